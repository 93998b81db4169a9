"""Sharded safetensors for the Hugging Face Hub: which tensor goes into which shard, and the index.

We let huggingface_hub decide (its `split_state_dict_into_shards_factory` is what
`split_torch_state_dict_into_shards` and transformers' `save_pretrained` use), giving it our
metadata-only tensor sizes instead of torch tensors, so the shard names, the grouping and the
index are exactly what huggingface_hub would produce for the same state dict.

Example:
    >>> split = plan_shards({"a": 6_000_000_000, "b": 10}, max_shard_size=5 * 10**9)
    >>> split.files
    {'model-00001-of-00002.safetensors': ('a',), 'model-00002-of-00002.safetensors': ('b',)}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub.serialization._base.MAX_SHARD_SIZE
FILENAME_PATTERN = "model{suffix}.safetensors"  # huggingface_hub.constants.SAFETENSORS_WEIGHTS_FILE_PATTERN
INDEX_SUFFIX = ".index.json"  # save_torch_state_dict: filename_pattern.format(suffix="") + ".index.json"


@dataclass(frozen=True)
class ShardSplit:
    """Shard file name -> keys in it, and the index JSON (None when there is one file)."""

    files: dict[str, tuple[str, ...]]
    index_name: str | None
    index: bytes | None


def plan_shards(sizes: Mapping[str, int], max_shard_size: int) -> ShardSplit:
    """Return the split huggingface_hub makes for tensors of these byte sizes, in key order.

    One file is named `model.safetensors` and has no index, as with huggingface_hub.
    """
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        dict(sizes),
        get_storage_size=lambda size: size,
        filename_pattern=FILENAME_PATTERN,
        max_shard_size=max_shard_size,
    )
    files = {name: tuple(keys) for name, keys in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return ShardSplit(files, None, None)
    # the same document save_torch_state_dict writes: json.dump(index, f, indent=2)
    index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
    return ShardSplit(files, FILENAME_PATTERN.format(suffix="") + INDEX_SUFFIX, json.dumps(index, indent=2).encode())
