"""Megatron-Core `torch_dist` checkpoints as the model's own tensors.

`megatron.core.dist_checkpointing.save(sharded_state_dict, dir)` with the `torch_dist` backend
writes a torch DCP directory (`.metadata`, `__R_T.distcp`) plus `common.pt` and `metadata.json`.
Its DCP keys are Megatron's ShardedTensor keys (strategies/torch.py
`_replace_state_dict_keys_with_sharded_keys`), not the state dict's: a model with homogeneous
layers saves each `decoder.layers.{i}.<rest>` as one tensor `decoder.layers.<rest>` with a layer
axis prepended (transformer/transformer_block.py `sharded_state_dict`: offset `(0, i, num_layers)`,
`prepend_axis_num=1`), and every layer's tensor-parallel part is its own chunk of size 1 along
that axis. Non-tensor state (`_extra_state`, RNG state) is saved as `<key>/shard_<offset>_<shape>`
byte entries; optimizer state (Megatron-LM) as `optimizer.state.<name>.<key>`.

`model_view` takes the layer axis apart: each chunk of a stacked tensor becomes a chunk of the
layer its dim-0 offset names, pointing at the same stored bytes (the layer axis has size 1 in
every chunk Megatron writes, so they are the same row-major bytes; a chunk of several layers,
as reshard writes, is cut into its layers' consecutive byte ranges). Each such chunk's torch.save record is read
(its data.pkl, never the tensor bytes) and checked to hold that chunk, dtype and shape `(1, ...)`;
the chunk then refers to the record's storage bytes as a raw range with the record's CRC-32
(`dcp.blobs.RAW_RANGE_TRANSFORM`), since the record's own shape keeps the layer axis. A tensor
is kept stacked, as saved, unless each chunk is one layer, each layer's chunks add up to the
layer, and each record reads as a plain one: a damaged one is then named by the integrity gate
(beyond-eof, blob-overlap, overlap, ...) exactly as for any DCP checkpoint. The model tensors are placed under a
`model` subtree (as Megatron-LM nests them: `state_dict["model"]`), so consolidate writes them
under `decoder.layers.0.self_attention.linear_qkv.weight` etc. and leaves byte entries and
optimizer state out. Names are the checkpoint's: with the local layer spec the layer norms are
saved under Transformer-Engine's names (`self_attention.linear_qkv.layer_norm_weight` for
`input_layernorm.weight`, gpt_layer_specs.py `sharded_state_dict_keys_map`), kept as they are.

Example:
    >>> view = model_view(read_checkpoint("checkpoints/iter_0000002"))
    >>> view.tensors["model.decoder.layers.1.self_attention.linear_qkv.weight"].shape
    (48, 16)
"""

from __future__ import annotations

import dataclasses
import math
import re

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms
from ckpttool.dcp.blobs import DataFiles, read_tensor_record
from ckpttool.core.errors import CheckpointError, CorruptMetadata
from ckpttool.model.model_view import OPTIMIZER_KEYS, TRAINING_STATE_KEYS

LAYERS = "layers"  # TransformerBlock: f'{prefix}layers.'
MODEL_SUBTREE = "model"  # Megatron-LM's generate_state_dict: state_dict['model']
_NUMBER = re.compile(r"(\d+)")


def stacked_split(fqn: str) -> tuple[str, str] | None:
    """Return (`...layers.`, rest) when `fqn` names a layer-stacked tensor, else None.

    Example:
        >>> stacked_split("decoder.layers.mlp.linear_fc1.weight")
        ('decoder.layers.', 'mlp.linear_fc1.weight')
        >>> stacked_split("decoder.layers.0.mlp.linear_fc1.weight") is None
        True
    """
    parts = fqn.split(".")
    for at, part in enumerate(parts[:-1]):
        if part == LAYERS:
            if parts[at + 1].isdigit():
                return None
            return ".".join(parts[:at + 1]) + ".", ".".join(parts[at + 1:])
    return None


def unstack(tensor: Tensor, prefix: str, rest: str, files: DataFiles) -> list[Tensor] | None:
    """Return one Tensor per layer of a stacked tensor, its chunks as raw ranges of the stored
    records, or None to keep it as saved (see the module docstring). A chunk spanning several
    layers (a reshard's dim-0 slab) gives each layer its own contiguous part of the record."""
    stored = [chunk for chunk in tensor.chunks if chunk.numel]  # a reshard's empty slabs hold nothing
    if not tensor.shape or any(chunk.blob is None or chunk.blob.transforms
                               or not 0 <= chunk.offsets[0] <= tensor.shape[0] - chunk.sizes[0] for chunk in stored):
        return None
    layers: list[list[tuple[Chunk, int]]] = [[] for _ in range(tensor.shape[0])]
    for chunk in stored:
        for layer in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]):
            layers[layer].append((chunk, layer - chunk.offsets[0]))
    layer_numel = math.prod(tensor.shape[1:])
    if any(sum(math.prod(chunk.sizes[1:]) for chunk, _ in pieces) != layer_numel for pieces in layers):
        return None
    records: dict[int, Blob | None] = {}
    parts = []
    for layer, pieces in enumerate(layers):
        chunks = []
        for chunk, index in pieces:
            whole = records[id(chunk)] if id(chunk) in records else records.setdefault(id(chunk), _raw_range(files, tensor, chunk))
            if whole is None:
                return None
            step = whole.length // chunk.sizes[0]
            blob = whole if chunk.sizes[0] == 1 else Blob(whole.file, whole.offset + index * step, step, raw_range_transforms())
            chunks.append(Chunk(chunk.offsets[1:], chunk.sizes[1:], blob))
        parts.append(Tensor(f"{prefix}{layer}.{rest}", tensor.dtype, tensor.shape[1:], tuple(sorted(chunks))))
    return parts


def _raw_range(files: DataFiles, tensor: Tensor, chunk: Chunk) -> Blob | None:
    """Return the stored bytes of `chunk` as a raw-range blob, or None unless its record is a
    plain one holding exactly that chunk."""
    blob = chunk.blob
    assert blob is not None  # unstack keeps tensors whose stored chunks all have a blob
    where = f"{files.path(blob.file)}: {tensor.fqn} chunk at {list(chunk.offsets)}"
    try:
        record = read_tensor_record(files, blob, where)
    except CheckpointError:  # missing, truncated, moved: the integrity gate says which
        return None
    if record.dtype != tensor.dtype or tuple(record.shape) != chunk.sizes or not record.is_plain:
        return None
    return Blob(blob.file, record.data_offset, record.data_length, raw_range_transforms(record.crc32))


def model_view(checkpoint: Checkpoint, follow_symlinks: bool = False) -> Checkpoint:
    """Return `checkpoint` with its model tensors one per layer, under the `model` subtree;
    byte entries and optimizer state as saved.

    Raises CorruptMetadata when a layer's name is also saved as its own entry.
    """
    tensors: dict[str, Tensor] = {}
    nesting: dict[str, tuple[str, str]] = {}
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        parts = {fqn: _split(tensor, files) for fqn, tensor in checkpoint.tensors.items()
                 if fqn.split(".", 1)[0] not in (*OPTIMIZER_KEYS, *TRAINING_STATE_KEYS)}
    for fqn, tensor in checkpoint.tensors.items():
        if fqn not in parts:
            tensors[fqn] = tensor
            continue
        for part in parts[fqn]:
            name = f"{MODEL_SUBTREE}.{part.fqn}"
            if name in tensors or name in checkpoint.tensors:
                raise CorruptMetadata(f"{checkpoint.path}: {fqn} gives {part.fqn}, which another entry gives too")
            tensors[name] = dataclasses.replace(part, fqn=name)
            nesting[name] = (MODEL_SUBTREE, part.fqn)
    order = sorted(nesting, key=_natural)
    return dataclasses.replace(checkpoint, tensors=dict(sorted(tensors.items())),
                               nesting={name: nesting[name] for name in order}, model_prefix=MODEL_SUBTREE)


def _split(tensor: Tensor, files: DataFiles) -> list[Tensor]:
    split = stacked_split(tensor.fqn)
    return (unstack(tensor, *split, files) if split else None) or [tensor]


def _natural(name: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(piece) if piece.isdigit() else piece for piece in _NUMBER.split(name)]
