"""Plans: which source bytes go where, as pure data built from metadata and located blobs.

`operations` holds the four kinds of operation both planners use; `consolidate` and
`reshard` are the two planners. Nothing here reads or writes a file: `execute` runs a plan.
"""

from __future__ import annotations

from ckpttool.checkpoint import Tensor


def unique_chunks(tensor: Tensor) -> list[int]:
    """Return the indices of chunks with elements, each box once: a replicated box (HSDP
    replicas, 0-d scalars saved by every rank) is read a single time."""
    seen: set = set()
    indices = []
    for index, chunk in enumerate(tensor.chunks):
        box = (chunk.offsets, chunk.sizes)
        if chunk.numel and box not in seen:
            seen.add(box)
            indices.append(index)
    return indices
