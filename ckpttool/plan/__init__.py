"""Plans: which source bytes go where, as pure data built from metadata and located blobs.

`operations` holds the four kinds of operation both planners use; `consolidate` and
`reshard` are the two planners. Nothing here reads or writes a file: `execute` runs a plan.
"""

from __future__ import annotations

from typing import Any, Sequence

from ckpttool.core.checkpoint import ChunkTable, Tensor


def unique_chunks(tensor: Tensor) -> list[int]:
    """Return the indices of chunks with elements, each box once: a replicated box (HSDP
    replicas, 0-d scalars saved by every rank) is read a single time."""
    if isinstance(tensor.chunks, ChunkTable):
        return _unique_rows(tensor.chunks)
    seen: set = set()
    indices = []
    for index, chunk in enumerate(tensor.chunks):
        box = (chunk.offsets, chunk.sizes)
        if chunk.numel and box not in seen:
            seen.add(box)
            indices.append(index)
    return indices


def _unique_rows(table: ChunkTable) -> list[int]:
    """`unique_chunks` on columns: the first row of each distinct box among the non-empty ones."""
    import numpy as np

    nonempty = np.flatnonzero((table.sizes > 0).all(axis=1))
    if not len(nonempty):
        return []
    boxes = np.concatenate([table.offsets[nonempty], table.sizes[nonempty]], axis=1)
    _, first = np.unique(boxes, axis=0, return_index=True)
    return nonempty[np.sort(first)].tolist()


def unique_table_rows(tables: Sequence[ChunkTable]) -> list[Any]:
    """`unique_chunks` of many tables at once, each table's indices as an int64 numpy array.

    A table whose non-empty rows have strictly ascending offsets (as FSDP and TP shardings
    save: no box twice) keeps all of them, found for all such tables with a few array
    operations; a table of 0-d rows keeps its first non-empty one; the rest (replicated
    boxes, unsorted rows) go through `_unique_rows` one by one.
    """
    import numpy as np

    found: list[Any] = [None] * len(tables)
    by_ndim: dict[int, list[int]] = {}
    for number, table in enumerate(tables):
        by_ndim.setdefault(table.offsets.shape[1], []).append(number)
    for ndim, numbers in by_ndim.items():
        counts = np.array([len(tables[n].file) for n in numbers], dtype=np.int64)
        if ndim == 0:  # one box, (): non-empty always
            for number, count in zip(numbers, counts.tolist()):
                found[number] = np.zeros(min(count, 1), dtype=np.int64)
            continue
        offsets = np.concatenate([tables[n].offsets for n in numbers])
        sizes = np.concatenate([tables[n].sizes for n in numbers])
        owner = np.repeat(np.arange(len(numbers)), counts)
        rows = np.flatnonzero((sizes > 0).all(axis=1))  # non-empty, in table order
        before, after = offsets[rows[:-1]], offsets[rows[1:]]
        differ = before != after
        first = differ.argmax(axis=1)
        ascending = differ.any(axis=1) & (np.take_along_axis(after, first[:, None], 1) > np.take_along_axis(before, first[:, None], 1))[:, 0]
        same_table = owner[rows[:-1]] == owner[rows[1:]]
        doubtful = np.zeros(len(numbers), dtype=bool)
        doubtful[owner[rows[:-1]][same_table & ~ascending]] = True
        base = np.cumsum(counts) - counts
        kept = np.split(rows - base[owner[rows]], np.searchsorted(owner[rows], np.arange(1, len(numbers))))
        for place, number in enumerate(numbers):
            found[number] = _unique_rows_array(tables[number]) if doubtful[place] else kept[place]
    return found


def _unique_rows_array(table: ChunkTable) -> Any:
    import numpy as np

    return np.array(_unique_rows(table), dtype=np.int64)
