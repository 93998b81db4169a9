"""ReshardWrites: a ReshardPlan laid out as bytes in the rank files (pure data, reads nothing).

Each rank file holds its objects, copied verbatim, then one torch.save record per chunk
(`torchsave.record`), in the plan's order; `.metadata` records where each lies. A chunk
filled by one run of raw source bytes (or empty), in a record of at most `RECORDS_RECORD`
bytes, goes into a `Records` operation with its neighbours (the common case: hundreds of thousands of
small records as columns); any other chunk gets its own `Record` (several runs, a decoded
source, a large record streamed).

Example:
    >>> writes = plan_writes(plan, checkpoint, locating.locate_chunks(files, checkpoint.tensors.values()))
    >>> writes.files[0]
    ('__0_0.distcp', 36261)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ckpttool.core.checkpoint import Checkpoint, Tensor, paused_gc
from ckpttool.dcp.blobs import RawData, RawDataRows
from ckpttool.dcp.writer import StoredChunks, StoredObject, StoredTensor, data_file_name
from ckpttool.plan.operations import Copy, Gather, Operation, Put, Record, Records
from ckpttool.plan.reshard import ReshardPlan, TargetChunk, TargetTable
from ckpttool.torchsave.record import record_layout

RECORDS_RECORD = 32 << 10  # largest record a Records operation holds (larger ones stream alone)
RECORDS_COUNT = 256  # most records per Records operation: at most 8 MiB of output, a few hundred per plan of 100k


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
    with paused_gc():  # a few small acyclic objects per operation (see paused_gc)
        return _plan_writes(plan, checkpoint, located)


def _plan_writes(plan: ReshardPlan, checkpoint: Checkpoint, located: Mapping[str, Mapping[int, RawData | None]]) -> ReshardWrites:
    import numpy as np

    table = plan.table
    world = plan.world_size
    names = [data_file_name(rank) for rank in range(world)]
    kinds, kind = _record_kinds(table)
    layouts = [record_layout(dtype, shape) for dtype, shape in kinds]
    length = np.array([layout.length for layout in layouts], dtype=np.int64)[kind]

    objects: list[StoredObject] = []
    object_copies: list[list[Copy | Put]] = []
    first = np.zeros(world, dtype=np.int64)  # where each file's records start: after its objects
    for rank_file in plan.files:
        at = 0
        copies: list[Copy | Put] = []
        for obj in rank_file.objects:
            source = obj.source
            if isinstance(source, bytes):  # made by the reader: written as it is
                objects.append(StoredObject(obj.fqn, rank_file.name, at, len(source)))
                copies.append(Put(rank_file.name, at, source))
                at += len(source)
                continue
            objects.append(StoredObject(obj.fqn, rank_file.name, at, source.length, source.transforms))
            copies.append(Copy(source.file, source.offset, rank_file.name, at, source.length))
            at += source.length
        first[rank_file.rank] = at
        object_copies.append(copies)
    # records lie end to end from `first`: a chunk's offset is its file's start plus the
    # lengths of the records before it in the file (the table is in file order)
    edges = np.searchsorted(table.owner, np.arange(world + 1))
    total = np.concatenate(([0], np.cumsum(length)))
    offset = first[table.owner] + total[:-1] - total[edges[:-1]][table.owner]
    sizes = first + total[edges[1:]] - total[edges[:-1]]

    # a chunk filled by one run of raw bytes, in a small record, is written by a Records
    run = table.run_bounds[:-1]
    single = np.flatnonzero(np.diff(table.run_bounds) == 1)
    source_names, base, source_file, source_offset = _raw_sources(plan, checkpoint, located)
    raw_file = np.full(len(table), -1, dtype=np.int64)
    raw_offset = np.zeros(len(table), dtype=np.int64)
    source = base[table.tensor[single]] + table.run_source[run[single]]
    raw_file[single] = source_file[source]
    raw_offset[single] = source_offset[source] + table.run_source_offset[run[single]]
    # (an empty chunk reads nothing: a Records holds it too, with no source file)
    data_length = np.array([layout.data_length for layout in layouts], dtype=np.int64)[kind]
    simple = ((raw_file >= 0) | (data_length == 0)) & (length <= RECORDS_RECORD)

    columns = _Columns(table, kinds, kind, offset, raw_file, raw_offset, names, source_names)
    operations: list[Operation] = []
    edge_list = edges.tolist()
    for rank in range(world):
        operations.extend(object_copies[rank])
        begin, end = edge_list[rank], edge_list[rank + 1]
        # runs of simple chunks become Records of up to RECORDS_COUNT; the others a Record each
        stops = (np.flatnonzero(np.diff(simple[begin:end])) + begin + 1).tolist() + [end]
        position = begin
        for stop in stops:
            if position == stop:
                continue
            if simple[position]:
                operations.extend(columns.records(group, min(stop, group + RECORDS_COUNT))
                                  for group in range(position, stop, RECORDS_COUNT))
            else:
                for index in range(position, stop):
                    chunk = table.chunk(index)
                    data_start = int(offset[index]) + layouts[kind[index]].data_offset
                    parts = _record_parts(checkpoint.tensors[chunk.fqn], chunk, located[chunk.fqn], names[rank], data_start)
                    operations.append(Record(names[rank], int(offset[index]), chunk.fqn, chunk.offsets, chunk.dtype,
                                             chunk.sizes, parts))
            position = stop
    tensors = _stored_tensors(table, offset, length, tuple(names))
    return ReshardWrites(tuple(zip(names, sizes.tolist())), tuple(operations), tensors, tuple(objects))


def _record_kinds(table: TargetTable) -> tuple[list[tuple[str, tuple[int, ...]]], Any]:
    """Return the distinct (dtype, shape) of the table's chunks and, per chunk, its index in them."""
    import numpy as np

    if not len(table):
        return [], np.zeros(0, dtype=np.int64)
    span = int(table.rows.max()) + 1
    keys, inverse = np.unique(table.tensor * span + table.rows, return_inverse=True)  # (tensor, rows) pairs
    found: dict[tuple[str, tuple[int, ...]], int] = {}
    numbers = []
    for tensor, rows in zip(*(part.tolist() for part in np.divmod(keys, span))):
        layout = table.tensors[tensor]
        shape = (rows, *layout.shape[1:]) if layout.shape else ()
        numbers.append(found.setdefault((layout.dtype, shape), len(found)))
    return list(found), np.array(numbers, dtype=np.int64)[inverse.reshape(-1)]


def _raw_sources(plan: ReshardPlan, checkpoint: Checkpoint,
                 located: Mapping[str, Mapping[int, RawData | None]]) -> tuple[list[str], Any, Any, Any]:
    """Return the source data files, where each tensor's source chunks start in the columns
    that follow, and per source chunk of every tensor the index of its file (-1: not located
    raw, it is decoded) and its raw bytes' offset."""
    import numpy as np

    counts = [len(checkpoint.tensors[layout.fqn].chunks) for layout in plan.tensors]
    base = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    file = np.full(int(base[-1]), -1, dtype=np.int64)
    offset = np.zeros(int(base[-1]), dtype=np.int64)
    files: dict[str, int] = {}
    numbers: dict[tuple[str, ...], Any] = {}  # a RawDataRows' files -> their numbers here
    keys: list[int] = []
    raws: list[RawData | None] = []
    for start, layout in zip(base.tolist(), plan.tensors):
        found = located.get(layout.fqn)
        if isinstance(found, RawDataRows):  # columns: no RawData is built
            known = numbers.get(found.files)
            if known is None:
                known = numbers[found.files] = np.array([files.setdefault(name, len(files)) for name in found.files])
            file[start + found.index] = known[found.file]
            offset[start + found.index] = found.offset
            found = found.overrides
        if found:
            keys.extend([start + index for index in found])
            raws.extend(found.values())
    # chunk by chunk (tuple checkpoints, remote walks, chunks located alone); None: decoded
    file[keys] = [-1 if raw is None else files.setdefault(raw.file, len(files)) for raw in raws]
    offset[keys] = [0 if raw is None else raw.offset for raw in raws]
    return list(files), base[:-1], file, offset


class _Columns:
    """The table's columns as lists, sliced into Records (lists slice faster than arrays convert)."""

    def __init__(self, table: TargetTable, kinds: list, kind: Any, offset: Any, raw_file: Any, raw_offset: Any,
                 names: list[str], source_names: list[str]):
        import numpy as np

        self.kinds = kinds
        self.kind = kind.tolist()
        self.fqn = np.array([layout.fqn for layout in table.tensors] or [""], dtype=object)[table.tensor].tolist()
        self.start = table.start.tolist()
        self.offset = offset.tolist()
        self.src = np.array(source_names + [""], dtype=object)[raw_file].tolist()
        self.src_offset = raw_offset.tolist()
        self.dst = [names[rank] for rank in table.owner.tolist()]

    def records(self, begin: int, end: int) -> Records:
        kinds = self.kind[begin:end]
        local = {number: index for index, number in enumerate(sorted(set(kinds)))}
        return Records(self.dst[begin], self.offset[begin], tuple(self.kinds[number] for number in local),
                       tuple(map(local.__getitem__, kinds)), tuple(self.fqn[begin:end]), tuple(self.start[begin:end]),
                       tuple(self.src[begin:end]), tuple(self.src_offset[begin:end]))


def _stored_tensors(table: TargetTable, offset: Any, length: Any, names: tuple[str, ...]) -> tuple[StoredTensor, ...]:
    """Return what `.metadata` records of each tensor: its chunks in metadata order, as columns."""
    import numpy as np

    order, edges = table.by_tensor, table.tensor_bounds.tolist()
    stored = []
    for number, layout in enumerate(table.tensors):
        rows = order[edges[number]:edges[number + 1]]
        ndim = len(layout.shape)
        offsets = np.zeros((len(rows), ndim), dtype=np.int64)
        sizes = np.zeros((len(rows), ndim), dtype=np.int64)
        if ndim:
            offsets[:, 0] = table.start[rows]
            sizes[:, 0] = table.rows[rows]
            sizes[:, 1:] = layout.shape[1:]
        chunks = StoredChunks(offsets, sizes, names, table.owner[rows], offset[rows], length[rows])
        stored.append(StoredTensor(layout.fqn, layout.dtype, layout.shape, chunks))
    return tuple(stored)


def _record_parts(tensor: Tensor, chunk: TargetChunk, located: Mapping[int, RawData | None], file: str,
                  data_start: int) -> tuple[Copy | Gather, ...]:
    parts: list[Copy | Gather] = []
    decoded: dict[int, list[tuple[int, int, int]]] = {}
    for run in chunk.runs:
        raw = located[run.source_chunk]
        if raw is None:
            decoded.setdefault(run.source_chunk, []).append((run.source_offset, data_start + run.target_offset, run.length))
        elif run.source_offset == 0 and run.length == raw.length:  # a whole source record: its CRC-32 is stored
            parts.append(Copy(raw.file, raw.offset, file, data_start + run.target_offset, run.length, raw.crc32))
        else:
            parts.append(Copy(raw.file, raw.offset + run.source_offset, file, data_start + run.target_offset, run.length,
                              within=raw))
    for index, pieces in decoded.items():
        parts.append(Gather(tensor, index, None, tensor.dtype, file, tuple(pieces)))
    return tuple(parts)
