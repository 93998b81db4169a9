"""`ckpttool reshard`: a checkpoint rewritten for N ranks loads, with stock torch, into FSDP2 on
N ranks exactly as its source does; rank r's file holds what rank r owns.

The expensive part, spawning N gloo ranks, runs once per N for the whole session
(`loads_at(N)`): it reshards every bundled fixture to N, loads each into a `fully_shard`ed
TinyModel + AdamW with `dcp.load`, gathers full tensors, records which file each read came
from, and saves the state again with torch's own `dcp.save` for a layout comparison. In the
same spawn it loads the trainer's world 2, 3 and 4 checkpoints, resharded to N, into the
trainer's own GPT + AdamW.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURE_NAMES, FIXTURES, assert_same_bytes, flatten, tensor_bytes
from fsdp_loads import LoadJob, load_all, read_reads

from ckpttool.options import ConvertOptions, WriteOptions
from ckpttool.commands.reshard import reshard
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.outputs.temps import TEMP_PREFIX
from ckpttool.torchsave.record import record_bytes

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
# fixture -> (dtype, holds optimizer state and `extra`)
FIXTURE_STATE = {
    "fsdp2_world2": ("float32", False),
    "fsdp2_world2_adamw": ("float32", True),
    "fsdp2_world2_bf16": ("bfloat16", False),
    "fsdp2_world3_uneven": ("float32", True),
}
HSDP_MESH = (2, 2)


TRAINER_WORLDS = (2, 3, 4)


@pytest.fixture(scope="session")
def trainer_checkpoints(tmp_path_factory):
    """{world size: step-2 checkpoint of a 4-step trainer run stopped at step 2}."""
    from trainer_runs import latest_step, run_trainer

    checkpoints = {}
    for world_size in TRAINER_WORLDS:
        directory = tmp_path_factory.mktemp(f"trainer-world{world_size}")
        run_trainer(directory, "--stop-at", "2", nproc=world_size, steps=4)
        checkpoints[world_size] = latest_step(directory / "ckpt")
    return checkpoints


@pytest.fixture(scope="session")
def loads_at(tmp_path_factory, trainer_checkpoints):
    """`loads_at(N)` -> directory with every fixture resharded to N (`<name>`), torch's own
    save of the loaded state (`torch-<name>`) and the load results (`out/`); at N = 4 also
    the HSDP 2x2 versions (`<name>-hsdp`); the trainer's checkpoints resharded to N
    (`trainer-world<W>`) loaded into its GPT."""
    done: dict[int, Path] = {}

    def run(world_size: int) -> Path:
        if world_size not in done:
            root = tmp_path_factory.mktemp(f"loads-world{world_size}")
            jobs = []
            for source_world, checkpoint in trainer_checkpoints.items():
                name = f"trainer-world{source_world}"
                reshard(checkpoint, root / name, world_size)
                jobs.append(LoadJob(name, str(root / name), optimizer=True, model="gpt"))
            for name, (dtype, optimizer) in FIXTURE_STATE.items():
                reshard(FIXTURES / name, root / name, world_size)
                jobs.append(LoadJob(name, str(root / name), dtype, optimizer, optimizer, save_to=str(root / f"torch-{name}")))
                if name == "fsdp2_world2":  # model only: a world-1 copy is resharded by the every-tensor rule
                    single = root / f"{name}-world1"
                    reshard(FIXTURES / name, single, 1)
                    reshard(single, root / f"{name}-from-world1", world_size)
                    jobs.append(LoadJob(f"{name}-from-world1", str(root / f"{name}-from-world1"), dtype))
                if world_size == HSDP_MESH[0] * HSDP_MESH[1]:
                    reshard(FIXTURES / name, root / f"{name}-hsdp", mesh=HSDP_MESH)
                    jobs.append(LoadJob(f"{name}-hsdp", str(root / f"{name}-hsdp"), dtype, optimizer, optimizer,
                                        mesh=HSDP_MESH, save_to=str(root / f"torch-{name}-hsdp")))
            load_all(jobs, world_size, root / "out")
            done[world_size] = root
        return done[world_size]

    return run


def assert_loaded_equals_source(loaded_file: Path, expected: dict, name: str) -> None:
    loaded = flatten(torch.load(loaded_file, weights_only=False))  # written by our own test worker
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert tensors and set(tensors) <= set(loaded), f"{name}: missing {sorted(set(tensors) - set(loaded))[:5]}"
    for fqn, value in tensors.items():
        assert_same_bytes(loaded[fqn], value, f"{name}: {fqn}")
    for fqn in (k for k in expected if k.startswith("extra.")):
        assert loaded[fqn] == expected[fqn], f"{name}: {fqn}"


def chunk_layout(checkpoint: Path) -> dict:
    """fqn -> [(offsets, sizes, file)] and object fqn -> file, from the metadata."""
    ckpt = read_checkpoint(checkpoint)
    layout = {fqn: [(c.offsets, c.sizes, c.blob.file) for c in t.chunks] for fqn, t in ckpt.tensors.items()}
    layout.update({fqn: o.blob.file for fqn, o in ckpt.objects.items()})
    return layout


# ---------------------------------------------------------------------------------------------
# Loading with stock torch


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stock_dcp_load_of_resharded_fixtures_on_n_ranks_is_bit_identical_to_the_source(loads_at, reference, world_size):
    root = loads_at(world_size)
    for name in FIXTURE_STATE:
        assert_loaded_equals_source(root / "out" / f"{name}.pt", reference(FIXTURES / name), f"{name} -> {world_size}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stock_dcp_load_of_a_single_rank_model_only_source_resharded_to_n_ranks_is_bit_identical(
        loads_at, reference, world_size):
    root = loads_at(world_size)
    name = "fsdp2_world2-from-world1"
    assert_loaded_equals_source(root / "out" / f"{name}.pt", reference(FIXTURES / "fsdp2_world2"), name)
    layout = read_checkpoint(root / name).tensors
    if world_size > 1:
        assert all(len(t.chunks) > 1 for t in layout.values() if t.shape), "every tensor of 1+ dims is sharded"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stock_dcp_load_of_resharded_trainer_checkpoints_into_its_gpt_on_n_ranks_is_bit_identical(
        loads_at, trainer_checkpoints, reference, world_size):
    root = loads_at(world_size)
    for source_world, checkpoint in trainer_checkpoints.items():
        expected = {fqn: value for fqn, value in reference(checkpoint).items() if fqn.startswith(("model.", "optim."))}
        assert any(fqn.startswith("optim.state.") for fqn in expected)
        name = f"trainer-world{source_world}"
        assert_loaded_equals_source(root / "out" / f"{name}.pt", expected, f"{name} -> {world_size}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_resharded_layout_is_exactly_what_torch_saves_from_fsdp2_at_world_n(loads_at, world_size):
    # same chunk boxes, and every chunk, replicated tensor and object in the same rank file
    # as torch's own dcp.save from a fully_shard'ed model on N ranks (dedup balancing included)
    root = loads_at(world_size)
    for name in FIXTURE_STATE:
        assert chunk_layout(root / name) == chunk_layout(root / f"torch-{name}"), name


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_reads_its_shards_only_from_its_own_file(loads_at, world_size):
    root = loads_at(world_size)
    for name in [*FIXTURE_STATE, *(f"trainer-world{w}" for w in TRAINER_WORLDS)]:
        ckpt = read_checkpoint(root / name)
        for rank in range(world_size):
            own = f"__{rank}_0.distcp"
            # a lower bound too: every non-empty chunk of the loaded state (model and optimizer;
            # not the trainer's rng) its own file holds, its shards and the replicated tensors
            # written to it, is read by it
            stored = {(fqn, chunk.offsets) for fqn, tensor in ckpt.tensors.items() if fqn.startswith(("model.", "optim."))
                      for chunk in tensor.chunks if chunk.blob.file == own and chunk.numel}
            assert stored, f"{name}: rank {rank}'s file holds no tensor bytes"
            read = set()
            for fqn, offsets, file, _, _ in read_reads(root / "out", name, rank):
                tensor = ckpt.tensors.get(fqn)
                sharded = tensor is not None and len(tensor.chunks) > 1
                if sharded:
                    assert file == own, f"{name}: rank {rank} read {fqn} {offsets} from {file}"
                if file == own:
                    read.add((fqn, offsets))
            assert stored <= read, f"{name}: rank {rank} did not read {sorted(stored - read)[:3]}"
            # replicated tensors and objects are written once (as torch does), so other
            # ranks read those few small entries from the one file that holds them


def test_original_world2_checkpoint_loaded_at_3_reads_shards_across_files(loads_at, tmp_path):
    # the contrast to the locality test: DCP's load-time resharding makes rank 1 of 3 read
    # rows that live in both source files
    ckpt = read_checkpoint(FIXTURES / "fsdp2_world2_adamw")
    embed = ckpt.tensors["model.embed.weight"]
    assert [c.sizes[0] for c in embed.chunks] == [7, 6]  # rank 1 of 3 owns rows 5..10
    assert {c.blob.file for c in embed.chunks if c.offsets[0] < 10 and c.offsets[0] + c.sizes[0] > 5} == {
        "__0_0.distcp", "__1_0.distcp"}


def test_hsdp_mesh_shards_over_s_and_writes_each_chunk_once_like_torch(loads_at, reference):
    root = loads_at(HSDP_MESH[0] * HSDP_MESH[1])
    for name in FIXTURE_STATE:
        assert_loaded_equals_source(root / "out" / f"{name}-hsdp.pt", reference(FIXTURES / name), f"{name} -> hsdp")
        ours = chunk_layout(root / f"{name}-hsdp")
        assert ours == chunk_layout(root / f"torch-{name}-hsdp"), name
        embed = ours["model.embed.weight"]
        assert [(offsets, sizes) for offsets, sizes, _ in embed] == [((0, 0), (7, 8)), ((7, 0), (6, 8))]


# ---------------------------------------------------------------------------------------------
# The blobs and the metadata we write


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "bool", "uint16", "float8_e4m3fn", "complex64"])
@pytest.mark.parametrize("shape", [(5, 8), (0, 8), (), (3,), (2, 0)])
def test_chunk_record_loads_with_torch_load_as_the_same_tensor(dtype, shape):
    numel = 1
    for size in shape:
        numel *= size
    value = torch.arange(numel).reshape(shape).to(getattr(torch, dtype))
    record = record_bytes(dtype, shape, tensor_bytes(value))
    assert_same_bytes(torch.load(io.BytesIO(record), weights_only=True), value)


def test_resharded_metadata_keeps_version_planner_data_and_objects_verbatim(tmp_path):
    import pickle

    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", 2)
    source = pickle.loads((FIXTURES / "fsdp2_world3_uneven" / ".metadata").read_bytes())  # our bundled fixture
    written = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())  # just written by us
    assert written.version == source.version
    assert written.planner_data == source.planner_data
    src, out = read_checkpoint(FIXTURES / "fsdp2_world3_uneven"), read_checkpoint(tmp_path / "out")
    for fqn, obj in src.objects.items():
        moved = out.objects[fqn].blob
        original = (FIXTURES / "fsdp2_world3_uneven" / obj.blob.file).read_bytes()[obj.blob.offset:obj.blob.offset + obj.blob.length]
        assert (tmp_path / "out" / moved.file).read_bytes()[moved.offset:moved.offset + moved.length] == original


@pytest.mark.parametrize("world_size", [1, 5])
def test_inspect_shows_new_layout_and_validate_deep_passes(cli, tmp_path, world_size):
    out = tmp_path / "out"
    reshard(FIXTURES / "fsdp2_world3_uneven", out, world_size)
    assert sorted(p.name for p in out.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)]
    inspected = cli("inspect", out, "--json")
    assert inspected.exit_code == 0
    assert [f["rank"] for f in json.loads(inspected.stdout)["files"]] == list(range(world_size))
    text = cli("inspect", out).output
    assert f"in {world_size} files" in text
    assert ("from rank 0" if world_size == 1 else f"from ranks 0..{world_size - 1}") in text
    validated = cli("validate", "--deep", out)
    assert validated.exit_code == 0, validated.output


def test_torch_dcp_to_torch_save_of_every_fixture_resharded_to_every_n_matches_the_source(tmp_path, reference):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for name in FIXTURE_NAMES:
        expected = reference(FIXTURES / name)
        for world_size in WORLD_SIZES:
            out = tmp_path / f"{name}-{world_size}"
            reshard(FIXTURES / name, out, world_size)
            dcp_to_torch_save(out, tmp_path / "full.pt")
            got = flatten(torch.load(tmp_path / "full.pt", weights_only=False))  # written by torch just now
            assert set(got) == set(expected)
            for fqn, value in expected.items():
                if isinstance(value, torch.Tensor):
                    assert_same_bytes(got[fqn], value, f"{name} -> {world_size}: {fqn}")
                else:
                    assert got[fqn] == value


def test_resharding_is_deterministic_byte_for_byte(tmp_path):
    # (the same destination: torch records the checkpoint path in the metadata)
    reshard(FIXTURES / "fsdp2_world2_adamw", tmp_path / "out", 3)
    first = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}
    reshard(FIXTURES / "fsdp2_world2_adamw", tmp_path / "out", 3, write=WriteOptions(threads=1, max_memory="1KB", force=True))
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == first


def test_resharding_back_to_the_source_world_size_gives_the_source_layout(tmp_path):
    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "w5", 5)
    reshard(tmp_path / "w5", tmp_path / "w3", 3)
    assert chunk_layout(tmp_path / "w3") == chunk_layout(FIXTURES / "fsdp2_world3_uneven")


def test_world_1_source_is_sharded_by_the_optimizer_state_rule(tmp_path):
    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "w1", 1)
    ckpt = read_checkpoint(tmp_path / "w1")
    assert all(len(t.chunks) == 1 for t in ckpt.tensors.values())
    reshard(tmp_path / "w1", tmp_path / "w2", 2)
    layout = read_checkpoint(tmp_path / "w2").tensors
    assert len(layout["model.embed.weight"].chunks) == 2  # has optim.state.embed.weight.*
    assert len(layout["optim.state.embed.weight.exp_avg"].chunks) == 2
    assert len(layout["model.position_ids"].chunks) == 1  # a buffer: no optimizer state
    assert len(layout["optim.state.embed.weight.step"].chunks) == 1  # 0-d


def test_world_1_source_without_optimizer_state_shards_every_tensor_unless_kept_whole(tmp_path):
    reshard(FIXTURES / "fsdp2_world2", tmp_path / "w1", 1)
    report = reshard(tmp_path / "w1", tmp_path / "w2", 2)
    assert report.plan.rule == "every-tensor"
    layout = read_checkpoint(tmp_path / "w2").tensors
    assert len(layout["model.position_ids"].chunks) == 2  # a buffer, but nothing tells it from a parameter
    kept = reshard(tmp_path / "w1", tmp_path / "w2-kept", 2, keep_whole=["model.position_ids", "*.mask"])
    layout = read_checkpoint(tmp_path / "w2-kept").tensors
    assert len(layout["model.position_ids"].chunks) == 1 and len(layout["model.mask"].chunks) == 1
    assert len(layout["model.embed.weight"].chunks) == 2
    assert kept.plan.keep_whole == ("model.position_ids", "*.mask")


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_records_copied_in_the_kernel_with_crcs_from_the_stored_ones_equal_records_summed_byte_for_byte(
        tmp_path, monkeypatch, reference, world_size):
    """Every record through record_writes.write_record (as a large one goes): its data copied
    in the kernel, its CRC-32 combined from the source's stored ones (or from a stored one and
    the rest of a cut record); the same bytes as records built whole and summed, each record
    loads with torch.load, and torch's own DCP load of the output gives the source's tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpttool.run import execute, record_writes

    name, out = "fsdp2_world3_uneven", tmp_path / "out"  # one destination: torch records it in the metadata
    reshard(FIXTURES / name, out, world_size)
    summed = {path.name: path.read_bytes() for path in out.iterdir()}
    slices = []
    crc32_slice = record_writes.crc32_slice
    monkeypatch.setattr(record_writes, "crc32_slice", lambda *args: slices.append(args) or crc32_slice(*args))
    monkeypatch.setattr(execute, "SMALL_OPERATION", 0)  # no record is small: each goes the large records' way
    reshard(FIXTURES / name, out, world_size, write=WriteOptions(force=True))
    assert slices, "some records hold part of a source record whose CRC-32 is derived from the stored one"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == summed
    checkpoint = read_checkpoint(out)
    for fqn, tensor in checkpoint.tensors.items():
        for chunk in tensor.chunks:
            data = summed[chunk.blob.file][chunk.blob.offset:chunk.blob.offset + chunk.blob.length]
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            assert tuple(loaded.shape) == tuple(chunk.sizes) and str(loaded.dtype) == f"torch.{tensor.dtype}", fqn
    dcp_to_torch_save(out, tmp_path / "full.pt")
    got = flatten(torch.load(tmp_path / "full.pt", weights_only=False))  # written by torch just now
    for fqn, value in reference(FIXTURES / name).items():
        if isinstance(value, torch.Tensor):
            assert_same_bytes(got[fqn], value, fqn)
        else:
            assert got[fqn] == value


def test_execute_tells_each_output_done_once_as_soon_as_its_last_operation_ran(tmp_path, monkeypatch):
    """`execute.run(on_file_done=...)`: each output is named once, when every copy into it has
    run and before the next output's copies start (outputs written one after another), and an
    output no operation writes is named at the end."""
    import numpy as np

    from ckpttool.run import execute
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.plan.operations import Copy

    source = np.random.default_rng(0).integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "data.bin").write_bytes(source)
    names = ["a", "b", "c", "empty"]
    operations = [Copy("data.bin", 4096 * n + 1024 * k, name, 1024 * k, 1024)
                  for n, name in enumerate(names[:3]) for k in range(4)]
    monkeypatch.setattr(execute, "SMALL_OPERATION", 0)  # a task per copy
    fds = {name: os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o644) for name in names}
    told = []

    def on_file_done(name: str) -> None:
        # what every output holds at that moment
        told.append((name, {other: os.pread(fd, 4096, 0) for other, fd in fds.items()}))

    try:
        with DataFiles(tmp_path / "src") as files:
            execute.run(operations, files, fds, threads=1, max_memory=1 << 20, on_file_done=on_file_done)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert [name for name, _ in told] == names
    for number, (name, seen) in enumerate(told[:3]):
        assert seen[name] == source[4096 * number:4096 * (number + 1)], f"{name} named before it was written"
        assert all(not seen[later] for later in names[number + 1:3]), f"{name} named after later outputs started"


def test_every_rank_file_is_fsynced_exactly_once_before_the_metadata_is_written(tmp_path, monkeypatch):
    """Rank files are fsynced as each is written through (overlapping the copies into the
    next ones), each once, all before `.metadata` is written."""
    from ckpttool.run import execute
    from ckpttool.store import io as ckpt_io

    events = []
    sync, write_file = ckpt_io.sync, execute.write_file
    monkeypatch.setattr(ckpt_io, "sync", lambda fd: events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))) or sync(fd))
    monkeypatch.setattr(execute, "write_file", lambda path, data: events.append(("write", str(path))) or write_file(path, data))
    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", 5)
    synced = [os.path.basename(path) for kind, path in events if kind == "sync"]
    assert sorted(synced) == [f"__{rank}_0.distcp" for rank in range(5)]
    kinds = [kind for kind, _ in events]
    assert kinds == ["sync"] * len(synced) + ["write"] * (len(kinds) - len(synced)), "a rank file synced after the metadata"


# ---------------------------------------------------------------------------------------------
# consolidate agrees


def test_consolidate_of_resharded_checkpoint_equals_consolidate_of_its_source(tmp_path):
    from ckpttool.commands.consolidate import consolidate

    for name in ("fsdp2_world2_bf16", "fsdp2_world3_uneven"):
        consolidate(FIXTURES / name, tmp_path / f"{name}-source.safetensors")
        consolidate(FIXTURES / name, tmp_path / f"{name}-source.pt", convert=ConvertOptions(everything=True))
        for world_size in (1, 4, 5):
            resharded = tmp_path / f"{name}-{world_size}"
            reshard(FIXTURES / name, resharded, world_size)
            consolidate(resharded, tmp_path / f"{name}-{world_size}.safetensors")
            consolidate(resharded, tmp_path / f"{name}-{world_size}.pt", convert=ConvertOptions(everything=True))
            for suffix in (".safetensors", ".pt"):
                assert (tmp_path / f"{name}-{world_size}{suffix}").read_bytes() == \
                    (tmp_path / f"{name}-source{suffix}").read_bytes(), f"{name} -> {world_size} {suffix}"


# ---------------------------------------------------------------------------------------------
# The command line


def no_leftovers(directory: Path) -> bool:
    return not any(p.name.startswith(TEMP_PREFIX) for p in directory.iterdir())


def test_cli_writes_src_world_n_beside_src_by_default(cli, tmp_path):
    source = tmp_path / "step-00000002"
    shutil.copytree(FIXTURES / "fsdp2_world2", source)
    result = cli("reshard", source, "--world", "3")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "step-00000002-world3" / "__2_0.distcp").is_file()
    assert "3 ranks" in result.output


def test_cli_dry_run_prints_each_target_rank_and_writes_nothing(cli, tmp_path):
    result = cli("reshard", FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", "--world", "4", "--dry-run")
    assert result.exit_code == 0
    assert not (tmp_path / "out").exists()
    lines = result.output.splitlines()
    assert lines[0].startswith("reshard to 4 ranks (mesh 4): 58 tensors (42 sharded, 16 whole)")
    assert lines[1].startswith("  rule: source")
    assert [line.split()[1] for line in lines[2:6]] == ["0", "1", "2", "3"]
    assert "__3_0.distcp" in lines[5] and "bytes" in lines[5]


def test_verify_catches_a_byte_that_differs_from_the_source_and_keeps_nothing(monkeypatch, tmp_path):
    from ckpttool.run import execute
    from ckpttool.core.errors import VerificationFailed

    real_write_at = execute.write_at
    flipped = []

    def write_at_then_flip_the_first_tensor_byte(fd, data, offset):
        real_write_at(fd, data, offset)
        # tensor bytes stream from a reused buffer (memoryview), or small records come gathered
        # (bytearray: heads, data and tails); a lone record head or tail is bytes
        if isinstance(data, (memoryview, bytearray)) and len(data) and not flipped:
            os.pwrite(fd, bytes([data[0] ^ 0xFF]), offset)
            flipped.append(offset)

    monkeypatch.setattr(execute, "write_at", write_at_then_flip_the_first_tensor_byte)
    with pytest.raises(VerificationFailed, match="differs from the source"):
        reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", 2, write=WriteOptions(threads=1, verify=True))
    assert flipped and list(tmp_path.iterdir()) == []


def test_cli_refuses_an_existing_destination_without_force(cli, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    refused = cli("reshard", FIXTURES / "fsdp2_world2", tmp_path / "out", "--world", "3")
    assert refused.exit_code == 2 and "--force" in refused.output
    assert (tmp_path / "out" / "keep").exists()
    replaced = cli("reshard", FIXTURES / "fsdp2_world2", tmp_path / "out", "--world", "3", "--force", "--verify")
    assert replaced.exit_code == 0, replaced.output
    assert (tmp_path / "out" / "keep").read_text() == "x" and "verified" in replaced.output  # not ckpttool's: kept


@pytest.mark.parametrize("args, message", [
    ((), "--world N"),
    (("--mesh", "2,2", "--world", "3"), "does not match"),
    (("--mesh", "two"), "R,S"),
    (("--world", "2", "--max-memory", "lots"), "cannot read size"),
])
def test_cli_usage_errors_exit_2_with_a_message(cli, tmp_path, args, message):
    result = cli("reshard", FIXTURES / "fsdp2_world2", tmp_path / "out", *args)
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "out").exists()


def corrupt_truncated_data_file(path: Path) -> None:
    data = path / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:5000])


def corrupt_garbage_metadata(path: Path) -> None:
    (path / ".metadata").write_bytes(b"\x80\x04garbage")


def corrupt_missing_data_file(path: Path) -> None:
    (path / "__0_0.distcp").unlink()


def corrupt_zip_directory(path: Path) -> None:
    data = bytearray((path / "__0_0.distcp").read_bytes())
    at = data.rfind(b"PK\x01\x02")
    data[at:at + 4] = b"XXXX"
    (path / "__0_0.distcp").write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [corrupt_truncated_data_file, corrupt_garbage_metadata,
                                     corrupt_missing_data_file, corrupt_zip_directory])
def test_corrupted_source_fails_with_exit_1_a_message_and_nothing_at_dst(cli, tmp_path, corrupt):
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "fsdp2_world2_adamw", source)
    corrupt(source)
    result = cli("reshard", source, tmp_path / "out", "--world", "3", "--quiet")
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and str(source) in result.output
    assert not (tmp_path / "out").exists()
    assert no_leftovers(tmp_path)


def test_installed_ckpttool_reshards_in_a_real_subprocess(tmp_path):
    command = [os.path.join(os.path.dirname(sys.executable), "ckpttool"), "reshard",
               str(FIXTURES / "fsdp2_world2_bf16"), str(tmp_path / "out"), "--mesh", "2,2", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "4 ranks (mesh 2x2)" in result.stdout
    assert len(read_checkpoint(tmp_path / "out").tensors["model.embed.weight"].chunks) == 2


# ---------------------------------------------------------------------------------------------
# The trainer resumes from a resharded checkpoint exactly as from DCP's load-time resharding


@pytest.mark.parametrize("source_world, world_size", [(2, 3), (3, 4), (4, 2)])
def test_trainer_resumed_from_resharded_checkpoint_has_bit_identical_losses(trainer_checkpoints, tmp_path, source_world, world_size):
    from trainer_runs import losses, run_trainer

    original = trainer_checkpoints[source_world]
    resharded = tmp_path / "resharded" / original.name  # keep the step-0000000S name
    reshard(original, resharded, world_size, write=WriteOptions(verify=True))
    run_trainer(tmp_path / "from-original", "--resume", str(original), nproc=world_size, steps=4)
    run_trainer(tmp_path / "from-resharded", "--resume", str(resharded), nproc=world_size, steps=4)
    expected, got = losses(tmp_path / "from-original"), losses(tmp_path / "from-resharded")
    assert sorted(got) == [3, 4]
    assert got == expected  # float32 values, compared exactly


@pytest.mark.parametrize("source_world", [2, 3, 4])
def test_trainer_checkpoints_resharded_to_every_n_hold_the_source_bytes(trainer_checkpoints, tmp_path, reference, source_world):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    original = trainer_checkpoints[source_world]
    expected = reference(original)
    for world_size in WORLD_SIZES:
        out = tmp_path / f"world{world_size}"
        reshard(original, out, world_size)
        assert len(read_checkpoint(out).data_files()) == world_size
        # (stock dcp.load of these on N ranks into the trainer's GPT: the loads_at test above;
        # here every entry, scheduler, train state and RNG included, through dcp_to_torch_save)
        dcp_to_torch_save(out, tmp_path / "full.pt")
        got = flatten(torch.load(tmp_path / "full.pt", weights_only=False))  # written by torch just now
        assert set(got) == set(expected)
        for fqn, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert_same_bytes(got[fqn], value, f"world {source_world} -> {world_size}: {fqn}")
