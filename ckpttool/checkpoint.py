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
import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

from ckpttool import dtypes
from ckpttool.errors import BadName

# Our own blob markers, never written to disk: the blob is the chunk's raw row-major bytes as
# they are, with no record around them (readers/verl.py: a storage inside a torch.save .pt
# file); `ckpttool.raw/<crc32 hex>` also states the CRC-32 of those bytes.
RAW_RANGE_TRANSFORM = "ckpttool.raw"
OUR_TRANSFORMS = "ckpttool."  # the prefix of our markers (RAW_RANGE_TRANSFORM), never in a file


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


@dataclass(frozen=True)
class Tensor:
    """A tensor entry of the checkpoint: its global shape, dtype and chunks."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

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


@dataclass(frozen=True)
class Checkpoint:
    """Everything `.metadata` says, in our own types. Entries are sorted by fqn."""

    path: Path
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

    def entries(self) -> Iterator[Tensor | Object]:
        """Yield tensors and objects in fqn order."""
        names = sorted(set(self.tensors) | set(self.objects))
        for name in names:
            yield self.tensors.get(name) or self.objects[name]

    def data_files(self) -> list[str]:
        """Return the relative data-file paths referenced by any blob, sorted."""
        files = {c.blob.file for t in self.tensors.values() for c in t.chunks if c.blob}
        files |= {o.blob.file for o in self.objects.values() if o.blob}
        return sorted(files)



def raw_range_transforms(crc32: int | None = None) -> tuple[str, ...]:
    """Return the transforms of a raw-byte-range blob (with its CRC-32 when known)."""
    return (RAW_RANGE_TRANSFORM if crc32 is None else f"{RAW_RANGE_TRANSFORM}/{crc32:08x}",)


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
    files |= {c.blob.file for t in tensors.values() for c in t.chunks if c.blob}
    files |= {o.blob.file for o in objects.values() if o.blob}
    for file in files:
        if (why := bad_text(file)) is not None:
            raise BadName(f"{source}: data file path {ascii(file)[:120]} holds {why}; refusing the checkpoint")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects.

    Building 100k+ chunk records triggers collections over and over although none form
    cycles; pausing it makes reading large metadata about 4x faster.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
