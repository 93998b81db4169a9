"""ckpttool: see inside, validate, reshard and consolidate PyTorch Distributed Checkpoints.

The public API, imported lazily so that `import ckpttool` stays cheap (no torch):

    >>> import ckpttool
    >>> ckpttool.inspect("runs/gpt/step-00000200").summary.parameters
    >>> ckpttool.validate("runs/gpt/step-00000200", deep=True).valid
    >>> ckpttool.consolidate("runs/gpt/step-00000200", "model.safetensors",
    ...                      ckpttool.ConvertOptions(dtype="bf16"), ckpttool.WriteOptions(verify=True)).files
    >>> ckpttool.read_checkpoint("runs/gpt/step-00000200").tensors["model.tok_emb.weight"].shape
    >>> with ckpttool.open("runs/gpt/step-00000200") as f:
    ...     f.get_tensor("tok_emb.weight")                     # a torch tensor, bit for bit
    >>> ckpttool.load_into(model, "runs/gpt/step-00000200")     # model + one tensor in memory
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_API = {
    "inspect": ("ckpttool.commands.inspect", "inspect"),
    "validate": ("ckpttool.commands.validate", "validate"),
    "consolidate": ("ckpttool.commands.consolidate", "consolidate"),
    "reshard": ("ckpttool.commands.reshard", "reshard"),
    "diff": ("ckpttool.commands.diff", "diff"),
    "push": ("ckpttool.commands.push", "push"),
    "read_checkpoint": ("ckpttool.readers.dcp", "read_checkpoint"),
    "open": ("ckpttool.load", "open"),
    "load_state_dict": ("ckpttool.load", "load_state_dict"),
    "load_into": ("ckpttool.load", "load_into"),
    "CheckpointError": ("ckpttool.core.errors", "CheckpointError"),
    "export": ("ckpttool.commands.export", "export"),
    "export_adapter": ("ckpttool.commands.export_adapter", "export_adapter"),
    "import_checkpoint": ("ckpttool.commands.import_", "import_checkpoint"),
    "ConvertOptions": ("ckpttool.options", "ConvertOptions"),
    "SourceOptions": ("ckpttool.options", "SourceOptions"),
    "WriteOptions": ("ckpttool.options", "WriteOptions"),
    "AdapterOptions": ("ckpttool.options", "AdapterOptions"),
    "manifest": ("ckpttool.commands.manifest", "manifest"),  # manifest (issue 34)
    "check_manifest": ("ckpttool.commands.manifest", "check"),
    "import_to_framework": ("ckpttool.commands.import_framework", "import_to_framework"),  # issue 46
    "latest": ("ckpttool.commands.latest", "latest"),  # run care (issue 47)
    "average": ("ckpttool.commands.average", "average"),
}

__all__ = ["__version__", *_API]

# modules that lived at the top level before the packages (issue 45): their old import paths
# (`ckpttool.distributed.sharing()`, `from ckpttool import storage`) still give the same module
MOVED = {
    "core": ("checkpoint", "errors", "dtypes", "geometry", "numerics", "testpoints"),
    "store": ("storage", "s3", "spans", "io", "safepaths"),
    "model": ("model_view", "keys", "lora", "quantization"),
    "check": ("integrity", "integrity_small", "manifest", "expected_keys"),
    "run": ("execute", "locating", "record_writes", "dequantizing", "merge", "distributed", "adapter"),
    "render": ("shard_map",),
}
_MOVED_TO = {f"{__name__}.{module}": f"{__name__}.{package}.{module}" for package, modules in MOVED.items()
             for module in modules}


class _OldPaths:
    """Serves `ckpttool.<old name>` as the module at its new home (asked only after the normal
    finders found nothing: it sits last on sys.meta_path). A finder and loader by protocol, not
    by importlib.abc's classes, whose import costs more than the rest of `import ckpttool`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in _MOVED_TO else None  # type: ignore[arg-type]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(_MOVED_TO[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
