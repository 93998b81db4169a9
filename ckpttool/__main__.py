"""`python -m ckpttool` runs the command line (under torchrun: see `distributed.run_main`).

`distributed` (the torchrun protocol, with every writer it drives) is imported only when the
launcher set WORLD_SIZE: without it `distributed.environment()` is None, and `python -m ckpttool
inspect` costs what the `ckpttool` script costs.
"""

import os

from ckpttool.cli import main

if "WORLD_SIZE" not in os.environ:
    main()
else:
    from ckpttool.run import distributed

    if distributed.environment() is None:
        main()
    else:
        distributed.run_main(main)
