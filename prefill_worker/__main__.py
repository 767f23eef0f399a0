import sys

from kvrelay.prefill_worker.main import main

sys.exit(main())
