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


# torch/distributed/checkpoint/metadata.py `_MEM_FORMAT_ENCODING`: CPython 3.11.0-3.11.4
# pickle its members by name, as getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
_MEMORY_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


def _enum_member(enum: Any, name: str) -> int:
    """Stand-in for `builtins.getattr`: only a member of the memory format enum, by name."""
    if enum is _memory_format_encoding and type(name) is str and name in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[name]
    raise UnsafeMetadata(f"getattr of something other than a memory format ({type(name).__name__})")


def _write_item_type(value: int) -> int:
    """Stand-in for the `WriteItemType` enum (SHARD, TENSOR, BYTE_IO), called with its value."""
    return value
