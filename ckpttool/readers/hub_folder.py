"""Read a Hugging Face Hub style model folder: `model.safetensors`, or shards plus
`model.safetensors.index.json` (huggingface_hub `save_torch_state_dict`, transformers
`save_pretrained`), one chunk per tensor, without torch.

Example:
    >>> checkpoint = read_hub_folder("Qwen2-0.5B/")
    >>> checkpoint.metadata_file
    'model.safetensors.index.json'
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpttool.store import storage
from ckpttool.core.checkpoint import as_path
from ckpttool.store.safepaths import containment_root
from ckpttool.core.errors import NotACheckpoint
from ckpttool.formats.hub import INDEX_SUFFIX
from ckpttool.formats.safetensors import SUFFIX
from ckpttool.readers.safetensors import build_checkpoint, read_header, read_index

SINGLE_FILENAME = "model.safetensors"  # huggingface_hub.constants.SAFETENSORS_SINGLE_FILE
INDEX_FILENAME = SINGLE_FILENAME + INDEX_SUFFIX  # huggingface_hub.constants.SAFETENSORS_INDEX_FILE


def index_files(root: Path) -> list[str]:
    """Return the `*.safetensors.index.json` files of a folder, `model.safetensors.index.json`
    first (diffusers and adapters use other stems)."""
    try:
        names = sorted(p.name for p in root.iterdir() if p.name.endswith(SUFFIX + INDEX_SUFFIX) and p.is_file())
    except OSError:
        return []
    return sorted(names, key=lambda name: name != INDEX_FILENAME)


def safetensors_files(root: Path) -> list[str]:
    """Return the `.safetensors` files directly in a folder, sorted."""
    try:
        return sorted(p.name for p in root.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    except OSError:
        return []


def read_hub_folder(path: str | os.PathLike, follow_symlinks: bool = False):
    """Return the Checkpoint of a Hub folder: the index's weight map if there is one, else
    its single `.safetensors` file (`model.safetensors` preferred)."""
    root = as_path(storage.location(path))
    inside = None if follow_symlinks else containment_root(root)
    indexes = index_files(root)
    if indexes:
        weight_map = read_index(root / indexes[0])
        headers = [read_header(root, name, inside) for name in sorted(set(weight_map.values()))]
        return build_checkpoint(root, headers, indexes[0], names=weight_map)
    files = safetensors_files(root)
    if SINGLE_FILENAME in files:
        files = [SINGLE_FILENAME]
    if len(files) != 1:
        raise NotACheckpoint(f"{root}: {len(files)} .safetensors files and no {INDEX_FILENAME} saying which "
                             "tensors each holds" if files else f"{root}: no .safetensors files")
    return build_checkpoint(root, [read_header(root, files[0], inside)], files[0])
