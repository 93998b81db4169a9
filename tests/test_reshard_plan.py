"""Planning a reshard needs no files: which rank file holds which chunk, and which source
bytes fill it, follow from the metadata alone."""

from __future__ import annotations

import random

import pytest

from conftest import FIXTURES

from pathlib import Path

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, ChunkTable, Object, Tensor, with_tables
from ckpttool.options import WriteOptions
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.core.errors import CorruptMetadata, UsageError
from ckpttool.core.geometry import intersect, row_major_runs, split_dim0, volume
from ckpttool.plan.reshard import (EVERY_TENSOR_RULE, Mesh, Run, _slab_runs, _zip_runs, fill_all_runs, fill_runs, is_sharded, parse_mesh,
                                   plan_reshard, sharding_rule)


def tensor(fqn: str, shape: tuple, boxes: list, dtype: str = "float32") -> Tensor:
    chunks = tuple(Chunk(tuple(o), tuple(s), Blob("__0_0.distcp", 0, 0)) for o, s in boxes)
    return Tensor(fqn, dtype, tuple(shape), chunks)


def test_rows_3_to_8_of_two_row_blocks_come_from_both_blocks_as_contiguous_runs():
    t = tensor("model.w", (10, 4), [((0, 0), (5, 4)), ((5, 0), (5, 4))])
    runs = fill_runs(t, ((3, 0), (5, 4)))
    assert [(r.source_chunk, r.source_offset, r.target_offset, r.length) for r in runs] == [(0, 48, 0, 32), (1, 0, 32, 48)]


def test_a_dim0_target_is_filled_row_by_row_from_column_blocks():
    t = tensor("model.w", (2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))], dtype="int8")
    runs = fill_runs(t, ((0, 0), (2, 4)))
    assert [(r.source_chunk, r.source_offset, r.target_offset, r.length) for r in runs] == [
        (0, 0, 0, 2), (1, 0, 2, 2), (0, 2, 4, 2), (1, 2, 6, 2)]


def test_missing_rows_in_the_source_are_reported_with_the_tensor_name():
    t = tensor("model.w", (10, 4), [((0, 0), (5, 4))])
    with pytest.raises(CorruptMetadata, match="model.w: the source chunks cover 80 of the 160 bytes"):
        fill_runs(t, ((0, 0), (10, 4)))


def _runs_by_every_pair(t: Tensor, box) -> tuple[Run, ...]:
    """fill_runs as it was: every source chunk intersected with the box (S x T per tensor)."""
    runs = []
    for index, chunk in enumerate(t.chunks):
        region = intersect((chunk.offsets, chunk.sizes), box) if volume(chunk.sizes) else None
        if region is not None:
            runs.extend(_zip_runs(row_major_runs((chunk.offsets, chunk.sizes), region, t.itemsize),
                                  row_major_runs(box, region, t.itemsize), index))
    return tuple(sorted(runs, key=lambda run: run.target_offset))


def _tiling(rng: random.Random, shape: tuple[int, ...]) -> list:
    """A random exact tiling of `shape`: uneven dim-0 cuts, then per band uneven cuts of dim 1
    (a 2-D mesh when some band is cut), with empty shards mixed in, in shuffled order."""
    boxes = []
    cuts = sorted(rng.sample(range(1, shape[0]), min(shape[0] - 1, rng.randint(0, 5))))
    for start, end in zip([0, *cuts], [*cuts, shape[0]]):
        if len(shape) == 1:
            boxes.append(((start,), (end - start,)))
            continue
        columns = sorted(rng.sample(range(1, shape[1]), min(shape[1] - 1, rng.randint(0, 3))))
        for left, right in zip([0, *columns], [*columns, shape[1]]):
            boxes.append(((start, left, *(0 for _ in shape[2:])), (end - start, right - left, *shape[2:])))
    boxes += [((shape[0], *(0 for _ in shape[1:])), (0, *shape[1:]))] * rng.randint(0, 2)
    rng.shuffle(boxes)
    return boxes


def test_the_sorted_sweep_fills_every_box_as_intersecting_every_pair_did_on_random_tilings():
    rng = random.Random(0)
    for trial in range(300):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.choice((1, 2, 2, 3))))
        t = tensor("model.w", shape, _tiling(rng, shape), dtype=rng.choice(("float32", "bfloat16", "int8")))
        if rng.random() < 0.5:  # FSDP's dim-0 split for some world size, with its empty shards
            targets = [((start, *(0 for _ in shape[1:])), (rows, *shape[1:]))
                       for start, rows in split_dim0(shape[0], rng.randint(1, 12))]
        else:  # another random tiling (block sharding on both sides)
            targets = _tiling(rng, shape)
        assert fill_all_runs(t, targets) == [_runs_by_every_pair(t, box) for box in targets], (trial, shape)


def _outcome(fill, t: Tensor, targets):
    try:
        return fill(t, targets)
    except CorruptMetadata as error:
        return str(error)


def test_runs_from_the_columns_of_fsdp_slabs_are_the_runs_of_the_general_sweep():
    """A ChunkTable of dim-0 slabs is filled by bisecting its starts; anything else (block
    sharding, replicas, gaps, boxes past the tensor) falls back to the sweep: the results and
    the errors are those of the sweep over the same chunks as tuples."""
    rng = random.Random(1)
    fast = 0
    for trial in range(400):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.choice((1, 2, 2, 3))))
        boxes = _tiling(rng, shape) if rng.random() < 0.3 else [
            ((start, *(0 for _ in shape[1:])), (rows, *shape[1:])) for start, rows in split_dim0(shape[0], rng.randint(1, 6))]
        if rng.random() < 0.15 and boxes:
            boxes.append(rng.choice(boxes))  # an HSDP replica of one box
        if rng.random() < 0.15 and len(boxes) > 1:
            boxes.remove(rng.choice(boxes))  # a gap
        table = ChunkTable.from_chunks(tensor("model.w", shape, boxes).chunks, len(shape))
        if table is None or len(table) < 2:
            continue
        dtype = rng.choice(("float32", "bfloat16", "int8"))
        as_table, as_tuples = Tensor("model.w", dtype, shape, table), Tensor("model.w", dtype, shape, tuple(table))
        targets = [((start, *(0 for _ in shape[1:])), (rows, *shape[1:])) for start, rows in split_dim0(shape[0], rng.randint(1, 12))]
        if rng.random() < 0.1:
            targets.append(((shape[0] - 1, *(0 for _ in shape[1:])), (2, *shape[1:])))  # past the end
        expected = _outcome(fill_all_runs, as_tuples, targets)
        assert _outcome(fill_all_runs, as_table, targets) == expected, (trial, shape, boxes)
        fast += _slab_runs(as_table, targets) is not None
    assert fast > 150  # most trials took the columns' path


def test_the_sorted_sweep_still_reports_a_gap_in_the_source():
    t = tensor("model.w", (10, 4), [((0, 0), (3, 4)), ((5, 0), (5, 4))])
    with pytest.raises(CorruptMetadata, match="cover 64 of the 96 bytes of box \\[2, 0\\]"):
        fill_all_runs(t, [((0, 0), (2, 4)), ((2, 0), (6, 4)), ((8, 0), (2, 4))])


def test_sharding_rule_follows_the_source_then_the_optimizer_state():
    # sharded_by_optimizer's set: the parameters the optimizer state names, and that state
    optimized = frozenset({"model.embed.weight", "optim.state.embed.weight.exp_avg", "optim.state.embed.weight.step"})
    whole = [((0, 0), (13, 8))]
    assert is_sharded(tensor("model.embed.weight", (13, 8), whole), optimized)
    assert is_sharded(tensor("optim.state.embed.weight.exp_avg", (13, 8), whole), optimized)
    assert not is_sharded(tensor("optim.state.embed.weight.step", (), [((), ())]), optimized)
    assert not is_sharded(tensor("model.position_ids", (5,), [((0,), (5,))]), optimized)
    assert is_sharded(tensor("model.frozen", (4,), [((0,), (2,)), ((2,), (2,))]), optimized)


def test_fsdp_world_3_plan_gives_each_rank_its_torch_chunk_rows_and_dedups_empty_shards():
    plan = plan_reshard(read_checkpoint(FIXTURES / "fsdp2_world2_adamw"), Mesh(1, 5))
    head = next(t for t in plan.tensors if t.fqn == "model.head.weight")
    # 2 rows on 5 ranks: rows 0 and 1 on ranks 0 and 1, one empty chunk at row 2 for ranks 2..4
    assert head.chunks == ((0, 0), (1, 0), (2, 0))
    rows = {f.rank: [c.sizes[0] for c in f.chunks if c.fqn == "model.embed.weight"] for f in plan.files}
    assert rows == {0: [3], 1: [3], 2: [3], 3: [3], 4: [1]}
    assert sum(len(f.objects) for f in plan.files) == len(read_checkpoint(FIXTURES / "fsdp2_world2_adamw").objects)


def test_hsdp_plan_splits_over_shards_and_writes_each_chunk_once_on_a_replica_that_owns_it():
    mesh = Mesh(2, 3)
    plan = plan_reshard(read_checkpoint(FIXTURES / "fsdp2_world3_uneven"), mesh)
    owners: dict = {}
    for rank_file in plan.files:
        for chunk in rank_file.chunks:
            key = (chunk.fqn, chunk.offsets)
            assert key not in owners, f"{key} written twice"
            owners[key] = rank_file.rank
    embed = [(offsets, owners[("model.embed.weight", offsets)]) for offsets in
             next(t for t in plan.tensors if t.fqn == "model.embed.weight").chunks]
    assert [offsets for offsets, _ in embed] == [(0, 0), (5, 0), (10, 0)]
    for shard, (_, rank) in enumerate(embed):
        assert rank in mesh.holders(shard)


def test_single_rank_sources_are_sharded_by_optimizer_state_or_else_every_tensor():
    whole = [((0, 0), (13, 8))]
    every = {"rule": EVERY_TENSOR_RULE}
    assert is_sharded(tensor("model.position_ids", (5,), [((0,), (5,))]), frozenset(), **every)
    assert not is_sharded(tensor("model.step", (), [((), ())]), frozenset(), **every)
    assert not is_sharded(tensor("model.embed.weight", (13, 8), whole), frozenset(), **every, keep_whole=["*.embed.*"])
    assert not is_sharded(tensor("model.frozen", (4,), [((0,), (2,)), ((2,), (2,))]), frozenset(), keep_whole=["*frozen"])


def test_the_rule_is_chosen_from_the_source():
    sharded = read_checkpoint(FIXTURES / "fsdp2_world2")
    assert plan_reshard(sharded, Mesh(1, 3)).rule == "source"
    assert sharding_rule(sharded, frozenset()) == "source"


def test_dry_run_text_lists_the_rule_and_every_target_rank(tmp_path):
    from ckpttool.commands.reshard import reshard
    from ckpttool.render.convert import reshard_text

    text = reshard_text(reshard(FIXTURES / "fsdp2_world2", tmp_path / "out", 3, write=WriteOptions(dry_run=True)))
    lines = text.splitlines()
    assert lines[0].startswith("reshard to 3 ranks (mesh 3): 16 tensors (14 sharded, 2 whole)")
    assert lines[1].startswith("  rule: source")
    assert [line.split()[1] for line in lines[2:5]] == ["0", "1", "2"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world_size, mesh, expected", [(3, None, Mesh(1, 3)), (None, "2,4", Mesh(2, 4)),
                                                         (6, (3, 2), Mesh(3, 2)), (None, "2x2", Mesh(2, 2))])
def test_parse_mesh(world_size, mesh, expected):
    assert parse_mesh(world_size, mesh) == expected


@pytest.mark.parametrize("world_size, mesh", [(None, None), (0, None), (3, "2,2"), (None, "a,b"), (None, "0,2")])
def test_parse_mesh_refuses_what_does_not_fit(world_size, mesh):
    with pytest.raises(UsageError):
        parse_mesh(world_size, mesh)


def _random_checkpoint(rng: random.Random) -> Checkpoint:
    """Tensors saved at world 2 (dim-0 halves: sharded), whole (replicated) and 0-d, with
    first dims small enough that some targets get empty shards, and a few objects, in a
    shuffled state-dict order."""
    tensors, objects = {}, {}
    for number in range(rng.randint(3, 9)):
        fqn = f"model.t{number}"
        kind = rng.choice(["sharded", "whole", "scalar"])
        if kind == "scalar":
            tensors[fqn] = tensor(fqn, (), [((), ())])
            continue
        shape = (rng.randint(1, 9), rng.randint(1, 3))
        if kind == "sharded" and shape[0] > 1:
            cut = rng.randint(1, shape[0] - 1)
            tensors[fqn] = tensor(fqn, shape, [((0, 0), (cut, shape[1])), ((cut, 0), (shape[0] - cut, shape[1]))])
        else:
            tensors[fqn] = tensor(fqn, shape, [((0, 0), shape)])
    for number in range(rng.randint(0, 3)):
        objects[f"optim.o{number}"] = Object(f"optim.o{number}", Blob("__0_0.distcp", 0, 8))
    names = list(tensors) + list(objects)
    rng.shuffle(names)
    return Checkpoint(Path("ckpt"), ".metadata", "1.0.0", tensors, objects, {fqn: (fqn,) for fqn in names})


def _torch_dedup(checkpoint: Checkpoint, plan, mesh: Mesh) -> list[list[tuple]]:
    """Each rank's save plan as FSDP2 on `mesh` makes it (its shard of every sharded tensor,
    every whole tensor and object), deduplicated by torch's own dedup_save_plans: the items
    each rank's file keeps, in order."""
    import torch
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    sharded = {layout.fqn: layout.sharded for layout in plan.tensors}
    plans = []
    for rank in range(mesh.world_size):
        items = []
        for fqn in checkpoint.nesting:
            if fqn in checkpoint.objects:
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
                continue
            shape = checkpoint.tensors[fqn].shape
            if sharded[fqn]:
                start, rows = split_dim0(shape[0], mesh.shards)[rank % mesh.shards]
                offsets, sizes = (start,) + (0,) * (len(shape) - 1), (rows, *shape[1:])
            else:
                offsets, sizes = (0,) * len(shape), shape
            data = TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                   TensorProperties(dtype=torch.float32), torch.Size(shape))
            items.append(WriteItem(MetadataIndex(fqn, offsets), WriteItemType.SHARD, tensor_data=data))
        plans.append(SavePlan(items))
    return [[(item.index.fqn, tuple(item.index.offset) if item.index.offset is not None else None) for item in kept.items]
            for kept in dedup_save_plans(plans)]


@pytest.mark.parametrize("mesh", [Mesh(1, 1), Mesh(1, 3), Mesh(1, 7), Mesh(2, 3), Mesh(3, 2), Mesh(2, 5)])
def test_each_rank_file_holds_what_torchs_dedup_save_plans_leaves_that_rank(mesh):
    rng = random.Random(mesh.world_size * 31 + mesh.replicas)
    for trial in range(25):
        checkpoint = _random_checkpoint(rng)
        plan = plan_reshard(checkpoint, mesh)
        ours = [[(o.fqn, None) for o in f.objects] + [(c.fqn, c.offsets) for c in f.chunks] for f in plan.files]
        expected = _torch_dedup(checkpoint, plan, mesh)
        # torch writes a rank's objects before its tensors; within each kind, the plan's order
        expected = [[item for item in items if item[1] is None] + [item for item in items if item[1] is not None]
                    for items in expected]
        assert ours == expected, (trial, mesh)


def _written(checkpoint: Checkpoint, mesh: Mesh) -> tuple:
    """What reshard writes for `checkpoint` on `mesh`: file sizes, every record as a Record
    (Records expanded), the objects and the `.metadata` chunks."""
    from ckpttool.run import locating
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.plan.operations import Records
    from ckpttool.plan.rank_files import plan_writes

    plan = plan_reshard(checkpoint, mesh)
    with DataFiles(checkpoint.path) as files:
        writes = plan_writes(plan, checkpoint, locating.locate_chunks(files, checkpoint.tensors.values()))
    operations = [record for op in writes.operations for record in (op.records() if isinstance(op, Records) else [op])]
    return (writes.files, operations, writes.objects,
            [(t.fqn, t.dtype, t.shape, list(t.chunks)) for t in writes.tensors], [list(f.chunks) for f in plan.files])


@pytest.mark.parametrize("name", ["fsdp2_world2_adamw", "fsdp2_world3_uneven", "fsdp2_world2"])
def test_reshard_from_chunk_tables_writes_what_it_writes_from_chunk_tuples(name):
    # a large .metadata is read into ChunkTables, whose runs come from the columns
    # (slab_run_columns); small ones into tuples, which take the general sweep
    checkpoint = read_checkpoint(FIXTURES / name)
    tabled = with_tables(checkpoint)
    assert any(isinstance(t.chunks, ChunkTable) for t in tabled.tensors.values())
    for mesh in (Mesh(1, 1), Mesh(1, 3), Mesh(2, 2), Mesh(1, 7)):
        assert _written(tabled, mesh) == _written(checkpoint, mesh), mesh


def test_small_records_of_one_raw_run_are_written_by_records_and_the_rest_by_a_record_each():
    from ckpttool.run import locating
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.plan.operations import Copy, Record, Records
    from ckpttool.plan.rank_files import RECORDS_RECORD, plan_writes
    from ckpttool.torchsave.record import record_layout

    checkpoint = read_checkpoint(FIXTURES / "fsdp2_world3_uneven")
    plan = plan_reshard(checkpoint, Mesh(1, 2))  # rows 0..7 of a 13-row tensor from two source chunks
    with DataFiles(checkpoint.path) as files:
        writes = plan_writes(plan, checkpoint, locating.locate_chunks(files, checkpoint.tensors.values()))
    grouped = [op for op in writes.operations if isinstance(op, Records)]
    alone = [op for op in writes.operations if isinstance(op, Record)]
    assert grouped and any(len(op.parts) > 1 for op in alone)
    for op in alone:  # several runs, a decoded source, or too large a record to build whole
        assert (len(op.parts) != 1 or not isinstance(op.parts[0], Copy)
                or record_layout(op.dtype, op.shape).length > RECORDS_RECORD), op
    assert sum(len(op) for op in grouped) + len(alone) == sum(len(f.chunks) for f in plan.files)


def test_tensors_chunked_alike_are_planned_once_and_get_the_same_runs(monkeypatch):
    """A model's layers repeat: ChunkTable tensors of one shape, dtype size and chunking get
    their runs worked out once (`_geometry`), and the plan is the one worked out tensor by tensor."""
    import numpy as np

    from ckpttool.plan import reshard as planning

    tabled = with_tables(read_checkpoint(FIXTURES / "fsdp2_world2_adamw"))
    calls = []
    run_columns = planning._run_columns
    monkeypatch.setattr(planning, "_run_columns", lambda tensor, slab: calls.append(tensor.fqn) or run_columns(tensor, slab))
    shared = plan_reshard(tabled, Mesh(1, 3))
    assert len(calls) < len(tabled.tensors), "every tensor was planned on its own"
    calls.clear()
    monkeypatch.setattr(planning, "_geometry", lambda tensor, slab: None)
    alone = plan_reshard(tabled, Mesh(1, 3))
    assert len(calls) == len(tabled.tensors)
    for column in ("tensor", "box", "start", "rows", "owner", "nbytes", "run_bounds", "run_source",
                   "run_source_offset", "run_target_offset", "run_length", "by_tensor", "tensor_bounds"):
        assert np.array_equal(getattr(shared.table, column), getattr(alone.table, column)), column
    assert shared.table.tensors == alone.table.tensors
