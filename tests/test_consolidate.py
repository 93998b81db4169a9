"""`ckpttool consolidate`: a sharded DCP checkpoint becomes one full state dict, bit for bit.

Every byte comparison is against torch's own `dcp_to_torch_save` of the same checkpoint. Layouts
come from the bundled fixtures, from the real trainer (FSDP2 world 3/4, FSDP1, HSDP, bf16) and
from one spawned world-4 save of what the trainer does not write (2-D block sharding, tied
weights, int/bool buffers).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, assert_same_bytes, flatten, save_with_writer_options

from ckpttool.options import ConvertOptions, WriteOptions
from ckpttool.run import execute
from ckpttool.commands.consolidate import consolidate
from ckpttool.core.errors import VerificationFailed
from ckpttool.plan.operations import Band, Copy
from ckpttool.outputs.temps import TEMP_PREFIX

CKPTTOOL = Path(sys.executable).with_name("ckpttool")


def model_part(reference: dict) -> dict:
    """The reference's `model.*` entries under the keys `model.state_dict()` has."""
    return {k.removeprefix("model."): v for k, v in reference.items() if k.startswith("model.")}


def assert_same_state(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_same_bytes(actual[key], value, key)
        else:
            assert actual[key] == value and type(actual[key]) is type(value), key


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX)]


# ---------------------------------------------------------------------------------------------
# Checkpoints the bundled fixtures do not cover, written once per session


TRAINER_LAYOUTS = {
    "fsdp2_world3_bf16": (("--param-dtype", "bfloat16"), 3),
    "fsdp2_world4": ((), 4),
    "fsdp1_world2": (("--fsdp", "1"), 2),
    "hsdp_2x2": (("--replicate", "2"), 4),
}


@pytest.fixture(scope="session")
def written(trainer_checkpoint, block_tied_buffers) -> dict[str, Path]:
    """name -> checkpoint directory, for the trainer's layouts (shared with other files through
    conftest's `trainer_checkpoint`) and the world-4 save of what it does not write (conftest's
    `block_tied_buffers`, shared with test_manifest.py)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {name: pool.submit(trainer_checkpoint, *args, nproc=nproc) for name, (args, nproc) in TRAINER_LAYOUTS.items()}
        paths = {name: run.result() for name, run in runs.items()}
    paths["block_tied_buffers"] = block_tied_buffers
    return paths


# ---------------------------------------------------------------------------------------------
# Bit-exact against torch


def test_safetensors_of_every_fixture_is_byte_identical_to_torch(fixture_checkpoint, reference, tmp_path, cli):
    out = tmp_path / "model.safetensors"
    result = cli("consolidate", fixture_checkpoint, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(out), model_part(reference(fixture_checkpoint)))


def test_safetensors_file_is_the_file_safetensors_save_file_writes(reference, tmp_path):
    expected = tmp_path / "expected.safetensors"
    save_file(model_part(reference(FIXTURES / "fsdp2_world3_uneven")), expected, metadata={"format": "pt"})
    consolidate(FIXTURES / "fsdp2_world3_uneven", tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == expected.read_bytes()


def test_pt_of_every_fixture_loads_with_weights_only_and_is_byte_identical(fixture_checkpoint, reference, tmp_path):
    consolidate(fixture_checkpoint, tmp_path / "model.pt")
    assert zipfile.ZipFile(tmp_path / "model.pt").testzip() is None  # every CRC-32 is right
    assert_same_state(torch.load(tmp_path / "model.pt", weights_only=True), model_part(reference(fixture_checkpoint)))


@pytest.mark.parametrize("name", ["fsdp2_world2_adamw", "fsdp2_world3_uneven"])
def test_all_to_pt_equals_dcp_to_torch_save_with_optimizer_state_and_objects(name, reference, tmp_path):
    report = consolidate(FIXTURES / name, tmp_path / "everything.pt", convert=ConvertOptions(everything=True), write=WriteOptions(verify=True))
    loaded = torch.load(tmp_path / "everything.pt", weights_only=True)
    assert isinstance(loaded["optim"]["param_groups"], list)  # nested as saved
    extra = {fqn.removeprefix("extra."): value for fqn, value in reference(FIXTURES / name).items()
             if fqn.startswith("extra.")}
    assert set(extra) == {"step", "note"} and loaded["extra"] == extra  # a dict, nested as saved
    assert_same_state(flatten(loaded), reference(FIXTURES / name))
    assert report.objects > 0 and report.verified


@pytest.mark.parametrize("writer_options", ["safetensors", "zstd"])
def test_safetensors_and_zstd_serialised_checkpoints_consolidate_to_the_saved_bytes(writer_options, tmp_path):
    state = save_with_writer_options(tmp_path / "ckpt", writer_options)
    # the saved state itself is the reference: torch 2.13's own dcp_to_torch_save cannot read
    # a SAFETENSORS-format checkpoint back at all (its FileSystemReader torch.loads every
    # tensor blob: "Unsupported operand 176"); ckpttool reads it
    expected = flatten(state)
    consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors", write=WriteOptions(verify=True))
    assert_same_state(load_file(tmp_path / "model.safetensors"), model_part(expected))
    consolidate(tmp_path / "ckpt", tmp_path / "all.pt", convert=ConvertOptions(everything=True), write=WriteOptions(verify=True))
    assert_same_state(flatten(torch.load(tmp_path / "all.pt", weights_only=True)), expected)
    # resharded (to torch_save records), the same bytes come out
    from ckpttool.commands.reshard import reshard

    reshard(tmp_path / "ckpt", tmp_path / "world3", 3, write=WriteOptions(verify=True))
    consolidate(tmp_path / "world3", tmp_path / "world3.pt", convert=ConvertOptions(everything=True))
    assert_same_state(flatten(torch.load(tmp_path / "world3.pt", weights_only=True)), expected)


@pytest.mark.parametrize("name", ["fsdp2_world3_bf16", "fsdp2_world4", "fsdp1_world2", "hsdp_2x2", "block_tied_buffers"])
def test_trainer_and_spawned_layouts_are_byte_identical_to_torch(name, written, reference, tmp_path):
    checkpoint = written[name]
    expected = model_part(reference(checkpoint))
    consolidate(checkpoint, tmp_path / "model.safetensors", write=WriteOptions(verify=True))
    assert_same_state(load_file(tmp_path / "model.safetensors"), expected)
    consolidate(checkpoint, tmp_path / "model.pt")
    assert_same_state(torch.load(tmp_path / "model.pt", weights_only=True), expected)


@pytest.mark.parametrize("name", ["fsdp2_world3_bf16", "hsdp_2x2"])
def test_trainer_optimizer_state_with_all_equals_torch(name, written, reference, tmp_path):
    consolidate(written[name], tmp_path / "everything.pt", convert=ConvertOptions(everything=True))
    assert_same_state(flatten(torch.load(tmp_path / "everything.pt", weights_only=True)), reference(written[name]))


def test_block_sharding_and_hsdp_replicas_are_planned_as_expected(written):
    report = consolidate(written["block_tied_buffers"], "unused.safetensors", write=WriteOptions(dry_run=True))
    operations = {t.key: t.operations for t in report.plan.tensors}
    (band,) = operations["block.weight"]  # 2x2 blocks of short rows: one band of whole rows
    block = next(t for t in report.plan.tensors if t.key == "block.weight")
    assert isinstance(band, Band) and (band.offset, band.length) == (block.offset, block.nbytes)
    assert sorted(part.chunk for part in band.parts) == [0, 1, 2, 3]
    assert all(isinstance(op, Copy) for op in operations["fc.weight"])
    assert len(operations["fc.weight"]) == 2  # 2 shards; the replica's copies are not read again


# ---------------------------------------------------------------------------------------------
# Hub layout


def test_sharded_directory_loads_into_the_trainers_model_with_huggingface_hub(written, reference, tmp_path, cli):
    from huggingface_hub import load_torch_model

    from train_minimal.model import GPT

    checkpoint = written["fsdp2_world4"]
    out = tmp_path / "hub"
    assert cli("consolidate", checkpoint, out, "--max-shard-size", "20kB", "--quiet").exit_code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards and sorted(set(index["weight_map"].values())) == shards
    model = GPT(32, 2, 2, 128, 32)
    load_torch_model(model, out, strict=True)
    assert_same_state(model.state_dict(), model_part(reference(checkpoint)))


def test_shards_are_what_huggingface_hub_save_torch_state_dict_writes(reference, tmp_path):
    from huggingface_hub import save_torch_state_dict

    from ckpttool.readers.dcp import read_checkpoint

    # in the order the state dict was saved (model.state_dict() order, kept in .metadata)
    saved = [fqn.removeprefix("model.") for fqn in read_checkpoint(FIXTURES / "fsdp2_world2").nesting]
    part = model_part(reference(FIXTURES / "fsdp2_world2"))
    state = {key: part[key].clone() for key in saved}
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(state, tmp_path / "hub", max_shard_size=1000)
    consolidate(FIXTURES / "fsdp2_world2", tmp_path / "ours", convert=ConvertOptions(max_shard_size="1000"))
    theirs = sorted(p.name for p in (tmp_path / "hub").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == theirs
    for name in theirs:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "hub" / name).read_bytes(), name


def test_a_directory_that_fits_one_shard_is_model_safetensors_without_index(tmp_path):
    report = consolidate(FIXTURES / "fsdp2_world2", tmp_path / "hub")
    assert [p.name for p in report.files] == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Selection, keys, dtypes, ties


def test_all_to_safetensors_refuses_python_objects_and_says_to_write_pt(tmp_path, cli):
    result = cli("consolidate", FIXTURES / "fsdp2_world2_adamw", tmp_path / "x.safetensors", "--all")
    assert result.exit_code == 2
    assert "python objects" in result.output and ".pt" in result.output
    assert not (tmp_path / "x.safetensors").exists()


def test_filter_selects_optimizer_tensors_for_safetensors(reference, tmp_path):
    consolidate(FIXTURES / "fsdp2_world2_adamw", tmp_path / "o.safetensors", convert=ConvertOptions(everything=True, filters=["optim.state.*"]))
    expected = {k: v for k, v in reference(FIXTURES / "fsdp2_world2_adamw").items() if k.startswith("optim.state.")}
    assert_same_state(load_file(tmp_path / "o.safetensors"), expected)


def test_dry_run_shows_normalised_and_renamed_keys_and_writes_nothing(tmp_path, cli):
    out = tmp_path / "m.safetensors"
    result = cli("consolidate", FIXTURES / "fsdp2_world2", out, "--dry-run", "--rename", r"^layers\.=h.", "--dtype", "bf16")
    assert result.exit_code == 0
    rows = {line.split()[0]: line.split()[1:4] for line in result.output.splitlines()[2:-1]}
    assert rows["h.0.fc1.weight"] == ["model.layers.0.fc1.weight", "float32->bfloat16", "20x8"]
    assert rows["position_ids"] == ["model.position_ids", "int64", "5"]
    assert not out.exists() and not leftovers(tmp_path)


def test_rename_collision_exits_1_and_writes_nothing(tmp_path, cli):
    result = cli("consolidate", FIXTURES / "fsdp2_world2", tmp_path / "m.safetensors", "--rename", r"\.\d+\.=.")
    assert result.exit_code == 1
    assert "both become" in result.output
    assert list(tmp_path.iterdir()) == []


def test_dtype_bf16_equals_tensor_to_bfloat16_and_leaves_integers_alone(reference, tmp_path):
    consolidate(FIXTURES / "fsdp2_world3_uneven", tmp_path / "m.safetensors", convert=ConvertOptions(dtype="bf16"), write=WriteOptions(verify=True))
    expected = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in model_part(reference(FIXTURES / "fsdp2_world3_uneven")).items()
    }
    assert_same_state(load_file(tmp_path / "m.safetensors"), expected)


def test_dtype_map_keeps_norms_in_fp32(reference, tmp_path):
    consolidate(FIXTURES / "fsdp2_world2", tmp_path / "m.pt", convert=ConvertOptions(dtype="fp16", dtype_map=["*norm*=fp32"]))
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded["layers.0.norm.weight"].dtype == torch.float32
    assert_same_bytes(loaded["layers.0.fc1.weight"], reference(FIXTURES / "fsdp2_world2")["model.layers.0.fc1.weight"].half())


def test_tied_weights_are_reported_and_drop_tied_keeps_the_embedding(written, tmp_path, cli):
    checkpoint = written["block_tied_buffers"]
    result = cli("consolidate", checkpoint, tmp_path / "both.safetensors", "--quiet")
    assert "tied: lm_head.weight is the same tensor as tok_emb.weight" in result.output
    assert {"lm_head.weight", "tok_emb.weight"} <= set(load_file(tmp_path / "both.safetensors"))
    report = consolidate(checkpoint, tmp_path / "one.safetensors", convert=ConvertOptions(drop_tied=True))
    assert report.dropped == ("lm_head.weight",)
    loaded = load_file(tmp_path / "one.safetensors")
    assert "lm_head.weight" not in loaded and "tok_emb.weight" in loaded
    assert not [t for t in report.ties if t.kept.startswith("norm")]  # equal bytes alone are no tie


# ---------------------------------------------------------------------------------------------
# Safety: nothing half-written, ever


def copy_checkpoint(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    return destination


def test_existing_output_is_kept_without_force_and_replaced_with_it(tmp_path, cli):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"precious")
    result = cli("consolidate", FIXTURES / "fsdp2_world2", out, "--quiet")
    assert result.exit_code == 2 and "--force" in result.output
    assert out.read_bytes() == b"precious"
    assert cli("consolidate", FIXTURES / "fsdp2_world2", out, "--quiet", "--force").exit_code == 0
    assert load_file(out)


@pytest.mark.parametrize("damage", ["truncated", "missing", "malicious"])
def test_a_damaged_source_exits_1_naming_the_file_and_leaves_nothing(damage, tmp_path, cli):
    checkpoint = copy_checkpoint(FIXTURES / "fsdp2_world2", tmp_path / "ckpt")
    data = checkpoint / "__1_0.distcp"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "missing":
        data.unlink()
    else:
        (checkpoint / ".metadata").write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = cli("consolidate", checkpoint, out_dir / "m.safetensors", "--quiet")
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and ("__1_0.distcp" in result.output or ".metadata" in result.output)
    assert list(out_dir.iterdir()) == []


def test_a_disk_full_write_exits_1_and_leaves_nothing(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    result = subprocess.run(
        [CKPTTOOL, "consolidate", "--quiet", FIXTURES / "fsdp2_world2", out_dir / "m.safetensors"],
        preexec_fn=limit_file_size, capture_output=True, text=True,
    )
    assert result.returncode == 1, result.stderr
    assert "writing failed" in result.stderr and "File too large" in result.stderr
    assert list(out_dir.iterdir()) == []


def test_verify_failure_keeps_nothing(monkeypatch, tmp_path):
    def corrupting_copy(src_fd, src_offset, dst_fd, dst_offset, length):
        os.pwrite(dst_fd, b"\xff" * length, dst_offset)

    monkeypatch.setattr(execute, "copy_range", corrupting_copy)
    with pytest.raises(VerificationFailed, match="differs from the source"):
        consolidate(FIXTURES / "fsdp2_world2", tmp_path / "m.safetensors", write=WriteOptions(verify=True))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory) -> Path:
    """A 256 MB single-process checkpoint: big enough to interrupt a consolidation midway."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("large") / "ckpt"
    dcp.save({"model": {f"w{i}": torch.full((1024, 8192), float(i)) for i in range(8)}}, checkpoint_id=directory, no_dist=True)
    return directory


def writing_into(pid: int, directory: Path) -> bool:
    """Whether process `pid` has a file open in `directory` (the output being written: with
    O_TMPFILE it has no name there, so only /proc shows it)."""
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            if os.readlink(fd).startswith(f"{directory}/"):
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def default_sigint() -> None:
    """Give the child SIGINT's default action: a suite started in the background by a
    non-interactive shell inherits SIGINT ignored, and ckpttool keeps an ignored SIGINT
    ignored (as under nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_killing_a_consolidation_midway_leaves_no_file_at_out(how, large_checkpoint, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process = subprocess.Popen(
        [CKPTTOOL, "consolidate", "--quiet", "--threads", "1", "--dtype", "bf16", large_checkpoint, out_dir / "m.safetensors"],
        stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 30
    while not writing_into(process.pid, out_dir) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.005)
    assert writing_into(process.pid, out_dir), "the output was never opened"
    process.send_signal(how)
    process.wait(timeout=30)
    assert not (out_dir / "m.safetensors").exists()
    if how == signal.SIGINT:
        assert process.returncode == 130 and "interrupted" in process.stderr.read()
        assert list(out_dir.iterdir()) == []  # Ctrl-C also removes the temporary file
    process.stderr.close()


def test_installed_cli_prints_a_summary_line_and_no_progress_bar_into_a_pipe(tmp_path):
    out = tmp_path / "m.safetensors"
    result = subprocess.run([CKPTTOOL, "consolidate", FIXTURES / "fsdp2_world2_bf16", out, "--verify"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote 16 tensors, 1.7 kB to ") and "verified" in result.stdout
    assert "%|" not in result.stderr  # bars only on a terminal (test_first_minutes.py shows one there)
    assert load_file(out)["embed.weight"].dtype == torch.bfloat16
