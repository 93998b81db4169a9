"""What a call of each allowlisted callable gives, checked on its arguments before anything
is called: a torch.Size only of a flat tuple of ints, a set only of strings, and so on."""

from __future__ import annotations

from typing import Any, Callable

from ckpttool.safepickle.nodes import _DICT, _FROZENSET, _GLOBAL, _LIST, _SET, _SIZE, _TUPLE, PickleRefused, _Node
from ckpttool.safepickle.standins import (_MEMBERS, _Shape, _enum_member, _layout, _memory_format_encoding,
                                          _path, _windows_path, _write_item_type)


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


def _members(enum: Any) -> dict[str, int]:
    try:
        return _MEMBERS.get(enum, {})
    except TypeError:  # an unhashable allowlisted object: no enum of ours
        return {}


def _call_enum_member(args: _Node) -> Any:
    items = args.items
    if (items is not None and len(items) == 2 and type(items[0]) is _Node and items[0].kind == _GLOBAL
            and type(items[1]) is str and items[1] in _members(items[0].value)):
        return int
    raise PickleRefused("getattr of something other than a DCP metadata enum's member by name")


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
