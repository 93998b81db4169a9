"""The torch.save record of one tensor (DCP's blob per chunk), written and read; and reading
the record of a plain python object (DCP's blob per non-tensor entry).

Writing lays a record out around its data so the raw bytes can stream straight from a source
checkpoint into `data/0` without being decoded, and only the CRC-32 (computed while they
stream) completes it:

    layout = record_layout("float32", (5, 8))
    write_at(fd, layout.head, offset)                  # everything before data/0's bytes
    ... stream layout.data_length bytes to offset + layout.data_offset, computing crc ...
    write_at(fd, layout.tail(crc), offset + layout.data_offset + layout.data_length)

Reading parses the record's zip directory and its `data.pkl` (through an allowlist, never
executing it) to learn the tensor's dtype, shape and where its bytes are, so they can be
copied as they are; `find_record_problems` is what `validate --deep` checks of each record. Both
take a `read(start, count)` callable and the record's length, so they serve any byte source.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

from ckpttool.core import dtypes
from ckpttool.core.errors import CheckpointError, CorruptBlob, CorruptMetadata
from ckpttool.safepickle import RestrictedUnpickler
from ckpttool.torchsave import archive, native
from ckpttool.torchsave.pickle import dumps
from ckpttool.torchsave.zip import (LOCAL, LOCAL_MAGIC, UNSUPPORTED_FLAGS, Entry, Read, entry_bytes, entry_data_offset,
                                    entry_in, find_entry, read_directory)

MAX_PICKLE_BYTES = 64 << 20  # a torch.save data.pkl for one tensor is a few hundred bytes
CRC_IN_LOCAL_HEADER, CRC_IN_CENTRAL_HEADER = 14, 16  # APPNOTE.TXT: a header's crc-32 field, from its start


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one tensor's torch.save record: `head`, the data, then `tail(crc)`."""

    head: bytes
    data_length: int
    archive_layout: archive.Layout
    tail_patches: "_TailPatches"

    @property
    def length(self) -> int:
        return self.archive_layout.length

    @property
    def data_offset(self) -> int:
        """Where `data/0`'s bytes start, relative to the record."""
        return len(self.head)

    def tail(self, crc32: int) -> bytes:
        """Return the bytes after the data, given the CRC-32 of the data."""
        return self.tail_patches.tail(crc32)


@dataclass(frozen=True)
class _TailPatches:
    """A record's tail for any data CRC-32: the tail written for CRC 0, cut where the fields
    that depend on the CRC go (the data's CRC in its descriptor and central header; the
    serialization id, a digest of every entry's CRC, and its own CRC in both places).

    `segments` are the template's bytes between those fields and `fields` says which goes
    after each segment (DATA_CRC, IDENTITY or IDENTITY_CRC): a tail is one join, not a copy
    of the template patched in place (3x faster; a reshard makes 300k of them)."""

    segments: tuple[bytes, ...]
    fields: tuple[int, ...]
    crcs_before: bytes  # of the entries before data/0, in write order, packed as uint32s
    crcs_after: bytes  # of those after it, but for the serialization id
    # blake2b of `crcs_before`, copied for each tail (`archive.serialization_id_from`)
    digest_before: Any = field(default=None, compare=False, repr=False)

    DATA_CRC, IDENTITY, IDENTITY_CRC = 0, 1, 2

    def __post_init__(self) -> None:
        if self.digest_before is None:
            object.__setattr__(self, "digest_before",
                               hashlib.blake2b(self.crcs_before, digest_size=archive.SERIALIZATION_DIGEST))

    @classmethod
    def of(cls, layout: archive.Layout, data_end: int) -> "_TailPatches":
        template = b"".join(data for offset, data in archive.writes(layout, [0]) if offset >= data_end)

        def read(offset: int, length: int) -> bytes:
            if offset < data_end:
                raise ValueError("the directory lies after the data")
            return template[offset - data_end:offset - data_end + length]

        central = {entry.name: entry.central_offset for entry in read_directory(read, data_end + len(template), "layout").values()}
        storage, identity = layout.storages[0], layout.entries[-1]
        crcs = [zlib.crc32(data) if data is not None else None for data in layout.contents[:-1]]
        index = layout.entries.index(storage)
        identity_at = identity.data_offset - data_end
        fields = sorted([
            (storage.data_offset + storage.size + 4 - data_end, cls.DATA_CRC, 4),
            (central[storage.name] + CRC_IN_CENTRAL_HEADER - data_end, cls.DATA_CRC, 4),
            (identity_at, cls.IDENTITY, len(archive.serialization_id_of(b""))),  # 40 digits
            (identity.data_offset + identity.size + 4 - data_end, cls.IDENTITY_CRC, 4),
            (central[identity.name] + CRC_IN_CENTRAL_HEADER - data_end, cls.IDENTITY_CRC, 4),
        ])
        segments, at = [], 0
        for start, _, length in fields:
            segments.append(template[at:start])
            at = start + length
        segments.append(template[at:])
        return cls(tuple(segments), tuple(kind for _, kind, _ in fields),
                   struct.pack(f"<{index}I", *crcs[:index]), struct.pack(f"<{len(crcs) - index - 1}I", *crcs[index + 1:]))

    def tail(self, crc32: int) -> bytes:
        crc = crc32.to_bytes(4, "little")
        digest = self.digest_before.copy()
        digest.update(crc + self.crcs_after)
        identity = archive.serialization_id_from(digest)
        values = (crc, identity, zlib.crc32(identity).to_bytes(4, "little"))
        s, f = self.segments, self.fields  # five fields, always (`of`)
        return b"".join((s[0], values[f[0]], s[1], values[f[1]], s[2], values[f[2]], s[3], values[f[3]], s[4],
                         values[f[4]], s[5]))


@functools.lru_cache(maxsize=4096)
def record_layout(dtype: str, shape: tuple[int, ...]) -> RecordLayout:
    """Return the layout of the torch.save record of a contiguous `dtype` tensor of `shape`.

    Example:
        >>> layout = record_layout("float32", (5, 8))
        >>> layout.data_offset % 64, layout.data_length
        (0, 160)
    """
    if sys.byteorder != "little":
        raise NotImplementedError("writing checkpoints on a big-endian host is not supported")
    data_length = math.prod(shape) * dtypes.ITEMSIZE[dtype]
    layout = archive.lay_out(dumps(archive.tensor("0", dtype, shape)), [data_length])
    data_offset = layout.storages[0].data_offset
    head = b"".join(data for offset, data in archive.writes(layout, [0]) if offset < data_offset)
    return RecordLayout(head, data_length, layout, _TailPatches.of(layout, data_offset + data_length))


def record_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """Return a whole torch.save record holding `data` (small tensors, tests)."""
    layout = record_layout(dtype, tuple(shape))
    if len(data) != layout.data_length:
        raise ValueError(f"{len(data)} bytes given for a {dtype} tensor of shape {list(shape)}")
    return layout.head + data + layout.tail(zlib.crc32(data))


@dataclass(frozen=True)
class TensorRecord:
    """What a torch.save record of one tensor says about itself."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
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
            and self.stride == archive.contiguous_strides(self.shape)
        )


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


# what a one-tensor data.pkl may name; the allowlist's stand-ins record, they never build
_TENSOR_PICKLE_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageClass(None),
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): tuple,
    **{("torch", name): _StorageClass(dtype) for name, dtype in dtypes.STORAGE_CLASS_DTYPE.items()},
}


def _persistent_storage(pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CorruptBlob(f"unexpected persistent id {pid!r:.80} in torch.save record")
    _, storage_class, key, _location, numel = pid
    if not isinstance(storage_class, _StorageClass) or not isinstance(numel, int):
        raise CorruptBlob(f"unexpected storage {pid!r:.80} in torch.save record")
    return _Storage(storage_class.dtype, str(key), numel)


def parse_tensor_record(read: Read, length: int, where: str, offset: int = 0) -> TensorRecord:
    """Return what the torch.save record of `length` bytes holds, without reading its tensor
    bytes: `read(start, count)` returns the record's bytes at `start`; `offset` is where the
    record starts in its file (TensorRecord.data_offset counts from the file's start)."""
    return _parse(read, length, where, offset)[0]


def _parse(read: Read, length: int, where: str, offset: int) -> tuple[TensorRecord, list[Entry], Entry]:
    """`parse_tensor_record`, also returning the zip entries and the one of the tensor's data."""
    entries = read_directory(read, length, where)
    pickle_entry = find_entry(entries, "data.pkl")
    if pickle_entry is None:
        raise CorruptBlob(f"{where}: torch.save record has no data.pkl")
    raw = entry_bytes(read, length, pickle_entry, where, MAX_PICKLE_BYTES)
    try:
        unpickler = RestrictedUnpickler(io.BytesIO(raw), _TENSOR_PICKLE_ALLOWED, where, persistent=_persistent_storage)
        rebuilt = unpickler.load()
    except (CorruptBlob, CorruptMetadata):
        raise
    except Exception as error:
        raise CorruptBlob(f"{where}: cannot decode torch.save record ({type(error).__name__}: {error})") from None
    if not isinstance(rebuilt, _Rebuilt) or not isinstance(rebuilt.storage, _Storage):
        raise CorruptBlob(f"{where}: torch.save record does not hold a single tensor")
    dtype = rebuilt.dtype or rebuilt.storage.dtype or "unknown"
    itemsize = dtypes.ITEMSIZE.get(dtype, 1)
    storage_bytes = rebuilt.storage.numel * (itemsize if rebuilt.storage.dtype else 1)
    data_entry = find_entry(entries, f"data/{rebuilt.storage.key}")
    if data_entry is None:
        raise CorruptBlob(f"{where}: torch.save record misses its storage data/{rebuilt.storage.key}")
    if data_entry.size != storage_bytes:
        raise CorruptBlob(f"{where}: storage holds {data_entry.size} bytes but its header says {storage_bytes}")
    byteorder_entry = find_entry(entries, "byteorder")
    byteorder = "little"
    if byteorder_entry is not None:
        byteorder = entry_bytes(read, length, byteorder_entry, where, 16).decode("ascii", "replace")
    data_offset = offset + entry_data_offset(read, length, data_entry, where)
    record = TensorRecord(dtype=dtype, shape=rebuilt.shape, stride=rebuilt.stride,
                          storage_offset=rebuilt.storage_offset, data_offset=data_offset,
                          data_length=data_entry.size, crc32=data_entry.crc32, byteorder=byteorder)
    return record, list(entries.values()), data_entry


class ParsedRecords:
    """`parse_tensor_record` for the many records of one data file, parsing each layout once.

    The records of one checkpoint differ, apart from their data, only in CRC-32s (of the
    data, and of `.data/serialization_id`, which torch derives from it): a chunk of the same
    dtype and shape gets the same zip layout and data.pkl. The parse is a function of the
    bytes it reads; so when a record has the length of one parsed before and every byte range
    that parse read holds the same bytes in it, apart from the entries' CRC-32 fields (which
    the parse ignores, but for the data's in the central directory, which it returns), the
    parse would read the same ranges and reach the same result: that result is reused, with
    this record's offset and CRC-32. Anything else is parsed in full. Keeps at most
    MAX_LAYOUTS layouts; not thread-safe (one per file walk).

    Example:
        >>> records = ParsedRecords()
        >>> [records.parse(read, length, where, offset) for read, length, where, offset in file_records]
    """

    MAX_LAYOUTS = 64

    def __init__(self) -> None:
        self._layouts: dict[int, list[_Layout]] = {}  # by record length
        self._kept = 0
        self._words: dict[int, list] = {}  # `_Layout.words` by id of a kept layout

    @property
    def layouts(self) -> int:
        """How many layouts are kept."""
        return self._kept

    def parse(self, read: Read, length: int, where: str, offset: int = 0) -> TensorRecord:
        """Return `parse_tensor_record(read, length, where, offset)`."""
        for layout in self._layouts.get(length, ()):
            try:
                record = layout.reuse(read, offset)
            except CheckpointError:  # a read past the file's end: the parse's own reads say which
                break
            if record is not None:
                return record
        reads: list[tuple[int, bytes]] = []

        def logged(start: int, count: int) -> bytes:
            data = read(start, count)
            reads.append((start, bytes(data)))
            return data

        record, entries, data_entry = _parse(logged, length, where, offset)
        if self._kept < self.MAX_LAYOUTS:
            new_layout = _Layout.of(record, offset, entries, data_entry, reads)
            if new_layout is not None:
                self._layouts.setdefault(length, []).append(new_layout)
                self._kept += 1
        return record

    def match_block(self, block: Any, starts: Any, length: int, skip: int = 0) -> tuple[Any, Any, list[tuple[TensorRecord, int]]]:
        """`parse` for many records at once, where a layout parsed before can be reused:
        `block` is a uint8 numpy array holding at least 8 bytes past each record's end (any
        values), `starts` an int64 array of where records of `length` bytes start in it.
        Returns, per record, the number of the layout its bytes are (-1: parse it alone) and
        the data's CRC-32 (int64, 0 where -1), and per layout of `length` (its record, the
        data's offset in the record): `parse` would return that record with the record's own
        offset and CRC-32. The first `skip` layouts are not compared (the caller compared them
        before).

        The bytes compared are those `_Layout.reuse` compares and the zip local header's
        signature every reused record starts with (`_Layout.words`), as 8-byte words under
        a mask (zero over the CRC-32 fields, the data and the bytes no parse read).
        """
        import numpy as np

        layouts = self._layouts.get(length, [])
        which = np.full(len(starts), -1, dtype=np.int64)
        crcs = np.zeros(len(starts), dtype=np.int64)
        found = [(layout.record, layout.data_start) for layout in layouts]
        if len(layouts) <= skip or not len(starts):
            return which, crcs, found

        def gathered(at: Any, width: int) -> Any:  # the `width` bytes at each of `at`, a (len(at), width) copy
            windows = np.ndarray((len(block) - width + 1, width), np.uint8, buffer=block, strides=(1, 1))
            return windows[at]

        pending = np.ones(len(starts), dtype=bool)
        for number, layout in enumerate(layouts[skip:], skip):
            runs = self._words.get(id(layout))
            if runs is None:
                runs = self._words[id(layout)] = layout.words(length)
            candidates = np.flatnonzero(pending)
            if not len(candidates):
                break
            if not runs:  # the parse read past the record's end: `reuse` alone decides
                continue
            at = starts[candidates]
            if native.records is not None:  # the same comparison in C, without the copies
                same = np.frombuffer(native.records.match(block, np.ascontiguousarray(at, np.int64), runs), dtype=bool)
            else:
                same = np.ones(len(candidates), dtype=bool)
                for first, end, expected, mask in runs:  # only the words compared are copied
                    part = gathered(at + first * 8, (end - first) * 8).view("<u8")
                    if mask is not None:
                        part &= mask
                    same &= (part == expected).all(axis=1)
            hit = candidates[same]
            if not len(hit):
                continue
            which[hit] = number
            pending[hit] = False
            crcs[hit] = gathered(starts[hit] + layout.crc_at, 4).view("<u4")[:, 0]
        return which, crcs, found


SPAN_GAP = 4096  # ranges a parse read this close together are read again as one (the bytes between are not compared)


@dataclass(frozen=True)
class _Layout:
    """What a full parse read and found: `spans` are (start, length, pieces) record-relative
    ranges to read again, each piece (from, to, bytes) a part of the span that must hold
    the same bytes; the CRC-32 fields are the gaps between pieces."""

    spans: tuple[tuple[int, int, tuple[tuple[int, int, bytes], ...]], ...]
    crc_at: int  # of the data entry's central directory crc-32 field
    record: TensorRecord
    data_start: int  # TensorRecord.data_offset - the record's offset

    @classmethod
    def of(cls, record: TensorRecord, offset: int, entries: list[Entry], data_entry: Entry,
           reads: list[tuple[int, bytes]]) -> "_Layout | None":
        """Return the layout of a parsed record, or None when a CRC-32 field that was read lies
        in more than one of the ranges read, or partly in one, or two fields overlap
        (structures that overlap: never reused)."""
        crc_at = data_entry.central_offset + CRC_IN_CENTRAL_HEADER
        fields = {entry.central_offset + CRC_IN_CENTRAL_HEADER for entry in entries}
        fields |= {entry.local_offset + CRC_IN_LOCAL_HEADER for entry in entries}
        cuts = sorted(cut for cut in fields if any(start < cut + 4 and cut < start + len(data) for start, data in reads))
        if any(b < a + 4 for a, b in zip(cuts, cuts[1:])):
            return None
        if any(sum(start < cut + 4 and cut < start + len(data) for start, data in reads) > 1 for cut in cuts):
            return None
        if not any(start <= crc_at and crc_at + 4 <= start + len(data) for start, data in reads):
            return None
        spans: list[tuple[int, int, list]] = []
        for start, data in sorted(set(reads)):
            pieces, at = [], 0
            for cut in (cut - start for cut in cuts):
                if 0 <= cut and cut + 4 <= len(data):
                    pieces.append((at, cut, data[at:cut]))
                    at = cut + 4
                elif -4 < cut < len(data):
                    return None
            pieces.append((at, len(data), data[at:]))
            if spans and start <= spans[-1][0] + spans[-1][1] + SPAN_GAP:  # read with the previous range
                shift = start - spans[-1][0]
                spans[-1] = (spans[-1][0], max(spans[-1][1], shift + len(data)), spans[-1][2])
                spans[-1][2].extend((shift + begin, shift + end, piece) for begin, end, piece in pieces)
            else:
                spans.append((start, len(data), pieces))
        return cls(tuple((start, length, tuple(p for p in pieces if p[2])) for start, length, pieces in spans),
                   crc_at, record, record.data_offset - offset)

    def reuse(self, read: Read, offset: int) -> TensorRecord | None:
        """Return the parse of the record `read` reads, at `offset` of its file, when its bytes
        are this layout's; else None."""
        for start, length, pieces in self.spans:
            data = read(start, length)
            for begin, end, expected in pieces:
                if data[begin:end] != expected:
                    return None
        record = self.record
        return TensorRecord(record.dtype, record.shape, record.stride, record.storage_offset,
                            offset + self.data_start, record.data_length,
                            int.from_bytes(read(self.crc_at, 4), "little"), record.byteorder)

    def words(self, length: int) -> list[tuple[int, int, Any, Any]]:
        """Return the bytes `reuse` compares in a record of `length` bytes, and the zip
        local header signature at its start, as runs of 8-byte words: (first word, end word,
        expected words, mask words), the mask all ones over the bytes compared and zero
        elsewhere (the expected words zero there too; None for a run compared whole); []
        when no record would match."""
        import numpy as np

        width = -(-length // 8) * 8
        template = np.zeros(width, dtype=np.uint8)
        mask = np.zeros(width, dtype=np.uint8)
        for start, span, pieces in self.spans:
            if start + span > length:
                return []
            for begin, end, expected in pieces:
                template[start + begin:start + end] = np.frombuffer(expected, np.uint8)
                mask[start + begin:start + end] = 0xFF
        if self.crc_at + 4 > length:
            return []
        # and the record starts with a zip local header (`match_block` reuses no other)
        signature = np.frombuffer(LOCAL_MAGIC, np.uint8)
        if ((mask[:len(signature)] != 0) & (template[:len(signature)] != signature)).any():
            return []
        template[:len(signature)], mask[:len(signature)] = signature, 0xFF
        template, mask = template.view("<u8"), mask.view("<u8")
        used = np.flatnonzero(mask)
        if not len(used):  # nothing read (cannot happen: a parse reads the end record)
            return []
        # words used lying within RUN_GAP words of each other form one run (fewer array calls)
        cuts = np.flatnonzero(np.diff(used) > RUN_GAP) + 1
        runs = []
        for run in np.split(used, cuts):
            first, end = int(run[0]), int(run[-1]) + 1
            bits = mask[first:end].copy()
            runs.append((first, end, template[first:end] & bits, None if (bits == np.uint64(0xFFFFFFFFFFFFFFFF)).all() else bits))
        return runs


RUN_GAP = 8  # words: unused words between two used ones below this are compared under a zero mask


def find_record_problems(read: Read, length: int, where: str, skip_largest: bool) -> list[tuple[str, str]]:
    """Return what is wrong with the torch.save record of `length` bytes that `read(start,
    count)` reads, as (kind, message) pairs:
    kind "checksum" for an entry whose bytes do not match its CRC-32, "structure" for what
    torch's PyTorchStreamReader would refuse (entries outside one `<name>/` folder, a missing
    `data.pkl` or `version`, a local header that is damaged or names another entry).

    With `skip_largest` the largest entry (a tensor's data, checked while it streams) is left
    out and only the bytes around it are read: two reads per record, whatever its size.
    """
    try:
        entries = list(read_directory(read, length, where).values())
    except CorruptBlob as error:
        return [("structure", str(error))]
    problems = []
    folders = {entry.name.split("/", 1)[0] for entry in entries}
    if len(folders) != 1 or any("/" not in entry.name for entry in entries):
        problems.append(("structure", f"{where}: record entries are not all in one folder ({', '.join(sorted(e.name for e in entries)[:6])})"))
    by_name = {entry.name: entry for entry in entries}
    # torch's reader wants data.pkl and a version record (`version`, or `.data/version`)
    for required, alternatives in (("data.pkl", ("data.pkl",)), ("version", ("version", ".data/version"))):
        if all(find_entry(by_name, name) is None for name in alternatives):
            problems.append(("structure", f"{where}: record has no {required} entry"))
    for entry in entries:  # what miniz (torch's zip reader) refuses when it opens an archive
        if entry.method != 0 or entry.size != entry.uncompressed_size:
            problems.append(("structure", f"{where}: zip entry {entry.name} is not stored uncompressed (method {entry.method}, {entry.size} of {entry.uncompressed_size} bytes)"))
        if entry.flags & UNSUPPORTED_FLAGS or entry.disk not in (0, 1):  # miniz: this disk, or 1
            problems.append(("structure", f"{where}: zip entry {entry.name} has damaged flags or disk fields"))
        if entry.local_offset + LOCAL.size + entry.size > length:
            problems.append(("structure", f"{where}: zip entry {entry.name} runs past the end of its record"))
    largest = max(entries, key=lambda entry: entry.size, default=None)
    if largest is None:
        return problems
    # only a tensor's data is checked while it streams; data.pkl may be the largest entry
    skip_largest = skip_largest and "/data/" in largest.name
    regions = [(0, length)]
    if skip_largest:
        try:
            data_start = entry_data_offset(read, length, largest, where)
        except CheckpointError as error:
            return problems + [("structure", str(error))]
        regions = [(0, data_start), (data_start + largest.size, length)]
    buffers = [(start, read(start, end - start)) for start, end in regions if end > start]
    for entry in entries:
        if skip_largest and entry is largest:
            continue
        content = entry_in(buffers, entry)
        if content is None:
            problems.append(("structure", f"{where}: zip entry {entry.name} has a damaged local header"))
        elif zlib.crc32(content) != entry.crc32:
            problems.append(("checksum", f"{where}: record entry {entry.name} does not match its CRC-32 (bytes changed on disk)"))
    return problems


@dataclass
class NumpyDType:
    """`numpy.dtype(name, align, copy)` + BUILD (version, byte order, ...), recorded."""

    name: str = ""
    byteorder: str = "="

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) >= 2 and isinstance(state[1], str)):
            raise ValueError("numpy dtype state is not (version, byte order, ...)")
        self.byteorder = state[1]


@dataclass
class NumpyArray:
    """A numpy array inside a pickled value (numpy's RNG state in Megatron-LM's `rng_state`):
    `numpy._core.multiarray._reconstruct(ndarray, ...)` then BUILD with (version, shape, dtype,
    fortran order, raw bytes). Recorded as those fields, compared by them; numpy never runs."""

    shape: tuple[int, ...] = ()
    dtype: NumpyDType | None = None
    fortran: bool = False
    data: bytes = b""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[1], tuple)
                and isinstance(state[2], NumpyDType) and isinstance(state[3], bool) and isinstance(state[4], bytes)):
            raise ValueError("numpy array state is not (version, shape, dtype, fortran, bytes)")
        _, self.shape, self.dtype, self.fortran, self.data = state


_NDARRAY = NumpyDType("ndarray")  # `numpy.ndarray`: only passed to _reconstruct


def _numpy_dtype(name: Any, *flags: Any) -> NumpyDType:
    if not isinstance(name, str):
        raise ValueError("numpy dtype named by something other than a string")
    return NumpyDType(name)


def _latin1_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    """`_codecs.encode(text, "latin1")`: how pickle protocol 2 writes bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError("_codecs.encode other than of a string to latin1")
    return text.encode("latin1")


def _numpy_reconstruct(subtype: Any, shape: Any, code: Any) -> NumpyArray:
    if subtype is not _NDARRAY:
        raise ValueError("numpy _reconstruct of something other than ndarray")
    return NumpyArray()


_PLAIN_OBJECT_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    # numpy arrays of plain numbers (numpy's RNG state), recorded by the stand-ins above
    **{(module, "_reconstruct"): _numpy_reconstruct for module in ("numpy._core.multiarray", "numpy.core.multiarray")},
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _numpy_dtype,
    ("_codecs", "encode"): _latin1_bytes,
}


def read_plain_object(data: bytes, where: str) -> Any:
    """Return the value in a whole torch.save record of plain data (numbers, strings, None,
    lists, tuples, dicts), unpickled through an allowlist without torch.

    Raises CheckpointError (UnsafeMetadata for a value that names any other class) or the
    error pickle raises on a damaged pickle.
    """

    def read(offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > len(data):
            raise CorruptBlob(f"{where}: zip record points past the end of the blob")
        return data[offset:offset + length]

    entry = find_entry(read_directory(read, len(data), where), "data.pkl")
    if entry is None:
        raise CorruptBlob(f"{where}: torch.save record has no data.pkl")
    pickled = entry_bytes(read, len(data), entry, where, MAX_PICKLE_BYTES)
    return RestrictedUnpickler(io.BytesIO(pickled), _PLAIN_OBJECT_ALLOWED, where).load()
