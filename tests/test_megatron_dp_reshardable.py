"""A Megatron-Core torch_dist save whose distributed optimizer state is in Megatron-LM 0.16.1's default
sharding, `dp_reshardable`, migrated to FSDP2 (issue 48 item 5): `reshard(ITER, DST, world_size=N,
to="transformers")` reads each model-parallel rank's buckets (readers/megatron_bucket_space.py) and
writes transformers' model and AdamW state that `set_state_dict` loads into fully_shard + AdamW.

Fixture `megatron_distopt_torch_dist/` (fixtures/frameworks/generate_megatron_distopt_torch_dist.py:
megatron-core 0.16.1 + Megatron-LM core_v0.16.1 `save_checkpoint`, TP 2 x PP 1 x DP 2,
--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 2049: 9 buckets a rank, parameters
cut between the data-parallel ranks mid-row). Its reference (`optimizer_expected.json`) is the live
DistributedOptimizer's state before the save; the same run saved in the legacy format is
`megatron_legacy_distopt_dp2/`, whose migration tests/test_megatron_legacy_migration.py checks against
Megatron's own reload. Here: the parameter order the reader derives is proven by the buckets' own copy
of the parameters (`param`), and a wrong order is refused by the same check at run time; every moment
and step equals the reference after set_state_dict at world 2 and 3; the two saves of the run migrate
to the same bytes, as does the save with every bucket piece cut again mid-row (this run's data-parallel
cuts all fall between rows); damaged bucket layouts exit 1 with nothing written.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

from ckpttool.outputs.temps import TEMP_PREFIX

SAVE = FIXTURES / "frameworks" / "megatron_distopt_torch_dist"
ITERATION = SAVE / "checkpoints" / "iter_0000002"
LEGACY = FIXTURES / "frameworks" / "megatron_legacy_distopt_dp2"  # the same run, --ckpt-format torch
WORLDS = (2, 3)
MOMENTS = ("exp_avg", "exp_avg_sq")
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_{}.{}"
UNPADDED = "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"


def _values(folder: Path, tensor) -> bytes:
    """A tensor's row-major float32 bytes assembled from its chunks (raw ranges or torch.save records)."""
    import numpy as np
    import torch

    out = np.zeros(tensor.shape, dtype=np.float32)
    for chunk in tensor.chunks:
        data = (folder / chunk.blob.file).read_bytes()[chunk.blob.offset:chunk.blob.offset + chunk.blob.length]
        if chunk.blob.transforms:  # a raw range of a record's storage
            piece = np.frombuffer(data, dtype=np.float32).reshape(chunk.sizes)
        else:
            piece = torch.load(io.BytesIO(data), weights_only=True).numpy().reshape(chunk.sizes)
        out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = piece
    return out.tobytes()


def test_the_param_buckets_placed_by_the_derived_order_are_every_weight_byte_for_byte():
    """The proof of the parameter order (GPTModel's module order, reversed, laid out in buckets):
    the buckets' own copy of the parameters, placed by it through the tensor-parallel rules, equals
    every weight of the save, each cut at the data-parallel ranks' boundaries."""
    from ckpttool.naming import megatron_config
    from ckpttool.readers.dcp import read_checkpoint
    from ckpttool.readers.megatron_bucket_space import read_bucket_optimizer

    args = megatron_config.read_args(ITERATION / "common.pt")
    saved = read_bucket_optimizer(read_checkpoint(ITERATION), args, kinds=("param",))
    placed = {fqn.removeprefix("optimizer.state.param."): tensor for fqn, tensor in saved.checkpoint.tensors.items()
              if fqn.startswith("optimizer.state.param.")}
    weights = {fqn.removeprefix("model."): tensor for fqn, tensor in saved.checkpoint.tensors.items()
               if fqn.startswith("model.")}
    assert sorted(placed) == sorted(weights) and len(weights) == 27
    # parameters cut between the data-parallel ranks: more pieces than their 2 tensor-parallel parts
    assert sum(len({chunk.blob.file for chunk in tensor.chunks}) > 2 for tensor in placed.values()) >= 5
    for key in weights:
        assert _values(ITERATION, placed[key]) == _values(ITERATION, weights[key]), key


def test_an_order_the_buckets_do_not_hold_is_refused_by_the_parameters_own_bytes(monkeypatch):
    """Every run checks the derived order on the save: with linear_qkv and linear_fc2 swapped (both
    1024 elements a tensor rank, so the recorded bucket lengths and chunk starts still agree) the
    buckets' copy of the parameters is no longer the weights' (CRC-32 of each saved chunk)."""
    from ckpttool.core.errors import UnsupportedFormat
    from ckpttool.naming.megatron_optimizer import plan_migration
    from ckpttool.readers import megatron_bucket_space
    from ckpttool.readers.dcp import read_checkpoint
    from ckpttool.readers.detect import MEGATRON

    order = list(megatron_bucket_space.LAYER_ORDER)
    qkv, fc2 = order.index("self_attention.linear_qkv.weight"), order.index("mlp.linear_fc2.weight")
    order[qkv], order[fc2] = order[fc2], order[qkv]
    monkeypatch.setattr(megatron_bucket_space, "LAYER_ORDER", tuple(order))
    with pytest.raises(UnsupportedFormat, match="is not the saved weight"):
        plan_migration(MEGATRON, read_checkpoint(ITERATION))


def test_a_range_cut_mid_row_is_a_partial_row_whole_rows_and_a_partial_row():
    """A data-parallel rank's piece of a parameter as boxes of the global tensor: here tensor rank
    1's part of a row-parallel [4, 6] weight (columns 3..5) and of a SwiGLU fc1 (gate rows 2..3
    then up rows 6..7 of [8, 2]), pieces starting and ending mid-row."""
    from ckpttool.readers.megatron_bucket_space import _boxes, _Fragment, _Part

    row_parallel = _Part("w", (4, 3), (_Fragment(0, 4, (0, 3)),), False)
    assert _boxes(row_parallel, 2, 11) == [((0, 5), (1, 1), 2), ((1, 3), (2, 3), 3), ((3, 3), (1, 2), 9)]
    gated = _Part("fc1", (4, 2), (_Fragment(0, 2, (2, 0)), _Fragment(2, 4, (6, 0))), False)
    assert _boxes(gated, 1, 6) == [((2, 1), (1, 1), 1), ((3, 0), (1, 2), 2), ((6, 0), (1, 2), 4)]
    assert _boxes(_Part("b", (4,), (_Fragment(0, 2, (2,)), _Fragment(2, 4, (6,))), False), 1, 3) == [
        ((3,), (1,), 1), ((6,), (1,), 2)]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> dict:
    """(save, world) -> the folder reshard(..., to="transformers") wrote, each written to the same
    path in turn (a copy kept) so that their .metadata compare too."""
    from ckpttool import reshard

    root = tmp_path_factory.mktemp("dp-reshardable")
    found = {}
    for world in WORLDS:
        for name, source in (("torch_dist", SAVE), ("legacy", LEGACY)):
            report = reshard(source / "checkpoints", root / f"world{world}", world_size=world, to="transformers")
            found[(name, world)] = report.destination.rename(root / f"{name}-{world}")
    return found


@pytest.mark.parametrize("world", WORLDS)
def test_the_migration_is_byte_identical_to_the_legacy_saves_of_the_same_run(migrated, world):
    """Model, moments, steps and param groups: every data file byte for byte, and the .metadata the
    same but for torch's per-save ids (StorageMeta)."""
    from torch.distributed.checkpoint import FileSystemReader

    ours, theirs = migrated[("torch_dist", world)], migrated[("legacy", world)]
    files = sorted(p.name for p in ours.glob("*.distcp"))
    assert files == sorted(p.name for p in theirs.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]
    for name in files:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    a, b = FileSystemReader(str(ours)).read_metadata(), FileSystemReader(str(theirs)).read_metadata()
    assert (a.state_dict_metadata, a.storage_data, a.planner_data) == (b.state_dict_metadata, b.storage_data,
                                                                        b.planner_data)


@pytest.fixture(scope="module")
def loaded(migrated, tmp_path_factory) -> dict:
    """world -> what fully_shard + AdamW loaded by set_state_dict on that many gloo ranks."""
    import torch

    from fsdp_loads import free_port
    from rank_forks import run_ranks

    root = tmp_path_factory.mktemp("dp-reshardable-loaded")
    results = {}
    for world in WORLDS:
        out = root / f"world{world}.pt"
        run_ranks("test_megatron_legacy_migration:_rank", world, world, free_port(),
                  [("torch_dist", str(migrated[("torch_dist", world)]))], str(out), timeout=300)
        results[world] = torch.load(out, weights_only=True)["torch_dist"]
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_every_parameters_moments_and_step_are_the_live_optimizers(loaded, world):
    """exp_avg and exp_avg_sq after set_state_dict, put back into Megatron's names, are byte for
    byte the live DistributedOptimizer's before the save; each step is the saved 2.0 as a 0-d
    float32; each parameter's group settings are the one Megatron put it in."""
    from test_megatron_legacy_migration import LEGACY as LLAMA, as_megatron, megatron_name, sha256

    config = json.loads((LLAMA / "hf" / "config.json").read_text())
    expected = json.loads((SAVE / "optimizer_expected.json").read_text())
    result = loaded[world]
    for kind in MOMENTS:
        got = {key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "sha256": sha256(value)}
               for key, value in as_megatron(result["moments"][kind], config).items()}
        assert got == {key: tensors[kind] for key, tensors in expected["tensors"].items()}, kind
    steps = {(str(value.dtype), tuple(value.shape), tensor_bytes(value).hex()) for value in result["steps"].values()}
    assert steps == {("torch.float32", (), "00000040")} and set(expected["step"].values()) == {"00000040"}
    for key, settings in result["groups"].items():
        wanted = expected["groups"][megatron_name(key)]
        assert settings == {k: v for k, v in wanted.items() if k in settings}, key


def test_the_moments_are_byte_ranges_of_the_buckets_records():
    """Nothing is decoded but the step (a number in the param groups): every moment chunk of the
    migration is a raw range of a bucket's stored record in a .distcp file."""
    from ckpttool.naming.megatron_optimizer import plan_migration
    from ckpttool.readers.dcp import read_checkpoint
    from ckpttool.readers.detect import MEGATRON

    migration = plan_migration(MEGATRON, read_checkpoint(ITERATION))
    sources = {piece.source for target in migration.targets.values() for piece in target.pieces
               if piece.source.startswith("optimizer.state.")}
    assert sources and all(chunk.blob.file.endswith(".distcp") and chunk.blob.transforms
                           for tensor in migration.sources() if tensor.fqn in sources for chunk in tensor.chunks)
    assert set(migration.step_values.values()) == {2.0}


def _cut_mid_row(folder: Path, metadata) -> None:
    """Every bucket tensor's chunks cut again every 100 elements (mid-row for rows of 16 and 32),
    each piece a torch.save record of its own in a new data file, as a data-parallel size whose
    rank boundaries fall mid-row would save them; the bytes stay the bucket's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    keys = sorted(key for key in metadata.state_dict_metadata if ".bucket_idx_" in key)
    state = {key: torch.empty(tuple(metadata.state_dict_metadata[key].size)) for key in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    name = "__9_0.distcp"
    data = io.BytesIO()
    for key in keys:
        entry = metadata.state_dict_metadata[key]
        starts = sorted({chunk.offsets[0] for chunk in entry.chunks} | set(range(0, entry.size[0], 100)))
        metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}
        entry.chunks = []
        for start, stop in zip(starts, [*starts[1:], entry.size[0]]):
            record = io.BytesIO()
            torch.save(state[key][start:stop].clone(), record)
            info = type(next(iter(metadata.storage_data.values())))(name, data.tell(), len(record.getvalue()))
            data.write(record.getvalue())
            entry.chunks.append(ChunkStorageMetadata(torch.Size([start]), torch.Size([stop - start])))
            metadata.storage_data[MetadataIndex(key, torch.Size([start]))] = info
    (folder / name).write_bytes(data.getvalue())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pieces_cut_mid_row_migrate_to_the_same_bytes(migrated, tmp_path):
    """The same buckets with every parameter's state cut mid-row into pieces in other records: each
    piece becomes partial rows and whole rows of the global tensor, and the output is byte for byte
    the one of the save as Megatron cut it."""
    from ckpttool import reshard
    from ckpttool.naming.megatron_optimizer import plan_migration
    from ckpttool.readers.dcp import read_checkpoint
    from ckpttool.readers.detect import MEGATRON

    copy = tmp_path / "checkpoints"
    shutil.copytree(SAVE / "checkpoints", copy)
    _rewrite(copy / "iter_0000002", _cut_mid_row)
    moments = [tensor for tensor in plan_migration(MEGATRON, read_checkpoint(copy / "iter_0000002")).sources()
               if tensor.fqn.startswith("optimizer.state.") and len(tensor.shape) == 2]
    assert sum(chunk.sizes[0] == 1 and chunk.sizes[1] < tensor.shape[1] for tensor in moments
               for chunk in tensor.chunks) > 100  # partial rows
    out = reshard(copy, tmp_path / "out", world_size=2, to="transformers").destination
    ours = migrated[("torch_dist", 2)]
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (out / name).read_bytes() == (ours / name).read_bytes(), name


# -- damaged saves: exit 1 in one line, nothing written ----------------------------------------------

def _rewrite(folder: Path, change) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    change(folder, metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _shorter_bucket(folder: Path, metadata) -> None:
    """bucket 0's exp_avg recorded without its last chunk (32 of its 2080 elements)."""
    import torch

    fqn = BUCKET.format(0, "exp_avg")
    entry = metadata.state_dict_metadata[fqn]
    last = max(entry.chunks, key=lambda chunk: chunk.offsets[0])
    entry.chunks = [chunk for chunk in entry.chunks if chunk is not last]
    entry.size = torch.Size([last.offsets[0]])
    metadata.storage_data = {index: info for index, info in metadata.storage_data.items()
                             if not (index.fqn == fqn and tuple(index.offset) == tuple(last.offsets))}


def _other_unpadded_lengths(folder: Path, metadata) -> None:
    """per_bucket_numel_unpadded's last bucket one element shorter, saved anew after the file's end."""
    import torch

    [index] = [index for index in metadata.storage_data if index.fqn == UNPADDED]
    info = metadata.storage_data[index]
    path = folder / info.relative_path
    value = torch.load(io.BytesIO(path.read_bytes()[info.offset:info.offset + info.length]), weights_only=False)
    [(dtypes, lengths)] = value[0][0].items()
    value[0][0][dtypes] = [*lengths[:-1], lengths[-1] - 1]
    record = io.BytesIO()
    torch.save(value, record)
    offset = path.stat().st_size
    with path.open("ab") as file:
        file.write(record.getvalue())
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(record.getvalue()))


DAMAGED = {
    "a-bucket-shorter-than-the-layout": (_shorter_bucket, "bucket 0 exp_avg"),
    "per-bucket-numel-unpadded-not-the-layouts": (_other_unpadded_lengths, "per_bucket_numel_unpadded"),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_bucket_layout_exits_1_in_one_line_with_nothing_written(run, tmp_path, case):
    damage, message = DAMAGED[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree(SAVE / "checkpoints", copy)
    _rewrite(copy / "iter_0000002", damage)
    result = run("reshard", copy, tmp_path / "out", "--world", "2", "--to", "transformers")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


def test_the_cli_migrates_it(run, tmp_path):
    result = run("reshard", SAVE / "checkpoints", tmp_path / "out", "--world", "2", "--to", "transformers", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
