import sys

from tauflow.queue.app import main

sys.exit(main(sys.argv[1:]))
