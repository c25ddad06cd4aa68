import sys

from tauflow.controller.app import main

sys.exit(main(sys.argv[1:]))
