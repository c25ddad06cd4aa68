import sys

from tauflow.rollout.app import main

sys.exit(main(sys.argv[1:]))
