"""Read one torch.save file (`.pt`, `.pth`, `.bin`, `.ckpt`) holding a state dict, without torch.

The file is a torch.save zip (torch >= 1.6; torch/serialization.py `_save`, read with
`torchsave/zip.py`). Its `data.pkl` is checked by the budgeted loader (`safepickle.scan_pickle`)
and built only from stand-ins of our own for the globals a state dict names (`_ALLOWED`:
`_rebuild_tensor_v2/v3`, storages, `OrderedDict`, `torch.Size`, dtypes, devices, Parameters),
which record numbers and never run anything. The legacy non-zip format (torch < 1.6, or
`_use_new_zipfile_serialization=False`) is refused.

What is read: the value must be a dict, possibly nested (`model.state_dict()`, consolidate's
output, HF `pytorch_model.bin`, Lightning's `{"state_dict": ..., "optimizer_states": [...], ...}`).
Entries are named as DCP flattens a state dict (torch/distributed/checkpoint/_traverse.py
`traverse_state_dict`): dict keys joined with ".", lists walked by index when they hold a dict
or a tensor; `nesting` keeps each key path. Every tensor is one chunk whose blob is its raw
byte range in the file (`checkpoint.raw_range_transforms`, with the storage's CRC-32 when the
tensor is the whole storage); tied weights name the same range. A tensor must be a
contiguous row-major view of its storage (any storage offset): a non-contiguous view saved
as it is raises UnsupportedFormat. Other values (ints, floats, strings, lists, None, ...) are
left out: the Checkpoint holds the file's tensors only.

The model's weights: under `state_dict` (Lightning), `model` or `module` (DeepSpeed) when that
top-level value is a dict; otherwise the top-level keys are the model's (`model_prefix=""`).

Example:
    >>> checkpoint = read_torch_pt("pytorch_model.bin")
    >>> checkpoint.tensors["lm_head.weight"].chunks[0].blob.transforms
    ('ckpttool.raw',)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from ckpttool.core import dtypes
from ckpttool.store import storage
from ckpttool.core.checkpoint import Checkpoint, Chunk, Tensor, as_path, refuse_bad_names
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CorruptMetadata, NotACheckpoint, UnsupportedFormat
from ckpttool.readers.detect import HUB_TORCH_FILE
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED, _Rebuilt
from ckpttool.torchsave.stored import StateDictUnpickler, device, file_entries, ints, load_data_pkl, raw_blob, stored_dtype
from ckpttool.torchsave.zip import LOCAL_MAGIC

# torch/serialization.py MAGIC_NUMBER (0x1950a86a20f9469cfc6c), pickled first by `_legacy_save`
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
# top-level keys whose dict holds the model's weights: Lightning's checkpoint (`state_dict`),
# `{"model": ..., "optimizer": ...}` saves and ckpttool's own `consolidate --all`, DeepSpeed (`module`)
MODEL_SUBTREES = ("state_dict", "model", "module")


# ---------------------------------------------------------------------------------------------
# Stand-ins for what a state dict's data.pkl names (nothing here runs code from the file)


def _parameter(data: Any, *rest: Any) -> Any:
    """`torch._utils._rebuild_parameter(_with_state)`: an nn.Parameter is its tensor."""
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    **_TENSOR_PICKLE_ALLOWED,  # _rebuild_tensor_v2/v3, typed storages, OrderedDict, torch.Size
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch", "device"): device,
}


class _Unpickler(StateDictUnpickler):
    """The checking loader with a state dict's allowlist: a refused name is named in one line."""


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
    file = torch_pt_file(as_path(storage.location(path)))
    root, name = file.parent, file.name
    where = str(file)
    with DataFiles(root, follow_symlinks) as files:
        size = files.size(name)

        def read(offset: int, length: int) -> bytes:
            return files.read(name, offset, length)

        _refuse_legacy(read(0, min(size, len(LEGACY_MAGIC))), where)
        entries = file_entries(read, size, where)
        state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED)
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
                dtype = stored_dtype(value, here)
                shape = ints(value.shape, f"{here}: shape")
                blob = raw_blob(entries, starts, read, size, here, name, value, dtype)
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
                      notes=tuple(notes), model_prefix=_model_subtree(state))


def _refuse_legacy(head: bytes, where: str) -> None:
    if head.startswith(LOCAL_MAGIC):
        return
    if head == LEGACY_MAGIC:
        raise UnsupportedFormat(f"{where}: a legacy (non-zip) torch.save file, which this build does not read; "
                                "re-save it with torch >= 1.6's default torch.save")
    raise CorruptMetadata(f"{where}: not a torch.save zip file (it does not start with a zip header)")


def _kind(value: Any) -> str:
    return "tensor" if isinstance(value, _Rebuilt) else type(value).__name__


def _walked(items: list) -> bool:
    """True for a list DCP flattens by index: one holding a dict, a tensor or such a list
    (torch/distributed/checkpoint/_traverse.py `_is_terminal` with `_keep_visiting_tensors`)."""
    return any(isinstance(item, (dict, _Rebuilt)) or (isinstance(item, list) and _walked(item)) for item in items)


def _walk(value: Any, keys: tuple, leaves: list, where: str) -> None:
    """Append (key path, tensor) for every tensor under `value`, in the file's order."""
    items: Iterable[tuple[Any, Any]]
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


def _model_subtree(state: dict) -> str:
    for key in MODEL_SUBTREES:
        if isinstance(state.get(key), dict) and _holds_tensor(state[key]):
            return key
    return ""


