"""The optimizer state of Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`), read
without torch, beside the model readers/megatron_legacy.py reads: for `reshard --to transformers`
(naming/megatron_optimizer.py).

Each parameter's exp_avg / exp_avg_sq comes in the shape of the rank's part of it, merged and
renumbered by the same rules as the weights, every chunk a raw byte range of a rank's file:

- Megatron's non-distributed FP32Optimizer saves its torch optimizer's state dict per rank, its
  parameters numbered by integer id in the order Megatron-LM builds its param groups
  (`_get_param_groups`); each id is mapped back to its parameter by that order.
- The distributed optimizer (--use-distributed-optimizer) saves its param groups only (with the
  common `step`, a number) in model_optim_rng.pt, and `distrib_optim.pt` beside it: per model
  chunk's grad buffer the flat float32 exp_avg / exp_avg_sq, gathered over the data-parallel
  ranks (each bucket's part without the padding at its end, one after another); each parameter's
  range is found as `_ParamAndGradBuffer` lays the buffer out (the chunk's parameters in reverse,
  each at a multiple of 64 elements of its bucket, a new bucket once one holds `bucket_size`
  elements: `grad_bucket_size`, from the saved arguments), checked against the buffer's recorded
  size.

Refused by name: the mixed-precision and chained optimizers' state, other optimizers, non-standard
param groups, a distrib_optim.pt of another layout (older, non-float32, several buffers a chunk).

Example:
    >>> state = read_legacy_optimizer("checkpoints/iter_0000002")
    >>> sorted(state.checkpoint.tensors)[0]
    'model.decoder.final_layernorm.weight'
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.core.checkpoint import Blob, Checkpoint, as_path, raw_range_transforms
from ckpttool.core.errors import CorruptMetadata, MissingFile, UnsupportedFormat
from ckpttool.dcp.blobs import DataFiles
from ckpttool.readers.megatron_legacy import (
    _ALLOWED, DISTRIBUTED_OPTIMIZER_FILE, MODEL_PREFIX, RankFile, Stored, _as_checkpoint, _gated, _global_model,
    _layout, _merge, _read_ranks, _renumbered, _Unpickler, float32_pair_keys_as_one,
)
from ckpttool.store import storage
from ckpttool.torchsave.record import _Rebuilt
from ckpttool.torchsave.stored import file_entries, ints, load_data_pkl, raw_blob, stored_dtype

# ---------------------------------------------------------------------------------------------
# The optimizer state (Megatron's non-distributed optimizer)

MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_STATE = "optimizer.state."  # the view's moment tensors: f'optimizer.state.{kind}.{name}', as torch_dist's
WD_MULT = "wd_mult"
# megatron/core/optimizer/__init__.py _get_param_groups: what every group of the standard overrides
# (get_standard_config_overrides, no --decoupled-lr) holds besides wd_mult; another value means
# overrides whose membership the save does not say
STANDARD_GROUP = (("lr_mult", 1.0), ("is_expert_parallel", False), ("is_decoupled_lr", False))


@dataclass(frozen=True)
class LegacyOptimizer:
    """A legacy save's model and the state of Megatron's non-distributed optimizer, global.

    `checkpoint`: `model.<name>` and `optimizer.state.<kind>.<name>` (kind exp_avg, exp_avg_sq:
    each parameter's moments, merged and renumbered exactly as its weight), every chunk a raw byte
    range of a rank file. `groups`: the saved param groups without `params` (equal on every rank),
    in order; `group_of`: global name -> its group; `steps`: global name -> its 0-d `step`
    (tensor-parallel rank 0's part; equal bytes on every rank holding one)."""

    checkpoint: Checkpoint
    args: dict[str, Any]
    groups: tuple[dict[str, Any], ...]
    group_of: dict[str, int]
    steps: dict[str, Stored | float]  # the distributed optimizer's: the groups' common step, a number


def read_legacy_optimizer(path: str | os.PathLike, follow_symlinks: bool = False) -> LegacyOptimizer:
    """Return the model and optimizer state of a Megatron-LM `--ckpt-format torch` iteration folder.

    Each rank's integer parameter ids are its parameters as Megatron-LM built its param groups
    (megatron/core/optimizer/__init__.py `_get_param_groups`, core_v0.16.1): every model chunk's
    `named_parameters()` in order (the order of its state dict, `_extra_state` left out), each in
    the group of its overrides (get_standard_config_overrides: `wd_mult` 0 for 1-D parameters and
    biases, q/k layer norms excepted with --apply-wd-to-qk-layernorm; 1 otherwise); a group's
    `params` lists its members' ids in that order (torch's Optimizer.state_dict).

    With the distributed optimizer the moments come from each rank folder's distrib_optim.pt
    (`_by_layout`) and the step is the number its param groups share.

    Raises UnsupportedFormat naming what is not read (no optimizer saved, the mixed-precision or
    chained optimizers' state, another optimizer than Adam/AdamW, param groups other than the
    standard ones, a distrib_optim.pt of another layout), MissingFile for a distributed save's
    missing distrib_optim.pt, CorruptMetadata for state that disagrees with the model.

    Example:
        >>> saved = read_legacy_optimizer("checkpoints/iter_0000002")
        >>> saved.checkpoint.tensors["optimizer.state.exp_avg.output_layer.weight"].shape
        (128, 32)
    """
    folder = as_path(storage.location(path))
    with DataFiles(folder, follow_symlinks) as files:
        first, ranks, tensor_parallel, pipeline_parallel = _read_ranks(folder, files, optimizer=True)
        for rank in ranks.values():
            if rank.refused is not None:
                raise UnsupportedFormat(f"{rank.refused}; reshard --to transformers reads the state of Megatron's "
                                        "FP32 optimizers (distributed or not) over torch's Adam/AdamW")
        distributed = {key for key, rank in ranks.items() if rank.optimizer is not None and rank.optimizer.distributed}
        if distributed and len(distributed) != len(ranks):
            odd = ranks[min(set(ranks) - distributed)]
            raise CorruptMetadata(f"{folder / odd.name}: holds the non-distributed optimizer's state, other ranks the "
                                  "distributed optimizer's")
        buffers = {key: _read_buffers(files, folder, rank) for key, rank in ranks.items()} if distributed else {}
    if not distributed:
        leftover = sorted(folder.glob(f"mp_rank_*/{DISTRIBUTED_OPTIMIZER_FILE}"))
        if leftover:
            raise CorruptMetadata(f"{leftover[0]}: the distributed optimizer's state beside model_optim_rng.pt files "
                                  "holding the non-distributed optimizer's; is an older save's file left over?")
    model = _global_model(folder, first, ranks, tensor_parallel, pipeline_parallel)
    qk_decay = first.args.get("apply_wd_to_qk_layernorm") is True
    groups = _saved_groups(ranks, folder)
    per_rank = {key: _by_layout(rank, buffers[key], groups, qk_decay, _bucket_sizes(first.args, key[1], rank, folder), folder)
                if distributed else _by_name(rank, groups, qk_decay, folder) for key, rank in ranks.items()}
    tensors = {f"{MODEL_PREFIX}.{name}": tensor for name, tensor in model.items()}
    for kind in MOMENTS:
        moments = {key: dataclasses.replace(rank, chunks=per_rank[key][0][kind]) for key, rank in ranks.items()}
        for name, tensor in _merge(moments, tensor_parallel, pipeline_parallel, _gated(first), folder).items():
            if name not in model or (tensor.shape, tensor.dtype) != (model[name].shape, model[name].dtype):
                raise CorruptMetadata(f"{folder}: {OPTIMIZER_STATE}{kind}.{name} is not the state of a model tensor "
                                      "of its shape and dtype")
            tensors[f"{OPTIMIZER_STATE}{kind}.{name}"] = tensor
    group_of: dict[str, int] = {}
    steps: dict[str, Stored | float] = {}
    for chunk, stage, offset in _layout(ranks, pipeline_parallel):
        for name in ranks[(0, stage)].chunks[chunk]:
            global_name = _renumbered(name, offset)
            held = [per_rank[(t, stage)] for t in range(tensor_parallel)]
            group_of[global_name] = held[0][1][(chunk, name)]
            steps[global_name] = held[0][2][(chunk, name)]
            for t, (_, _, rank_steps) in enumerate(held[1:], start=1):
                if _step_key(rank_steps[(chunk, name)]) != _step_key(steps[global_name]):
                    raise CorruptMetadata(f"{folder / ranks[(t, stage)].name}: the Adam step of {name} differs from "
                                          f"{ranks[(0, stage)].name}'s")
    return LegacyOptimizer(_as_checkpoint(folder, first, tensors), first.args,
                           tuple({k: v for k, v in group.items() if k not in ("params", STEP)} for group in groups),
                           group_of, steps)


def _step_key(step: Stored | float) -> tuple:
    return (step.dtype, step.blob.transforms) if isinstance(step, Stored) else (float, step)


STEP = "step"  # DistributedOptimizer.state_dict: the common Adam step in every param group (torch's own Adam)
BUFFER_KINDS = ("param", "exp_avg", "exp_avg_sq")  # get_parameter_state_dp_zero's world tensors
NUMEL_UNPADDED = "numel_unpadded"
BUCKETS_COALESCED = "buckets_coalesced"
# param_and_grad_buffer.py _ParamAndGradBuffer `_pad_start_of_param_if_needed`: with the distributed
# optimizer every parameter starts at a multiple of 64 elements of its grad buffer (and of its bucket:
# a bucket starts at a multiple of lcm(DP, 128), `_pad_end_of_bucket_if_needed`)
PARAM_ALIGNMENT = 64
# megatron/training/training.py get_model (core_v0.16.1): without --ddp-bucket-size / --ddp-num-buckets a
# bucket holds max(40M, 1M x data-parallel size with context parallel) elements
DEFAULT_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DATA_PARALLEL_RANK = 1_000_000


def grad_bucket_size(args: dict[str, Any], stage: int, chunk: int, rank_parameters: int) -> int | None:
    """Return the bucket size (elements) Megatron-LM gave the grad buffer of model chunk `chunk`
    on pipeline stage `stage`, or None for one bucket, from the save's arguments.

    megatron/training/training.py get_model: --ddp-num-buckets n gives the rank's parameter count
    // n, else --ddp-bucket-size, else DEFAULT_BUCKET_SIZE (at least 1M per data-parallel rank);
    none without --overlap-grad-reduce. megatron/core/distributed/distributed_data_parallel.py:
    none on a pipeline stage after the first, and get_model disables bucketing for model chunks
    after the first and with --overlap-param-gather-with-optimizer-step.

    Example:
        >>> grad_bucket_size({"overlap_grad_reduce": True, "ddp_bucket_size": 2049}, 0, 0, 22848)
        2049
    """
    if not args.get("overlap_grad_reduce") or stage > 0 or chunk > 0 or args.get("overlap_param_gather_with_optimizer_step"):
        return None
    if args.get("ddp_num_buckets") is not None:
        return rank_parameters // int(args["ddp_num_buckets"])
    if args.get("ddp_bucket_size") is not None:
        return int(args["ddp_bucket_size"])
    data_parallel = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
    return max(DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DATA_PARALLEL_RANK * data_parallel)


BUCKET_ARGUMENTS = ("ddp_num_buckets", "ddp_bucket_size", "data_parallel_size", "context_parallel_size")


def _bucket_sizes(args: dict[str, Any], stage: int, rank: RankFile, folder: Path) -> dict[int, int | None]:
    """chunk -> grad_bucket_size of each of `rank`'s model chunks; CorruptMetadata for saved
    arguments that are no bucket count or size."""
    for key in BUCKET_ARGUMENTS:
        value = args.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise CorruptMetadata(f"{folder / rank.name}: args.{key} is {value!r:.40}, not a positive integer")
    parameters = sum(math.prod(weight.shape) for chunk in rank.chunks.values() for weight in chunk.values())
    return {chunk: grad_bucket_size(args, stage, chunk, parameters) for chunk in rank.chunks}


def parameter_offsets(numels: list[int], bucket_size: int | None) -> tuple[list[int], int]:
    """Return where each parameter starts in a grad buffer's state in distrib_optim.pt, and its
    length: `numels` in the order _ParamAndGradBuffer lays them out (the model chunk's parameters
    in reverse), each at a multiple of PARAM_ALIGNMENT of its bucket; a bucket ends after the
    parameter that brings it to `bucket_size` elements (None: one bucket), and the padding after
    its end is left out (get_parameter_state_dp_zero keeps each bucket's `numel_unpadded`).
    Not modelled: the bucket of its own a `shared_embedding` parameter gets (tied embeddings,
    which reshard --to transformers refuses before reading the optimizer); a layout it changes
    disagrees with the buffer's recorded size.

    Example:
        >>> parameter_offsets([2048, 32, 100], 2049)
        ([0, 2048, 2080], 2180)
    """
    offsets, lengths = bucket_layout(numels, bucket_size)
    return offsets, sum(lengths)


def bucket_layout(numels: list[int], bucket_size: int | None) -> tuple[list[int], list[int]]:
    """Return parameter_offsets' offsets (in the buckets laid end to end) and each bucket's
    unpadded length, in order: what a torch_dist save's `per_bucket_numel_unpadded` records.

    Example:
        >>> bucket_layout([2048, 32, 100], 2049)
        ([0, 2048, 2080], [2080, 100])
    """
    offsets = []
    lengths = []
    bucket_start = 0  # in the state: the sum of the earlier buckets' unpadded lengths
    position = 0  # in the bucket
    for numel in numels:
        position = -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        offsets.append(bucket_start + position)
        position += numel
        if bucket_size is not None and position >= bucket_size:
            lengths.append(position)
            bucket_start, position = bucket_start + position, 0
    if position:
        lengths.append(position)
    return offsets, lengths


@dataclass(frozen=True)
class GradBuffer:
    """One grad buffer's state in distrib_optim.pt: its flat moments (float32, over the buffer
    without the padding at the end of its buckets) and how many elements that is."""

    moments: dict[str, Stored]
    numel_unpadded: int


def _read_buffers(files: DataFiles, folder: Path, rank: RankFile) -> list[GradBuffer]:
    """Return the grad buffers distrib_optim.pt beside `rank`'s file holds, in order
    (DistributedOptimizer.get_parameter_state_dp_zero: {'buckets_coalesced': True, buffer index:
    {(param dtype, grad dtype): {'param', 'exp_avg', 'exp_avg_sq', 'numel_unpadded'}}})."""
    name = f"{rank.name.rsplit('/', 1)[0]}/{DISTRIBUTED_OPTIMIZER_FILE}"
    where = str(folder / name)
    if not (folder / name).is_file():
        raise MissingFile(f"{where}: missing: {rank.name} holds the distributed optimizer's param groups, and its "
                          "state is in this file (was the save interrupted?)")
    size = files.size(name)

    def read(offset: int, length: int) -> bytes:
        return files.read(name, offset, length)

    entries = file_entries(read, size, where)
    state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED, float32_pair_keys_as_one)
    if not isinstance(state, dict) or state.get(BUCKETS_COALESCED) is not True:
        raise UnsupportedFormat(f"{where}: not the coalesced per-buffer state (`{BUCKETS_COALESCED}`) Megatron-core "
                                "0.16 writes; an older distributed optimizer's layout is not read")
    numbers = sorted(key for key in state if key != BUCKETS_COALESCED)
    if numbers != list(range(len(numbers))):
        raise CorruptMetadata(f"{where}: buffers {numbers[:8]} are not numbered 0, 1, ...")
    starts: dict[str, int] = {}
    found = []
    for number in numbers:
        by_dtype = state[number]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise CorruptMetadata(f"{where}: buffer {number} is not one (param dtype, grad dtype) entry")
        [(dtype_key, held)] = by_dtype.items()  # (float32, float32) read as float32: float32_pair_keys_as_one
        if getattr(dtype_key, "name", None) != "float32":
            raise UnsupportedFormat(f"{where}: buffer {number} holds {dtype_key!r:.60} parameters and gradients; this "
                                    "build reads float32 ones (a --bf16/--fp16 run's main parameters are not read yet)")
        if not isinstance(held, dict) or set(held) != {*BUFFER_KINDS, NUMEL_UNPADDED}:
            raise CorruptMetadata(f"{where}: buffer {number} holds {sorted(map(str, held))[:6] if isinstance(held, dict) else held!r:.60}")
        numel = held[NUMEL_UNPADDED]
        moments = {}
        for kind in MOMENTS:
            value = held[kind]
            here = f"{where}: buffer {number} {kind}"
            if not isinstance(value, _Rebuilt):
                raise CorruptMetadata(f"{here}: not a tensor")
            dtype = stored_dtype(value, here)
            moments[kind] = Stored(raw_blob(entries, starts, read, size, here, name, value, dtype), dtype,
                                   ints(value.shape, f"{here}: shape"))
            if moments[kind].dtype != "float32" or moments[kind].shape != (numel,):
                raise CorruptMetadata(f"{here}: {moments[kind].dtype} {list(moments[kind].shape)}, not float32 [{numel}]")
        found.append(GradBuffer(moments, numel))
    return found


def _by_layout(rank: RankFile, buffers: list[GradBuffer], groups: tuple[dict[str, Any], ...], qk_decay: bool,
               bucket_sizes: dict[int, int | None], folder: Path
               ) -> tuple[dict[str, dict[int, dict[str, Stored]]], dict[tuple[int, str], int], dict[tuple[int, str], float]]:
    """_by_name for the distributed optimizer: each parameter's moments are a range of its model
    chunk's grad buffer (megatron/core/distributed/param_and_grad_buffer.py `_ParamAndGradBuffer`,
    as parameter_offsets lays it out with the chunk's bucket size), its group the one of its
    wd_mult, its step the groups' common `step`."""
    where = folder / rank.name
    if len(buffers) != len(rank.chunks):
        raise UnsupportedFormat(f"{where.parent / DISTRIBUTED_OPTIMIZER_FILE}: {len(buffers)} grad buffers for "
                                f"{len(rank.chunks)} model chunks (experts' or other dtypes' buffers are not read yet)")
    steps = {group.get(STEP) for group in groups}
    common = next(iter(steps))
    if len(steps) != 1 or not isinstance(common, (int, float)) or isinstance(common, bool):
        raise UnsupportedFormat(f"{where}: optimizer param groups' `step` {sorted(map(repr, steps))[:2]}: not the one "
                                "common Adam step of torch's Adam/AdamW (apex's or Transformer Engine's optimizer?)")
    step = float(common)
    by_wd_mult = {0.0 if group[WD_MULT] == 0.0 else 1.0: number for number, group in enumerate(groups)}
    moments: dict[str, dict[int, dict[str, Stored]]] = {kind: {chunk: {} for chunk in rank.chunks} for kind in MOMENTS}
    group_of: dict[tuple[int, str], int] = {}
    for chunk, buffer in zip(sorted(rank.chunks), buffers):
        parameters = rank.chunks[chunk]
        names = list(reversed(list(parameters)))
        for name in names:
            if parameters[name].dtype != "float32":
                raise UnsupportedFormat(f"{where}: {name} is {parameters[name].dtype}; the distributed optimizer's "
                                        "state is read for float32 models only")
        offsets, length = parameter_offsets([math.prod(parameters[name].shape) for name in names], bucket_sizes[chunk])
        if length != buffer.numel_unpadded:
            buckets = "one bucket" if bucket_sizes[chunk] is None else f"buckets of {bucket_sizes[chunk]} elements"
            raise UnsupportedFormat(f"{where.parent / DISTRIBUTED_OPTIMIZER_FILE}: grad buffer {chunk} holds "
                                    f"{buffer.numel_unpadded} elements, model chunk {chunk}'s parameters laid out in "
                                    f"{buckets} (the save's arguments) at multiples of {PARAM_ALIGNMENT} take {length} "
                                    "(buckets split otherwise, or frozen parameters): not read")
        for name, start in zip(names, offsets):
            weight = parameters[name]
            numel = math.prod(weight.shape)
            for kind in MOMENTS:
                flat = buffer.moments[kind].blob
                blob = Blob(flat.file, flat.offset + start * 4, numel * 4, raw_range_transforms())
                moments[kind][chunk][name] = Stored(blob, "float32", weight.shape)
            wd_mult = _weight_decay_multiplier(name, weight.shape, qk_decay)
            if wd_mult not in by_wd_mult:
                raise CorruptMetadata(f"{where}: no optimizer param group has {WD_MULT} {wd_mult}, the group of {name}")
            group_of[(chunk, name)] = by_wd_mult[wd_mult]
    return moments, group_of, {key: step for key in group_of}


def _saved_groups(ranks: dict[tuple[int, int], RankFile], folder: Path) -> tuple[dict[str, Any], ...]:
    """Return the first rank's param groups after checking every rank saved the same ones (all but
    `params`: _get_param_groups gathers the groups' keys over all ranks) and that they are the
    standard overrides' (one per wd_mult, 1.0 and 0.0)."""
    first = ranks[(0, 0)]
    assert first.optimizer is not None
    groups = first.optimizer.groups

    def settings(rank: RankFile) -> list[dict[str, Any]]:
        assert rank.optimizer is not None
        return [{k: v for k, v in group.items() if k != "params"} for group in rank.optimizer.groups]

    for rank in ranks.values():
        if settings(rank) != settings(first):
            raise CorruptMetadata(f"{folder / rank.name}: optimizer param groups differ from {first.name}'s (other than "
                                  "their params), which Megatron-LM makes the same on every rank")
    seen = set()
    for number, group in enumerate(groups):
        odd = [f"{key}={group.get(key)!r:.20}" for key, value in STANDARD_GROUP if group.get(key, value) != value]
        if group.get(WD_MULT) not in (0.0, 1.0) or group.get(WD_MULT) in seen or odd:
            what = ", ".join(odd) or f"{WD_MULT}={group.get(WD_MULT)!r:.20}"
            raise UnsupportedFormat(f"{folder / first.name}: optimizer param group {number} ({what}) is not one of "
                                    "Megatron-LM's standard groups (weight decay on or off), so which parameters it "
                                    "holds cannot be told from the save")
        seen.add(group.get(WD_MULT))
    return groups


def _by_name(rank: RankFile, groups: tuple[dict[str, Any], ...], qk_decay: bool, folder: Path
             ) -> tuple[dict[str, dict[int, dict[str, Stored]]], dict[tuple[int, str], int], dict[tuple[int, str], Stored]]:
    """Return a rank's optimizer state by parameter: kind -> chunk -> name -> moment part, and
    (chunk, name) -> its group number, -> its step."""
    where = folder / rank.name
    assert rank.optimizer is not None
    saved = rank.optimizer
    parameters = [(chunk, name) for chunk in sorted(rank.chunks) for name in rank.chunks[chunk]]
    ids: dict[tuple[int, str], int] = {}
    group_of: dict[tuple[int, str], int] = {}
    for number, group in enumerate(saved.groups):
        wd_mult = 0.0 if group[WD_MULT] == 0.0 else 1.0
        members = [(chunk, name) for chunk, name in parameters
                   if _weight_decay_multiplier(name, rank.chunks[chunk][name].shape, qk_decay) == wd_mult]
        group_ids = group["params"]
        if len(group_ids) != len(members):
            raise CorruptMetadata(f"{where}: optimizer param group {number} ({WD_MULT} {group[WD_MULT]}) holds "
                                  f"{len(group_ids)} parameters; the model's {len(members)} go there as Megatron-LM "
                                  "groups them (are some frozen, or is the model another?)")
        for member, number_id in zip(members, group_ids):
            ids[member] = number_id
            group_of[member] = number
    if len(ids) != len(parameters) or sorted(ids.values()) != sorted(set(ids.values())) or set(ids.values()) != set(saved.state):
        raise CorruptMetadata(f"{where}: the optimizer's parameter ids ({len(saved.state)} with state) are not the "
                              f"model's {len(parameters)} parameters one each")
    moments: dict[str, dict[int, dict[str, Stored]]] = {kind: {chunk: {} for chunk in rank.chunks} for kind in MOMENTS}
    steps: dict[tuple[int, str], Stored] = {}
    for (chunk, name), number_id in ids.items():
        state = saved.state[number_id]
        weight = rank.chunks[chunk][name]
        for kind in MOMENTS:
            if (state[kind].shape, state[kind].dtype) != (weight.shape, weight.dtype):
                raise CorruptMetadata(f"{where}: optimizer state {number_id} {kind} is {state[kind].dtype} "
                                      f"{list(state[kind].shape)}, its parameter {name} {weight.dtype} {list(weight.shape)}")
            moments[kind][chunk][name] = state[kind]
        if state["step"].shape != ():
            raise CorruptMetadata(f"{where}: optimizer state {number_id} step has shape {list(state['step'].shape)}, not []")
        steps[(chunk, name)] = state["step"]
    return moments, group_of, steps


def _weight_decay_multiplier(name: str, shape: tuple[int, ...], qk_decay: bool) -> float:
    """The wd_mult get_standard_config_overrides gives a parameter (megatron/core/optimizer/__init__.py)."""
    no_decay = len(shape) == 1 or name.endswith(".bias")
    if qk_decay and ("q_layernorm." in name or "k_layernorm." in name):
        no_decay = False
    return 0.0 if no_decay else 1.0


__all__ = ["LegacyOptimizer", "read_legacy_optimizer"]
