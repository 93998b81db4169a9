"""ConsolidatePlan: which source bytes go where in the output, as pure data.

Planning reads nothing: it takes the checkpoint's metadata, where each chunk's raw bytes sit
(`RawData`, found by `dcp.blobs.locate`), and the chosen keys and dtypes, and returns every
operation the writer will run:

- `Copy`: a byte range moves as it is from a `.distcp` file to the output (FSDP's dim-0
  chunks: each chunk is one contiguous run of the full tensor; `copy_file_range`, no buffer);
- `Convert`: a contiguous run that must be cast (`--dtype`), in blocks of `CONVERT_BLOCK`;
- `Gather`: a chunk read whole into memory (decoded if its blob is transformed), cast if
  asked, and scattered row by row (block / 2-D sharding). Memory: one chunk.

Example:
    >>> operations = plan_tensor(tensor, located, dtype="float32", file="m.safetensors", offset=96)
    >>> operations[0]
    Copy(src='__0_0.distcp', src_offset=1216, dst='m.safetensors', dst_offset=96, length=208, crc32=...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ckpttool import dtypes
from ckpttool.dcp.blobs import RawData
from ckpttool.dcp.metadata import Chunk, Tensor
from ckpttool.layout import row_major_runs

CONVERT_BLOCK = 16 << 20  # source bytes cast per step: bounds memory of a --dtype cast


@dataclass(frozen=True)
class Copy:
    """Move `length` raw bytes from a data file to an output file."""

    src: str
    src_offset: int
    dst: str
    dst_offset: int
    length: int
    crc32: int | None = None  # CRC-32 of these bytes, when torch.save recorded it


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


@dataclass(frozen=True)
class Gather:
    """Read chunk `chunk` of `fqn` whole (decoding it when `source` is None), cast it when
    `dtype` differs, and write its bytes as `runs` of (output offset, length), in order."""

    fqn: str
    chunk: int
    source: RawData | None
    source_dtype: str
    dtype: str
    dst: str
    runs: tuple[tuple[int, int], ...]
    memory: int  # bytes held while it runs

    @property
    def output_length(self) -> int:
        return sum(length for _, length in self.runs)


Operation = Copy | Convert | Gather


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
        size = dtypes.ITEMSIZE[self.dtype]
        for extent in self.shape:
            size *= extent
        return size


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
    zip_layouts: dict = field(default_factory=dict)  # .pt: file name -> torch_pt.ZipLayout

    @property
    def output_bytes(self) -> int:
        return sum(f.size for f in self.files) + (len(self.index) if self.index else 0)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def operations(self) -> list[Operation]:
        return [op for tensor in self.tensors for op in tensor.operations]


def unique_chunks(tensor: Tensor) -> list[tuple[int, Chunk]]:
    """Return (index, chunk) of chunks with elements, each box once: a replicated box
    (HSDP replicas, 0-d scalars saved by every rank) is read a single time."""
    seen: set = set()
    chunks = []
    for index, chunk in enumerate(tensor.chunks):
        box = (chunk.offsets, chunk.sizes)
        if chunk.numel == 0 or box in seen:
            continue
        seen.add(box)
        chunks.append((index, chunk))
    return chunks


def plan_tensor(
    tensor: Tensor,
    located: Mapping[int, RawData | None],
    dtype: str,
    file: str,
    offset: int,
) -> tuple[Operation, ...]:
    """Return the operations that write `tensor`, cast to `dtype`, at `offset` of `file`.

    `located[i]` is where chunk i's raw bytes are (None: its blob must be decoded).
    """
    itemsize = dtypes.ITEMSIZE[dtype]
    source_itemsize = dtypes.ITEMSIZE[tensor.dtype]
    whole = ((0,) * len(tensor.shape), tensor.shape)
    operations: list[Operation] = []
    for index, chunk in unique_chunks(tensor):
        runs = row_major_runs(whole, (chunk.offsets, chunk.sizes), itemsize)
        raw = located.get(index)
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
        memory = chunk.numel * (source_itemsize + (itemsize if dtype != tensor.dtype else 0))
        operations.append(Gather(
            tensor.fqn, index, raw, tensor.dtype, dtype, file,
            tuple((offset + start, length) for start, length in runs), memory,
        ))
    return tuple(operations)


def target_dtype(source_dtype: str, wanted: str | None) -> str:
    """Return the output dtype: `wanted` for floating tensors, the source dtype otherwise
    (integer and bool tensors are never cast)."""
    if wanted is None or source_dtype not in dtypes.FLOATING:
        return source_dtype
    return wanted

