"""The safetensors layout, computed before any data is written.

A safetensors file is an 8-byte little-endian header length, a JSON header padded with spaces
to a multiple of 8, then every tensor's raw bytes back to back. Because the header depends
only on names, dtypes and shapes, we compute it (and each tensor's byte offset) from the plan
up front; the data can then be placed at its offset in any order, in parallel.

We order tensors exactly as safetensors' own `save_file` does (by dtype, widest first, then
by name), so for the same tensors our file is byte-identical to `save_file`'s.

Example:
    >>> layout = layout_file([("w", "float32", (2, 2))], {"format": "pt"})
    >>> layout.offsets["w"], len(layout.header) % 8
    (104, 0)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

from ckpttool import dtypes
from ckpttool.errors import UsageError

SUFFIX = ".safetensors"
METADATA = {"format": "pt"}  # what transformers and huggingface_hub write and check for
HEADER_ALIGNMENT = 8  # safetensors pads the header with spaces to this (format spec)

# The order of safetensors' Rust `Dtype` enum; `save_file` sorts tensors by it, descending
# (safetensors/src/tensor.rs `prepare`), then by name. Measured with safetensors 0.8.
DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_RANK = {name: rank for rank, name in enumerate(DTYPE_ORDER)}


@dataclass(frozen=True)
class FileLayout:
    """Where everything goes in one safetensors file."""

    header: bytes  # the 8-byte length plus the padded JSON
    offsets: dict[str, int]  # key -> absolute byte offset of its data in the file
    size: int  # total file size


def safetensors_dtype(dtype: str) -> str:
    """Return safetensors' code for a torch dtype name (`float32` -> `F32`)."""
    try:
        return dtypes.SAFETENSORS_NAME[dtype]
    except KeyError:
        raise UsageError(f"safetensors cannot store dtype {dtype}; write .pt instead") from None


def layout_file(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] = METADATA
) -> FileLayout:
    """Return the header and data offsets for `(key, dtype, shape)` tensors.

    Keys are ordered like safetensors' `save_file`: widest dtype first, then by name.
    """
    ordered = sorted(
        ((key, safetensors_dtype(dtype), tuple(shape), dtypes.ITEMSIZE[dtype]) for key, dtype, shape in tensors),
        key=lambda item: (-_RANK[item[1]], item[0]),
    )
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    relative: dict[str, int] = {}
    at = 0
    for key, code, shape, itemsize in ordered:
        nbytes = itemsize
        for size in shape:
            nbytes *= size
        entries[key] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        relative[key] = at
        at += nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    header = struct.pack("<Q", len(text)) + text
    start = len(header)
    return FileLayout(header, {key: start + offset for key, offset in relative.items()}, start + at)
