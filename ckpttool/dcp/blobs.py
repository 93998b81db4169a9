"""Find and decode the bytes of one blob inside a `.distcp` data file.

A DCP data file is a concatenation of blobs. With torch's default writer each tensor chunk is
one `torch.save` record: an uncompressed zip whose `data/<key>` entry holds the chunk's raw
row-major bytes. We parse the zip's central directory and the record's `data.pkl` (through an
allowlist, never executing it) to learn where those raw bytes are, so they can be copied as
they are. With `serialization_format=SAFETENSORS` the tensors of a file sit in one safetensors
blob at its end; blobs may also be zstd-compressed (`stream.zstd/1` transform).

Example:
    >>> with DataFiles(ckpt.path) as files:
    ...     raw = locate(files, tensor, tensor.chunks[0])      # RawData(file, offset, length)
    ...     data = read_chunk(files, tensor, tensor.chunks[0])  # bytes, decoded if needed
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ckpttool import dtypes
from ckpttool.dcp.metadata import Blob, Chunk, RestrictedUnpickler, Tensor
from ckpttool.errors import CheckpointError, CorruptBlob, CorruptMetadata, MissingFile, UnsupportedFormat

ZSTD_TRANSFORM = "stream.zstd"  # torch/distributed/checkpoint/_extension.py ZStandard.registry_name
ZIP_LOCAL_MAGIC = b"PK\x03\x04"
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_EOCD64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on header size
_ZIP_UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040  # encrypted, compressed patch, strong encryption (miniz)
MAX_PICKLE_BYTES = 64 << 20  # a torch.save data.pkl for one tensor is a few hundred bytes


# ---------------------------------------------------------------------------------------------
# Opening data files safely


def safe_relative_path(relative: str, source: str = "") -> PurePosixPath:
    """Return `relative` as a path inside the checkpoint, or raise if it escapes it."""
    path = PurePosixPath(relative.replace("\\", "/"))
    if not relative or path.is_absolute() or ".." in path.parts or relative.startswith(("/", "\\")):
        raise CorruptMetadata(
            f"{source}data file path {relative!r} is absolute or leaves the checkpoint "
            "directory; refusing to read it"
        )
    if len(relative) > 1 and relative[1] == ":":
        raise CorruptMetadata(f"{source}data file path {relative!r} is a drive path; refusing it")
    return path


class DataFiles:
    """Open data files of one checkpoint by relative path; positional reads, thread-safe."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "DataFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def path(self, relative: str) -> Path:
        return self.root / safe_relative_path(relative)

    def fd(self, relative: str) -> int:
        with self._lock:
            fd = self._fds.get(relative)
            if fd is None:
                path = self.path(relative)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise MissingFile(
                        f"{path}: referenced by the metadata but missing (was the save "
                        "interrupted or the directory copied partially? run `ckpttool validate`)"
                    ) from None
                except OSError as error:
                    raise CorruptBlob(f"{path}: cannot open data file ({error.strerror or error})") from None
                self._fds[relative] = fd
                self._sizes[relative] = os.fstat(fd).st_size
            return fd

    def size(self, relative: str) -> int:
        self.fd(relative)
        return self._sizes[relative]

    def _checked_fd(self, relative: str, offset: int, length: int) -> int:
        fd = self.fd(relative)
        if offset < 0 or length < 0 or offset + length > self._sizes[relative]:
            raise CorruptBlob(
                f"{self.path(relative)}: byte range {offset}..{offset + length} is beyond the "
                f"file's {self._sizes[relative]} bytes (truncated file?)"
            )
        return fd

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        """Fill all of `buffer` with the bytes at `offset`, or raise CorruptBlob naming the file.

        For streaming: a caller that reuses one buffer per thread allocates nothing per block
        (fresh multi-MiB `bytes` per block fragment the allocator's per-thread arenas).
        """
        fd = self._checked_fd(relative, offset, len(buffer))
        got = 0
        while got < len(buffer):  # preadv may return short reads on some filesystems
            try:
                count = os.preadv(fd, [buffer[got:]], offset + got)
            except OSError as error:  # EISDIR, EIO, ...
                raise CorruptBlob(f"{self.path(relative)}: cannot read ({error.strerror or error})") from None
            if count == 0:
                raise CorruptBlob(f"{self.path(relative)}: unexpected end of file at {offset + got}")
            got += count

    def read(self, relative: str, offset: int, length: int) -> bytes:
        """Return exactly `length` bytes at `offset`, or raise CorruptBlob naming the file."""
        fd = self._checked_fd(relative, offset, length)
        try:
            data = os.pread(fd, length, offset)
        except OSError as error:  # EISDIR, EIO, ...
            raise CorruptBlob(f"{self.path(relative)}: cannot read ({error.strerror or error})") from None
        parts = [data]
        got = len(data)
        while got < length:  # pread may return short reads on some filesystems
            more = os.pread(fd, length - got, offset + got)
            if not more:
                raise CorruptBlob(f"{self.path(relative)}: unexpected end of file at {offset + got}")
            parts.append(more)
            got += len(more)
        return data if len(parts) == 1 else b"".join(parts)


# ---------------------------------------------------------------------------------------------
# torch.save records


@dataclass(frozen=True)
class TensorRecord:
    """What a torch.save record of one tensor says about itself."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    storage_bytes: int
    data_offset: int  # absolute offset of the storage bytes in the data file
    data_length: int
    crc32: int
    byteorder: str

    @property
    def is_plain(self) -> bool:
        """True when the storage bytes are exactly the tensor, row-major, little-endian."""
        itemsize = dtypes.ITEMSIZE.get(self.dtype, 0)
        nbytes = math.prod(self.shape) * itemsize
        return (
            self.byteorder == "little"
            and self.storage_offset == 0
            and self.data_length == nbytes
            and self.stride == contiguous_strides(self.shape)
        )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Return row-major strides (in elements) for `shape`."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class _Storage:
    dtype: str | None
    key: str
    numel: int  # elements for typed storages, bytes for UntypedStorage


@dataclass(frozen=True)
class _Rebuilt:
    storage: Any
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str | None


class _StorageClass:
    def __init__(self, dtype: str | None):
        self.dtype = dtype


def _rebuild_v2(storage, storage_offset, size, stride, *rest) -> _Rebuilt:
    return _Rebuilt(storage, storage_offset, tuple(size), tuple(stride), None)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    return _Rebuilt(storage, storage_offset, tuple(size), tuple(stride), getattr(dtype, "name", None))


_TENSOR_PICKLE_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageClass(None),
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): tuple,
}
for _name, _dtype in dtypes.STORAGE_CLASS_DTYPE.items():
    _TENSOR_PICKLE_ALLOWED[("torch", _name)] = _StorageClass(_dtype)


def _persistent_storage(pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CorruptBlob(f"unexpected persistent id {pid!r:.80} in torch.save record")
    _, storage_class, key, _location, numel = pid
    if not isinstance(storage_class, _StorageClass) or not isinstance(numel, int):
        raise CorruptBlob(f"unexpected storage {pid!r:.80} in torch.save record")
    return _Storage(storage_class.dtype, str(key), numel)


@dataclass(frozen=True)
class _ZipEntry:
    name: str
    local_offset: int
    size: int
    crc32: int
    method: int
    uncompressed_size: int = 0
    flags: int = 0
    disk: int = 0  # the disk its local header is on: 0 in any archive torch can read


def _zip_entries(files: DataFiles, blob: Blob, where: str) -> dict[str, _ZipEntry]:
    tail_length = min(blob.length, 65536)
    tail_start = blob.offset + blob.length - tail_length
    tail = files.read(blob.file, tail_start, tail_length)
    position = tail.rfind(b"PK\x05\x06", 0, len(tail) - _EOCD.size + 4)
    if position < 0:
        raise CorruptBlob(f"{where}: torch.save record has no zip directory (truncated blob?)")
    (_, disk, directory_disk, on_disk, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, position)
    if disk not in (0, 0xFFFF) or directory_disk not in (0, 0xFFFF) or on_disk != count:
        raise CorruptBlob(f"{where}: torch.save record's zip end record is damaged")
    locator = position - _EOCD64_LOCATOR.size
    has_zip64 = locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07"
    if has_zip64:
        # torch writes zip64 end records (miniz) and its reader trusts them over the classic one
        (_, _, eocd64_offset, _) = _EOCD64_LOCATOR.unpack_from(tail, locator)
        if eocd64_offset + _EOCD64.size > blob.length:
            raise CorruptBlob(f"{where}: zip64 end record lies outside the blob")
        fields = _EOCD64.unpack(files.read(blob.file, blob.offset + eocd64_offset, _EOCD64.size))
        if fields[0] != 0x06064B50 or fields[6] != fields[7]:
            raise CorruptBlob(f"{where}: torch.save record's zip64 end record is damaged")
        classic = (count, cd_size, cd_offset)
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        saturated = (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
        if any(old != new and old != cap for old, new, cap in zip(classic, (count, cd_size, cd_offset), saturated)):
            raise CorruptBlob(f"{where}: torch.save record's zip end records disagree")
    elif count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        raise CorruptBlob(f"{where}: zip64 record locator missing")
    if cd_offset + cd_size > blob.length:
        raise CorruptBlob(f"{where}: zip directory lies outside the blob")
    directory = files.read(blob.file, blob.offset + cd_offset, cd_size)
    entries: dict[str, _ZipEntry] = {}
    at = 0
    for _ in range(count):
        if directory[at:at + 4] != b"PK\x01\x02":
            raise CorruptBlob(f"{where}: damaged zip directory")
        fields = _CENTRAL.unpack_from(directory, at)
        method, crc, csize, usize = fields[4], fields[7], fields[8], fields[9]
        name_length, extra_length, comment_length, local_offset = fields[10], fields[11], fields[12], fields[16]
        name = directory[at + 46:at + 46 + name_length].decode("utf-8", "replace")
        extra = directory[at + 46 + name_length:at + 46 + name_length + extra_length]
        usize, csize, local_offset = _zip64_extra(extra, usize, csize, local_offset)
        entries[name] = _ZipEntry(name, local_offset, csize, crc, method, usize, fields[3], fields[13])
        at += 46 + name_length + extra_length + comment_length
    return entries


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if usize == 0xFFFFFFFF:
                usize = next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if offset == 0xFFFFFFFF:
                offset = next(values)
            break
        at += 4 + length
    return usize, csize, offset


def _entry_data_offset(files: DataFiles, blob: Blob, entry: _ZipEntry, where: str) -> int:
    header = files.read(blob.file, blob.offset + entry.local_offset, _LOCAL.size)
    fields = _LOCAL.unpack(header)
    if fields[0] != 0x04034B50:
        raise CorruptBlob(f"{where}: zip entry {entry.name} has a damaged header")
    start = entry.local_offset + _LOCAL.size + fields[9] + fields[10]
    if entry.method != 0:
        raise UnsupportedFormat(f"{where}: zip entry {entry.name} is compressed (method {entry.method})")
    if start + entry.size > blob.length:
        raise CorruptBlob(f"{where}: zip entry {entry.name} runs past the end of its blob")
    return blob.offset + start


def _entry_bytes(files: DataFiles, blob: Blob, entry: _ZipEntry, where: str, limit: int) -> bytes:
    if entry.size > limit:
        raise CorruptBlob(f"{where}: zip entry {entry.name} is implausibly large ({entry.size} bytes)")
    start = _entry_data_offset(files, blob, entry, where)
    return files.read(blob.file, start, entry.size)


def _find_entry(entries: dict[str, _ZipEntry], suffix: str) -> _ZipEntry | None:
    for name, entry in entries.items():
        if name == suffix or name.endswith("/" + suffix):
            return entry
    return None


def record_problems(files: DataFiles, blob: Blob, where: str, skip_largest: bool) -> list[tuple[str, str]]:
    """Return what is wrong with the torch.save record in `blob` as (kind, message) pairs:
    kind "checksum" for an entry whose bytes do not match its CRC-32, "structure" for what
    torch's PyTorchStreamReader would refuse (entries outside one `<name>/` folder, a missing
    `data.pkl` or `version`, a local header that is damaged or names another entry).

    With `skip_largest` the largest entry (a tensor's data, checked while it streams) is left
    out and only the bytes around it are read: two reads per record, whatever its size.
    """
    try:
        entries = list(_zip_entries(files, blob, where).values())
    except CorruptBlob as error:
        return [("structure", str(error))]
    problems = []
    folders = {entry.name.split("/", 1)[0] for entry in entries}
    if len(folders) != 1 or any("/" not in entry.name for entry in entries):
        problems.append(("structure", f"{where}: record entries are not all in one folder ({', '.join(sorted(e.name for e in entries)[:6])})"))
    by_name = {entry.name: entry for entry in entries}
    # torch's reader wants data.pkl and a version record (`version`, or `.data/version`)
    for required, alternatives in (("data.pkl", ("data.pkl",)), ("version", ("version", ".data/version"))):
        if all(_find_entry(by_name, name) is None for name in alternatives):
            problems.append(("structure", f"{where}: record has no {required} entry"))
    for entry in entries:  # what miniz (torch's zip reader) refuses when it opens an archive
        if entry.method != 0 or entry.size != entry.uncompressed_size:
            problems.append(("structure", f"{where}: zip entry {entry.name} is not stored uncompressed (method {entry.method}, {entry.size} of {entry.uncompressed_size} bytes)"))
        if entry.flags & _ZIP_UNSUPPORTED_FLAGS or entry.disk not in (0, 0xFFFF):
            problems.append(("structure", f"{where}: zip entry {entry.name} has damaged flags or disk fields"))
        if entry.local_offset + _LOCAL.size + entry.size > blob.length:
            problems.append(("structure", f"{where}: zip entry {entry.name} runs past the end of its record"))
    largest = max(entries, key=lambda entry: entry.size, default=None)
    if largest is None:
        return problems
    regions = [(0, blob.length)]
    if skip_largest:
        try:
            data_start = _entry_data_offset(files, blob, largest, where) - blob.offset
        except CheckpointError as error:
            return problems + [("structure", str(error))]
        regions = [(0, data_start), (data_start + largest.size, blob.length)]
    buffers = [(start, files.read(blob.file, blob.offset + start, end - start)) for start, end in regions if end > start]
    for entry in entries:
        if skip_largest and entry is largest:
            continue
        content = _entry_in(buffers, entry)
        if content is None:
            problems.append(("structure", f"{where}: zip entry {entry.name} has a damaged local header"))
        elif zlib.crc32(content) != entry.crc32:
            problems.append(("checksum", f"{where}: record entry {entry.name} does not match its CRC-32 (bytes changed on disk)"))
    return problems


def _entry_in(buffers: list[tuple[int, bytes]], entry: _ZipEntry) -> bytes | None:
    """Return an entry's stored bytes from the buffer holding its local header and data, or
    None when that header is damaged or names another entry."""
    name = entry.name.encode("utf-8")
    for start, buffer in buffers:
        at = entry.local_offset - start
        if 0 <= at and at + _LOCAL.size <= len(buffer):
            fields = _LOCAL.unpack_from(buffer, at)
            name_start = at + _LOCAL.size
            if fields[0] != 0x04034B50 or buffer[name_start:name_start + fields[9]] != name:
                return None
            begin = name_start + fields[9] + fields[10]
            if begin + entry.size <= len(buffer):
                return buffer[begin:begin + entry.size]
            return None
    return None


def read_tensor_record(files: DataFiles, blob: Blob, where: str) -> TensorRecord:
    """Return what the torch.save record in `blob` holds, without reading its tensor bytes."""
    entries = _zip_entries(files, blob, where)
    pickle_entry = _find_entry(entries, "data.pkl")
    if pickle_entry is None:
        raise CorruptBlob(f"{where}: torch.save record has no data.pkl")
    raw = _entry_bytes(files, blob, pickle_entry, where, MAX_PICKLE_BYTES)
    try:
        rebuilt = RestrictedUnpickler(
            io.BytesIO(raw), _TENSOR_PICKLE_ALLOWED, where, persistent=_persistent_storage
        ).load()
    except (CorruptBlob, CorruptMetadata):
        raise
    except Exception as error:
        raise CorruptBlob(f"{where}: cannot decode torch.save record ({type(error).__name__}: {error})") from None
    if not isinstance(rebuilt, _Rebuilt) or not isinstance(rebuilt.storage, _Storage):
        raise CorruptBlob(f"{where}: torch.save record does not hold a single tensor")
    dtype = rebuilt.dtype or rebuilt.storage.dtype or "unknown"
    itemsize = dtypes.ITEMSIZE.get(dtype, 1)
    storage_bytes = rebuilt.storage.numel * (itemsize if rebuilt.storage.dtype else 1)
    data_entry = _find_entry(entries, f"data/{rebuilt.storage.key}")
    if data_entry is None:
        raise CorruptBlob(f"{where}: torch.save record misses its storage data/{rebuilt.storage.key}")
    if data_entry.size != storage_bytes:
        raise CorruptBlob(
            f"{where}: storage holds {data_entry.size} bytes but its header says {storage_bytes}"
        )
    byteorder_entry = _find_entry(entries, "byteorder")
    byteorder = "little"
    if byteorder_entry is not None:
        byteorder = _entry_bytes(files, blob, byteorder_entry, where, 16).decode("ascii", "replace")
    return TensorRecord(
        dtype=dtype,
        shape=rebuilt.shape,
        stride=rebuilt.stride,
        storage_offset=rebuilt.storage_offset,
        storage_bytes=storage_bytes,
        data_offset=_entry_data_offset(files, blob, data_entry, where),
        data_length=data_entry.size,
        crc32=data_entry.crc32,
        byteorder=byteorder,
    )


# ---------------------------------------------------------------------------------------------
# safetensors-format data files


def safetensors_header(files: DataFiles, blob: Blob, where: str) -> tuple[dict, int]:
    """Return a safetensors blob's header and where its data section starts in the file."""
    head = files.read(blob.file, blob.offset, 8)
    (header_length,) = struct.unpack("<Q", head)
    if header_length > MAX_SAFETENSORS_HEADER:
        raise CorruptBlob(f"{where}: safetensors header of {header_length} bytes is implausible")
    try:
        header = json.loads(files.read(blob.file, blob.offset + 8, header_length))
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptBlob(f"{where}: unreadable safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise CorruptBlob(f"{where}: the safetensors header is not a JSON object")
    return header, blob.offset + 8 + header_length


def is_safetensors_blob(files: DataFiles, blob: Blob) -> bool:
    """True when the blob starts with a safetensors header rather than a zip record."""
    if blob.transforms or blob.length == 0:
        return False
    head = files.read(blob.file, blob.offset, min(9, files.size(blob.file) - blob.offset))
    return len(head) == 9 and head[8:9] == b"{" and head[:4] != ZIP_LOCAL_MAGIC


@dataclass(frozen=True)
class RawData:
    """A chunk's raw row-major little-endian bytes, as a byte range of one data file."""

    file: str
    offset: int
    length: int
    crc32: int | None = None  # CRC-32 the torch.save record states for these bytes, if any


def _where(files: DataFiles, tensor: Tensor, chunk: Chunk) -> str:
    blob = chunk.blob
    name = files.path(blob.file) if blob else files.root
    return f"{name}: {tensor.fqn} chunk at {list(chunk.offsets)}"


def locate(files: DataFiles, tensor: Tensor, chunk: Chunk) -> RawData | None:
    """Return where the chunk's raw bytes are, or None when they must be decoded first.

    Checks the record's dtype and shape against the metadata; raises CorruptBlob on mismatch.
    """
    blob = chunk.blob
    where = _where(files, tensor, chunk)
    if blob is None:
        raise CorruptBlob(f"{where}: the metadata has no storage entry for this chunk")
    if blob.transforms:
        return None
    expected = chunk.numel * tensor.itemsize
    if is_safetensors_blob(files, blob):
        header, data_start = safetensors_header(files, blob, where)
        info = header.get(tensor.fqn)
        if not isinstance(info, dict):
            raise CorruptBlob(f"{where}: not in the file's safetensors header")
        dtype = dtypes.FROM_SAFETENSORS_NAME.get(info.get("dtype"), info.get("dtype"))
        begin, end = info.get("data_offsets", (0, -1))
        _check_record(where, tensor, chunk, dtype, tuple(info.get("shape", ())))
        if end - begin != expected:
            raise CorruptBlob(f"{where}: holds {end - begin} bytes, expected {expected}")
        return RawData(blob.file, data_start + begin, end - begin)
    record = read_tensor_record(files, blob, where)
    _check_record(where, tensor, chunk, record.dtype, record.shape)
    if not record.is_plain:
        return None
    return RawData(blob.file, record.data_offset, record.data_length, record.crc32)


def _check_record(where: str, tensor: Tensor, chunk: Chunk, dtype: str, shape: tuple) -> None:
    if dtype != tensor.dtype:
        raise CorruptBlob(f"{where}: blob holds {dtype}, metadata says {tensor.dtype}")
    if tuple(shape) != chunk.sizes:
        raise CorruptBlob(f"{where}: blob holds shape {list(shape)}, metadata says {list(chunk.sizes)}")


def read_chunk(files: DataFiles, tensor: Tensor, chunk: Chunk) -> bytes:
    """Return the chunk's raw row-major little-endian bytes, decoding the blob if needed."""
    raw = locate(files, tensor, chunk)
    if raw is not None:
        return files.read(raw.file, raw.offset, raw.length)
    return _decode_chunk(files, tensor, chunk)


def blob_bytes(files: DataFiles, blob: Blob, where: str) -> bytes:
    """Return a blob's bytes with its stream transforms (zstd) undone."""
    data = files.read(blob.file, blob.offset, blob.length)
    for transform in reversed(blob.transforms):
        name = transform.split("/", 1)[0]
        if name != ZSTD_TRANSFORM:
            raise UnsupportedFormat(f"{where}: unknown stream transform {transform!r}")
        data = _zstd_decompress(data, where)
    return data


def _zstd_decompress(data: bytes, where: str) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise UnsupportedFormat(
            f"{where}: blob is zstd-compressed (`{ZSTD_TRANSFORM}`); install `zstandard` "
            "(pip install 'ckpttool[zstd]') to read it"
        ) from None
    try:
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    except zstandard.ZstdError as error:
        raise CorruptBlob(f"{where}: zstd stream does not decompress ({error})") from None


def _decode_chunk(files: DataFiles, tensor: Tensor, chunk: Chunk) -> bytes:
    """Slow path: materialise the chunk through torch (transforms, strides, big-endian)."""
    where = _where(files, tensor, chunk)
    data = blob_bytes(files, chunk.blob, where)
    loaded = load_torch_bytes(data, where)
    import torch

    if not isinstance(loaded, torch.Tensor):
        raise CorruptBlob(f"{where}: blob does not hold a tensor")
    _check_record(where, tensor, chunk, str(loaded.dtype).removeprefix("torch."), tuple(loaded.shape))
    return tensor_bytes(loaded)


def tensor_bytes(value: Any) -> bytes:
    """Return a torch tensor's bytes, row-major (works for bf16 and float8 too)."""
    import torch

    flat = value.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


_PLAIN_OBJECT_ALLOWED: dict[tuple[str, str], Any] = {("collections", "OrderedDict"): dict}


def decode_object(data: bytes, where: str) -> Any:
    """Return the python value of a torch.save'd non-tensor entry (param_groups, step, ...).

    Plain values (numbers, strings, None, lists, tuples, dicts) are unpickled through an
    allowlist without importing torch; anything else (torch.Size, tensors, other classes) is
    handed to `torch.load(weights_only=True)`, which also words the error for a broken blob.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == "data.pkl"]
            # torch.save stores records uncompressed; anything else goes to torch (no zip bombs)
            if len(entries) == 1 and entries[0].compress_type == zipfile.ZIP_STORED and entries[0].file_size <= len(data):
                pickled = archive.read(entries[0])
                return RestrictedUnpickler(io.BytesIO(pickled), _PLAIN_OBJECT_ALLOWED, where).load()
    except (CheckpointError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, EOFError,
            KeyError, TypeError, AttributeError, IndexError, OverflowError):
        pass
    return load_torch_bytes(data, where)


def load_torch_bytes(data: bytes, where: str) -> Any:
    """Decode a torch.save blob with `weights_only=True` (never runs code from the file)."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CorruptBlob(f"{where}: refused or unreadable torch.save blob ({error})") from None
    except Exception as error:
        raise CorruptBlob(f"{where}: unreadable torch.save blob ({type(error).__name__}: {error})") from None


def iter_blocks(files: DataFiles, raw: RawData, block: int = 16 << 20, buffer: memoryview | None = None):
    """Yield the bytes of a range in blocks of at most `block` bytes (keep it a multiple of
    the itemsize so each block holds whole elements).

    With `buffer` (at least `block` bytes) every block is a view of it, filled in place: no
    allocation per block, and each view is valid only until the next one is asked for.
    """
    for start in range(raw.offset, raw.offset + raw.length, block):
        length = min(block, raw.offset + raw.length - start)
        if buffer is None:
            yield files.read(raw.file, start, length)
        else:
            view = buffer[:length]
            files.read_into(raw.file, start, view)
            yield view
