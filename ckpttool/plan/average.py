"""The average plan: which byte ranges of each source make up each block of the output (pure data).

`average` reads k checkpoints of one model, whatever their layouts and world sizes, and writes
the weighted average of their model tensors. Each source is planned as consolidate plans it
(`commands.consolidate.plan_output`: its model found, its chunks located); the operations of
that plan say which source bytes hold which bytes of each row-major tensor, and `source_map`
keeps exactly that, per tensor, as `Segment`s. The output is laid out once, by the first
source's consolidate plan (safetensors headers, a .pt's zip layout, Hub shards) or by
reshard's plan of a stand-in checkpoint whose tensors are whole (`averaged_checkpoint`:
DCP for N ranks). Every tensor of the output is then cut into `Average` blocks of at most
`block_elements` elements: a block names, for each source in order, the byte ranges (`RawData`,
or a part of a chunk that must be decoded: `Decoded`) that hold its elements. A DCP record
becomes an `AverageRecord`: its head, its data as blocks, its tail with the data's CRC-32.

Nothing here reads a file. `run.average` computes and writes the blocks.

Example:
    >>> maps = [{key: source_map(t.offset, t.operations) for t in plan.tensors} for plan in plans]
    >>> plan = plan_average(plans[0], maps, weights_for(2, None), block_elements=1 << 20)
    >>> plan.operations[0].reads[1]
    (RawData(file='__1_0.distcp', offset=1216, length=208, crc32=None),)
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms
from ckpttool.core.errors import InvalidCheckpoint, UnsupportedFormat, UsageError
from ckpttool.dcp.blobs import RawData
from ckpttool.plan.consolidate import ConsolidatePlan
from ckpttool.plan.operations import Band, Copy, Gather, Operation, Record, Records
from ckpttool.plan.rank_files import ReshardWrites
from ckpttool.plan.reshard import ReshardPlan

# dtypes averaged in float64 (the rest must be equal across the sources and are copied)
AVERAGED = ("float64", "float32", "float16", "bfloat16")
COPIED = frozenset({"int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"})
BLOCK_ELEMENTS = 1 << 20  # output elements per block: 24 MiB of working memory for fp32
# bytes of working memory per element of a block: the source bytes read, the float64 sum and
# the float64 product of one source, a float32 copy (bf16 and fp16 go through float32), the
# output bytes
WORKING_BYTES = 8 + 8 + 8 + 4 + 8
# the stand-in data file of the averaged tensors, laid end to end, when the output is DCP:
# reshard's planner lays the rank files out from it; it never exists on disk
AVERAGED_FILE = "<averaged>"
DCP_PREFIX = "model."  # as `import` writes: dcp.load({"model": model.state_dict()}) reads it


@dataclass(frozen=True)
class Decoded:
    """Bytes [start, start + length) of chunk `chunk` of `tensor`, whose blob must be decoded
    (zstd, strided): the chunk is decoded whole and this part taken."""

    tensor: Tensor
    chunk: int
    start: int
    length: int


Piece = RawData | Decoded  # a run of a source tensor's row-major bytes


@dataclass(frozen=True)
class Segment:
    """Bytes [at, at + piece.length) of a tensor's row-major bytes are `piece`."""

    at: int
    piece: Piece


@dataclass(frozen=True)
class SourceMap:
    """Where one source holds each byte of one tensor: `Segment`s in tensor order, tiling it."""

    segments: tuple[Segment, ...]
    starts: tuple[int, ...]  # each segment's `at`, for bisect


@dataclass(frozen=True)
class Average:
    """Elements [start, start + count) of tensor `key` (row-major), averaged from the sources
    (`reads[i]`: the pieces of source i that hold them, in order) and written as `dtype` at
    `dst_offset` of output file `dst`. An integer or bool tensor is compared and copied."""

    key: str
    dtype: str
    start: int
    count: int
    reads: tuple[tuple[Piece, ...], ...]
    dst: str
    dst_offset: int

    @property
    def averaged(self) -> bool:
        return self.dtype in AVERAGED

    @property
    def output_length(self) -> int:
        return self.count * dtypes.ITEMSIZE[self.dtype]

    @property
    def memory(self) -> int:
        decoded = max((sum(p.tensor.chunks[p.chunk].numel * p.tensor.itemsize for p in pieces if isinstance(p, Decoded))
                       for pieces in self.reads), default=0)
        return self.count * (WORKING_BYTES if self.averaged else 2 * dtypes.ITEMSIZE[self.dtype]) + decoded


@dataclass(frozen=True)
class AverageRecord:
    """A torch.save record of a DCP rank file: its head at `offset`, its data written by
    `parts` (in data order, end to end), then its tail holding the data's CRC-32."""

    dst: str
    offset: int
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Average, ...]

    @property
    def output_length(self) -> int:
        return sum(part.output_length for part in self.parts)

    @property
    def memory(self) -> int:
        return max((part.memory for part in self.parts), default=0)


AverageOperation = Average | AverageRecord


@dataclass(frozen=True)
class OutputTensor:
    """A tensor of the output: its key, dtype and shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class AveragePlan:
    """Everything average will write, computed before writing a byte: the output files
    (`files`: name, size), the operations that fill them, and the layout they come from
    (`consolidated` for a state dict, `writes` of `resharded` for DCP)."""

    sources: tuple[str, ...]
    weights: tuple[float, ...]
    format: str  # "safetensors" | "torch" | "dcp"
    tensors: tuple[OutputTensor, ...]
    files: tuple[tuple[str, int], ...]
    operations: tuple[AverageOperation, ...]
    consolidated: ConsolidatePlan | None = None
    resharded: ReshardPlan | None = None  # DCP output
    writes: ReshardWrites | None = None

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def averaged(self) -> int:
        """The number of tensors averaged (floating); the others are copied."""
        return sum(t.dtype in AVERAGED for t in self.tensors)


def weights_for(count: int, given: Sequence[float] | None) -> tuple[float, ...]:
    """Return the weights of `count` sources: `given` (one per source, finite), or `1.0 / count`
    each, computed in float64.

    Example:
        >>> weights_for(3, None)
        (0.3333333333333333, 0.3333333333333333, 0.3333333333333333)
    """
    if count < 2:
        raise UsageError(f"average needs at least two sources and OUT; got {count} source{'s' * (count != 1)}")
    if given is None:
        return (1.0 / count,) * count
    weights = tuple(float(w) for w in given)
    if len(weights) != count:
        raise UsageError(f"--weights gives {len(weights)} weights for {count} sources: give one per source, in order")
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"--weights {','.join(map(repr, weights))}: every weight must be a finite number")
    return weights


def parse_weights(text: str) -> tuple[float, ...]:
    """Return the floats of `--weights 0.5,0.25,0.25` (Python's float(): float64, as written)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--weights {text!r}: comma-separated numbers, one per source, e.g. 0.5,0.25,0.25") from None


def check_same_model(names: Sequence[str], models: Sequence[Mapping[str, Tensor]]) -> None:
    """Raise InvalidCheckpoint naming the first key, shape or dtype in which a source's model
    differs from the first source's (`models[i]`: key -> tensor, in output order), and
    UnsupportedFormat for a dtype average cannot compute (float8, complex)."""
    first = models[0]
    for name, model in zip(names[1:], models[1:]):
        missing = [key for key in first if key not in model]
        extra = [key for key in model if key not in first]
        if missing or extra:
            more = len(missing) + len(extra) - 1
            what = (f"{missing[0]} is in {names[0]} but not in {name}" if missing
                    else f"{extra[0]} is in {name} but not in {names[0]}")
            raise InvalidCheckpoint(f"the sources are not one model: {what}"
                                    f"{f' ({more} more keys differ)' if more else ''}; nothing was written",
                                    code="different-models")
        for key, tensor in first.items():
            other = model[key]
            if other.shape != tensor.shape or other.dtype != tensor.dtype:
                raise InvalidCheckpoint(f"the sources are not one model: {key} is {tensor.dtype} {list(tensor.shape)} in "
                                        f"{names[0]} but {other.dtype} {list(other.shape)} in {name}; nothing was written",
                                        code="different-models")
    for key, tensor in first.items():
        if tensor.dtype not in AVERAGED and tensor.dtype not in COPIED:
            raise UnsupportedFormat(f"{names[0]}: {key} is {tensor.dtype}: average computes in float64 from float64, "
                                    "float32, float16 and bfloat16 (dequantise float8 weights first: consolidate "
                                    "--dtype bf16); nothing was written")


def source_map(tensor_offset: int, operations: Sequence[Operation]) -> SourceMap:
    """Return where a source holds each byte of a tensor, from the operations consolidate
    planned to write it at `tensor_offset` of its output (Copy: a raw run; Gather: pieces of a
    chunk, raw or decoded; Band: the Gathers of its rows)."""
    segments: list[Segment] = []
    for op in [part for each in operations for part in (each.parts if isinstance(each, Band) else (each,))]:
        if isinstance(op, Copy):
            segments.append(Segment(op.dst_offset - tensor_offset, RawData(op.src, op.src_offset, op.length)))
        elif isinstance(op, Gather) and op.dtype == op.tensor.dtype:
            raw = op.source
            for start, at, length in op.pieces:
                piece: Piece = (RawData(raw.file, raw.offset + start, length) if raw is not None
                                else Decoded(op.tensor, op.chunk, start, length))
                segments.append(Segment(at - tensor_offset, piece))
        else:  # consolidate's plan without --dtype, --quantize or dequantising makes only those two
            raise UnsupportedFormat(f"average cannot read {type(op).__name__} operations (a cast or quantised source)")
    segments.sort(key=lambda segment: segment.at)
    return SourceMap(tuple(segments), tuple(segment.at for segment in segments))


def pieces(found: SourceMap, start: int, end: int) -> tuple[Piece, ...]:
    """Return the pieces that hold bytes [start, end) of the tensor `found` maps, in order."""
    out: list[Piece] = []
    index = max(0, bisect.bisect_right(found.starts, start) - 1)
    segments = found.segments
    while index < len(segments) and segments[index].at < end:
        segment = segments[index]
        piece = segment.piece
        low, high = max(start, segment.at), min(end, segment.at + piece.length)
        if high > low:
            skip, length = low - segment.at, high - low
            if isinstance(piece, RawData):
                out.append(RawData(piece.file, piece.offset + skip, length))
            else:
                out.append(Decoded(piece.tensor, piece.chunk, piece.start + skip, length))
        index += 1
    if sum(p.length for p in out) != end - start:  # consolidate's plan tiles every tensor: a bug if not
        raise AssertionError(f"bytes {start}..{end} of a tensor are not all mapped")
    return tuple(out)


def blocks(tensor: OutputTensor, maps: Sequence[SourceMap], start: int, count: int, dst: str, dst_offset: int,
           block_elements: int) -> list[Average]:
    """Return the `Average` blocks writing elements [start, start + count) of `tensor` at
    `dst_offset` of `dst`, each of at most `block_elements` elements."""
    itemsize = dtypes.ITEMSIZE[tensor.dtype]
    out = []
    for first in range(start, start + count, max(1, block_elements)):
        n = min(block_elements, start + count - first)
        reads = tuple(pieces(found, first * itemsize, (first + n) * itemsize) for found in maps)
        out.append(Average(tensor.key, tensor.dtype, first, n, reads, dst, dst_offset + (first - start) * itemsize))
    return out


def plan_average(sources: Sequence[str], weights: Sequence[float], template: ConsolidatePlan,
                 maps: Sequence[Mapping[str, SourceMap]], block_elements: int = BLOCK_ELEMENTS) -> AveragePlan:
    """Return the plan that writes the average into the files `template` lays out (the first
    source's consolidate plan: .safetensors, Hub shards or .pt); `maps[i][key]`: where source
    i holds tensor `key`."""
    operations: list[AverageOperation] = []
    tensors = []
    for placed in template.tensors:
        tensor = OutputTensor(placed.key, placed.dtype, placed.shape)
        tensors.append(tensor)
        numel = math.prod(placed.shape)
        if numel:
            operations.extend(blocks(tensor, [found[placed.key] for found in maps], 0, numel, placed.file, placed.offset,
                                     block_elements))
    files = tuple((f.name, f.size) for f in template.files)
    return AveragePlan(tuple(sources), tuple(weights), template.format, tuple(tensors), files, tuple(operations),
                       consolidated=template)


def averaged_checkpoint(path: Path, tensors: Sequence[OutputTensor], sharded: frozenset[str]) -> Checkpoint:
    """Return a stand-in checkpoint of the averaged model for reshard's planner: each tensor
    whole, its bytes a range of AVERAGED_FILE (tensors end to end, in order), keyed
    `model.<key>` and nested under `model` as `import` writes; `sharded` (keys) are the
    parameters FSDP2 shards (those a source holds in several chunks; none: every tensor of one
    or more dimensions is, as `import` shards)."""
    entries = {}
    at = 0
    for tensor in tensors:
        blob = Blob(AVERAGED_FILE, at, tensor.nbytes, raw_range_transforms())
        fqn = DCP_PREFIX + tensor.key
        entries[fqn] = Tensor(fqn, tensor.dtype, tensor.shape, (Chunk((0,) * len(tensor.shape), tensor.shape, blob),))
        at += tensor.nbytes
    nesting: dict[str, tuple[str | int, ...]] = {DCP_PREFIX + t.key: (DCP_PREFIX[:-1], t.key) for t in tensors}
    return Checkpoint(path, ".metadata", None, entries, {}, nesting=nesting, model_prefix=DCP_PREFIX[:-1],
                      parameters=frozenset(DCP_PREFIX + key for key in sharded))


def averaged_located(checkpoint: Checkpoint) -> dict[str, dict[int, RawData | None]]:
    """Return where the stand-in's chunks are (each its raw range of AVERAGED_FILE)."""
    located: dict[str, dict[int, RawData | None]] = {}
    for fqn, tensor in checkpoint.tensors.items():
        blob = tensor.chunks[0].blob
        assert blob is not None  # averaged_checkpoint gives every chunk one
        located[fqn] = {0: RawData(blob.file, blob.offset, blob.length)}
    return located


def plan_average_dcp(sources: Sequence[str], weights: Sequence[float], tensors: Sequence[OutputTensor],
                     resharded: ReshardPlan, writes: ReshardWrites, maps: Sequence[Mapping[str, SourceMap]],
                     block_elements: int = BLOCK_ELEMENTS) -> AveragePlan:
    """Return the plan that writes the average as the DCP rank files `writes` lays out
    (reshard's plan of `averaged_checkpoint(tensors)`): each record of a chunk becomes an
    AverageRecord whose data are the blocks of the chunk's elements."""
    bases, at = [], 0
    for tensor in tensors:
        bases.append(at)
        at += tensor.nbytes
    operations: list[AverageOperation] = []
    for op in writes.operations:
        for record in (op.records() if isinstance(op, Records) else (op,)):
            if not isinstance(record, Record):
                raise AssertionError(f"the averaged model holds no python objects: {type(record).__name__}")
            parts: list[Average] = []
            for part in sorted(record.parts, key=lambda p: p.dst_offset if isinstance(p, Copy) else 0):
                if not isinstance(part, Copy) or part.src != AVERAGED_FILE:
                    raise AssertionError("a record of the stand-in is filled by copies of its raw ranges")
                number = bisect.bisect_right(bases, part.src_offset) - 1
                while tensors[number].nbytes == 0 or part.src_offset >= bases[number] + tensors[number].nbytes:
                    number += 1  # past empty tensors sharing the offset
                tensor = tensors[number]
                itemsize = dtypes.ITEMSIZE[tensor.dtype]
                first = (part.src_offset - bases[number]) // itemsize
                parts.extend(blocks(tensor, [found[tensor.key] for found in maps], first, part.length // itemsize,
                                    part.dst, part.dst_offset, block_elements))
            operations.append(AverageRecord(record.dst, record.offset, record.fqn, record.dtype, record.shape,
                                            tuple(parts)))
    return AveragePlan(tuple(sources), tuple(weights), "dcp", tuple(tensors), writes.files, tuple(operations),
                       resharded=resharded, writes=writes)


def weights_text(weights: Sequence[float]) -> str:
    """Return the weights as Python writes the float64 values (repr: exact round trip)."""
    return ",".join(repr(w) for w in weights)


def float64_bits(value: float) -> str:
    """Return the IEEE-754 bits of a float64 as 16 hex digits (for the JSON document)."""
    return struct.pack(">d", value).hex()
