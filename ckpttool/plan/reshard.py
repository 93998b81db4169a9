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
from typing import Iterator, Mapping, Sequence

from ckpttool.checkpoint import Blob, Checkpoint, ChunkTable, Tensor, paused_gc
from ckpttool.dcp.blobs import RawData
from ckpttool.dcp.writer import StoredChunk, StoredObject, StoredTensor, data_file_name
from ckpttool.errors import CorruptMetadata, UnsupportedFormat, UsageError
from ckpttool.geometry import COLUMN_LIMIT, Box, dim0_slabs, overlapping_boxes, row_major_runs, split_dim0, volume
from ckpttool.model_view import ModelView, find_model
from ckpttool.plan.operations import Copy, Gather, Operation, Record
from ckpttool.torchsave.record import record_layout


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
    """A non-tensor entry, copied verbatim from its source blob."""

    fqn: str
    source: Blob


@dataclass(frozen=True)
class RankFile:
    """What rank `rank`'s data file holds, in file order (objects first, as torch writes)."""

    rank: int
    name: str
    objects: tuple[TargetObject, ...]
    chunks: tuple[TargetChunk, ...]

    @property
    def nbytes(self) -> int:
        """Tensor data bytes (not counting record headers and objects)."""
        return sum(chunk.nbytes for chunk in self.chunks)

    @property
    def tensors(self) -> int:
        return len({chunk.fqn for chunk in self.chunks})


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the resharded checkpoint: whether it is sharded and its chunks in order."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    sharded: bool
    chunks: tuple[tuple[int, ...], ...]  # offsets of its chunks, in metadata order


@dataclass(frozen=True)
class ReshardPlan:
    mesh: Mesh
    files: tuple[RankFile, ...]
    tensors: tuple[TensorLayout, ...]
    planner_data: dict[str, tuple]
    rule: str = "source"  # the sharding rule that applied (module doc)
    keep_whole: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


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
    return frozenset(view.parameters | state)


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
    """`fill_all_runs` from the columns when the source is a table of dim-0 slabs tiling the
    tensor exactly once (FSDP's) and every box is a dim-0 slab: each overlap of a source slab
    and a box is one run, found by bisecting the slabs' starts. None otherwise (the general
    sweep decides, and names what is wrong)."""
    chunks = tensor.chunks
    if not isinstance(chunks, ChunkTable) or not tensor.shape or len(chunks) < 2:
        return None
    import numpy as np

    shape = tensor.shape
    rest = tuple(shape[1:])
    if not 0 < volume(shape) * tensor.itemsize < COLUMN_LIMIT:
        return None
    if any(box[1][1:] != rest or any(box[0][1:]) or box[0][0] < 0 or box[0][0] + box[1][0] > shape[0] for box in boxes):
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
    row = volume(rest) * tensor.itemsize
    low = np.fromiter((box[0][0] for box in boxes), dtype=np.int64, count=len(boxes))
    high = low + np.fromiter((box[1][0] for box in boxes), dtype=np.int64, count=len(boxes))
    # a box's runs: from the slab holding its first row to the last slab starting before its end
    first = np.searchsorted(starts, low, side="right") - 1
    count = np.where(high > low, np.searchsorted(starts, high, side="left") - first, 0)
    bounds = np.concatenate(([0], np.cumsum(count)))
    box = np.repeat(np.arange(len(boxes)), count)
    source = first[box] + np.arange(bounds[-1]) - bounds[:-1][box]
    begin = np.maximum(low[box], starts[source])
    end = np.minimum(high[box], ends[source])
    runs = [Run(*values) for values in zip(keep[source].tolist(), ((begin - starts[source]) * row).tolist(),
                                            ((begin - low[box]) * row).tolist(), ((end - begin) * row).tolist())]
    edges = bounds.tolist()
    return [tuple(runs[a:b]) for a, b in zip(edges, edges[1:])]


# an item of a rank's save plan, as dedup_save_plans sees it: (fqn, offsets (None for an
# object), holders, weight in its balancing); a plain tuple, made once per target chunk
_Item = tuple[str, "tuple[int, ...] | None", "tuple[int, ...]", int]


def _state_dict_order(checkpoint: Checkpoint) -> list[str]:
    # the save's own order (planner_data is built while flattening the state dict), then
    # anything it does not name, sorted
    names = set(checkpoint.tensors) | set(checkpoint.objects)
    ordered = [fqn for fqn in checkpoint.nesting if fqn in names]
    seen = set(ordered)
    return ordered + sorted(names - seen)


def _target_boxes(tensor: Tensor, sharded: bool, mesh: Mesh) -> list[tuple[Box, tuple[int, ...]]]:
    """Return (box, holders) for each distinct chunk of `tensor` on the target mesh."""
    if not sharded:
        whole = (tuple(0 for _ in tensor.shape), tuple(tensor.shape))
        return [(whole, tuple(range(mesh.world_size)))]
    rest = tuple(tensor.shape[1:])
    zeros = (0,) * len(rest)
    boxes: list[tuple[Box, list[int]]] = []
    empty: tuple[Box, list[int]] | None = None
    for shard, (start, rows) in enumerate(split_dim0(tensor.shape[0], mesh.shards)):
        holders = (shard,) if mesh.replicas == 1 else mesh.holders(shard)
        if rows:  # the non-empty shards start at distinct rows
            boxes.append((((start, *zeros), (rows, *rest)), list(holders)))
        elif empty is None:
            # the empty shards past the chunk count are one chunk, as DCP dedups write
            # items with equal (fqn, offsets)
            empty = (((start, *zeros), (0, *rest)), list(holders))
            boxes.append(empty)
        else:
            empty[1].extend(holders)
    return [(box, tuple(sorted(holders))) for box, holders in boxes]


def plan_reshard(checkpoint: Checkpoint, mesh: Mesh, keep_whole: Sequence[str] = (),
                 view: ModelView | None = None) -> ReshardPlan:
    """Return the plan that lays `checkpoint` out for `mesh` (reads no data files); tensors
    matching a `keep_whole` glob are not sharded; `view` is the model found in it (default:
    `find_model`'s).

    Raises UnsupportedFormat for dtypes of unknown size and CorruptMetadata when a tensor's
    chunks do not cover it.
    """
    with paused_gc():  # a few small acyclic objects per chunk (see paused_gc)
        return _plan_reshard(checkpoint, mesh, keep_whole, view)


def _plan_reshard(checkpoint: Checkpoint, mesh: Mesh, keep_whole: Sequence[str], view: ModelView | None) -> ReshardPlan:
    optimized = sharded_by_optimizer(checkpoint, view or find_model(checkpoint))
    rule = sharding_rule(checkpoint, optimized)
    order = _state_dict_order(checkpoint)
    layouts: dict[str, TensorLayout] = {}
    boxes_of: dict[str, list[Box]] = {}
    items_by_rank: list[list[_Item]] = [[] for _ in range(mesh.world_size)]
    for fqn in order:
        tensor = checkpoint.tensors.get(fqn)
        if tensor is None:
            item = (fqn, None, tuple(range(mesh.world_size)), 1)
            for rank in item[2]:
                items_by_rank[rank].append(item)
            continue
        if tensor.itemsize == 0:
            raise UnsupportedFormat(f"{checkpoint.path}: {fqn} has dtype {tensor.dtype!r}, whose size is unknown")
        sharded = is_sharded(tensor, optimized, rule, keep_whole)
        boxes = _target_boxes(tensor, sharded, mesh)
        boxes_of[fqn] = [box for box, _ in boxes]
        layouts[fqn] = TensorLayout(fqn, tensor.dtype, tensor.shape, sharded, tuple(b[0] for b, _ in boxes))
        # dedup_save_plans weighs an item by WriteItem.tensor_storage_size(), which is the
        # bytes of the whole tensor (not of the chunk), or 1 when that is 0
        weight = volume(tensor.shape) * tensor.itemsize or 1
        for box, holders in boxes:
            item = (fqn, box[0], holders, weight)
            for rank in holders:
                items_by_rank[rank].append(item)

    # torch/distributed/checkpoint/_dedup_save_plans.py: walk the ranks' plans in order; each
    # item goes to the holder with the fewest bytes planned so far
    load = [0] * mesh.world_size
    assigned: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for rank_items in items_by_rank:
        for fqn, offsets, holders, weight in rank_items:
            key = (fqn, offsets)
            if key in assigned:
                continue
            owner = holders[0] if len(holders) == 1 else min(holders, key=lambda rank: (load[rank], rank))
            assigned[key] = owner
            load[owner] += weight

    objects: list[list[TargetObject]] = [[] for _ in range(mesh.world_size)]
    chunks: list[list[TargetChunk]] = [[] for _ in range(mesh.world_size)]
    for fqn in order:
        tensor = checkpoint.tensors.get(fqn)
        if tensor is None:
            source = checkpoint.objects[fqn].blob
            if source is None:
                raise CorruptMetadata(f"{checkpoint.path}: {fqn} has no storage entry in the metadata")
            objects[assigned[(fqn, None)]].append(TargetObject(fqn, source))
            continue
        boxes = boxes_of[fqn]
        dtype, itemsize = tensor.dtype, tensor.itemsize
        for (offsets, sizes), runs in zip(boxes, fill_all_runs(tensor, boxes)):
            target = TargetChunk(fqn, dtype, offsets, sizes, volume(sizes) * itemsize, runs)
            chunks[assigned[(fqn, offsets)]].append(target)
    files = tuple(
        RankFile(rank, data_file_name(rank), tuple(objects[rank]), tuple(chunks[rank]))
        for rank in range(mesh.world_size)
    )
    planner_data = {fqn: checkpoint.nesting[fqn] for fqn in order if fqn in checkpoint.nesting}
    tensors = tuple(layouts[f] for f in order if f in layouts)
    return ReshardPlan(mesh, files, tensors, planner_data, rule, tuple(keep_whole))


@dataclass(frozen=True)
class ReshardWrites:
    """The resharded checkpoint as bytes: each rank file's size, the operations that fill the
    files (objects copied verbatim, then one torch.save record per chunk) and the entries
    `.metadata` records for them."""

    files: tuple[tuple[str, int], ...]  # (file name, size)
    operations: tuple[Operation, ...]
    tensors: tuple[StoredTensor, ...]
    objects: tuple[StoredObject, ...]

    @property
    def file_bytes(self) -> int:
        return sum(size for _, size in self.files)


def plan_writes(plan: ReshardPlan, checkpoint: Checkpoint, located: Mapping[str, Mapping[int, RawData | None]]) -> ReshardWrites:
    """Return where every byte of `plan` goes (pure: reads nothing); `located` says where each
    source chunk's raw bytes are (None: its blob is decoded)."""
    with paused_gc():  # a few small acyclic objects per chunk (see paused_gc)
        return _plan_writes(plan, checkpoint, located)


def _plan_writes(plan: ReshardPlan, checkpoint: Checkpoint, located: Mapping[str, Mapping[int, RawData | None]]) -> ReshardWrites:
    files, operations, objects = [], [], []
    stored: dict[tuple[str, tuple[int, ...]], StoredChunk] = {}
    for rank_file in plan.files:
        at = 0
        for obj in rank_file.objects:
            source = obj.source
            objects.append(StoredObject(obj.fqn, rank_file.name, at, source.length, source.transforms))
            operations.append(Copy(source.file, source.offset, rank_file.name, at, source.length))
            at += source.length
        name = rank_file.name
        for chunk in rank_file.chunks:
            layout = record_layout(chunk.dtype, chunk.sizes)
            data_start = at + layout.data_offset
            runs, sources = chunk.runs, located[chunk.fqn]
            raw = sources[runs[0].source_chunk] if len(runs) == 1 else None
            if raw is not None:  # the common case: one run of raw bytes
                run = runs[0]
                parts: tuple[Copy | Gather, ...] = (
                    Copy(raw.file, raw.offset + run.source_offset, name, data_start + run.target_offset, run.length),)
            else:
                parts = _record_parts(checkpoint.tensors[chunk.fqn], chunk, sources, name, data_start)
            operations.append(Record(name, at, chunk.fqn, chunk.offsets, chunk.dtype, chunk.sizes, parts))
            length = layout.length
            stored[(chunk.fqn, chunk.offsets)] = StoredChunk(chunk.offsets, chunk.sizes, name, at, length)
            at += length
        files.append((rank_file.name, at))
    tensors = tuple(
        StoredTensor(t.fqn, t.dtype, t.shape, tuple(stored[(t.fqn, offsets)] for offsets in t.chunks))
        for t in plan.tensors
    )
    return ReshardWrites(tuple(files), tuple(operations), tensors, tuple(objects))


def _record_parts(tensor: Tensor, chunk: TargetChunk, located: Mapping[int, RawData | None], file: str,
                  data_start: int) -> tuple[Copy | Gather, ...]:
    parts: list[Copy | Gather] = []
    decoded: dict[int, list[tuple[int, int, int]]] = {}
    for run in chunk.runs:
        raw = located[run.source_chunk]
        if raw is None:
            decoded.setdefault(run.source_chunk, []).append((run.source_offset, data_start + run.target_offset, run.length))
        else:
            parts.append(Copy(raw.file, raw.offset + run.source_offset, file, data_start + run.target_offset, run.length))
    for index, pieces in decoded.items():
        parts.append(Gather(tensor, index, None, tensor.dtype, file, tuple(pieces)))
    return tuple(parts)
