"""`python -m ckpttool` runs the command line (under torchrun: see `distributed.run_main`)."""

from ckpttool import distributed
from ckpttool.cli import main

if distributed.environment() is None:
    main()
else:
    distributed.run_main(main)
