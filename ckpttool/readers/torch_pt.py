"""Read one torch.save file (`.pt`, `.pth`, `.bin`, `.ckpt`) holding a state dict, without torch.

The file is a torch.save zip (torch >= 1.6; torch/serialization.py `_save`, read with
`torchsave/zip.py`). Its `data.pkl` is checked by the budgeted loader (`dcp.metadata.scan_pickle`)
and built only from stand-ins of our own for the globals a state dict names (`_ALLOWED`:
`_rebuild_tensor_v2/v3`, storages, `OrderedDict`, `torch.Size`, dtypes, devices, Parameters),
which record numbers and never run anything. The legacy non-zip format (torch < 1.6, or
`_use_new_zipfile_serialization=False`) is refused.

What is read: the value must be a dict, possibly nested (`model.state_dict()`, consolidate's
output, HF `pytorch_model.bin`, Lightning's `{"state_dict": ..., "optimizer_states": [...], ...}`).
Entries are named as DCP flattens a state dict (torch/distributed/checkpoint/_traverse.py
`traverse_state_dict`): dict keys joined with ".", lists walked by index when they hold a dict
or a tensor; `nesting` keeps each key path. Every tensor is one chunk whose blob is its raw
byte range in the file (`dcp.blobs.raw_range_transforms`, with the storage's CRC-32 when the
tensor is the whole storage); tied weights name the same range. A tensor must be a
contiguous row-major view of its storage (any storage offset): a non-contiguous view saved
as it is raises UnsupportedFormat. Other values (ints, floats, strings, lists, None, ...) are
left out: the Checkpoint holds the file's tensors only.

The model's weights: under `state_dict` (Lightning), `model` or `module` (DeepSpeed) when that
top-level value is a dict; otherwise the top-level keys are the model's (`model_subtree=None`).

Example:
    >>> checkpoint = read_torch_pt("pytorch_model.bin")
    >>> checkpoint.tensors["lm_head.weight"].chunks[0].blob.transforms
    ('ckpttool.raw',)
"""

from __future__ import annotations

import io
import math
import os
import pickletools
from pickle import BUILD, POP
from pathlib import Path
from typing import Any

from ckpttool import dtypes, storage
from ckpttool.dcp.blobs import DataFiles, raw_range_transforms
from ckpttool.dcp.metadata import Blob, Checkpoint, Chunk, PickleRefused, RestrictedUnpickler, Tensor, refuse_bad_names
from ckpttool.errors import CheckpointError, CorruptBlob, CorruptMetadata, NotACheckpoint, UnsafeMetadata, UnsupportedFormat
from ckpttool.readers.detect import HUB_TORCH_FILE
from ckpttool.torchsave.archive import contiguous_strides
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED, _persistent_storage, _Rebuilt, _Storage
from ckpttool.torchsave.zip import LOCAL_MAGIC, Entry, entry_bytes, entry_data_offset, find_entry, read_directory

MAX_PICKLE_BYTES = 256 << 20  # a 70B model's state dict pickles to a few MB
# torch/serialization.py MAGIC_NUMBER (0x1950a86a20f9469cfc6c), pickled first by `_legacy_save`
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
# top-level keys whose dict holds the model's weights: Lightning's checkpoint (`state_dict`),
# `{"model": ..., "optimizer": ...}` saves and ckpttool's own `consolidate --all`, DeepSpeed (`module`)
MODEL_SUBTREES = ("state_dict", "model", "module")


# ---------------------------------------------------------------------------------------------
# Stand-ins for what a state dict's data.pkl names (nothing here runs code from the file)


class _DTypeName:
    """A torch dtype global (`torch.float32`); `_rebuild_tensor_v3` reads its `.name`."""

    def __init__(self, name: str) -> None:
        self.name = name


def _parameter(data: Any, *rest: Any) -> Any:
    """`torch._utils._rebuild_parameter(_with_state)`: an nn.Parameter is its tensor."""
    return data


def _device(kind: Any, index: Any = None) -> str:
    return kind if type(kind) is str else "?"


_ALLOWED: dict[tuple[str, str], Any] = {
    **_TENSOR_PICKLE_ALLOWED,  # _rebuild_tensor_v2/v3, typed storages, OrderedDict, torch.Size
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch", "device"): _device,
}


class _Unpickler(RestrictedUnpickler):
    """The checking loader with a state dict's allowlist: a refused name is named in one line."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and not name.startswith("_"):
            try:
                return _DTypeName(dtypes.canonical(name))
            except KeyError:
                pass
        raise UnsafeMetadata(
            f"{self._source}: refuses to load `{module:.200}.{name:.200}`, which a state dict of tensors and "
            "plain values never holds; nothing from the file was executed (the file is corrupt or was "
            "crafted to run code)")


# ---------------------------------------------------------------------------------------------
# Reading


def torch_pt_file(path: Path) -> Path:
    """Return the torch.save file at `path`: the file itself, or a folder's `pytorch_model.bin`."""
    if path.is_dir():
        if (path / HUB_TORCH_FILE).is_file():
            return path / HUB_TORCH_FILE
        raise NotACheckpoint(f"{path}: no {HUB_TORCH_FILE} here")
    return path


def read_torch_pt(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return the tensors of a torch.save file (or a folder's `pytorch_model.bin`) as a
    Checkpoint rooted at its folder: one chunk per tensor, each a raw byte range of the file.

    Raises UnsafeMetadata for a pickle naming anything outside the allowlist, CorruptMetadata
    or CorruptBlob for a damaged or truncated file, UnsupportedFormat for the legacy non-zip
    format, a big-endian file or a non-contiguous tensor.
    """
    file = torch_pt_file(storage.location(path))
    root, name = file.parent, file.name
    where = str(file)
    with DataFiles(root, follow_symlinks) as files:
        size = files.size(name)

        def read(offset: int, length: int) -> bytes:
            return files.read(name, offset, length)

        _refuse_legacy(read(0, min(size, len(LEGACY_MAGIC))), where)
        try:
            entries = read_directory(read, size, where)
        except CorruptBlob as error:
            raise CorruptMetadata(f"{where}: truncated or damaged torch.save file: "
                                  f"{str(error).removeprefix(where + ': ')}") from None
        pickle_entry = find_entry(entries, "data.pkl")
        if pickle_entry is None:
            raise CorruptMetadata(f"{where}: not a torch.save file (no data.pkl in the zip)")
        byteorder = find_entry(entries, "byteorder")
        if byteorder is not None and entry_bytes(read, size, byteorder, where, 16) != b"little":
            raise UnsupportedFormat(f"{where}: saved on a big-endian machine; this build reads little-endian files only")
        state = _unpickle(entry_bytes(read, size, pickle_entry, where, MAX_PICKLE_BYTES), where)
        if not isinstance(state, dict):
            raise UnsupportedFormat(f"{where}: holds a {_kind(state)}, not a dict; this build reads torch.save "
                                    "files of (nested) state dicts")
        leaves: list[tuple[tuple, _Rebuilt]] = []
        _walk(state, (), leaves, where)
        tensors: dict[str, Tensor] = {}
        nesting: dict[str, tuple[str | int, ...]] = {}
        starts: dict[str, int] = {}  # storage key -> where its bytes start in the file
        notes = []
        try:
            for keys, value in leaves:
                fqn = ".".join(map(str, keys))
                if fqn in tensors:
                    raise UnsupportedFormat(f"{where}: {fqn}: two entries flatten to this name (a key holding dots "
                                            "beside a nested dict); this build cannot tell them apart")
                here = f"{where}: {fqn}"
                dtype = _dtype(value, here)
                shape = _ints(value.shape, f"{here}: shape")
                blob = _blob(entries, starts, read, size, here, name, value, dtype)
                tensors[fqn] = Tensor(fqn, dtype, shape, (Chunk((0,) * len(shape), shape, blob),))
                nesting[fqn] = keys
                if dtype not in dtypes.ITEMSIZE:
                    notes.append(f"{fqn}: unknown dtype {dtype[:64]!r}")
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as error:
            raise CorruptMetadata(f"{where}: malformed tensor in data.pkl ({type(error).__name__}: "
                                  f"{str(error)[:200]})") from None
    tensors = dict(sorted(tensors.items()))
    refuse_bad_names(file, list(tensors), set(), tensors, {})
    return Checkpoint(path=root, metadata_file=name, version=None, tensors=tensors, objects={}, nesting=nesting,
                      notes=tuple(notes), model_subtree=_model_subtree(state))


def _refuse_legacy(head: bytes, where: str) -> None:
    if head.startswith(LOCAL_MAGIC):
        return
    if head == LEGACY_MAGIC:
        raise UnsupportedFormat(f"{where}: a legacy (non-zip) torch.save file, which this build does not read; "
                                "re-save it with torch >= 1.6's default torch.save")
    raise CorruptMetadata(f"{where}: not a torch.save zip file (it does not start with a zip header)")


def _builds_as_pops(raw: bytes) -> bytes:
    """Return the pickle with every `BUILD` turned into `POP` (the same stack effect).

    `module.state_dict()` is an OrderedDict carrying a `_metadata` attribute (each module's
    version), which pickles as a BUILD of the dict, at the end or nested anywhere. The checking
    loader admits BUILD of objects only, and no stand-in here is filled by BUILD: as POP the
    state is still scanned like the rest, then dropped.
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
        edited[position] = POP[0]
    return bytes(edited)


def _unpickle(raw: bytes, where: str) -> Any:
    try:
        return _Unpickler(io.BytesIO(_builds_as_pops(raw)), _ALLOWED, where, persistent=_persistent_storage).load()
    except CheckpointError:
        raise
    except PickleRefused as error:
        raise CorruptMetadata(f"{where}: data.pkl refused: {error}; nothing was built from it") from None
    except Exception as error:  # pickle raises many kinds on truncated or garbage input
        raise CorruptMetadata(f"{where}: cannot decode data.pkl ({type(error).__name__}: {str(error)[:200]})") from None


def _kind(value: Any) -> str:
    return "tensor" if isinstance(value, _Rebuilt) else type(value).__name__


def _walked(items: list) -> bool:
    """True for a list DCP flattens by index: one holding a dict, a tensor or such a list
    (torch/distributed/checkpoint/_traverse.py `_is_terminal` with `_keep_visiting_tensors`)."""
    return any(isinstance(item, (dict, _Rebuilt)) or (isinstance(item, list) and _walked(item)) for item in items)


def _walk(value: Any, keys: tuple, leaves: list, where: str) -> None:
    """Append (key path, tensor) for every tensor under `value`, in the file's order."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and _walked(value):
        items = enumerate(value)
    elif isinstance(value, _Rebuilt):
        leaves.append((keys, value))
        return
    else:
        if _holds_tensor(value):
            raise UnsupportedFormat(f"{where}: {'.'.join(map(str, keys)) or 'the top level'}: a {type(value).__name__} "
                                    "holding tensors; this build reads tensors in dicts and lists only")
        return  # a plain value: not part of the Checkpoint
    for key, item in items:
        if type(key) is not str and type(key) is not int:
            if _holds_tensor(item):
                raise UnsupportedFormat(f"{where}: {'.'.join(map(str, keys)) or 'the top level'}: a dict key that is "
                                        f"a {type(key).__name__}, above tensors; this build names entries by str and int keys")
            continue
        _walk(item, (*keys, key), leaves, where)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, _Rebuilt):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _model_subtree(state: dict) -> str | None:
    for key in MODEL_SUBTREES:
        if isinstance(state.get(key), dict) and _holds_tensor(state[key]):
            return key
    return None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptMetadata(f"{what} is not a sequence of non-negative integers")
    return tuple(value)


def _dtype(value: _Rebuilt, here: str) -> str:
    dtype = value.dtype or (value.storage.dtype if isinstance(value.storage, _Storage) else None)
    if type(dtype) is not str:
        raise CorruptMetadata(f"{here}: the tensor's dtype is not recorded")
    return dtype


def _blob(entries: dict[str, Entry], starts: dict[str, int], read: Any, size: int, here: str, name: str,
          value: _Rebuilt, dtype: str) -> Blob:
    """Return the tensor's bytes as a raw range of the file; UnsupportedFormat unless it is a
    contiguous row-major view of its storage."""
    storage_ = value.storage
    if not isinstance(storage_, _Storage):
        raise CorruptMetadata(f"{here}: the tensor has no storage")
    shape = _ints(value.shape, f"{here}: shape")
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
