"""ReshardPlan: which rank file gets which chunk, and which source bytes fill it (pure data).

Planning reads nothing but the metadata. For a target world of N ranks (or an HSDP mesh of
R replicas x S shards, N = R * S) it decides, the way FSDP2's `fully_shard` lays state out:

- which tensors are sharded (`is_sharded`, the rule below) and their dim-0 split over S
  ranks (`layout.split_dim0`: torch.chunk sizes, empty shards past the chunk count);
- which rank's file holds each chunk: a sharded chunk lives with a rank that owns it, and
  anything several ranks hold (replicated tensors, objects, HSDP replicas, identical empty
  chunks) is written once, by the least-loaded holder, exactly as DCP's `dedup_save_plans`
  balances a real save;
- for each target chunk, the byte runs of source chunks that fill it, as offsets into the
  chunks' raw row-major bytes (the executor finds those with `dcp.blobs.locate`).

The sharding rule (`ReshardPlan.rule`), chosen from the source:
- `source`: the source is sharded (some tensor has several chunks). Tensors it shards stay
  sharded; a single-chunk tensor is sharded only when it is a parameter by the optimizer's
  account (below), else it is replicated (a buffer) and stays whole.
- `optimizer-state`: a single-rank source (saved at world 1 or without a process group) with
  optimizer state: a model tensor is a parameter when the optimizer's state is keyed by its
  name (`<opt>.state.<name>.*`, wherever `model_view.find_model` finds the model and the
  optimizer); parameters and their non-0-d optimizer state are sharded, everything else (buffers,
  0-d `step`, non-model entries) stays whole. Parameters without optimizer state (frozen
  ones) cannot be told from buffers and stay whole (DCP still loads them).
- `every-tensor`: a single-rank source without optimizer state: parameters cannot be told
  from buffers, so every tensor of one or more dimensions is sharded along dim 0, as FSDP2
  shards parameters (stock `dcp.load` reads a buffer stored either way).
Tensors matching a `keep_whole` glob stay in one piece under every rule.

Example:
    >>> plan = plan_reshard(read_checkpoint("ckpt/step-00000100"), Mesh(1, 3))
    >>> [(f.rank, len(f.chunks), f.nbytes) for f in plan.files]
    [(0, 12, 1088), (1, 11, 1056), (2, 11, 612)]
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ckpttool.core.checkpoint import Blob, Checkpoint, ChunkTable, Tensor, paused_gc
from ckpttool.dcp.writer import data_file_name
from ckpttool.core.errors import CorruptMetadata, UnsupportedFormat, UsageError
from ckpttool.core.geometry import (COLUMN_LIMIT, Box, dim0_slabs, overlapping_boxes, positions_in_groups, row_major_runs,
                               torch_chunk, volume)
from ckpttool.model.model_view import ModelView, find_model


@dataclass(frozen=True)
class Mesh:
    """The target layout: `replicas` x `shards` ranks (FSDP: one replica; HSDP: several).

    Rank `r * shards + s` holds shard `s` in replica `r`, as `init_device_mesh(
    "cpu", (replicas, shards))` numbers them.
    """

    replicas: int
    shards: int

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    def holders(self, shard: int) -> tuple[int, ...]:
        """Return the ranks that own shard `shard` (one per replica)."""
        return tuple(r * self.shards + shard for r in range(self.replicas))

    def __str__(self) -> str:
        return f"{self.replicas}x{self.shards}" if self.replicas > 1 else str(self.shards)


def parse_mesh(world_size: int | None, mesh: str | tuple[int, int] | None) -> Mesh:
    """Return the Mesh for `--world N` and/or `--mesh R,S` (R replicas x S shards).

    Example:
        >>> parse_mesh(4, "2,2")
        Mesh(replicas=2, shards=2)
    """
    if mesh is None:
        if world_size is None:
            raise UsageError("give the target world size (--world N) or an HSDP mesh (--mesh R,S)")
        if world_size < 1:
            raise UsageError(f"--world {world_size}: the world size must be at least 1")
        return Mesh(1, world_size)
    if isinstance(mesh, str):
        parts = mesh.replace("x", ",").split(",")
        try:
            replicas, shards = (int(p) for p in parts)
        except ValueError:
            raise UsageError(f"--mesh {mesh!r}: expected R,S (replicas,shards), e.g. 2,4") from None
    else:
        replicas, shards = mesh
    if replicas < 1 or shards < 1:
        raise UsageError(f"--mesh {replicas},{shards}: both sizes must be at least 1")
    if world_size is not None and world_size != replicas * shards:
        raise UsageError(f"--world {world_size} does not match --mesh {replicas},{shards} ({replicas * shards} ranks)")
    return Mesh(replicas, shards)


@dataclass(frozen=True)
class Run:
    """Bytes of one source chunk that land in a target chunk (offsets into raw bytes)."""

    source_chunk: int  # index into the source Tensor.chunks
    source_offset: int
    target_offset: int
    length: int


@dataclass(frozen=True)
class TargetChunk:
    """One chunk of the resharded checkpoint and how to fill it."""

    fqn: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    runs: tuple[Run, ...]


@dataclass(frozen=True)
class TargetObject:
    """A non-tensor entry, copied verbatim from its source blob (or written from the bytes
    its reader made: `checkpoint.Object.data`)."""

    fqn: str
    source: Blob | bytes


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the resharded checkpoint: whether it is sharded and its chunks in order."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    sharded: bool
    starts: tuple[int, ...]  # first rows of its chunks (dim-0 slabs), in metadata order

    @property
    def chunks(self) -> tuple[tuple[int, ...], ...]:
        """The offsets of its chunks, in metadata order."""
        if not self.shape:
            return ((),)
        zeros = (0,) * (len(self.shape) - 1)
        return tuple((start, *zeros) for start in self.starts)


@dataclass(frozen=True, eq=False)
class TargetTable:
    """Every chunk of the resharded checkpoint as columns (numpy int64), in file order: by
    owning rank, then the state dict's order, then first row. Every target box is a dim-0
    slab (a shard's rows, or the whole tensor), so `start` and `rows` say all of it; chunk
    `i` is filled by runs `run_bounds[i]` to `run_bounds[i + 1]` of the run columns. A 300k
    chunk plan is a few arrays here instead of a TargetChunk and its Runs per chunk."""

    tensors: tuple[TensorLayout, ...]
    tensor: Any  # index into `tensors`
    box: Any  # index of the chunk in its tensor's `chunks`
    start: Any  # first row (0 for a 0-d tensor)
    rows: Any  # rows (1 for a 0-d tensor)
    owner: Any  # the rank whose file holds it
    nbytes: Any
    run_bounds: Any
    run_source: Any  # index into the source Tensor.chunks
    run_source_offset: Any
    run_target_offset: Any
    run_length: Any
    by_tensor: Any  # the chunks' positions here in metadata order: by tensor, then box
    tensor_bounds: Any  # tensor `t`'s chunks are by_tensor[tensor_bounds[t]:tensor_bounds[t + 1]]

    def __len__(self) -> int:
        return len(self.tensor)

    def chunk(self, index: int) -> TargetChunk:
        """Return chunk `index` as our frozen type."""
        layout = self.tensors[int(self.tensor[index])]
        start, rows = int(self.start[index]), int(self.rows[index])
        offsets, sizes = ((start, *(0 for _ in layout.shape[1:])), (rows, *layout.shape[1:])) if layout.shape else ((), ())
        begin, end = int(self.run_bounds[index]), int(self.run_bounds[index + 1])
        runs = tuple(Run(*values) for values in zip(
            self.run_source[begin:end].tolist(), self.run_source_offset[begin:end].tolist(),
            self.run_target_offset[begin:end].tolist(), self.run_length[begin:end].tolist()))
        return TargetChunk(layout.fqn, layout.dtype, offsets, sizes, int(self.nbytes[index]), runs)


class TargetChunks(Sequence[TargetChunk]):
    """Chunks `begin` to `end` of a TargetTable (a rank file's), each built when asked for."""

    __slots__ = ("table", "begin", "end")

    def __init__(self, table: TargetTable, begin: int, end: int):
        self.table, self.begin, self.end = table, begin, end

    def __len__(self) -> int:
        return self.end - self.begin

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.table.chunk(self.begin + index % len(self))

    def __iter__(self) -> Iterator[TargetChunk]:
        return (self.table.chunk(i) for i in range(self.begin, self.end))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return f"TargetChunks({list(self)!r})"


@dataclass(frozen=True)
class RankFile:
    """What rank `rank`'s data file holds, in file order (objects first, as torch writes)."""

    rank: int
    name: str
    objects: tuple[TargetObject, ...]
    chunks: TargetChunks  # a slice of the plan's table

    @property
    def nbytes(self) -> int:
        """Tensor data bytes (not counting record headers and objects)."""
        return int(self.chunks.table.nbytes[self.chunks.begin:self.chunks.end].sum())

    @property
    def tensors(self) -> int:
        import numpy as np

        return len(np.unique(self.chunks.table.tensor[self.chunks.begin:self.chunks.end]))


@dataclass(frozen=True)
class ReshardPlan:
    mesh: Mesh
    files: tuple[RankFile, ...]
    tensors: tuple[TensorLayout, ...]
    table: TargetTable
    planner_data: dict[str, tuple]
    rule: str = "source"  # the sharding rule that applied (module doc)
    keep_whole: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes.sum())


def sharded_by_optimizer(checkpoint: Checkpoint, view: ModelView) -> frozenset[str]:
    """Return the fqns the optimizer's account shards: the model's parameters its state is
    keyed by, and that state (`<opt>.state.<name>.<key>`).

    Raises AmbiguousModel when the state names parameters but the model could be either of
    two subtrees (`--model-prefix` decides).
    """
    states = {prefix + ".state." if prefix else "state." for prefix in view.optimizers}
    state = {fqn for fqn in checkpoint.tensors if any(fqn.startswith(s) for s in states)}
    if state and not view.parameters and view.candidates[1:]:
        view.require()
    return frozenset(view.parameters | state | checkpoint.parameters)


SOURCE_RULE, OPTIMIZER_STATE_RULE, EVERY_TENSOR_RULE = "source", "optimizer-state", "every-tensor"


def sharding_rule(checkpoint: Checkpoint, optimized: frozenset[str]) -> str:
    """Return which sharding rule of the module doc applies to `checkpoint`."""
    if any(len(tensor.chunks) > 1 for tensor in checkpoint.tensors.values()):
        return SOURCE_RULE
    return OPTIMIZER_STATE_RULE if optimized else EVERY_TENSOR_RULE


def is_sharded(tensor: Tensor, optimized: frozenset[str], rule: str = SOURCE_RULE,
               keep_whole: Sequence[str] = ()) -> bool:
    """Return True when FSDP2 would shard `tensor` along dim 0 (the rule in the module doc);
    `optimized` is `sharded_by_optimizer`'s set."""
    if not tensor.shape or any(fnmatch.fnmatchcase(tensor.fqn, glob) for glob in keep_whole):
        return False
    return len(tensor.chunks) > 1 or rule == EVERY_TENSOR_RULE or tensor.fqn in optimized


def _zip_runs(source: list[tuple[int, int]], target: list[tuple[int, int]], chunk_index: int) -> Iterator[Run]:
    """Pair two run lists that cover the same bytes in the same order, splitting as needed."""
    sources, targets = iter(source), iter(target)
    s_off, s_left = next(sources, (0, 0))
    t_off, t_left = next(targets, (0, 0))
    while s_left and t_left:
        length = min(s_left, t_left)
        yield Run(chunk_index, s_off, t_off, length)
        s_off, s_left, t_off, t_left = s_off + length, s_left - length, t_off + length, t_left - length
        if not s_left:
            s_off, s_left = next(sources, (0, 0))
        if not t_left:
            t_off, t_left = next(targets, (0, 0))


def fill_runs(tensor: Tensor, box: Box) -> tuple[Run, ...]:
    """Return the runs that fill target `box` of `tensor` from its source chunks.

    Raises CorruptMetadata when the source chunks do not cover the box exactly once.

    Example (rows 3..8 of a (10, 4) float32 tensor stored as rows 0..5 and 5..10):
        >>> [(r.source_chunk, r.source_offset, r.target_offset, r.length) for r in fill_runs(t, ((3, 0), (5, 4)))]
        [(0, 48, 0, 32), (1, 0, 32, 48)]
    """
    return fill_all_runs(tensor, [box])[0]


def fill_all_runs(tensor: Tensor, boxes: Sequence[Box]) -> list[tuple[Run, ...]]:
    """Return `fill_runs(tensor, box)` for each of `boxes`, in their order.

    One sweep along dim 0 pairs the target boxes with the source chunks they share elements
    with (`geometry.overlapping_boxes`): the cost grows with the chunks plus their overlaps,
    not with chunks x boxes (a world-128 source resharded for 256 ranks would otherwise try
    128 x 129 pairs per tensor).
    """
    itemsize = tensor.itemsize
    slabs = _slab_runs(tensor, boxes)
    if slabs is not None:
        return slabs
    sources = [(chunk.offsets, chunk.sizes) for chunk in tensor.chunks]
    found: list[list[Run]] = [[] for _ in boxes]
    for target, index, region in overlapping_boxes(boxes, sources):
        source_runs = row_major_runs(sources[index], region, itemsize)
        target_runs = row_major_runs(boxes[target], region, itemsize)
        found[target].extend(_zip_runs(source_runs, target_runs, index))
    filled = []
    for box, runs in zip(boxes, found):
        covered = sum(run.length for run in runs)
        expected = volume(box[1]) * itemsize
        if covered != expected:
            raise CorruptMetadata(
                f"{tensor.fqn}: the source chunks cover {covered} of the {expected} bytes of "
                f"box {list(box[0])}+{list(box[1])} (missing or overlapping chunks; run `ckpttool validate`)"
            )
        runs.sort(key=lambda run: run.target_offset)
        filled.append(tuple(runs))
    return filled


def _slab_runs(tensor: Tensor, boxes: Sequence[Box]) -> list[tuple[Run, ...]] | None:
    """`fill_all_runs` from the columns when every box is a dim-0 slab (`slab_run_columns`
    says when the source is one); None otherwise (the general sweep decides, and names what
    is wrong)."""
    import numpy as np

    shape = tensor.shape
    rest = tuple(shape[1:])
    if not shape or any(box[1][1:] != rest or any(box[0][1:]) for box in boxes):
        return None
    low = np.fromiter((box[0][0] for box in boxes), dtype=np.int64, count=len(boxes))
    high = low + np.fromiter((box[1][0] for box in boxes), dtype=np.int64, count=len(boxes))
    columns = slab_run_columns(tensor, low, high)
    if columns is None:
        return None
    runs = [Run(*values) for values in zip(*(column.tolist() for column in columns[1:]))]
    edges = columns[0].tolist()
    return [tuple(runs[a:b]) for a, b in zip(edges, edges[1:])]


def slab_run_columns(tensor: Tensor, low: Any, high: Any) -> tuple[Any, ...] | None:
    """Return (bounds, source chunk, source offset, target offset, length) columns of the runs
    filling the dim-0 slabs `low[i]` to `high[i]` of `tensor` (box `i`'s runs are
    `bounds[i]` to `bounds[i + 1]`) when the source is a table of dim-0 slabs tiling the
    tensor exactly once (FSDP's): each overlap of a source slab and a box is one run, found
    by bisecting the slabs' starts. None otherwise."""
    import numpy as np

    chunks, shape = tensor.chunks, tensor.shape
    if not isinstance(chunks, ChunkTable) or not shape or len(chunks) < 2:
        return None
    if not 0 < volume(shape) * tensor.itemsize < COLUMN_LIMIT:
        return None
    if len(low) and (low.min() < 0 or high.max() > shape[0]):
        return None
    offsets, sizes = chunks.offsets, chunks.sizes
    keep = np.flatnonzero((sizes > 0).all(axis=1))  # empty chunks share no element with anything
    if not len(keep):
        return None
    starts, rows = offsets[keep, 0], sizes[keep, 0]
    ends = starts + rows
    if (not dim0_slabs(shape, offsets[keep], sizes[keep])
            or starts[0] != 0 or ends[-1] != shape[0] or (starts[1:] != ends[:-1]).any()):
        return None
    row = volume(shape[1:]) * tensor.itemsize
    # a box's runs: from the slab holding its first row to the last slab starting before its end
    first = np.searchsorted(starts, low, side="right") - 1
    count = np.where(high > low, np.searchsorted(starts, high, side="left") - first, 0)
    bounds = np.concatenate(([0], np.cumsum(count)))
    box = np.repeat(np.arange(len(low)), count)
    source = first[box] + np.arange(bounds[-1]) - bounds[:-1][box]
    begin = np.maximum(low[box], starts[source])
    end = np.minimum(high[box], ends[source])
    return bounds, keep[source], (begin - starts[source]) * row, (begin - low[box]) * row, (end - begin) * row


def _state_dict_order(checkpoint: Checkpoint) -> list[str]:
    # the save's own order (planner_data is built while flattening the state dict), then
    # anything it does not name, sorted
    names = set(checkpoint.tensors) | set(checkpoint.objects)
    ordered = [fqn for fqn in checkpoint.nesting if fqn in names]
    seen = set(ordered)
    return ordered + sorted(names - seen)


@dataclass(frozen=True)
class _Slabs:
    """A tensor's target chunks before they are given to ranks: dim-0 slabs in metadata
    order. Sharded: shard `s` < `count` is box `s`; the shards past the chunk count share one
    empty box (as DCP dedups write items with equal offsets), box `count`, held by `empty`."""

    index: int  # in the plan's tensors
    sharded: bool
    count: int  # non-empty shards (sharded), or 1 (whole)
    starts: Any
    rows: Any
    empty: tuple[int, ...]  # ranks holding the empty box (none when every shard has rows)
    weight: int  # dedup_save_plans weighs an item by the bytes of the whole tensor (1 when 0)


def _slabs(index: int, tensor: Tensor, sharded: bool, mesh: Mesh) -> _Slabs:
    import numpy as np

    weight = volume(tensor.shape) * tensor.itemsize or 1
    if not sharded:
        whole = tensor.shape[0] if tensor.shape else 1
        return _Slabs(index, False, 1, np.zeros(1, np.int64), np.array([whole], np.int64), (), weight)
    # geometry.split_dim0 for every shard at once
    length = tensor.shape[0]
    step, count = torch_chunk(length, mesh.shards)
    starts = np.arange(count, dtype=np.int64) * step
    rows = np.minimum(step, length - starts)
    empty: tuple[int, ...] = ()
    if count < mesh.shards:
        starts, rows = np.append(starts, length), np.append(rows, 0)
        # the holders of shards count.. in every replica, ascending
        empty = tuple(np.add.outer(np.arange(mesh.replicas) * mesh.shards, np.arange(count, mesh.shards)).ravel().tolist())
    return _Slabs(index, True, count, starts, rows, empty, weight)


def _owners(slabs: dict[str, _Slabs], objects: list[str], order: list[str], mesh: Mesh) -> tuple[list[Any], dict[str, int]]:
    """Return the owning rank of each tensor's boxes (arrays, in `slabs` order) and of each
    object; `order` is the state dict's (the order of each rank's save plan).

    torch/distributed/checkpoint/_dedup_save_plans.py walks the ranks' plans in order; an
    item several ranks hold goes to the holder with the fewest bytes planned so far (on a
    tie, the first of its holders' set). An item one rank holds just adds to its load, so only the ranks
    that are the first holder of a shared item are walked item by item (rank 0, for
    replicated tensors and objects); the others add their own items' weight at once.
    """
    import numpy as np

    world, shards = mesh.world_size, mesh.shards
    everyone = tuple(range(world))
    single = mesh.replicas == 1
    own = np.zeros(world, dtype=np.int64)  # weight of the items only that rank holds
    walked: set[int] = set()
    if objects or any(not slab.sharded for slab in slabs.values()):
        walked.add(0)
    for slab in slabs.values():
        if not slab.sharded:
            if world == 1:
                own[0] += slab.weight
            continue
        if single:
            own[:slab.count] += slab.weight
        else:
            walked.update(range(slab.count))
        if len(slab.empty) == 1:
            own[slab.empty[0]] += slab.weight
        elif slab.empty:
            walked.add(slab.empty[0])
    load = [0] * world
    assigned: dict[tuple[str, int], int] = {}
    for rank in range(world):
        if rank not in walked:
            load[rank] += int(own[rank])
            continue
        shard = rank % shards
        for fqn in order:
            item = slabs.get(fqn)
            if item is None:
                key, holders, weight = (fqn, -1), everyone, 1
            elif not item.sharded:
                key, holders, weight = (fqn, 0), everyone, item.weight
            elif shard < item.count:
                key, holders, weight = (fqn, shard), mesh.holders(shard), item.weight
            else:
                key, holders, weight = (fqn, item.count), item.empty, item.weight
            if len(holders) == 1:
                load[rank] += weight
            elif key not in assigned:
                # torch takes min(plan_indices, key=size) over a set the ranks were added to in
                # order: a tie goes to the first in the set's iteration order, which is not the
                # lowest rank once ranks reach its table size (holders (3, 8) iterate 8, 3)
                owner = min(set(holders), key=load.__getitem__)
                assigned[key] = owner
                load[owner] += weight
    owners = []
    for fqn, slab in slabs.items():
        if not slab.sharded:
            owners.append(np.array([assigned[(fqn, 0)] if world > 1 else 0], dtype=np.int64))
            continue
        if single:
            found = np.arange(slab.count, dtype=np.int64)
        else:
            found = np.array([assigned[(fqn, shard)] for shard in range(slab.count)], dtype=np.int64)
        if slab.empty:
            found = np.append(found, slab.empty[0] if len(slab.empty) == 1 else assigned[(fqn, slab.count)])
        owners.append(found)
    return owners, {fqn: assigned[(fqn, -1)] if world > 1 else 0 for fqn in objects}


def plan_reshard(checkpoint: Checkpoint, mesh: Mesh, keep_whole: Sequence[str] = (),
                 view: ModelView | None = None, rule: str | None = None) -> ReshardPlan:
    """Return the plan that lays `checkpoint` out for `mesh` (reads no data files); tensors
    matching a `keep_whole` glob are not sharded; `view` is the model found in it (default:
    `find_model`'s); `rule` the sharding rule (default: `sharding_rule`'s; a converted view's
    chunks are its pieces, not a sharding, so import states EVERY_TENSOR_RULE).

    Raises UnsupportedFormat for dtypes of unknown size and CorruptMetadata when a tensor's
    chunks do not cover it.
    """
    with paused_gc():  # a few small acyclic objects per tensor and per shared chunk (see paused_gc)
        return _plan_reshard(checkpoint, mesh, keep_whole, view, rule)


def _plan_reshard(checkpoint: Checkpoint, mesh: Mesh, keep_whole: Sequence[str], view: ModelView | None,
                  stated: str | None) -> ReshardPlan:
    import numpy as np

    optimized = sharded_by_optimizer(checkpoint, view or find_model(checkpoint))
    rule = stated or sharding_rule(checkpoint, optimized)
    order = _state_dict_order(checkpoint)
    object_names = [fqn for fqn in order if fqn not in checkpoint.tensors]
    layouts: list[TensorLayout] = []
    slabs: list[_Slabs] = []
    for fqn in order:
        tensor = checkpoint.tensors.get(fqn)
        if tensor is None:
            continue
        if tensor.itemsize == 0:
            raise UnsupportedFormat(f"{checkpoint.path}: {fqn} has dtype {tensor.dtype!r}, whose size is unknown")
        slab = _slabs(len(slabs), tensor, is_sharded(tensor, optimized, rule, keep_whole), mesh)
        slabs.append(slab)
        layouts.append(TensorLayout(fqn, tensor.dtype, tensor.shape, slab.sharded, tuple(slab.starts.tolist())))
    owners, object_owners = _owners({layout.fqn: slab for layout, slab in zip(layouts, slabs)}, object_names, order, mesh)

    runs: list[tuple[Any, ...]] = []
    # a model's layers repeat: tensors of one shape, chunked alike, get the same runs (the
    # columns are only read from here on), worked out once (2169 tensors, ~40 geometries at 70B)
    geometries: dict[tuple, tuple[Any, ...]] = {}
    for layout, slab in zip(layouts, slabs):
        tensor = checkpoint.tensors[layout.fqn]
        key = _geometry(tensor, slab)
        found = geometries.get(key) if key is not None else None
        if found is None:
            found = _run_columns(tensor, slab)
            if key is not None:
                geometries[key] = found
        runs.append(found)
    counts = np.array([len(slab.starts) for slab in slabs], dtype=np.int64)
    tensor_of = np.repeat(np.arange(len(slabs), dtype=np.int64), counts)
    row_bytes = np.array([volume(t.shape[1:]) * checkpoint.tensors[t.fqn].itemsize for t in layouts], dtype=np.int64)
    join = (lambda arrays: np.concatenate(arrays) if arrays else np.zeros(0, np.int64))
    starts, rows = join([slab.starts for slab in slabs]), join([slab.rows for slab in slabs])
    owner = join(owners)
    # stable: within a rank, chunks keep the state dict's order and then their first row
    # (radix-sorted as 16-bit ranks: 10x faster than as int64)
    order_in_files = np.argsort(owner.astype(np.uint16) if mesh.world_size <= 1 << 16 else owner, kind="stable")
    by_tensor = np.empty_like(order_in_files)
    by_tensor[order_in_files] = np.arange(len(order_in_files))
    run_counts = join([np.diff(columns[0]) for columns in runs])
    run_bounds = np.concatenate(([0], np.cumsum(run_counts)))
    picked_counts = run_counts[order_in_files]
    picked = np.repeat(run_bounds[:-1][order_in_files], picked_counts) + positions_in_groups(picked_counts)
    run_source, run_source_offset, run_target_offset, run_length = (join([columns[k] for columns in runs])[picked]
                                                                    for k in range(1, 5))
    table = TargetTable(
        tuple(layouts), tensor_of[order_in_files], positions_in_groups(counts)[order_in_files],
        starts[order_in_files], rows[order_in_files], owner[order_in_files],
        (rows * row_bytes[tensor_of])[order_in_files],
        np.concatenate(([0], np.cumsum(picked_counts))),
        run_source, run_source_offset, run_target_offset, run_length,
        by_tensor, np.concatenate(([0], np.cumsum(counts))),
    )

    world = mesh.world_size
    objects: list[list[TargetObject]] = [[] for _ in range(world)]
    for fqn in object_names:
        entry = checkpoint.objects[fqn]
        source = entry.blob if entry.data is None else entry.data
        if source is None:
            raise CorruptMetadata(f"{checkpoint.path}: {fqn} has no storage entry in the metadata")
        objects[object_owners[fqn]].append(TargetObject(fqn, source))
    edges = np.searchsorted(table.owner, np.arange(world + 1)).tolist()
    files = tuple(RankFile(rank, data_file_name(rank), tuple(objects[rank]), TargetChunks(table, edges[rank], edges[rank + 1]))
                  for rank in range(world))
    planner_data = {fqn: checkpoint.nesting[fqn] for fqn in order if fqn in checkpoint.nesting}
    return ReshardPlan(mesh, files, tuple(layouts), table, planner_data, rule, tuple(keep_whole))


def _geometry(tensor: Tensor, slab: _Slabs) -> tuple | None:
    """Return what `_run_columns` of a ChunkTable tensor depends on, as a key (None for chunk
    tuples: those take the general sweep, whose errors name the tensor)."""
    chunks = tensor.chunks
    if not isinstance(chunks, ChunkTable):
        return None
    return (tensor.shape, tensor.itemsize, chunks.offsets.shape, chunks.offsets.tobytes(), chunks.sizes.tobytes(),
            slab.starts.tobytes(), slab.rows.tobytes())


def _run_columns(tensor: Tensor, slab: _Slabs) -> tuple[Any, ...]:
    """Return `slab_run_columns` of the slab's boxes, or the same columns from the general
    sweep (`fill_all_runs`) when the source is not a table of dim-0 slabs."""
    import numpy as np

    if tensor.shape:
        columns = slab_run_columns(tensor, slab.starts, slab.starts + slab.rows)
        if columns is not None:
            return columns
        zeros = (0,) * (len(tensor.shape) - 1)
        rest = tuple(tensor.shape[1:])
        boxes = [((start, *zeros), (rows, *rest)) for start, rows in zip(slab.starts.tolist(), slab.rows.tolist())]
    else:
        boxes = [((), ())]
    filled = fill_all_runs(tensor, boxes)
    counts = [len(runs) for runs in filled]
    flat = [run for runs in filled for run in runs]
    bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    return (bounds, *(np.array([getattr(run, name) for run in flat], dtype=np.int64)
                      for name in ("source_chunk", "source_offset", "target_offset", "length")))
