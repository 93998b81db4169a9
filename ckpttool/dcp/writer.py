"""Write DCP checkpoints that stock torch loads: `.distcp` blobs and the `.metadata` pickle.

A blob is a `torch.save` record of one tensor chunk: an uncompressed zip holding `data.pkl`
(the tensor's rebuild recipe), a few small version records and `data/0` (the raw row-major
bytes). We lay the record out byte for byte as torch's `PyTorchStreamWriter` (miniz) does,
so the raw bytes can stream straight from the source checkpoint into `data/0` without being
decoded, and only the CRC-32 (computed while they stream) completes the record:

    head = layout.head                      # everything before data/0's bytes
    write_at(fd, head, offset)
    ... stream `layout.data_length` bytes to offset + len(head), computing crc ...
    write_at(fd, layout.tail(crc), offset + len(head) + layout.data_length)

`metadata_bytes` writes the `.metadata` pickle `FileSystemWriter.finish` writes for torch's
`Metadata` dataclasses. Neither pickle needs torch: small stand-ins (`_Global`, `_Reduce`,
`_NewObject`) take the place of torch's objects and `_Pickler` writes them byte for byte as
CPython's C pickler writes the real ones, so writing a checkpoint never imports torch.

Example:
    >>> layout = record_layout("float32", (5, 8))
    >>> layout.length, len(layout.head), layout.data_length
    (1705, 704, 160)
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import pickle
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Callable, Iterable, Mapping, Sequence

from ckpttool import dtypes
from ckpttool.dcp.blobs import contiguous_strides
from ckpttool.dcp.metadata import paused_gc

# torch.save names its records `archive/...` when it writes to a stream (torch/serialization.py)
RECORD_ARCHIVE = "archive"
# caffe2/serialize/inline_container.h kFieldAlignment; torch.save's `.storage_alignment` record
ALIGNMENT = 64
FORMAT_VERSION = b"1"  # torch/serialization.py `_save`: ".format_version"
FILE_FORMAT_VERSION = b"3\n"  # inline_container.h kProducedFileFormatVersion, as torch.save writes it
PICKLE_PROTOCOL = 2  # torch.save's DEFAULT_PROTOCOL
_UINT32_MAX = 0xFFFFFFFF
_UTF8_AND_DESCRIPTOR = 0x0808  # general purpose flags miniz sets: data descriptor + UTF-8 names
_UTF8 = 0x0800  # miniz writes an empty entry without a data descriptor
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 0x002D  # miniz's zip64 end record


# ---------------------------------------------------------------------------------------------
# A pickler for stand-ins of torch's objects
#
# torch's pickles name torch classes, functions and dtypes; pickling the real objects would
# import torch (~1.75 s, ~270 MB). Instead we pickle stand-ins and write, opcode for opcode,
# what CPython's C pickler (Modules/_pickle.c) writes for the real objects: the same memo
# slots (by object identity, as pickle keeps them), the same batching and the same frames.

# Modules/_pickle.c BATCHSIZE: items between MARK and APPENDS / SETITEMS
_BATCHSIZE = 1000
# Modules/_pickle.c: protocol 4+ frames are committed at the first save() after reaching
# FRAME_SIZE_TARGET bytes; frames shorter than FRAME_SIZE_MIN get no FRAME header
_FRAME_SIZE_TARGET = 64 * 1024
_FRAME_SIZE_MIN = 4
_FRAME_HEADER_SIZE = 9  # FRAME opcode + 8-byte length
_TUPLE_OPCODES = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


class _Global:
    """Stands for a module-level object pickle refers to by name (a class, function or dtype).

    Instances are shared (module constants or cached) because pickle memoizes a global by
    identity: the second use of `torch.Size` in a pickle is a memo lookup, not a new name.
    `module` is a specific string object for the same reason (see `_TORCH_DTYPE_MODULE`).
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"_Global({self.module}.{self.name})"


class _Reduce:
    """Stands for an object whose `__reduce_ex__` returns `(function, args)`."""

    __slots__ = ("function", "args")

    def __init__(self, function: _Global, args: tuple):
        self.function, self.args = function, args


class _NewObject:
    """Stands for a plain class instance: `object.__reduce_ex__` gives `copyreg.__newobj__(cls)`
    and then BUILD with `state` (its `__dict__` or `__getstate__()`; no BUILD when None)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: _Global, state: Any):
        self.cls, self.state = cls, state


class _PersistentId:
    """Stands for an object the pickler's `persistent_id` maps to `pid` (torch.save's storages)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


_BININT1 = [pickle.BININT1 + bytes([value]) for value in range(256)]
_BINGET = [pickle.BINGET + bytes([slot]) for slot in range(256)]


def _int_opcode(value: int) -> bytes:
    """Return the opcode pickle writes for an int outside 0..255 (protocol 2+)."""
    if 0 <= value <= 0xFFFF:
        return pickle.BININT2 + struct.pack("<H", value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return pickle.BININT + struct.pack("<i", value)
    # pickle.py encode_long: two's complement, little-endian, as few bytes as keep the sign
    encoded = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
    if value < 0 and len(encoded) > 1 and encoded[-1] == 0xFF and encoded[-2] & 0x80:
        encoded = encoded[:-1]
    if len(encoded) < 256:
        return pickle.LONG1 + bytes([len(encoded)]) + encoded
    return pickle.LONG4 + struct.pack("<i", len(encoded)) + encoded


class _Pickler:
    """Writes plain data (None, bool, int, str, tuple, list, dict) and stand-ins (`_Global`,
    `_Reduce`, `_NewObject`, `_PersistentId`) as CPython's C pickler writes the objects they
    stand for, at protocol 2 (torch.save) or 4/5 (`pickle.dump`'s default)."""

    def __init__(self, protocol: int):
        if protocol not in (2, 4, 5):
            raise ValueError(f"pickle protocol {protocol} is not supported (2, 4 and 5 are)")
        self.protocol = protocol
        self.out = bytearray()
        self.memo: dict[int, tuple[int, object]] = {}  # id -> (slot, obj kept alive), as pickle's
        self.frame_start = -1  # where the open frame's header is reserved; -1: no frame open
        self.frame_full = sys.maxsize  # output length at which the open frame is full

    def dump(self, obj: object) -> bytes:
        """Return the whole pickle of `obj`."""
        self.out += pickle.PROTO + bytes([self.protocol])
        if self.protocol >= 4:
            self._open_frame()
        self.save(obj)
        self.out += pickle.STOP
        self._close_frame()
        return bytes(self.out)

    def save(self, obj: object) -> None:
        """Write `obj`, or a memo lookup when the same object was written before."""
        out = self.out
        if len(out) >= self.frame_full:
            # _pickle.c save(): a full frame is committed before anything else is written
            self._close_frame()
            self._open_frame()
        kind = type(obj)
        if kind is int:
            if 0 <= obj <= 0xFF:
                out += _BININT1[obj]
            else:
                out += _int_opcode(obj)
        elif obj is None:
            out += pickle.NONE
        elif kind is bool:
            out += pickle.NEWTRUE if obj else pickle.NEWFALSE
        else:
            entry = self.memo.get(id(obj))
            if entry is not None:
                slot = entry[0]
                out += _BINGET[slot] if slot < 256 else pickle.LONG_BINGET + struct.pack("<I", slot)
                return
            save = _Pickler.SAVE_BY_TYPE.get(kind)
            if save is None:
                raise TypeError(f"cannot write a pickle of {kind.__name__} objects without their class")
            save(self, obj)

    def _open_frame(self) -> None:
        # _pickle.c opens a frame at the first write after a commit; nothing is written in
        # between, so opening it right away puts it at the same place
        self.frame_start = len(self.out)
        self.frame_full = self.frame_start + _FRAME_HEADER_SIZE + _FRAME_SIZE_TARGET
        self.out += bytes(_FRAME_HEADER_SIZE)

    def _close_frame(self) -> None:
        start = self.frame_start
        if start < 0:
            return
        length = len(self.out) - start - _FRAME_HEADER_SIZE
        if length >= _FRAME_SIZE_MIN:
            self.out[start:start + _FRAME_HEADER_SIZE] = pickle.FRAME + struct.pack("<Q", length)
        else:
            del self.out[start:start + _FRAME_HEADER_SIZE]
        self.frame_start, self.frame_full = -1, sys.maxsize

    def _memoize(self, obj: object) -> None:
        slot = len(self.memo)
        self.memo[id(obj)] = (slot, obj)
        if self.protocol >= 4:
            self.out += pickle.MEMOIZE
        elif slot < 256:
            self.out += pickle.BINPUT + bytes([slot])
        else:
            self.out += pickle.LONG_BINPUT + struct.pack("<I", slot)

    def _save_str(self, value: str) -> None:
        data = value.encode("utf-8", "surrogatepass")
        if len(data) <= 0xFF and self.protocol >= 4:
            header = pickle.SHORT_BINUNICODE + bytes([len(data)])
        elif len(data) > 0xFFFFFFFF and self.protocol >= 4:
            header = pickle.BINUNICODE8 + struct.pack("<Q", len(data))
        else:
            header = pickle.BINUNICODE + struct.pack("<I", len(data))
        if len(data) >= _FRAME_SIZE_TARGET and self.frame_start >= 0:
            # _pickle.c _Pickler_write_bytes: a large payload goes between frames
            self._close_frame()
            self.out += header + data
            self._open_frame()
        else:
            self.out += header + data
        self._memoize(value)

    def _save_tuple(self, value: tuple) -> None:
        # (our tuples hold strings and numbers, so never themselves: no recursion check)
        if not value:
            self.out += pickle.EMPTY_TUPLE
            return
        if len(value) <= 3:
            for item in value:
                self.save(item)
            self.out += _TUPLE_OPCODES[len(value)]
        else:
            self.out += pickle.MARK
            for item in value:
                self.save(item)
            self.out += pickle.TUPLE
        self._memoize(value)

    def _save_list(self, value: list) -> None:
        self.out += pickle.EMPTY_LIST
        self._memoize(value)
        if len(value) == 1:
            self.save(value[0])
            self.out += pickle.APPEND
            return
        # _pickle.c batch_list_exact: full batches, no empty batch after the last
        for start in range(0, len(value), _BATCHSIZE):
            self.out += pickle.MARK
            for item in value[start:start + _BATCHSIZE]:
                self.save(item)
            self.out += pickle.APPENDS

    def _save_dict(self, value: dict) -> None:
        self.out += pickle.EMPTY_DICT
        self._memoize(value)
        if len(value) == 1:
            for key, item in value.items():
                self.save(key)
                self.save(item)
            self.out += pickle.SETITEM
            return
        if not value:
            return
        # _pickle.c batch_dict_exact: batches until one is short, so a dict of k * BATCHSIZE
        # items ends with an empty MARK SETITEMS
        items = iter(value.items())
        while True:
            self.out += pickle.MARK
            count = 0
            for key, item in itertools.islice(items, _BATCHSIZE):
                self.save(key)
                self.save(item)
                count += 1
            self.out += pickle.SETITEMS
            if count < _BATCHSIZE:
                return

    def _save_global(self, value: _Global) -> None:
        if self.protocol >= 4:
            self.save(value.module)
            self.save(value.name)
            self.out += pickle.STACK_GLOBAL
        else:
            # (fix_imports renames no module we write; _compat_pickle maps only stdlib ones)
            self.out += pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode("ascii")
        self._memoize(value)

    def _save_reduce(self, value: _Reduce) -> None:
        self.save(value.function)
        self.save(value.args)
        self.out += pickle.REDUCE
        self._memoize(value)

    def _save_new_object(self, value: _NewObject) -> None:
        self.save(value.cls)
        self.save(())  # copyreg.__newobj__'s arguments after the class
        self.out += pickle.NEWOBJ
        self._memoize(value)
        if value.state is not None:
            self.save(value.state)
            self.out += pickle.BUILD

    def _save_persistent_id(self, value: _PersistentId) -> None:
        # (not memoized: _pickle.c asks persistent_id before it looks at the memo)
        self.save(value.pid)
        self.out += pickle.BINPERSID

    # (a class attribute: bound methods kept on the instance would make a reference cycle that
    # holds the whole memo until the next garbage collection)
    SAVE_BY_TYPE: dict[type, Callable[[_Pickler, Any], None]] = {
        str: _save_str,
        tuple: _save_tuple,
        list: _save_list,
        dict: _save_dict,
        _Global: _save_global,
        _Reduce: _save_reduce,
        _NewObject: _save_new_object,
        _PersistentId: _save_persistent_id,
    }


# torch's dtypes all report one shared, non-interned "torch" as their module, a different
# string object from the interned "torch" of torch.Size; pickle memoizes module names by
# identity, so the two are written separately and each dtype name reuses the first
_TORCH_DTYPE_MODULE = "".join(("tor", "ch"))


@functools.lru_cache(maxsize=None)
def _dtype_global(dtype: str) -> _Global:
    """Return the (shared) stand-in for `torch.<dtype>`; torch pickles a dtype by name."""
    if dtype not in dtypes.ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _Global(_TORCH_DTYPE_MODULE, dtype)


# ---------------------------------------------------------------------------------------------
# data.pkl: the same pickle torch.save writes for a contiguous tensor

# torch/storage.py `_new_dtypes` (torch 2.13.0): dtypes torch.save writes as an UntypedStorage
# plus the dtype (`_rebuild_tensor_v3`); every other dtype has a legacy typed storage class
# (`dtypes.STORAGE_CLASS_DTYPE`, from `_dtype_to_storage_type_map`) and `_rebuild_tensor_v2`
NEW_DTYPES = frozenset({
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "complex32", "uint16", "uint32", "uint64",
})
LEGACY_STORAGE_CLASS: dict[str, str] = {dtype: name for name, dtype in dtypes.STORAGE_CLASS_DTYPE.items()}

_REBUILD_TENSOR_V2 = _Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_TENSOR_V3 = _Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED_STORAGE = _Global("torch.storage", "UntypedStorage")
_ORDERED_DICT = _Global("collections", "OrderedDict")


@functools.lru_cache(maxsize=4096)
def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """Return the `data.pkl` torch.save writes for a contiguous CPU tensor of this dtype/shape.

    Legacy dtypes use `_rebuild_tensor_v2` with a typed storage class (`torch.FloatStorage`);
    newer ones (float8, uint16, ...) `_rebuild_tensor_v3` with `UntypedStorage` and the dtype,
    as `torch.Tensor._reduce_ex_internal` does. The persistent id is torch/serialization.py
    `_save.persistent_id`'s ("storage", storage class, key, location, size).

    Example:
        >>> tensor_pickle("float32", (5, 8))[2:35]   # after PROTO 2: the rebuild function
        b'ctorch._utils\\n_rebuild_tensor_v2\\n'
    """
    numel = math.prod(shape)
    hooks = _Reduce(_ORDERED_DICT, ())  # an empty OrderedDict of backward hooks
    # fresh tuples: torch pickles new ones, so none of them may hit the memo
    size, stride = (*shape,), contiguous_strides(shape)
    if dtype in NEW_DTYPES:
        storage = _PersistentId(("storage", _UNTYPED_STORAGE, "0", "cpu", numel * dtypes.ITEMSIZE[dtype]))
        rebuild = _Reduce(_REBUILD_TENSOR_V3, (storage, 0, size, stride, False, hooks, _dtype_global(dtype)))
    else:
        storage_class = _Global("torch", LEGACY_STORAGE_CLASS[dtype])
        storage = _PersistentId(("storage", storage_class, "0", "cpu", numel))
        rebuild = _Reduce(_REBUILD_TENSOR_V2, (storage, 0, size, stride, False, hooks))
    return _Pickler(PICKLE_PROTOCOL).dump(rebuild)


# ---------------------------------------------------------------------------------------------
# The zip record, laid out as PyTorchStreamWriter + miniz write it


@dataclass(frozen=True)
class _Entry:
    name: bytes
    local_offset: int
    size: int
    crc32: int

    @property
    def flags(self) -> int:
        return _UTF8_AND_DESCRIPTOR if self.size else _UTF8


def _zip64_extra(size: int | None, local_offset: int | None) -> bytes:
    values = []
    if size is not None:
        values += [size, size]  # uncompressed, compressed
    if local_offset is not None:
        values.append(local_offset)
    return struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)


class _RecordWriter:
    """Builds a torch.save zip record in pieces: entries are appended at a running cursor."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.cursor = 0
        self.entries: list[_Entry] = []

    def local_header(self, name: bytes, size: int) -> None:
        """Append the local header of entry `name`, padded so its data starts aligned
        (caffe2/serialize/inline_container.cc `getPadding`)."""
        big_size, big_offset = size >= _UINT32_MAX, self.cursor >= _UINT32_MAX
        zip64 = b""
        if big_size or big_offset:
            zip64 = _zip64_extra(size if big_size else None, self.cursor if big_offset else None)
        start = self.cursor + 30 + len(name) + len(zip64) + 4
        padding = -start % ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        entry = _Entry(name, self.cursor, size, 0)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, entry.flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
        self.entries.append(entry)
        self._emit(header + name + extra)

    def descriptor(self, crc32: int) -> None:
        """Append the data descriptor that follows an entry's data, and record its CRC-32."""
        entry = self.entries[-1]
        self.entries[-1] = _Entry(entry.name, entry.local_offset, entry.size, crc32)
        if entry.size == 0:
            return
        if entry.size >= _UINT32_MAX or entry.local_offset >= _UINT32_MAX:
            self._emit(struct.pack("<IIQQ", 0x08074B50, crc32, entry.size, entry.size))
        else:
            self._emit(struct.pack("<IIII", 0x08074B50, crc32, entry.size, entry.size))

    def record(self, name: str, data: bytes) -> None:
        full = f"{RECORD_ARCHIVE}/{name}".encode()
        self.local_header(full, len(data))
        self._emit(data)
        self.descriptor(zlib.crc32(data))

    def skip(self, length: int) -> None:
        """Advance over bytes written elsewhere (the streamed tensor data)."""
        self.cursor += length

    def finish(self) -> None:
        """Append the central directory and the zip64 + classic end records."""
        directory_start = self.cursor
        for entry in self.entries:
            big_size, big_offset = entry.size >= _UINT32_MAX, entry.local_offset >= _UINT32_MAX
            extra = b""
            if big_size or big_offset:
                extra = _zip64_extra(entry.size if big_size else None, entry.local_offset if big_offset else None)
            size32 = min(entry.size, _UINT32_MAX)
            self._emit(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, entry.flags, 0, 0, 0,
                    entry.crc32, size32, size32, len(entry.name), len(extra), 0, 0, 0, 0,
                    min(entry.local_offset, _UINT32_MAX),
                )
                + entry.name
                + extra
            )
        directory_size = self.cursor - directory_start
        count = len(self.entries)
        end64_offset = self.cursor
        self._emit(
            struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, _ZIP64_MADE_BY, _ZIP64_NEEDED, 0, 0,
                count, count, directory_size, directory_start,
            )
        )
        self._emit(struct.pack("<IIQI", 0x07064B50, 0, end64_offset, 1))
        self._emit(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                min(directory_size, _UINT32_MAX), min(directory_start, _UINT32_MAX), 0,
            )
        )

    def _emit(self, data: bytes) -> None:
        self.out += data
        self.cursor += len(data)


def _hash_combine(seed: int, value: int) -> int:
    # c10/util/hash.h hash_combine, on uint64
    return (seed ^ (value + 0x9E3779B9 + ((seed << 6) & 0xFFFFFFFFFFFFFFFF) + (seed >> 2))) & 0xFFFFFFFFFFFFFFFF


# The record names torch.save's PyTorchStreamWriter has in `files_written_` when it computes the
# serialization id, in insertion order (the order `_build` writes them; no archive prefix)
_RECORD_NAMES = ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0", "version")
_UINT64_MASK = (1 << 64) - 1
# libstdc++ hash_bytes.cc: seed std::hash<std::string> passes to _Hash_bytes
_STD_HASH_SEED = 0xC70F6907
# libstdc++ hash_bytes.cc: the multiplier of its 64-bit MurmurHash2 (`mul`)
_MURMUR_MULTIPLIER = (0xC6A4A793 << 32) + 0x5BD1E995
# libstdc++ hashtable_policy.h _Prime_rehash_policy: the first insert sizes an empty
# unordered_set for 11 elements -> the next prime above 11 buckets, and it grows only past 13
_FIRST_BUCKET_COUNT = 13


def _shift_mix(value: int) -> int:
    return value ^ (value >> 47)


def _std_hash(data: bytes) -> int:
    """Return libstdc++'s 64-bit `std::hash<std::string>` of `data` (`std::_Hash_bytes`).

    Example:
        >>> _std_hash(b"data.pkl") % _FIRST_BUCKET_COUNT
        3
    """
    mask, multiplier = _UINT64_MASK, _MURMUR_MULTIPLIER
    aligned = len(data) & ~7
    result = (_STD_HASH_SEED ^ (len(data) * multiplier)) & mask
    for start in range(0, aligned, 8):
        # unaligned_load of a size_t: little-endian on the hosts we write on
        word = int.from_bytes(data[start:start + 8], "little")
        result = ((result ^ ((_shift_mix((word * multiplier) & mask) * multiplier) & mask)) * multiplier) & mask
    if len(data) & 7:
        # load_bytes: the trailing bytes, last one most significant
        result = ((result ^ int.from_bytes(data[aligned:], "little")) * multiplier) & mask
    result = (_shift_mix(result) * multiplier) & mask
    return _shift_mix(result)


def _unordered_set_order(names: Sequence[str]) -> list[str]:
    """Return the iteration order of a libstdc++ `std::unordered_set<std::string>` after
    inserting `names` in order (at most 13: no rehash beyond the first sizing).

    libstdc++ (hashtable.h `_M_insert_bucket_begin`) keeps one singly linked list: a node
    whose bucket is empty goes to the front of the list, otherwise to the front of its bucket.
    """
    if len(names) > _FIRST_BUCKET_COUNT:
        raise ValueError(f"{len(names)} names would rehash the set; only up to {_FIRST_BUCKET_COUNT} are modelled")
    order: list[tuple[int, str]] = []
    for name in names:
        bucket = _std_hash(name.encode()) % _FIRST_BUCKET_COUNT
        at = next((i for i, (other, _) in enumerate(order) if other == bucket), 0)
        order.insert(at, (bucket, name))
    return [name for _, name in order]


def _record_name_hash_from_torch() -> bytes:
    """Return the name-hash half of a serialization id as the installed torch.save writes it."""
    import torch

    buffer = io.BytesIO()
    torch.save(torch.zeros(0), buffer)
    data = buffer.getvalue()
    marker = f"{RECORD_ARCHIVE}/.data/serialization_id".encode()
    at = data.index(marker) + len(marker)
    (extra_length,) = struct.unpack_from("<H", data, at - len(marker) - 2)
    return data[at + extra_length:at + extra_length + 20]


@functools.lru_cache(maxsize=1)
def _record_name_hash() -> bytes:
    """Return the first half of torch's serialization id, 20 digits: the record names' hashes
    combined, the same for every single-tensor record.

    inline_container.cc `writeSerializationId` combines `c10::hash<std::string>` (that is
    std::hash, so it depends on the C++ library torch was built with) of each name, in the
    iteration order of the std::unordered_set `files_written_`. On Linux torch is built
    against libstdc++, which we compute here; elsewhere we ask torch.
    """
    if not (sys.platform.startswith("linux") and sys.maxsize > 2**32):
        return _record_name_hash_from_torch()
    combined = 0
    for name in _unordered_set_order(_RECORD_NAMES):
        combined = _hash_combine(combined, _std_hash(name.encode()))
    return b"%020d" % combined


def _serialization_id(crcs: Sequence[int]) -> bytes:
    # inline_container.cc writeSerializationId: name hash, then the combined CRC-32s of the
    # records in write order, each zero-padded to 20 digits
    combined = 0
    for crc in crcs:
        combined = _hash_combine(combined, crc)
    return _record_name_hash() + b"%020d" % combined


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one tensor chunk's torch.save record: `head`, data, then `tail(crc)`."""

    dtype: str
    shape: tuple[int, ...]
    head: bytes
    data_length: int
    tail_length: int

    @property
    def length(self) -> int:
        return len(self.head) + self.data_length + self.tail_length

    @property
    def data_offset(self) -> int:
        """Where `data/0`'s bytes start, relative to the record."""
        return len(self.head)

    def tail(self, crc32: int) -> bytes:
        """Return the bytes after the data, given the CRC-32 of the data."""
        return _build(self.dtype, self.shape, crc32)[1]


def _build(dtype: str, shape: tuple[int, ...], crc32: int) -> tuple[bytes, bytes, int]:
    data_length = dtypes.ITEMSIZE[dtype]
    for size in shape:
        data_length *= size
    writer = _RecordWriter()
    # torch/serialization.py `_save` record order
    writer.record("data.pkl", tensor_pickle(dtype, shape))
    writer.record(".format_version", FORMAT_VERSION)
    writer.record(".storage_alignment", str(ALIGNMENT).encode())
    writer.record("byteorder", sys.byteorder.encode())
    writer.local_header(f"{RECORD_ARCHIVE}/data/0".encode(), data_length)
    head = bytes(writer.out)
    writer.out = bytearray()
    writer.skip(data_length)
    writer.descriptor(crc32)
    writer.record("version", FILE_FORMAT_VERSION)
    # torch combines the CRC-32 of non-empty records only
    crcs = [entry.crc32 for entry in writer.entries if entry.size]
    writer.record(".data/serialization_id", _serialization_id(crcs))
    writer.finish()
    return head, bytes(writer.out), data_length


@functools.lru_cache(maxsize=4096)
def record_layout(dtype: str, shape: tuple[int, ...]) -> RecordLayout:
    """Return the layout of the torch.save record of a contiguous `dtype` tensor of `shape`.

    Example:
        >>> record_layout("float32", (5, 8)).length   # as torch.save(torch.empty(5, 8))
        1705
    """
    if sys.byteorder != "little":
        raise NotImplementedError("writing checkpoints on a big-endian host is not supported")
    head, tail, data_length = _build(dtype, tuple(shape), 0)
    return RecordLayout(dtype, tuple(shape), head, data_length, len(tail))


def record_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    """Return a whole torch.save record holding `data` (small tensors, tests)."""
    layout = record_layout(dtype, tuple(shape))
    if len(data) != layout.data_length:
        raise ValueError(f"{len(data)} bytes given for a {dtype} tensor of shape {list(shape)}")
    return layout.head + data + layout.tail(zlib.crc32(data))


# ---------------------------------------------------------------------------------------------
# .metadata


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as it will be recorded: its box and where its blob is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoredTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[StoredChunk, ...]


@dataclass(frozen=True)
class StoredObject:
    fqn: str
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()  # stream transforms its blob was written with (zstd)


# torch/distributed/checkpoint/filesystem.py CURRENT_DCP_VERSION of torch 2.13.0, the version
# whose FileSystemWriter our `.metadata` and blobs reproduce (tests check it against the
# installed torch)
DCP_VERSION = "1.0.0"

# pickle.dump's default, as FileSystemWriter.finish calls it
METADATA_PICKLE_PROTOCOL = pickle.DEFAULT_PROTOCOL

# The classes' modules are their interned `__module__` strings, as pickle finds them
_METADATA_MODULE = sys.intern("torch.distributed.checkpoint.metadata")
_FILESYSTEM_MODULE = sys.intern("torch.distributed.checkpoint.filesystem")
_METADATA = _Global(_METADATA_MODULE, "Metadata")
_TENSOR_STORAGE_METADATA = _Global(_METADATA_MODULE, "TensorStorageMetadata")
_TENSOR_PROPERTIES = _Global(_METADATA_MODULE, "TensorProperties")
_CHUNK_STORAGE_METADATA = _Global(_METADATA_MODULE, "ChunkStorageMetadata")
_BYTES_STORAGE_METADATA = _Global(_METADATA_MODULE, "BytesStorageMetadata")
_METADATA_INDEX = _Global(_METADATA_MODULE, "MetadataIndex")
_STORAGE_META = _Global(_METADATA_MODULE, "StorageMeta")
_STORAGE_INFO = _Global(_FILESYSTEM_MODULE, "_StorageInfo")
_SIZE = _Global(sys.intern("torch"), "Size")
# torch.strided: copyreg reduces a layout to `torch.serialization._get_layout("torch.strided")`
_STRIDED = _Reduce(_Global(sys.intern("torch.serialization"), "_get_layout"), ("torch.strided",))
# TensorProperties.__getstate__ encodes torch.contiguous_format as this enum member
_CONTIGUOUS_FORMAT = _Reduce(_Global(_METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,))


def _size(values: Sequence[int]) -> _Reduce:
    # torch.Size reduces to (torch.Size, (tuple(self),)): fresh tuples every time
    return _Reduce(_SIZE, ((*values,),))


def _tensor_properties(dtype: str) -> _NewObject:
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    return _NewObject(_TENSOR_PROPERTIES, (_dtype_global(dtype), _STRIDED, False, _CONTIGUOUS_FORMAT, False))


def _metadata_index(fqn: str, offsets: Sequence[int] | None, index: int | None) -> _NewObject:
    # MetadataIndex.__init__ sets fqn, index, then offset only when given
    state: dict[str, Any] = {"fqn": fqn, "index": index}
    if offsets is not None:
        state["offset"] = _size(offsets)
    return _NewObject(_METADATA_INDEX, state)


def _storage_info(file: str, offset: int, length: int, transforms: Sequence[str] = ()) -> _NewObject:
    # _StorageInfo.__getstate__ leaves out transform_descriptors when it is None (torch
    # writes None for no transforms, else the list of descriptors)
    state: dict[str, Any] = {"relative_path": file, "offset": offset, "length": length}
    if transforms:
        state["transform_descriptors"] = list(transforms)
    return _NewObject(_STORAGE_INFO, state)


def _path_object(path: PurePath) -> _Reduce:
    # a pathlib path reduces to (its class, its parts)
    cls, args = path.__reduce_ex__(METADATA_PICKLE_PROTOCOL)
    return _Reduce(_Global(cls.__module__, cls.__qualname__), args)


def metadata_bytes(
    tensors: Iterable[StoredTensor],
    objects: Iterable[StoredObject],
    planner_data: Mapping[str, tuple],
    checkpoint_id: PurePath | str | None,
    save_id: str,
) -> bytes:
    """Return the `.metadata` pickle FileSystemWriter.finish would write for these entries.

    The bytes are those of `pickle.dump(Metadata(...))` with torch's own dataclasses (version
    `DCP_VERSION`), written from stand-ins without importing torch. `planner_data` is the
    default planner's fqn -> key path mapping (torch's loader uses it to nest the flat entries
    back into the state dict).

    Example:
        >>> step = StoredObject("step", "__0_0.distcp", 0, 10)
        >>> data = metadata_bytes([], [step], {"step": ("step",)}, Path("out"), "save-1")
        >>> data[:2], len(data)   # protocol 4; ckpttool's reader and torch's pickle.load read it
        (b'\\x80\\x04', 493)
    """
    with paused_gc():  # many small acyclic stand-ins (see paused_gc)
        metadata = _metadata_object(tensors, objects, planner_data, checkpoint_id, save_id)
        return _Pickler(METADATA_PICKLE_PROTOCOL).dump(metadata)


def _metadata_object(tensors, objects, planner_data, checkpoint_id, save_id) -> _NewObject:
    """Return the stand-in for torch's `Metadata` (see `metadata_bytes` for the arguments)."""
    state_dict_metadata: dict[str, _NewObject] = {}
    # storage_data is keyed by MetadataIndex, equal when fqn and offset are (index is not
    # compared); a repeated key keeps its first MetadataIndex and takes the last value
    storage_data: dict[tuple[str, tuple[int, ...] | None], list[_NewObject]] = {}

    def store(key: _NewObject, fqn: str, offsets: tuple[int, ...] | None, info: _NewObject) -> None:
        entry = storage_data.setdefault((fqn, offsets), [key, info])
        entry[1] = info

    for tensor in tensors:
        chunks = []
        for index, chunk in enumerate(tensor.chunks):
            chunks.append(_NewObject(_CHUNK_STORAGE_METADATA, {"offsets": _size(chunk.offsets), "sizes": _size(chunk.sizes)}))
            info = _storage_info(chunk.file, chunk.offset, chunk.length)
            store(_metadata_index(tensor.fqn, chunk.offsets, index), tensor.fqn, tuple(chunk.offsets), info)
        state_dict_metadata[tensor.fqn] = _NewObject(
            _TENSOR_STORAGE_METADATA,
            {"properties": _tensor_properties(tensor.dtype), "size": _size(tensor.shape), "chunks": chunks},
        )
    for obj in objects:
        state_dict_metadata[obj.fqn] = _NewObject(_BYTES_STORAGE_METADATA, None)  # empty __dict__
        store(_metadata_index(obj.fqn, None, None), obj.fqn, None, _storage_info(obj.file, obj.offset, obj.length, obj.transforms))

    if checkpoint_id is None or isinstance(checkpoint_id, str):
        checkpoint = checkpoint_id
    elif isinstance(checkpoint_id, PurePath):
        checkpoint = _path_object(checkpoint_id)
    else:
        raise TypeError(f"checkpoint_id must be a path, a string or None, not {type(checkpoint_id).__name__}")
    storage_meta = _NewObject(
        _STORAGE_META, {"checkpoint_id": checkpoint, "save_id": save_id, "load_id": None, "modules": []}
    )
    return _NewObject(
        _METADATA,
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": dict(planner_data),
            "storage_data": {key: info for key, info in storage_data.values()},
            "storage_meta": storage_meta,
            "version": DCP_VERSION,
        },
    )


def data_file_name(rank: int) -> str:
    """Return torch's name for rank `rank`'s data file (FileSystemWriter: `__{rank}_{n}.distcp`)."""
    return f"__{rank}_0.distcp"

