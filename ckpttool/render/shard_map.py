"""The shard map: what the HTML page of `inspect --html` and `validate --html` draws, as pure data.

Built from an inspect report (and validate's problems): bytes by group, by module (one row per
layer) and by file; per tensor one summary row and its chunks as one int64 array, so that a
checkpoint of 100k+ chunks is a few arrays, not 100k objects. The page (`render/html.py`) draws a
tensor's chunks only when it is opened.

Example:
    >>> shard_map = build(inspect("runs/x/step-00000020"))
    >>> row = shard_map.tensors[0]
    >>> row.axes, row.chunks[0]            # a dim-0 split: drawn as bars along dim 0
    ((0,), array([0, 0, 86, 64, 0]))       # offsets, sizes, file number
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ckpttool.commands.inspect import ChunkInfos, FileInfo, GroupInfo, InspectReport, Summary, TensorInfo
from ckpttool.check.integrity import Problem

if TYPE_CHECKING:
    import numpy as np

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True)
class ModuleBytes:
    """The tensors of one module (a layer: `model.layers.3`) of one group, and their bytes."""

    group: str
    module: str
    tensors: int
    nbytes: int  # logical: numel * itemsize
    stored_bytes: int  # element bytes of every chunk, copies included


@dataclass(frozen=True)
class TensorMap:
    """One tensor as the page shows it: a summary row, and its chunks to draw on demand.

    `chunks` is an int64 array of one row per chunk: its offsets, its sizes (one per
    dimension each), then the number of its data file in `ShardMap.files` (-1: no blob).
    `axes` are the dimensions drawn: one (bars along it) or two (a grid, rows x columns).
    `copies` is the most times one box is stored; `duplicate_bytes` what the copies beyond the
    first take.
    """

    fqn: str
    group: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    sharding: str
    uneven: bool
    axes: tuple[int, ...]
    copies: int
    duplicate_bytes: int
    ranks: int  # ranks (or files, where files name no rank) holding a chunk
    chunks: "np.ndarray"
    problems: tuple[int, ...]  # indices into ShardMap.problems


@dataclass(frozen=True)
class ShardMap:
    """Everything the page shows. `files` numbers the data files the chunks refer to; `problems`
    are validate's (empty for `inspect --html`); `validated` says whether validate ran."""

    path: str
    layout: str
    summary: Summary | None
    groups: dict[str, GroupInfo]
    files: tuple[FileInfo, ...]
    modules: tuple[ModuleBytes, ...]
    tensors: tuple[TensorMap, ...]
    problems: tuple[Problem, ...] = ()
    validated: bool = False
    filters: tuple[str, ...] = ()

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def duplicate_bytes(self) -> int:
        return sum(t.duplicate_bytes for t in self.tensors)


def module_of(fqn: str) -> str:
    """Return the module a tensor's bytes are counted under: the fqn up to its first index
    (one row per layer), else without its last part.

    Example:
        >>> module_of("model.layers.3.attn.wq.weight"), module_of("model.tok_emb.weight")
        ('model.layers.3', 'model.tok_emb')
    """
    parts = fqn.split(".")
    for at, part in enumerate(parts[1:], start=1):
        if _INDEX.match(part):
            return ".".join(parts[:at + 1])
    return ".".join(parts[:-1]) or fqn


def chunk_rows(tensor: TensorInfo, file_numbers: dict[str, int]) -> "np.ndarray":
    """Return the chunks of `tensor` as rows of offsets, sizes and file number (int64)."""
    import numpy as np

    ndim = len(tensor.shape)
    if isinstance(tensor.chunks, ChunkInfos):
        table = tensor.chunks.table
        numbers = np.array([file_numbers.get(name, -1) for name in table.files] + [-1], dtype=np.int64)
        count = len(table)
        return np.concatenate([table.offsets.reshape(count, ndim), table.sizes.reshape(count, ndim),
                               numbers[table.file].reshape(count, 1)], axis=1).astype(np.int64)
    rows = [(*c.offsets, *c.sizes, file_numbers.get(c.file, -1) if c.file is not None else -1) for c in tensor.chunks]
    return np.array(rows, dtype=np.int64).reshape(len(rows), 2 * ndim + 1)


def drawn_axes(shape: Sequence[int], rows: "np.ndarray") -> tuple[int, ...]:
    """Return the dimensions to draw: the split ones (at most two, a grid), else dim 0 (a bar);
    () for a 0-d tensor."""
    ndim = len(shape)
    if ndim == 0:
        return ()
    sizes = rows[:, ndim:2 * ndim]
    nonempty = sizes[(sizes > 0).all(axis=1)] if ndim else sizes
    split = [d for d in range(ndim) if len(nonempty) and bool((nonempty[:, d] != shape[d]).any())]
    return tuple(split[:2]) if split else (0,)


def copy_counts(rows: "np.ndarray", ndim: int) -> "np.ndarray":
    """Return, per chunk, how many chunks have its box (offsets and sizes): 2 for each of two
    replicas of a box."""
    import numpy as np

    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    if ndim == 0:  # every chunk of a 0-d tensor is the whole of it
        return np.full(len(rows), len(rows), dtype=np.int64)
    _, inverse, counts = np.unique(rows[:, :2 * ndim], axis=0, return_inverse=True, return_counts=True)
    return counts[inverse.reshape(-1)]


def _tensor_map(tensor: TensorInfo, file_numbers: dict[str, int], file_ranks: "np.ndarray",
                problems: tuple[int, ...]) -> TensorMap:
    import numpy as np

    ndim = len(tensor.shape)
    rows = chunk_rows(tensor, file_numbers)
    itemsize = tensor.nbytes // tensor.numel if tensor.numel else 0
    volumes = np.prod(rows[:, ndim:2 * ndim], axis=1, dtype=np.int64) if ndim else np.ones(len(rows), dtype=np.int64)
    stored = int(volumes.sum()) * itemsize
    counts = copy_counts(rows, ndim)
    # each box once: a box held by k chunks adds (k - 1) / k of its bytes per chunk, summed exactly
    duplicate = int((volumes * (counts - 1) // np.maximum(counts, 1)).sum()) * itemsize if len(rows) else 0
    holders = file_ranks[rows[:, -1]] if len(rows) else np.zeros(0, dtype=np.int64)
    return TensorMap(
        tensor.fqn, tensor.group, tensor.dtype, tensor.shape, tensor.nbytes, stored, tensor.sharding.kind,
        tensor.sharding.uneven, drawn_axes(tensor.shape, rows), int(counts.max()) if len(counts) else 0,
        duplicate, len(set(holders[holders != -1].tolist())) if len(holders) else 0, rows, problems)


def build(report: InspectReport | None, problems: Sequence[Problem] = (), path: str | Path | None = None,
          validated: bool = False) -> ShardMap:
    """Return the shard map of an inspect report, with validate's `problems` (`validated`:
    validate ran, so no problems means none found). `report` may be None when the metadata
    could not be read: the page then lists the problems alone."""
    import numpy as np

    problems = tuple(problems)
    if report is None:
        return ShardMap(str(path or ""), "", None, {}, (), (), (), problems, validated)
    by_fqn: dict[str, list[int]] = defaultdict(list)
    for index, problem in enumerate(problems):
        if problem.fqn is not None:
            by_fqn[problem.fqn].append(index)
    file_numbers = {f.file: number for number, f in enumerate(report.files)}
    # a chunk's holder: the rank of its file, else the file itself (numbered past the ranks); -1: no file
    first_unranked = max((f.rank for f in report.files if f.rank is not None), default=-1) + 1
    ranks = [f.rank if f.rank is not None else first_unranked + number for number, f in enumerate(report.files)]
    file_ranks = np.array(ranks + [-1], dtype=np.int64)
    tensors = tuple(_tensor_map(t, file_numbers, file_ranks, tuple(by_fqn.get(t.fqn, ()))) for t in report.tensors)
    modules: dict[tuple[str, str], list[int]] = {}
    for tensor in tensors:
        counted = modules.setdefault((tensor.group, module_of(tensor.fqn)), [0, 0, 0])
        counted[0] += 1
        counted[1] += tensor.nbytes
        counted[2] += tensor.stored_bytes
    return ShardMap(
        str(path or report.path), report.layout, report.summary, report.groups, report.files,
        tuple(ModuleBytes(group, module, *counted) for (group, module), counted in modules.items()),
        tensors, problems, validated, report.filters)

