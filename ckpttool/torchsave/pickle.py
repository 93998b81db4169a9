"""A small protocol-2 pickle writer: plain data, and stand-ins for the torch objects pickles name.

torch.save's `data.pkl` and DCP's `.metadata` name torch classes, functions and dtypes;
pickling the real objects would import torch (~1.7 s, ~270 MB). We pickle stand-ins instead:
`Global` (a class, function or dtype, by module and name), `Reduce` (a call of a global),
`NewObject` (a class instance: NEWOBJ, then BUILD with its state) and `PersistentId`
(torch.save's storages). Stock `pickle` and torch's weights_only unpickler load what we
write. The only memo is for strings and globals, by value; no frames, no batching.

Example (read back through our allowlist loader, as ckpttool reads every pickle):
    >>> import io
    >>> from ckpttool.safepickle import RestrictedUnpickler
    >>> RestrictedUnpickler(io.BytesIO(dumps({"lr": 0.1, "betas": (0.9, 0.999)})), {}, "example").load()
    {'lr': 0.1, 'betas': (0.9, 0.999)}
    >>> allowed = {("collections", "OrderedDict"): dict}
    >>> RestrictedUnpickler(io.BytesIO(dumps(Reduce(Global("collections", "OrderedDict"), ()))), allowed, "example").load()
    {}
"""

from __future__ import annotations

import itertools
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, cast, final

PROTOCOL = 2  # torch.save's DEFAULT_PROTOCOL; torch's weights_only unpickler expects it


@dataclass(frozen=True)
class Global:
    """Stands for a module-level object pickle names (a class, function or dtype)."""

    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """Stands for `function(*args)`."""

    function: Global
    args: tuple


@dataclass(frozen=True, eq=False)
class NewObject:
    """Stands for an instance of `cls` made without `__init__` and given `state` (its
    `__dict__`, or what `__setstate__` takes; no state when None).

    Hashed by identity, as the instance it stands for may be a dict key (`.metadata` keys
    its storage_data by MetadataIndex).
    """

    cls: Global
    state: Any = None


@dataclass(frozen=True)
class PersistentId:
    """Stands for an object the loader's `persistent_load` makes from `pid` (a storage)."""

    pid: tuple


@dataclass(frozen=True)
class Opcodes:
    """Stands for a value some other protocol-2 pickler wrote (without its PROTO and STOP).

    Spliced in as it is; our memo is forgotten after it, as it may have reused our slots.
    """

    data: bytes


@final  # so `type(value) is Fragment` narrows
@dataclass(frozen=True)
class Fragment:
    """Stands for a value `Writer.fragment` (or `Writer.object_parts`) encoded earlier in
    the same `dumps`: spliced in as it is (it only fetches from the memo)."""

    data: bytes


@dataclass(frozen=True)
class LazyList:
    """Stands for `list(items(writer))`, its items made as the writer reaches them (so they
    can be `Fragment`s of what the memo holds by then)."""

    items: Callable[["Writer"], Iterable[Any]]


@dataclass(frozen=True)
class LazyDict:
    """Stands for `dict(items(writer))`, its (key, value) pairs made as the writer reaches them;
    a pair may come as one `Fragment` holding the key's bytes and then the value's."""

    items: Callable[["Writer"], Iterable[tuple[Any, Any] | Fragment]]


_CODECS_ENCODE = Global("_codecs", "encode")  # how protocol 2 pickles bytes


def dumps(value: Any) -> bytes:
    """Return a protocol-2 pickle of `value`: None, bool, int, float, str, bytes, tuple, list
    and dict, nested, with stand-ins anywhere.

    Example:
        >>> dumps([1, "a"])
        b'\\x80\\x02](K\\x01X\\x01\\x00\\x00\\x00aq\\x00e.'
    """
    writer = Writer()
    writer.out += pickle.PROTO + bytes([PROTOCOL])
    writer.write(value)
    writer.out += pickle.STOP
    return bytes(writer.out)


class Writer:
    """Appends opcodes to `out`. Strings and globals are written once and then fetched from
    the memo: `.metadata` repeats the same field names, fqns, file names and classes for every
    chunk, and writing them in full makes it ~3x larger and ~2x slower to load.

    Fast paths for many similar values (a million chunks) take their bytes from `fragment`
    and `object_parts` once and splice them in as `Fragment`s: the same bytes, without
    walking the value again.
    """

    def __init__(self) -> None:
        self.out = bytearray()
        self.memo: dict[str | Global, int] = {}  # by value: equal strings and globals load the same

    def write(self, value: Any) -> None:
        write = _WRITERS.get(type(value))
        if write is None:
            raise TypeError(f"cannot pickle a {type(value).__name__} without its class")
        write(self, value)

    def fetched(self, key: str | Global) -> bool:
        """Write a fetch of `key` from the memo and return True, or return False when it is not there."""
        data = self.fetch(key)
        if data is not None:
            self.out += data
        return data is not None

    def fetch(self, key: str | Global) -> bytes | None:
        """Return the bytes `fetched(key)` would write, or None when the memo lacks `key`."""
        slot = self.memo.get(key)
        if slot is None:
            return None
        return pickle.BINGET + bytes([slot]) if slot < 256 else pickle.LONG_BINGET + struct.pack("<I", slot)

    def fragment(self, value: Any) -> bytes | None:
        """Return the bytes `write(value)` would append now, when they only fetch from the
        memo (every string and global in `value` is there already), else None; writes
        nothing. (Not for values holding `Opcodes`, which reset the memo.)"""
        out, slots = self.out, len(self.memo)
        self.out = bytearray()
        try:
            self.write(value)
            data = bytes(self.out) if len(self.memo) == slots else None
        finally:
            self.out = out
            while len(self.memo) > slots:  # forget what the trial remembered: it was not written
                self.memo.popitem()
        return data

    def object_parts(self, cls: Global, keys: tuple[str, ...]) -> list[bytes] | None:
        """Return the bytes around the values of `NewObject(cls, {key: value, ...})` with these
        keys (non-empty): the parts before each value, then the closing part; None unless
        `cls` and the keys are in the memo.

        Example: `parts[0] + fragment(v0) + parts[1] + fragment(v1) + parts[2]` is the
        bytes of `NewObject(cls, {keys[0]: v0, keys[1]: v1})`."""
        head = self.fragment(cls)
        fragments = [self.fragment(key) for key in keys]
        if head is None or None in fragments:
            return None
        names = cast(list[bytes], fragments)  # no None among them (checked above)
        names[0] = head + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK + names[0]
        return names + [pickle.SETITEMS + pickle.BUILD]

    def remember(self, key: str | Global) -> None:
        slot = self.memo[key] = len(self.memo)
        self.out += pickle.BINPUT + bytes([slot]) if slot < 256 else pickle.LONG_BINPUT + struct.pack("<I", slot)


def int_bytes(value: int) -> bytes:
    """Return the opcodes `write(value)` appends for an int (ints need no memo).

    Example:
        >>> int_bytes(300)
        b'M,\\x01'
    """
    if 0 <= value <= 0xFF:
        return pickle.BININT1 + bytes([value])
    if 0 <= value <= 0xFFFF:
        return pickle.BININT2 + struct.pack("<H", value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return pickle.BININT + struct.pack("<i", value)
    encoded = pickle.encode_long(value)
    if len(encoded) < 256:
        return pickle.LONG1 + bytes([len(encoded)]) + encoded
    return pickle.LONG4 + struct.pack("<i", len(encoded)) + encoded


def _int(writer: Writer, value: int) -> None:
    writer.out += int_bytes(value)


def _str(writer: Writer, value: str) -> None:
    if not writer.fetched(value):
        data = value.encode("utf-8", "surrogatepass")
        writer.out += pickle.BINUNICODE + struct.pack("<I", len(data)) + data
        writer.remember(value)


def _tuple(writer: Writer, value: tuple) -> None:
    if len(value) > 3:
        writer.out += pickle.MARK
    for item in value:
        writer.write(item)
    writer.out += _TUPLE_OPCODES.get(len(value), pickle.TUPLE)


_TUPLE_OPCODES = {0: pickle.EMPTY_TUPLE, 1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


def _list(writer: Writer, value: list) -> None:
    writer.out += pickle.EMPTY_LIST
    if value:
        writer.out += pickle.MARK
        for item in value:
            writer.write(item)
        writer.out += pickle.APPENDS


def _dict(writer: Writer, value: dict) -> None:
    writer.out += pickle.EMPTY_DICT
    if value:
        writer.out += pickle.MARK
        for key, item in value.items():
            writer.write(key)
            writer.write(item)
        writer.out += pickle.SETITEMS


def _global(writer: Writer, value: Global) -> None:
    if not writer.fetched(value):
        writer.out += pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode("utf-8")
        writer.remember(value)


def _reduce(writer: Writer, value: Reduce) -> None:
    _global(writer, value.function)
    _tuple(writer, value.args)
    writer.out += pickle.REDUCE


def _new_object(writer: Writer, value: NewObject) -> None:
    _global(writer, value.cls)
    writer.out += pickle.EMPTY_TUPLE + pickle.NEWOBJ
    if value.state is not None:
        writer.write(value.state)
        writer.out += pickle.BUILD


def _lazy_list(writer: Writer, value: LazyList) -> None:
    items = iter(value.items(writer))
    first = next(items, _NOTHING)
    writer.out += pickle.EMPTY_LIST
    if first is not _NOTHING:
        writer.out += pickle.MARK
        writer.write(first)
        for item in items:
            writer.write(item)
        writer.out += pickle.APPENDS


def _lazy_dict(writer: Writer, value: LazyDict) -> None:
    pairs = iter(value.items(writer))
    first = next(pairs, _NOTHING)
    writer.out += pickle.EMPTY_DICT
    if first is not _NOTHING:
        writer.out += pickle.MARK
        for pair in itertools.chain((cast("tuple[Any, Any] | Fragment", first),), pairs):
            if type(pair) is Fragment:
                writer.out += pair.data
                continue
            writer.write(pair[0])
            writer.write(pair[1])
        writer.out += pickle.SETITEMS


_NOTHING = object()


def _persistent_id(writer: Writer, value: PersistentId) -> None:
    _tuple(writer, value.pid)
    writer.out += pickle.BINPERSID


def _opcodes(writer: Writer, value: Opcodes) -> None:
    writer.out += value.data
    writer.memo.clear()  # its memo slots may be ours: forget what they held


_WRITERS: dict[type, Callable[[Writer, Any], None]] = {
    type(None): lambda writer, value: writer.out.extend(pickle.NONE),
    bool: lambda writer, value: writer.out.extend(pickle.NEWTRUE if value else pickle.NEWFALSE),
    int: _int,
    float: lambda writer, value: writer.out.extend(pickle.BINFLOAT + struct.pack(">d", value)),
    str: _str,
    bytes: lambda writer, value: _reduce(writer, Reduce(_CODECS_ENCODE, (value.decode("latin-1"), "latin1"))),
    tuple: _tuple,
    list: _list,
    dict: _dict,
    Global: _global,
    Reduce: _reduce,
    NewObject: _new_object,
    PersistentId: _persistent_id,
    Opcodes: _opcodes,
    Fragment: lambda writer, value: writer.out.extend(value.data),
    LazyList: _lazy_list,
    LazyDict: _lazy_dict,
}
