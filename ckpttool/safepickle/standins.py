"""Stand-ins for what DCP metadata names: built in place of torch's classes and functions,
they keep the fields a pickle gives them and run nothing from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from ckpttool.core.errors import UnsafeMetadata


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


def _write_item_type(value: int) -> int:
    """Stand-in for the `WriteItemType` enum (SHARD, TENSOR, BYTE_IO), called with its value."""
    return value


# CPython 3.11.0-3.11.4 pickle an Enum's member by name, as getattr(Enum, "NAME"): the enums a DCP
# `.metadata` holds, torch/distributed/checkpoint/metadata.py `_MEM_FORMAT_ENCODING` and (in a
# SavePlan's WriteItems, Megatron's planner data) planner.py `WriteItemType`, their members' values
_MEMORY_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}
_WRITE_ITEM_TYPES = {"TENSOR": 1, "SHARD": 2, "BYTE_IO": 3}
_MEMBERS: dict[Any, dict[str, int]] = {_memory_format_encoding: _MEMORY_FORMATS, _write_item_type: _WRITE_ITEM_TYPES}


def _enum_member(enum: Any, name: str) -> int:
    """Stand-in for `builtins.getattr`: only a member, by name, of an enum `_MEMBERS` names."""
    try:
        members = _MEMBERS.get(enum)
    except TypeError:  # unhashable: no enum of ours
        members = None
    if members is not None and type(name) is str and name in members:
        return members[name]
    raise UnsafeMetadata(f"getattr of something other than a member of a DCP metadata enum ({type(name).__name__})")
