import sys

from tauflow.reward.app import main

sys.exit(main(sys.argv[1:]))
