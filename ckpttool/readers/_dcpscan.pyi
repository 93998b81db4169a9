# Type stub of the optional C reader of DCP `.metadata` (_dcpscan.c, built by setup.py when a compiler is there).
from typing import Any

def scan(data: Any, dtypes: Any, where: bool = ..., mapped: bool = ...) -> tuple[Any, ...] | None:
    """Columns of a DCP .metadata pickle as torch writes it (see _dcpscan.c), or None: read it with safepickle."""

def json_rows(rows: int, ndim: int, offsets: Any, sizes: Any, file: Any, offset: Any, length: Any, nbytes: Any,
              files: tuple[bytes, ...], last: bool = ...) -> bytes:
    """The JSON of inspect's chunk rows from int64 columns in any strides, each row followed by `, `
    but the last when `last` (see _dcpscan.c)."""

def file_sums(rows: int, file: Any, length: Any, nbytes: Any, bins: Any, group: int, counts: Any, lengths: Any,
              totals: Any) -> bool:
    """Add each row's count, length and nbytes to bin `bins[file] + group` in place; False when a sum passed int64."""
