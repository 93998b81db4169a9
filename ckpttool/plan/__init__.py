"""Plans: which source bytes go where, as pure data built from metadata and located blobs.

`operations` holds the four kinds of operation both planners use; `consolidate` and
`reshard` are the two planners. Nothing here reads or writes a file: `execute` runs a plan.
"""

from __future__ import annotations

from ckpttool.checkpoint import ChunkTable, Tensor


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
