"""A torch.save archive laid out for writing: its entries, their order, and data.pkl's tensors.

torch.save (torch/serialization.py `_save`) writes a zip whose entries sit in one folder:
`data.pkl` (the pickled value; each tensor names a storage by key), `.format_version`,
`.storage_alignment`, `byteorder`, one `data/<key>` per storage (raw bytes, 64-byte aligned),
`version` and `.data/serialization_id`. We write the same entries in the same order. The
storages' bytes are the caller's to write (streamed or copied into place); everything else
comes from `lay_out` and `writes` once the storages' CRC-32s are known.

Example:
    >>> layout = lay_out(b"\x80\x02N.", [16])   # data.pkl (here: None), one 16-byte storage
    >>> layout.storages[0].data_offset, layout.length
    (576, 1449)
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from ckpttool.core import dtypes
from ckpttool.core.errors import UnsupportedFormat
from ckpttool.torchsave.pickle import Global, PersistentId, Reduce
from ckpttool.torchsave.zip import ALIGNMENT, Placed, descriptor, directory, directory_length, place

ARCHIVE = "archive"  # the folder name torch.save uses when it writes to a stream; any name loads
# torch/serialization.py `_save`: the small records before and after the storages
HEAD_RECORDS = ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()), ("byteorder", b"little"))
VERSION_RECORD = ("version", b"3\n")  # caffe2 inline_container.h kProducedFileFormatVersion
SERIALIZATION_ID = ".data/serialization_id"  # 40 digits; torch only logs it, any value loads
SERIALIZATION_ID_LENGTH = 40

# dtype -> the legacy typed storage class torch.save names for it (torch/storage.py
# `_dtype_to_storage_type_map`); newer dtypes (float8, uint16, ...) have none
LEGACY_STORAGE_CLASS: dict[str, str] = {dtype: name for name, dtype in dtypes.STORAGE_CLASS_DTYPE.items()}
_REBUILD_TENSOR_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_TENSOR_V3 = Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED_STORAGE = Global("torch.storage", "UntypedStorage")
_ORDERED_DICT = Global("collections", "OrderedDict")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Return row-major strides (in elements) for `shape`."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tensor(key: str, dtype: str, shape: tuple[int, ...]) -> Reduce:
    """Return the stand-in data.pkl holds for a contiguous CPU tensor stored as `data/<key>`.

    As `torch.Tensor._reduce_ex_internal`: `_rebuild_tensor_v2` with a typed storage class for
    dtypes that have one, `_rebuild_tensor_v3` with an UntypedStorage and the dtype for the
    others. The persistent id is torch.save's ("storage", class, key, location, size).
    """
    if dtype not in dtypes.ITEMSIZE:
        raise UnsupportedFormat(f"cannot write a tensor of dtype {dtype} (not one ckpttool knows)")
    shape = tuple(shape)
    numel = math.prod(shape)
    hooks = Reduce(_ORDERED_DICT, ())  # an empty OrderedDict of backward hooks
    storage_class = LEGACY_STORAGE_CLASS.get(dtype)
    if storage_class is None:
        storage = PersistentId(("storage", _UNTYPED_STORAGE, key, "cpu", numel * dtypes.ITEMSIZE[dtype]))
        args = (storage, 0, shape, contiguous_strides(shape), False, hooks, Global("torch", dtype))
        return Reduce(_REBUILD_TENSOR_V3, args)
    storage = PersistentId(("storage", Global("torch", storage_class), key, "cpu", numel))
    return Reduce(_REBUILD_TENSOR_V2, (storage, 0, shape, contiguous_strides(shape), False, hooks))


@dataclass(frozen=True)
class Layout:
    """Where every entry of one torch.save archive goes (offsets from the archive's start)."""

    entries: tuple[Placed, ...]  # in write order
    contents: tuple[bytes | None, ...]  # of each entry; None for storages and the serialization id
    storages: tuple[Placed, ...]  # data/0, data/1, ...
    length: int


def lay_out(pickled: bytes, storage_sizes: Sequence[int]) -> Layout:
    """Return the layout of an archive holding `pickled` as data.pkl and storages of these
    byte sizes as data/0, data/1, ..."""
    records: list[tuple[str, bytes | None, int]] = [("data.pkl", pickled, len(pickled))]
    records += [(short, data, len(data)) for short, data in HEAD_RECORDS]
    records += [(f"data/{key}", None, size) for key, size in enumerate(storage_sizes)]
    records += [(*VERSION_RECORD, len(VERSION_RECORD[1])), (SERIALIZATION_ID, None, SERIALIZATION_ID_LENGTH)]
    entries = tuple(place([(f"{ARCHIVE}/{short}", size) for short, _, size in records]))
    first = 1 + len(HEAD_RECORDS)
    storages = entries[first:first + len(storage_sizes)]
    length = entries[-1].end + directory_length(entries)
    return Layout(entries, tuple(data for _, data, _ in records), storages, length)


def writes(layout: Layout, storage_crcs: Sequence[int]) -> list[tuple[int, bytes]]:
    """Return (offset, bytes) for all of the archive but the storages' data: local headers,
    small records, data descriptors, the central directory and end records.

    Example:
        >>> layout = lay_out(b"pickle", [3])
        >>> parts = writes(layout, [zlib.crc32(b"abc")]) + [(layout.storages[0].data_offset, b"abc")]
        >>> sum(len(data) for _, data in parts) == layout.length
        True
    """
    crcs: list[int] = []
    storage_crc = iter(storage_crcs)
    parts: list[tuple[int, bytes]] = []
    for entry, data in zip(layout.entries, layout.contents):
        if entry is layout.entries[-1]:  # the serialization id
            data = serialization_id(crcs)
        if data is None:
            crc = next(storage_crc)
        else:
            crc = zlib.crc32(data)
            parts.append((entry.data_offset, data))
        crcs.append(crc)
        parts.append((entry.offset, entry.header))
        parts.append((entry.data_offset + entry.size, descriptor(entry, crc)))
    parts.append((layout.entries[-1].end, directory(layout.entries, crcs)))
    return sorted(parts, key=lambda part: part[0])


def serialization_id(crcs: Sequence[int]) -> bytes:
    """Return 40 digits that identify the archive: a digest of its entries' CRC-32s."""
    return serialization_id_of(struct.pack(f"<{len(crcs)}I", *crcs))


def serialization_id_of(packed_crcs: bytes) -> bytes:
    """`serialization_id` of the CRC-32s packed as little-endian uint32s (for callers that
    keep most of them packed: a record's tail is made 300k times in a reshard)."""
    return serialization_id_from(hashlib.blake2b(packed_crcs, digest_size=SERIALIZATION_DIGEST))


SERIALIZATION_DIGEST = 16  # bytes of blake2b digest behind the 40 digits


def serialization_id_from(digest: Any) -> bytes:
    """`serialization_id` from a blake2b object holding the packed CRC-32s: callers making many
    ids that share a prefix keep the prefix's object and `copy()` it (a third of the cost of a
    new one with its keyword arguments)."""
    return b"%040d" % int.from_bytes(digest.digest(), "little")


def tensor_bytes(value: Any) -> bytes:
    """Return a torch tensor's bytes, row-major (works for bf16 and float8 too): what its
    storage entry holds."""
    import torch

    flat = value.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def saved_value(pickled: bytes) -> bytes:
    """Return the bytes `torch.save(value, stream)` writes for a value without tensors, given
    its pickle (`torchsave.pickle.dumps(value)`): what DCP stores for a non-tensor entry.

    Example:
        >>> torch.load(io.BytesIO(saved_value(dumps(0.001))), weights_only=True)
        0.001
    """
    layout = lay_out(pickled, [])
    out = bytearray(layout.length)
    for offset, data in writes(layout, []):
        out[offset:offset + len(data)] = data
    return bytes(out)
