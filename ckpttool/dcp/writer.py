"""Write DCP's `.metadata`: the pickle `FileSystemWriter.finish` writes for torch's `Metadata`.

The chunks' blobs are torch.save records (`torchsave.record`); this module describes where
they are, in torch's own dataclasses, pickled from stand-ins (`torchsave.pickle`) so writing
a checkpoint never imports torch. Stock torch (`dcp.load`, `pickle.load`) and ckpttool's
reader load it.

Example:
    >>> step = StoredObject("step", data_file_name(0), 0, 10)
    >>> data = metadata_bytes([], [step], {"step": ("step",)}, Path("out"), "save-1")
    >>> data[:2]   # protocol 2
    b'\\x80\\x02'
"""

from __future__ import annotations

import functools
import pickle
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Iterable, Iterator, Mapping, Sequence, cast

from ckpttool.core.checkpoint import paused_gc
from ckpttool.formats.dcp import DATA_FILE_SUFFIX
from ckpttool.core.geometry import positions_in_groups
from ckpttool.torchsave import native
from ckpttool.torchsave.pickle import Fragment, Global, LazyDict, LazyList, NewObject, Reduce, Writer, dumps, int_bytes


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as it will be recorded: its box and where its blob is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class StoredChunks(Sequence[StoredChunk]):
    """A tensor's chunks as columns (reshard's plan at 300k+ chunks): row `i` is
    `StoredChunk(tuple(offsets[i]), tuple(sizes[i]), files[file[i]], offset[i], length[i])`.
    Equal by identity (its columns are numpy arrays)."""

    offsets: Any  # numpy int64 (n, ndim)
    sizes: Any  # numpy int64 (n, ndim)
    files: tuple[str, ...]
    file: Any  # numpy int64 (n,): index into `files`
    offset: Any  # numpy int64 (n,)
    length: Any  # numpy int64 (n,)

    def __len__(self) -> int:
        return len(self.file)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return StoredChunk(tuple(self.offsets[index].tolist()), tuple(self.sizes[index].tolist()),
                           self.files[int(self.file[index])], int(self.offset[index]), int(self.length[index]))

    def __iter__(self) -> Iterator[StoredChunk]:
        files = self.files
        for offsets, sizes, file, offset, length in zip(self.offsets.tolist(), self.sizes.tolist(), self.file.tolist(),
                                                        self.offset.tolist(), self.length.tolist()):
            yield StoredChunk(tuple(offsets), tuple(sizes), files[file], offset, length)


@dataclass(frozen=True)
class StoredTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[StoredChunk]  # a tuple, or StoredChunks


@dataclass(frozen=True)
class StoredObject:
    fqn: str
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # stream transforms its blob was written with (zstd)


# torch/distributed/checkpoint/filesystem.py CURRENT_DCP_VERSION of torch 2.13.0, the
# version of the Metadata we write (tests check it against the installed torch)
DCP_VERSION = "1.0.0"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA = Global(_METADATA_MODULE, "Metadata")
_TENSOR_STORAGE_METADATA = Global(_METADATA_MODULE, "TensorStorageMetadata")
_TENSOR_PROPERTIES = Global(_METADATA_MODULE, "TensorProperties")
_CHUNK_STORAGE_METADATA = Global(_METADATA_MODULE, "ChunkStorageMetadata")
_BYTES_STORAGE_METADATA = Global(_METADATA_MODULE, "BytesStorageMetadata")
_METADATA_INDEX = Global(_METADATA_MODULE, "MetadataIndex")
_STORAGE_META = Global(_METADATA_MODULE, "StorageMeta")
_STORAGE_INFO = Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_SIZE = Global("torch", "Size")
# torch.strided: copyreg reduces a layout to `torch.serialization._get_layout("torch.strided")`
_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
# TensorProperties.__getstate__ encodes torch.contiguous_format as this enum member
_CONTIGUOUS_FORMAT = Reduce(Global(_METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,))


def _size(values: Sequence[int]) -> Reduce:
    # torch.Size reduces to (torch.Size, (tuple(self),))
    return Reduce(_SIZE, (tuple(values),))


def _tensor_properties(dtype: str) -> NewObject:
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    return NewObject(_TENSOR_PROPERTIES, (Global("torch", dtype), _STRIDED, False, _CONTIGUOUS_FORMAT, False))


def _tensor_storage_metadata(dtype: str, shape: Sequence[int], chunks: LazyList) -> NewObject:
    return NewObject(_TENSOR_STORAGE_METADATA,
                     {"properties": _tensor_properties(dtype), "size": _size(shape), "chunks": chunks})


def _metadata_index(fqn: str, offsets: Sequence[int] | None, index: int | None) -> NewObject:
    # MetadataIndex.__init__ sets fqn, index, then offset only when given
    state: dict[str, Any] = {"fqn": fqn, "index": index}
    if offsets is not None:
        state["offset"] = _size(offsets)
    return NewObject(_METADATA_INDEX, state)


def _storage_info(file: str, offset: int, length: int, transforms: Sequence[str] = ()) -> NewObject:
    # _StorageInfo.__getstate__ leaves out transform_descriptors when it is None (torch
    # writes None for no transforms, else the list of descriptors)
    state: dict[str, Any] = {"relative_path": file, "offset": offset, "length": length}
    if transforms:
        state["transform_descriptors"] = list(transforms)
    return NewObject(_STORAGE_INFO, state)


def _path_object(path: PurePath) -> Reduce:
    # a pathlib path reduces to (its class, its parts)
    cls, args = cast(tuple[type, tuple], path.__reduce_ex__(2))
    return Reduce(Global(cls.__module__, cls.__qualname__), args)


def metadata_bytes(
    tensors: Iterable[StoredTensor],
    objects: Iterable[StoredObject],
    planner_data: Mapping[str, tuple],
    checkpoint_id: PurePath | str | None,
    save_id: str,
) -> bytes:
    """Return a `.metadata` pickle of torch's `Metadata` (version `DCP_VERSION`) for these
    entries, written from stand-ins without importing torch. `planner_data` is the default
    planner's fqn -> key path mapping (torch's loader uses it to nest the flat entries back
    into the state dict).
    """
    with paused_gc():  # many small acyclic stand-ins (see paused_gc)
        return dumps(_metadata_object(tensors, objects, planner_data, checkpoint_id, save_id))


def _metadata_object(tensors, objects, planner_data, checkpoint_id, save_id) -> NewObject:
    """Return the stand-in for torch's `Metadata` (see `metadata_bytes` for the arguments).

    The chunk lists and storage_data are written lazily through `_Fragments`: a chunk (or
    storage entry) whose strings and classes the memo already holds is spliced in from
    cached bytes instead of being built and walked as stand-ins (75 us a chunk otherwise).
    Chunks given as `StoredChunks` are encoded from their columns, all tensors' rows at once.
    """
    tensors = list(tensors)
    rows, spans = _rows(tensors)
    fragments = _Fragments(rows)
    state_dict_metadata: dict[str, NewObject | _ColumnTensor] = {}
    # storage_data is keyed by MetadataIndex, equal when fqn and offset are (index is not
    # compared); a repeated key keeps its first MetadataIndex and takes the last value
    storage_data: dict[Any, Any] = {}

    def store(fqn: str, offsets: tuple[int, ...] | None, index: int | None, info: tuple) -> None:
        entry = storage_data.setdefault((fqn, offsets), [(fqn, offsets, index), info])
        entry[1] = info

    # a tensor's rows are one block of storage_data (no key per chunk) when no other entry
    # can share a key with them: its fqn is no other tensor's and its offsets are distinct
    fqn_counts = Counter(tensor.fqn for tensor in tensors)
    repeated = _repeated_offsets(rows, spans)
    for position, (tensor, span) in enumerate(zip(tensors, spans)):
        if span is None:
            for index, chunk in enumerate(tensor.chunks):
                store(tensor.fqn, tuple(chunk.offsets), index, (chunk.file, chunk.offset, chunk.length, ()))
            chunks = LazyList(functools.partial(fragments.chunks, tensor.chunks))
        else:
            assert rows is not None  # a tensor with a span is one of the rows
            if fqn_counts[tensor.fqn] == 1 and position not in repeated:
                block = _Block(tensor.fqn, *span)
                storage_data[block] = block
            else:
                for row in range(*span):
                    offsets, _ = rows.box(row)
                    store(tensor.fqn, offsets, row - span[0], rows.storage(row))
            # its stand-ins are made only if it is written in full (see _Fragments.tensors)
            state_dict_metadata[tensor.fqn] = _ColumnTensor(tensor.dtype, tuple(tensor.shape), *span)
            continue
        state_dict_metadata[tensor.fqn] = _tensor_storage_metadata(tensor.dtype, tensor.shape, chunks)
    for obj in objects:
        state_dict_metadata[obj.fqn] = NewObject(_BYTES_STORAGE_METADATA, None)  # empty __dict__
        store(obj.fqn, None, None, (obj.file, obj.offset, obj.length, obj.transforms))

    checkpoint: str | Reduce | None
    if checkpoint_id is None or isinstance(checkpoint_id, str):
        checkpoint = checkpoint_id
    elif isinstance(checkpoint_id, PurePath) and type(checkpoint_id).__module__ != "pathlib":
        checkpoint = str(checkpoint_id)  # a URL (storage.RemotePath): torch's FsspecWriter stores the string
    elif isinstance(checkpoint_id, PurePath):
        checkpoint = _path_object(checkpoint_id)
    else:
        raise TypeError(f"checkpoint_id must be a path, a string or None, not {type(checkpoint_id).__name__}")
    storage_meta = NewObject(
        _STORAGE_META, {"checkpoint_id": checkpoint, "save_id": save_id, "load_id": None, "modules": []}
    )
    return NewObject(
        _METADATA,
        {
            "state_dict_metadata": LazyDict(functools.partial(fragments.tensors, list(state_dict_metadata.items()))),
            "planner_data": dict(planner_data),
            "storage_data": LazyDict(functools.partial(fragments.storage, list(storage_data.values()))),
            "storage_meta": storage_meta,
            "version": DCP_VERSION,
        },
    )


@dataclass(frozen=True, eq=False)
class _Rows:
    """The chunks of every tensor given as `StoredChunks`, one row each in the order they are
    written: one numpy pass encodes all of them (per tensor, numpy's call overhead would be
    most of the time at 2,892 tensors of ~120 chunks)."""

    offsets: Any  # numpy int64 (rows, width): a row's values past its ndim are 0
    sizes: Any  # numpy int64 (rows, width)
    ndim: Any  # numpy int64 (rows,)
    file: Any  # numpy int64 (rows,): index into `files`
    offset: Any  # numpy int64 (rows,)
    length: Any  # numpy int64 (rows,)
    index: Any  # numpy int64 (rows,): the chunk's index in its tensor
    files: tuple[str, ...]

    def box(self, row: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Return the row's (offsets, sizes) as Python ints."""
        ndim = int(self.ndim[row])
        return tuple(self.offsets[row, :ndim].tolist()), tuple(self.sizes[row, :ndim].tolist())

    def storage(self, row: int) -> tuple[str, int, int, tuple]:
        """Return the row's (file, offset, length, transforms) as `store` takes them."""
        return self.files[int(self.file[row])], int(self.offset[row]), int(self.length[row]), ()


@dataclass(frozen=True, eq=False)
class _ColumnTensor:
    """A tensor whose chunks are rows `start:stop`, as state_dict_metadata holds it until
    `_Fragments.tensors` writes its TensorStorageMetadata (from cached parts, or in full)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class _Block:
    """storage_data's entries for rows `start:stop`, one tensor's chunks (keyed by identity)."""

    fqn: str
    start: int
    stop: int


def _rows(tensors: Sequence[StoredTensor]) -> tuple[_Rows | None, list[tuple[int, int] | None]]:
    """Return the rows of the tensors whose chunks are `StoredChunks` (None when none are:
    then numpy is not imported), and each tensor's (start, stop) in them (None for a tensor
    given as a tuple)."""
    columns = [tensor.chunks for tensor in tensors if isinstance(tensor.chunks, StoredChunks)]
    if not columns:
        return None, [None] * len(tensors)
    import numpy as np

    counts = [len(chunks) for chunks in columns]
    dims = [np.shape(chunks.offsets)[1] for chunks in columns]
    total, width = sum(counts), max(dims, default=0)
    offsets = np.zeros((total, width), np.int64)
    sizes = np.zeros((total, width), np.int64)
    file = np.zeros(total, np.int64)
    names: dict[str, int] = {}
    remaps: dict[tuple[str, ...], Any] = {}  # a StoredChunks' files -> their index in `names`
    spans: list[tuple[int, int] | None] = []
    start = 0
    for tensor in tensors:
        chunks = tensor.chunks
        if not isinstance(chunks, StoredChunks):
            spans.append(None)
            continue
        stop = start + len(chunks)
        ndim = np.shape(chunks.offsets)[1]
        offsets[start:stop, :ndim] = chunks.offsets
        sizes[start:stop, :ndim] = chunks.sizes
        remap = remaps.get(chunks.files)
        if remap is None:
            remap = remaps[chunks.files] = np.array([names.setdefault(name, len(names)) for name in chunks.files],
                                                    np.int64)
        file[start:stop] = remap[np.asarray(chunks.file, np.int64)]
        spans.append((start, stop))
        start = stop
    return _Rows(
        offsets=offsets,
        sizes=sizes,
        ndim=np.repeat(np.array(dims, np.int64), counts),
        file=file,
        offset=np.concatenate([np.asarray(chunks.offset, np.int64) for chunks in columns] or [np.zeros(0, np.int64)]),
        length=np.concatenate([np.asarray(chunks.length, np.int64) for chunks in columns] or [np.zeros(0, np.int64)]),
        index=positions_in_groups(np.asarray(counts, np.int64)),
        files=tuple(names),
    ), spans


def _repeated_offsets(rows: _Rows | None, spans: Sequence[tuple[int, int] | None]) -> set[int]:
    """Return the positions of the tensors (in `spans`) two of whose rows have the same offsets."""
    if rows is None or len(rows.offsets) < 2:
        return set()
    import numpy as np

    offsets = rows.offsets
    # rows in strictly increasing (lexicographic) order are distinct: the common case, checked
    # at once for all rows; a tensor whose rows are not is checked row by row
    before, after = offsets[:-1], offsets[1:]
    if offsets.shape[1]:
        differ = before != after
        column = differ.argmax(axis=1)  # the first that differs, if any
        pairs = np.arange(len(column))
        increasing = differ[pairs, column] & (after[pairs, column] > before[pairs, column])
    else:  # only 0-d tensors: every offsets is ()
        increasing = np.zeros(len(before), bool)
    unordered = np.flatnonzero(~increasing & (rows.index[1:] > 0)) + 1  # each against the row before, in its tensor
    positions = {span[0]: position for position, span in enumerate(spans) if span is not None}
    repeated = set()
    for first in np.unique(unordered - rows.index[unordered]).tolist():  # the first row of their tensor
        position = positions[first]
        start, stop = cast(tuple[int, int], spans[position])  # `positions` are of tensors with rows
        ndim = int(rows.ndim[start])
        if len(set(map(tuple, offsets[start:stop, :ndim].tolist()))) < stop - start:
            repeated.add(position)
    return repeated


class _Fragments:
    """The encoded bytes one `metadata_bytes` call reuses: whole chunk entries by box, the
    memo fetches of fqns, file names and torch.Size values, and the fixed parts of
    MetadataIndex and _StorageInfo. Every value is first written in full (which puts its
    strings and classes in the memo); only then are its bytes taken from here.

    Rows of `StoredChunks` follow the same rule, encoded by numpy from those fixed parts:
    every chunk entry at once, storage entries in runs between the ones written in full."""

    def __init__(self, rows: _Rows | None) -> None:
        self.chunk: dict[tuple, bytes] = {}
        self.fetch: dict = {}  # fqn / file name (str) / offsets (tuple: a torch.Size) -> bytes fetching it
        self.index_parts: list[bytes] | None = None
        self.info_parts: list[bytes] | None = None
        self.rows = rows  # not None when a column method is called
        self.chunk_rows: tuple[bytes, Any] | None = None  # every row's chunk entry, and where each starts (numpy)
        self.size_head: bytes | None = None  # the fetch of torch.Size
        self.tensor_parts: list[bytes] | None = None  # TensorStorageMetadata's (object_parts)
        self.properties: dict[str, bytes] = {}  # dtype -> its TensorProperties
        self.file_fetch: list[bytes] = [b""] * len(rows.files if rows else ())  # b"": not in the memo yet
        self.unfetched: Any = None  # numpy bool per file of `rows`: not in the memo yet
        self.stale = True  # something was written in full since `unfetched` was brought up to date
        self.all_fetched = False  # the memo holds every file name of `rows`

    def chunks(self, chunks: Sequence[StoredChunk], writer: Writer) -> Iterator[NewObject | Fragment]:
        for chunk in chunks:
            key = (tuple(chunk.offsets), tuple(chunk.sizes))
            data = self.chunk.get(key)
            if data is None:
                value = NewObject(_CHUNK_STORAGE_METADATA, {"offsets": _size(chunk.offsets), "sizes": _size(chunk.sizes)})
                data = writer.fragment(value)
                if data is None:
                    yield value
                    continue
                self.chunk[key] = data
            yield Fragment(data)

    def tensors(self, entries: list, writer: Writer) -> Iterator[tuple[str, Any]]:
        """Yield state_dict_metadata's (fqn, value) pairs: a `_ColumnTensor`'s value as one
        Fragment once the memo holds its classes, keys and dtype and its chunk rows are encoded
        (the fqn, new to the memo, is written as a key always)."""
        for fqn, value in entries:
            if type(value) is not _ColumnTensor:
                yield fqn, value
                continue
            data = self._tensor(value, writer)
            if data is None:
                chunks = LazyList(functools.partial(self.column_chunks, value.start, value.stop))
                yield fqn, _tensor_storage_metadata(value.dtype, value.shape, chunks)
            else:
                yield fqn, Fragment(data)

    def _tensor(self, tensor: _ColumnTensor, writer: Writer) -> bytes | None:
        """Return the bytes of the tensor's TensorStorageMetadata from cached parts, or None
        while the memo lacks some of them (or its chunk rows are not encoded yet)."""
        if self.chunk_rows is None:
            return None
        if self.tensor_parts is None:
            self.tensor_parts = writer.object_parts(_TENSOR_STORAGE_METADATA, ("properties", "size", "chunks"))
        if self.size_head is None:
            self.size_head = writer.fragment(_SIZE)
        properties = self.properties.get(tensor.dtype)
        if properties is None:
            properties = writer.fragment(_tensor_properties(tensor.dtype))
            if properties is not None:
                self.properties[tensor.dtype] = properties
        parts, head = self.tensor_parts, self.size_head
        if parts is None or head is None or properties is None:
            return None
        data, starts = self.chunk_rows
        chunks: tuple = (pickle.EMPTY_LIST,)  # the writer's list: MARK ... APPENDS only around some items
        if tensor.stop > tensor.start:
            chunks = (pickle.EMPTY_LIST + pickle.MARK, memoryview(data)[starts[tensor.start]:starts[tensor.stop]],
                      pickle.APPENDS)
        return b"".join((parts[0], properties, parts[1], head, _tuple_bytes(tensor.shape), _SIZE_TAIL, parts[2],
                         *chunks, parts[3]))

    def column_chunks(self, start: int, stop: int, writer: Writer) -> Iterator[NewObject | Fragment]:
        """Yield the chunk entries of rows `start:stop`: in full until the memo holds their
        class and keys, then the rest as one Fragment."""
        assert self.rows is not None  # column methods are called for rows only
        row = start
        while row < stop and self.chunk_rows is None:
            parts = writer.object_parts(_CHUNK_STORAGE_METADATA, ("offsets", "sizes"))
            size = writer.fragment(_SIZE)
            if parts is None or size is None:
                offsets, sizes = self.rows.box(row)
                yield NewObject(_CHUNK_STORAGE_METADATA, {"offsets": _size(offsets), "sizes": _size(sizes)})
                row += 1
                continue
            rows = self.rows
            self.chunk_rows = _encoded_rows([parts[0], size, (_TUPLE, rows.offsets, rows.ndim), _SIZE_TAIL + parts[1],
                                             size, (_TUPLE, rows.sizes, rows.ndim), _SIZE_TAIL + parts[2]],
                                            len(rows.ndim), starts=True)
        if row < stop:
            assert self.chunk_rows is not None  # the loop above ended by making them
            data, starts = self.chunk_rows
            yield Fragment(data[starts[row]:starts[stop]])

    def _fetch(self, writer: Writer, key: Any, value: Any) -> bytes | None:
        data = self.fetch.get(key)
        if data is None:
            data = writer.fragment(value)
            if data is not None:
                self.fetch[key] = data
        return data

    def storage(self, entries: list, writer: Writer) -> Iterator[tuple[NewObject, NewObject] | Fragment]:
        """Yield storage_data's (MetadataIndex, _StorageInfo) pairs, as one Fragment each once
        their strings and classes are in the memo (a `_Block`'s rows: one Fragment a run)."""
        runs: list[tuple[int, int, bytes]] = []  # rows to encode at once: (start, stop, fetch of their fqn)
        for entry in entries:
            if type(entry) is _Block:
                # past the first uses of every file, a block is one run (the common case, at once)
                name = writer.fetch(entry.fqn) if self.all_fetched else None
                if name is not None:
                    if entry.stop > entry.start:
                        runs.append((entry.start, entry.stop, name))
                else:
                    yield from self._block(entry, runs, writer)
                continue
            if runs:
                yield Fragment(self._storage_rows(runs))
                runs.clear()
            (fqn, offsets, index), (file, offset, length, transforms) = entry
            self._entry_parts(writer)
            fetch = self.fetch
            name, size, path = fetch.get(fqn), fetch.get(offsets), fetch.get(file)
            if name is None or size is None or path is None:
                if offsets is not None:
                    name, size, path = (self._fetch(writer, fqn, fqn), self._fetch(writer, offsets, _size(offsets)),
                                        self._fetch(writer, file, file))
            if (offsets is None or transforms or self.index_parts is None or self.info_parts is None
                    or name is None or size is None or path is None):
                self.stale = True
                yield _metadata_index(fqn, offsets, index), _storage_info(file, offset, length, transforms)
                continue
            key, info = self.index_parts, self.info_parts
            yield Fragment(b"".join((key[0], name, key[1], int_bytes(index), key[2], size, key[3],
                                     info[0], path, info[1], int_bytes(offset), info[2], int_bytes(length), info[3])))
        if runs:
            yield Fragment(self._storage_rows(runs))

    def _block(self, block: _Block, runs: list, writer: Writer) -> Iterator[tuple[NewObject, NewObject] | Fragment]:
        """Add the block's rows to `runs`, but write a row in full (the runs before it first)
        where the memo lacks what it fetches: the first entry's classes and keys, a file's name."""
        assert self.rows is not None  # a _Block is rows
        row = block.start
        while row < block.stop:
            name = self._ready(writer, block.fqn)
            full = row if name is None else self._first_unfetched(row, block.stop, writer)
            if full is None:
                runs.append((row, block.stop, name))
                return
            if full > row:
                runs.append((row, full, name))
            if runs:
                yield Fragment(self._storage_rows(runs))
                runs.clear()
            offsets, _ = self.rows.box(full)
            file, offset, length, _ = self.rows.storage(full)
            self.stale = True
            yield _metadata_index(block.fqn, offsets, full - block.start), _storage_info(file, offset, length)
            row = full + 1

    def _entry_parts(self, writer: Writer) -> None:
        """Take the fixed parts of MetadataIndex and _StorageInfo once the memo holds them."""
        if self.index_parts is None or self.info_parts is None:
            self.index_parts = writer.object_parts(_METADATA_INDEX, ("fqn", "index", "offset"))
            self.info_parts = writer.object_parts(_STORAGE_INFO, ("relative_path", "offset", "length"))

    def _ready(self, writer: Writer, fqn: str) -> bytes | None:
        """Return the fetch of `fqn` when the memo holds it and the classes and keys of every
        storage entry, else None."""
        self._entry_parts(writer)
        if self.size_head is None:
            self.size_head = writer.fragment(_SIZE)
        if self.index_parts is None or self.info_parts is None or self.size_head is None:
            return None
        return self._fetch(writer, fqn, fqn)

    def _first_unfetched(self, start: int, stop: int, writer: Writer) -> int | None:
        """Return the first of rows `start:stop` whose file name the memo lacks, or None."""
        import numpy as np

        assert self.rows is not None  # asked for a _Block's rows
        if self.unfetched is None:
            self.unfetched = np.ones(len(self.rows.files), bool)
        if self.stale:  # only what was written in full can have put a file name in the memo
            for file in np.flatnonzero(self.unfetched).tolist():
                name = self.rows.files[file]
                if name in writer.memo:
                    fetch = writer.fragment(name)
                    assert fetch is not None  # in the memo: only a fetch
                    self.file_fetch[file] = fetch
                    self.unfetched[file] = False
            self.stale = False
            self.all_fetched = not self.unfetched.any()
        if self.all_fetched:  # past the first uses of every file: the common case, without numpy
            return None
        found = np.flatnonzero(self.unfetched[self.rows.file[start:stop]])
        return start + int(found[0]) if len(found) else None

    def _storage_rows(self, runs: Sequence[tuple[int, int, bytes]]) -> bytes:
        """Return the storage entries of these runs of rows, as the per-entry path writes them."""
        import numpy as np

        rows, key, info = self.rows, self.index_parts, self.info_parts
        # a run is added once `_ready` found the entry parts (and a _Block is rows)
        assert rows is not None and key is not None and info is not None and self.size_head is not None
        counts = np.array([stop - start for start, stop, _ in runs], np.int64)
        firsts = np.array([start for start, _, _ in runs], np.int64)
        into = np.cumsum(counts) - counts  # where each run starts among the selected rows
        selected: Any
        if all(runs[number][0] == runs[number - 1][1] for number in range(1, len(runs))):
            selected = slice(runs[0][0], runs[-1][1])  # one range (the common case): views, no copies
        else:
            selected = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(firsts - into, counts)
        run_of_row = np.repeat(np.arange(len(runs)), counts)
        return _encoded_rows([
            key[0], (_FETCH, tuple(name for _, _, name in runs), run_of_row), key[1], (_INT, rows.index[selected]),
            key[2], self.size_head, (_TUPLE, rows.offsets[selected], rows.ndim[selected]), _SIZE_TAIL + key[3],
            info[0], (_FETCH, tuple(self.file_fetch), rows.file[selected]), info[1], (_INT, rows.offset[selected]),
            info[2], (_INT, rows.length[selected]), info[3],
        ], int(counts.sum()))[0]


# A row of `_encoded_rows` is its spec's parts in turn: bytes every row has, or one of these
# over int64 columns (numpy, a value per row): (_INT, values): `int_bytes(values[row])`;
# (_TUPLE, values (rows, width), ndim): `Writer._tuple` of `values[row, :ndim[row]]`, ints;
# (_FETCH, table (tuple of bytes), which): `table[which[row]]` (a memo fetch)
_INT, _TUPLE, _FETCH = 0, 1, 2
_SIZE_TAIL = pickle.TUPLE1 + pickle.REDUCE  # after a torch.Size's tuple (see `_size`)


def _encoded_rows(spec: Sequence, rows: int, starts: bool = False) -> tuple[bytes, Any]:
    """Return the bytes of `rows` rows, each its spec's parts (see above) in turn, and where
    each row starts then the end (numpy int64 (rows + 1,); None unless `starts`). In C
    (`_records.encode_rows`) when it is built, else by numpy: the same bytes."""
    import numpy as np

    merged: list = []
    for part in spec:  # runs of fixed bytes as one; columns as C-contiguous int64
        if isinstance(part, bytes):
            if merged and isinstance(merged[-1], bytes):
                merged[-1] += part
            else:
                merged.append(part)
        elif part[0] == _FETCH:
            merged.append((_FETCH, tuple(part[1]), np.ascontiguousarray(part[2], np.int64)))
        else:
            merged.append((part[0], *(np.ascontiguousarray(column, np.int64) for column in part[1:])))
    if native.records is not None:
        offsets = np.empty(rows + 1, np.int64) if starts else None
        return native.records.encode_rows(merged, rows, offsets), offsets
    segments: list = []
    for part in merged:
        if isinstance(part, bytes):
            segments.append(part)
        elif part[0] == _INT:
            segments.append(_int_column(part[1]))
        elif part[0] == _TUPLE:
            segments += _tuple_segments(part[1], part[2])
        else:
            segments.append(_fetch_column(part[1], part[2]))
    data, lengths = _joined_rows(segments, rows)
    return data, (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) if starts else None)


_TUPLE_OPCODES = pickle.EMPTY_TUPLE + pickle.TUPLE1 + pickle.TUPLE2 + pickle.TUPLE3 + pickle.TUPLE  # by length; 4: more


def _tuple_bytes(values: Sequence[int]) -> bytes:
    """Return the bytes `Writer._tuple` appends for a tuple of ints."""
    ints = b"".join(map(int_bytes, values))
    if len(values) > 3:
        return pickle.MARK + ints + pickle.TUPLE
    return ints + _TUPLE_OPCODES[len(values):len(values) + 1]


# The numpy encoders below (without the C module) build `_joined_rows` segments: bytes every
# row has, or a column of each row's own bytes (numpy uint8 (width, rows): byte j of every row
# together, as filling and masking whole rows of that is ~2x faster than (rows, width); and
# numpy int64 (rows,) lengths).


def _tuple_segments(values: Any, ndim: Any) -> list:
    """Return the segments of `Writer._tuple(row[:ndim])` for each row of `values` (numpy
    (rows, width)): MARK past 3 items, the ints, the tuple opcode."""
    import numpy as np

    rows = len(ndim)
    segments: list = [(np.full((1, rows), pickle.MARK[0], np.uint8), (ndim > 3).astype(np.int64))]
    for column in range(values.shape[1]):
        encoded, lengths = _int_column(values[:, column])
        segments.append((encoded, np.where(ndim > column, lengths, 0)))
    opcodes = np.frombuffer(_TUPLE_OPCODES, np.uint8)[np.minimum(ndim, 4)]
    segments.append((opcodes.reshape(1, rows), np.ones(rows, np.int64)))
    return segments


def _int_column(values: Any) -> tuple[Any, Any]:
    """Return the segment of `int_bytes(value)` for each of `values` (numpy int64)."""
    import numpy as np

    values = np.asarray(values, np.int64)
    rows = len(values)
    little = values.astype("<i8").view(np.uint8).reshape(rows, 8).T
    # 0: BININT1, 1: BININT2, 2: BININT, 3: LONG1
    kind = np.where(values < 0, 2 + (values < -0x80000000),
                    (values > 0xFF).view(np.int8) + (values > 0xFFFF) + (values > 0x7FFFFFFF))
    encoded = np.empty((10, rows), np.uint8)
    encoded[0] = np.frombuffer(pickle.BININT1 + pickle.BININT2 + pickle.BININT + pickle.LONG1, np.uint8)[kind]
    encoded[1:9] = little
    lengths = np.array([2, 3, 5, 0], np.int64)[kind]
    long = kind == 3
    if long.any():
        # LONG1: a length byte, then the fewest little-endian two's-complement bytes (encode_long)
        count = np.ones(rows, np.int64)
        for size in range(1, 8):
            count += (values >= 1 << (8 * size - 1)) | (values < -(1 << (8 * size - 1)))
        encoded[1, long] = count[long]
        encoded[2:10, long] = little[:, long]
        lengths[long] = 2 + count[long]
    return encoded[:int(lengths.max(initial=0))], lengths


def _fetch_column(fetches: Sequence[bytes], which: Any) -> tuple[Any, Any]:
    """Return the segment of `fetches[i]` for each `i` of `which` (numpy int64)."""
    import numpy as np

    width = max(map(len, fetches), default=0)
    table = np.frombuffer(b"".join(data.ljust(width, b"\0") for data in fetches), np.uint8).reshape(len(fetches), width)
    return table.T[:, which], np.array([len(data) for data in fetches], np.int64)[which]


def _joined_rows(segments: Sequence, rows: int) -> tuple[bytes, Any]:
    """Return the bytes of `rows` rows, each its segments' bytes in turn, and each row's length
    (numpy: `encode_rows` does this in C from the columns themselves)."""
    import numpy as np

    merged: list = []
    for segment in segments:  # runs of fixed bytes as one
        if isinstance(segment, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += segment
        else:
            merged.append(segment)
    widths = [len(segment) if isinstance(segment, bytes) else len(segment[0]) for segment in merged]
    # every row at its segments' widest, then the bytes past each row's own lengths left out
    table = np.empty((sum(widths), rows), np.uint8)
    keep = np.empty((sum(widths), rows), bool)
    lengths = np.zeros(rows, np.int64)
    start = 0
    for segment, width in zip(merged, widths):
        stop = start + width
        if isinstance(segment, bytes):
            table[start:stop] = np.frombuffer(segment, np.uint8)[:, None]
            keep[start:stop] = True
            lengths += width
        else:
            encoded, counts = segment
            table[start:stop] = encoded
            np.less(np.arange(width)[:, None], counts, out=keep[start:stop])
            lengths += counts
        start = stop
    return table.T[keep.T].tobytes(), lengths


def data_file_name(rank: int) -> str:
    """Return torch's name for rank `rank`'s data file (FileSystemWriter: `__{rank}_{n}.distcp`)."""
    return f"__{rank}_0{DATA_FILE_SUFFIX}"

