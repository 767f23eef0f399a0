import sys

from router.main import main

sys.exit(main())
