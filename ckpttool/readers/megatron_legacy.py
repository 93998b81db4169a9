"""Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`), read without torch.

Megatron-LM's `save_checkpoint` with ckpt_format `torch` (megatron/training/checkpointing.py at
core_v0.16.1: `get_checkpoint_name`, `generate_state_dict`) has every tensor- and pipeline-parallel
rank `torch.save` one file, `iter_%07d/mp_rank_TT/model_optim_rng.pt` (`mp_rank_TT_PPP/` with
pipeline parallelism), holding `args` (the parsed command line, an argparse.Namespace),
`checkpoint_version`, `iteration`, `model` (the stage's `state_dict_for_save_checkpoint()`;
`model0`, `model1`, ... for virtual-pipeline chunks), `optimizer`, `opt_param_scheduler` and
`rng_state`; the run folder's `latest_checkpointed_iteration.txt` names the newest.

Each rank's model tensors are its tensor-parallel part of its pipeline stage's layers, numbered
from 0 on every stage. The checkpoint is given as one global model, under Megatron's names with
global layer numbers (what the `torch_dist` reader's model view gives, readers/megatron.py), so
the megatron families' tables (naming/families/megatron_*.py) convert it:

- `MERGE_RULES` (data, by name suffix) say how each tensor's parts make the whole:
  column-parallel ones are the ranks' parts one after the other on dim 0 (the QKV weight holds
  whole query groups per rank, each `[q heads; k; v]`, so the parts in rank order are the global
  interleaved layout; the embedding and output layer hold the vocabulary padded to
  `make_vocab_size_divisible_by x TP` rows, kept: export trims to the config's vocab), row-parallel
  ones on dim 1, and a gated fc1 (`--swiglu`) holds `[gate part; up part]` per rank, so rank r's
  halves land at rows `r*h` and `F + r*h` (as Megatron's own swiglu sharded factory places
  them); replicated ones (norms) are rank 0's, after every rank's shape, dtype and CRC-32 agree.
- pipeline stages (and virtual-pipeline chunks, chunk-major as the interleaved schedule lays them
  out: chunk c of stage p follows chunk c of stage p-1, and chunk c+1 of stage 0 follows chunk c
  of the last stage) are renumbered by counting the decoder layers each holds.

Every chunk is a raw byte range of a rank's file (the storage of its tensor inside the torch.save
zip); only the pickles are read. `args` comes out as an inert record (`Namespace`), never
executed; any global outside `_ALLOWED` is refused in one line.

Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed, a fork of Megatron-LM before megatron-core)
saves the same way, and through DeepSpeed's engine (--deepspeed) as `global_stepN/
mp_rank_TT_model_states.pt`, its `module` in place of `model` (readers/detect.py
`legacy_rank_files`); both hold the legacy model's nested state dict (`language_model` ->
`encoder` -> `layers.N....`), flattened here to its module names, and its arguments, put under
Megatron-LM's names (`DEEPSPEED_ARGUMENTS`). The engine's ZeRO optimizer partitions beside them
are not opened. Its pipeline engine's saves (`layer_XX-model_TT-model_states.pt` beside
`mp_rank_MM_model_states.pt` holding `module` None and the args) are read by
readers/megatron_deepspeed_pipe.py into the same merge (`read_layer_file`, `_global_model`).

The optimizer state beside the model is read by readers/megatron_legacy_optimizer.py.

Example:
    >>> checkpoint = read_megatron_legacy("checkpoints/iter_0000002")
    >>> [c.offsets for c in checkpoint.tensors["model.decoder.layers.3.mlp.linear_fc1.weight"].chunks]
    [(0, 0), (32, 0), (64, 0), (96, 0)]
"""

from __future__ import annotations

import os
import pickletools
import re
from dataclasses import dataclass
from pathlib import Path
from pickle import POP
from typing import Any, Callable

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, as_path, raw_range_transforms, refuse_bad_names
from ckpttool.core.errors import CorruptMetadata, MissingFile, NotACheckpoint, UnsupportedFormat
from ckpttool.dcp.blobs import DataFiles
from ckpttool.readers.megatron_args import ARGS_ALLOWED, EnumValue, Namespace
from ckpttool.readers.detect import DEEPSPEED_ENGINE_RANK, MEGATRON_LEGACY_FILE, legacy_rank_files, pipeline_layer_files
from ckpttool.store import storage
from ckpttool.torchsave.record import _PLAIN_OBJECT_ALLOWED, _TENSOR_PICKLE_ALLOWED, _Rebuilt
from ckpttool.torchsave.stored import StateDictUnpickler, device, file_entries, ints, load_data_pkl, raw_blob, stored_dtype

MODEL_PREFIX = "model"  # generate_state_dict: state_dict['model'] (the torch_dist model view's subtree too)
ENGINE_MODEL_KEY = "module"  # DeepSpeed's engine: mp_rank_TT_model_states.pt's `module` (Megatron-DeepSpeed --deepspeed)
CHUNK_KEY = re.compile(r"^model(\d+)$")  # virtual pipeline: f"model{i}"
EXTRA_STATE = "_extra_state"  # torch.nn.Module.get_extra_state's key: no weight
# only the decoder's layers are per stage: megatron-core's `decoder.layers.N.`, the legacy model's
# (megatron/model/transformer.py ParallelTransformer, Megatron-DeepSpeed's) `language_model.encoder.layers.N.`
_LAYER = re.compile(r"^(?P<head>(?:decoder|language_model\.encoder)\.layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")

COLUMN, ROW, GATED, REPLICATED = "column", "row", "gated", "replicated"
# name suffix -> how the tensor-parallel parts make the tensor (megatron/core/tensor_parallel/layers.py:
# VocabParallelEmbedding and ColumnParallelLinear split dim 0, RowParallelLinear dim 1 and keeps its
# bias whole; norms are whole on every rank). GATED: column-parallel [gate; up] when the MLP is gated
# (--swiglu, --quick-geglu), plain column-parallel otherwise.
MERGE_RULES: tuple[tuple[str, str], ...] = (
    ("embedding.word_embeddings.weight", COLUMN),
    ("embedding.position_embeddings.weight", REPLICATED),
    ("self_attention.linear_qkv.weight", COLUMN),
    ("self_attention.linear_qkv.bias", COLUMN),
    ("self_attention.linear_qkv.layer_norm_weight", REPLICATED),  # the TE spec's fused input norm
    ("self_attention.linear_qkv.layer_norm_bias", REPLICATED),
    ("self_attention.linear_proj.weight", ROW),
    ("self_attention.linear_proj.bias", REPLICATED),
    ("self_attention.q_layernorm.weight", REPLICATED),
    ("self_attention.k_layernorm.weight", REPLICATED),
    ("input_layernorm.weight", REPLICATED),
    ("input_layernorm.bias", REPLICATED),
    ("pre_mlp_layernorm.weight", REPLICATED),
    ("pre_mlp_layernorm.bias", REPLICATED),
    ("mlp.linear_fc1.weight", GATED),
    ("mlp.linear_fc1.bias", GATED),
    ("mlp.linear_fc1.layer_norm_weight", REPLICATED),
    ("mlp.linear_fc1.layer_norm_bias", REPLICATED),
    ("mlp.linear_fc2.weight", ROW),
    ("mlp.linear_fc2.bias", REPLICATED),
    ("decoder.final_layernorm.weight", REPLICATED),
    ("decoder.final_layernorm.bias", REPLICATED),
    ("output_layer.weight", COLUMN),
    ("output_layer.bias", COLUMN),
    # the legacy model (megatron/model/, Megatron-DeepSpeed's; its tensor_parallel layers split
    # alike): its names (`language_model.embedding.word_embeddings.weight` and
    # `language_model.output_layer.weight` take the rules above)
    ("self_attention.query_key_value.weight", COLUMN),
    ("self_attention.query_key_value.bias", COLUMN),
    ("self_attention.dense.weight", ROW),
    ("self_attention.dense.bias", REPLICATED),
    ("post_attention_layernorm.weight", REPLICATED),
    ("post_attention_layernorm.bias", REPLICATED),
    ("mlp.dense_h_to_4h.weight", GATED),
    ("mlp.dense_h_to_4h.bias", GATED),
    ("mlp.dense_4h_to_h.weight", ROW),
    ("mlp.dense_4h_to_h.bias", REPLICATED),
    ("encoder.final_layernorm.weight", REPLICATED),
    ("encoder.final_layernorm.bias", REPLICATED),
)
GATING_ARGS = ("swiglu", "quick_geglu")  # arguments.py core_transformer_config_from_args: gated_linear_unit


def merge_rule(name: str, gated: bool) -> str | None:
    """Return how `name`'s tensor-parallel parts make it (COLUMN, ROW, REPLICATED), or None.

    Example:
        >>> merge_rule("decoder.layers.0.mlp.linear_fc1.weight", gated=True)
        'gated'
        >>> merge_rule("decoder.layers.0.mlp.linear_fc1.weight", gated=False)
        'column'
    """
    for suffix, rule in MERGE_RULES:
        if name == suffix or name.endswith("." + suffix):
            return rule if rule != GATED or gated else COLUMN
    return None


# ---------------------------------------------------------------------------------------------
# Stand-ins for what model_optim_rng.pt's data.pkl names (nothing here runs code from the file)


def _parameter(data: Any, *rest: Any) -> Any:
    """`torch._utils._rebuild_parameter`: an nn.Parameter is its tensor."""
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    **_PLAIN_OBJECT_ALLOWED,  # numpy's RNG state (np_rng_state) as inert records
    **_TENSOR_PICKLE_ALLOWED,  # _rebuild_tensor_v2/v3, typed storages, OrderedDict, torch.Size
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch", "device"): device,
    **ARGS_ALLOWED,  # args: the Namespace and its Enum members (readers/megatron_args.py)
}


class _Unpickler(StateDictUnpickler):
    """The checking loader with model_optim_rng.pt's allowlist: a refused name is named in one line."""

    holds = "Megatron-LM's model_optim_rng.pt (arguments, model, optimizer and RNG state)"


def ordered_dict_builds_as_pops(raw: bytes) -> bytes:
    """Return the pickle with the BUILD of every OrderedDict (a state dict's `_metadata`) turned
    into POP, and every other BUILD (args' Namespace, numpy arrays) kept: the checking loader
    builds no dict by BUILD (torchsave.stored.builds_as_pops), and the Namespace is filled by one.
    Which object a BUILD fills is found by following the stack and the memo through the opcodes."""
    return _popped(raw, lambda name, stack: name == "BUILD"
                   and stack[-2] == ("made by", ("global", ("collections", "OrderedDict"))))


FLOAT32_PAIR = (("global", ("torch", "float32")), ("global", ("torch", "float32")))


def float32_pair_keys_as_one(raw: bytes) -> bytes:
    """Return distrib_optim.pt's pickle with each `(torch.float32, torch.float32)` tuple (a buffer's
    (param dtype, grad dtype) key) made by TUPLE2 turned into POP: the key is then the one dtype
    record, which the checking loader hashes (it refuses tuple keys of anything but ints). Other
    dtype pairs stay tuples, and the loader refuses them by name."""
    return _popped(raw, lambda name, stack: name == "TUPLE2" and tuple(stack[-2:]) == FLOAT32_PAIR)


def _popped(raw: bytes, wanted: Any) -> bytes:
    """Return the pickle with every opcode `wanted(opcode name, stack)` picks turned into POP (a
    one-byte opcode whose stack effect leaves what it should: BUILD drops the state, TUPLE2 the
    second item), the stack and the memo followed through the opcodes (each item: a global, what
    a call made of it, or a placeholder)."""
    try:  # parses only; a malformed pickle is left for the loader to word
        ops = list(pickletools.genops(raw))
    except Exception:
        return raw
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    found: list[int] = []
    try:
        for opcode, arg, position in ops:
            name = opcode.name
            if name in ("BUILD", "TUPLE2") and position is not None and raw[position] == opcode.code.encode("latin-1")[0] \
                    and wanted(name, stack):
                found.append(position)
            if name == "MARK":
                marks.append(len(stack))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                held = tuple(str(arg).split(" ", 1)) if name == "GLOBAL" else (stack.pop(-2), stack.pop())
                stack.append(("global", held))
            elif name in ("REDUCE", "NEWOBJ"):
                del stack[-1]
                stack.append(("made by", stack.pop()))
            elif name == "BUILD":
                del stack[-1]
            elif name in ("SETITEM", "APPEND"):  # the container stays where it is
                del stack[-(2 if name == "SETITEM" else 1):]
            elif name in ("SETITEMS", "APPENDS", "ADDITEMS"):
                del stack[marks.pop():]
            else:
                before = opcode.stack_before
                if pickletools.markobject in before:
                    del stack[marks.pop():]
                    before = before[:before.index(pickletools.markobject)]
                if before:
                    del stack[-len(before):]
                after = len(opcode.stack_after)
                stack.extend([arg if isinstance(arg, str) else None] * after)
    except (IndexError, KeyError):  # unbalanced: the loader words it
        return raw
    if not found:
        return raw
    edited = bytearray(raw)
    for position in found:
        edited[position] = POP[0]
    return bytes(edited)


# ---------------------------------------------------------------------------------------------
# The rank files


@dataclass(frozen=True)
class Stored:
    """One rank's part of a tensor: its bytes (a raw range of the rank's file), dtype and shape."""

    blob: Blob
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RankOptimizer:
    """A rank's `optimizer` entry as torch's `Optimizer.state_dict()` (Megatron's FP32Optimizer
    saves its torch optimizer's): the param groups as saved (`params`: integer ids, numbered over
    the groups in order) and id -> state kind -> part (`step` 0-d, the moments the parameter's shape)."""

    groups: tuple[dict[str, Any], ...]
    state: dict[int, dict[str, Stored]]
    distributed: bool = False  # DistributedOptimizer's: groups without `params`, the state in distrib_optim.pt


@dataclass(frozen=True)
class RankFile:
    """What one rank's model_optim_rng.pt holds: its arguments and, per model chunk, name -> part;
    with `optimizer` asked for, its optimizer state, or why it is not read (`refused`)."""

    name: str  # relative to the iteration folder: mp_rank_TT_PPP/model_optim_rng.pt
    args: dict[str, Any]
    chunks: dict[int, dict[str, Stored]]  # chunk number (0 without a virtual pipeline) -> name -> part
    version: Any
    optimizer: RankOptimizer | None = None
    refused: str | None = None  # why the optimizer state is not read (kind, absence)


def rank_file(tensor_rank: int, pipeline_rank: int, pipeline_parallel: bool, engine: bool = False) -> str:
    """Return a rank's file, relative to the iteration folder (checkpointing.py `get_checkpoint_name`;
    `engine`: DeepSpeed's engine's, in its tag folder, `_get_ckpt_name`).

    Example:
        >>> rank_file(1, 0, pipeline_parallel=True)
        'mp_rank_01_000/model_optim_rng.pt'
        >>> rank_file(1, 0, pipeline_parallel=False, engine=True)
        'mp_rank_01_model_states.pt'
    """
    if engine:
        return f"mp_rank_{tensor_rank:02d}_model_states.pt"
    folder = f"mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}" if pipeline_parallel else f"mp_rank_{tensor_rank:02d}"
    return f"{folder}/{MEGATRON_LEGACY_FILE}"


def _load(files: DataFiles, folder: Path, name: str, holds: str) -> tuple[dict, Any, Callable[[int, int], bytes], int, str]:
    """Return the state dict a rank or layer file holds (read through the checking loader), its zip
    entries, a reader of its bytes, its size and its path for messages; CorruptMetadata naming
    `holds` when it holds no dict."""
    where = str(folder / name)
    size = files.size(name)

    def read(offset: int, length: int) -> bytes:
        return files.read(name, offset, length)

    entries = file_entries(read, size, where)
    state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED, ordered_dict_builds_as_pops)
    if not isinstance(state, dict):
        raise CorruptMetadata(f"{where}: holds a {type(state).__name__}, not {holds}")
    return state, entries, read, size, where


def _read_rank(files: DataFiles, folder: Path, name: str, optimizer: bool = False) -> RankFile:
    state, entries, read, size, where = _load(files, folder, name, "Megatron-LM's state dict")
    args = state.get("args")
    engine = DEEPSPEED_ENGINE_RANK.match(Path(name).name) is not None
    if engine and not isinstance(args, Namespace):
        raise UnsupportedFormat(f"{where}: DeepSpeed's engine saved tensor-parallel ranks (mp_rank_01 ...) without "
                                "Megatron's `args`, so not Megatron-DeepSpeed's; this build reads ZeRO saves with one "
                                "model-parallel rank; convert with DeepSpeed's ds_to_universal first")
    if not isinstance(args, Namespace):
        raise CorruptMetadata(f"{where}: `args` is {type(args).__name__}, not Megatron-LM's argparse.Namespace")
    # DeepSpeed's pipeline engine saves `module` None beside the layer files (readers/megatron_deepspeed_pipe.py)
    layers_beside = engine and state.get(ENGINE_MODEL_KEY) is None and bool(pipeline_layer_files(folder))
    if engine and not layers_beside and not isinstance(state.get(ENGINE_MODEL_KEY), dict):
        raise UnsupportedFormat(f"{where}: `{ENGINE_MODEL_KEY}` is {type(state.get(ENGINE_MODEL_KEY)).__name__} and no "
                                "layer_XX-model_TT-model_states.pt beside it: neither DeepSpeed's engine's model nor its "
                                "pipeline engine's layers")
    models = {} if layers_beside else {0: state[ENGINE_MODEL_KEY]} if engine else {0: state[MODEL_PREFIX]} \
        if MODEL_PREFIX in state else {int(match.group(1)): value for key, value in state.items()
                                       if isinstance(key, str) and (match := CHUNK_KEY.match(key))}
    if not layers_beside and (not models or not all(isinstance(model, dict) for model in models.values())):
        raise CorruptMetadata(f"{where}: no `model` state dict (nor virtual-pipeline `model0`, `model1`, ...)")
    starts: dict[str, int] = {}
    chunks = {number: _parts(model, entries, starts, read, size, where, name) for number, model in sorted(models.items())}
    arguments = megatron_lm_arguments(dict(vars(args)), where)
    if not optimizer:
        return RankFile(name, arguments, chunks, state.get("checkpoint_version"))

    def stored(value: Any, here: str) -> Stored:
        dtype = stored_dtype(value, here)
        return Stored(raw_blob(entries, starts, read, size, here, name, value, dtype), dtype, ints(value.shape, f"{here}: shape"))

    saved, refused = _rank_optimizer(state.get(OPTIMIZER), stored, where)
    if engine:  # the engine's `optimizer` is None under ZeRO: the state is in its partition files
        saved, refused = None, (f"{where}: DeepSpeed's engine keeps the optimizer state in ZeRO's "
                                "zero_pp_rank_D_mp_rank_TT_optim_states.pt files, which this build does not read at "
                                "tensor parallel > 1")
    return RankFile(name, arguments, chunks, state.get("checkpoint_version"), saved, refused)


def _parts(model: dict, entries: Any, starts: dict[str, int], read: Any, size: int, where: str,
           name: str) -> dict[str, Stored]:
    """Return a model state dict's tensors (flattened names) as raw ranges of the file `name`."""
    parts: dict[str, Stored] = {}
    for key, value in _flattened(model, where):
        if not isinstance(value, _Rebuilt) or str(key).endswith(EXTRA_STATE):
            continue  # `_extra_state` (None for local layers; Transformer Engine's FP8 metadata), plain values
        here = f"{where}: {key}"
        dtype = stored_dtype(value, here)
        parts[str(key)] = Stored(raw_blob(entries, starts, read, size, here, name, value, dtype), dtype,
                                 ints(value.shape, f"{here}: shape"))
    return parts


def read_layer_file(files: DataFiles, folder: Path, name: str) -> dict[str, Stored]:
    """Return the tensors of one of DeepSpeed's pipeline layer files (`layer_XX-model_TT-model_states.pt`:
    the layer module's state dict, its own names) as raw ranges of the file, read through the
    checking loader."""
    state, entries, read, size, where = _load(files, folder, name, "a pipeline layer's state dict")
    return _parts(state, entries, {}, read, size, where, name)


def _flattened(model: dict, where: str, prefix: str = "") -> list[tuple[str, Any]]:
    """Return (name, value) of a model state dict, nested dicts' names joined by dots: the legacy
    model's `state_dict_for_save_checkpoint` (megatron/model/gpt_model.py, Megatron-DeepSpeed's)
    nests `language_model` -> `embedding` -> `word_embeddings` -> `weight`, and `encoder` ->
    `layers.0.input_layernorm.weight`; the names are then its `named_parameters()` names.
    megatron-core's state dicts are flat."""
    found: list[tuple[str, Any]] = []
    for key, value in model.items():
        if not isinstance(key, str):
            raise CorruptMetadata(f"{where}: {MODEL_PREFIX}.{prefix}{key!r:.40} is not a name")
        if isinstance(value, dict):
            found.extend(_flattened(value, where, f"{prefix}{key}."))
        else:
            found.append((prefix + key, value))
    return found


# ---------------------------------------------------------------------------------------------
# Megatron-DeepSpeed's arguments (microsoft/Megatron-DeepSpeed megatron/arguments.py, 6acc370a),
# under the names Megatron-LM core_v0.16.1 gives them, so that naming/megatron_config.py's one
# mapping makes config.json of either. Its arguments are told by `use_rotary_position_embeddings`
# (Megatron-LM has --position-embedding-type instead). Each row: Megatron-LM's name <- how it is
# made of Megatron-DeepSpeed's arguments; the arguments it has under the same name stay as they are.
DEEPSPEED_MARK = "use_rotary_position_embeddings"
_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}  # --normalization's choices, each
DEEPSPEED_ARGUMENTS: tuple[tuple[str, Any], ...] = (
    ("position_embedding_type", lambda a: "rope" if a.get("use_rotary_position_embeddings")
     else "learned_absolute" if a.get("add_position_embedding", True) else "none"),
    ("normalization", lambda a: _NORMALIZATION.get(a.get("normalization"), a.get("normalization"))),
    ("num_query_groups", lambda a: a.get("num_key_value_heads")),
    ("group_query_attention", lambda a: a.get("num_key_value_heads") not in (None, a.get("num_attention_heads"))),
    ("rotary_base", lambda a: a.get("rope_theta")),
    ("layernorm_zero_centered_gamma", lambda a: a.get("apply_layernorm_1p")),
    # --num-experts is a list, one count per expert layer ([1]: dense; anything else is refused as MoE)
    ("num_experts", lambda a: None if a.get("num_experts") in ([1], None) else a["num_experts"]),
    ("expert_model_parallel_size", lambda a: a.get("moe_expert_parallel_size")),
)
# 676a482c ("Adding the new feature of FPDT (#441)", 2024-12-04) added --ds-sequence-parallel-fpdt
# and changed ParallelAttention.forward to read query_key_value's rows as [q | k | v] thirds
# (`mixed_x_layer.shape[-1] // 3`), not per query group as before and as its converters write them
DEEPSPEED_THIRDS_MARK = "ds_sequence_parallel_fpdt"


def megatron_lm_arguments(args: dict[str, Any], where: str) -> dict[str, Any]:
    """Return the saved arguments with Megatron-DeepSpeed's put under Megatron-LM's names
    (`DEEPSPEED_ARGUMENTS`); Megatron-LM's own as they are. Raises UnsupportedFormat for a save
    of Megatron-DeepSpeed from 676a482c on, whose attention reads the fused QKV otherwise.

    Example:
        >>> megatron_lm_arguments({"use_rotary_position_embeddings": True, "normalization": "rmsnorm",
        ...                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": [1]}, "f")["normalization"]
        'RMSNorm'
    """
    if DEEPSPEED_MARK not in args or "position_embedding_type" in args:
        return args
    if DEEPSPEED_THIRDS_MARK in args:
        raise UnsupportedFormat(f"{where}: saved by Megatron-DeepSpeed from 676a482c (2024-12-04, args hold "
                                f"{DEEPSPEED_THIRDS_MARK}) on, whose attention reads query_key_value's rows as [q | k | v] "
                                "thirds while its converters and earlier versions read them per query group; which the "
                                "weights were trained as is not known, so they are not read")
    return {**args, **{name: made(args) for name, made in DEEPSPEED_ARGUMENTS}}


OPTIMIZER = "optimizer"  # generate_state_dict: state_dict['optimizer'] = optimizer.state_dict()
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"  # checkpointing.get_distributed_optimizer_checkpoint_name
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")  # torch's Adam/AdamW per-parameter state (amsgrad off)


def _rank_optimizer(saved: Any, stored: Any, where: str) -> tuple[RankOptimizer | None, str | None]:
    """Return a rank's `optimizer` entry as a RankOptimizer, or why it is not read: the state dict
    of Megatron's FP32Optimizer over torch's Adam/AdamW (optimizer.py `FP32Optimizer.state_dict`:
    `self.optimizer.state_dict()`) is, and DistributedOptimizer's ({'optimizer': param groups only},
    the state in distrib_optim.pt, read by `_read_buffers`); the others are named
    (Float16OptimizerWithFloat16Params: {'optimizer', 'fp32_from_fp16_params', ...};
    ChainedOptimizer of several: a list)."""
    here = f"{where}: {OPTIMIZER}"
    if saved is None:
        return None, f"{here}: none saved (--no-save-optim?)"
    if isinstance(saved, list):
        return None, f"{here}: {len(saved)} chained optimizers' state (a model with experts), which is not read yet"
    if not isinstance(saved, dict):
        return None, f"{here}: a {type(saved).__name__}, no optimizer state this build knows"
    if "fp32_from_fp16_params" in saved:
        return None, (f"{here}: the mixed-precision optimizer's (fp32_from_fp16_params: a --bf16/--fp16 run's main "
                      "parameters), which is not read yet")
    inner = saved.get(OPTIMIZER)
    if isinstance(inner, dict) and "state" not in inner and isinstance(inner.get("param_groups"), list):
        if set(saved) - {OPTIMIZER, "grad_scaler"} or set(inner) != {"param_groups"}:
            keys = ", ".join(sorted(map(str, (*saved, *inner))))[:80]
            return None, f"{here}: keys {keys}: no distributed optimizer state this build knows"
        if not all(isinstance(group, dict) and "params" not in group for group in inner["param_groups"]):
            raise CorruptMetadata(f"{here}: the distributed optimizer's param groups are not dicts without `params`")
        return RankOptimizer(tuple(inner["param_groups"]), {}, distributed=True), None
    state, groups = saved.get("state"), saved.get("param_groups")
    if set(saved) != {"state", "param_groups"} or not isinstance(state, dict) or not isinstance(groups, list):
        keys = ", ".join(sorted(map(str, saved)))[:80]
        return None, f"{here}: keys {keys}: no optimizer state this build knows (torch's state and param_groups)"
    if not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        raise CorruptMetadata(f"{here}: a param group without its `params` list")
    parts: dict[int, dict[str, Stored]] = {}
    for number, held in state.items():
        if type(number) is not int or not isinstance(held, dict):
            raise CorruptMetadata(f"{here}: state entry {number!r:.40} is not torch's (an integer id -> its state)")
        odd = sorted(str(kind) for kind in held if kind not in ADAM_STATE)
        if odd or set(held) != set(ADAM_STATE):
            what = f"`{odd[0][:40]}`" if odd else f"{', '.join(sorted(map(str, held)))[:60] or 'nothing'}"
            return None, (f"{here}: parameter {number} keeps {what}, not Adam's {', '.join(ADAM_STATE)} (another "
                          "optimizer, or amsgrad), which is not read")
        parts[number] = {}
        for kind in ADAM_STATE:
            if not isinstance(held[kind], _Rebuilt):
                return None, f"{here}: parameter {number}'s {kind} is a {type(held[kind]).__name__}, not a tensor"
            parts[number][kind] = stored(held[kind], f"{here}: state {number} {kind}")
    return RankOptimizer(tuple(groups), parts), None


def _size_arg(args: dict[str, Any], key: str, where: str, default: int = 1) -> int:
    value = args.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise CorruptMetadata(f"{where}: args {key}={value!r:.40} is not a positive integer")
    return value


# ---------------------------------------------------------------------------------------------
# Reading


def read_legacy_args(path: str | os.PathLike, follow_symlinks: bool = False) -> dict[str, Any]:
    """Return the Megatron-LM arguments (name -> value: numbers, strings, `EnumValue`s, torch
    dtypes as `DTypeName`s) the first rank file of the iteration folder `path` stores, read
    through the checking loader: what `naming.megatron_config.hf_config` turns into config.json.

    Example:
        >>> read_legacy_args("checkpoints/iter_0000002")["padded_vocab_size"]
        128
    """
    folder = as_path(storage.location(path))
    present = legacy_rank_files(folder)
    if not present:
        raise NotACheckpoint(f"{folder}: no mp_rank_TT[_PPP]/{MEGATRON_LEGACY_FILE}; not a Megatron-LM legacy save")
    with DataFiles(folder, follow_symlinks) as files:
        return _read_rank(files, folder, present[0]).args


def read_megatron_legacy(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return a Megatron-LM `--ckpt-format torch` iteration folder as one global model: its tensors
    under `model.` with global layer numbers, every chunk a raw byte range of a rank's file.

    Raises MissingFile for a rank's file that is missing, UnsafeMetadata for a pickle naming a
    global outside the allowlist, CorruptMetadata for parts that disagree across ranks (shape,
    dtype, replicated bytes, names) or for damaged files, UnsupportedFormat for expert
    parallelism and for a tensor whose tensor-parallel split MERGE_RULES does not say.
    """
    folder = as_path(storage.location(path))
    with DataFiles(folder, follow_symlinks) as files:
        first, ranks, tensor_parallel, pipeline_parallel = _read_ranks(folder, files, optimizer=False)
    tensors = _global_model(folder, first, ranks, tensor_parallel, pipeline_parallel)
    return _as_checkpoint(folder, first, {f"{MODEL_PREFIX}.{name}": tensor for name, tensor in tensors.items()})


def _as_checkpoint(folder: Path, first: RankFile, tensors: dict[str, Tensor]) -> Checkpoint:
    """The Checkpoint of `tensors` (fqn -> global tensor): `model.` ones nested under `model`."""
    tensors = {fqn: Tensor(fqn, tensor.dtype, tensor.shape, tensor.chunks) for fqn, tensor in tensors.items()}
    model = [fqn for fqn in tensors if fqn.startswith(MODEL_PREFIX + ".")]
    refuse_bad_names(folder, list(tensors), set(), tensors, {})
    version = first.version if type(first.version) in (int, float) else None
    return Checkpoint(path=folder, metadata_file=first.name,
                      version=f"megatron-lm checkpoint_version {version}" if version is not None else None,
                      tensors=dict(sorted(tensors.items())),
                      objects={}, nesting={fqn: (MODEL_PREFIX, fqn.split(".", 1)[1]) for fqn in sorted(model, key=_natural)},
                      model_prefix=MODEL_PREFIX)


def _read_ranks(folder: Path, files: DataFiles, optimizer: bool
                ) -> tuple[RankFile, dict[tuple[int, int], RankFile], int, int]:
    """Return the first rank file, every (tensor rank, pipeline rank) -> its file, and the tensor
    and pipeline parallel sizes; refuse a missing, extra or disagreeing rank file."""
    present = legacy_rank_files(folder)
    if not present:
        raise NotACheckpoint(f"{folder}: no mp_rank_TT[_PPP]/{MEGATRON_LEGACY_FILE}; not a Megatron-LM legacy save")
    if pipeline_layer_files(folder):  # the model: readers/megatron_deepspeed_pipe.py; the optimizer: not read
        raise UnsupportedFormat(f"{folder}: DeepSpeed's pipeline engine keeps the optimizer state in ZeRO's "
                                "zero_pp_rank_D_mp_rank_TT_optim_states.pt files, which this build does not read")
    first = _read_rank(files, folder, present[0], optimizer)
    engine = DEEPSPEED_ENGINE_RANK.match(present[0]) is not None
    where = str(folder / first.name)
    tensor_parallel = _size_arg(first.args, "tensor_model_parallel_size", where)
    pipeline_parallel = _size_arg(first.args, "pipeline_model_parallel_size", where)
    refuse_experts(first.args, where)
    wanted = {rank_file(t, p, pipeline_parallel > 1, engine): (t, p)
              for t in range(tensor_parallel) for p in range(pipeline_parallel)}
    found = sorted(present)
    for name in found:
        if name not in wanted:
            raise CorruptMetadata(f"{folder / name}: beyond the save's tensor parallel {tensor_parallel} x pipeline "
                                  f"parallel {pipeline_parallel} ranks (args in {where}); is an older save's file left over?")
    ranks: dict[tuple[int, int], RankFile] = {}
    for name, (t, p) in sorted(wanted.items(), key=lambda item: item[1][::-1]):
        if name not in found:
            raise MissingFile(f"{folder / name}: missing: tensor-parallel rank {t} of pipeline stage {p} (the save has "
                              f"tensor parallel {tensor_parallel} x pipeline parallel {pipeline_parallel}; was it interrupted?)")
        ranks[(t, p)] = first if name == first.name else _read_rank(files, folder, name, optimizer)
    _check_same_topology(ranks, first, folder)
    return first, ranks, tensor_parallel, pipeline_parallel


def _global_model(folder: Path, first: RankFile, ranks: dict[tuple[int, int], RankFile], tensor_parallel: int,
                  pipeline_parallel: int) -> dict[str, Tensor]:
    """Return the model's global tensors (Megatron's names, global layer numbers)."""
    tensors = _merge(ranks, tensor_parallel, pipeline_parallel, _gated(first), folder)
    layers = first.args.get("num_layers")
    counted = len({match.group("layer") for name in tensors if (match := _LAYER.match(name))})
    if type(layers) is int and counted != layers:
        raise CorruptMetadata(f"{folder / first.name}: the stages hold {counted} decoder layers, args num_layers says {layers}")
    return tensors


def _gated(first: RankFile) -> bool:
    return any(first.args.get(flag) is True for flag in GATING_ARGS)


def _check_same_topology(ranks: dict[tuple[int, int], RankFile], first: RankFile, folder: Path) -> None:
    """Every rank's file records the same tensor and pipeline parallel sizes as the first's."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    for rank in ranks.values():
        if any(rank.args.get(key) != first.args.get(key) for key in keys):
            raise CorruptMetadata(f"{folder / rank.name}: args say tensor parallel {rank.args.get(keys[0])!r:.20} x pipeline "
                                  f"parallel {rank.args.get(keys[1])!r:.20}, {first.name}'s say {first.args.get(keys[0])!r:.20}"
                                  f" x {first.args.get(keys[1])!r:.20}")


def refuse_experts(args: dict[str, Any], where: str) -> None:
    """Raise UnsupportedFormat for a mixture-of-experts save's arguments."""
    if _size_arg(args, "expert_model_parallel_size", where) > 1 or args.get("num_experts"):
        raise UnsupportedFormat(f"{where}: a mixture-of-experts save (args num_experts / expert_model_parallel_size); "
                                "this build reads dense legacy Megatron-LM saves; convert it with Megatron-LM's "
                                "checkpoint converter to torch_dist first")


def _layout(ranks: dict[tuple[int, int], RankFile], pipeline_parallel: int) -> list[tuple[int, int, int]]:
    """Return (model chunk, pipeline stage, its first global layer number) in the global layer
    order: chunk-major for a virtual pipeline (the interleaved schedule's layer order)."""
    found = []
    offset = 0
    for chunk in sorted(ranks[(0, 0)].chunks):
        for stage in range(pipeline_parallel):
            found.append((chunk, stage, offset))
            local_layers = {int(m.group("layer")) for name in ranks[(0, stage)].chunks[chunk] if (m := _LAYER.match(name))}
            offset += max(local_layers) + 1 if local_layers else 0
    return found


def _merge(ranks: dict[tuple[int, int], RankFile], tensor_parallel: int, pipeline_parallel: int, gated: bool,
           folder: Path) -> dict[str, Tensor]:
    """Return the global tensors: each stage's (and chunk's) layers renumbered, each tensor's
    tensor-parallel parts placed by its merge rule."""
    chunk_numbers = sorted(ranks[(0, 0)].chunks)
    for rank in ranks.values():
        if sorted(rank.chunks) != chunk_numbers:
            raise CorruptMetadata(f"{folder / rank.name}: model chunks {sorted(rank.chunks)}, {ranks[(0, 0)].name} has "
                                  f"{chunk_numbers}")
    tensors: dict[str, Tensor] = {}
    for chunk, stage, offset in _layout(ranks, pipeline_parallel):
        parts = [ranks[(t, stage)] for t in range(tensor_parallel)]
        names = sorted(parts[0].chunks[chunk])
        for rank in parts[1:]:
            if sorted(rank.chunks[chunk]) != names:
                odd = sorted(set(names) ^ set(rank.chunks[chunk]))[0]
                raise CorruptMetadata(f"{folder / rank.name}: {odd} is on one tensor-parallel rank of stage {stage} and "
                                      f"not on {parts[0].name}")
        for name in names:
            global_name = _renumbered(name, offset)
            if global_name in tensors:
                raise CorruptMetadata(f"{folder / parts[0].name}: {name} gives {global_name}, which another stage "
                                      "gives too")
            pieces = [rank.chunks[chunk][name] for rank in parts]
            tensors[global_name] = _placed(global_name, pieces, [piece.blob.file for piece in pieces], gated, folder)
    return tensors


def _renumbered(name: str, offset: int) -> str:
    match = _LAYER.match(name)
    if match is None or not offset:
        return name
    return f"{match.group('head')}{int(match.group('layer')) + offset}.{match.group('rest')}"


def _placed(name: str, pieces: list[Stored], files: list[str], gated: bool, folder: Path) -> Tensor:
    """Return the global tensor `name` from its tensor-parallel parts (rank order)."""
    first = pieces[0]
    for piece, file in zip(pieces[1:], files[1:]):
        if piece.dtype != first.dtype or piece.shape != first.shape:
            raise CorruptMetadata(f"{folder / file}: {name} is {piece.dtype} {list(piece.shape)}, on {files[0]} "
                                  f"{first.dtype} {list(first.shape)} (tensor-parallel parts are equal in shape)")
    if len(pieces) == 1:
        return Tensor(name, first.dtype, first.shape, (Chunk((0,) * len(first.shape), first.shape, first.blob),))
    rule = merge_rule(name, gated)
    if rule is None:
        raise UnsupportedFormat(f"{folder / files[0]}: {name}: how its tensor-parallel parts make the tensor is not known "
                                "to this build (readers/megatron_legacy.py MERGE_RULES)")
    shape, count = first.shape, len(pieces)
    if rule == REPLICATED:
        for piece, file in zip(pieces[1:], files[1:]):
            if piece.blob.transforms != first.blob.transforms:  # the storages' CRC-32s, when whole
                raise CorruptMetadata(f"{folder / file}: {name} is replicated across tensor-parallel ranks, and its bytes "
                                      f"differ from {files[0]}'s (CRC-32)")
        return Tensor(name, first.dtype, shape, (Chunk((0,) * len(shape), shape, first.blob),))
    dim = 1 if rule == ROW else 0
    if len(shape) <= dim or (rule == GATED and shape[0] % 2):
        raise CorruptMetadata(f"{folder / files[0]}: {name} of shape {list(shape)} cannot be a {rule}-parallel part")
    full = tuple(size * count if axis == dim else size for axis, size in enumerate(shape))
    chunks = []
    for rank, piece in enumerate(pieces):
        if rule != GATED:
            offsets = tuple(rank * size if axis == dim else 0 for axis, size in enumerate(shape))
            chunks.append(Chunk(offsets, shape, piece.blob))
            continue
        half = shape[0] // 2
        half_bytes = piece.blob.length // 2
        sizes = (half, *shape[1:])
        for which, row in enumerate((rank * half, full[0] // 2 + rank * half)):  # the gate part, then the up part
            blob = Blob(piece.blob.file, piece.blob.offset + which * half_bytes, half_bytes, raw_range_transforms())
            chunks.append(Chunk((row, *(0,) * (len(shape) - 1)), sizes, blob))
    return Tensor(name, first.dtype, full, tuple(sorted(chunks)))


def _natural(name: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


__all__ = ["MERGE_RULES", "EnumValue", "Namespace", "merge_rule", "rank_file", "read_legacy_args", "read_megatron_legacy"]
