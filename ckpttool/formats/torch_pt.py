"""A `torch.save` file laid out up front, so tensor bytes can be copied into place.

`torch.save` writes an uncompressed zip: `<archive>/data.pkl` (the pickled structure, whose
tensors refer to storages by key), one `<archive>/data/<key>` entry per storage holding its raw
bytes at a 64-byte aligned offset, and a few small records. We write the same zip ourselves:
the pickle is made first (it needs only names, dtypes and shapes), then every entry's offset
is known, tensor bytes are copied to their offsets like safetensors data, and the zip headers
(which carry each entry's CRC-32) are written last. The result loads with
`torch.load(weights_only=True)` and memory never holds more than the buffers of the copies.

Example:
    >>> pickled = pickle_state([(("w",), "float32", (2, 2))], objects=[])
    >>> layout = layout_zip(pickled, [16])
    >>> layout.data_offsets[0] % 64
    0
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ckpttool import dtypes
from ckpttool.errors import UnsupportedFormat

SUFFIXES = (".pt", ".bin", ".pth")
ARCHIVE = "archive"  # torch.save names it after the file stem; torch.load accepts any name
STORAGE_ALIGNMENT = 64  # torch/serialization.py: storages start at 64-byte aligned offsets
PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
ZIP64_LIMIT = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_EOCD64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
PADDING_TAG = 0x4246  # "FB": the padding extra field torch's writer uses
ZIP64_TAG = 0x0001
UTF8_FLAG = 0x0800


# ---------------------------------------------------------------------------------------------
# The pickle


class _StorageRef:
    def __init__(self, key: str, dtype: str, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as torch.save pickles a contiguous CPU tensor: `_rebuild_tensor_v2(...)`."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        import torch

        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, tuple(self.shape), _strides(self.shape), False, collections.OrderedDict()),
        )


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_class(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def _storage_class(dtype: str) -> Any:
    import torch

    name = torch.storage._dtype_to_storage_type_map().get(getattr(torch, dtype, None))
    if name is None:
        raise UnsupportedFormat(f"this writer cannot store dtype {dtype} in a .pt; write .safetensors")
    return getattr(torch, name)


@dataclass(frozen=True)
class PickledState:
    """data.pkl, and the raw bytes of tensors found inside python objects (stored inline)."""

    data: bytes
    inline: tuple[bytes, ...]  # storages numbered after the planned tensors


def pickle_state(
    tensors: Sequence[tuple[tuple, str, tuple[int, ...]]],
    objects: Sequence[tuple[tuple, Any]],
) -> PickledState:
    """Return data.pkl for a nested dict: `tensors` are (path, dtype, shape), stored as
    storages "0", "1", ... in order; `objects` are (path, python value).

    A path is the tuple of keys (int keys make lists, as DCP's planner_data says). Without
    python objects the pickle is written directly (no torch import, which costs ~1.7 s).
    """
    if not objects and all(dtype in _STORAGE_CLASS for _, dtype, _ in tensors):
        root = _Node()
        for position, (path, dtype, shape) in enumerate(tensors):
            _place(root, path, _TensorRef(_StorageRef(str(position), dtype, _numel(shape)), shape))
        return PickledState(b"\x80\x02" + b"".join(_opcodes(_lists(root))) + b".", ())
    import torch

    root = _Node()
    inline: list[bytes] = []
    for position, (path, dtype, shape) in enumerate(tensors):
        _place(root, path, _TensorRef(_StorageRef(str(position), dtype, _numel(shape)), shape))

    def replace_tensors(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            from ckpttool.dcp.blobs import tensor_bytes

            key = str(len(tensors) + len(inline))
            inline.append(tensor_bytes(value))
            dtype = str(value.dtype).removeprefix("torch.")
            return _TensorRef(_StorageRef(key, dtype, value.numel()), tuple(value.shape))
        if isinstance(value, dict):
            return type(value)((k, replace_tensors(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(replace_tensors(v) for v in value)
        return value

    for path, value in objects:
        _place(root, path, replace_tensors(value))
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PICKLE_PROTOCOL).dump(_lists(root))
    return PickledState(buffer.getvalue(), tuple(inline))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# dtype -> the legacy storage class torch.save names for it (torch/storage.py)
_STORAGE_CLASS = {dtype: name for name, dtype in dtypes.STORAGE_CLASS_DTYPE.items()}


def _opcodes(value: Any) -> Iterator[bytes]:
    """Yield protocol-2 pickle opcodes for the nested dict/list of tensor references that
    torch.save would pickle for the same tensors (no memo: loading needs none)."""
    if isinstance(value, _TensorRef):
        storage = value.storage
        yield b"ctorch._utils\n_rebuild_tensor_v2\n("
        yield b"(" + _string("storage") + f"ctorch\n{_STORAGE_CLASS[storage.dtype]}\n".encode()
        yield _string(storage.key) + _string("cpu") + _integer(storage.numel) + b"tQ"
        yield _integer(0)
        for numbers in (tuple(value.shape), _strides(value.shape)):
            yield b"(" + b"".join(_integer(n) for n in numbers) + b"t"
        yield b"\x89ccollections\nOrderedDict\n)RtR"
    elif isinstance(value, dict):
        yield b"}"
        if value:
            yield b"("
            for key, item in value.items():
                yield _string(key) if isinstance(key, str) else _integer(key)
                yield from _opcodes(item)
            yield b"u"
    elif isinstance(value, list):
        yield b"]"
        if value:
            yield b"("
            for item in value:
                yield from _opcodes(item)
            yield b"e"
    else:
        raise TypeError(f"cannot pickle {type(value).__name__} here")


def _string(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _integer(number: int) -> bytes:
    if 0 <= number < 256:
        return b"K" + bytes([number])
    if 0 <= number < 65536:
        return b"M" + struct.pack("<H", number)
    if -(2**31) <= number < 2**31:
        return b"J" + struct.pack("<i", number)
    data = pickle.encode_long(number)
    return b"\x8a" + bytes([len(data)]) + data


class _Node(dict):
    """A dict made from a path; python objects from the checkpoint are never one."""


def _place(root: dict, path: tuple, value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, _Node())
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    """Turn path dicts whose keys are exactly 0..n-1 (DCP's list positions) into lists, as
    torch's `unflatten_state_dict` does; values stored at a path stay as they are."""
    if type(node) is not _Node:
        return node
    converted = {key: _lists(value) for key, value in node.items()}
    keys = list(converted)
    if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return [converted[k] for k in range(len(keys))]
    return converted


# ---------------------------------------------------------------------------------------------
# The zip


@dataclass(frozen=True)
class ZipEntry:
    name: str
    header_offset: int  # local header
    data_offset: int
    size: int
    local_extra: bytes  # zip64 sizes and alignment padding


@dataclass(frozen=True)
class ZipLayout:
    entries: tuple[ZipEntry, ...]
    small: dict[str, bytes]  # entries written from memory: data.pkl, version, ...
    data_offsets: tuple[int, ...]  # of storage "0", "1", ...
    central_offset: int
    size: int


def layout_zip(pickled: PickledState, storage_sizes: Sequence[int]) -> ZipLayout:
    """Return where every zip entry goes, for planned storages of these byte sizes (in key
    order) followed by the pickled state's inline storages."""
    digest = hashlib.sha256(pickled.data + repr(list(storage_sizes)).encode()).hexdigest()
    serialization_id = str(int(digest, 16))[:40].rjust(40, "0")
    sizes = list(storage_sizes) + [len(data) for data in pickled.inline]
    names: list[tuple[str, int]] = [
        ("data.pkl", len(pickled.data)),
        (".format_version", 1),
        (".storage_alignment", 2),
        ("byteorder", 6),
    ]
    names += [(f"data/{key}", size) for key, size in enumerate(sizes)]
    names += [("version", 2), (".data/serialization_id", 40)]
    small = {
        "data.pkl": pickled.data,
        ".format_version": b"1",
        ".storage_alignment": str(STORAGE_ALIGNMENT).encode(),
        "byteorder": b"little",
        "version": b"3\n",
        ".data/serialization_id": serialization_id.encode(),
    }
    for key, data in enumerate(pickled.inline, start=len(storage_sizes)):
        small[f"data/{key}"] = data
    entries = []
    at = 0
    for short, size in names:
        name = f"{ARCHIVE}/{short}"
        extra = struct.pack("<HHQQ", ZIP64_TAG, 16, size, size) if size >= ZIP64_LIMIT else b""
        start = at + _LOCAL.size + len(name.encode()) + len(extra)
        pad = -start % STORAGE_ALIGNMENT
        if pad:
            pad += STORAGE_ALIGNMENT if pad < 4 else 0
            extra += struct.pack("<HH", PADDING_TAG, pad - 4) + b"Z" * (pad - 4)
        entries.append(ZipEntry(name, at, start + pad, size, extra))
        at = start + pad + size
    central = sum(_CENTRAL.size + len(e.name.encode()) + len(_central_extra(e)) for e in entries)
    size = at + central + _EOCD64.size + _EOCD64_LOCATOR.size + _EOCD.size
    first_storage = 4
    data_offsets = tuple(e.data_offset for e in entries[first_storage:first_storage + len(storage_sizes)])
    return ZipLayout(tuple(entries), {f"{ARCHIVE}/{k}": v for k, v in small.items()}, data_offsets, at, size)


def _central_extra(entry: ZipEntry) -> bytes:
    values = []
    if entry.size >= ZIP64_LIMIT:
        values += [entry.size, entry.size]
    if entry.header_offset >= ZIP64_LIMIT:
        values.append(entry.header_offset)
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", ZIP64_TAG, 8 * len(values), *values)


def zip_records(layout: ZipLayout, crcs: dict[str, int]) -> list[tuple[int, bytes]]:
    """Return (offset, bytes) of every local header, small entry and the central directory,
    given the CRC-32 of each entry's data by name (small entries are computed here)."""
    import zlib

    writes: list[tuple[int, bytes]] = []
    central = bytearray()
    for entry in layout.entries:
        name = entry.name.encode()
        data = layout.small.get(entry.name)
        crc = zlib.crc32(data) if data is not None else crcs[entry.name]
        size32 = min(entry.size, ZIP64_LIMIT)
        version = 45 if entry.size >= ZIP64_LIMIT or entry.header_offset >= ZIP64_LIMIT else 20
        local = _LOCAL.pack(0x04034B50, version, UTF8_FLAG, 0, 0, 0, crc, size32, size32, len(name), len(entry.local_extra))
        writes.append((entry.header_offset, local + name + entry.local_extra))
        if data is not None:
            writes.append((entry.data_offset, data))
        extra = _central_extra(entry)
        central += _CENTRAL.pack(
            0x02014B50, version, version, UTF8_FLAG, 0, 0, 0, crc, size32, size32, len(name), len(extra),
            0, 0, 0, 0, min(entry.header_offset, ZIP64_LIMIT),
        ) + name + extra
    count = len(layout.entries)
    eocd64_offset = layout.central_offset + len(central)
    central += _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, count, count, eocd64_offset - layout.central_offset, layout.central_offset)
    central += _EOCD64_LOCATOR.pack(0x07064B50, 0, eocd64_offset, 1)
    central += _EOCD.pack(
        0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
        min(eocd64_offset - layout.central_offset, ZIP64_LIMIT), min(layout.central_offset, ZIP64_LIMIT), 0,
    )
    writes.append((layout.central_offset, bytes(central)))
    return writes


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """Return the CRC-32 of `a + b` from crc32(a), crc32(b) and len(b) (zlib's crc32_combine),
    so a tensor's CRC follows from the CRCs torch.save stored for its chunks."""
    if length2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if length2 & 1:
            crc1 = _gf2_times(even, crc1)
        length2 >>= 1
        if not length2:
            break
        odd = _gf2_square(even)
        if length2 & 1:
            crc1 = _gf2_times(odd, crc1)
        length2 >>= 1
        if not length2:
            break
    return crc1 ^ crc2


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]
