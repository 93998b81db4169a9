"""Find and decode the bytes of one blob inside a `.distcp` data file.

A DCP data file is a concatenation of blobs. With torch's default writer each tensor chunk is
one `torch.save` record (read by `torchsave.record`: it tells where the chunk's raw row-major
bytes are, so they can be copied as they are). With `serialization_format=SAFETENSORS` the
tensors of a file sit in one safetensors blob at its end; blobs may also be zstd-compressed
(`stream.zstd/1` transform).

Example:
    >>> with DataFiles(ckpt.path) as files:
    ...     raw = locate(files, tensor, tensor.chunks[0])      # RawData(file, offset, length)
    ...     data = read_chunk(files, tensor, tensor.chunks[0])  # bytes, decoded if needed
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, MutableMapping, Protocol, Sequence, cast

from ckpttool.core import dtypes
from ckpttool.store import spans, storage
from ckpttool.core.checkpoint import (RAW_RANGE_TRANSFORM, Blob, Chunk, Tensor, as_path, is_raw_range, rows_as_columns,
                                      rows_transposed)
from ckpttool.core.errors import CheckpointError, CorruptBlob, CorruptMetadata, MissingFile, UnsupportedFormat
from ckpttool.formats import safetensors
from ckpttool.store.safepaths import check_data_file, containment_root, safe_relative_path
from ckpttool.safepickle import PickleRefused
from ckpttool.torchsave.archive import tensor_bytes
from ckpttool.torchsave.record import (ParsedRecords, TensorRecord, find_record_problems, parse_tensor_record,
                                       read_plain_object)
from ckpttool.torchsave.zip import LOCAL_MAGIC

ZSTD_TRANSFORM = "stream.zstd"  # torch/distributed/checkpoint/_extension.py ZStandard.registry_name
HEADER_WINDOW = 256 << 10  # bytes one read-ahead fill spans: the headers of many small records (storage.READ_AHEAD)
HEAD_WINDOW = 4 << 10  # a fill at the start of a record larger than HEADER_WINDOW: its local headers and data.pkl
MAX_OBJECT_BYTES = 64 << 20  # a non-tensor entry decompressed: param_groups, steps, RNG states are far smaller
RECORD_SLACK = 1 << 20  # what a one-tensor record may hold beyond its data (data.pkl, small entries, zip directory)
RECORD_TAIL = 64 << 10  # what locating reads at a record's end: torchsave.zip.read_directory's end-record window
DECOMPRESS_BLOCK = 4 << 20  # bytes decompressed per step
MAP_BLOCK = 4 << 20  # bytes of a local file mapped at once by `DataFiles.mapped`


class DataFiles:
    """Open data files of one checkpoint by relative path; positional reads, thread-safe.

    Only regular files are opened (non-blocking, so a FIFO cannot hang the open), and only
    inside the checkpoint directory unless `follow_symlinks`. A remote root (`storage`) has
    no fds (`local` is False): its reads are ranged GETs through `storage.RangeReader`.

    With a `budget` (bytes), a remote root's reads are coalesced (`coalesced` is True): the
    records to locate (`walk_records`) and the ranges the copies will read (`expect`) are
    fetched as few large spans by a `spans.SpanStore` holding at most about `budget` bytes,
    and reads inside them are served from memory. Local roots ignore it. `whole_records`
    False: locating fetches only record heads and ends (a torchrun process copies a share of
    the bytes, so it must not fetch them all to locate). `made`: name -> local file ckpttool
    wrote itself beside the checkpoint's (import's initial values of buffers no source holds),
    read by that name like a data file."""

    def __init__(self, root: str | os.PathLike, follow_symlinks: bool = False, budget: int = 0,
                 whole_records: bool = True, made: Mapping[str, Path] | None = None):
        self.root = as_path(storage.location(root))
        self._made = dict(made or {})
        self.local = not storage.is_remote(self.root)
        self._inside = None if follow_symlinks else containment_root(self.root)
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._readers: dict[str, storage.RangeReader] = {}
        self._lock = threading.Lock()
        self._spans = None if self.local or budget <= 0 else spans.SpanStore(self._fetch, budget)
        self._whole_records = whole_records
        self.checks: ReadChecks | None = None  # set by locating: records whose headers are read with their data

    def __enter__(self) -> "DataFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._spans is not None:
            self._spans.close()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    @property
    def coalesced(self) -> bool:
        """True when reads are served from coalesced spans (a remote root given a budget)."""
        return self._spans is not None

    @property
    def requests(self) -> int:
        """The ranged GETs sent for data files so far (0 for a local root)."""
        with self._lock:
            return sum(reader.requests for reader in self._readers.values())

    def walk_records(self, blobs: Iterable[Blob | None]) -> None:
        """Say which blobs' records are about to be located, each file's in offset order, so
        their headers are fetched as coalesced spans. Records are fetched whole, header and
        data together, while their bytes fit the budget (the copies read them next: the first
        records of every file first, as the copies come), the rest by their heads and ends
        only. Does nothing unless `coalesced`."""
        if self._spans is None:
            return
        present = [blob for blob in blobs if blob is not None]
        readable = {relative for relative in {blob.file for blob in present} if self._opens(relative)}
        by_file: dict[str, list[Blob]] = {}
        for blob in sorted((blob for blob in present if blob.file in readable), key=lambda blob: (blob.file, blob.offset)):
            by_file.setdefault(blob.file, []).append(blob)
        small = spans.GAP + HEAD_WINDOW + RECORD_TAIL  # a longer record not kept: its head and its end only
        whole, ends, spent = [], [], 0
        interleaved = sorted(((position, blob) for found in by_file.values() for position, blob in enumerate(found)),
                             key=lambda item: (item[0], item[1].file))
        for _, blob in interleaved:
            if self._whole_records and spent + blob.length <= self._spans.budget:
                spent += blob.length
                whole.append((blob.file, blob.offset, blob.offset + blob.length))
            else:
                ends.extend(_record_ends(blob, small))
        limit = self._spans.fit(len(by_file))
        walked = [span for span in spans.coalesce(whole + ends, limit=limit) if span.end <= self._sizes[span.file]]
        self._spans.walk(walked, keep=spans.overlapping(walked, whole))

    def passed(self, relative: str, offset: int) -> None:
        """Say the walker of `relative` reads nothing below `offset` any more (see SpanStore.passed)."""
        if self._spans is not None:
            self._spans.passed(relative, offset)

    def expect(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """Say which (file, start, end) ranges are read next, in order (see SpanStore.expect);
        does nothing unless `coalesced`."""
        if self._spans is not None:
            if self.checks is not None:
                ranges = self.checks.ranges(ranges)
            readable = {relative for relative in {r[0] for r in ranges} if self._opens(relative)}
            self._spans.expect([r for r in ranges if r[0] in readable and r[2] <= self._sizes[r[0]]])

    def _opens(self, relative: str) -> bool:
        """True when the remote file can be read (a missing one is named by the read that needs it)."""
        try:
            self._reader(relative)
        except CheckpointError:
            return False
        return True

    def _fetch(self, relative: str, start: int, end: int) -> bytes:
        return self._reader(relative).get(start, end)

    def path(self, relative: str) -> Path:
        made = self._made.get(relative)
        return made if made is not None else self.root / safe_relative_path(relative)

    def _reader(self, relative: str) -> "storage.RangeReader":
        with self._lock:
            found = self._readers.get(relative)
            if found is None:
                path = self.path(relative)
                try:
                    found = self._readers[relative] = storage.reader(cast(storage.RemotePath, path))  # not local
                except FileNotFoundError:
                    raise MissingFile(f"{path}: referenced by the metadata but missing (was the upload "
                                      "interrupted or partial? run `ckpttool validate`)") from None
                except OSError as error:
                    raise CorruptBlob(f"{path}: cannot open data file ({error.strerror or error})") from None
                self._sizes[relative] = found.size
            return found

    def fd(self, relative: str) -> int:
        if not self.local:
            raise TypeError(f"{self.path(relative)}: a remote file has no fd (check DataFiles.local)")
        with self._lock:
            fd = self._fds.get(relative)
            if fd is None:
                path = self.path(relative)
                inside = None if relative in self._made else self._inside  # a file ckpttool wrote: outside the root
                try:
                    check_data_file(path, os.stat(path).st_mode, inside)  # before open: devices may act on it
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise MissingFile(
                        f"{path}: referenced by the metadata but missing (was the save "
                        "interrupted or the directory copied partially? run `ckpttool validate`)"
                    ) from None
                except OSError as error:
                    raise CorruptBlob(f"{path}: cannot open data file ({error.strerror or error})") from None
                try:  # again on what was opened: the path may have changed in between
                    status = os.fstat(fd)
                    opened = f"/proc/self/fd/{fd}"
                    check_data_file(path, status.st_mode, inside,
                                    os.readlink(opened) if os.path.islink(opened) else None)
                except BaseException:
                    os.close(fd)
                    raise
                self._fds[relative] = fd
                self._sizes[relative] = status.st_size
            return fd

    def size(self, relative: str) -> int:
        self.fd(relative) if self.local else self._reader(relative)
        return self._sizes[relative]

    def _checked_fd(self, relative: str, offset: int, length: int) -> int | None:
        fd = None
        if self.local:
            fd = self.fd(relative)
        else:
            self._reader(relative)
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
        if fd is None:
            buffer[:] = self._remote_read(relative, offset, len(buffer))
            return
        got = 0
        while got < len(buffer):  # preadv may return short reads on some filesystems
            try:
                count = os.preadv(fd, [buffer[got:]], offset + got)
            except OSError as error:  # EISDIR, EIO, ...
                raise CorruptBlob(f"{self.path(relative)}: cannot read ({error.strerror or error})") from None
            if count == 0:
                raise CorruptBlob(f"{self.path(relative)}: unexpected end of file at {offset + got}")
            got += count

    def mapped(self, relative: str, offset: int, length: int, block: int = MAP_BLOCK) -> Iterator[memoryview]:
        """Yield the `length` bytes at `offset` of a local file as read-only maps of at most
        `block` bytes, one at a time (each view valid until the next): the page cache's pages
        read in place, without the copy into a buffer a read makes (for a CRC-32 of bytes the
        kernel copies: `record_writes.source_crc`). The range is checked against the file's size
        first (CorruptBlob); a file truncated by another process while mapped faults (SIGBUS),
        as with any mapped reader (check.numbers maps what it scans the same way)."""
        fd = self._checked_fd(relative, offset, length)
        if fd is None:
            raise TypeError(f"{self.path(relative)}: a remote file cannot be mapped (check DataFiles.local)")
        end = offset + length
        for begin in range(offset, end, block):
            start = begin - begin % mmap.ALLOCATIONGRANULARITY
            stop = min(begin + block, end)
            try:
                mapping = mmap.mmap(fd, stop - start, access=mmap.ACCESS_READ, offset=start)
            except OSError as error:
                raise CorruptBlob(f"{self.path(relative)}: cannot map ({error.strerror or error})") from None
            view = memoryview(mapping)
            try:
                piece = view[begin - start:]
                try:
                    yield piece
                finally:
                    piece.release()
            finally:
                view.release()
                mapping.close()

    def pieces(self, relative: str, offset: int, length: int, buffer: memoryview) -> Iterator[memoryview]:
        """Yield the `length` bytes at `offset` as consecutive fills of `buffer` (each view valid
        until the next): from a remote file one ranged GET streamed through the buffer."""
        self._checked_fd(relative, offset, length)
        if not self.local:
            if self.checks is not None:
                offset = self.checks.offset(relative, offset, length)
            served = self._spans.pieces(relative, offset, length, len(buffer)) if self._spans is not None else iter([None])
            first = next(served, None)
            if first is None:
                yield from self._readers[relative].pieces(offset, length, buffer)
                return
            yield first
            yield from cast(Iterator[memoryview], served)  # the spans' pieces (not `iter([None])`: returned above)
            return
        for done in range(0, length, len(buffer)):
            view = buffer[:min(len(buffer), length - done)]
            self.read_into(relative, offset + done, view)
            yield view

    def read(self, relative: str, offset: int, length: int) -> bytes:
        """Return exactly `length` bytes at `offset`, or raise CorruptBlob naming the file."""
        fd = self._checked_fd(relative, offset, length)
        if fd is None:
            return self._remote_read(relative, offset, length)
        try:
            data = os.pread(fd, length, offset)
        except OSError as error:  # EISDIR, EIO, ...
            raise CorruptBlob(f"{self.path(relative)}: cannot read ({error.strerror or error})") from None
        if len(data) < length:  # pread may return short reads on some filesystems
            rest = bytearray(length - len(data))
            self.read_into(relative, offset + len(data), memoryview(rest))
            data += rest
        return data

    def _remote_read(self, relative: str, offset: int, length: int) -> bytes:
        if self.checks is not None:
            offset = self.checks.offset(relative, offset, length)
        served = self._spans.read(relative, offset, length) if self._spans is not None and length else None
        if served is None:
            return self._readers[relative].read(offset, length)
        return bytes(served)


class ReadChecks(Protocol):
    """What a remote DataFiles asks before its reads (`locating.PredictedRecords`: records
    whose headers are read with their data, by the copies)."""

    def ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """The ranges to fetch for reads of `ranges`, in order (the headers to check with them)."""

    def offset(self, relative: str, offset: int, length: int) -> int:
        """Where to read the `length` bytes asked for at `offset` (after checking what holds them)."""


class FileReads(Protocol):
    """What locating reads data files through: a DataFiles, or a ReadAhead of one of its files."""

    @property
    def root(self) -> Path: ...

    def path(self, relative: str) -> Path: ...

    def size(self, relative: str) -> int: ...

    def read(self, relative: str, offset: int, length: int) -> bytes: ...


class ReadAhead:
    """DataFiles' reads of one data file through one read-ahead window, for one thread walking
    that file's records in offset order: the headers of neighbouring records come from one
    read of up to HEADER_WINDOW bytes instead of several small reads per record.

    It answers `read`, `size`, `path` and `root` as DataFiles does (the same bytes, the same
    bounds checks and errors: anything outside the window or the file goes to `files.read`),
    so `locate(ReadAhead(files, name), ...)` is `locate(files, ...)` with fewer reads. Memory:
    one window. Not thread-safe: one per task.

    Example:
        >>> ahead = ReadAhead(files, "__0_0.distcp")
        >>> for tensor, chunk in chunks_in_offset_order:
        ...     ahead.expect(chunk.blob)
        ...     raw = locate(ahead, tensor, chunk)
    """

    def __init__(self, files: DataFiles, relative: str):
        self.files = files
        self.relative = relative
        self.root = files.root
        self._start = 0
        self._window = b""
        self._head_end = 0  # fills below it are HEAD_WINDOW: the head of a large record, then its data
        self._path: Path | None = None  # of `relative`, once checked: every error message names it
        self._size: int | None = None
        self.records = ParsedRecords()  # the record layouts of this file parsed so far

    def path(self, relative: str) -> Path:
        if relative != self.relative:
            return self.files.path(relative)
        if self._path is None:
            self._path = self.files.path(relative)
        return self._path

    def size(self, relative: str) -> int:
        if relative != self.relative:
            return self.files.size(relative)
        if self._size is None:
            self._size = self.files.size(relative)  # fixed once the file is open
        return self._size

    def expect(self, blob: Blob) -> None:
        """Say which record the next reads belong to (it sizes the next fills; coalesced
        spans below it may be let go)."""
        large = blob.length > HEADER_WINDOW + HEAD_WINDOW
        self._head_end = blob.offset + HEAD_WINDOW if large else 0
        if blob.file == self.relative:
            self.files.passed(self.relative, blob.offset)

    def read(self, relative: str, offset: int, length: int) -> bytes:
        """Return exactly `length` bytes at `offset`, as `DataFiles.read` does."""
        if (relative != self.relative or offset < 0 or length < 0 or length >= HEADER_WINDOW
                or self.files.coalesced):  # coalesced spans already hold the neighbours in memory
            return self.files.read(relative, offset, length)
        end = offset + length
        if self._start <= offset and end <= self._start + len(self._window):
            return self._window[offset - self._start:end - self._start]
        size = self.size(relative)
        if end > size:
            return self.files.read(relative, offset, length)  # raises, naming the file
        fill = HEAD_WINDOW if offset < self._head_end else HEADER_WINDOW
        self._window = self.files.read(relative, offset, min(max(length, fill), size - offset))
        self._start = offset
        return self._window[:length]


def _record_ends(blob: Blob, small: int) -> list[tuple[str, int, int]]:
    """The byte ranges locating reads of the record in `blob`: all of a small one, else the
    head (local headers, data.pkl) and the end (zip directory)."""
    start, end = blob.offset, blob.offset + blob.length
    if blob.length <= small:
        return [(blob.file, start, end)]
    return [(blob.file, start, start + HEAD_WINDOW), (blob.file, end - RECORD_TAIL, end)]


def _blob_reader(files: FileReads, blob: Blob) -> Callable[[int, int], bytes]:
    return lambda offset, length: files.read(blob.file, blob.offset + offset, length)


def safetensors_header(files: FileReads, blob: Blob, where: str) -> tuple[dict, int]:
    """Return a safetensors blob's header and where its data section starts in the file."""
    try:
        header, data_start = safetensors.read_header(_blob_reader(files, blob))
    except safetensors.HeaderError as error:
        if error.kind == "length":
            raise CorruptBlob(f"{where}: safetensors header of {error.length} bytes is implausible") from None
        if error.kind == "json":
            raise CorruptBlob(f"{where}: unreadable safetensors header ({error.error})") from None
        raise CorruptBlob(f"{where}: the safetensors header is not a JSON object") from None
    return header, blob.offset + data_start


def is_safetensors_blob(files: FileReads, blob: Blob) -> bool:
    """True when the blob starts with a safetensors header rather than a zip record (an
    empty tensor's blob in a safetensors file has length 0 and is one too)."""
    if blob.transforms:
        return False
    head = files.read(blob.file, blob.offset, min(9, files.size(blob.file) - blob.offset))
    return len(head) == 9 and head[8:9] == b"{" and head[:4] != LOCAL_MAGIC


def read_tensor_record(files: DataFiles | ReadAhead, blob: Blob, where: str) -> TensorRecord:
    """Return what the torch.save record in `blob` holds, without reading its tensor bytes
    (through a ReadAhead: each layout of its file parsed once, `ParsedRecords`)."""
    parse = files.records.parse if isinstance(files, ReadAhead) else parse_tensor_record
    return parse(_blob_reader(files, blob), blob.length, where, blob.offset)


def record_problems(files: DataFiles, blob: Blob, where: str, skip_largest: bool) -> list[tuple[str, str]]:
    """Return what is wrong with the torch.save record in `blob` (see `find_record_problems`)."""
    return find_record_problems(_blob_reader(files, blob), blob.length, where, skip_largest)


@dataclass(frozen=True)
class RawData:
    """A chunk's raw row-major little-endian bytes, as a byte range of one data file."""

    file: str
    offset: int
    length: int
    crc32: int | None = None  # CRC-32 the torch.save record states for these bytes, if any


class RawDataRows(MutableMapping[int, "RawData | None"]):
    """A tensor's located chunks as columns (what locating a ChunkTable tensor finds): chunk
    index -> RawData, each built when asked for, instead of 300k RawData objects built up
    front. Planners at that scale read the columns: chunk `index[i]` is the raw bytes at
    `offset[i]` (`length[i]` of them, CRC-32 `crc32[i]`) of data file `files[file[i]]`;
    `overrides` holds the chunks found another way (located alone; None: decoded), which win.

    Example:
        >>> rows = located["model.embed.weight"]
        >>> rows[0] == RawData(rows.files[rows.file[0]], int(rows.offset[0]), int(rows.length[0]), int(rows.crc32[0]))
        True
    """

    __slots__ = ("index", "files", "file", "offset", "length", "crc32", "overrides", "_rows")

    def __init__(self, index: Any, files: tuple[str, ...], file: Any, offset: Any, length: Any, crc32: Any):
        self.index, self.files, self.file = index, files, file
        self.offset, self.length, self.crc32 = offset, length, crc32
        self.overrides: dict[int, RawData | None] = {}
        self._rows: dict[int, int] | None = None  # chunk index -> row, made on the first lookup

    def _row(self, key: int) -> int | None:
        if self._rows is None:
            self._rows = dict(zip(self.index.tolist(), range(len(self.index))))
        return self._rows.get(key)

    def __getitem__(self, key: int) -> RawData | None:
        if key in self.overrides:
            return self.overrides[key]
        row = self._row(key)
        if row is None:
            raise KeyError(key)
        return RawData(self.files[self.file[row]], int(self.offset[row]), int(self.length[row]), int(self.crc32[row]))

    def __setitem__(self, key: int, value: RawData | None) -> None:
        self.overrides[key] = value

    def __delitem__(self, key: int) -> None:
        raise TypeError("located chunks are not removed")

    def __iter__(self) -> Iterator[int]:
        yield from self.index.tolist()
        yield from (key for key in self.overrides if self._row(key) is None)

    def __len__(self) -> int:
        return len(self.index) + sum(self._row(key) is None for key in self.overrides)


def _where(files: FileReads, tensor: Tensor, chunk: Chunk) -> str:
    blob = chunk.blob
    name = files.path(blob.file) if blob else files.root
    return f"{name}: {tensor.fqn} chunk at {list(chunk.offsets)}"


def locate(files: DataFiles | ReadAhead, tensor: Tensor, chunk: Chunk) -> RawData | None:
    """Return where the chunk's raw bytes are, or None when they must be decoded first.

    Checks the record's dtype and shape against the metadata; raises CorruptBlob on mismatch.
    Many chunks of one file: pass a `ReadAhead` of it, walking them in offset order.
    """
    blob = chunk.blob
    where = _where(files, tensor, chunk)
    if blob is None:
        raise CorruptBlob(f"{where}: the metadata has no storage entry for this chunk")
    expected = chunk.numel * tensor.itemsize
    if is_raw_range(blob):
        if blob.length != expected:
            raise CorruptBlob(f"{where}: holds {blob.length} bytes, expected {expected}")
        crc = blob.transforms[0].partition("/")[2]
        if crc and not (len(crc) == 8 and all(c in "0123456789abcdef" for c in crc)):
            raise CorruptBlob(f"{where}: malformed {RAW_RANGE_TRANSFORM} transform {blob.transforms[0][:40]!r}")
        return RawData(blob.file, blob.offset, blob.length, int(crc, 16) if crc else None)
    if blob.transforms:
        return None
    if is_safetensors_blob(files, blob):
        header, data_start = safetensors_header(files, blob, where)
        info = header.get(tensor.fqn)
        if not isinstance(info, dict):
            raise CorruptBlob(f"{where}: not in the file's safetensors header")
        stated: Any = info.get("dtype")  # JSON: anything (a wrong one is reported by _check_record)
        dtype = dtypes.FROM_SAFETENSORS_NAME.get(stated, stated)
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
    grid = rows_transposed(chunk.blob) if chunk.blob is not None else None
    if grid is not None:
        return _transposed_rows(files, tensor, chunk, grid)
    grid = rows_as_columns(chunk.blob) if chunk.blob is not None else None
    if grid is not None:
        return _rows_as_columns(files, tensor, chunk, grid)
    return _decode_chunk(files, tensor, chunk)


def _transposed_rows(files: DataFiles, tensor: Tensor, chunk: Chunk, grid: tuple[int, int]) -> bytes:
    """Return a ROWS_TRANSPOSED_TRANSFORM chunk's bytes: its blob's rows read in one range, as
    a grid of rows transposed (numpy moves whole rows: one strided copy)."""
    import numpy as np

    blob = cast(Blob, chunk.blob)
    x, y = grid
    expected = chunk.numel * tensor.itemsize
    if blob.length != expected or x <= 0 or y <= 0 or expected % (x * y):
        raise CorruptBlob(f"{_where(files, tensor, chunk)}: a {x} x {y} grid of rows in {blob.length} bytes, "
                          f"expected {expected}")
    data = np.frombuffer(files.read(blob.file, blob.offset, blob.length), dtype=np.uint8)
    return data.reshape(x, y, expected // (x * y)).transpose(1, 0, 2).tobytes()


def _rows_as_columns(files: DataFiles, tensor: Tensor, chunk: Chunk, grid: tuple[int, int]) -> bytes:
    """Return a ROWS_AS_COLUMNS_TRANSFORM chunk's bytes: its blob (X * Y rows of C elements)
    read in one range, the rows as an X x Y grid transposed, then the matrix transposed (numpy:
    one strided copy), whatever the chunk's shape (import's chunks are [C', R]: row_chunks).
    Holds the blob's bytes and that copy."""
    import numpy as np

    blob = cast(Blob, chunk.blob)
    x, y = grid
    expected = chunk.numel * tensor.itemsize
    rows = x * y
    if blob.length != expected or x <= 0 or y <= 0 or expected % (rows * tensor.itemsize):
        raise CorruptBlob(f"{_where(files, tensor, chunk)}: a {x} x {y} grid of rows as the columns of a chunk of "
                          f"shape {list(chunk.sizes)} in {blob.length} bytes, expected {expected}")
    columns = expected // (rows * tensor.itemsize)
    data = np.frombuffer(files.read(blob.file, blob.offset, blob.length), dtype=np.uint8)
    return data.reshape(x, y, columns, tensor.itemsize).transpose(2, 1, 0, 3).tobytes()


def object_bytes(files: DataFiles, entry: Any) -> bytes:
    """Return a non-tensor entry's torch.save bytes: made by its reader, or read from its blob;
    CorruptMetadata when neither holds them."""
    if entry.data is not None:
        return entry.data
    blob = entry.blob
    where = f"{files.path(blob.file) if blob else files.root}: {entry.fqn}"
    if blob is None:
        raise CorruptMetadata(f"{where}: the metadata has no storage entry for this object")
    return blob_bytes(files, blob, where)


def blob_bytes(files: DataFiles, blob: Blob, where: str, max_output: int = MAX_OBJECT_BYTES) -> bytes:
    """Return a blob's bytes with its stream transforms (zstd) undone, refusing (CorruptBlob)
    to decompress more than `max_output` bytes: a tiny blob must not expand to GBs."""
    data = files.read(blob.file, blob.offset, blob.length)
    for transform in reversed(blob.transforms):
        name = transform.split("/", 1)[0]
        if name != ZSTD_TRANSFORM:
            raise UnsupportedFormat(f"{where}: unknown stream transform {transform!r}")
        data = _zstd_decompress(data, where, max_output)
    return data


def _zstd_decompress(data: bytes, where: str, max_output: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise UnsupportedFormat(
            f"{where}: blob is zstd-compressed (`{ZSTD_TRANSFORM}`); install `zstandard` "
            "(pip install 'ckpttool[zstd]') to read it"
        ) from None
    parts, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
            while part := reader.read(min(DECOMPRESS_BLOCK, max_output + 1 - size)):
                parts.append(part)
                size += len(part)
                if size > max_output:
                    raise CorruptBlob(f"{where}: zstd stream expands beyond {max_output} bytes, more than "
                                      "the metadata allows for it; refusing to decompress the rest")
    except zstandard.ZstdError as error:
        raise CorruptBlob(f"{where}: zstd stream does not decompress ({error})") from None
    return b"".join(parts)


def _decode_chunk(files: DataFiles, tensor: Tensor, chunk: Chunk) -> bytes:
    """Slow path: materialise the chunk through torch (transforms, strides, big-endian)."""
    where = _where(files, tensor, chunk)
    assert chunk.blob is not None  # `locate` refused a chunk without one
    data = blob_bytes(files, chunk.blob, where, chunk.numel * tensor.itemsize + RECORD_SLACK)
    loaded = load_torch_bytes(data, where)
    import torch

    if not isinstance(loaded, torch.Tensor):
        raise CorruptBlob(f"{where}: blob does not hold a tensor")
    _check_record(where, tensor, chunk, str(loaded.dtype).removeprefix("torch."), tuple(loaded.shape))
    return tensor_bytes(loaded)


def decode_object(data: bytes, where: str) -> Any:
    """Return the python value of a torch.save'd non-tensor entry (param_groups, step, ...).

    Plain values (numbers, strings, None, lists, tuples, dicts) are unpickled through an
    allowlist without importing torch; anything else (torch.Size, tensors, other classes) is
    handed to `torch.load(weights_only=True)`, which also words the error for a broken blob.
    """
    try:
        return read_plain_object(data, where)
    except PickleRefused as error:  # a budget or rule broken: torch.load would build the bomb
        raise CorruptBlob(f"{where}: {error}") from None
    except (CheckpointError, pickle.UnpicklingError, ValueError, EOFError,
            KeyError, TypeError, AttributeError, IndexError, OverflowError):
        return load_torch_bytes(data, where)


def load_torch_bytes(data: bytes, where: str) -> Any:
    """Decode a torch.save blob with `weights_only=True` (never runs code from the file).

    torch.save never compresses a record's entries; one that claims to be compressed (a
    deflate bomb torch's reader would expand whole) is refused before torch sees it.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            packed = [info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        packed = []  # not a zip Python can read: torch's reader words the error
    if packed:
        raise CorruptBlob(f"{where}: torch.save record entry {packed[0]} is compressed, which torch.save never "
                          "does; refusing to decompress it")
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CorruptBlob(f"{where}: torch.save blob refused by torch.load(weights_only=True): "
                          f"{_torch_reason(str(error))}; ckpttool never runs code from a checkpoint") from None
    except Exception as error:
        raise CorruptBlob(f"{where}: unreadable torch.save blob ({type(error).__name__}: "
                          f"{_torch_reason(str(error))})") from None


def _numpy_globals() -> list:
    """What a numpy array of numbers pickles as (numpy's RNG state in Megatron-LM's and many
    trainers' `rng_state`): torch's own advice for weights_only loads of such arrays. Object
    arrays hold values the same checking loader built; nothing else of numpy is admitted."""
    try:
        import numpy as np
    except ImportError:
        return []
    reconstruct = getattr(np, "_core", np.core).multiarray._reconstruct
    numeric = [type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"]
    return [reconstruct, np.ndarray, np.dtype, *numeric]


def _torch_reason(message: str) -> str:
    """The cause in torch's error, on one line, without its advice to load with weights_only=False."""
    cause = message.split("WeightsUnpickler error:", 1)[-1].split(" Please ", 1)[0]
    line = " ".join(cause.split()).rstrip(".")
    return line if len(line) <= 200 else line[:197] + "..."


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
