"""Our checkpoint types: what every reader yields and every command reads.

A `Checkpoint` holds its `Tensor`s (global shape, dtype, and the `Chunk`s that tile it, each
with the `Blob` of a data file that holds its bytes) and its non-tensor `Object`s, sorted by
fqn. Frozen and free of torch: a reader converts its format's own metadata into these once.

Example:
    >>> ckpt = read_checkpoint("runs/x/step-00000020")       # ckpttool.readers.dcp
    >>> tensor = ckpt.tensors["model.tok_emb.weight"]
    >>> tensor.shape, tensor.chunks[0].blob.file
    ((256, 64), '__0_0.distcp')
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence, cast, overload

if TYPE_CHECKING:
    import numpy as np

from ckpttool.core import dtypes
from ckpttool.core.errors import BadName

# `Checkpoint.notes` that start so say the save left model parameters out on purpose (DeepSpeed's
# exclude_frozen_parameters): a warning, not "cannot read", and a full model cannot be written
EXCLUDED_FROZEN = "frozen parameters not saved (DeepSpeed exclude_frozen_parameters)"

# Our own blob markers, never written to disk: the blob is the chunk's raw row-major bytes as
# they are, with no record around them (readers/verl.py: a storage inside a torch.save .pt
# file); `ckpttool.raw/<crc32 hex>` also states the CRC-32 of those bytes.
RAW_RANGE_TRANSFORM = "ckpttool.raw"
# `ckpttool.rows-transposed/<X>/<Y>`: the blob is X * Y rows of raw bytes (a box of whole rows
# of a source tensor) and the chunk is them as an X x Y grid of rows, transposed: chunk row
# y * X + x is blob row x * Y + y (a rotary head's rows in torchtitan's order: naming.backward)
ROWS_TRANSPOSED_TRANSFORM = "ckpttool.rows-transposed"
# `ckpttool.rows-as-columns/<X>/<Y>`: the blob is X * Y rows of C elements each (a source matrix,
# raw bytes) and the chunk is them as an X x Y grid of rows transposed, then as a matrix
# transposed: chunk element [c, y * X + x] is blob element [x * Y + y, c], C the chunk's numel
# over X * Y (GPT-OSS's experts: Megatron's [gate; up] rows interleaved and transposed, X = 2; a
# plain transpose, X = 1; C = 1, a bias: the interleave alone), the chunk's row-major elements
# read as that [C, X * Y] matrix whatever its shape (import's inverse: a band of an expert's rows
# as an (R, X', Y') array, axes reversed: naming/expert_columns.py `row_chunks`). Decoding holds
# the blob's bytes and their transposed copy: two copies of one expert's matrix (naming/engine.py)
ROWS_AS_COLUMNS_TRANSFORM = "ckpttool.rows-as-columns"
OUR_TRANSFORMS = "ckpttool."  # the prefix of our markers (RAW_RANGE_TRANSFORM, ...), never in a file


# Blob and Chunk are NamedTuples rather than frozen dataclasses: a checkpoint can hold
# 100k+ of each, and a NamedTuple is built about 5x faster.


class Blob(NamedTuple):
    """Where an entry's bytes sit: a byte range of one data file, plus stream transforms."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


class Chunk(NamedTuple):
    """A box of a tensor: `offsets` and `sizes` per dimension, and the blob holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob | None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class ChunkTable(Sequence[Chunk]):
    """A tensor's chunks as columns: what a large `.metadata` is read into (readers/dcp.py),
    one row per chunk, sorted by offsets, instead of a `Chunk` and a `Blob` per chunk.

    It is a sequence of `Chunk`s (each built when asked for), so code that walks
    `tensor.chunks` works on it unchanged; code on the hot path of large checkpoints (the
    integrity gate, inspect) reads the columns:

    - `offsets`, `sizes`: int64 arrays of shape (rows, ndim)
    - `file`: integer index into `files` of the data file holding each chunk, -1 for a chunk
      without a storage entry (then `blob_offset` and `blob_length` are 0)
    - `blob_offset`, `blob_length`: int64 byte ranges in that file
    - every blob has no transforms (tables are only built for such tensors)

    Example:
        >>> table = ckpt.tensors["model.tok_emb.weight"].chunks
        >>> table.offsets[:, 0], table.files[table.file[0]]
        (array([  0, 128]), '__0_0.distcp')
    """

    __slots__ = ("offsets", "sizes", "file", "blob_offset", "blob_length", "files", "_chunks")

    def __init__(self, offsets: "np.ndarray", sizes: "np.ndarray", file: "np.ndarray", blob_offset: "np.ndarray",
                 blob_length: "np.ndarray", files: tuple[str, ...]):
        self.offsets, self.sizes, self.file = offsets, sizes, file
        self.blob_offset, self.blob_length, self.files = blob_offset, blob_length, files
        self._chunks: tuple[Chunk, ...] | None = None  # built on the first walk (planners walk a tensor's chunks often)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk], ndim: int) -> "ChunkTable | None":
        """Return `chunks` (sorted by offsets, untransformed blobs, int64 values) as a table,
        or None when they cannot be one."""
        import numpy as np

        files: dict[str, int] = {}
        rows = []
        for chunk in sorted(chunks, key=_chunk_order):
            blob = chunk.blob
            if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim or (blob is not None and blob.transforms):
                return None
            if blob is None:
                rows.append((*chunk.offsets, *chunk.sizes, -1, 0, 0))
            else:
                rows.append((*chunk.offsets, *chunk.sizes, files.setdefault(blob.file, len(files)), blob.offset, blob.length))
        if any(type(v) is not int or not -(1 << 63) <= v < (1 << 63) for row in rows for v in row):
            return None
        array = np.array(rows, dtype=np.int64).reshape(len(rows), 2 * ndim + 3)
        return cls(array[:, :ndim].copy(), array[:, ndim:2 * ndim].copy(), array[:, -3].astype(np.int32),
                   array[:, -2].copy(), array[:, -1].copy(), tuple(files))

    def __len__(self) -> int:
        return len(self.file)

    @overload
    def __getitem__(self, index: int) -> Chunk: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Chunk, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        if self._chunks is not None:
            return self._chunks[index]
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        file = int(self.file[index])
        blob = None if file < 0 else Blob(self.files[file], int(self.blob_offset[index]), int(self.blob_length[index]), ())
        return Chunk(tuple(self.offsets[index].tolist()), tuple(self.sizes[index].tolist()), blob)

    def rows(self, indices: Sequence[int]) -> list[Chunk]:
        """Return the chunks at `indices`, built in one pass over the columns (not kept)."""
        if self._chunks is not None:
            return [self._chunks[index] for index in indices]
        files = self.files
        return [
            Chunk(tuple(offsets), tuple(sizes), None if file < 0 else Blob(files[file], offset, length, ()))
            for offsets, sizes, file, offset, length in zip(self.offsets[indices].tolist(), self.sizes[indices].tolist(),
                                                            self.file[indices].tolist(), self.blob_offset[indices].tolist(),
                                                            self.blob_length[indices].tolist())
        ]

    def __iter__(self) -> Iterator[Chunk]:
        if self._chunks is None:
            files = self.files
            self._chunks = tuple(
                Chunk(tuple(offsets), tuple(sizes), None if file < 0 else Blob(files[file], offset, length, ()))
                for offsets, sizes, file, offset, length in zip(self.offsets.tolist(), self.sizes.tolist(),
                                                                self.file.tolist(), self.blob_offset.tolist(),
                                                                self.blob_length.tolist())
            )
        return iter(self._chunks)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ChunkTable, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks of {self.offsets.shape[1]} dims in {len(self.files)} files)"

    def data_files(self) -> set[str]:
        """Return the names of the data files any chunk's blob is in."""
        import numpy as np

        return {self.files[i] for i in np.unique(self.file).tolist() if i >= 0}


def _chunk_order(chunk: Chunk) -> tuple[int, ...]:
    return chunk.offsets


@dataclass(frozen=True)
class Tensor:
    """A tensor entry of the checkpoint: its global shape, dtype and chunks."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] | ChunkTable  # sorted by offsets

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtypes.ITEMSIZE.get(self.dtype, 0)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Object:
    """A non-tensor entry (torch.save'd bytes: ints, floats, lists, param_groups, ...)."""

    fqn: str
    blob: Blob | None
    # its torch.save bytes when no data file holds them: a value the reader made from the
    # layout's own records (DeepSpeed's param_groups); then `blob` is None
    data: bytes | None = None


def as_path(path: object) -> Path:
    """`path` typed as the readers take it: a `storage.RemotePath` answers the `Path` questions
    they ask (`exists`, `is_file`, `iterdir`, `stat`, `read_bytes`, `/`), so it travels as a Path
    (a `Checkpoint.path` is one or the other); `storage.is_remote` tells them apart."""
    return cast(Path, path)


@dataclass(frozen=True)
class Checkpoint:
    """Everything `.metadata` says, in our own types. Entries are sorted by fqn."""

    path: Path  # a local Path, or a RemotePath (`as_path`)
    metadata_file: str
    version: str | None
    tensors: dict[str, Tensor]
    objects: dict[str, Object]
    # fqn -> path of keys in the nested state dict (torch's planner_data); empty when absent.
    nesting: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    # blobs in the storage table that no tensor or object refers to (torch never writes these)
    orphan_blobs: tuple[tuple[str, Blob], ...] = ()
    # entries the storage table mentions for unknown fqns
    save_id: str | None = None
    # problems found while converting, kept for `validate` (e.g. unknown dtype names)
    notes: tuple[str, ...] = ()
    # where the layout itself keeps the model (dotted prefix; "" the top level: safetensors files,
    # Hub folders, verl), or None: found from the structure (model_view.find_model)
    model_prefix: str | None = None
    # the attribute path inside the model's dict that holds the model, stripped from each model
    # key (a LightningModule's `model`, Lightning's DeepSpeed wrapper `_forward_module.model`)
    model_attribute: str | None = None
    # the model's parameters (fqns), when the layout names them apart from its buffers
    # (DeepSpeed's param_shapes and frozen parameters): reshard shards each, as fully_shard does
    parameters: frozenset[str] = frozenset()

    def entries(self) -> Iterator[Tensor | Object]:
        """Yield tensors and objects in fqn order."""
        names = sorted(set(self.tensors) | set(self.objects))
        for name in names:
            yield self.tensors.get(name) or self.objects[name]

    def data_files(self) -> list[str]:
        """Return the relative data-file paths referenced by any blob, sorted."""
        files = {o.blob.file for o in self.objects.values() if o.blob}
        for tensor in self.tensors.values():
            files |= tensor_files(tensor)
        return sorted(files)



def with_tables(checkpoint: Checkpoint) -> Checkpoint:
    """Return `checkpoint` with each tensor's chunks as a `ChunkTable` where they can be one
    (what reading a large `.metadata` gives; tests compare both forms)."""
    tensors = {}
    for fqn, tensor in checkpoint.tensors.items():
        table = tensor.chunks if isinstance(tensor.chunks, ChunkTable) else ChunkTable.from_chunks(tensor.chunks, len(tensor.shape))
        tensors[fqn] = tensor if table is None else Tensor(tensor.fqn, tensor.dtype, tensor.shape, table)
    return dataclasses.replace(checkpoint, tensors=tensors)


def tensor_files(tensor: Tensor) -> set[str]:
    """Return the names of the data files holding any chunk of `tensor`."""
    if isinstance(tensor.chunks, ChunkTable):
        return tensor.chunks.data_files()
    return {c.blob.file for c in tensor.chunks if c.blob}


def raw_range_transforms(crc32: int | None = None) -> tuple[str, ...]:
    """Return the transforms of a raw-byte-range blob (with its CRC-32 when known)."""
    return (RAW_RANGE_TRANSFORM if crc32 is None else f"{RAW_RANGE_TRANSFORM}/{crc32:08x}",)


def rows_transposed_transforms(grid: tuple[int, int]) -> tuple[str, ...]:
    """Return the transforms of a blob whose rows, as a `grid` (X, Y) of rows, are the chunk's transposed."""
    return (f"{ROWS_TRANSPOSED_TRANSFORM}/{grid[0]}/{grid[1]}",)


def rows_transposed(blob: Blob) -> tuple[int, int] | None:
    """Return the (X, Y) grid of a ROWS_TRANSPOSED_TRANSFORM blob, None for any other.

    Example:
        >>> rows_transposed(Blob("a.safetensors", 0, 1024, rows_transposed_transforms((2, 64))))
        (2, 64)
    """
    return _grid(blob, ROWS_TRANSPOSED_TRANSFORM)


def rows_as_columns_transforms(grid: tuple[int, int]) -> tuple[str, ...]:
    """Return the transforms of a blob whose rows, as a `grid` (X, Y) of rows transposed, are the chunk's columns."""
    return (f"{ROWS_AS_COLUMNS_TRANSFORM}/{grid[0]}/{grid[1]}",)


def rows_as_columns(blob: Blob) -> tuple[int, int] | None:
    """Return the (X, Y) grid of a ROWS_AS_COLUMNS_TRANSFORM blob, None for any other.

    Example:
        >>> rows_as_columns(Blob("a.distcp", 0, 8192, rows_as_columns_transforms((2, 32))))
        (2, 32)
    """
    return _grid(blob, ROWS_AS_COLUMNS_TRANSFORM)


def _grid(blob: Blob, transform: str) -> tuple[int, int] | None:
    """Return the (X, Y) grid of a blob whose one transform is `transform/X/Y`, else None."""
    if len(blob.transforms) != 1:
        return None
    name, _, grid = blob.transforms[0].partition("/")
    if name != transform:
        return None
    x, _, y = grid.partition("/")
    return int(x), int(y)


def is_raw_range(blob: Blob) -> bool:
    """True for a blob that is a chunk's raw bytes (see RAW_RANGE_TRANSFORM)."""
    return len(blob.transforms) == 1 and blob.transforms[0].split("/", 1)[0] == RAW_RANGE_TRANSFORM


def bad_text(text: str) -> str | None:
    """Why `text` can be neither a name nor a path (a NUL byte, an unpaired surrogate), or None."""
    if "\x00" in text:
        return "a NUL byte"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "an unpaired surrogate"
    return None


def refuse_bad_names(source: Path, names: list[str], files: set[str], tensors: dict[str, Tensor],
                     objects: dict[str, Object]) -> None:
    """Raise BadName for the first entry name or data-file path that `bad_text` refuses."""
    for fqn in names:
        if (why := bad_text(fqn)) is not None:
            raise BadName(f"{source}: entry name {ascii(fqn)[:120]} holds {why}; refusing the checkpoint")
    # tables' `files` tuples holding no bad name, by identity (a reader's tables share one)
    clean: dict[int, tuple[str, ...]] = {}
    for tensor in tensors.values():
        chunks = tensor.chunks
        if isinstance(chunks, ChunkTable):
            if id(chunks.files) in clean:
                continue
            if all(bad_text(file) is None for file in chunks.files):
                clean[id(chunks.files)] = chunks.files
                continue
        files |= tensor_files(tensor)
    files |= {o.blob.file for o in objects.values() if o.blob}
    for file in files:
        if (why := bad_text(file)) is not None:
            raise BadName(f"{source}: data file path {ascii(file)[:120]} holds {why}; refusing the checkpoint")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects.

    Building 100k+ chunk records triggers collections over and over although none form
    cycles; pausing it makes reading large metadata about 4x faster. On the way out, what
    was built goes straight to the oldest generation (a freeze and unfreeze: two list
    splices) rather than staying young, where the next collections would walk all of it and
    then walk it again as it ages: seconds for a plan of 300k chunks.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():  # nobody else's frozen objects to thaw
                gc.freeze()
                gc.unfreeze()
            gc.enable()
