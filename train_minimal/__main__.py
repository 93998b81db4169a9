"""`python -m train_minimal ...`: see train_minimal/launch.py."""

from train_minimal.launch import exit_now, main

if __name__ == "__main__":
    exit_now(main())
