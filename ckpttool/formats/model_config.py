"""A model folder's `config.json`: the file that names a Hub model's architecture and its
quantisation, read beside a checkpoint (a Hub folder's own)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpttool.store.safepaths import read_json_object

HUB_CONFIG = "config.json"  # transformers CONFIG_NAME: a model folder's config beside its weights


def config_beside(path: Path | Any) -> dict[str, Any] | None:
    """Return `config.json` beside a local checkpoint (a Hub folder's own: what names its
    quantisation, `quantization.find`), or None."""
    if not isinstance(path, Path):
        return None  # object storage: the config comes with --assets
    candidate = path / HUB_CONFIG
    return read_json_object(candidate) if os.path.isfile(candidate) else None
