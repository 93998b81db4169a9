"""Write DCP checkpoints that stock torch loads: `.distcp` blobs and the `.metadata` pickle.

A blob is a `torch.save` record of one tensor chunk: an uncompressed zip holding `data.pkl`
(the tensor's rebuild recipe), a few small version records and `data/0` (the raw row-major
bytes). We lay the record out byte for byte as torch's `PyTorchStreamWriter` (miniz) does,
so the raw bytes can stream straight from the source checkpoint into `data/0` without being
decoded, and only the CRC-32 (computed while they stream) completes the record:

    head = layout.head                      # everything before data/0's bytes
    write_at(fd, head, offset)
    ... stream `layout.data_length` bytes to offset + len(head), computing crc ...
    write_at(fd, layout.tail(crc), offset + len(head) + layout.data_length)

`write_metadata` pickles torch's own `Metadata` dataclasses (this module is the one place
besides the reader that touches torch's checkpoint classes), the way `FileSystemWriter.finish`
does.

Example:
    >>> layout = record_layout("float32", (5, 8))
    >>> layout.length, len(layout.head), layout.data_length
    (1705, 704, 160)
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ckpttool import dtypes
from ckpttool.dcp.blobs import contiguous_strides

# torch.save names its records `archive/...` when it writes to a stream (torch/serialization.py)
RECORD_ARCHIVE = "archive"
# caffe2/serialize/inline_container.h kFieldAlignment; torch.save's `.storage_alignment` record
ALIGNMENT = 64
FORMAT_VERSION = b"1"  # torch/serialization.py `_save`: ".format_version"
FILE_FORMAT_VERSION = b"3\n"  # inline_container.h kProducedFileFormatVersion, as torch.save writes it
PICKLE_PROTOCOL = 2  # torch.save's DEFAULT_PROTOCOL
_UINT32_MAX = 0xFFFFFFFF
_UTF8_AND_DESCRIPTOR = 0x0808  # general purpose flags miniz sets: data descriptor + UTF-8 names
_UTF8 = 0x0800  # miniz writes an empty entry without a data descriptor
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 0x002D  # miniz's zip64 end record


# ---------------------------------------------------------------------------------------------
# data.pkl: the same pickle torch.save writes for a contiguous tensor


class _Storage:
    """Stands for the tensor's storage while pickling; becomes torch's persistent id."""

    def __init__(self, storage_class: object, numel: int):
        self.storage_class = storage_class
        self.numel = numel


class _Rebuild:
    def __init__(self, function: object, args: tuple):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: object):
        if isinstance(obj, _Storage):
            # torch/serialization.py `_save.persistent_id`
            return ("storage", obj.storage_class, "0", "cpu", obj.numel)
        return None


@functools.lru_cache(maxsize=4096)
def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """Return the `data.pkl` torch.save writes for a contiguous CPU tensor of this dtype/shape.

    Legacy dtypes use `_rebuild_tensor_v2` with a typed storage class (`torch.FloatStorage`);
    newer ones (float8, uint16, ...) `_rebuild_tensor_v3` with `UntypedStorage` and the dtype,
    as `torch.Tensor._reduce_ex_internal` does.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    stride = contiguous_strides(shape)
    numel = 1
    for size in shape:
        numel *= size
    hooks = OrderedDict()
    if torch_dtype in torch.storage._new_dtypes():
        storage = _Storage(torch.UntypedStorage, numel * dtypes.ITEMSIZE[dtype])
        args = (storage, 0, tuple(shape), stride, False, hooks, torch_dtype)
        rebuild = _Rebuild(torch._utils._rebuild_tensor_v3, args)
    else:
        storage_class = getattr(torch, torch.storage._dtype_to_storage_type_map()[torch_dtype])
        args = (_Storage(storage_class, numel), 0, tuple(shape), stride, False, hooks)
        rebuild = _Rebuild(torch._utils._rebuild_tensor_v2, args)
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=PICKLE_PROTOCOL).dump(rebuild)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The zip record, laid out as PyTorchStreamWriter + miniz write it


@dataclass(frozen=True)
class _Entry:
    name: bytes
    local_offset: int
    size: int
    crc32: int

    @property
    def flags(self) -> int:
        return _UTF8_AND_DESCRIPTOR if self.size else _UTF8


def _zip64_extra(size: int | None, local_offset: int | None) -> bytes:
    values = []
    if size is not None:
        values += [size, size]  # uncompressed, compressed
    if local_offset is not None:
        values.append(local_offset)
    return struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)


class _RecordWriter:
    """Builds a torch.save zip record in pieces: entries are appended at a running cursor."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.cursor = 0
        self.entries: list[_Entry] = []

    def local_header(self, name: bytes, size: int) -> None:
        """Append the local header of entry `name`, padded so its data starts aligned
        (caffe2/serialize/inline_container.cc `getPadding`)."""
        big_size, big_offset = size >= _UINT32_MAX, self.cursor >= _UINT32_MAX
        zip64 = b""
        if big_size or big_offset:
            zip64 = _zip64_extra(size if big_size else None, self.cursor if big_offset else None)
        start = self.cursor + 30 + len(name) + len(zip64) + 4
        padding = -start % ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        entry = _Entry(name, self.cursor, size, 0)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, entry.flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
        self.entries.append(entry)
        self._emit(header + name + extra)

    def descriptor(self, crc32: int) -> None:
        """Append the data descriptor that follows an entry's data, and record its CRC-32."""
        entry = self.entries[-1]
        self.entries[-1] = _Entry(entry.name, entry.local_offset, entry.size, crc32)
        if entry.size == 0:
            return
        if entry.size >= _UINT32_MAX or entry.local_offset >= _UINT32_MAX:
            self._emit(struct.pack("<IIQQ", 0x08074B50, crc32, entry.size, entry.size))
        else:
            self._emit(struct.pack("<IIII", 0x08074B50, crc32, entry.size, entry.size))

    def record(self, name: str, data: bytes) -> None:
        full = f"{RECORD_ARCHIVE}/{name}".encode()
        self.local_header(full, len(data))
        self._emit(data)
        self.descriptor(zlib.crc32(data))

    def skip(self, length: int) -> None:
        """Advance over bytes written elsewhere (the streamed tensor data)."""
        self.cursor += length

    def finish(self) -> None:
        """Append the central directory and the zip64 + classic end records."""
        directory_start = self.cursor
        for entry in self.entries:
            big_size, big_offset = entry.size >= _UINT32_MAX, entry.local_offset >= _UINT32_MAX
            extra = b""
            if big_size or big_offset:
                extra = _zip64_extra(entry.size if big_size else None, entry.local_offset if big_offset else None)
            size32 = min(entry.size, _UINT32_MAX)
            self._emit(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, entry.flags, 0, 0, 0,
                    entry.crc32, size32, size32, len(entry.name), len(extra), 0, 0, 0, 0,
                    min(entry.local_offset, _UINT32_MAX),
                )
                + entry.name
                + extra
            )
        directory_size = self.cursor - directory_start
        count = len(self.entries)
        end64_offset = self.cursor
        self._emit(
            struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, _ZIP64_MADE_BY, _ZIP64_NEEDED, 0, 0,
                count, count, directory_size, directory_start,
            )
        )
        self._emit(struct.pack("<IIQI", 0x07064B50, 0, end64_offset, 1))
        self._emit(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                min(directory_size, _UINT32_MAX), min(directory_start, _UINT32_MAX), 0,
            )
        )

    def _emit(self, data: bytes) -> None:
        self.out += data
        self.cursor += len(data)


def _hash_combine(seed: int, value: int) -> int:
    # c10/util/hash.h hash_combine, on uint64
    return (seed ^ (value + 0x9E3779B9 + ((seed << 6) & 0xFFFFFFFFFFFFFFFF) + (seed >> 2))) & 0xFFFFFFFFFFFFFFFF


@functools.lru_cache(maxsize=1)
def _record_name_hash() -> bytes:
    """The first half of torch's serialization id: a hash of the record names (std::hash, so
    platform-specific), the same for every single-tensor record. Taken from torch itself."""
    import torch

    buffer = io.BytesIO()
    torch.save(torch.zeros(0), buffer)
    data = buffer.getvalue()
    marker = f"{RECORD_ARCHIVE}/.data/serialization_id".encode()
    at = data.index(marker) + len(marker)
    (extra_length,) = struct.unpack_from("<H", data, at - len(marker) - 2)
    return data[at + extra_length:at + extra_length + 20]


def _serialization_id(crcs: Sequence[int]) -> bytes:
    # inline_container.cc writeSerializationId: name hash, then the combined CRC-32s of the
    # records in write order, each zero-padded to 20 digits
    combined = 0
    for crc in crcs:
        combined = _hash_combine(combined, crc)
    return _record_name_hash() + b"%020d" % combined


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one tensor chunk's torch.save record: `head`, data, then `tail(crc)`."""

    dtype: str
    shape: tuple[int, ...]
    head: bytes
    data_length: int
    tail_length: int

    @property
    def length(self) -> int:
        return len(self.head) + self.data_length + self.tail_length

    @property
    def data_offset(self) -> int:
        """Where `data/0`'s bytes start, relative to the record."""
        return len(self.head)

    def tail(self, crc32: int) -> bytes:
        """Return the bytes after the data, given the CRC-32 of the data."""
        return _build(self.dtype, self.shape, crc32)[1]


def _build(dtype: str, shape: tuple[int, ...], crc32: int) -> tuple[bytes, bytes, int]:
    data_length = dtypes.ITEMSIZE[dtype]
    for size in shape:
        data_length *= size
    writer = _RecordWriter()
    # torch/serialization.py `_save` record order
    writer.record("data.pkl", tensor_pickle(dtype, shape))
    writer.record(".format_version", FORMAT_VERSION)
    writer.record(".storage_alignment", str(ALIGNMENT).encode())
    writer.record("byteorder", sys.byteorder.encode())
    writer.local_header(f"{RECORD_ARCHIVE}/data/0".encode(), data_length)
    head = bytes(writer.out)
    writer.out = bytearray()
    writer.skip(data_length)
    writer.descriptor(crc32)
    writer.record("version", FILE_FORMAT_VERSION)
    # torch combines the CRC-32 of non-empty records only
    crcs = [entry.crc32 for entry in writer.entries if entry.size]
    writer.record(".data/serialization_id", _serialization_id(crcs))
    writer.finish()
    return head, bytes(writer.out), data_length


@functools.lru_cache(maxsize=4096)
def record_layout(dtype: str, shape: tuple[int, ...]) -> RecordLayout:
    """Return the layout of the torch.save record of a contiguous `dtype` tensor of `shape`.

    Example:
        >>> record_layout("float32", (5, 8)).length   # as torch.save(torch.empty(5, 8))
        1705
    """
    if sys.byteorder != "little":
        raise NotImplementedError("writing checkpoints on a big-endian host is not supported")
    head, tail, data_length = _build(dtype, tuple(shape), 0)
    return RecordLayout(dtype, tuple(shape), head, data_length, len(tail))


def record_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """Return a whole torch.save record holding `data` (small tensors, tests)."""
    layout = record_layout(dtype, tuple(shape))
    if len(data) != layout.data_length:
        raise ValueError(f"{len(data)} bytes given for a {dtype} tensor of shape {list(shape)}")
    return layout.head + data + layout.tail(zlib.crc32(data))


# ---------------------------------------------------------------------------------------------
# .metadata


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as it will be recorded: its box and where its blob is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoredTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[StoredChunk, ...]


@dataclass(frozen=True)
class StoredObject:
    fqn: str
    file: str
    offset: int
    length: int


def metadata_bytes(
    tensors: Iterable[StoredTensor],
    objects: Iterable[StoredObject],
    planner_data: Mapping[str, tuple],
    checkpoint_id: Path | None,
    save_id: str,
) -> bytes:
    """Return the `.metadata` pickle FileSystemWriter.finish would write for these entries.

    `planner_data` is the default planner's fqn -> key path mapping (torch's loader uses it
    to nest the flat entries back into the state dict); `version` is the installed torch's
    `CURRENT_DCP_VERSION`, since the blobs are written as that torch writes them.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata: dict = {}
    storage_data: dict = {}
    for tensor in tensors:
        chunks = []
        for index, chunk in enumerate(tensor.chunks):
            chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
            key = MetadataIndex(tensor.fqn, chunk.offsets, index)
            storage_data[key] = _StorageInfo(chunk.file, chunk.offset, chunk.length)
        properties = TensorProperties(dtype=getattr(torch, tensor.dtype))
        state_dict_metadata[tensor.fqn] = TensorStorageMetadata(properties, torch.Size(tensor.shape), chunks)
    for obj in objects:
        state_dict_metadata[obj.fqn] = BytesStorageMetadata()
        storage_data[MetadataIndex(obj.fqn)] = _StorageInfo(obj.file, obj.offset, obj.length)
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=dict(planner_data),
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )
    return pickle.dumps(metadata)


def data_file_name(rank: int) -> str:
    """Return torch's name for rank `rank`'s data file (FileSystemWriter: `__{rank}_{n}.distcp`)."""
    return f"__{rank}_0.distcp"

