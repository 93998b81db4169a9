"""`SourceOptions`: how a command reads its source, the one options object `inspect` and
`validate` take. A module of its own so that they build it without the writing commands'
options (`options.py` re-exports it beside them: one class, imported from either).

Example:
    >>> SourceOptions(model_prefix="app.model").locate("runs/x/step-00000020")
    PosixPath('runs/x/step-00000020')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from ckpttool.store import storage


@dataclass(frozen=True)
class SourceOptions:
    """How to read a checkpoint: data files that are symlinks out of it, object-storage
    options (fsspec's `storage_options`, e.g. `endpoint_url`; used for every URL the command
    opens, its output too), and where the model's state dict sits (`None`: found from the
    structure, `""`: the top level); and where one step holds checkpoints of two layouts (a Hub
    model beside the ZeRO save it was written from), the layout to read (`None`: the training save)."""

    follow_symlinks: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    model_prefix: str | None = None
    layout: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", MappingProxyType(dict(self.storage_options)))  # read-only, like the rest

    def locate(self, path: str | Any) -> Path | storage.RemotePath:
        """Return `path` as a local Path or a RemotePath carrying these storage options."""
        return storage.location(path, self.storage_options)
