import sys

from tauflow.weights.app import main

sys.exit(main())
