import sys

from kvrelay.router.main import main

sys.exit(main())
