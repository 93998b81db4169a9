"""Read what torch's `HuggingFaceStorageWriter` writes, without torch.

With `save_distributed=True` every rank writes its local shards to
`shard-0000R-model-0000K-of-0000N.safetensors` and no `.metadata` at all
(torch/distributed/checkpoint/hf_storage.py `finish`). Each file's `__metadata__` holds
`DCP_SHARDING_INFO`: JSON `{fqn: {"saved_offsets": [...]}}`, where each local shard sits in
its global tensor (torch/distributed/checkpoint/filesystem.py `_write_files_from_queue`). The
global shape is the largest extent of a tensor's shards, as `HuggingFaceStorageReader.
read_metadata` computes it. Rank-0 saves (`save_distributed=False`) and the consolidated output
(`enable_consolidation=True`, or `consolidate_safetensors_files`) are
`model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json` (its weight map names
each tensor's file); the consolidator writes headers without `__metadata__`.

Example:
    >>> checkpoint = read_dcp_hf("ckpt/hf-step-10")
    >>> [c.offsets for c in checkpoint.tensors["embed.weight"].chunks]
    [(0, 0), (16, 0)]
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ckpttool.store import storage
from ckpttool.core.checkpoint import as_path
from ckpttool.store.safepaths import containment_root
from ckpttool.core.errors import CorruptMetadata, NotACheckpoint
from ckpttool.formats.safetensors import SUFFIX
from ckpttool.readers.safetensors import Header, build_checkpoint, read_header, read_index

# torch/distributed/checkpoint/_hf_utils.py
INDEX_FILENAME = "model.safetensors.index.json"  # `_metadata_fn`
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # `CUSTOM_METADATA_KEY`
SAVED_OFFSETS_KEY = "saved_offsets"
SHARDED_DIR_NAME = "sharded"  # where enable_consolidation puts the per-rank files
SHARD_FILE_PATTERN = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")  # SHARDED_FILE_NAME
MODEL_FILE_PATTERN = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")  # FILE_NAME
SHARD_FILES_GLOB = "shard-*-model-*-of-*.safetensors"  # shown as the metadata file when there is no index


def sharding_offsets(header: Header) -> dict[str, tuple[int, ...]]:
    """Return each entry's offsets in its global tensor from `DCP_SHARDING_INFO` (all zeros
    when the file has none, as torch's reader assumes). Raises CorruptMetadata naming the
    file and tensor when the info is malformed or does not fit the entry."""
    text = header.metadata.get(SHARDING_INFO_KEY)
    if text is None:
        return {entry.name: (0,) * len(entry.shape) for entry in header.entries}
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise CorruptMetadata(f"{header.file}: {SHARDING_INFO_KEY} is not JSON ({type(error).__name__})") from None
    if not isinstance(info, dict):
        raise CorruptMetadata(f"{header.file}: {SHARDING_INFO_KEY} is not a JSON object")
    placement = {}
    for entry in header.entries:
        record = info.get(entry.name)
        offsets = record.get(SAVED_OFFSETS_KEY) if isinstance(record, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != len(entry.shape)
                or not all(type(n) is int and n >= 0 for n in offsets)):
            raise CorruptMetadata(f"{header.file}: {entry.name}: {SHARDING_INFO_KEY} has no valid "
                                  f"{SAVED_OFFSETS_KEY} for its {len(entry.shape)} dimensions")
        placement[entry.name] = tuple(offsets)
    return placement


def shard_files(root: Path) -> list[str]:
    """Return the per-rank shard files of a directory, sorted."""
    try:
        return sorted(p.name for p in root.iterdir() if SHARD_FILE_PATTERN.match(p.name))
    except OSError:
        return []


def read_dcp_hf(path: str | os.PathLike, follow_symlinks: bool = False):
    """Return the Checkpoint of a HuggingFaceStorageWriter directory: the files its
    `model.safetensors.index.json` maps if there is one, else every `*.safetensors` in it
    (torch's reader takes them all), each shard placed by `DCP_SHARDING_INFO`."""
    root = as_path(storage.location(path))
    inside = None if follow_symlinks else containment_root(root)
    index = root / INDEX_FILENAME
    if index.is_file():
        weight_map = read_index(index)
        headers = [read_header(root, name, inside) for name in sorted(set(weight_map.values()))]
        return build_checkpoint(root, headers, INDEX_FILENAME, sharding_offsets, names=weight_map)
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    if not names:
        raise NotACheckpoint(f"{root}: no .safetensors files, so this is not a HuggingFaceStorageWriter checkpoint")
    headers = [read_header(root, name, inside) for name in names]
    return build_checkpoint(root, headers, SHARD_FILES_GLOB, sharding_offsets)
