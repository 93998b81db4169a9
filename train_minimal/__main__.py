"""`python -m train_minimal ...`: see train_minimal/launch.py."""

import sys

from train_minimal.launch import main

if __name__ == "__main__":
    sys.exit(main())
