import sys

from kvrelay.cli.main import main

sys.exit(main())
