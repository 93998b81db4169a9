"""torch DCP's file names, once: what `dcp.save` writes in a checkpoint directory.

Example:
    >>> DATA_FILE_PATTERN.match("__3_0.distcp").group(1)   # the rank that wrote it
    '3'
"""

from __future__ import annotations

import re

METADATA_FILENAME = ".metadata"  # torch/distributed/checkpoint/filesystem.py `_metadata_fn`
RANK_METADATA_PATTERN = re.compile(r"^__(\d+)\.metadata$")  # written when use_collectives=False
DATA_FILE_SUFFIX = ".distcp"  # torch/distributed/checkpoint/filesystem.py DEFAULT_SUFFIX
DATA_FILE_PATTERN = re.compile(r"^__(\d+)_(\d+)\.distcp$")  # `__{rank}_{n}.distcp`
