import sys

from kvrelay.decode_worker.main import main

sys.exit(main())
