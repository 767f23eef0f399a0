import sys

from cluster.worker_main import main

sys.exit(main("decode"))
