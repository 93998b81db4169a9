"""Read a DCP `.metadata` file safely into our own frozen types.

torch writes `.metadata` with `pickle.dump(Metadata)`; torch reads it back with plain
`pickle.load`, which would run any code a hostile checkpoint carries. We unpickle through an
allowlist that maps each admitted class to a small stand-in of our own, so this module never
imports torch and never executes anything from the file.

Example:
    >>> ckpt = read_checkpoint("runs/x/step-00000020")
    >>> ckpt.tensors["model.tok_emb.weight"].shape
    (256, 64)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import math
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator, NamedTuple

from ckpttool import dtypes
from ckpttool.errors import CorruptMetadata, NotACheckpoint, UnsafeMetadata

METADATA_FILENAME = ".metadata"  # torch/distributed/checkpoint/filesystem.py `_metadata_fn`
RANK_METADATA_PATTERN = re.compile(r"^__(\d+)\.metadata$")  # written when use_collectives=False
DATA_FILE_PATTERN = re.compile(r"^__(\d+)_(\d+)\.distcp$")  # `__{rank}_{n}.distcp`
MAX_METADATA_BYTES = 4 << 30  # a metadata pickle larger than this is refused before reading

# Top-level state-dict keys and the group they belong to.
MODEL_KEYS = ("model",)
OPTIMIZER_KEYS = ("optim", "optimizer", "optimizers")


# ---------------------------------------------------------------------------------------------
# Our types


# Blob and Chunk are NamedTuples rather than frozen dataclasses: a checkpoint can hold
# 100k+ of each, and a NamedTuple is built about 5x faster.


class Blob(NamedTuple):
    """Where an entry's bytes sit: a byte range of one data file, plus stream transforms."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


class Chunk(NamedTuple):
    """A box of a tensor: `offsets` and `sizes` per dimension, and the blob holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob | None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Tensor:
    """A tensor entry of the checkpoint: its global shape, dtype and chunks."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtypes.ITEMSIZE.get(self.dtype, 0)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Object:
    """A non-tensor entry (torch.save'd bytes: ints, floats, lists, param_groups, ...)."""

    fqn: str
    blob: Blob | None


@dataclass(frozen=True)
class Checkpoint:
    """Everything `.metadata` says, in our own types. Entries are sorted by fqn."""

    path: Path
    metadata_file: str
    version: str | None
    tensors: dict[str, Tensor]
    objects: dict[str, Object]
    # fqn -> path of keys in the nested state dict (torch's planner_data); empty when absent.
    nesting: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # blobs in the storage table that no tensor or object refers to (torch never writes these)
    orphan_blobs: tuple[tuple[str, Blob], ...] = ()
    # entries the storage table mentions for unknown fqns
    save_id: str | None = None
    # problems found while converting, kept for `validate` (e.g. unknown dtype names)
    notes: tuple[str, ...] = ()

    def entries(self) -> Iterator[Tensor | Object]:
        """Yield tensors and objects in fqn order."""
        names = sorted(set(self.tensors) | set(self.objects))
        for name in names:
            yield self.tensors.get(name) or self.objects[name]

    def data_files(self) -> list[str]:
        """Return the relative data-file paths referenced by any blob, sorted."""
        files = {c.blob.file for t in self.tensors.values() for c in t.chunks if c.blob}
        files |= {o.blob.file for o in self.objects.values() if o.blob}
        return sorted(files)


def group_of(fqn: str) -> str:
    """Return `model`, `optimizer` or `other` from an fqn's top-level key."""
    top = fqn.split(".", 1)[0]
    if top in MODEL_KEYS:
        return "model"
    if top in OPTIMIZER_KEYS:
        return "optimizer"
    return "other"


# ---------------------------------------------------------------------------------------------
# The restricted unpickler


class _Record:
    """Stand-in for an admitted torch dataclass: pickle fills its `__dict__`, nothing runs.

    No `__setstate__`, so pickle's BUILD updates `__dict__` in C (fast for 100k records).
    Fields are read with `_field`, never as attributes, so a crafted state cannot shadow
    methods.
    """

    kind = "record"

    def __init__(self, *args: Any) -> None:
        self.__dict__["_args"] = args


class _TensorProperties(_Record):
    """TensorProperties pickles its state as a tuple (dtype, layout, ...)."""

    kind = "TensorProperties"

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


def _field(record: Any, name: str, default: Any = None) -> Any:
    return record.__dict__.get(name, default)


def _record_class(name: str) -> type:
    if name == "TensorProperties":
        return _TensorProperties
    return type(name, (_Record,), {"kind": name})


@dataclass(frozen=True)
class _DType:
    name: str


class _Shape(tuple):
    """A tuple of ints already checked while unpickling `torch.Size`."""


@functools.lru_cache(maxsize=1 << 16)
def _size(values: Any = ()) -> tuple[int, ...]:
    # shapes and chunk offsets repeat across tensors, so checking each distinct one once
    # keeps 100k-chunk metadata fast
    if not isinstance(values, tuple) or any(type(v) is not int for v in values):
        raise CorruptMetadata(f"torch.Size holds non-integers: {values!r:.80}")
    return _Shape(values)


def _path(*parts: Any) -> str:
    return str(PurePosixPath(*[str(p) for p in parts]))


def _windows_path(*parts: Any) -> str:
    return str(PureWindowsPath(*[str(p) for p in parts]))


def _layout(name: Any) -> str:
    return str(name)


def _memory_format_encoding(value: Any) -> int:
    return int(value)


# torch/distributed/checkpoint/metadata.py `_MEM_FORMAT_ENCODING` members, by name
_MEMORY_FORMAT_MEMBERS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


def _enum_member(owner: Any, name: Any) -> int:
    """`getattr(_MEM_FORMAT_ENCODING, NAME)`: how CPython 3.11.0-3.11.4 pickle an enum member
    (Debian bookworm's default Python writes metadata this way). Nothing else is reachable."""
    if owner is _memory_format_encoding and isinstance(name, str) and name in _MEMORY_FORMAT_MEMBERS:
        return _MEMORY_FORMAT_MEMBERS[name]
    raise UnsafeMetadata(f"refuses getattr({name!r:.60}) on anything but a _MEM_FORMAT_ENCODING member; "
                         "nothing from the file was executed")


_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    # TensorProperties lived here before torch 2.2
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._fsspec_filesystem",
)
_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_StorageInfo",
    "_StoragePrefix",
)
_RECORD_TYPES = {name: _record_class(name) for name in _METADATA_CLASSES}
_STORAGE_INFO = _RECORD_TYPES["_StorageInfo"]
_CHUNK = _RECORD_TYPES["ChunkStorageMetadata"]

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("pathlib", "WindowsPath"): _windows_path,
    ("pathlib", "PureWindowsPath"): _windows_path,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "getattr"): _enum_member,
}
for _module in _METADATA_MODULES:
    for _name, _cls in _RECORD_TYPES.items():
        _ALLOWED[(_module, _name)] = _cls
    _ALLOWED[(_module, "_MEM_FORMAT_ENCODING")] = _memory_format_encoding


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that admits only the names in `allowed`; anything else is refused."""

    def __init__(
        self,
        file: io.BufferedIOBase,
        allowed: dict[tuple[str, str], Any],
        source: str,
        persistent: Any = None,
    ):
        super().__init__(file)
        self._allowed = allowed
        self._source = source
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and not name.startswith("_"):
            try:
                return _DType(dtypes.canonical(name))
            except KeyError:
                pass
            if name.endswith("_format") or name in ("strided", "sparse_coo"):
                return _DType(name)
            # an unknown torch dtype attribute from a newer torch: keep the name, flag it later
            if name.islower() and name.replace("_", "").isalnum():
                return _DType(name)
        raise UnsafeMetadata(
            f"{self._source}: refuses to load `{module}.{name}`, which is not part of DCP "
            "metadata; nothing from the file was executed (the checkpoint is corrupt or "
            "was crafted to run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeMetadata(f"{self._source}: unexpected persistent id in pickle")
        return self._persistent(pid)


def _unpickle_metadata(raw: bytes, source: str) -> Any:
    try:
        return RestrictedUnpickler(io.BytesIO(raw), _ALLOWED, source).load()
    except UnsafeMetadata:
        raise
    except RecursionError as error:
        raise CorruptMetadata(f"{source}: metadata pickle nests too deeply ({error})") from None
    except Exception as error:  # pickle raises many kinds on truncated or garbage input
        raise CorruptMetadata(
            f"{source}: cannot decode DCP metadata ({type(error).__name__}: {error}); "
            "the file is truncated or not a DCP .metadata file"
        ) from None


# ---------------------------------------------------------------------------------------------
# Conversion into our types


def find_metadata_file(path: Path) -> Path:
    """Return the `.metadata` file of a checkpoint directory (or the lowest `__N.metadata`)."""
    if not path.exists():
        raise NotACheckpoint(f"{path}: no such directory")
    if not path.is_dir():
        raise NotACheckpoint(f"{path}: not a directory (pass the checkpoint directory)")
    main = path / METADATA_FILENAME
    if main.is_file():
        return main
    per_rank = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := RANK_METADATA_PATTERN.match(p.name))
    )
    if per_rank:
        return per_rank[0][1]
    inside = _checkpoints_inside(path)
    if inside:
        latest = _latest_pointer(path)
        shown = ", ".join(inside[-MAX_LISTED_CHECKPOINTS:])
        more = f"{len(inside) - MAX_LISTED_CHECKPOINTS} more, " if len(inside) > MAX_LISTED_CHECKPOINTS else ""
        pick = latest if latest in inside else inside[-1]
        raise NotACheckpoint(
            f"{path}: a directory of checkpoints ({more}{shown}"
            f"{f'; latest: {latest}' if latest in inside else ''}), not a checkpoint itself: "
            f"pass one of them, e.g. {path / pick}"
        )
    raise NotACheckpoint(
        f"{path}: no {METADATA_FILENAME} file, so this is not a DCP checkpoint "
        "(or the save did not finish: torch writes .metadata last)"
    )


MAX_LISTED_CHECKPOINTS = 5  # checkpoints named in the "directory of checkpoints" error


def _checkpoints_inside(path: Path) -> list[str]:
    """Return the names of subdirectories that hold a `.metadata`, in natural order."""
    try:
        names = [p.name for p in path.iterdir() if (p / METADATA_FILENAME).is_file()]
    except OSError:
        return []
    return sorted(names, key=lambda name: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)])


def _latest_pointer(path: Path) -> str | None:
    """Return what a `latest` file (train_minimal, many trainers) names, if it is small text."""
    pointer = path / "latest"
    try:
        if pointer.is_file() and pointer.stat().st_size < 4096:
            return Path(pointer.read_text().strip()).name
    except (OSError, UnicodeDecodeError):
        pass
    return None


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Return the checkpoint's metadata as our types, reading only `.metadata`.

    Raises NotACheckpoint, UnsafeMetadata or CorruptMetadata; never runs code from the file.
    """
    root = Path(path)
    metadata_path = find_metadata_file(root)
    size = metadata_path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptMetadata(f"{metadata_path}: {size} bytes is implausibly large for DCP metadata")
    if size == 0:
        raise CorruptMetadata(f"{metadata_path}: empty file (the save was interrupted?)")
    raw = metadata_path.read_bytes()
    with paused_gc():
        record = _unpickle_metadata(raw, str(metadata_path))
        try:
            return _convert(root, metadata_path, record)
        except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as error:
            raise CorruptMetadata(
                f"{metadata_path}: malformed DCP metadata ({type(error).__name__}: {error})"
            ) from None


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects.

    Building 100k+ chunk records triggers collections over and over although none form
    cycles; pausing it makes reading large metadata about 4x faster.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _kind(obj: Any) -> str:
    return obj.kind if isinstance(obj, _Record) else type(obj).__name__


def _require(obj: Any, kind: str, where: str, source: Path) -> _Record:
    if _kind(obj) != kind:
        raise CorruptMetadata(f"{source}: expected {kind} at {where}, found {_kind(obj)}")
    return obj


def _int_tuple(value: Any, where: str, source: Path) -> tuple[int, ...]:
    if type(value) is _Shape:
        return value
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CorruptMetadata(f"{source}: {where} is not a sequence of integers: {value!r:.80}")
    return tuple(value)


def _convert(root: Path, source: Path, record: Any) -> Checkpoint:
    metadata = _require(record, "Metadata", "top level", source)
    entries = _field(metadata, "state_dict_metadata")
    if not isinstance(entries, dict):
        raise CorruptMetadata(f"{source}: Metadata.state_dict_metadata is missing or not a dict")
    storage = _field(metadata, "storage_data") or {}
    if not isinstance(storage, dict):
        raise CorruptMetadata(f"{source}: Metadata.storage_data is not a dict")

    blobs: dict[tuple[str, tuple[int, ...] | None], Blob] = {}
    metadata_index = _RECORD_TYPES["MetadataIndex"]
    for index, info in storage.items():
        if type(index) is not metadata_index:
            _require(index, "MetadataIndex", "a storage_data key", source)
        fields = index.__dict__
        fqn, offset = fields.get("fqn"), fields.get("offset")
        if offset is not None and type(offset) is not _Shape:
            offset = _int_tuple(offset, f"{fqn} storage offset", source)
        blobs[(fqn, offset)] = _blob(info, fqn, source)

    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    notes: list[str] = []
    used: set[tuple[str, tuple[int, ...] | None]] = set()
    for fqn in sorted(entries):
        entry = entries[fqn]
        if not isinstance(fqn, str):
            raise CorruptMetadata(f"{source}: state_dict_metadata key {fqn!r:.80} is not a string")
        kind = _kind(entry)
        if kind == "BytesStorageMetadata":
            key = (fqn, None)
            used.add(key)
            objects[fqn] = Object(fqn, blobs.get(key))
            continue
        if kind != "TensorStorageMetadata":
            raise CorruptMetadata(f"{source}: {fqn}: unknown storage metadata type {kind}")
        tensor, keys, note = _tensor(fqn, entry, blobs, source)
        used |= keys
        tensors[fqn] = tensor
        if note:
            notes.append(note)

    orphans = tuple(sorted(((k[0], b) for k, b in blobs.items() if k not in used), key=str))
    nesting = _field(metadata, "planner_data")
    storage_meta = _field(metadata, "storage_meta")
    save_id = _field(storage_meta, "save_id") if isinstance(storage_meta, _Record) else None
    return Checkpoint(
        path=root,
        metadata_file=source.name,
        version=_field(metadata, "version"),
        tensors=tensors,
        objects=objects,
        nesting=_nesting(nesting) if isinstance(nesting, dict) else {},
        orphan_blobs=orphans,
        save_id=save_id if isinstance(save_id, str) else None,
        notes=tuple(notes),
    )


def _nesting(planner_data: dict) -> dict[str, tuple[str | int, ...]]:
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, keys in planner_data.items():
        if isinstance(fqn, str) and isinstance(keys, (tuple, list)):
            if all(isinstance(k, (str, int)) for k in keys):
                out[fqn] = tuple(keys)
    return out


def _blob(info: Any, fqn: Any, source: Path) -> Blob:
    # the hot loop of large metadata: no f-strings unless something is wrong
    if type(info) is not _STORAGE_INFO:
        _require(info, "_StorageInfo", f"storage entry of {fqn}", source)
    state = info.__dict__
    file, offset, length = state.get("relative_path"), state.get("offset"), state.get("length")
    transforms = state.get("transform_descriptors")
    if type(file) is not str:
        raise CorruptMetadata(f"{source}: {fqn}: storage relative_path is not a string")
    if type(offset) is not int or type(length) is not int:
        raise CorruptMetadata(f"{source}: {fqn}: storage offset or length is not an integer")
    if not transforms:
        return Blob(file, offset, length, ())
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise CorruptMetadata(f"{source}: {fqn}: transform_descriptors is not a list of strings")
    return Blob(file, offset, length, tuple(transforms))


def _tensor(
    fqn: str, entry: _Record, blobs: dict, source: Path
) -> tuple[Tensor, set, str | None]:
    properties = _field(entry, "properties")
    dtype_name, note = "unknown", None
    if isinstance(properties, _Record):
        state = _field(properties, "_state")
        dtype = state[0] if isinstance(state, tuple) and state else _field(properties, "dtype")
        if isinstance(dtype, _DType):
            dtype_name = dtype.name
    if dtype_name not in dtypes.ITEMSIZE:
        note = f"{fqn}: unknown dtype {dtype_name!r}"
    shape = _int_tuple(_field(entry, "size"), f"{fqn} size", source)
    raw_chunks = _field(entry, "chunks")
    if not isinstance(raw_chunks, (list, tuple)):
        raise CorruptMetadata(f"{source}: {fqn}: chunks is not a list")
    chunks = []
    keys = set()
    for position, raw in enumerate(raw_chunks):
        if type(raw) is not _CHUNK:
            _require(raw, "ChunkStorageMetadata", f"{fqn} chunk {position}", source)
        fields = raw.__dict__
        offsets, sizes = fields.get("offsets"), fields.get("sizes")
        if type(offsets) is not _Shape:
            offsets = _int_tuple(offsets, f"{fqn} chunk {position} offsets", source)
        if type(sizes) is not _Shape:
            sizes = _int_tuple(sizes, f"{fqn} chunk {position} sizes", source)
        key = (fqn, offsets)
        keys.add(key)
        chunks.append(Chunk(offsets, sizes, blobs.get(key)))
    chunks.sort(key=lambda c: c.offsets)
    return Tensor(fqn, dtype_name, shape, tuple(chunks)), keys, note
