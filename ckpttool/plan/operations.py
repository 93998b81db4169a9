"""The operations a plan is made of: which source bytes go where, as pure data.

Both planners (`plan.consolidate`, `plan.reshard`) describe their output with these
kinds, and `execute` runs any list of them (with one memory budget) and verifies them:

- `Copy`: a byte range moves as it is from a data file to an output file (FSDP's dim-0
  chunks are contiguous runs of the full tensor: `copy_file_range`, no buffer);
- `Put`: bytes the planner made (a reader-made object) written as they are;
- `Convert`: a contiguous run that is cast (`--dtype`), in blocks of `CONVERT_BLOCK`;
- `Gather`: a chunk read whole (decoded when its blob is transformed or strided), cast if
  asked, and written as pieces (block / 2-D sharding, or a decoded source);
- `Band`: whole output rows that several chunks fill side by side (a weight cut on dim 1:
  row-parallel TP), assembled in memory from a Gather of each chunk's rows and written once;
- `Record`: a torch.save record of one chunk (reshard): its head, the data of its parts
  (each a Copy or Gather), and the tail that carries the CRC-32 of that data;
- `Records`: many such records laid end to end in one output, each filled by one run of
  raw source bytes (reshard's common case: 300k+ small records, one operation per few
  hundred, held as columns instead of a Record and a Copy each);
- `Dequantize`: rows of a quantised weight (FP8 codes, MXFP4 blocks) and of its scale read,
  dequantised as the references compute it, and written in the output dtype.

Example:
    >>> Copy("__0_0.distcp", 1216, "m.safetensors", 96, 208).memory
    0
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Tensor
from ckpttool.dcp.blobs import RawData
from ckpttool.torchsave.record import record_layout

CONVERT_BLOCK = 16 << 20  # source bytes cast per step: bounds memory of a --dtype cast
DEQUANTIZE_ELEMENTS = 4 << 20  # output elements dequantised per operation (16 MiB of float32 working copy)
STREAM_BLOCK = 8 << 20  # bytes read, checksummed and written per step of a record's data
# a record's copies shorter than this whose CRC-32 must be summed are read with their neighbours
# in one span and written from memory (run.record_writes.copy_groups): a copy_file_range, a
# pread and a CRC-32 combine per row of a weight cut into rows (4 KiB) cost more than its bytes
GATHER_PART = 64 << 10
# output bytes a Band assembles at a time: a few hundred rows of a large weight, one write each;
# held per thread with the rows read for it, so small beside STREAM_BLOCK
BAND_BYTES = 2 << 20
GATHER_SPAN = STREAM_BLOCK // 2  # the most source bytes read at once for them, and the most gathered
GATHER_FILES = 8  # the most source files one group reads from (a span each): a row's tensor-parallel pieces
GATHER_WINDOW = 1 << 20  # a span may read through this much, else at most twice what it copies
RECORDS_WRITE_BLOCK = 4 << 20  # a Records operation's output is built and written this much at a time
# the bytes between its runs a Records operation may read through (at least its own length):
# its records often come from a few source files, each run a few KiB apart
RECORDS_READ_THROUGH = 4 << 20


@dataclass(frozen=True)
class Copy:
    """Move `length` raw bytes from a data file to an output file."""

    src: str
    src_offset: int
    dst: str
    dst_offset: int
    length: int
    crc32: int | None = None  # CRC-32 of these bytes, when torch.save recorded it
    # the torch.save record data these bytes are a part of, with its recorded CRC-32: theirs
    # follows from it and the CRC-32 of the rest (torchsave.crc32.crc32_slice)
    within: RawData | None = None

    @property
    def memory(self) -> int:
        return 0  # in-kernel copy

    @property
    def output_length(self) -> int:
        return self.length


@dataclass(frozen=True)
class Put:
    """Write bytes the planner made (a reader-made object's torch.save bytes) as they are."""

    dst: str
    dst_offset: int
    data: bytes

    @property
    def memory(self) -> int:
        return 0  # held by the plan already

    @property
    def output_length(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Convert:
    """Cast a contiguous run of `source_dtype` elements to `dtype` and write it."""

    src: str
    src_offset: int
    length: int  # source bytes
    source_dtype: str
    dtype: str
    dst: str
    dst_offset: int

    @property
    def output_length(self) -> int:
        return self.length // dtypes.ITEMSIZE[self.source_dtype] * dtypes.ITEMSIZE[self.dtype]

    @property
    def memory(self) -> int:
        return self.length + self.output_length


@dataclass(frozen=True)
class Gather:
    """Read chunk `chunk` of `tensor` whole (from `source`, or decoded when it is None), cast it
    to `dtype`, and write `pieces`: (offset in the cast chunk bytes, output offset, length)."""

    tensor: Tensor
    chunk: int
    source: RawData | None
    dtype: str
    dst: str
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def output_length(self) -> int:
        return sum(length for _, _, length in self.pieces)

    @property
    def memory(self) -> int:
        # the bytes read (the chunk, or the rows of it a Band takes: `source`), and their cast copy
        read = self.source.length if self.source is not None else self.tensor.chunks[self.chunk].numel * self.tensor.itemsize
        cast = read // self.tensor.itemsize * dtypes.ITEMSIZE[self.dtype] if self.dtype != self.tensor.dtype else 0
        return read + cast


@dataclass(frozen=True)
class Band:
    """Output bytes [offset, offset + length) of `dst`: whole rows of one tensor that the
    `parts` fill side by side, each a Gather of one chunk's rows in the band (its `source` the
    raw bytes of those rows; its pieces' output offsets inside the band, together covering it
    once). Assembled in one buffer and written with one write, instead of one write per row
    piece: a weight cut on dim 1 into TP ranks has a piece per row and rank."""

    dst: str
    offset: int
    length: int
    parts: tuple[Gather, ...]

    @property
    def output_length(self) -> int:
        return self.length

    @property
    def memory(self) -> int:
        return self.length + max((part.memory for part in self.parts), default=0)


@dataclass(frozen=True)
class Record:
    """A torch.save record of a `dtype` chunk of `shape` at `offset` of `dst`: the record's
    head, the data written by `parts` (output offsets absolute, together covering the data
    exactly once), and the tail holding the data's CRC-32."""

    dst: str
    offset: int
    fqn: str  # the chunk it holds: for messages
    chunk_offsets: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Copy | Gather, ...]
    # asked for by batching, budgets and progress, for 100k+ records: computed once, when
    # made (functools.cached_property takes a lock on every first access)
    output_length: int = field(init=False, repr=False, compare=False)
    memory: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = self.parts
        if len(parts) == 1 and type(parts[0]) is Copy:  # the common case: one run of one source
            length = parts[0].length
            object.__setattr__(self, "output_length", length)
            object.__setattr__(self, "memory", min(length, STREAM_BLOCK))
            return
        length = sum(part.output_length for part in parts)
        decoded = {(p.tensor.fqn, p.chunk): p.memory for p in parts if isinstance(p, Gather)}
        # short copies read in a span and gathered (record_writes.copy_groups): the span and the gathered bytes
        gathering = (min(GATHER_SPAN, max(2 * length, GATHER_WINDOW)) + min(length, GATHER_SPAN)
                     if any(type(p) is Copy and p.length < GATHER_PART and not p.crc32 for p in parts) else 0)
        object.__setattr__(self, "output_length", length)
        object.__setattr__(self, "memory", max(min(length, STREAM_BLOCK), sum(decoded.values()), gathering))


@dataclass(frozen=True, eq=False)
class Records:
    """torch.save records of chunks laid end to end in `dst` from byte `offset`, record `i`
    holding a `shapes[kind[i]]` chunk of `fqn[i]` whose first row is `start[i]` (its other
    offsets 0), its data the `length` raw bytes at `src_offset[i]` of data file `src[i]`
    (`length` = the record layout's `data_length`). A record of an empty chunk (no data)
    reads nothing: its `src` is "" and its `src_offset` 0.

    `records()` gives the same writes as one `Record` (with one `Copy` part, none for an empty
    chunk) per record: what they write is what these write, byte for byte. Equal by identity
    (its columns are long).
    """

    dst: str
    offset: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # distinct (dtype, shape) of the records
    kind: tuple[int, ...]  # per record: index into `shapes`
    fqn: tuple[str, ...]
    start: tuple[int, ...]
    src: tuple[str, ...]
    src_offset: tuple[int, ...]
    length: int = field(init=False, repr=False)  # bytes written: the records, heads and tails included
    output_length: int = field(init=False, repr=False)  # the chunks' data bytes, as a Record counts them
    read_through: int = field(init=False, repr=False)  # most gap bytes read between runs (record_writes)
    memory: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layouts = [record_layout(dtype, shape) for dtype, shape in self.shapes]
        lengths = [layout.length for layout in layouts]
        counts = Counter(self.kind)  # counted in C: a reshard makes 300k+ records
        total = sum(lengths[kind] * count for kind, count in counts.items())
        object.__setattr__(self, "length", total)
        object.__setattr__(self, "output_length", sum(layouts[kind].data_length * count for kind, count in counts.items()))
        object.__setattr__(self, "read_through", max(total, RECORDS_READ_THROUGH))
        # held at once while it runs: the source spans (the records' data and the gaps read
        # through between runs: record_writes.source_spans), and the output block being built
        # (up to RECORDS_WRITE_BLOCK and one record past it)
        block = min(total, RECORDS_WRITE_BLOCK + max(lengths, default=0))
        object.__setattr__(self, "memory", self.output_length + self.read_through + block)

    def __len__(self) -> int:
        return len(self.kind)

    def records(self) -> list[Record]:
        """Return the records as `Record` operations, in output order."""
        layouts = [record_layout(dtype, shape) for dtype, shape in self.shapes]
        out, at = [], self.offset
        for kind, fqn, start, src, src_offset in zip(self.kind, self.fqn, self.start, self.src, self.src_offset):
            dtype, shape = self.shapes[kind]
            layout = layouts[kind]
            chunk_offsets = (start, *(0 for _ in shape[1:])) if shape else ()
            copy = (Copy(src, src_offset, self.dst, at + layout.data_offset, layout.data_length),) if layout.data_length else ()
            out.append(Record(self.dst, at, fqn, chunk_offsets, dtype, shape, copy))
            at += layout.length
        return out


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of dim 0 of a checkpoint tensor, and where its chunks' raw bytes are
    (chunk index -> RawData, None: decoded): what a Dequantize reads."""

    tensor: Tensor
    located: tuple[tuple[int, RawData | None], ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        shape = self.tensor.shape
        return (self.stop - self.start) * math.prod(shape[1:]) * self.tensor.itemsize if shape else self.tensor.nbytes


@dataclass(frozen=True)
class Dequantize:
    """Dequantise rows of a quantised weight (`quantization.QuantizedWeight`: its `layout` and
    `block`) from its `codes` and `scale` rows, and write them as `dtype` at `dst_offset`:
    FP8 a block-row at a time, MXFP4 whole experts (formats.fp8, formats.mxfp4)."""

    name: str  # the dequantised tensor's fqn: for messages
    layout: str
    block: tuple[int, int]
    codes: Rows
    scale: Rows
    shape: tuple[int, ...]  # the dequantised tensor's shape
    dtype: str
    dst: str
    dst_offset: int

    @property
    def output_length(self) -> int:
        return (self.codes.stop - self.codes.start) * math.prod(self.shape[1:]) * dtypes.ITEMSIZE[self.dtype]

    @property
    def memory(self) -> int:
        # the rows read, a float32 (FP8) or int32 (MXFP4 nibbles) working copy, the output
        # and, for MXFP4, its transposed copy
        return self.codes.nbytes + self.scale.nbytes + 8 * self.codes.nbytes + 2 * self.output_length


@dataclass(frozen=True)
class Quantize:
    """Quantise rows of a weight to fine-grained FP8 (formats.fp8.quantize_rows: DeepSeek's
    weight_quant) and write one `part` of the result: its float8 `codes` or its float32
    `scales` (the scale rows of those blocks). Both parts read the same rows."""

    name: str  # the weight's output key: for messages
    part: str  # "codes" | "scales"
    block: tuple[int, int]
    source: Rows
    dst: str
    dst_offset: int

    @property
    def output_length(self) -> int:
        rows, (b0, b1) = self.source.stop - self.source.start, self.block
        shape = self.source.tensor.shape
        if self.part == "codes":
            return rows * math.prod(shape[1:])
        return -(-rows // b0) * -(-shape[-1] // b1) * 4

    @property
    def memory(self) -> int:
        return self.source.nbytes + 4 * self.source.nbytes // max(1, self.source.tensor.itemsize) + self.output_length


Operation = Copy | Put | Convert | Gather | Band | Record | Records | Dequantize | Quantize
