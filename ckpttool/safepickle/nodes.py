"""What the loader knows of each value the unpickler would build: `_Node` for containers,
objects and globals, and the light records its fast paths build instead of stand-ins; the
refusals it raises."""

from __future__ import annotations

import operator
import pickle
from typing import Any


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
_LIGHT_SET = frozenset(_LIGHT_TYPES)
_SALTED_KEYS = frozenset((str, *_LIGHT_TYPES))
_last = operator.itemgetter(-1)
_depth_of = operator.itemgetter(-2)
_new_tuple = tuple.__new__
