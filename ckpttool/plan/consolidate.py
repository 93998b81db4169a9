"""The consolidate plan: which source bytes go where in one full state dict, as pure data.

Planning reads nothing. `select` picks the output keys from the metadata; the command then
locates the chosen chunks' raw bytes (`locating.locate_chunks`), finds tied pairs and decodes
python objects (IO), and `plan_consolidate` turns all of that into output files (safetensors
headers or a .pt zip layout) and the operations that fill them (`plan.operations`).

Example:
    >>> selection = select(checkpoint, find_model(checkpoint), KeyRules(), OutputFormat("safetensors", False, None))
    >>> plan = plan_consolidate(checkpoint, selection, located, name="m.safetensors", kind=...)
    >>> plan.tensors[0].operations[0]
    Copy(src='__0_0.distcp', src_offset=1216, dst='m.safetensors', dst_offset=96, length=208, crc32=...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Checkpoint, ChunkTable, Tensor
from ckpttool.dcp.blobs import RawData
from ckpttool.core.errors import KeyCollision, UsageError
from ckpttool.formats import fp8, hub, safetensors
from ckpttool.model.keys import KeyRules, match_dtype, normalise, output_keys
from ckpttool.core.geometry import row_major_runs, slab_rows, slab_runs
from ckpttool.model.model_view import ModelView
from ckpttool.plan import unique_chunks
from ckpttool.plan.operations import (BAND_BYTES, CONVERT_BLOCK, DEQUANTIZE_ELEMENTS, GATHER_PART, Band, Convert, Copy,
                                      Dequantize, Gather, Operation, Quantize, Rows)
from ckpttool.model.quantization import QuantizedWeight
from ckpttool.torchsave import ptfile


@dataclass(frozen=True)
class OutputFormat:
    """What OUT asks for: `safetensors` (one file, or `sharded` into a Hub directory) or `torch`."""

    kind: str  # "safetensors" | "torch"
    sharded: bool
    max_shard_size: int | None


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: where it goes and the operations that fill it."""

    key: str
    fqn: str
    path: tuple  # nested keys in a .pt (the key itself, or DCP's planner_data with --all)
    source_dtype: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # output file name, relative to the output
    offset: int  # absolute byte offset of its data in `file`
    operations: tuple[Operation, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class OutputFile:
    """One output file: its name, total size, and the bytes written at offset 0 (a
    safetensors header); a .pt's zip records are made after the data (they carry CRCs)."""

    name: str
    size: int
    head: bytes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class OutputObject:
    """A python value (param_groups, step, ...) that goes into a .pt as it was saved."""

    key: str
    fqn: str
    path: tuple


@dataclass(frozen=True)
class Tie:
    """Two keys that hold the same tensor (same dtype, shape and bytes), e.g. a tied
    embedding and lm_head; `dropped` is left out with --drop-tied."""

    kept: str
    dropped: str


@dataclass(frozen=True)
class Selection:
    """The output keys chosen from a checkpoint: key -> fqn for tensors and for objects, and
    each key's place in the output (a nested path for --all to .pt)."""

    tensors: dict[str, str]
    objects: dict[str, str]
    paths: dict[str, tuple]


@dataclass(frozen=True)
class ConsolidatePlan:
    """Everything consolidate will write, computed before writing a byte."""

    source: str
    format: str  # "safetensors" or "torch"
    files: tuple[OutputFile, ...]
    tensors: tuple[OutputTensor, ...]
    objects: tuple[OutputObject, ...] = ()
    index_name: str | None = None  # model.safetensors.index.json when sharded
    index: bytes | None = None
    ties: tuple[Tie, ...] = ()
    dropped: tuple[str, ...] = ()
    zip_layouts: dict = field(default_factory=dict)  # .pt: file name -> torchsave.ptfile.PtLayout

    @property
    def output_bytes(self) -> int:
        return sum(f.size for f in self.files) + (len(self.index) if self.index else 0)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def operations(self) -> list[Operation]:
        return [op for tensor in self.tensors for op in tensor.operations]


def select(checkpoint: Checkpoint, view: ModelView, rules: KeyRules, kind: OutputFormat) -> Selection:
    """Return the output keys for `rules` (the model entries of `view`, or all), in the order
    the state dict was saved.

    planner_data keeps `model.state_dict()` order, so shards group tensors as save_pretrained
    would; entries it does not name come after, sorted. Raises UsageError when nothing is
    selected or python objects would go into safetensors.
    """
    source = str(checkpoint.path)
    if not rules.everything:
        view.require()
    chosen = output_keys(list(checkpoint.tensors) + list(checkpoint.objects), rules, view.keys)
    saved_order = {fqn: position for position, fqn in enumerate(checkpoint.nesting)}
    chosen = dict(sorted(chosen.items(), key=lambda item: (saved_order.get(item[1], len(saved_order)), item[0])))
    tensors = {key: fqn for key, fqn in chosen.items() if fqn in checkpoint.tensors}
    objects = {key: fqn for key, fqn in chosen.items() if fqn in checkpoint.objects}
    if not tensors and not objects:
        if rules.filters:
            what = "--filter matched nothing"
        elif view.prefix is None:
            what = f"no model found ({view.reason}); name its subtree with --model-prefix, or pass --all"
        else:
            what = f"the model subtree {view.prefix or '(the top level)'!s} holds no entries; check --model-prefix"
        raise UsageError(f"{source}: nothing to export: {what}")
    if objects and kind.kind == "safetensors":
        names = ", ".join(sorted(objects)[:4]) + (", ..." if len(objects) > 4 else "")
        raise UsageError(
            f"{source}: {len(objects)} selected entries are python objects, not tensors ({names}); "
            "safetensors holds tensors only: write a .pt file, or leave them out with --filter"
        )
    return Selection(tensors, objects, _paths(checkpoint, chosen, rules, kind))


def _paths(checkpoint: Checkpoint, chosen: dict[str, str], rules: KeyRules, kind: OutputFormat) -> dict[str, tuple]:
    """Return each key's place in the output: flat `(key,)`, or with --all to .pt the nested
    path torch saved (planner_data), wrapper names normalised in each part."""
    if not (rules.everything and kind.kind == "torch"):
        return {key: (key,) for key in chosen}
    if rules.renames:
        raise UsageError("--rename applies to flat keys; with --all a .pt keeps the nested structure as saved")
    paths: dict[str, tuple] = {}
    seen: dict[tuple, str] = {}
    for key, fqn in chosen.items():
        path = checkpoint.nesting.get(fqn) or tuple(fqn.split("."))
        if rules.normalise:
            path = tuple(normalise(part) if isinstance(part, str) else part for part in path)
        if path in seen:
            raise KeyCollision(f"{seen[path]} and {fqn} both become {path!r}; pass --keep-keys")
        seen[path] = fqn
        paths[key] = path
    return paths


def plan_consolidate(checkpoint: Checkpoint, selection: Selection, located: Mapping[str, Mapping[int, RawData | None]],
                     *, name: str, kind: OutputFormat, dtype: str | None = None,
                     dtype_map: tuple[tuple[str, str], ...] = (), ties: tuple[Tie, ...] = (), drop_tied: bool = False,
                     objects: Mapping[str, Any] | None = None,
                     quantized: Mapping[str, QuantizedWeight] | None = None,
                     quantize: Mapping[str, tuple[int, int]] | None = None) -> ConsolidatePlan:
    """Return the plan that writes `selection` as one state dict named `name` (pure: reads
    nothing). `located` says where each chunk's raw bytes are (None: decode), `objects` holds
    the decoded python values of the selected objects (for a .pt). `quantized` names the keys
    written dequantised (key -> its quantised weight, whose codes the selection names): each
    is written in its key's dtype (`dtype` or `dtype_map`), which must be given. `quantize`
    names the keys written as fine-grained FP8 (key -> block): float8 codes under the key,
    float32 `<key>_scale_inv` right after it."""
    dropped = tuple(sorted(t.dropped for t in ties)) if drop_tied else ()
    quantized = quantized or {}
    tensor_keys = {key: fqn for key, fqn in selection.tensors.items() if key not in dropped}
    source_tensors = {key: checkpoint.tensors[fqn] for key, fqn in tensor_keys.items()}
    wanted = {key: target_dtype(t.dtype, match_dtype(key, dtype_map, dtype)) for key, t in source_tensors.items()}
    shapes = {key: t.shape for key, t in source_tensors.items()}
    for key, weight in quantized.items():
        cast = match_dtype(key, dtype_map, dtype)
        if cast is None:
            raise UsageError(f"{checkpoint.path}: {weight.codes}: dequantising needs a dtype for {key} "
                             "(--dtype bf16|fp16|fp32, or a --dtype-map glob that matches it)")
        wanted[key], shapes[key] = cast, weight.shape
    paths = dict(selection.paths)
    scale_of: dict[str, str] = {}  # --quantize: scale key -> its weight's key
    if quantize:
        tensor_keys, source_tensors = _with_scale_keys(tensor_keys, source_tensors, quantize, scale_of, checkpoint)
        for key, block in quantize.items():
            scale_key = key + fp8.BLOCK_SCALE
            wanted[key], wanted[scale_key] = fp8.FLOAT8[0], "float32"
            shapes[scale_key] = fp8.scale_shape(shapes[key], block)
            paths[scale_key] = (*paths[key][:-1], f"{paths[key][-1]}{fp8.BLOCK_SCALE}")
    sizes = {key: dtypes.ITEMSIZE[wanted[key]] * math.prod(shapes[key]) for key in source_tensors}

    output_files: list[OutputFile] = []
    offsets: dict[str, tuple[str, int]] = {}
    index_name = index = None
    zip_layouts: dict = {}
    if kind.kind == "safetensors":
        groups = {name: tuple(tensor_keys)}
        if kind.sharded:
            assert kind.max_shard_size is not None  # commands.consolidate.output_format gives every sharded output one
            split = hub.plan_shards(sizes, kind.max_shard_size)
            groups, index_name, index = split.files, split.index_name, split.index
        for file_name, keys in groups.items():
            layout = safetensors.layout_file([(k, wanted[k], shapes[k]) for k in keys])
            output_files.append(OutputFile(file_name, layout.size, layout.header, tuple(keys)))
            offsets.update({k: (file_name, layout.offsets[k]) for k in keys})
    else:
        values = objects or {}
        pickled = ptfile.pickle_state(
            [(paths[k], wanted[k], shapes[k]) for k in tensor_keys],
            [(selection.paths[k], values[k]) for k in selection.objects],
        )
        pt_layout = ptfile.lay_out(pickled, [sizes[k] for k in tensor_keys])
        output_files.append(OutputFile(name, pt_layout.size, b"", tuple(tensor_keys)))
        offsets = {k: (name, pt_layout.data_offsets[i]) for i, k in enumerate(tensor_keys)}
        zip_layouts[name] = pt_layout

    tensors = []
    for key, tensor in source_tensors.items():
        file_name, offset = offsets[key]
        if key in quantized:
            weight = quantized[key]
            scale = checkpoint.tensors[weight.scale]
            operations = plan_dequantize(weight, tensor, located[tensor.fqn], scale, located[scale.fqn], wanted[key],
                                         file_name, offset)
        elif quantize and (key in quantize or key in scale_of):
            weight_key = scale_of.get(key, key)
            operations = plan_quantize(weight_key, "scales" if key in scale_of else "codes", quantize[weight_key],
                                       tensor, located[tensor.fqn], file_name, offset)
        else:
            operations = plan_tensor(tensor, located[tensor.fqn], wanted[key], file_name, offset)
        tensors.append(OutputTensor(key, tensor.fqn, paths[key], tensor.dtype, wanted[key], shapes[key],
                                    file_name, offset, operations))
    output_objects = tuple(OutputObject(key, fqn, selection.paths[key]) for key, fqn in selection.objects.items())
    return ConsolidatePlan(
        source=str(checkpoint.path), format=kind.kind, files=tuple(output_files), tensors=tuple(tensors),
        objects=output_objects, index_name=index_name, index=index, ties=tuple(ties), dropped=dropped,
        zip_layouts=zip_layouts,
    )


def plan_tensor(tensor: Tensor, located: Mapping[int, RawData | None], dtype: str, file: str,
                offset: int) -> tuple[Operation, ...]:
    """Return the operations that write `tensor`, cast to `dtype`, at `offset` of `file`.

    `located` holds each distinct chunk's raw bytes (None: its blob must be decoded); a
    chunk that is one contiguous run of the output is copied (or converted) as it is, any
    other is gathered in memory and written row by row, or, when every chunk is raw bytes
    cut into short row pieces (a weight split on dim 1), in bands of whole rows (`bands`).
    """
    itemsize = dtypes.ITEMSIZE[dtype]
    source_itemsize = dtypes.ITEMSIZE[tensor.dtype]
    indices = unique_chunks(tensor)
    operations: list[Operation] = []
    for index, runs in zip(indices, _chunk_runs(tensor, indices, itemsize)):
        raw = located[index]
        if raw is not None and len(runs) == 1:
            (start, length), = runs
            if dtype == tensor.dtype:
                operations.append(Copy(raw.file, raw.offset, file, offset + start, length, raw.crc32))
                continue
            step = CONVERT_BLOCK - CONVERT_BLOCK % source_itemsize
            for done in range(0, raw.length, step):
                part = min(step, raw.length - done)
                operations.append(Convert(
                    raw.file, raw.offset + done, part, tensor.dtype, dtype,
                    file, offset + start + done // source_itemsize * itemsize,
                ))
            continue
        pieces, at = [], 0
        for start, length in runs:
            pieces.append((at, offset + start, length))
            at += length
        operations.append(Gather(tensor, index, raw, dtype, file, tuple(pieces)))
    gathers = [op for op in operations if type(op) is Gather]
    if len(gathers) > 1 and len(gathers) == len(operations):
        return tuple(bands(gathers, math.prod(tensor.shape[1:]) * itemsize, offset))
    return tuple(operations)


def bands(gathers: list[Gather], row: int, offset: int, size: int = BAND_BYTES) -> list[Operation]:
    """Return `gathers` (all the chunks of one tensor written at `offset`, `row` output bytes
    a row) as Bands of whole rows, about `size` output bytes each, when every chunk is raw
    bytes written as row pieces shorter than GATHER_PART on average; else `gathers` as they are.

    A band reads, of each chunk, only the raw bytes of its rows in the band: the pieces of a
    chunk lie in the output in the order of its bytes, so those are one run of them.

    Example (a [4, 8] float32 weight cut on dim 1 into two [4, 4] chunks):
        >>> [(op.offset, op.length, [p.source.length for p in op.parts]) for op in bands(gathers, 32, 0, 64)]
        [(0, 64, [32, 32]), (64, 64, [32, 32])]
    """
    pieces = [piece for op in gathers for piece in op.pieces]
    if (row <= 0 or any(op.source is None for op in gathers)
            or sum(length for _, _, length in pieces) >= GATHER_PART * len(pieces)):
        return list(gathers)
    rows = max(1, size // row)
    end = offset + sum(length for _, _, length in pieces)
    out: list[Operation] = []
    for start in range(offset, end, rows * row):
        stop = min(end, start + rows * row)
        parts = []
        for op in gathers:
            inside = [piece for piece in op.pieces if start <= piece[1] < stop]
            if not inside:
                continue
            if any(at + length > stop for _, at, length in inside):
                return list(gathers)  # a piece crosses rows: keep the chunks whole
            assert op.source is not None
            first, last = inside[0][0], inside[-1][0] + inside[-1][2]
            out_item, src_item = dtypes.ITEMSIZE[op.dtype], op.tensor.itemsize
            source = RawData(op.source.file, op.source.offset + first // out_item * src_item,
                             (last - first) // out_item * src_item)
            parts.append(Gather(op.tensor, op.chunk, source, op.dtype, op.dst,
                                tuple((at_chunk - first, at, length) for at_chunk, at, length in inside)))
        if sum(length for part in parts for _, _, length in part.pieces) != stop - start:
            return list(gathers)  # the chunks do not tile these rows: keep them whole
        out.append(Band(gathers[0].dst, start, stop - start, tuple(parts)))
    return out


def plan_dequantize(weight: QuantizedWeight, codes: Tensor, codes_located: Mapping[int, RawData | None], scale: Tensor,
                    scale_located: Mapping[int, RawData | None], dtype: str, file: str,
                    offset: int) -> tuple[Operation, ...]:
    """Return the operations that write `weight` dequantised to `dtype` at `offset` of `file`:
    about DEQUANTIZE_ELEMENTS output elements each, FP8 in whole blocks of rows (a 2-D
    weight) or whole matrices (grouped experts), MXFP4 in whole experts."""
    shape = weight.shape
    row_elements = math.prod(shape[1:])
    step = max(1, DEQUANTIZE_ELEMENTS // max(1, row_elements))
    blocked = weight.layout == fp8.BLOCK and len(shape) == 2
    if blocked:
        step = max(1, step // weight.block[0]) * weight.block[0]
    itemsize = dtypes.ITEMSIZE[dtype]
    operations: list[Operation] = []
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        if weight.layout == fp8.TENSOR or not scale.shape:
            scale_rows = (0, scale.shape[0] if scale.shape else 1)
        elif blocked:
            scale_rows = (start // weight.block[0], -(-stop // weight.block[0]))
        else:
            scale_rows = (start, stop)
        operations.append(Dequantize(
            weight.name, weight.layout, weight.block, _rows(codes, codes_located, start, stop),
            _rows(scale, scale_located, *scale_rows), shape, dtype, file, offset + start * row_elements * itemsize,
        ))
    return tuple(operations)


def _with_scale_keys(tensor_keys: dict[str, str], source_tensors: dict[str, Tensor], quantize: Mapping[str, Any],
                     scale_of: dict[str, str], checkpoint: Checkpoint) -> tuple[dict[str, str], dict[str, Tensor]]:
    """Return the keys and source tensors with each quantised weight's scale key right after it."""
    keys: dict[str, str] = {}
    sources: dict[str, Tensor] = {}
    for key, fqn in tensor_keys.items():
        keys[key], sources[key] = fqn, source_tensors[key]
        if key in quantize:
            scale_key = key + fp8.BLOCK_SCALE
            if scale_key in tensor_keys:
                raise KeyCollision(f"{checkpoint.path}: {key} is quantised, but {scale_key} is already a key")
            keys[scale_key], sources[scale_key] = fqn, source_tensors[key]
            scale_of[scale_key] = key
    return keys, sources


def plan_quantize(key: str, part: str, block: tuple[int, int], tensor: Tensor, located: Mapping[int, RawData | None],
                  file: str, offset: int) -> tuple[Operation, ...]:
    """Return the operations that write `part` ("codes" or "scales") of `tensor` [rows, cols]
    quantised to fine-grained FP8 in `block`s at `offset` of `file`, whole blocks of rows at a
    time."""
    rows, cols = tensor.shape
    step = max(1, DEQUANTIZE_ELEMENTS // max(1, block[0] * cols)) * block[0]
    scale_row = -(-cols // block[1]) * 4
    operations: list[Operation] = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        at = offset + (start * cols if part == "codes" else start // block[0] * scale_row)
        operations.append(Quantize(key, part, block, _rows(tensor, located, start, stop), file, at))
    return tuple(operations)


def quantizable(key: str, tensor: Tensor) -> bool:
    """True for a weight `--quantize fp8` writes as FP8: a 2-D bf16/fp16/fp32 `*.weight` of a
    projection (`*_proj`, `kv_a_proj_with_mqa`: the nn.Linear layers transformers' FP8
    integration replaces); embeddings, norms, routers and lm_head stay as they are."""
    if len(tensor.shape) != 2 or tensor.dtype not in ("bfloat16", "float16", "float32") or not key.endswith(".weight"):
        return False
    module = key[: -len(".weight")].rsplit(".", 1)[-1]
    return "proj" in module


def _rows(tensor: Tensor, located: Mapping[int, RawData | None], start: int, stop: int) -> Rows:
    """Return rows [start, stop) of `tensor` with its distinct chunks that hold part of them."""
    chunks = tensor.chunks
    if not tensor.shape:
        return Rows(tensor, tuple((index, located[index]) for index in unique_chunks(tensor)), 0, 1)
    crossing = tuple((index, located[index]) for index in unique_chunks(tensor)
                     if chunks[index].offsets[0] < stop and chunks[index].offsets[0] + chunks[index].sizes[0] > start)
    return Rows(tensor, crossing, start, stop)


def _chunk_runs(tensor: Tensor, indices: list[int], itemsize: int) -> list[list[tuple[int, int]]]:
    """Return where each chunk of `indices` lies in the row-major output (`row_major_runs`),
    from the columns when the chunks are a table of dim-0 slabs (FSDP's)."""
    chunks = tensor.chunks
    if isinstance(chunks, ChunkTable) and indices:
        runs = slab_runs(tensor.shape, chunks.offsets[indices], chunks.sizes[indices], itemsize)
        if runs is not None:
            return runs
    whole = ((0,) * len(tensor.shape), tensor.shape)
    row = math.prod(tensor.shape[1:]) * itemsize
    runs = []
    for index in indices:  # a converted view (naming) has a chunk per row: slabs skip the general walk
        box = (chunks[index].offsets, chunks[index].sizes)
        slab = slab_rows(tensor.shape, box)
        if slab is None:
            runs.append(row_major_runs(whole, box, itemsize))
        else:
            runs.append([(slab[0] * row, slab[1] * row)] if slab[1] * row else [])
    return runs


def target_dtype(source_dtype: str, wanted: str | None) -> str:
    """Return the output dtype: `wanted` for floating tensors, the source dtype otherwise
    (integer and bool tensors are never cast)."""
    if wanted is None or source_dtype not in dtypes.FLOATING:
        return source_dtype
    return wanted
