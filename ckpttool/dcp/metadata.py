"""Read a DCP `.metadata` file safely into our own frozen types.

torch writes `.metadata` with `pickle.dump(Metadata)`; torch reads it back with plain
`pickle.load`, which would run any code a hostile checkpoint carries. We unpickle through an
allowlist that maps each admitted class to a small stand-in of our own, so this module never
imports torch and never executes anything from the file.

An allowlist alone does not make a crafted pickle harmless: a few bytes can ask the C
unpickler for gigabytes (a memo slot of 2**31), build structures whose hash or repr recurses
until the process segfaults or runs for ever, or make dict building quadratic with colliding
keys. So every pickle goes through `_Loader`, which walks the opcodes once, iteratively, with a
model of the unpickler's stack and memo, and refuses the pickle before anything is built as
soon as it would exceed one of these budgets:

- the file: `.metadata` must be a regular file of at most `MAX_METADATA_BYTES` (2 GiB, about
  15M chunks; a 100k-chunk checkpoint has 14 MB), read in pieces of `READ_CHUNK_BYTES`.
- memo: a PUT may only fill the next free slot or overwrite a filled one, a GET only read a
  filled one, so the memo never outgrows the objects made.
- nesting: containers (tuples, lists, dicts, sets, objects) nest at most `MAX_NESTING` (16)
  deep; DCP metadata nests 9.
- size: every value, unfolded as a tree (a shared part counted each time it is used), and the
  work of all calls, BUILDs and hashed keys, stay under `TREE_NODES_PER_BYTE` (4) per pickle
  byte plus `TREE_NODES_SLACK`; torch's metadata needs 0.7 per byte.
- objects: at most one new object per `BYTES_PER_OBJECT` (3) pickle bytes plus `OBJECTS_SLACK`;
  torch's metadata makes one per 8 bytes.
- hashing: dict keys and set items are strings, our records (hashed by identity), or at most
  `MAX_UNSALTED_KEYS` ints, floats and flat tuples of ints (their hashes are not salted, so
  colliding ones could make dict building quadratic); torch.Size takes a flat tuple of ints.
- opcodes: protocol 0 text opcodes, DUP, INST/OBJ, NEWOBJ_EX, EXT and out-of-band buffers (which
  torch and pickle.dump at protocol 2+ never write) are refused.

For `.metadata` the loader also builds the objects itself, reading the records torch repeats
100k times (chunks, storage entries, tensor entries) with fast paths; other pickles
(`RestrictedUnpickler`: torch.save records, object blobs) are built by the C unpickler once
the loader accepted them. Every refusal is a one-line `CorruptMetadata` naming the file.

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
import operator
import os
import pickle
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable, Iterator, NamedTuple

from ckpttool import dtypes, storage
from ckpttool.errors import BadName, CorruptMetadata, NotACheckpoint, UnsafeMetadata

METADATA_FILENAME = ".metadata"  # torch/distributed/checkpoint/filesystem.py `_metadata_fn`
RANK_METADATA_PATTERN = re.compile(r"^__(\d+)\.metadata$")  # written when use_collectives=False
DATA_FILE_PATTERN = re.compile(r"^__(\d+)_(\d+)\.distcp$")  # `__{rank}_{n}.distcp`
# a 100k-chunk checkpoint's metadata is ~14 MB; 2 GiB is ~15M chunks
MAX_METADATA_BYTES = 2 << 30
READ_CHUNK_BYTES = 64 << 20

OUR_TRANSFORMS = "ckpttool."  # blob markers of our own readers (blobs.RAW_RANGE_TRANSFORM), never in a file

# Budgets of `scan_pickle` (see the module docstring).
MAX_NESTING = 16
TREE_NODES_PER_BYTE = 4
TREE_NODES_SLACK = 1 << 16
BYTES_PER_OBJECT = 3
OBJECTS_SLACK = 1 << 12
MAX_UNSALTED_KEYS = 4096


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
    # where the layout itself keeps the model (dotted prefix; "" the top level: safetensors files,
    # Hub folders, verl), or None: found from the structure (model_view.find_model)
    model_prefix: str | None = None

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


# ---------------------------------------------------------------------------------------------
# The restricted unpickler


class _Record:
    """Stand-in for an admitted torch dataclass: BUILD fills its `__dict__`, nothing runs.

    Fields are read with `_field`, never as attributes, so a crafted state cannot shadow
    methods; its kind is its class's (`_kind`), never an instance attribute.
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
    """A torch.Size: the loader lets one be built only from a flat tuple of ints.

    Built by calling the class itself, uncached: a cache keyed by the shape would let crafted
    shapes with colliding hashes (ints hash without a salt) make every lookup linear.
    """

    __slots__ = ()


def _path(*parts: str) -> str:
    return str(PurePosixPath(*parts))


def _windows_path(*parts: str) -> str:
    return str(PureWindowsPath(*parts))


def _layout(name: str) -> str:
    return str(name)


def _memory_format_encoding(value: int) -> int:
    return int(value)


# torch/distributed/checkpoint/metadata.py `_MEM_FORMAT_ENCODING`: CPython 3.11.0-3.11.4
# pickle its members by name, as getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
_MEMORY_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


def _enum_member(enum: Any, name: str) -> int:
    """Stand-in for `builtins.getattr`: only a member of the memory format enum, by name."""
    if enum is _memory_format_encoding and type(name) is str and name in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[name]
    raise UnsafeMetadata(f"getattr of something other than a memory format ({type(name).__name__})")


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
_METADATA_INDEX = _RECORD_TYPES["MetadataIndex"]
_TENSOR_STORAGE = _RECORD_TYPES["TensorStorageMetadata"]
_TENSOR_PROPERTIES = _RECORD_TYPES["TensorProperties"]

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _Shape,
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

# Megatron-Core keeps every rank's SavePlan on the Metadata it writes, as `all_local_plans`
# (megatron/core/dist_checkpointing/strategies/state_dict_saver.py:144, to reuse the plan on the
# next save); read as records and never looked at.
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
for _name in ("SavePlan", "WriteItem", "TensorWriteData"):
    _ALLOWED[(_PLANNER_MODULE, _name)] = _record_class(_name)


def _write_item_type(value: int) -> int:
    """Stand-in for the `WriteItemType` enum (SHARD, TENSOR, BYTE_IO), called with its value."""
    return value


_ALLOWED[(_PLANNER_MODULE, "WriteItemType")] = _write_item_type

# OLMo-core's own filesystem writer pickles its copy of torch's storage records
# (olmo_core/distributed/checkpoint/filesystem.py `_StorageInfo(relative_path, offset, length)`,
# `_StoragePrefix(prefix)`, the fields of torch's before transform descriptors were added).
_OLMO_CORE_MODULE = "olmo_core.distributed.checkpoint.filesystem"
for _name in ("_StorageInfo", "_StoragePrefix"):
    _ALLOWED[(_OLMO_CORE_MODULE, _name)] = _RECORD_TYPES[_name]


def _find_allowed(allowed: dict[tuple[str, str], Any], source: str, module: str, name: str) -> Any:
    """Return the stand-in `allowed` maps (module, name) to, or a torch dtype's name; raise
    UnsafeMetadata for anything else."""
    found = allowed.get((module, name))
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
        if len(name) <= 64 and name.islower() and name.replace("_", "").isalnum():
            return _DType(name)
    raise UnsafeMetadata(
        f"{source}: refuses to load `{module:.200}.{name:.200}`, which is not part of "
        "DCP metadata; nothing from the file was executed (the checkpoint is corrupt or "
        "was crafted to run code)"
    )


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that admits only the names in `allowed`; anything else is refused.

    `load` reads the whole file object and checks it with `scan_pickle` (raising
    `PickleRefused`, an `UnpicklingError`, when it exceeds a budget; see the module docstring)
    before the C unpickler builds anything. Verdicts on small pickles are remembered: the
    torch.save records of a checkpoint repeat a few `data.pkl`s.
    """

    def __init__(
        self,
        file: io.BufferedIOBase,
        allowed: dict[tuple[str, str], Any],
        source: str,
        persistent: Any = None,
    ):
        super().__init__(file)
        self._file = file
        self._allowed = allowed
        self._source = source
        self._persistent = persistent

    def load(self) -> Any:
        """Return the unpickled object, built only after `scan_pickle` accepted the bytes."""
        data = self._file.read()
        if not isinstance(data, bytes):
            data = bytes(data)
        persistent = self._persistent is not None
        if len(_PASSED) >= _PASSED_ALLOWLISTS and (id(self._allowed), persistent) not in _PASSED:
            _PASSED.clear()  # a caller passing a new allowlist each time
        passed = _PASSED.setdefault((id(self._allowed), persistent), (self._allowed, set()))[1]
        if data not in passed:
            scan_pickle(data, self.find_class, persistent=persistent)
            if len(data) <= _PASSED_BYTES:
                if len(passed) >= _PASSED_COUNT:
                    passed.clear()
                passed.add(data)
        super().__init__(io.BytesIO(data))
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        return _find_allowed(self._allowed, self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeMetadata(f"{self._source}: unexpected persistent id in pickle")
        return self._persistent(pid)


# small pickles `scan_pickle` accepted, per allowlist (kept alive here) and persistent ids
_PASSED: dict[tuple[int, bool], tuple[dict, set[bytes]]] = {}
_PASSED_BYTES, _PASSED_COUNT, _PASSED_ALLOWLISTS = 4096, 8192, 16


def _unpickle_metadata(raw: bytes | bytearray, source: str) -> Any:
    try:
        find_class = functools.partial(_find_allowed, _ALLOWED, source)
        try:
            return _Loader(raw, find_class, build=True).load()
        except _Fallback:
            return RestrictedUnpickler(io.BytesIO(raw), _ALLOWED, source).load()
    except UnsafeMetadata:
        raise
    except PickleRefused as error:
        if error.exhausts:
            raise CorruptMetadata(
                f"{source}: refused: {error}; nothing was built from it (the file is corrupt, "
                "or was crafted to exhaust memory or time)"
            ) from None
        raise CorruptMetadata(
            f"{source}: cannot decode DCP metadata: {error}; the file is truncated or corrupt"
        ) from None
    except Exception as error:  # pickle raises many kinds on truncated or garbage input
        raise CorruptMetadata(
            f"{source}: cannot decode DCP metadata ({type(error).__name__}: {_clip(str(error))}); "
            "the file is truncated or not a DCP .metadata file"
        ) from None


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# The budget loader: what a pickle builds, checked opcode by opcode before anything is built


class PickleRefused(pickle.UnpicklingError):
    """The pickle would exceed a budget of `scan_pickle` (`exhausts`), or is malformed or uses
    an opcode DCP never writes; nothing was built and nothing from it ran."""

    def __init__(self, message: str, exhausts: bool = False):
        super().__init__(message)
        self.exhausts = exhausts


class _Fallback(Exception):
    """The fast `.metadata` loader met something only the general path models exactly."""


# node kinds
_TUPLE, _LIST, _DICT, _SET, _FROZENSET = "tuple", "list", "dict", "set", "frozenset"
_OBJECT, _RESULT, _GLOBAL, _SIZE = "object", "call result", "global", "torch.Size"


class _Node:
    """What the loader knows of a container or object the unpickler builds.

    `depth` and `size` are its nesting and its size unfolded as a tree; `fresh` is True while
    it may still be filled (a new list, dict, set or object not yet fetched from the memo,
    nor built); `key` says how it hashes (0 not at all, 1 by identity or salted, 2 unsalted);
    `ints` that a tuple or list holds only ints, `keys` only hashable items; `items` keeps a
    short tuple's items (call arguments); `value` is the object itself when the loader builds.
    """

    __slots__ = ("kind", "depth", "size", "fresh", "key", "ints", "keys", "items", "value")

    def __init__(self, kind: str, depth: int = 1, size: int = 1, fresh: bool = False, key: int = 0,
                 ints: bool = False, keys: bool = True, items: tuple | None = None, value: Any = None):
        self.kind, self.depth, self.size, self.fresh, self.key = kind, depth, size, fresh, key
        self.ints, self.keys, self.items, self.value = ints, keys, items, value


_EMPTY_TUPLE = _Node(_TUPLE, key=2, ints=True, items=(), value=())
_SHORT_TUPLE = 64  # tuples up to this length keep their items (call arguments: a path has 10+ parts)
_UNKEPT = object()  # a memo slot the fast loader did not keep (torch never fetches it again)
_UNKEPTS = tuple((_UNKEPT,) * n for n in range(12))


def _key_class(value: Any) -> int:
    """How `value` hashes: 1 salted (str, bytes) or by identity, 2 unsalted, 0 unhashable."""
    kind = type(value)
    if kind is _Node:
        return value.key
    if kind is str or kind is bytes:
        return 1
    if kind is int or kind is float or kind is bool or value is None:
        return 2
    return 1 if kind in _LIGHT_TYPES else 0


def _describe(value: Any) -> str:
    return value.kind if type(value) is _Node or type(value) in _LIGHT_TYPES else type(value).__name__


def _unwrap(value: Any) -> Any:
    return value.value if type(value) is _Node else value


def _measure(items: list) -> tuple[int, int, bool, bool]:
    """Return (depth, tree size, all ints, all hashable) of a container holding `items`."""
    if len(items) > _SHORT_TUPLE:
        kinds = set(map(type, items))
        if kinds <= _LIGHT_SET:  # a batch of records from the fast path
            return 1 + max(map(_depth_of, items)), 1 + sum(map(_last, items)), False, True
    depth, size, ints, keys = 0, 1, True, True
    for value in items:
        if type(value) is _Node:
            if value.depth > depth:
                depth = value.depth
            size += value.size
            ints = False
            if not value.key:
                keys = False
        elif type(value) is int:
            size += 1
        else:
            ints = False
            if type(value) in _LIGHT_TYPES:
                size += value[-1]
                if value[-2] > depth:
                    depth = value[-2]
            else:
                size += 1
                if not _key_class(value):
                    keys = False
    return depth + 1, size, ints, keys


# What a call of each known callable gives, checked on its argument tuple (a _Node); anything
# else allowed gives an opaque result that may not be hashed.


def _call_size(args: _Node) -> _Node:
    items = args.items
    if items is not None and (not items or (len(items) == 1 and type(items[0]) is _Node and items[0].ints)):
        return _Node(_SIZE, 1, args.size, key=2, ints=True)
    raise PickleRefused("torch.Size of something other than a flat tuple of ints")


def _call_empty_dict(args: _Node) -> _Node:
    if args.items == ():
        return _Node(_DICT, fresh=True)
    raise PickleRefused("OrderedDict called with arguments (pickle.dump never writes that)")


def _call_set(kind: str) -> Callable[[_Node], _Node]:
    def call(args: _Node) -> _Node:
        items = args.items
        if items == ():
            return _Node(kind, fresh=kind == _SET)
        inner = items[0] if items is not None and len(items) == 1 else None
        if type(inner) is _Node and inner.kind in (_LIST, _TUPLE) and inner.keys:
            if inner.depth > 2:
                raise PickleRefused(f"a {kind} of containers")
            return _Node(kind, inner.depth, inner.size, fresh=kind == _SET)
        raise PickleRefused(f"{kind} of something other than a list of strings")
    return call


def _call_tuple(args: _Node) -> _Node:
    items = args.items
    if items is not None and len(items) == 1 and type(items[0]) is _Node and items[0].kind in (_LIST, _TUPLE, _SIZE):
        inner = items[0]
        return _Node(_TUPLE, inner.depth, inner.size, key=2 if inner.ints else 0, ints=inner.ints, keys=inner.keys)
    raise PickleRefused("tuple() of something other than a tuple or list")


def _call_slice(args: _Node) -> Any:
    items = args.items
    if items is not None and len(items) <= 3 and all(type(v) is int or v is None for v in items):
        return slice
    raise PickleRefused("slice of something other than ints")


def _call_strings(args: _Node) -> Any:
    if args.items is not None and all(type(v) is str for v in args.items):
        return str
    raise PickleRefused("a path made of something other than strings")


def _call_one_string(args: _Node) -> Any:
    items = args.items
    if items is not None and len(items) == 1 and type(items[0]) is str:
        return str
    raise PickleRefused("a layout named by something other than a string")


def _call_enum_member(args: _Node) -> Any:
    items = args.items
    if (items is not None and len(items) == 2 and type(items[0]) is _Node and items[0].kind == _GLOBAL
            and items[0].value is _memory_format_encoding and items[1] in _MEMORY_FORMATS):
        return int
    raise PickleRefused("getattr of something other than a memory format by name")


def _call_one_int(args: _Node) -> Any:
    items = args.items
    if items is not None and len(items) == 1 and type(items[0]) in (int, bool):
        return int
    raise PickleRefused("a memory format named by something other than an int")


_CALLS: dict[Any, Callable[[_Node], Any]] = {
    _Shape: _call_size,
    dict: _call_empty_dict,
    set: _call_set(_SET),
    frozenset: _call_set(_FROZENSET),
    tuple: _call_tuple,
    slice: _call_slice,
    _path: _call_strings,
    _windows_path: _call_strings,
    _layout: _call_one_string,
    _memory_format_encoding: _call_one_int,
    _enum_member: _call_enum_member,
    _write_item_type: _call_one_int,
}


_SAMPLE = {str: "", int: 0, slice: slice(None)}  # what scanning pushes for a call's atom


def _known_call(function: Any) -> Callable[[_Node], Any] | None:
    try:
        return _CALLS.get(function)
    except TypeError:  # an unhashable allowlisted object: not one of ours
        return None


def _identity_hashed(cls: Any) -> bool:
    return isinstance(cls, type) and cls.__hash__ is object.__hash__


def _plain_new(cls: Any) -> bool:
    # NEWOBJ calls cls.__new__(cls, *args); only object.__new__ is known to ignore the args
    return isinstance(cls, type) and cls.__new__ is object.__new__


(_MARK, _STOP, _POP, _POP_MARK, _NONE, _BININT, _BININT1, _BININT2, _LONG1, _LONG4,
 _BINFLOAT, _SHORT_BINBYTES, _BINBYTES, _BINBYTES8, _SHORT_BINSTRING, _BINSTRING,
 _SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8, _EMPTY_TUPLE_OP, _TUPLE1, _TUPLE2, _TUPLE3,
 _TUPLE_OP, _EMPTY_LIST, _LIST_OP, _EMPTY_DICT, _DICT_OP, _EMPTY_SET, _ADDITEMS, _FROZENSET_OP,
 _NEWOBJ, _GLOBAL_OP, _STACK_GLOBAL, _APPEND, _APPENDS, _BUILD, _BINGET, _LONG_BINGET, _BINPUT,
 _LONG_BINPUT, _MEMOIZE, _SETITEM, _SETITEMS, _BINPERSID, _REDUCE, _PROTO, _FRAME, _NEWTRUE,
 _NEWFALSE) = (op[0] for op in (
    pickle.MARK, pickle.STOP, pickle.POP, pickle.POP_MARK, pickle.NONE, pickle.BININT,
    pickle.BININT1, pickle.BININT2, pickle.LONG1, pickle.LONG4, pickle.BINFLOAT,
    pickle.SHORT_BINBYTES, pickle.BINBYTES, pickle.BINBYTES8, pickle.SHORT_BINSTRING,
    pickle.BINSTRING, pickle.SHORT_BINUNICODE, pickle.BINUNICODE, pickle.BINUNICODE8,
    pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.TUPLE,
    pickle.EMPTY_LIST, pickle.LIST, pickle.EMPTY_DICT, pickle.DICT, pickle.EMPTY_SET,
    pickle.ADDITEMS, pickle.FROZENSET, pickle.NEWOBJ, pickle.GLOBAL, pickle.STACK_GLOBAL,
    pickle.APPEND, pickle.APPENDS, pickle.BUILD, pickle.BINGET, pickle.LONG_BINGET,
    pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE, pickle.SETITEM, pickle.SETITEMS,
    pickle.BINPERSID, pickle.REDUCE, pickle.PROTO, pickle.FRAME, pickle.NEWTRUE,
    pickle.NEWFALSE))

_OPCODE_NAMES = {
    value[0]: name for name, value in vars(pickle).items()
    if name.isupper() and isinstance(value, bytes) and len(value) == 1
}
# Opcodes torch and pickle.dump (protocol 2+) never write.
_REFUSED_OPCODES = frozenset(op[0] for op in (
    pickle.DUP, pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4,
    pickle.PERSID, pickle.GET, pickle.PUT, pickle.INT, pickle.LONG, pickle.FLOAT, pickle.STRING,
    pickle.UNICODE, pickle.BYTEARRAY8, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER,
))


def _opcode_name(op: int) -> str:
    return _OPCODE_NAMES.get(op, f"opcode 0x{op:02x}")


def scan_pickle(data: bytes, find_class: Callable[[str, str], Any], persistent: bool = False) -> None:
    """Check a pickle against the budgets (see the module docstring) without building it.

    Calls `find_class` for each global, as the unpickler will (so a refused name raises its
    error first). Raises `PickleRefused` naming the first budget exceeded.

    Example:
        >>> scan_pickle(b"\\x80\\x02N\\x94r\\xff\\xff\\xff\\x7f.", find_class)
        PickleRefused: LONG_BINPUT to memo slot 2147483647, but only 1 are filled (at byte 4)
    """
    _Loader(data, find_class, persistent=persistent).load()


class _Loader:
    """One pass over a pickle's opcodes with a model of the unpickler's stack and memo.

    It refuses the pickle as soon as a budget would be exceeded. With `build` it also builds
    the objects, calling the allowlisted functions as the C unpickler would (used for
    `.metadata`, with fast paths for the records torch repeats 100k times); without, the C
    unpickler builds them afterwards.
    """

    def __init__(self, data: bytes, find_class: Callable[[str, str], Any], persistent: bool = False,
                 persistent_load: Callable[[Any], Any] | None = None, build: bool = False):
        self.data = data
        self.find_class = find_class
        self.persistent = persistent
        self.persistent_load = persistent_load
        self.build = build
        self.memo: list = []
        self.budget = TREE_NODES_PER_BYTE * len(data) + TREE_NODES_SLACK
        self.max_objects = len(data) // BYTES_PER_OBJECT + OBJECTS_SLACK
        self.objects = 0
        self.work = 0
        self.unsalted_keys = MAX_UNSALTED_KEYS
        self.records = _Records(self) if build else None

    def load(self) -> Any:
        """Return the object built (None unless building)."""
        with paused_gc():
            return _unwrap(self.execute())

    def execute(self) -> Any:
        data, memo, budget, build = self.data, self.memo, self.budget, self.build
        end = len(data)
        max_objects = self.max_objects
        stack: list = []
        marks: list = []
        fence = 0
        push, pop = stack.append, stack.pop
        records = self.records
        pos = op = start = 0

        def refuse(message: str, exhausts: bool = False) -> PickleRefused:
            return PickleRefused(f"{message} (at byte {start})", exhausts)

        def underflow() -> PickleRefused:
            return refuse(f"{_opcode_name(op)} finds too few items on the unpickling stack")

        def pop_mark() -> int:
            nonlocal fence
            if not marks:
                raise refuse(f"{_opcode_name(op)} without a MARK")
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            return mark

        def new_object() -> None:
            self.objects += 1
            if self.objects > max_objects:
                raise refuse(f"builds more than {max_objects} objects ({BYTES_PER_OBJECT} bytes per object allowed)",
                             exhausts=True)

        def spend(amount: int) -> None:
            self.work += amount
            if self.work > budget:
                raise refuse(f"calls, BUILDs and hashed keys take more than {budget} objects of work in all",
                             exhausts=True)

        def nested(depth: int, size: int, kind: str) -> None:
            if depth > MAX_NESTING:
                raise refuse(f"containers nest deeper than {MAX_NESTING} levels", exhausts=True)
            if size > budget:
                raise refuse(f"a {kind} unfolds to more than {budget} objects (shared parts counted each time)",
                             exhausts=True)

        def container(kind: str, items: list, fresh: bool = False) -> _Node:
            depth, size, ints, keys = _measure(items)
            nested(depth, size, kind)
            new_object()
            key = 2 if kind == _TUPLE and ints else 0
            node = _Node(kind, depth, size, fresh, key, ints, keys, tuple(items) if len(items) <= _SHORT_TUPLE else None)
            if build:
                values = [_unwrap(v) for v in items]
                node.value = tuple(values) if kind == _TUPLE else values if kind == _LIST else None
            return node

        def hash_keys(kind: str, keys: list) -> None:
            if len(keys) > _SHORT_TUPLE and set(map(type, keys)) <= _SALTED_KEYS:
                return
            for key in keys:
                if type(key) is not str and type(key) not in _LIGHT_TYPES:
                    grade = _key_class(key)
                    if grade != 1:
                        if not grade:
                            raise refuse(f"a {kind} key that is a {_describe(key)}")
                        if type(key) is _Node and not key.ints:
                            raise refuse(f"a {kind} key that is a tuple of something other than ints")
                        self.unsalted_keys -= 1
                        if self.unsalted_keys < 0:
                            raise refuse(f"more than {MAX_UNSALTED_KEYS} int, float or tuple dict keys or set items",
                                         exhausts=True)
                        spend(key.size if type(key) is _Node else 1)

        def fill(target: Any, kind: str, items: list) -> None:
            if type(target) is not _Node or target.kind != kind or not target.fresh:
                raise refuse(f"{_opcode_name(op)} into a {_describe(target)} that is not a new {kind}")
            pairs = kind == _DICT
            hash_keys(kind, items[0::2] if pairs else items if kind == _SET else ())
            depth, size, ints, keys = _measure(items)
            if depth > target.depth:
                target.depth = depth
            target.size += size - 1
            target.ints = target.ints and ints
            target.keys = target.keys and keys
            nested(target.depth, target.size, kind)
            if build:
                value = target.value
                if _Node in set(map(type, items)):
                    items = [v.value if type(v) is _Node else v for v in items]
                if pairs:
                    value.update(zip(items[0::2], items[1::2]))
                else:
                    (value.extend if kind == _LIST else value.update)(items)

        def text(start: int, count: int, encoding: str = "utf-8") -> str:
            try:
                return data[start:start + count].decode(encoding, "surrogatepass" if encoding == "utf-8" else "strict")
            except UnicodeDecodeError:
                raise refuse(f"a string that is not {encoding}") from None

        def length(width: int, signed: bool = False) -> int:
            count = int.from_bytes(data[pos + 1:pos + 1 + width], "little", signed=signed)
            if count < 0 or pos + 1 + width + count > end:
                raise refuse(f"{_opcode_name(op)} of {count} bytes runs past the end of the pickle")
            return count

        try:
            while pos < end:
                op, start = data[pos], pos
                if op == _MEMOIZE:
                    if len(stack) <= fence:
                        raise underflow()
                    memo.append(stack[-1])
                    pos += 1
                elif op == _BINGET or op == _LONG_BINGET:
                    if records is not None:
                        following = data[pos + (2 if op == _BINGET else 5)]
                        if following == 0x29:  # `)`: a record's class, then NEWOBJ?
                            taken = records.read(pos, stack)
                        elif following in _PATH_ITEM_OPCODES:  # a planner_data fqn, then its path?
                            taken = records.paths(pos, stack)
                        else:
                            taken = 0
                        if taken:
                            pos = taken
                            continue
                    if op == _BINGET:
                        index, pos = data[pos + 1], pos + 2
                    else:
                        index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
                    if index >= len(memo):
                        raise refuse(f"GET of memo slot {index}, but only {len(memo)} are filled")
                    value = memo[index]
                    if type(value) is _Node:
                        value.fresh = False
                    elif value is _UNKEPT:
                        raise _Fallback()
                    push(value)
                elif op == _BININT1:
                    push(data[pos + 1])
                    pos += 2
                elif op == _MARK:
                    fence = len(stack)
                    marks.append(fence)
                    pos += 1
                elif op == _EMPTY_TUPLE_OP:
                    push(_EMPTY_TUPLE)
                    pos += 1
                elif op == _TUPLE1 or op == _TUPLE2 or op == _TUPLE3:
                    count = op - _TUPLE1 + 1
                    if len(stack) - count < fence:
                        raise underflow()
                    items = stack[-count:]
                    del stack[-count:]
                    push(container(_TUPLE, items))
                    pos += 1
                elif op == _EMPTY_DICT or op == _EMPTY_LIST or op == _EMPTY_SET:
                    new_object()
                    kind = _DICT if op == _EMPTY_DICT else _LIST if op == _EMPTY_LIST else _SET
                    value = ({} if op == _EMPTY_DICT else [] if op == _EMPTY_LIST else set()) if build else None
                    push(_Node(kind, fresh=True, ints=True, value=value))
                    pos += 1
                elif op == _SETITEMS or op == _APPENDS or op == _ADDITEMS:
                    mark = pop_mark()
                    if mark <= fence or mark > len(stack):
                        raise underflow()
                    items = stack[mark:]
                    del stack[mark:]
                    if op == _SETITEMS and len(items) % 2:
                        raise refuse("SETITEMS with an odd number of items")
                    fill(stack[mark - 1], _DICT if op == _SETITEMS else _LIST if op == _APPENDS else _SET, items)
                    pos += 1
                elif op == _SETITEM or op == _APPEND:
                    count = 2 if op == _SETITEM else 1
                    if len(stack) - count <= fence:
                        raise underflow()
                    items = stack[-count:]
                    del stack[-count:]
                    fill(stack[-1], _DICT if op == _SETITEM else _LIST, items)
                    pos += 1
                elif op == _NEWOBJ or op == _REDUCE:
                    if len(stack) - 2 < fence:
                        raise underflow()
                    args = pop()
                    function = pop()
                    if type(args) is not _Node or args.kind != _TUPLE:
                        raise refuse(f"{_opcode_name(op)} with arguments that are a {_describe(args)}, not a tuple")
                    if type(function) is not _Node or function.kind != _GLOBAL:
                        raise refuse(f"{_opcode_name(op)} of a {_describe(function)}, not of an allowed global")
                    target = function.value
                    spend(args.size)
                    call = _known_call(target) if op == _REDUCE else None
                    if call is not None:
                        result = call(args)
                        if type(result) is _Node and result.kind in (_SET, _FROZENSET) and args.items:
                            spend(args.size)  # every item hashed
                            self.unsalted_keys -= args.size
                            if self.unsalted_keys < 0:
                                raise refuse(f"more than {MAX_UNSALTED_KEYS} int, float or tuple dict keys or set items",
                                             exhausts=True)
                        if type(result) is _Node:
                            new_object()
                            if build:
                                result.value = target(*args.value)
                            push(result)
                        else:  # an atom of type `result`
                            push(target(*args.value) if build else _SAMPLE[result])
                    elif op == _NEWOBJ and not _plain_new(target):
                        raise refuse(f"NEWOBJ of {_clip(repr(target), 80)}, which is not a plain class")
                    elif not callable(target):
                        raise refuse(f"REDUCE of {_clip(repr(target), 80)}, which is not callable")
                    else:
                        node = container(_OBJECT if isinstance(target, type) else _RESULT, [args], fresh=True)
                        node.key = 1 if _identity_hashed(target) else 0
                        node.items = (target,)  # the class: how BUILD may fill it
                        if build:
                            node.value = target.__new__(target, *args.value) if op == _NEWOBJ else target(*args.value)
                        push(node)
                    pos += 1
                elif op == _BUILD:
                    if len(stack) - 2 < fence:
                        raise underflow()
                    state = pop()
                    target = stack[-1]
                    if type(target) is not _Node or target.kind not in (_OBJECT, _RESULT) or not target.fresh:
                        raise refuse(f"BUILD of a {_describe(target)} that is not a new object")
                    plain = target.kind == _OBJECT and getattr(target.items[0], "__setstate__", None) is None
                    if plain and state is not None and (type(state) is not _Node or state.kind != _DICT):
                        raise refuse(f"BUILD of an object from a {_describe(state)}, not a dict")
                    target.fresh = False
                    if type(state) is _Node:
                        spend(state.size)
                        target.size += state.size
                        if state.depth >= target.depth:
                            target.depth = state.depth + 1
                        nested(target.depth, target.size, "object")
                    if build:
                        _build(target.value, _unwrap(state))
                    pos += 1
                elif op == _BININT2:
                    push(data[pos + 1] | data[pos + 2] << 8)
                    pos += 3
                elif op == _SHORT_BINUNICODE:
                    count = data[pos + 1]
                    if pos + 2 + count > end:
                        raise refuse("SHORT_BINUNICODE runs past the end of the pickle")
                    new_object()
                    push(text(pos + 2, count))
                    pos += 2 + count
                elif op == _BINUNICODE or op == _BINUNICODE8:
                    width = 4 if op == _BINUNICODE else 8
                    count = length(width)
                    new_object()
                    push(text(pos + 1 + width, count))
                    pos += 1 + width + count
                elif op == _SHORT_BINSTRING or op == _BINSTRING:
                    width = 1 if op == _SHORT_BINSTRING else 4
                    count = length(width)
                    new_object()
                    push(text(pos + 1 + width, count, "ascii"))  # the unpickler's default encoding
                    pos += 1 + width + count
                elif op == _SHORT_BINBYTES or op == _BINBYTES or op == _BINBYTES8:
                    width = 1 if op == _SHORT_BINBYTES else 4 if op == _BINBYTES else 8
                    count = length(width)
                    new_object()
                    push(bytes(data[pos + 1 + width:pos + 1 + width + count]))
                    pos += 1 + width + count
                elif op == _NONE:
                    push(None)
                    pos += 1
                elif op == _BININT:
                    push(int.from_bytes(data[pos + 1:pos + 5], "little", signed=True))
                    pos += 5
                elif op == _LONG1 or op == _LONG4:
                    width = 1 if op == _LONG1 else 4
                    count = length(width, signed=op == _LONG4)
                    push(int.from_bytes(data[pos + 1 + width:pos + 1 + width + count], "little", signed=True))
                    pos += 1 + width + count
                elif op == _NEWTRUE or op == _NEWFALSE:
                    push(op == _NEWTRUE)
                    pos += 1
                elif op == _BINFLOAT:
                    if pos + 9 > end:
                        raise refuse("BINFLOAT runs past the end of the pickle")
                    push(struct.unpack(">d", data[pos + 1:pos + 9])[0])
                    pos += 9
                elif op == _TUPLE_OP or op == _LIST_OP or op == _DICT_OP or op == _FROZENSET_OP:
                    mark = pop_mark()
                    if mark < fence:
                        raise underflow()
                    items = stack[mark:]
                    del stack[mark:]
                    if op == _TUPLE_OP:
                        push(container(_TUPLE, items) if items else _EMPTY_TUPLE)
                    elif op == _LIST_OP:
                        push(container(_LIST, items, fresh=True))
                    else:
                        if op == _DICT_OP and len(items) % 2:
                            raise refuse("DICT with an odd number of items")
                        kind = _DICT if op == _DICT_OP else _SET
                        new_object()
                        node = _Node(kind, fresh=True, value=({} if kind == _DICT else set()) if build else None)
                        fill(node, kind, items)
                        if op == _FROZENSET_OP:
                            node.kind, node.fresh = _FROZENSET, False
                            node.value = frozenset(node.value) if build else None
                        push(node)
                    pos += 1
                elif op == _BINPUT or op == _LONG_BINPUT:
                    if op == _BINPUT:
                        index, pos = data[pos + 1], pos + 2
                    else:
                        index, pos = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
                    if pos > end:
                        break
                    if len(stack) <= fence:
                        raise underflow()
                    if index < len(memo):
                        memo[index] = stack[-1]
                        if records is not None:
                            records.forget()  # what was checked of the memo may have changed
                    elif index == len(memo):
                        memo.append(stack[-1])
                    else:
                        raise refuse(f"{_opcode_name(op)} to memo slot {index}, but only {len(memo)} are filled",
                                     exhausts=True)
                elif op == _STACK_GLOBAL or op == _GLOBAL_OP:
                    if op == _STACK_GLOBAL:
                        if len(stack) - 2 < fence:
                            raise underflow()
                        name, module = pop(), pop()
                        if type(name) is not str or type(module) is not str:
                            raise refuse("STACK_GLOBAL of names that are not strings")
                        pos += 1
                    else:
                        first = data.find(b"\n", pos + 1, end)
                        second = data.find(b"\n", first + 1, end) if first >= 0 else -1
                        if second < 0:
                            raise refuse("GLOBAL runs past the end of the pickle")
                        module, name = text(pos + 1, first - pos - 1), text(first + 1, second - first - 1)
                        pos = second + 1
                    new_object()
                    push(_Node(_GLOBAL, 0, 1, key=1, value=self.find_class(module, name)))
                elif op == _POP:
                    if marks and marks[-1] == len(stack):
                        raise refuse("POP of a MARK")
                    if len(stack) <= fence:
                        raise underflow()
                    pop()
                    pos += 1
                elif op == _POP_MARK:
                    del stack[pop_mark():]
                    pos += 1
                elif op == _BINPERSID:
                    if not self.persistent:
                        raise refuse("a persistent id, but this pickle may not have any")
                    if len(stack) <= fence:
                        raise underflow()
                    pid = pop()
                    spend(pid.size if type(pid) is _Node else 1)
                    node = container(_RESULT, [pid])
                    if build:
                        node.value = self.persistent_load(_unwrap(pid))
                    push(node)
                    pos += 1
                elif op == _FRAME:
                    count = int.from_bytes(data[pos + 1:pos + 9], "little")
                    if pos + 9 + count > end:
                        raise refuse(f"FRAME of {count} bytes runs past the end of the pickle")
                    pos += 9
                elif op == _PROTO:
                    if data[pos + 1] > pickle.HIGHEST_PROTOCOL:
                        raise refuse(f"unknown pickle protocol {data[pos + 1]}")
                    pos += 2
                elif op == _STOP:
                    if len(stack) <= fence:
                        raise underflow()
                    return stack[-1]
                elif op in _REFUSED_OPCODES:
                    raise refuse(f"opcode {_opcode_name(op)}, which torch never writes")
                else:
                    raise refuse(f"invalid opcode byte 0x{op:02x}")
            raise refuse("the pickle ends without STOP (truncated)")
        except IndexError:
            raise refuse("the pickle ends in the middle of an opcode (truncated)") from None


def _build(instance: Any, state: Any) -> None:
    """Apply BUILD as the C unpickler does: __setstate__ if the object has one, else update
    its __dict__ (the loader allows only a dict or None then)."""
    setstate = getattr(instance, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    elif state is not None:
        instance.__dict__.update(state)


# Fast paths for what makes up nearly all of a large `.metadata`: tensor entries with their
# chunks, storage keys with their entries, planner_data entries; as torch (protocol 4: a
# MEMOIZE after each object) and our writer (protocol 2: none) pickle them. A record is taken
# only when the memo slots it fetches hold what it assumes (checked once per distinct slots);
# it then pushes and memoizes what the opcode-by-opcode path would and spends the same
# budgets (tests/test_hostile_metadata.py and benchmarks/fuzz_metadata.py check both give the
# same), but builds a light tuple instead of a record and its state dict. Memo slots torch
# never fetches again (records, state dicts, a shape's tuples) are kept as _UNKEPT: fetching
# one hands the file to the general path (the loader without building, then the C unpickler).


class _Light(tuple):
    """A record the fast path built: a tuple of its fields and then the depth and tree size
    of the record the opcode-by-opcode path would build; hashed and compared by identity like
    that record."""

    __slots__ = ()
    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    kind = "record"


class _ChunkBox(_Light):
    """(offsets, sizes, depth, size) of a ChunkStorageMetadata"""

    __slots__ = ()
    kind = "ChunkStorageMetadata"


class _IndexKey(_Light):
    """(fqn, offset, depth, size) of a MetadataIndex"""

    __slots__ = ()
    kind = "MetadataIndex"


class _InfoBox(_Light):
    """(blob, depth, size) of a _StorageInfo"""

    __slots__ = ()
    kind = "_StorageInfo"


class _TensorBox(_Light):
    """(dtype, shape, chunks, depth, size) of a TensorStorageMetadata"""

    __slots__ = ()
    kind = "TensorStorageMetadata"


_LIGHT_TYPES = (_ChunkBox, _IndexKey, _InfoBox, _TensorBox)
_PATH_ITEM_OPCODES = frozenset((_SHORT_BINUNICODE, _BINUNICODE, _BINGET, _LONG_BINGET, _MARK, _BININT1))
_LIGHT_SET = frozenset(_LIGHT_TYPES)
_SALTED_KEYS = frozenset((str, *_LIGHT_TYPES))
_last = operator.itemgetter(-1)
_depth_of = operator.itemgetter(-2)
_new_tuple = tuple.__new__
_ANY_STR, _ANY_INT, _ANY_DTYPE = object(), object(), object()  # what `holds` may expect of a slot


@functools.cache
def _record_patterns(memoize: bytes) -> tuple[re.Pattern, ...]:
    """Return the patterns of a chunk, a storage key (MetadataIndex) followed by its entry
    (_StorageInfo), a lone key, a lone entry and the head of a tensor entry
    (TensorStorageMetadata up to its list of chunks), with `memoize` after each object
    (MEMOIZE for torch, nothing for our writer). Groups hold memo slots fetched (`(h.|j....)`),
    a shape's opcodes, a string fetched or literal, ints; see `_Records.read`."""
    m = re.escape(memoize)
    get = rb"(?:h.|j....)"
    long1 = b"|".join(bytes([n]) + b"." * n for n in range(9))
    int_ = rb"(?:K.|M..|J....|\x8a(?:" + long1 + rb"))"
    # a SHORT_BINUNICODE's length byte and text: the shortest that lets the rest match, so the
    # reader checks the length (a longer text can contain what looks like the rest)
    text = rb".{1,256}?"
    shape = (rb"(?:(?:" + int_ + rb"\x85|" + int_ + rb"{2}\x86|" + int_ + rb"{3}\x87)" + m + rb"|\))"
             rb"\x85" + m + b"R" + m)
    head = get + rb"\)\x81" + m + rb"\}" + m + rb"\(" + get
    string = rb"(?:(" + get + rb")|\x8c(" + text + rb")" + m + b")"
    chunk = rb"(" + head + get + rb")(" + shape + rb")(" + get + get + rb")(" + shape + rb")ub"
    index = rb"(" + head + rb")" + string + rb"(" + get + rb")(?:N|" + int_ + rb")(" + get + get + rb")(" + shape + rb")ub"
    info = rb"(" + head + rb")" + string + rb"(" + get + rb")(" + int_ + rb")(" + get + rb")(" + int_ + rb")ub"
    if memoize:  # torch: layout and memory format fetched, as torch memoized their first REDUCE
        properties = rb"(" + get + rb")(" + get + rb")[\x88\x89](" + get + rb")[\x88\x89]t\x94b"
    else:  # our writer: `_get_layout("torch.strided")` and `_MEM_FORMAT_ENCODING(0)` each time
        properties = rb"(" + get + rb")(" + get + get + rb")\x85R[\x88\x89](" + get + rb")K.\x85R[\x88\x89]tb"
    tensor = (rb"(" + head + get + rb"\)\x81" + m + rb"\()" + properties +
              rb"(" + get + get + rb")(" + shape + rb")(" + get + rb")\]" + m)
    return tuple(re.compile(p, re.DOTALL) for p in (chunk, index + info, index, info, tensor))


_TENSOR_HEAD = 4


def _memo_slots(encoded: bytes) -> list[int]:
    """Return the memo slots the GET opcodes in `encoded` fetch (other opcodes are skipped)."""
    slots, at = [], 0
    while at < len(encoded):
        op = encoded[at]
        if op == _BINGET:
            slots.append(encoded[at + 1])
            at += 2
        elif op == _LONG_BINGET:
            slots.append(int.from_bytes(encoded[at + 1:at + 5], "little"))
            at += 5
        else:
            at += 1
    return slots


def _slot(data: bytes, at: int) -> tuple[int, int]:
    """Return (memo slot, position after) of the BINGET or BINPUT (1-byte slot) or LONG_BINGET
    or LONG_BINPUT (4 bytes) at `at`."""
    if data[at] in (_BINGET, _BINPUT):
        return data[at + 1], at + 2
    return int.from_bytes(data[at + 1:at + 5], "little"), at + 5


def _int_opcode(encoded: bytes) -> int:
    op = encoded[0]
    if op == _BININT:
        return int.from_bytes(encoded[1:5], "little", signed=True)
    if op == _BININT2:
        return encoded[1] | encoded[2] << 8
    if op == _BININT1:
        return encoded[1]
    return int.from_bytes(encoded[2:], "little", signed=True)  # LONG1


class _Records:
    """The loader's fast paths (see the comment above `_Light`): `read` takes runs of records
    (chunks, storage keys with their entries, tensor entries with their chunks), `paths` runs
    of planner_data entries (an fqn and the tuple of keys it nests under)."""

    def __init__(self, loader: _Loader):
        self.loader = loader
        self.memo = loader.memo
        self.checked: dict[tuple, bool] = {}  # memo slots fetched -> do they hold what is assumed
        self.shapes: dict[bytes, tuple] = {}  # a shape's opcodes -> (shape, memo slots, objects, ndim)
        self.lengths: dict[bytes, int] = {}  # an int's opcode -> its value (blob lengths repeat)
        # torch pickles with protocol 4+, a MEMOIZE after each object; our writer with 2, none
        data = loader.data
        self.style = b"\x94" if len(data) > 1 and data[0] == _PROTO and data[1] >= 4 else b""
        self.patterns = _record_patterns(self.style)
        self.next = 0  # which pattern to try first

    def forget(self) -> None:
        self.checked.clear()

    def paths(self, pos: int, stack: list) -> int:
        """Push the planner_data entries from `pos` on (an fqn fetched from the memo, then the
        tuple of keys it nests under) and return the position after them, or 0."""
        loader, memo, data = self.loader, self.memo, self.loader.data
        start, objects = pos, 0
        while True:
            op = data[pos]
            if op == _BINGET:
                index, at = data[pos + 1], pos + 2
            elif op == _LONG_BINGET:
                index, at = int.from_bytes(data[pos + 1:pos + 5], "little"), pos + 5
            else:
                break
            fqn = memo[index] if index < len(memo) else None
            if type(fqn) is not str:
                break
            marked = data[at] == _MARK
            at += marked
            items, saved, made = [], len(memo), 0
            while True:  # the keys: strings (literal or fetched) and ints (list indices)
                op = data[at]
                if op == _SHORT_BINUNICODE or op == _BINUNICODE:
                    start_at = at + 2 if op == _SHORT_BINUNICODE else at + 5
                    end = start_at + (data[at + 1] if op == _SHORT_BINUNICODE else
                                      int.from_bytes(data[at + 1:at + 5], "little"))
                    try:
                        item = data[start_at:end].decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        items = None
                        break
                    if end >= len(data):
                        items = None
                        break
                    made += 1
                    at = end
                elif op == _BINGET or op == _LONG_BINGET:
                    index, at = _slot(data, at)
                    item = memo[index] if index < len(memo) else None
                    if type(item) is not str and type(item) is not int:
                        items = None
                        break
                    items.append(item)
                    continue
                elif op == _BININT1:
                    item, at = data[at + 1], at + 2
                    items.append(item)
                    continue
                else:
                    break
                items.append(item)
                at = self.memoize(at, item)
                if at < 0:
                    items = None
                    break
            count = len(items) if items is not None else 0
            if items is None or not count or count > 255 or (
                    data[at] != _TUPLE_OP if marked else data[at] != _TUPLE1 + count - 1 or count > 3):
                del memo[saved:]
                break
            ints = all(type(item) is int for item in items)
            node = _Node(_TUPLE, 1, 1 + count, False, 2 if ints else 0, ints, True,
                         tuple(items) if count <= _SHORT_TUPLE else None, tuple(items))
            at = self.memoize(at + 1, node)
            if at < 0:
                del memo[saved:]
                break
            stack.append(fqn)
            stack.append(node)
            objects += made + 1
            pos = at
        loader.objects += objects
        if loader.objects > loader.max_objects:
            raise PickleRefused(f"more than {loader.max_objects} objects", exhausts=True)
        return pos if pos != start else 0

    def memoize(self, at: int, value: Any) -> int:
        """Memoize `value` if the opcode at `at` says so (MEMOIZE, or a PUT of the next slot);
        return the position after it, or -1 for a PUT elsewhere."""
        data, memo = self.loader.data, self.memo
        op = data[at]
        if op == _MEMOIZE:
            memo.append(value)
            return at + 1
        if op == _BINPUT or op == _LONG_BINPUT:
            index, after = _slot(data, at)
            if index != len(memo):
                return -1
            memo.append(value)
            return after
        return at

    def holds(self, slots: tuple, expected: tuple) -> bool:
        """True when the memo slots in `slots` (opcode bytes holding GETs) hold what
        `expected` says: a string, a global's object, or any str, int or dtype; cached."""
        known = self.checked.get(slots)
        if known is None:
            memo = self.memo
            indices = [index for encoded in slots for index in _memo_slots(encoded)]
            known = len(indices) == len(expected)
            for index, want in zip(indices, expected):
                value = memo[index] if index < len(memo) else None
                if type(want) is str:
                    known = known and type(value) is str and value == want
                elif want is _ANY_STR or want is _ANY_INT:
                    known = known and type(value) is (str if want is _ANY_STR else int)
                elif want is _ANY_DTYPE:
                    known = known and type(value) is _Node and value.kind == _GLOBAL and type(value.value) is _DType
                else:
                    known = known and type(value) is _Node and value.kind == _GLOBAL and value.value is want
            self.checked[slots] = known
        return known

    def shape(self, encoded: bytes) -> tuple:
        values, at = [], 0
        while encoded[at] in (_BININT1, _BININT2, _BININT, _LONG1):
            width = {_BININT1: 2, _BININT2: 3, _BININT: 5}.get(encoded[at]) or 2 + encoded[at + 1]
            values.append(_int_opcode(encoded[at:at + width]))
            at += width
        count = len(values)
        # memo slots a shape takes: its inner tuple (none for a scalar), the argument tuple,
        # the torch.Size; objects: the same, as the scalar's inner tuple is the empty one
        slots = 0 if not encoded.endswith(b"\x94") else 3 if count else 2
        found = self.shapes[encoded] = (_Shape(values), slots, 3 if count else 2, count)
        return found

    def first(self, pos: int) -> int | None:
        """Return which pattern matches at `pos` (trying the likely one first), or None."""
        data, patterns = self.loader.data, self.patterns
        for which in dict.fromkeys((self.next, 0, 1, 2, 3, 4)):
            if patterns[which].match(data, pos) is not None:
                return which
        return None

    def key(self, pos: int) -> tuple[str, int, bool] | None:
        """Read the string at `pos` (a state_dict_metadata key): return (it, the position after
        it and its memo opcode, whether that memoizes it), or None."""
        data, memo = self.loader.data, self.memo
        op = data[pos]
        if op == _SHORT_BINUNICODE:
            start = pos + 2
            end = start + data[pos + 1]
        elif op == _BINUNICODE:
            start = pos + 5
            end = start + int.from_bytes(data[pos + 1:start], "little")
        elif op == _BINGET or op == _LONG_BINGET:
            index, end = _slot(data, pos)
            value = memo[index] if index < len(memo) else None
            return (value, end, False) if type(value) is str else None
        else:
            return None
        if end >= len(data):
            return None
        try:
            text = data[start:end].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
        op = data[end]
        if op == _MEMOIZE:
            return text, end + 1, True
        if op == _BINPUT or op == _LONG_BINPUT:
            index, after = _slot(data, end)
            return (text, after, True) if index == len(memo) and after <= len(data) else None
        return text, end, False

    def read(self, pos: int, stack: list) -> int:
        """Push the records from `pos` on (as many as follow each other) and return the
        position after them, or 0 when the opcode-by-opcode path must read the next one."""
        which = self.first(pos)
        if which is None:
            return 0
        loader, memo, shapes, data = self.loader, self.memo, self.shapes, self.loader.data
        style, patterns = self.style, self.patterns
        chunk_pattern = patterns[0]
        push, shape, lengths = stack.append, self.shape, self.lengths
        new, unkept, from_bytes = _new_tuple, _UNKEPT, int.from_bytes
        start, objects, work = pos, 0, 0
        # the memo slots last found to hold what each record assumes (checked when they change)
        chunk_head = chunk_tail = key_head = key_key = key_keys = entry_head = entry_key = entry_keys = None
        tensor_slots = dtype_slot = None
        if style:
            tensor_expected = (_TENSOR_STORAGE, "properties", _TENSOR_PROPERTIES, _ANY_STR, _ANY_INT,
                               "size", _Shape, "chunks")
        else:
            tensor_expected = (_TENSOR_STORAGE, "properties", _TENSOR_PROPERTIES, _layout, _ANY_STR,
                               _memory_format_encoding, "size", _Shape, "chunks")
        while True:
            if which == 5:  # a state_dict_metadata key, then a tensor entry
                key = self.key(pos)
                if key is None or patterns[_TENSOR_HEAD].match(data, key[1]) is None:
                    break
                text, after, memoized = key
                if memoized:
                    memo.append(text)
                objects += data[pos] in (_SHORT_BINUNICODE, _BINUNICODE)
                push(text)
                pos, which = after, _TENSOR_HEAD
            match = patterns[which].match(data, pos)
            if match is None:
                which = self.first(pos)
                if which is None:
                    break
                continue
            if which == 0:
                head, first, tail, second = match.groups()
                if head != chunk_head or tail != chunk_tail:
                    if not self.holds((head, tail), (_CHUNK, "offsets", _Shape, "sizes", _Shape)):
                        break
                    chunk_head, chunk_tail = head, tail
                offsets = shapes.get(first) or shape(first)
                sizes = shapes.get(second) or shape(second)
                count = offsets[3] + sizes[3]
                push(new(_ChunkBox, (offsets[0], sizes[0], 3, 9 + count)))
                objects += 2 + offsets[2] + sizes[2]
                work += 12 + 2 * count
                if style:
                    memo += _UNKEPTS[2 + offsets[1] + sizes[1]]
                pos = match.end()
                continue
            if which == _TENSOR_HEAD:
                classes, dtype, layout, memory_format, sized, encoded, listed = match.groups()
                slots = (classes, layout, memory_format, sized, listed)
                if slots != tensor_slots:
                    if not self.holds(slots, tensor_expected):
                        break
                    tensor_slots = slots
                if dtype != dtype_slot:
                    if not self.holds((dtype,), (_ANY_DTYPE,)):
                        break
                    dtype_slot = dtype
                index = dtype[1] if len(dtype) == 2 else from_bytes(dtype[1:], "little")
                size_of = shapes.get(encoded) or shape(encoded)
                end = match.end()
                # the chunks: none, one and APPEND, or batches of MARK ... APPENDS
                chunks, chunk_objects, chunk_work, chunk_slots, chunk_size = [], 0, 0, 0, 0
                batched = data[end] == _MARK
                while True:
                    if batched:
                        if data[end] != _MARK:
                            break
                        end += 1
                    chunk = chunk_pattern.match(data, end)
                    while chunk is not None:
                        head, first, tail, second = chunk.groups()
                        if head != chunk_head or tail != chunk_tail:
                            if not self.holds((head, tail), (_CHUNK, "offsets", _Shape, "sizes", _Shape)):
                                break
                            chunk_head, chunk_tail = head, tail
                        offsets = shapes.get(first) or shape(first)
                        sizes = shapes.get(second) or shape(second)
                        count = offsets[3] + sizes[3]
                        chunks.append(new(_ChunkBox, (offsets[0], sizes[0], 3, 9 + count)))
                        chunk_objects += 2 + offsets[2] + sizes[2]
                        chunk_work += 12 + 2 * count
                        chunk_size += 9 + count
                        chunk_slots += 2 + offsets[1] + sizes[1]
                        end = chunk.end()
                        chunk = chunk_pattern.match(data, end) if batched else None
                    if not batched:
                        if chunks:
                            if data[end] != _APPEND:
                                chunks = None
                            end += 1
                        break
                    if data[end] != _APPENDS:
                        chunks = None
                        break
                    end += 1
                if chunks is None or data[end:end + 2] != b"ub":
                    break
                count = size_of[3]
                state = 15 + count + chunk_size  # the state dict: keys, properties, shape, list
                push(new(_TensorBox, (loader.memo[index].value, size_of[0], chunks, 6 if chunks else 4, 2 + state)))
                objects += (8 if style else 10) - (3 - size_of[2]) + chunk_objects
                work += (10 if style else 14) + count + state + chunk_work
                if style:
                    memo += _UNKEPTS[5 + size_of[1]]
                    memo += (unkept,) * chunk_slots
                pos, which = end + 2, 5
                continue
            # a storage key (which 1, 2), then its entry (which 1, 3): everything is checked
            # before anything is pushed, so a pair that fails halfway leaves no trace
            if which == 1:
                head, get, literal, key, keys, encoded, head2, get2, literal2, key2, offset, keys2, length = match.groups()
            elif which == 2:
                head, get, literal, key, keys, encoded = match.groups()
            else:
                head2, get2, literal2, key2, offset, keys2, length = match.groups()
            if which != 3:
                if head != key_head or key != key_key or keys != key_keys:
                    if not self.holds((head, key, keys), (_METADATA_INDEX, "fqn", "index", "offset", _Shape)):
                        break
                    key_head, key_key, key_keys = head, key, keys
                if get is not None:
                    index = get[1] if len(get) == 2 else from_bytes(get[1:], "little")
                    key_text = memo[index] if index < len(memo) else None
                    if type(key_text) is not str:
                        break
                else:
                    if len(literal) != literal[0] + 1:
                        break
                    try:
                        key_text = literal[1:].decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        break
                offsets = shapes.get(encoded) or shape(encoded)
            if which != 2:
                if head2 != entry_head or key2 != entry_key or keys2 != entry_keys:
                    if not self.holds((head2, key2, keys2), (_STORAGE_INFO, "relative_path", "offset", "length")):
                        break
                    entry_head, entry_key, entry_keys = head2, key2, keys2
                if get2 is not None:
                    index = get2[1] if len(get2) == 2 else from_bytes(get2[1:], "little")
                    entry_text = memo[index] if index < len(memo) else None
                    if type(entry_text) is not str:
                        break
                else:
                    if len(literal2) != literal2[0] + 1:
                        break
                    try:
                        entry_text = literal2[1:].decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        break
                size = lengths.get(length)
                if size is None:
                    size = lengths[length] = _int_opcode(length)
                start_at = (from_bytes(offset[1:], "little", signed=True) if offset[0] == _BININT
                            else _int_opcode(offset))
            if which != 3:
                count = offsets[3]
                push(new(_IndexKey, (key_text, offsets[0], 3, 10 + count)))
                objects += 2 + (get is None) + offsets[2]
                work += 11 + 2 * count
                if style:
                    if get is None:
                        memo += (unkept, unkept, key_text)
                        memo += _UNKEPTS[offsets[1]]
                    else:
                        memo += _UNKEPTS[2 + offsets[1]]
            if which != 2:
                push(new(_InfoBox, (new(Blob, (entry_text, start_at, size, ())), 2, 9)))
                objects += 2 + (get2 is None)
                work += 8
                if style:
                    if get2 is None:
                        memo += (unkept, unkept, entry_text)
                    else:
                        memo += _UNKEPTS[2]
            which = (0, 1, 3, 2)[which]
            pos = match.end()
        self.next = min(which, _TENSOR_HEAD) if which is not None else 0
        loader.objects += objects
        loader.work += work
        if loader.objects > loader.max_objects or loader.work > loader.budget:
            raise PickleRefused(f"more than {loader.max_objects} objects or {loader.budget} units of work", exhausts=True)
        return pos if pos != start else 0


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
    if os.path.lexists(main):
        raise CorruptMetadata(f"{main}: {file_kind(main)}, not a regular file; torch writes .metadata as a plain file")
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


def file_kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a dangling link"
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "a special file"


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


def read_metadata_bytes(path: Path) -> bytearray:
    """Return the bytes of a `.metadata` file: a regular file of at most MAX_METADATA_BYTES,
    read in pieces of READ_CHUNK_BYTES into one buffer (a FIFO or device is refused without
    blocking on it)."""
    if storage.is_remote(path):
        return _read_remote_metadata(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise CorruptMetadata(f"{path}: cannot open ({error.strerror or error})") from None
    with open(fd, "rb", buffering=0, closefd=True) as handle:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise CorruptMetadata(f"{path}: {file_kind(path)}, not a regular file; torch writes .metadata as a plain file")
        size = status.st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptMetadata(
                f"{path}: {size} bytes is implausibly large for DCP metadata (at most {MAX_METADATA_BYTES} "
                "are read, ~15M chunks); the file is corrupt or not a .metadata file"
            )
        if size == 0:
            raise CorruptMetadata(f"{path}: empty file (the save was interrupted?)")
        data = bytearray(size)
        view = memoryview(data)
        done = 0
        try:
            while done < size:
                count = handle.readinto(view[done:done + READ_CHUNK_BYTES])
                if not count:
                    break
                done += count
        except OSError as error:
            raise CorruptMetadata(f"{path}: cannot read ({error.strerror or error})") from None
        finally:
            view.release()
        if done != size:
            raise CorruptMetadata(f"{path}: shrank from {size} to {done} bytes while being read")
    return data


def _read_remote_metadata(path: "storage.RemotePath") -> bytearray:
    """`read_metadata_bytes` of an object: the same size checks, ranged GETs of READ_CHUNK_BYTES."""
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptMetadata(f"{path}: {size} bytes is implausibly large for DCP metadata (at most "
                              f"{MAX_METADATA_BYTES} are read); the file is corrupt or not a .metadata file")
    if size == 0:
        raise CorruptMetadata(f"{path}: empty file (the save was interrupted?)")
    objects = storage.reader(path)
    data = bytearray(size)
    for start in range(0, size, READ_CHUNK_BYTES):
        data[start:start + READ_CHUNK_BYTES] = objects.read(start, min(READ_CHUNK_BYTES, size - start))
    return data


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Return the checkpoint's metadata as our types, reading only `.metadata`.

    Raises NotACheckpoint, UnsafeMetadata or CorruptMetadata (one line each, naming the
    file); never runs code from the file, and refuses a pickle over the budgets of
    `scan_pickle` before building anything.
    """
    root = storage.location(path)
    metadata_path = find_metadata_file(root)
    raw = read_metadata_bytes(metadata_path)
    with paused_gc():
        record = _unpickle_metadata(raw, str(metadata_path))
        del raw
        try:
            return _convert(root, metadata_path, record)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as error:
            raise CorruptMetadata(
                f"{metadata_path}: malformed DCP metadata ({type(error).__name__}: {_clip(str(error))})"
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
    # the class's kind: an instance's own `kind` comes from the file
    return type(obj).kind if isinstance(obj, (_Record, _Light)) else type(obj).__name__


def _require(obj: Any, kind: str, where: str, source: Path) -> _Record:
    if _kind(obj) != kind:
        raise CorruptMetadata(f"{source}: expected {kind} at {where}, found {_kind(obj)}")
    return obj


def _int_tuple(value: Any, where: str, source: Path) -> tuple[int, ...]:
    if type(value) is _Shape:
        return value
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise CorruptMetadata(f"{source}: {where} is not a sequence of integers ({_clip(_brief(value), 80)})")
    return tuple(value)


def _brief(value: Any) -> str:
    """Describe a value from the file without walking it (its repr could be huge)."""
    if type(value) is str:
        return repr(value[:60])
    if type(value) is int and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (int, float, type(None))):
        return repr(value)
    if isinstance(value, (tuple, list, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {_kind(value)}"


def _name(value: Any) -> str:
    return value if type(value) is str else _brief(value)


def _convert(root: Path, source: Path, record: Any) -> Checkpoint:
    metadata = _require(record, "Metadata", "top level", source)
    entries = _field(metadata, "state_dict_metadata")
    if not isinstance(entries, dict):
        raise CorruptMetadata(f"{source}: Metadata.state_dict_metadata is missing or not a dict")
    storage = _field(metadata, "storage_data") or {}
    if not isinstance(storage, dict):
        raise CorruptMetadata(f"{source}: Metadata.storage_data is not a dict")

    # fqn -> [(offsets or None, blob)] in storage order. Blobs are matched to chunks by
    # sorting, not by a dict keyed by offsets: tuples of ints hash without a salt, so crafted
    # colliding offsets would make every lookup linear.
    stored: dict[str, list] = {}
    for index, info in storage.items():
        if type(index) is _IndexKey and type(info) is _InfoBox:
            fqn, offset, blob = index[0], index[1], info[0]
        else:
            if type(index) is _IndexKey:
                fqn, offset = index[0], index[1]
            else:
                if type(index) is not _METADATA_INDEX:
                    _require(index, "MetadataIndex", "a storage_data key", source)
                fields = index.__dict__
                fqn, offset = fields.get("fqn"), fields.get("offset")
                if type(fqn) is not str:
                    raise CorruptMetadata(f"{source}: a storage_data key names {_brief(fqn)}, not a string fqn")
                if offset is not None and type(offset) is not _Shape:
                    offset = _int_tuple(offset, f"{fqn} storage offset", source)
            blob = _blob(info, fqn, source)
        found = stored.get(fqn)
        if found is None:
            stored[fqn] = [(offset, blob)]
        else:
            found.append((offset, blob))

    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    notes: list[str] = []
    orphans: list[tuple[str, Blob]] = []
    names = list(entries)
    if not all(type(fqn) is str for fqn in names):
        bad = next(fqn for fqn in names if type(fqn) is not str)
        raise CorruptMetadata(f"{source}: state_dict_metadata key {_brief(bad)} is not a string")
    for fqn in sorted(names):
        entry = entries[fqn]
        unkeyed, keyed = _latest(stored.pop(fqn, ()))
        kind = _kind(entry)
        if kind == "BytesStorageMetadata":
            objects[fqn] = Object(fqn, unkeyed)
            orphans.extend((fqn, blob) for _, blob in keyed)
            continue
        if kind != "TensorStorageMetadata":
            raise CorruptMetadata(f"{source}: {fqn}: unknown storage metadata type {kind}")
        if unkeyed is not None:
            orphans.append((fqn, unkeyed))
        tensor, note = _tensor(fqn, entry, keyed, orphans, source)
        tensors[fqn] = tensor
        if note:
            notes.append(note)
    for fqn, blobs in stored.items():
        unkeyed, keyed = _latest(blobs)
        if unkeyed is not None:
            orphans.append((fqn, unkeyed))
        orphans.extend((fqn, blob) for _, blob in keyed)

    refuse_bad_names(source, names, {b.file for _, b in orphans}, tensors, objects)
    nesting = _field(metadata, "planner_data")
    storage_meta = _field(metadata, "storage_meta")
    save_id = _field(storage_meta, "save_id") if isinstance(storage_meta, _Record) else None
    version = _field(metadata, "version")
    if type(version) is not str:
        version = None  # torch writes a string or nothing
    return Checkpoint(
        path=root,
        metadata_file=source.name,
        version=version,
        tensors=tensors,
        objects=objects,
        nesting=_nesting(nesting) if isinstance(nesting, dict) else {},
        orphan_blobs=tuple(sorted(orphans, key=str)),
        save_id=save_id if type(save_id) is str else None,
        notes=tuple(notes),
    )


def bad_text(text: str) -> str | None:
    """Why `text` can be neither a name nor a path (a NUL byte, an unpaired surrogate), or None."""
    if "\x00" in text:
        return "a NUL byte"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "an unpaired surrogate"
    return None


def refuse_bad_names(source: Path, names: list[str], files: set[str], tensors: dict[str, Tensor],
                     objects: dict[str, Object]) -> None:
    """Raise BadName for the first entry name or data-file path that `bad_text` refuses."""
    for fqn in names:
        if (why := bad_text(fqn)) is not None:
            raise BadName(f"{source}: entry name {ascii(fqn)[:120]} holds {why}; refusing the checkpoint")
    files |= {c.blob.file for t in tensors.values() for c in t.chunks if c.blob}
    files |= {o.blob.file for o in objects.values() if o.blob}
    for file in files:
        if (why := bad_text(file)) is not None:
            raise BadName(f"{source}: data file path {ascii(file)[:120]} holds {why}; refusing the checkpoint")


def _nesting(planner_data: dict) -> dict[str, tuple[str | int, ...]]:
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, keys in planner_data.items():
        if type(fqn) is str and isinstance(keys, (tuple, list)):
            if all(type(k) is str or type(k) is int for k in keys):
                out[fqn] = tuple(keys)
    return out


def _blob(info: Any, fqn: str, source: Path) -> Blob:
    # the hot loop of large metadata: no f-strings unless something is wrong
    if type(info) is _InfoBox:
        return info[0]
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
    if not isinstance(transforms, (list, tuple)) or not all(type(t) is str for t in transforms):
        raise CorruptMetadata(f"{source}: {fqn}: transform_descriptors is not a list of strings")
    if any(t.startswith(OUR_TRANSFORMS) for t in transforms):  # our readers' markers, never torch's
        raise CorruptMetadata(f"{source}: {fqn}: transform_descriptors names {transforms[0][:40]!r}, which torch never writes")
    return Blob(file, offset, length, tuple(transforms))


_first = operator.itemgetter(0)


def _latest(blobs: Any) -> tuple[Blob | None, list[tuple[tuple[int, ...], Blob]]]:
    """Return a tensor's or object's storage entries as a dict keyed by offsets would keep
    them (the last written of equal keys): the entry without offsets, and the others sorted
    by offsets."""
    unkeyed, keyed = None, []
    for offset, blob in blobs:
        if offset is None:
            unkeyed = blob
        else:
            keyed.append((offset, blob))
    if len(keyed) > 1:
        keyed.sort(key=_first)  # stable: equal offsets stay in storage order
        last = [item for item, after in zip(keyed, keyed[1:]) if item[0] != after[0]]
        last.append(keyed[-1])
        keyed = last
    return unkeyed, keyed


def _tensor(fqn: str, entry: Any, keyed: list, orphans: list, source: Path) -> tuple[Tensor, str | None]:
    if type(entry) is _TensorBox:
        dtype_name, shape, raw_chunks = entry[0].name, entry[1], entry[2]
    else:
        properties = _field(entry, "properties")
        dtype_name = "unknown"
        if isinstance(properties, _Record):
            state = _field(properties, "_state")
            dtype = state[0] if isinstance(state, tuple) and state else _field(properties, "dtype")
            if isinstance(dtype, _DType):
                dtype_name = dtype.name
        shape = _int_tuple(_field(entry, "size"), f"{fqn} size", source)
        raw_chunks = _field(entry, "chunks")
        if not isinstance(raw_chunks, (list, tuple)):
            raise CorruptMetadata(f"{source}: {fqn}: chunks is not a list")
    note = None if dtype_name in dtypes.ITEMSIZE else f"{fqn}: unknown dtype {dtype_name[:64]!r}"
    if set(map(type, raw_chunks)) <= {_ChunkBox}:  # all from the loader's fast path
        boxes = sorted(raw_chunks, key=_first)
        if len(keyed) == len(boxes) and list(map(_first, keyed)) == list(map(_first, boxes)):
            # every chunk has its storage entry: the usual case, matched without a loop
            chunks = tuple(map(_new_chunk, zip(map(_first, boxes), map(_second, boxes), map(_second, keyed))))
            return Tensor(fqn, dtype_name, shape, chunks), note
    else:
        boxes = _boxes(fqn, raw_chunks, source)
    # match chunks and storage entries by walking both in offsets order
    chunks = []
    at, count, matched = 0, len(keyed), False
    for box in boxes:
        offsets, sizes = box[0], box[1]
        while at < count and keyed[at][0] < offsets:
            if not matched:
                orphans.append((fqn, keyed[at][1]))
            at += 1
            matched = False
        if at < count and keyed[at][0] == offsets:
            chunks.append(_new_chunk((offsets, sizes, keyed[at][1])))
            matched = True
        else:
            chunks.append(_new_chunk((offsets, sizes, None)))
    orphans.extend((fqn, blob) for _, blob in keyed[at + matched:])
    return Tensor(fqn, dtype_name, shape, tuple(chunks)), note


_second = operator.itemgetter(1)
_new_chunk = functools.partial(tuple.__new__, Chunk)


def _boxes(fqn: str, raw_chunks: list | tuple, source: Path) -> list:
    """Return a tensor's chunks as (offsets, sizes) sorted by offsets, checking each."""
    boxes = []
    for position, raw in enumerate(raw_chunks):
        if type(raw) is _ChunkBox:
            boxes.append(raw)
            continue
        if type(raw) is not _CHUNK:
            _require(raw, "ChunkStorageMetadata", f"{fqn} chunk {position}", source)
        fields = raw.__dict__
        offsets, sizes = fields.get("offsets"), fields.get("sizes")
        if type(offsets) is not _Shape:
            offsets = _int_tuple(offsets, f"{fqn} chunk {position} offsets", source)
        if type(sizes) is not _Shape:
            sizes = _int_tuple(sizes, f"{fqn} chunk {position} sizes", source)
        boxes.append((offsets, sizes))
    boxes.sort(key=_first)
    return boxes
