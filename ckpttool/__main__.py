"""`python -m ckpttool` runs the command line."""

from ckpttool.cli import main

main()
