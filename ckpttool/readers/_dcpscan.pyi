# Type stub of the optional C reader of DCP `.metadata` (_dcpscan.c, built by setup.py when a compiler is there).
from typing import Any

def scan(data: Any, dtypes: Any, where: bool = ..., mapped: bool = ...) -> tuple[Any, ...] | None:
    """Columns of a DCP .metadata pickle as torch writes it (see _dcpscan.c), or None: read it with safepickle."""

def json_rows(rows: int, ndim: int, offsets: Any, sizes: Any, file: Any, offset: Any, length: Any, nbytes: Any,
              files: tuple[bytes, ...]) -> bytes:
    """The JSON of inspect's chunk rows from int64 columns, each row followed by `, ` (see _dcpscan.c)."""
