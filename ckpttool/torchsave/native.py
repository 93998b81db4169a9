"""torchsave's optional C module (`_records.c`, built by setup.py with zlib): records built
end to end, their source spans, record headers compared a block at a time, and `.metadata`'s
chunk and storage rows encoded from their columns (`encode_rows`). `records` is
None when it was not built (no compiler); every caller then runs its Python code, which
gives the same results (tests set `records` to None to compare the two)."""

from __future__ import annotations

import importlib
from typing import Any


def _load() -> Any:
    try:
        return importlib.import_module("ckpttool.torchsave._records")
    except ImportError:
        return None


records: Any = _load()
