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
    "CheckpointError": ("ckpttool.errors", "CheckpointError"),
    "export": ("ckpttool.commands.export", "export"),
    "export_adapter": ("ckpttool.commands.export_adapter", "export_adapter"),
    "import_checkpoint": ("ckpttool.commands.import_", "import_checkpoint"),
    "ConvertOptions": ("ckpttool.options", "ConvertOptions"),
    "SourceOptions": ("ckpttool.options", "SourceOptions"),
    "WriteOptions": ("ckpttool.options", "WriteOptions"),
    "AdapterOptions": ("ckpttool.options", "AdapterOptions"),
    "manifest": ("ckpttool.commands.manifest", "manifest"),  # manifest (issue 34)
    "check_manifest": ("ckpttool.commands.manifest", "check"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
