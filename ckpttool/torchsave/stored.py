"""Tensors stored inside a whole torch.save file (a state dict's `.pt`, verl's rank files),
read without torch: the data.pkl stand-ins both readers share, and each tensor's bytes as a
raw byte range of the file.

Example:
    >>> state = unpickle(raw_data_pkl, "model.pt", MyUnpickler, allowed)   # stand-ins only
    >>> blob = raw_blob(entries, starts, read, size, "model.pt: w", "model.pt", tensor, "float32")
"""

from __future__ import annotations

import io
import math
import pickletools
from dataclasses import dataclass
from pickle import BUILD, POP, STOP
from typing import Any, Callable

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Blob, raw_range_transforms
from ckpttool.core.errors import CheckpointError, CorruptMetadata, UnsafeMetadata, UnsupportedFormat
from ckpttool.safepickle import PickleRefused, RestrictedUnpickler
from ckpttool.torchsave.archive import contiguous_strides
from ckpttool.torchsave.record import _persistent_storage, _Rebuilt, _Storage
from ckpttool.torchsave.zip import Entry, entry_bytes, entry_data_offset, find_entry, read_directory

MAX_PICKLE_BYTES = 256 << 20  # a 70B model's state dict pickles to a few MB


@dataclass(frozen=True)
class DTypeName:
    """A torch dtype global (`torch.float32`); `_rebuild_tensor_v3` reads its `.name`."""

    name: str


def dtype_global(module: str, name: str) -> DTypeName | None:
    """The stand-in for `torch.<dtype>`, or None when (module, name) is not a dtype."""
    if module == "torch" and not name.startswith("_"):
        try:
            return DTypeName(dtypes.canonical(name))
        except KeyError:
            return None
    return None


class StateDictUnpickler(RestrictedUnpickler):
    """The checking loader for a state dict's data.pkl: its allowlist, torch dtypes, and for
    anything else a one-line refusal saying what kind of file never holds the name."""

    holds = "a state dict of tensors and plain values"

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if (dtype := dtype_global(module, name)) is not None:
            return dtype
        self.refuse(module, name)
        raise UnsafeMetadata(
            f"{self._source}: refuses to load `{module:.200}.{name:.200}`, which {self.holds} never holds; nothing "
            "from the file was executed (the file is corrupt or was crafted to run code)")

    def refuse(self, module: str, name: str) -> None:
        """Raise a more specific error for a name this reader knows but does not read."""


def device(kind: Any, index: Any = None) -> str:
    """`torch.device(...)`: its kind only (every tensor is read to the CPU anyway)."""
    return kind if type(kind) is str else "?"


def builds_as_pops(raw: bytes) -> bytes:
    """Return the pickle with every `BUILD` turned into `POP` (the same stack effect).

    `module.state_dict()` is an OrderedDict carrying a `_metadata` attribute (each module's
    version), which pickles as a BUILD of the dict, at the end or nested anywhere. The checking
    loader admits BUILD of objects only, and no stand-in of a state dict is filled by BUILD:
    as POP the state is still scanned like the rest, then dropped.
    """
    if BUILD not in raw:
        return raw
    try:  # parses only (the argument of another opcode may hold the BUILD byte)
        positions = [position for opcode, _, position in pickletools.genops(raw) if opcode.code == "b"]
    except Exception:  # malformed: the loader words it
        return raw
    if not positions:
        return raw
    edited = bytearray(raw)
    for position in positions:
        assert position is not None  # genops over bytes (not a stream) knows every position
        edited[position] = POP[0]
    return bytes(edited)


def closing_build_as_pop(raw: bytes) -> bytes:
    """Return the pickle with its closing `BUILD` turned into `POP`, when it ends so: for
    pickles whose stand-ins are filled by BUILD (verl's DTensorSpec), only the state dict's
    own `_metadata` BUILD, just before STOP, is dropped (see `builds_as_pops`)."""
    if raw[-2:] != BUILD + STOP:
        return raw
    try:  # parses only (the argument of another opcode may look like BUILD)
        positions = [position for _, _, position in pickletools.genops(raw)][-2:]
    except Exception:  # malformed: the loader words it
        return raw
    if positions != [len(raw) - 2, len(raw) - 1]:
        return raw
    return raw[:-2] + POP + STOP


def unpickle(raw: bytes, where: str, loader: Callable[..., RestrictedUnpickler], allowed: dict,
             rewrite: Callable[[bytes], bytes] = builds_as_pops) -> Any:
    """Return data.pkl built from stand-ins by `loader` (a RestrictedUnpickler with its own
    allowlist) after `rewrite` (which BUILDs become POPs), or raise a one-line CheckpointError
    naming `where`."""
    try:
        return loader(io.BytesIO(rewrite(raw)), allowed, where, persistent=_persistent_storage).load()
    except CheckpointError:
        raise
    except PickleRefused as error:
        raise CorruptMetadata(f"{where}: data.pkl refused: {error}; nothing was built from it") from None
    except Exception as error:  # pickle raises many kinds on truncated or garbage input
        raise CorruptMetadata(f"{where}: cannot decode data.pkl ({type(error).__name__}: {str(error)[:200]})") from None


def file_entries(read: Callable[[int, int], bytes], size: int, where: str) -> dict[str, Entry]:
    """Return the zip directory of a whole torch.save file (`read(offset, length)`), or raise
    CorruptMetadata naming it when it is truncated or damaged."""
    try:
        return read_directory(read, size, where)
    except CheckpointError as error:
        raise CorruptMetadata(f"{where}: truncated or damaged torch.save file: "
                              f"{str(error).removeprefix(where + ': ')}") from None


def load_data_pkl(entries: dict[str, Entry], read: Callable[[int, int], bytes], size: int, where: str,
                  loader: Callable[..., RestrictedUnpickler], allowed: dict,
                  rewrite: Callable[[bytes], bytes] = builds_as_pops) -> Any:
    """Return a torch.save file's data.pkl built from stand-ins (`unpickle`), after checking
    that the zip (`entries`, read by `read(offset, length)`) has one and is little-endian."""
    pickle_entry = find_entry(entries, "data.pkl")
    if pickle_entry is None:
        raise CorruptMetadata(f"{where}: not a torch.save file (no data.pkl in the zip)")
    byteorder = find_entry(entries, "byteorder")
    if byteorder is not None and entry_bytes(read, size, byteorder, where, 16) != b"little":
        raise UnsupportedFormat(f"{where}: saved on a big-endian machine; this build reads little-endian files only")
    return unpickle(entry_bytes(read, size, pickle_entry, where, MAX_PICKLE_BYTES), where, loader, allowed, rewrite)


def ints(value: Any, what: str) -> tuple[int, ...]:
    """`value` as a tuple of non-negative ints, or CorruptMetadata naming `what`."""
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptMetadata(f"{what} is not a sequence of non-negative integers")
    return tuple(value)


def stored_dtype(value: _Rebuilt, here: str) -> str:
    """The dtype a rebuilt tensor records (v3 argument, else its typed storage's)."""
    dtype = value.dtype or (value.storage.dtype if isinstance(value.storage, _Storage) else None)
    if type(dtype) is not str:
        raise CorruptMetadata(f"{here}: the tensor's dtype is not recorded")
    return dtype


def raw_blob(entries: dict[str, Entry], starts: dict[str, int], read: Any, size: int, here: str, name: str,
             value: _Rebuilt, dtype: str) -> Blob:
    """Return a rebuilt tensor's bytes as a raw range of the file `name` (its storage entry's
    data, from the storage offset), checked against the entry; UnsupportedFormat unless the
    tensor is a contiguous row-major view. `starts` caches each storage's data offset. The
    range carries the entry's CRC-32 when the tensor covers its whole storage."""
    storage_ = value.storage
    if not isinstance(storage_, _Storage):
        raise CorruptMetadata(f"{here}: the tensor has no storage")
    shape = ints(value.shape, f"{here}: shape")
    stride = tuple(value.stride)
    numel = math.prod(shape)
    if numel and any(n != 1 and s != c for n, s, c in zip(shape, stride, contiguous_strides(shape))):
        raise UnsupportedFormat(f"{here}: not contiguous (stride {list(stride)} for shape {list(shape)}: a "
                                "transposed or strided view saved as it is); save `t.contiguous()` instead")
    itemsize = dtypes.ITEMSIZE.get(dtype)
    if itemsize is None:
        raise UnsupportedFormat(f"{here}: unknown dtype {dtype[:64]!r}")
    entry = find_entry(entries, f"data/{storage_.key}")
    if entry is None:
        raise CorruptMetadata(f"{here}: its storage data/{storage_.key[:40]} is not in the file")
    storage_bytes = storage_.numel * (itemsize if storage_.dtype else 1)
    offset = value.storage_offset
    if entry.size != storage_bytes:
        raise CorruptMetadata(f"{here}: storage data/{storage_.key} holds {entry.size} bytes, data.pkl says {storage_bytes}")
    if type(offset) is not int or offset < 0 or (offset + numel) * itemsize > storage_bytes:
        raise CorruptMetadata(f"{here}: {numel} elements at storage offset {offset!r:.40} run past the "
                              f"{storage_bytes}-byte storage data/{storage_.key}")
    start = starts.get(storage_.key)
    if start is None:
        start = starts[storage_.key] = entry_data_offset(read, size, entry, here)
    whole = offset == 0 and numel * itemsize == entry.size
    return Blob(name, start + offset * itemsize, numel * itemsize, raw_range_transforms(entry.crc32 if whole else None))
