"""Experts that transformers stores transposed (GPT-OSS's fused `gate_up_proj` and `down_proj`),
as chunks of the source's bytes: the part of engine.py's conversion that turns such a piece (an
expert's rows becoming its target's columns, `Piece.columns`; import's inverse, an expert's
columns becoming its target's rows, `Piece.rows`) into chunks, and checks a target gathered from
one source tensor per expert.

A row permutation followed by a transpose is no byte range: an expert whose bytes are one
contiguous run of one source chunk is one chunk, its blob marked ROWS_AS_COLUMNS_TRANSFORM
(decoded by dcp.blobs.read_chunk, one expert's matrix and its transposed copy in memory); one
that straddles source chunks is a chunk per part of each source row, each a column (part) of
the target: raw byte ranges, many small ones.

Import (`rows`): transformers' expert [H, 2F] (or [F, H], or a bias [2F]) back to Megatron's
[2F, H] ([H, F], [2F]) is the same bytes rule: the expert's bytes as an (R, X, Y) array with its
axes reversed, so a band of whole rows of the expert in one source chunk is one chunk with a
ROWS_AS_COLUMNS_TRANSFORM blob of grid (rows, X). Decoding it holds the band's bytes and their
transposed copy: at most two copies of one expert's matrix, whatever the model's size.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol, Sequence, cast

from ckpttool.core.checkpoint import Blob, Chunk, Tensor, raw_range_transforms, rows_as_columns_transforms
from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.core.geometry import Box, intersect, row_major_runs

_RAW = raw_range_transforms()


class Piece(Protocol):
    """What this module reads of engine.Piece (engine.py imports this module, not the reverse)."""

    @property
    def source(self) -> str: ...
    @property
    def box(self) -> Box: ...
    @property
    def step(self) -> int: ...
    @property
    def at(self) -> tuple[int, ...] | None: ...
    @property
    def columns(self) -> tuple[int, int] | None: ...
    @property
    def rows(self) -> tuple[int, int] | None: ...


class Target(Protocol):
    """What this module reads of engine.Target."""

    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def pieces(self) -> Sequence[Piece]: ...


def column_chunks(tensor: Tensor, indices: Sequence[int], raw: Callable[[int], Any], piece: Piece,
                  where: str) -> list[Chunk]:
    """Return the target chunks of a `columns` piece of source `tensor` (`indices`: its distinct
    chunks; `raw(index)`: where a chunk's raw bytes are): the box [1, R, *C] (or [R, *C], one
    expert's own tensor) placed at `piece.at` as [1, *C, R], target column y * X + x being box
    row x * Y + y for `piece.columns` (X, Y). A `rows` piece: `row_chunks`."""
    if piece.rows is not None:
        return row_chunks(tensor, indices, raw, piece, where)
    x, y = cast(tuple[int, int], piece.columns)
    at = cast(tuple[int, ...], piece.at)
    lead = 1 if len(piece.box[1]) == len(at) else 0  # the box has the experts axis (a stacked source), or not
    offsets, sizes = piece.box
    first, starts, rows, rest = offsets[lead], offsets[lead + 1:], sizes[lead], tuple(sizes[lead + 1:])
    if (sizes[0] if lead else 1) != 1 or rows != x * y or piece.step != 1:
        raise ValueError(f"{where}: a columns piece of box {piece.box} is not one expert's {x} x {y} grid of rows")
    itemsize = tensor.itemsize
    boxes = [(index, (tensor.chunks[index].offsets, tensor.chunks[index].sizes)) for index in indices]
    for index, box in boxes:  # the whole expert, contiguous in one chunk: one chunk
        if intersect(piece.box, box) == piece.box and len(runs := row_major_runs(box, piece.box, itemsize)) == 1:
            found = raw(index)
            blob = Blob(found.file, found.offset + runs[0][0], runs[0][1], rows_as_columns_transforms((x, y)))
            return [Chunk(at, (1, *rest, rows), blob)]
    chunks: list[Chunk] = []
    for relative in range(rows):  # else each row's part in each chunk: a column (part) of the target
        row_box = ((*offsets[:lead], first + relative, *starts), (*sizes[:lead], 1, *rest))
        column = relative % y * x + relative // y
        for index, box in boxes:
            region = intersect(row_box, box)
            if region is None or not math.prod(region[1]):
                continue
            (start, length), = row_major_runs(box, region, itemsize)  # a part of one row: contiguous
            found = raw(index)
            within = tuple(offset - begin for offset, begin in zip(region[0][lead + 1:], starts))
            chunks.append(Chunk((at[0], *within, column), (1, *region[1][lead + 1:], 1),
                                Blob(found.file, found.offset + start, length, _RAW)))
    if sum(chunk.numel for chunk in chunks) != rows * math.prod(rest):
        raise InvalidCheckpoint(f"{where}: {tensor.fqn}: its chunks do not cover expert {at[0]}", code="config-mismatch")
    return chunks


def row_chunks(tensor: Tensor, indices: Sequence[int], raw: Callable[[int], Any], piece: Piece,
               where: str) -> list[Chunk]:
    """Return the target chunks of a `rows` piece of source `tensor` (import: the inverse of a
    `columns` piece): the box [1, R, C] (one expert of stacked experts; [1, C] a bias, R = 1)
    placed at `piece.at` as [1, C, R] ([1, C]), target row y * X + x being box column x * Y + y
    for `piece.rows` (X, Y), C = X * Y. One chunk per source chunk the expert meets, each holding
    whole rows of it; a source chunk that cuts the expert's rows is refused (UsageError).

    Example (an expert [H, 2F] interleaved -> [2F, H] as [gate; up], `rows` (F, 2)):
        >>> [chunk.sizes for chunk in row_chunks(tensor, [0], raw, piece, "hub")]
        [(1, 64, 32)]
    """
    x, y = cast(tuple[int, int], piece.rows)
    at = cast(tuple[int, ...], piece.at)
    offsets, sizes = piece.box
    matrix = len(sizes) == 3
    rows, columns = (sizes[1], sizes[2]) if matrix else (1, sizes[-1])
    if len(sizes) not in (2, 3) or sizes[0] != 1 or columns != x * y or piece.step != 1:
        raise ValueError(f"{where}: a rows piece of box {piece.box} is not one expert's {x} x {y} grid of columns")
    lead = at[:len(at) - (2 if matrix else 1)]  # the target's leading dims (layer, expert), each of size 1 here
    chunks: list[Chunk] = []
    for index in indices:
        chunk = tensor.chunks[index]
        box = (chunk.offsets, chunk.sizes)
        region = intersect(piece.box, box)
        if region is None or not math.prod(region[1]):
            continue
        runs = row_major_runs(box, region, tensor.itemsize)
        if region[1][-1] != columns or len(runs) != 1:
            raise UsageError(f"{where}: {tensor.fqn} chunk at {list(chunk.offsets)} cuts the rows of expert "
                             f"{offsets[0]}; consolidate the Hub model first (one chunk per tensor), then import that")
        first, count = (region[0][1] - offsets[1], region[1][1]) if matrix else (0, 1)
        found = raw(index)
        # the band's bytes as an (count, X, Y) array, axes reversed: a rows-as-columns grid (count, X)
        blob = Blob(found.file, found.offset + runs[0][0], runs[0][1], rows_as_columns_transforms((count, x)))
        if matrix:
            chunks.append(Chunk((*lead, at[-2], at[-1] + first), (*(1,) * len(lead), columns, count), blob))
        else:
            chunks.append(Chunk(at, (*(1,) * len(lead), columns), blob))
    if sum(chunk.numel for chunk in chunks) != rows * columns:
        raise InvalidCheckpoint(f"{where}: {tensor.fqn}: its chunks do not cover expert {offsets[0]}",
                                code="config-mismatch")
    return chunks


def check_gathered(target: Target, where: str) -> None:
    """Raise InvalidCheckpoint unless a target gathered from one source tensor per expert holds
    every expert once (its pieces' `at` on the experts axis)."""
    found = sorted(cast(tuple[int, ...], piece.at)[0] for piece in target.pieces)
    if found != list(range(target.shape[0])):
        missing = sorted(set(range(target.shape[0])) - set(found))
        twice = sorted({expert for expert in found if found.count(expert) > 1})
        raise InvalidCheckpoint(f"{where}: {target.key} holds {target.shape[0]} experts, but the checkpoint "
                                f"{f'has no expert {missing}' if missing else f'has expert {twice} twice'} "
                                f"(from {target.pieces[0].source}, ...)", code="config-mismatch")
