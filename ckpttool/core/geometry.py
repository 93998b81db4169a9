"""Pure geometry of chunks: boxes, overlaps, coverage, slabs, and how FSDP splits a tensor.

A *box* is `(offsets, sizes)`, one entry per dimension. Nothing here reads files or imports
torch, so every function is tested on plain tuples.

Example:
    >>> split_dim0(7, 3)            # what fully_shard on 3 ranks gives each rank
    [(0, 3), (3, 3), (6, 1)]
    >>> str(classify([((0, 0), (3, 5)), ((3, 0), (4, 5))], (7, 5)))
    'dim0 uneven'
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(sizes: Sequence[int]) -> int:
    """Return the element count of a box with these sizes."""
    return math.prod(sizes)


def in_bounds(offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int]) -> bool:
    """True when the box lies inside a tensor of `shape` (and has its rank)."""
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        return False
    return all(o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(offsets, sizes, shape))


def intersect(a: Box, b: Box) -> Box | None:
    """Return the common box of `a` and `b`, or None when they share no element."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        start, end = max(ao, bo), min(ao + asz, bo + bsz)
        if end <= start:
            return None
        offsets.append(start)
        sizes.append(end - start)
    return tuple(offsets), tuple(sizes)


def find_overlaps(boxes: Sequence[Box], limit: int = 100) -> list[tuple[int, int]]:
    """Return index pairs of boxes that share elements (at most `limit` pairs).

    A sweep along dim 0: boxes are sorted by start, and each is compared only with the boxes
    still open at its start. For FSDP's dim-0 shards at most one is open, so this is
    O(n log n); block (2-D) sharding with k column blocks costs O(n log n + n k).
    """
    order = sorted((i for i, (_, sizes) in enumerate(boxes) if volume(sizes) > 0), key=lambda i: boxes[i][0])
    pairs: list[tuple[int, int]] = []
    if not order or not boxes[order[0]][0]:
        # 0-d tensors: every non-empty box is the one element
        return [(order[0], j) for j in order[1:limit + 1]] if len(order) > 1 else []
    open_boxes: list[tuple[int, int]] = []  # heap of (end along dim 0, index)
    for i in order:
        start = boxes[i][0][0]
        while open_boxes and open_boxes[0][0] <= start:
            heapq.heappop(open_boxes)
        for _, j in open_boxes:
            if intersect(boxes[i], boxes[j]) is not None:
                pairs.append((min(i, j), max(i, j)))
                if len(pairs) >= limit:
                    return pairs
        heapq.heappush(open_boxes, (start + boxes[i][1][0], i))
    return pairs


@dataclass(frozen=True)
class Coverage:
    """How well a tensor's chunks cover it."""

    covered: int  # elements covered, counting overlaps once per chunk
    total: int
    missing_rows: tuple[tuple[int, int], ...]  # uncovered [start, end) ranges along dim 0, if known

    @property
    def complete(self) -> bool:
        return self.covered >= self.total


def coverage(boxes: Sequence[Box], shape: Sequence[int]) -> Coverage:
    """Return how many elements the (non-overlapping, in-bounds) boxes cover.

    With no overlaps, the boxes cover the tensor exactly when their volumes add up to its
    volume. When every box spans the full extent of dims 1.. (FSDP), the missing dim-0 row
    ranges are named as well.
    """
    total = volume(shape)
    covered = sum(volume(sizes) for _, sizes in boxes)
    missing: list[tuple[int, int]] = []
    if shape and covered < total and all(tuple(s[1:]) == tuple(shape[1:]) for _, s in boxes):
        rows = sorted((o[0], o[0] + s[0]) for o, s in boxes if s[0] > 0)
        at = 0
        for start, end in rows:
            if start > at:
                missing.append((at, start))
            at = max(at, end)
        if at < shape[0]:
            missing.append((at, shape[0]))
    return Coverage(covered, total, tuple(missing))


@dataclass(frozen=True)
class Sharding:
    """How a tensor is split into chunks.

    `kind` is `replicated` (one chunk holds the whole tensor: DCP writes replicated tensors
    once), `dim<K>` (split along one dimension K), `block` (split along several, e.g. 2-D or
    tensor parallel), `partial` (chunks do not add up to a whole) or `empty` (no elements).
    """

    kind: str
    uneven: bool = False
    empty_chunks: int = 0

    def __str__(self) -> str:
        text = self.kind + (" uneven" if self.uneven else "")
        if self.empty_chunks:
            text += f", {self.empty_chunks} empty"
        return text


def classify(boxes: Sequence[Box], shape: Sequence[int]) -> Sharding:
    """Return how a tensor of `shape` is split into `boxes`."""
    nonempty = sorted((tuple(o), tuple(s)) for o, s in boxes if volume(s) > 0)
    empty = len(boxes) - len(nonempty)
    if volume(shape) == 0:
        return Sharding("empty", False, empty)
    if len(nonempty) <= 1:
        whole = len(nonempty) == 1 and nonempty[0][1] == tuple(shape)
        return Sharding("replicated" if whole else "partial", False, empty)
    split_dims = {d for _, s in nonempty for d in range(len(shape)) if s[d] != shape[d]}
    if len(split_dims) == 1:
        (dim,) = split_dims
        extents = [s[dim] for _, s in nonempty]
        uneven = any(e != extents[0] for e in extents)
        return Sharding(f"dim{dim}", uneven, empty)
    return Sharding("block", False, empty)


def split_dim0(length: int, world_size: int) -> list[tuple[int, int]]:
    """Return `(offset, size)` of each rank's rows when `length` rows are split FSDP-style.

    FSDP2 splits with `torch.chunk`: every rank gets `ceil(length / world_size)` rows except
    the last ones, and ranks past the last chunk get empty shards (offset = length, size 0).
    """
    step, count = torch_chunk(length, world_size)
    shards = [(rank * step, min(step, length - rank * step)) for rank in range(count)]
    return shards + [(length, 0)] * (world_size - count)


def torch_chunk(length: int, world_size: int) -> tuple[int, int]:
    """Return the rows of each piece `torch.chunk` cuts `length` rows into for `world_size`
    ranks, and how many pieces there are (the ranks past them get empty shards).

    Example:
        >>> torch_chunk(7, 5)
        (2, 4)
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    step = -(-length // world_size) if length else 0
    return step, -(-length // step) if step else 0


def positions_in_groups(counts: "np.ndarray") -> "np.ndarray":
    """Return 0, 1, ..., count - 1 for each of `counts`, concatenated: each row's position in
    its group, for rows grouped one group after another (int64).

    Example:
        >>> positions_in_groups(np.array([2, 0, 3]))
        array([0, 1, 0, 1, 2])
    """
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def row_major_runs(box: Box, region: Box, itemsize: int) -> list[tuple[int, int]]:
    """Return `(byte offset within box, byte length)` runs that make up `region` inside `box`.

    `box` is a chunk stored row-major; `region` is a sub-box of it (global coordinates). Runs
    are contiguous in the chunk's storage and listed in the region's row-major order, so
    concatenating them gives the region's own row-major bytes. Adjacent runs are merged.
    """
    offsets, sizes = box
    r_offsets, r_sizes = region
    dims = len(sizes)
    if dims == 0:
        return [(0, itemsize)]
    # the innermost dims that the region spans completely can be copied as one run
    inner = dims
    run = itemsize
    while inner > 0 and r_sizes[inner - 1] == sizes[inner - 1]:
        inner -= 1
        run *= sizes[inner]
    if inner == 0:
        return [(0, run)] if run else []
    run *= r_sizes[inner - 1]
    strides = [itemsize] * dims
    for d in range(dims - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    local = [ro - o for ro, o in zip(r_offsets, offsets)]
    outer_sizes = r_sizes[: inner - 1]
    runs: list[tuple[int, int]] = []
    if volume(r_sizes) == 0:
        return runs
    base = sum(local[d] * strides[d] for d in range(inner - 1, dims))
    for index in itertools.product(*(range(size) for size in outer_sizes)):
        start = base + sum((local[d] + index[d]) * strides[d] for d in range(inner - 1))
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((start, run))
    return runs


def dim0_slabs(shape: Sequence[int], offsets: "np.ndarray", sizes: "np.ndarray") -> bool:
    """True when every box of the (rows, ndim) columns is a dim-0 slab of a tensor of `shape`:
    all of every dim but the first (FSDP's chunks)."""
    import numpy as np

    return bool((offsets[:, 1:] == 0).all() and (sizes[:, 1:] == np.asarray(shape[1:], dtype=np.int64)).all())


def slab_runs(shape: Sequence[int], offsets: "np.ndarray", sizes: "np.ndarray", itemsize: int) -> list[list[tuple[int, int]]] | None:
    """Return `row_major_runs(whole tensor, box, itemsize)` for each box of the (rows, ndim)
    columns when every box is a dim-0 slab (all of every other dim): one run each, or none
    for an empty one. None when some box is not a slab (use row_major_runs)."""
    if not shape or volume(shape) * itemsize >= COLUMN_LIMIT or not dim0_slabs(shape, offsets, sizes):
        return None
    row = volume(shape[1:]) * itemsize
    return [[(start, length)] if length else []
            for start, length in zip((offsets[:, 0] * row).tolist(), (sizes[:, 0] * row).tolist())]


def overlapping_boxes(a: Sequence[Box], b: Sequence[Box]) -> Iterator[tuple[int, int, Box]]:
    """Yield (index in a, index in b, common box) for every pair of non-empty boxes of two
    chunkings of one tensor that share elements, in the order of a's boxes.

    A sweep along dim 0: for each box of a, only boxes of b starting before its end and no
    more than b's tallest box before its start are looked at.

    Example:
        >>> list(overlapping_boxes([((0,), (4,))], [((0,), (3,)), ((3,), (3,))]))
        [(0, 0, ((0,), (3,))), (0, 1, ((3,), (1,)))]
    """
    boxes_b = sorted((j for j, box in enumerate(b) if volume(box[1])), key=lambda j: b[j][0])
    if not boxes_b:
        return
    if not b[boxes_b[0]][0]:  # 0-d: the one element
        for i, box in enumerate(a):
            if volume(box[1]):
                yield i, boxes_b[0], ((), ())
        return
    starts = [b[j][0][0] for j in boxes_b]
    tallest = max(b[j][1][0] for j in boxes_b)
    for i in sorted((i for i, box in enumerate(a) if volume(box[1])), key=lambda i: a[i][0]):
        box_a = a[i]
        found = []
        at = bisect.bisect_left(starts, box_a[0][0] + box_a[1][0]) - 1
        while at >= 0 and starts[at] + tallest > box_a[0][0]:
            j = boxes_b[at]
            common = intersect(box_a, b[j])
            if common is not None:
                found.append((j, common))
            at -= 1
        for j, common in sorted(found, key=lambda item: item[1][0]):
            yield i, j, common


def slabs(region: Box, itemsize: int, limit: int) -> Iterator[Box]:
    """Yield sub-boxes of `region` in row-major order, each of at most `limit` bytes.

    Example:
        >>> list(slabs(((0, 0), (4, 3)), 4, 24))
        [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    """
    offsets, sizes = region
    if volume(sizes) * itemsize <= limit:
        yield region
        return
    dim = next(d for d, size in enumerate(sizes) if size > 1)  # outer dims of size 1 keep the order
    step = max(1, limit // (volume(sizes[dim + 1:]) * itemsize))
    for start in range(0, sizes[dim], step):
        sub_offsets = offsets[:dim] + (offsets[dim] + start,) + offsets[dim + 1:]
        sub_sizes = sizes[:dim] + (min(step, sizes[dim] - start),) + sizes[dim + 1:]
        yield from slabs((sub_offsets, sub_sizes), itemsize, limit)


# ---------------------------------------------------------------------------------------------
# Boxes as columns: int64 arrays `offsets` and `sizes` of shape (boxes, ndim), one box per row
# (checkpoint.ChunkTable). Each function gives what its per-box counterpart above gives, or
# None when it cannot be sure without them (negative sizes, products near int64's limit): the
# caller then uses the per-box function on the materialised boxes. numpy is imported lazily.

COLUMN_LIMIT = 1 << 62  # element counts and byte sums of columns stay below this (int64 is exact)


def column_volumes(sizes: "np.ndarray") -> "np.ndarray | None":
    """Return each row's element count (`volume`) as int64, or None when a size is negative or
    a count might reach COLUMN_LIMIT.

    Example:
        >>> column_volumes(np.array([[2, 3], [0, 5]]))
        array([6, 0])
    """
    import numpy as np

    rows, ndim = sizes.shape
    if not rows or not ndim:
        return np.ones(rows, dtype=np.int64)
    if int(sizes.min()) < 0:
        return None
    if int(sizes.max()) >= 1 << (61 // ndim) and float(np.prod(sizes.astype(np.float64), axis=1).max()) >= COLUMN_LIMIT / 2:
        return None
    volumes = sizes[:, 0].astype(np.int64)  # a column at a time: np.prod along a short axis is slow
    for dim in range(1, ndim):
        volumes *= sizes[:, dim]
    return volumes


def column_shape(shape: Sequence[int]) -> "np.ndarray | None":
    """Return `shape` as int64, or None when a dimension is negative or reaches COLUMN_LIMIT."""
    import numpy as np

    if any(n < 0 or n >= COLUMN_LIMIT for n in shape):
        return None
    return np.array(shape, dtype=np.int64).reshape(len(shape))


def columns_in_bounds(offsets: "np.ndarray", sizes: "np.ndarray", shape: Sequence[int]) -> "np.ndarray | None":
    """Return which rows lie inside a tensor of `shape` (`in_bounds` per row), or None when
    the columns do not have its rank or the shape is not a plain int64 shape."""
    import numpy as np

    extent = column_shape(shape)
    if extent is None or offsets.shape[1] != len(shape) or sizes.shape[1] != len(shape):
        return None
    if not len(offsets) or not len(shape):
        return np.ones(len(offsets), dtype=bool)
    if int(offsets.min()) >= 0 and int(sizes.min()) >= 0 and int(offsets.max()) < COLUMN_LIMIT and int(sizes.max()) < COLUMN_LIMIT:
        return (offsets + sizes <= extent).all(axis=1)  # no sum reaches 2**63
    # offset <= extent first, so extent - offset cannot overflow
    inside = (offsets >= 0) & (sizes >= 0) & (offsets <= extent) & (sizes <= extent - offsets)
    return inside.all(axis=1)


def dim0_tiling(offsets: "np.ndarray", sizes: "np.ndarray", shape: Sequence[int]) -> Coverage | None:
    """Return the `coverage` of in-bounds boxes proven not to overlap, or None when the proof
    fails (then `find_overlaps` must look).

    The proof is FSDP's case, in O(n): every non-empty box spans the full extent of dims 1..
    and, in row order, each starts along dim 0 at or after the previous one's end.

    Example:
        >>> dim0_tiling(np.array([[0, 0], [4, 0]]), np.array([[4, 8], [3, 8]]), (8, 8))
        Coverage(covered=56, total=64, missing_rows=((7, 8),))
    """
    import numpy as np

    volumes = column_volumes(sizes)
    extent = column_shape(shape)
    if volumes is None or extent is None or not len(shape) or volume(shape) >= COLUMN_LIMIT:
        return None
    full = (sizes[:, 1:] == extent[1:]).all(axis=1)
    if len(volumes) and int(volumes.min()) > 0:  # the usual case: no empty boxes to leave out
        if not (full.all() and not offsets[:, 1:].any()):
            return None
        starts = offsets[:, 0]
        ends = starts + sizes[:, 0]
    else:
        nonempty = volumes > 0
        if not (full[nonempty].all() and not offsets[nonempty, 1:].any()):
            return None
        starts = offsets[nonempty, 0]
        ends = starts + sizes[nonempty, 0]
    if (starts[1:] < ends[:-1]).any():
        return None
    total = volume(shape)
    covered = int(volumes.sum())
    missing: tuple[tuple[int, int], ...] = ()
    if covered < total and full.all():
        # the rows are sorted and disjoint, so each gap lies between one box's end and the next start
        previous = np.concatenate(([0], ends[:-1]))
        gaps = starts > previous
        missing = tuple(zip(previous[gaps].tolist(), starts[gaps].tolist()))
        last = int(ends[-1]) if len(ends) else 0
        if last < shape[0]:
            missing += ((last, shape[0]),)
    return Coverage(covered, total, missing)


def classify_columns(sizes: "np.ndarray", shape: Sequence[int], volumes: "np.ndarray | None" = None) -> Sharding | None:
    """Return `classify` of the boxes with these sizes (offsets do not matter to it), or None
    when `column_volumes` cannot count them (`volumes`: theirs, when the caller has them)."""
    volumes = column_volumes(sizes) if volumes is None else volumes
    extent = column_shape(shape)
    if volumes is None or extent is None or sizes.shape[1] != len(shape):
        return None
    nonempty = sizes if not len(sizes) or int(volumes.min()) > 0 else sizes[volumes > 0]
    empty = len(sizes) - len(nonempty)
    if volume(shape) == 0:
        return Sharding("empty", False, empty)
    if len(nonempty) <= 1:
        whole = len(nonempty) == 1 and bool((nonempty[0] == extent).all())
        return Sharding("replicated" if whole else "partial", False, empty)
    split_dims = [dim for dim in range(len(shape)) if (nonempty[:, dim] != extent[dim]).any()]  # .any(axis=0) is slow
    if len(split_dims) == 1:
        extents = nonempty[:, split_dims[0]]
        return Sharding(f"dim{split_dims[0]}", bool((extents != extents[0]).any()), empty)
    return Sharding("block", False, empty)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Return the elements `[start, stop)` of a row-major tensor of `shape` as boxes
    `(offsets, sizes, flat_start)`, each contiguous in row-major order (so each is one byte
    range of a flat buffer holding those elements): at most 2 * ndim - 1 of them.

    A flat partition (DeepSpeed ZeRO's, FSDP1's) cuts a tensor mid-row; its piece of the
    tensor is then a partial row, whole rows, and a partial row.

    Example:
        >>> flat_boxes((3, 4), 2, 9)
        [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 1), 8)]
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])  # > 0: a tensor with a zero dimension has no [start, stop)
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def within(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row, *offsets), (1, *sizes), row * inner + flat)
                for offsets, sizes, flat in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return within(first, head, tail)
    boxes = []
    if head:
        boxes += within(first, head, inner)
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    if tail:
        boxes += within(last, 0, tail)
    return boxes


def slab_rows(shape: Sequence[int], box: Box) -> tuple[int, int] | None:
    """Return (first row, row count) of `box` when it is a dim-0 slab of a tensor of `shape`
    (all of every dim but the first: FSDP's chunks, whole rows), else None.

    Example:
        >>> slab_rows((8, 4), ((2, 0), (3, 4))), slab_rows((8, 4), ((2, 0), (3, 2)))
        ((2, 3), None)
    """
    offsets, sizes = box
    if not shape or len(offsets) != len(shape) or len(sizes) != len(shape):
        return None
    if any(offsets[1:]) or tuple(sizes[1:]) != tuple(shape[1:]):
        return None
    return offsets[0], sizes[0]
