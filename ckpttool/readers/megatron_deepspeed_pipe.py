"""Megatron-DeepSpeed's pipeline-parallel saves: DeepSpeed's pipeline engine over GPTModelPipe.

A Megatron-DeepSpeed run with --deepspeed and pipeline parallelism (the default: no
--no-pipeline-parallel) builds `GPTModelPipe` (megatron/model/gpt_model.py, microsoft/
Megatron-DeepSpeed 6acc370a), a DeepSpeed `PipelineModule` of layer specs, and saves it through
DeepSpeed's `PipelineEngine` (deepspeed 0.19.8). In the tag folder (`global_stepN/`):

- `layer_XX-model_TT-model_states.pt` (deepspeed/runtime/pipe/module.py `ckpt_layer_path`,
  `save_state_dict`): per layer spec holding a module, and per tensor-parallel rank TT, that
  module's `state_dict()` under its own names; XX is the spec's global index, whichever stage
  built it;
- `mp_rank_MM_model_states.pt` per model-parallel rank (MM = stage x TP + TT): DeepSpeed's engine
  state with `module` None, and Megatron-DeepSpeed's `args` (its `save_checkpoint` client state);
- `zero_pp_rank_D_mp_rank_MM_optim_states.pt`: ZeRO's optimizer partitions, not opened here.

GPTModelPipe's specs, in order (`PIPE_SPECS`): `_to_float16` (a function: no file), the
EmbeddingPipe (index 1), the N ParallelTransformerLayerPipe (2 .. N+1), the final norm (N+2),
LMHeadPipe (N+3, with --untie-embeddings-and-output-weights; tied, the head is a function of the
embedding's tied module and has no file), `float16_to_fp32` (a function). Each layer file's names
become the non-pipeline GPTModel's (what readers/megatron_legacy.py gives for Megatron's own
saves, global layer numbers), as Megatron-DeepSpeed's converter (tools/hf2megads_weight_converter.py:
`mega_emb_wnum` 1, `offset_num` 2, `mega_norm_wnum` N+2, `mega_lm_head_wnum` N+3) numbers them;
the tensor-parallel parts then merge by readers/megatron_legacy.py's MERGE_RULES. The files'
pipeline stages are not needed: the layer indices are global.

Example:
    >>> checkpoint = read_megatron_deepspeed_pipe("checkpoints/global_step0")
    >>> checkpoint.tensors["model.language_model.encoder.layers.1.mlp.dense_h_to_4h.weight"].shape
    (96, 32)
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpttool.core.checkpoint import Checkpoint, as_path
from ckpttool.core.errors import CorruptMetadata, MissingFile, NotACheckpoint, UnsupportedFormat
from ckpttool.dcp.blobs import DataFiles
from ckpttool.readers.detect import DEEPSPEED_PIPE_LAYER, deepspeed_engine_rank_files, pipeline_layer_files
from ckpttool.readers.megatron_legacy import (
    MODEL_PREFIX, RankFile, Stored, _as_checkpoint, _global_model, _read_rank, _size_arg, read_layer_file, refuse_experts,
)
from ckpttool.store import storage

EMBEDDING, LAYER, FINAL_NORM, HEAD = "embedding", "layer", "final_norm", "head"
EMBEDDING_INDEX = 1  # GPTModelPipe.specs[0] is `_to_float16`, a function
FIRST_LAYER_INDEX = 2  # the converter's offset_num
# spec -> (its layer file's name, GPTModel's name); `{name}`: any name the module's state dict holds,
# `{L}`: the decoder layer number (index - FIRST_LAYER_INDEX)
PIPE_SPECS: tuple[tuple[str, str, str], ...] = (
    (EMBEDDING, "{name}", "language_model.embedding.{name}"),  # EmbeddingPipe: word_embeddings, position_embeddings
    (LAYER, "{name}", "language_model.encoder.layers.{L}.{name}"),  # ParallelTransformerLayerPipe
    (FINAL_NORM, "{name}", "language_model.encoder.final_layernorm.{name}"),  # LayerNorm / RMSNorm: weight, bias
    (HEAD, "lm_head.weight", "language_model.output_layer.weight"),  # LMHeadPipe's ColumnParallelLinear
)
UNTIED_ARG = "untie_embeddings_and_output_weights"  # GPTModelPipe: LMHeadPipe only then


def spec_of(index: int, num_layers: int) -> tuple[str, int | None] | None:
    """Return (which spec, its decoder layer number or None) of GPTModelPipe's layer `index`, or
    None for an index that holds no module.

    Example:
        >>> spec_of(3, num_layers=2), spec_of(4, num_layers=2), spec_of(5, num_layers=2)
        (('layer', 1), ('final_norm', None), ('head', None))
    """
    if index == EMBEDDING_INDEX:
        return EMBEDDING, None
    if FIRST_LAYER_INDEX <= index < FIRST_LAYER_INDEX + num_layers:
        return LAYER, index - FIRST_LAYER_INDEX
    if index == FIRST_LAYER_INDEX + num_layers:
        return FINAL_NORM, None
    if index == FIRST_LAYER_INDEX + num_layers + 1:
        return HEAD, None
    return None


def global_name(index: int, name: str, num_layers: int) -> str | None:
    """Return GPTModel's name of `name` in GPTModelPipe's layer file `index`, or None when no
    PIPE_SPECS row takes it.

    Example:
        >>> global_name(2, "self_attention.query_key_value.weight", num_layers=2)
        'language_model.encoder.layers.0.self_attention.query_key_value.weight'
        >>> global_name(5, "lm_head.weight", num_layers=2)
        'language_model.output_layer.weight'
    """
    found = spec_of(index, num_layers)
    if found is None:
        return None
    spec, layer = found
    for row, local, megatron in PIPE_SPECS:
        if row == spec and (local == "{name}" or local == name):
            return megatron.format(name=name, L=layer)
    return None


def layer_file(index: int, tensor_rank: int) -> str:
    """Return a layer file's name (deepspeed/runtime/pipe/module.py `ckpt_layer_path`).

    Example:
        >>> layer_file(2, 1)
        'layer_02-model_01-model_states.pt'
    """
    return f"layer_{index:02d}-model_{tensor_rank:02d}-model_states.pt"


def read_megatron_deepspeed_pipe(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return DeepSpeed's pipeline engine's tag folder as one global model, as
    readers/megatron_legacy.py `read_megatron_legacy` gives Megatron's own saves: its tensors under
    `model.` with GPTModel's names and global layer numbers, every chunk a raw byte range of a layer file.

    Raises MissingFile for a missing layer file, CorruptMetadata for a layer file beyond the save's
    layers or tensor-parallel ranks or whose parts disagree in shape, UnsafeMetadata for a pickle
    naming a global outside the allowlist, UnsupportedFormat for a tensor PIPE_SPECS does not name.
    """
    folder = as_path(storage.location(path))
    with DataFiles(folder, follow_symlinks) as files:
        first, ranks, tensor_parallel, pipeline_parallel = read_pipeline_ranks(folder, files)
    tensors = _global_model(folder, first, ranks, tensor_parallel, pipeline_parallel)
    return _as_checkpoint(folder, first, {f"{MODEL_PREFIX}.{name}": tensor for name, tensor in tensors.items()})


def read_pipeline_ranks(folder: Path, files: DataFiles) -> tuple[RankFile, dict[tuple[int, int], RankFile], int, int]:
    """Return (the first mp_rank file, its arguments only; tensor rank -> a RankFile of that
    rank's layer files, its tensors under GPTModel's names with global layer numbers; the tensor
    parallel size; 1): what readers/megatron_legacy.py's merge takes, every stage already placed.

    Raises MissingFile for a layer file the arguments call for that is not there, CorruptMetadata
    for a layer file beyond the save's layers or tensor-parallel ranks (an older save's), or one
    whose names no PIPE_SPECS row takes.
    """
    engine_files = deepspeed_engine_rank_files(folder)
    if not engine_files:
        raise NotACheckpoint(f"{folder}: pipeline layer files without DeepSpeed's mp_rank_MM_model_states.pt (which "
                             "holds Megatron-DeepSpeed's args); not a Megatron-DeepSpeed save")
    first = _read_rank(files, folder, engine_files[0])
    where = str(folder / first.name)
    refuse_experts(first.args, where)
    tensor_parallel = _size_arg(first.args, "tensor_model_parallel_size", where)
    layers = first.args.get("num_layers")
    if type(layers) is not int or layers < 1:
        raise CorruptMetadata(f"{where}: args num_layers={layers!r:.40} is not a positive integer")
    last = FIRST_LAYER_INDEX + layers + (1 if first.args.get(UNTIED_ARG) is True else 0)
    wanted = {layer_file(index, t): (index, t) for index in range(EMBEDDING_INDEX, last + 1) for t in range(tensor_parallel)}
    present = pipeline_layer_files(folder)
    for name in present:
        if name not in wanted:
            index, rank = (int(group) for group in DEEPSPEED_PIPE_LAYER.match(name).groups())  # type: ignore[union-attr]
            beyond = (f"tensor-parallel rank {rank}, beyond the save's tensor parallel {tensor_parallel}" if rank >= tensor_parallel
                      else f"layer index {index}, beyond GPTModelPipe's {EMBEDDING_INDEX}..{last} for {layers} layers")
            raise CorruptMetadata(f"{folder / name}: {beyond} (args in {where}); is an older save's file left over?")
    ranks: dict[tuple[int, int], RankFile] = {}
    for t in range(tensor_parallel):
        parts: dict[str, Stored] = {}
        for index in range(EMBEDDING_INDEX, last + 1):
            name = layer_file(index, t)
            if name not in present:
                raise MissingFile(f"{folder / name}: missing: layer {index} of tensor-parallel rank {t} (the save has "
                                  f"{layers} layers at tensor parallel {tensor_parallel}; was it interrupted?)")
            for local, stored in read_layer_file(files, folder, name).items():
                megatron = global_name(index, local, layers)
                if megatron is None:
                    raise UnsupportedFormat(f"{folder / name}: {local}: GPTModelPipe's layer {index} holds no such "
                                            "tensor in this build's table (readers/megatron_deepspeed_pipe.py PIPE_SPECS)")
                parts[megatron] = stored
        ranks[(t, 0)] = RankFile(f"layer_*-model_{t:02d}-model_states.pt", first.args, {0: parts}, first.version)
    return first, ranks, tensor_parallel, 1


__all__ = ["PIPE_SPECS", "global_name", "layer_file", "read_megatron_deepspeed_pipe", "read_pipeline_ranks", "spec_of"]
