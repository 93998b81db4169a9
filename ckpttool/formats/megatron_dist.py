"""Megatron-Core's `torch_dist` checkpoint beyond its DCP files: what `import --to megatron`
writes beside `.metadata` and `__R_T.distcp` (readers/megatron.py reads the same layout).

`megatron.core.dist_checkpointing.save(sharded_state_dict, dir)` writes:
- the ShardedTensors as DCP entries under their ShardedTensor keys, homogeneous layers stacked
  on a layer axis (`decoder.layers.<rest>`, naming/backward.py `stack_layers`);
- each ShardedObject as a DCP byte entry `<key>/shard_<offset>_<shape>` holding the
  `torch.save` bytes of a one-element list of its data (dist_checkpointing/mapping.py
  `ShardedObject.unique_key`, offsets and shape dot-joined; strategies/torch.py
  `_mcore_to_torch_sharded_object`: `torch.save([sh_obj.data for sh_obj in sh_objs])`). The linear layers' `_extra_state` (Transformer Engine's FP8 state;
  `None` for megatron-core's local layers, whose `get_extra_state` keeps TE's key) is one per
  layer, and per expert for the experts (`shard_<layer>.<expert>_<layers>.<experts>`);
- `metadata.json` (dist_checkpointing/core.py `CheckpointingConfig`: the backends);
- `common.pt`, `torch.save` of the state dict's non-sharded entries (strategies/common.py
  `save_common`);
and Megatron-LM keeps each saved iteration in a run folder: `iter_0000000/` beside
`latest_checkpointed_iteration.txt`.

Example:
    >>> extra_state_keys(["decoder.layers.self_attention.linear_qkv.weight"], {"decoder.layers.self_attention.linear_qkv.weight": (2, 48, 16)})
    ['decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2', 'decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2']
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from ckpttool.torchsave.archive import saved_value
from ckpttool.torchsave.pickle import dumps

METADATA_JSON = "metadata.json"  # dist_checkpointing/core.py CONFIG_FNAME
COMMON_PT = "common.pt"  # dist_checkpointing/strategies/common.py COMMON_STATE_FNAME
# CheckpointingConfig as `save` writes it for the torch_dist backend (and the torch common backend)
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}
# the modules of a GPT layer that keep `_extra_state` (megatron-core's Column/RowParallelLinear
# and TE's linears): the stacked weight names they hold, as layer-stacked torch_dist keys
EXTRA_STATE_MODULES = (
    "decoder.layers.self_attention.linear_qkv",
    "decoder.layers.self_attention.linear_proj",
    "decoder.layers.mlp.linear_fc1",
    "decoder.layers.mlp.linear_fc2",
)
# experts stacked per layer and per expert (SequentialMLP's sharded_state_dict)
EXPERT_EXTRA_STATE_MODULES = (
    "decoder.layers.mlp.experts.experts.linear_fc1",
    "decoder.layers.mlp.experts.experts.linear_fc2",
)
# Megatron-LM's run folder (training/checkpointing.py): `--load DIR` reads the tracker, then the
# iteration's folder `iter_%07d` (get_checkpoint_name); an imported model is iteration 0
TRACKER = "latest_checkpointed_iteration.txt"  # get_checkpoint_tracker_filename
ITERATION = 0
ITERATION_FOLDER = f"iter_{ITERATION:07d}"
# common.pt: empty, as dist_checkpointing.save writes it for a model's sharded state dict. Its
# entries become the base of what `dist_checkpointing.load` returns, so any key here (even
# `iteration`) fails a strict `load_state_dict`; Megatron-LM's `--load` of iteration 0 then
# takes `--finetune` (no iteration, optimizer or RNG to restore), as for any converted model,
# and `checkpoint_version` 0 reorders only the legacy `query_key_value` names, not `linear_qkv`
RUN_COMMON: dict[str, object] = {}
# a module's extra state when no FP8 recipe ran: what megatron-core's local linear layers return
EXTRA_STATE_VALUE = None


def tracker_text() -> bytes:
    """Return the tracker file's text: the iteration (read_metadata: an int, or 'release')."""
    return str(ITERATION).encode()


def metadata_json() -> bytes:
    """Return `metadata.json` as dist_checkpointing.save writes it (json.dump, no sorting)."""
    return json.dumps(CHECKPOINTING_CONFIG).encode()


def common_pt(common: Mapping[str, object]) -> bytes:
    """Return `common.pt`: the torch.save bytes of the non-sharded state dict `common`."""
    return saved_value(dumps(dict(common)))


def extra_state_keys(weights: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Return the ShardedObject keys of the `_extra_state` of each layer-stacked module whose
    weight is among `weights` (shapes: their stacked shapes), sorted."""
    keys: list[str] = []
    present = set(weights)
    for module in EXTRA_STATE_MODULES:
        weight = module + ".weight"
        if weight in present:
            layers = shapes[weight][0]
            keys.extend(f"{module}._extra_state/shard_{layer}_{layers}" for layer in range(layers))
    for module in EXPERT_EXTRA_STATE_MODULES:
        weight = module + ".weight"
        if weight in present:
            layers, experts = shapes[weight][:2]
            keys.extend(f"{module}._extra_state/shard_{layer}.{expert}_{layers}.{experts}"
                        for layer in range(layers) for expert in range(experts))
    return sorted(keys)


def extra_state_bytes() -> bytes:
    """Return the bytes of one `_extra_state` ShardedObject: torch.save([EXTRA_STATE_VALUE])."""
    return saved_value(dumps([EXTRA_STATE_VALUE]))
