"""What a DCP `.metadata` pickle may name: each (module, name) and the stand-in it maps to;
anything else is refused before it is looked up."""

from __future__ import annotations

from typing import Any

from ckpttool.core import dtypes
from ckpttool.core.errors import UnsafeMetadata
from ckpttool.safepickle.standins import (_DType, _Shape, _enum_member, _layout, _memory_format_encoding, _path,
                                          _record_class, _windows_path, _write_item_type)

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
