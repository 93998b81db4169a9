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
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ckpttool.checkpoint import paused_gc
from ckpttool.formats.dcp import DATA_FILE_SUFFIX
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
    cls, args = path.__reduce_ex__(2)
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
    """
    fragments = _Fragments()
    state_dict_metadata: dict[str, NewObject] = {}
    # storage_data is keyed by MetadataIndex, equal when fqn and offset are (index is not
    # compared); a repeated key keeps its first MetadataIndex and takes the last value
    storage_data: dict[tuple[str, tuple[int, ...] | None], list] = {}

    def store(fqn: str, offsets: tuple[int, ...] | None, index: int | None, info: tuple) -> None:
        entry = storage_data.setdefault((fqn, offsets), [(fqn, offsets, index), info])
        entry[1] = info

    for tensor in tensors:
        for index, chunk in enumerate(tensor.chunks):
            store(tensor.fqn, tuple(chunk.offsets), index, (chunk.file, chunk.offset, chunk.length, ()))
        state_dict_metadata[tensor.fqn] = NewObject(
            _TENSOR_STORAGE_METADATA,
            {"properties": _tensor_properties(tensor.dtype), "size": _size(tensor.shape),
             "chunks": LazyList(functools.partial(fragments.chunks, tensor.chunks))},
        )
    for obj in objects:
        state_dict_metadata[obj.fqn] = NewObject(_BYTES_STORAGE_METADATA, None)  # empty __dict__
        store(obj.fqn, None, None, (obj.file, obj.offset, obj.length, obj.transforms))

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
            "state_dict_metadata": state_dict_metadata,
            "planner_data": dict(planner_data),
            "storage_data": LazyDict(functools.partial(fragments.storage, list(storage_data.values()))),
            "storage_meta": storage_meta,
            "version": DCP_VERSION,
        },
    )


class _Fragments:
    """The encoded bytes one `metadata_bytes` call reuses: whole chunk entries by box, the
    memo fetches of fqns, file names and torch.Size values, and the fixed parts of
    MetadataIndex and _StorageInfo. Every value is first written in full (which puts its
    strings and classes in the memo); only then are its bytes taken from here."""

    def __init__(self) -> None:
        self.chunk: dict[tuple, bytes] = {}
        self.fetch: dict = {}  # fqn / file name (str) / offsets (tuple: a torch.Size) -> bytes fetching it
        self.index_parts: list[bytes] | None = None
        self.info_parts: list[bytes] | None = None

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

    def _fetch(self, writer: Writer, key: Any, value: Any) -> bytes | None:
        data = self.fetch.get(key)
        if data is None:
            data = writer.fragment(value)
            if data is not None:
                self.fetch[key] = data
        return data

    def storage(self, entries: list, writer: Writer) -> Iterator[tuple[NewObject, NewObject] | Fragment]:
        """Yield storage_data's (MetadataIndex, _StorageInfo) pairs, as one Fragment each once
        their strings and classes are in the memo."""
        for (fqn, offsets, index), (file, offset, length, transforms) in entries:
            if self.index_parts is None or self.info_parts is None:
                self.index_parts = writer.object_parts(_METADATA_INDEX, ("fqn", "index", "offset"))
                self.info_parts = writer.object_parts(_STORAGE_INFO, ("relative_path", "offset", "length"))
            fetch = self.fetch
            name, size, path = fetch.get(fqn), fetch.get(offsets), fetch.get(file)
            if name is None or size is None or path is None:
                if offsets is not None:
                    name, size, path = (self._fetch(writer, fqn, fqn), self._fetch(writer, offsets, _size(offsets)),
                                        self._fetch(writer, file, file))
            if offsets is None or transforms or None in (self.index_parts, self.info_parts, name, size, path):
                yield _metadata_index(fqn, offsets, index), _storage_info(file, offset, length, transforms)
                continue
            key, info = self.index_parts, self.info_parts
            yield Fragment(b"".join((key[0], name, key[1], int_bytes(index), key[2], size, key[3],
                                     info[0], path, info[1], int_bytes(offset), info[2], int_bytes(length), info[3])))

def data_file_name(rank: int) -> str:
    """Return torch's name for rank `rank`'s data file (FileSystemWriter: `__{rank}_{n}.distcp`)."""
    return f"__{rank}_0{DATA_FILE_SUFFIX}"

