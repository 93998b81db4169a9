"""The safetensors format, in one place: reading a header with its limits, and the layout of a
file computed before any data is written.

A safetensors file is an 8-byte little-endian header length, a JSON header padded with spaces
to a multiple of 8, then every tensor's raw bytes back to back. `read_header` is the one
parser of that header (readers/safetensors.py for files, dcp/blobs.py for DCP's safetensors
blobs). Because the header depends only on names, dtypes and shapes, we compute it (and each
tensor's byte offset) from the plan up front; the data can then be placed at its offset in
any order, in parallel.

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
from typing import Any, Callable, Mapping, Sequence

from ckpttool.core import dtypes
from ckpttool.core.errors import UsageError

SUFFIX = ".safetensors"
METADATA = {"format": "pt"}  # what transformers and huggingface_hub write and check for
HEADER_ALIGNMENT = 8  # safetensors pads the header with spaces to this (format spec)
HEADER_LENGTH_BYTES = 8  # safetensors format spec: u64 little-endian header size
METADATA_KEY = "__metadata__"  # safetensors format spec: the optional str -> str map
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on header size

# The order of safetensors' Rust `Dtype` enum; `save_file` sorts tensors by it, descending
# (safetensors/src/tensor.rs `prepare`), then by name. Measured with safetensors 0.8.
DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_RANK = {name: rank for rank, name in enumerate(DTYPE_ORDER)}


class HeaderError(Exception):
    """Bytes that are not a safetensors header. `kind` says why: "short" (fewer bytes than the
    length field), "length" (the stated `length` is over MAX_HEADER_BYTES or past the end),
    "json" (not JSON: `error` is json's exception) or "not-object" (JSON, but not an object).
    Readers turn it into their own error, naming the file."""

    def __init__(self, kind: str, length: int = 0, error: Exception | None = None):
        super().__init__(kind)
        self.kind, self.length, self.error = kind, length, error


def read_header(read: Callable[[int, int], bytes], size: int | None = None) -> tuple[dict[str, Any], int]:
    """Return a safetensors header's JSON object and where the data section starts, reading
    with `read(offset, count)`; `size`, when known, is the bytes the file or blob holds.

    Raises HeaderError (see its kinds) before reading a header longer than MAX_HEADER_BYTES.

    Example:
        >>> data = open("model.safetensors", "rb").read()
        >>> header, data_start = read_header(lambda offset, count: data[offset:offset + count], len(data))
        >>> header["lm_head.weight"]["dtype"], data_start % HEADER_ALIGNMENT
        ('F32', 0)
    """
    if size is not None and size < HEADER_LENGTH_BYTES:
        raise HeaderError("short")
    (length,) = struct.unpack("<Q", read(0, HEADER_LENGTH_BYTES))
    if length > MAX_HEADER_BYTES or (size is not None and HEADER_LENGTH_BYTES + length > size):
        raise HeaderError("length", length)
    raw = read(HEADER_LENGTH_BYTES, length)
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise HeaderError("json", length, error) from None
    if not isinstance(document, dict):
        raise HeaderError("not-object", length)
    return document, HEADER_LENGTH_BYTES + length


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
    entries: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
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
