import sys

from tauflow.trainer.app import main

sys.exit(main())
