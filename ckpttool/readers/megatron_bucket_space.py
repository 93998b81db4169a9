"""Megatron's distributed optimizer state in a `torch_dist` save's default sharding, `dp_reshardable`
(Megatron-LM core_v0.16.1 with --use-distributed-optimizer and without
--dist-ckpt-optim-fully-reshardable), as each parameter's moments: for `reshard --to transformers`
(naming/megatron_optimizer.py).

What the save holds (megatron/core/optimizer/distrib_optimizer.py `sharded_param_state_dp_reshardable`),
beside the model's sharded tensors:

- per model-parallel rank i (`dp_group_idx_i`: its rank in the tensor x pipeline group, the tensor
  rank fastest: parallel_state's 'tp-pp' groups), grad buffer g and bucket b, the 1-D float32 DCP
  tensors `optimizer.distributed.dp_group_idx_{i}.gbuf_idx_{g}.dtype_{dtypes}.bucket_idx_{b}.{param,
  exp_avg, exp_avg_sq}`: the bucket without the padding at its end, one chunk per piece of a
  parameter or padding gap a data-parallel rank owns. Laid end to end, the buckets are
  distrib_optim.pt's flat buffer of the same run;
- byte entries `optimizer.distributed.dp_group_idx_{i}.{optimizer, per_bucket_numel,
  per_bucket_numel_unpadded}/shard_0_1`: the param groups (their common `step`, a number) and each
  bucket's padded and unpadded length.

Each parameter's range in its rank's buckets is found as `_ParamAndGradBuffer` lays the buffer out
(readers/megatron_legacy_optimizer.py `bucket_layout`, with the bucket size of the saved arguments),
over the rank's parameters in reverse order of the model chunk's `named_parameters()`. That order is
not saved: it is GPTModel's module order (`LAYER_ORDER`, `TOP_ORDER`, Megatron's local layer spec,
whose layer norms a torch_dist save names `linear_qkv.layer_norm_*` / `linear_fc1.layer_norm_*`),
and every run checks it against the save: the layout it gives must be the recorded
`per_bucket_numel_unpadded`; every parameter must start at a chunk of its bucket (Megatron saves
each data-parallel rank's piece of a parameter as a chunk of its own); and the buckets' own copy
of the parameters (`param`, the float32 main parameters) placed by it must hold each saved weight
chunk's bytes (the CRC-32 of the placed bytes, read in blocks, against the weight record's:
`_check_order`). A save that fails is refused by name, never migrated by a guess. tests/test_megatron_dp_reshardable.py also compares
the placed `param` buckets with every weight byte for byte.

A rank's part of a parameter is the global tensor's chunks of that tensor rank (a tensor with
`tensor_parallel x k` chunks: rank t's are chunks t, t + TP, ... in offset order, one after another
on the split axis: a SwiGLU fc1's gate then up rows; one chunk: every rank holds it whole, and
tensor rank 0's state is taken). Each range of it is cut into boxes of the global tensor (a partial
row, whole rows, a partial row), every box a raw byte range of a bucket's stored record.

Refused by name: other layer specs (Transformer Engine's fused modules order their parameters
otherwise), pipeline or virtual pipeline, context or expert parallelism, several grad buffers,
non-float32 buffers or models, several distributed-optimizer instances, parameters of more than 2
dimensions, tied embeddings (their shared bucket is not laid out).

Example:
    >>> saved = read_bucket_optimizer(read_checkpoint("checkpoints/iter_0000002"), args)
    >>> saved.checkpoint.tensors["optimizer.state.exp_avg.output_layer.weight"].shape
    (128, 32)
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, is_raw_range, raw_range_transforms
from ckpttool.core.errors import CorruptMetadata, UnsupportedFormat
from ckpttool.dcp.blobs import DataFiles, object_bytes
from ckpttool.readers.megatron import MODEL_SUBTREE, _natural, _raw_range, model_view
from ckpttool.readers.megatron_legacy import _ALLOWED, _Unpickler, float32_pair_keys_as_one
from ckpttool.readers.megatron_legacy_optimizer import (
    MOMENTS, OPTIMIZER_STATE, STANDARD_GROUP, STEP, WD_MULT, LegacyOptimizer, _weight_decay_multiplier,
    bucket_layout, grad_bucket_size,
)
from ckpttool.torchsave.stored import file_entries, load_data_pkl

DISTRIBUTED = "optimizer.distributed."
BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\."
                    r"(param|exp_avg|exp_avg_sq)")
FLOAT32_BUFFER = "(torch.float32, torch.float32)"  # f'dtype_{(param dtype, grad dtype)}'
ENTRY = "optimizer.distributed.dp_group_idx_{index}.{name}/shard_0_1"  # the ShardedObjects' one shard
PARAMETERS = "param"  # the bucket's main parameters (fp32), beside the moments
FLOAT32_BYTES = 4
READ_BLOCK = 8 << 20  # bytes of the `param` buckets read at a time to check the order
# GPTModel's module order (megatron/core/models/gpt/gpt_model.py, core_v0.16.1): the embedding, the
# decoder's layers, its final norm, the output layer; within a layer (transformer_layer.py, attention.py,
# mlp.py, the local spec of gpt_layer_specs.py) each module's weight before its bias. A torch_dist save
# names the local spec's input_layernorm / pre_mlp_layernorm by its `sharded_state_dict_keys_map`.
TOP_ORDER = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "decoder.layers.",
             "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight", "output_layer.bias")
LAYER_ORDER = (
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",  # input_layernorm
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",  # pre_mlp_layernorm
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
)
# gpt_layer_specs.py's local spec `sharded_state_dict_keys_map` (state-dict name -> torch_dist key), undone
STATE_DICT_NAMES = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))
LOCAL_SPEC = "local"  # --transformer-impl local
# arguments whose other values lay the buffers out otherwise than this reader models
ONE = ("pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
       "num_distributed_optimizer_instances")
UNSET = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "num_experts")


@dataclass(frozen=True)
class _Fragment:
    """A tensor rank's rows [start, stop) of its part of a parameter, at `origin` in the global tensor."""

    start: int
    stop: int
    origin: tuple[int, ...]


@dataclass(frozen=True)
class _Part:
    """A tensor rank's part of one parameter (per layer): its global key, shape, and fragments."""

    key: str
    shape: tuple[int, ...]
    fragments: tuple[_Fragment, ...]
    whole: bool  # every tensor rank holds all of it (its state taken from tensor rank 0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_bucket_optimizer(checkpoint: Checkpoint, args: dict[str, Any], follow_symlinks: bool = False,
                          kinds: Sequence[str] = MOMENTS) -> LegacyOptimizer:
    """Return the model and AdamW state of a torch_dist save in `dp_reshardable` sharding
    (`checkpoint` read as saved, `args` its Megatron-LM arguments) as a legacy save's reader gives
    them: the model view and `optimizer.state.<kind>.<key>` per parameter (`kinds`: the moments, or
    `param` for the buckets' own copy of the parameters), the param groups and the common step.

    Raises UnsupportedFormat naming what is not read (module doc), CorruptMetadata for buckets,
    records or recorded lengths that disagree with the layout.
    """
    where = str(checkpoint.path)
    _refuse_unread(args, where)
    tensor_parallel = int(args.get("tensor_model_parallel_size") or 1)
    view = model_view(checkpoint, follow_symlinks)
    keys = [str(path[1]) for path in view.nesting.values() if path[0] == MODEL_SUBTREE]
    order = sorted(keys, key=lambda key: _module_order(key, where))
    buckets = _buckets(checkpoint, tensor_parallel, where)
    tensors = {fqn: tensor for fqn, tensor in view.tensors.items() if not fqn.startswith(DISTRIBUTED)}
    chunks: dict[str, dict[str, list[Chunk]]] = {kind: {key: [] for key in order} for kind in kinds}
    groups: list[dict[str, Any]] = []
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        for rank in range(tensor_parallel):
            parts = [_part(view.tensors[f"{MODEL_SUBTREE}.{key}"], key, rank, tensor_parallel, where) for key in order]
            groups.append(_read_entry(checkpoint, files, rank, "optimizer", where))
            placed = _placed(checkpoint, files, args, rank, parts[::-1], buckets[rank],
                             tuple(dict.fromkeys((*kinds, PARAMETERS))), where)
            _check_order(files, view, parts, placed[PARAMETERS], rank, where)
            for kind in kinds:
                for part in parts:
                    if rank == 0 or not part.whole:
                        chunks[kind][part.key].extend(placed[kind][part.key])
    for kind in kinds:
        for key in order:
            model = view.tensors[f"{MODEL_SUBTREE}.{key}"]
            fqn = f"{OPTIMIZER_STATE}{kind}.{key}"
            if sum(chunk.numel for chunk in chunks[kind][key]) != math.prod(model.shape):
                raise CorruptMetadata(f"{where}: {fqn}: the buckets' pieces do not add up to {list(model.shape)}")
            tensors[fqn] = Tensor(fqn, "float32", model.shape, tuple(sorted(chunks[kind][key])))
    saved, step = _groups(groups, where)
    qk_decay = args.get("apply_wd_to_qk_layernorm") is True
    by_wd_mult = {float(group[WD_MULT]): number for number, group in enumerate(saved)}
    group_of = {}
    for key in order:
        wd_mult = _weight_decay_multiplier(key, view.tensors[f"{MODEL_SUBTREE}.{key}"].shape, qk_decay)
        if wd_mult not in by_wd_mult:
            raise CorruptMetadata(f"{where}: no optimizer param group has {WD_MULT} {wd_mult}, the group of {key}")
        group_of[key] = by_wd_mult[wd_mult]
    # the model in the order a legacy save of the run lists it (its state dict's names, natural order), so
    # that both migrate to the same bytes (param groups' members included)
    listed = sorted(keys, key=lambda key: _natural(_state_dict_name(key)))
    nesting = {**{fqn: path for fqn, path in view.nesting.items() if path[0] != MODEL_SUBTREE},
               **{f"{MODEL_SUBTREE}.{key}": (MODEL_SUBTREE, key) for key in listed}}
    return LegacyOptimizer(dataclasses.replace(view, tensors=dict(sorted(tensors.items())), nesting=nesting), args,
                           tuple({k: v for k, v in group.items() if k != STEP} for group in saved), group_of,
                           {key: step for key in order})


def _state_dict_name(key: str) -> str:
    """The model's state-dict name of a torch_dist key (the local spec's keys map undone)."""
    for saved, name in STATE_DICT_NAMES:
        key = key.replace(saved, name)
    return key


def _refuse_unread(args: dict[str, Any], where: str) -> None:
    """UnsupportedFormat for a run whose buffers this reader does not lay out (module doc)."""
    impl = args.get("transformer_impl")
    if impl != LOCAL_SPEC:
        raise UnsupportedFormat(f"{where}: a --transformer-impl {str(impl)[:30]} run: the order of its parameters in "
                                "the distributed optimizer's buckets (dp_reshardable) is derived for the local layer "
                                "spec only; save with --dist-ckpt-optim-fully-reshardable to migrate it")
    for name in ONE:
        if args.get(name) not in (None, 1):
            raise UnsupportedFormat(f"{where}: args.{name} {args.get(name)!r:.20}: the distributed optimizer's "
                                    "buckets (dp_reshardable) are read for one pipeline stage without context or "
                                    "expert parallelism; save with --dist-ckpt-optim-fully-reshardable to migrate it")
    for name in UNSET:
        if args.get(name) is not None:
            raise UnsupportedFormat(f"{where}: args.{name} {args.get(name)!r:.20}: not read in the distributed "
                                    "optimizer's dp_reshardable buckets yet; save with "
                                    "--dist-ckpt-optim-fully-reshardable to migrate it")
    if args.get("untie_embeddings_and_output_weights") is False:
        raise UnsupportedFormat(f"{where}: a run with tied embeddings (no --untie-embeddings-and-output-weights), "
                                "which reshard --to transformers does not migrate yet")
    for name in ("bf16", "fp16"):
        if args.get(name) is True:
            raise UnsupportedFormat(f"{where}: a --{name} run: its main parameters and moments in the distributed "
                                    "optimizer's buckets are not read yet (float32 runs are)")


def _module_order(key: str, where: str) -> tuple[int, int, int]:
    """Where `key` comes in GPTModel's named_parameters(); UnsupportedFormat for a name the order
    does not know (its place in the buckets cannot be told)."""
    for index, name in enumerate(TOP_ORDER):
        if name.endswith("."):
            layer, _, rest = key.removeprefix(name).partition(".") if key.startswith(name) else ("", "", "")
            if layer.isdigit() and rest in LAYER_ORDER:
                return index, int(layer), LAYER_ORDER.index(rest)
        elif key == name:
            return index, 0, 0
    raise UnsupportedFormat(f"{where}: {MODEL_SUBTREE}.{key}: its place in the distributed optimizer's buckets "
                            "(GPTModel's parameter order) is not known to this build; save with "
                            "--dist-ckpt-optim-fully-reshardable to migrate it")


def _buckets(checkpoint: Checkpoint, tensor_parallel: int, where: str) -> dict[int, list[dict[str, Tensor]]]:
    """Return model-parallel rank -> its buckets in order, each kind -> its tensor; refuse other
    buffers than one float32 one per rank."""
    found: dict[int, dict[int, dict[str, Tensor]]] = {}
    for fqn, tensor in checkpoint.tensors.items():
        if not fqn.startswith(DISTRIBUTED):
            continue
        matched = BUCKET.fullmatch(fqn)
        if matched is None:
            raise UnsupportedFormat(f"{where}: {fqn}: not a bucket of the dp_reshardable sharding; not read")
        index, buffer, dtypes, bucket, kind = matched.groups()
        if buffer != "0" or dtypes != FLOAT32_BUFFER:
            raise UnsupportedFormat(f"{where}: {fqn}: grad buffer {buffer} of {dtypes}; one float32 grad buffer a "
                                    "rank is read (several buffers or other dtypes are not yet)")
        found.setdefault(int(index), {}).setdefault(int(bucket), {})[kind] = tensor
    if sorted(found) != list(range(tensor_parallel)):
        raise CorruptMetadata(f"{where}: buckets of model-parallel ranks {sorted(found)[:8]}; tensor parallel "
                              f"{tensor_parallel} (args) has {list(range(tensor_parallel))}")
    result = {}
    for index, by_number in found.items():
        if sorted(by_number) != list(range(len(by_number))):
            raise CorruptMetadata(f"{where}: {DISTRIBUTED}dp_group_idx_{index}: buckets {sorted(by_number)[:8]} are not "
                                  "numbered 0, 1, ...")
        result[index] = [by_number[number] for number in range(len(by_number))]
    return result


def _part(tensor: Tensor, key: str, rank: int, tensor_parallel: int, where: str) -> _Part:
    """Tensor rank `rank`'s part of a (per layer) model tensor, from the save's chunks of it."""
    chunks = sorted(tensor.chunks)
    shape = tensor.shape
    if tensor.dtype != "float32":
        raise UnsupportedFormat(f"{where}: {key} is {tensor.dtype}; the distributed optimizer's buckets are read for "
                                "float32 models only")
    if len(shape) > 2:
        raise UnsupportedFormat(f"{where}: {key} has {len(shape)} dimensions; the distributed optimizer's buckets are "
                                "read for parameters of 1 or 2")
    if len(chunks) == 1 and chunks[0].sizes == shape:
        return _Part(key, shape, (_Fragment(0, shape[0], (0,) * len(shape)),), True)
    if len(chunks) % tensor_parallel:
        raise CorruptMetadata(f"{where}: {key}: {len(chunks)} chunks, not whole or a part for each of {tensor_parallel} "
                              "tensor-parallel ranks")
    mine = chunks[rank::tensor_parallel]
    split = {axis for chunk in mine for axis, size in enumerate(chunk.sizes) if size != shape[axis]}
    if split not in ({0}, {1}) or (len(mine) > 1 and split != {0}) or any(
            chunk.sizes[1:] != mine[0].sizes[1:] for chunk in mine):
        raise CorruptMetadata(f"{where}: {key}: tensor rank {rank}'s chunks {[list(c.offsets) for c in mine][:4]} are "
                              "not one part split on one axis")
    fragments = []
    row = 0
    for chunk in mine:
        fragments.append(_Fragment(row, row + chunk.sizes[0], chunk.offsets))
        row += chunk.sizes[0]
    local = (row, *mine[0].sizes[1:])
    return _Part(key, local, tuple(fragments), False)


def _read_entry(checkpoint: Checkpoint, files: DataFiles, index: int, name: str, where: str) -> Any:
    """A dp_group_idx's byte entry (`name`), decoded by the checking loader (its one shard)."""
    fqn = ENTRY.format(index=index, name=name)
    entry = checkpoint.objects.get(fqn)
    if entry is None:
        raise CorruptMetadata(f"{where}: {fqn}: missing (the distributed optimizer saves it beside its buckets)")
    data = object_bytes(files, entry)

    def read(offset: int, length: int) -> bytes:
        return data[offset:offset + length]

    here = f"{where}: {fqn}"
    value = load_data_pkl(file_entries(read, len(data), here), read, len(data), here, _Unpickler, _ALLOWED,
                          float32_pair_keys_as_one)
    if not isinstance(value, list) or len(value) != 1:
        raise CorruptMetadata(f"{here}: not the one shard Megatron saves")
    return value[0]


def _recorded_lengths(checkpoint: Checkpoint, files: DataFiles, index: int, where: str) -> list[int]:
    """The bucket lengths per_bucket_numel_unpadded records for dp_group_idx `index` (one float32 buffer)."""
    value = _read_entry(checkpoint, files, index, "per_bucket_numel_unpadded", where)
    here = f"{where}: {ENTRY.format(index=index, name='per_bucket_numel_unpadded')}"
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict) or len(value[0]) != 1:
        raise CorruptMetadata(f"{here}: not one grad buffer's {{dtypes: lengths}}")
    [(dtype, lengths)] = value[0].items()
    if getattr(dtype, "name", None) != "float32" or not isinstance(lengths, list) or not all(
            type(length) is int and length > 0 for length in lengths):
        raise CorruptMetadata(f"{here}: {str(dtype)[:40]} {str(lengths)[:60]}: not float32 buckets' lengths")
    return lengths


def _placed(checkpoint: Checkpoint, files: DataFiles, args: dict[str, Any], index: int, buffered: list[_Part],
            buckets: list[dict[str, Tensor]], kinds: Sequence[str], where: str) -> dict[str, dict[str, list[Chunk]]]:
    """kind -> key -> the global tensor's chunks of rank `index`'s state (`buffered`: its parts in
    the buffer's order), each a raw byte range of a bucket's record."""
    numels = [part.numel for part in buffered]
    offsets, lengths = bucket_layout(numels, grad_bucket_size(args, 0, 0, sum(numels)))
    recorded = _recorded_lengths(checkpoint, files, index, where)
    if recorded != lengths:
        raise CorruptMetadata(f"{where}: dp_group_idx_{index}: per_bucket_numel_unpadded {recorded[:12]}, the parameters "
                              f"laid out as Megatron's buffer ({len(buffered)} of them, buckets of "
                              f"{grad_bucket_size(args, 0, 0, sum(numels))} elements) give {lengths[:12]}")
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    placed: dict[str, dict[str, list[Chunk]]] = {kind: {} for kind in kinds}
    for kind in kinds:
        stored = [_stored_pieces(files, bucket, kind, length, index, number, where)
                  for number, (bucket, length) in enumerate(zip(buckets, lengths))]
        boundaries = {(number, start) for number, pieces in enumerate(stored) for start, _, _ in pieces}
        for part, offset in zip(buffered, offsets):
            number = max(n for n, start in enumerate(starts[:-1]) if start <= offset)
            begin = offset - starts[number]
            if (number, begin) not in boundaries:
                raise CorruptMetadata(f"{where}: dp_group_idx_{index} bucket {number} {kind}: no chunk starts at "
                                      f"{begin}, where the layout puts {part.key}")
            placed[kind][part.key] = list(_chunks(part, stored[number], begin))
    return placed


def _stored_pieces(files: DataFiles, buckets: dict[str, Tensor], kind: str, length: int, index: int, number: int,
                   where: str) -> list[tuple[int, int, Blob]]:
    """(start, stop, raw range of its record) of each chunk of a bucket's `kind` tensor, which must
    be 1-D float32 of the layout's `length` and covered by its chunks one after another."""
    tensor = buckets.get(kind)
    here = f"{where}: dp_group_idx_{index} bucket {number} {kind}"
    if tensor is None:
        raise CorruptMetadata(f"{here}: missing")
    if tensor.dtype != "float32" or tensor.shape != (length,):
        raise CorruptMetadata(f"{here} ({tensor.fqn}): {tensor.dtype} {list(tensor.shape)}; the layout's bucket is "
                              f"float32 [{length}]")
    pieces = []
    position = 0
    for chunk in sorted(tensor.chunks):
        blob = _raw_range(files, tensor, chunk) if chunk.offsets[0] == position else None
        if blob is None:
            raise CorruptMetadata(f"{here}: the chunk at {list(chunk.offsets)} is not the plain record of the next "
                                  f"{chunk.sizes[0]} elements after {position} (run `ckpttool validate`)")
        pieces.append((position, position + chunk.sizes[0], blob))
        position += chunk.sizes[0]
    if position != length:
        raise CorruptMetadata(f"{here}: its chunks hold {position} of its {length} elements")
    return pieces


def _chunks(part: _Part, pieces: list[tuple[int, int, Blob]], begin: int) -> list[Chunk]:
    """The global tensor's boxes of `part`, whose state starts at `begin` of a bucket (`pieces`)."""
    found = []
    end = begin + part.numel
    for start, stop, blob in pieces:
        low, high = max(start, begin), min(stop, end)
        if low >= high:
            continue
        for offsets, sizes, flat in _boxes(part, low - begin, high - begin):
            position = begin + flat - start
            found.append(Chunk(offsets, sizes, Blob(blob.file, blob.offset + position * FLOAT32_BYTES,
                                                    math.prod(sizes) * FLOAT32_BYTES, raw_range_transforms())))
    return found


def _boxes(part: _Part, low: int, high: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(global offsets, sizes, flat start) of the boxes elements [low, high) of `part` (row-major)
    are: per fragment, a partial row, whole rows, a partial row."""
    columns = math.prod(part.shape[1:])
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for fragment in part.fragments:
        position, stop = max(low, fragment.start * columns), min(high, fragment.stop * columns)
        if len(part.shape) == 1 and position < stop:
            boxes.append(((fragment.origin[0] + position - fragment.start,), (stop - position,), position))
            continue
        while position < stop:
            row, column = divmod(position, columns)
            rows = 1 if column or stop - position < columns else (stop - position) // columns
            width = min(columns - column, stop - position) if rows == 1 else columns
            boxes.append(((fragment.origin[0] + row - fragment.start, fragment.origin[1] + column), (rows, width), position))
            position += rows * width
    return boxes


def _check_order(files: DataFiles, view: Checkpoint, parts: list[_Part], placed: dict[str, list[Chunk]], rank: int,
                 where: str) -> None:
    """Prove the derived order on the save itself: the buckets' copy of each parameter (`param`,
    the float32 main parameters, which share the weights' storage) placed by it must hold the
    saved weight's bytes, each of the rank's weight chunks compared by its record's CRC-32 with
    the CRC-32 of the placed bytes (read once, in blocks; the weights are not read). Refused by
    name when it does not, or when a weight's CRC-32 is not known."""
    for part in parts:
        weight = view.tensors[f"{MODEL_SUBTREE}.{part.key}"]
        by_origin = {chunk.offsets: chunk for chunk in weight.chunks}
        for fragment in part.fragments:
            chunk = by_origin.get(fragment.origin)
            crc = _record_crc(files, weight, chunk) if chunk is not None else None
            if crc is None:
                raise UnsupportedFormat(f"{where}: {MODEL_SUBTREE}.{part.key}: the CRC-32 of its saved chunk at "
                                        f"{list(fragment.origin)} is not known, so the parameters' order in the "
                                        "distributed optimizer's buckets cannot be checked; not read")
            columns = math.prod(part.shape[1:])
            low, high = fragment.start * columns, fragment.stop * columns
            boxes = [c for c in placed[part.key] if _within(c, fragment, part.shape)]
            found = 0
            for box in sorted(boxes, key=lambda c: c.offsets):
                assert box.blob is not None
                for start in range(0, box.blob.length, READ_BLOCK):
                    found = zlib.crc32(files.read(box.blob.file, box.blob.offset + start,
                                                  min(READ_BLOCK, box.blob.length - start)), found)
            if found != crc or sum(box.numel for box in boxes) != high - low:
                raise UnsupportedFormat(f"{where}: dp_group_idx_{rank}: the buckets' copy of {part.key} (tensor rank "
                                        f"{rank}'s part at {list(fragment.origin)}) is not the saved weight: the "
                                        "parameters are not in the buckets in GPTModel's module order, as this build "
                                        "derives it; save with --dist-ckpt-optim-fully-reshardable to migrate it")


def _within(chunk: Chunk, fragment: _Fragment, shape: tuple[int, ...]) -> bool:
    """True when `chunk` (a box of the global tensor) lies in `fragment`'s rows."""
    rows = fragment.stop - fragment.start
    return fragment.origin[0] <= chunk.offsets[0] < fragment.origin[0] + rows and (
        len(shape) == 1 or fragment.origin[1] <= chunk.offsets[1] < fragment.origin[1] + shape[1])


def _record_crc(files: DataFiles, tensor: Tensor, chunk: Chunk) -> int | None:
    """The CRC-32 of a chunk's stored bytes, from its record (never its data), or None."""
    blob = chunk.blob if chunk.blob is not None and is_raw_range(chunk.blob) else _raw_range(files, tensor, chunk)
    name, _, crc = blob.transforms[0].partition("/") if blob is not None else ("", "", "")
    return int(crc, 16) if crc else None


def _groups(saved: list[Any], where: str) -> tuple[list[dict[str, Any]], float]:
    """The param groups every model-parallel rank saved (equal but for their params) and their
    common step; UnsupportedFormat for groups other than Megatron-LM's standard two."""
    groups = []
    for index, state in enumerate(saved):
        if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) or not all(
                isinstance(group, dict) for group in state["param_groups"]):
            raise CorruptMetadata(f"{where}: {ENTRY.format(index=index, name='optimizer')}: no param_groups")
        groups.append([{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]])
    if any(other != groups[0] for other in groups[1:]):
        raise CorruptMetadata(f"{where}: the model-parallel ranks' optimizer param groups differ, which Megatron-LM "
                              "makes the same on every rank")
    seen = set()
    for number, group in enumerate(groups[0]):
        odd = [f"{key}={group.get(key)!r:.20}" for key, value in STANDARD_GROUP if group.get(key, value) != value]
        if group.get(WD_MULT) not in (0.0, 1.0) or group.get(WD_MULT) in seen or odd:
            raise UnsupportedFormat(f"{where}: optimizer param group {number} ({', '.join(odd) or WD_MULT}) is not one "
                                    "of Megatron-LM's standard groups (weight decay on or off), so which parameters "
                                    "it holds cannot be told from the save")
        seen.add(group.get(WD_MULT))
    steps = {group.get(STEP) for group in groups[0]}
    step = next(iter(steps), None)
    if len(steps) != 1 or not isinstance(step, (int, float)) or isinstance(step, bool):
        raise UnsupportedFormat(f"{where}: optimizer param groups' `step` {sorted(map(repr, steps))[:2]}: not the one "
                                "common Adam step of torch's Adam/AdamW (apex's or Transformer Engine's optimizer?)")
    return groups[0], float(step)


__all__ = ["read_bucket_optimizer"]
