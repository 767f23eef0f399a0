import sys

from decode_worker.main import main

sys.exit(main())
