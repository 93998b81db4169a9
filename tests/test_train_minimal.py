"""The trainer (`python -m train_minimal`): exact resume, resume at another world size, the
checkpoints it writes, and its usage errors.

Every run is a real multi-process job (gloo on CPU, tiny preset) started through
`trainer_runs.run_trainer` (the launcher forked from the session's forkserver; one run and the
usage errors through `python -m train_minimal` itself); session-scoped fixtures run each one once. Weights and
optimizer state are compared byte for byte. The one tolerance is for a resume at another
world size: the same weights see the same samples, but the loss is a mean of per-rank
means summed in another order and the matmuls see other batch shapes, so it may differ
in the last float32 bits; we allow a relative difference of 1e-5 (float32 epsilon is 1.2e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import flatten, tensor_bytes
from trainer_runs import latest_step, losses, read_log, run_trainer, run_trainer_expecting_failure

# Relative tolerance for the first loss after resuming at another world size (see above).
CROSS_WORLD_RELATIVE_TOLERANCE = 1e-5
STEPS = 20
HALF = 10
SAVE_EVERY = 5  # the resumed half saves step 15 while training goes on (async in FSDP2)


@dataclass(frozen=True)
class ResumePair:
    """A straight 20-step run and the same run stopped at step 10 and resumed to 20."""

    straight: Path  # run directory: ckpt/, log.jsonl, full.safetensors
    resumed: Path

    def checkpoint(self, which: str, step: int) -> Path:
        return getattr(self, which) / "ckpt" / f"step-{step:08d}"


def run_resume_pair(root: Path, *flags: str, resume_flags: tuple[str, ...] = ()) -> ResumePair:
    """Run `flags` for 20 steps straight, and for 10 + `--resume` 10 steps; both save every 5."""
    straight, resumed = root / "straight", root / "resumed"
    every = ("--save-every", str(SAVE_EVERY))
    run_trainer(straight, *flags, *every, "--export", straight / "full.safetensors", steps=STEPS)
    run_trainer(resumed, *flags, *every, "--stop-at", str(HALF), steps=STEPS)
    run_trainer(resumed, *flags, *resume_flags, *every, "--resume",
                "--export", resumed / "full.safetensors", steps=STEPS)
    return ResumePair(straight, resumed)


@pytest.fixture(scope="session")
def fsdp2_pair(tmp_path_factory) -> ResumePair:
    """FSDP2, world 2; the resumed half saves with --async-save."""
    return run_resume_pair(tmp_path_factory.mktemp("fsdp2"), resume_flags=("--async-save",))


@pytest.fixture(scope="session")
def fsdp1_pair(tmp_path_factory) -> ResumePair:
    """FSDP1 FULL_SHARD, world 2, with dropout (so the per-rank RNG state must be restored)
    and tied embeddings."""
    return run_resume_pair(tmp_path_factory.mktemp("fsdp1"), "--fsdp", "1", "--dropout", "0.1", "--tie-embeddings")


@pytest.fixture(scope="session")
def resumed_at_world(fsdp2_pair, tmp_path_factory):
    """`resumed_at_world(N)`: the FSDP2 world-2 step-10 checkpoint resumed at world N for 2 steps."""
    runs: dict[int, Path] = {}

    def resume(world_size: int) -> Path:
        if world_size not in runs:
            directory = tmp_path_factory.mktemp(f"world{world_size}")
            run_trainer(directory, "--resume", fsdp2_pair.checkpoint("straight", HALF), "--stop-at", str(HALF + 2),
                        nproc=world_size, steps=STEPS)
            runs[world_size] = directory
        return runs[world_size]

    return resume


@pytest.fixture(scope="session")
def extra_checkpoints(trainer_checkpoint) -> dict[str, tuple[Path, int]]:
    """Checkpoints of the other layouts: name -> (step directory, shards per tensor); the HSDP
    run is the one test_consolidate.py consolidates (conftest's `trainer_checkpoint`)."""
    hsdp = trainer_checkpoint("--replicate", "2", nproc=4)
    bf16 = trainer_checkpoint("--mixed-precision", "bf16")
    bf16_params = trainer_checkpoint("--fsdp", "1", "--mixed-precision", "bf16", "--param-dtype", "bfloat16")
    return {"hsdp": (hsdp, 2), "bf16": (bf16, 2), "bf16_params": (bf16_params, 2)}


def assert_same_tensors(actual: dict, expected: dict, skip: tuple[str, ...] = ()) -> None:
    """Assert two flat dicts hold the same keys and, per key, the same dtype, shape and bytes
    (tensors) or equal values (other entries)."""
    keys = sorted(key for key in expected if not key.startswith(skip))
    assert sorted(key for key in actual if not key.startswith(skip)) == keys
    for key in keys:
        if isinstance(expected[key], torch.Tensor):
            assert actual[key].dtype == expected[key].dtype, key
            assert actual[key].shape == expected[key].shape, key
            assert tensor_bytes(actual[key]) == tensor_bytes(expected[key]), f"{key}: bytes differ"
        else:
            assert actual[key] == expected[key], key


def read_checkpoint(checkpoint: Path, scratch: Path) -> dict:
    """Return a whole DCP checkpoint, flattened, read with torch's own dcp_to_torch_save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / (checkpoint.parent.parent.name + "-" + checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, out)
    return flatten(torch.load(out, weights_only=False))  # written by us a line above


@pytest.mark.parametrize("pair_name", ["fsdp2_pair", "fsdp1_pair"])
def test_resume_gives_bit_identical_losses_and_final_weights(pair_name, request):
    pair: ResumePair = request.getfixturevalue(pair_name)
    straight, resumed = losses(pair.straight), losses(pair.resumed)
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in straight:
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]!r} != {straight[step]!r}"
    assert_same_tensors(load_file(pair.resumed / "full.safetensors"), load_file(pair.straight / "full.safetensors"))
    assert (pair.resumed / "full.safetensors").read_bytes() == (pair.straight / "full.safetensors").read_bytes()


@pytest.mark.parametrize("pair_name", ["fsdp2_pair", "fsdp1_pair"])
@pytest.mark.parametrize("step", [HALF + SAVE_EVERY, STEPS])
def test_resumed_checkpoints_equal_straight_ones_byte_for_byte(pair_name, step, request, tmp_path):
    """Model, optimizer (exp_avg, exp_avg_sq, step), scheduler, progress and RNG states; in
    FSDP2 the resumed run saved step 15 asynchronously while it trained steps 16-20."""
    pair: ResumePair = request.getfixturevalue(pair_name)
    straight = read_checkpoint(pair.checkpoint("straight", step), tmp_path)
    resumed = read_checkpoint(pair.checkpoint("resumed", step), tmp_path)
    assert_same_tensors(resumed, straight, skip=("train.config",))


def test_losses_are_bit_identical_between_runs_of_the_same_config(fsdp2_pair):
    # The resumed pair's first half ran as a separate process with the same config.
    straight = losses(fsdp2_pair.straight)
    first_half = [record for record in read_log(fsdp2_pair.resumed) if record["step"] <= HALF]
    assert [record["loss"] for record in first_half] == [straight[step] for step in range(1, HALF + 1)]


def test_loss_falls_on_the_synthetic_corpus(fsdp2_pair):
    loss = losses(fsdp2_pair.straight)
    assert loss[STEPS] < loss[1] - 1.0, loss


@pytest.mark.parametrize("world_size", [3, 1])
def test_world2_checkpoint_resumes_at_another_world_size(world_size, fsdp2_pair, resumed_at_world):
    records = read_log(resumed_at_world(world_size))
    assert [record["step"] for record in records] == [HALF + 1, HALF + 2]
    assert all(record["world_size"] == world_size for record in records)
    straight = losses(fsdp2_pair.straight)
    first = records[0]["loss"]
    assert abs(first - straight[HALF + 1]) <= CROSS_WORLD_RELATIVE_TOLERANCE * abs(straight[HALF + 1]), \
        f"first resumed loss {first!r}, straight run {straight[HALF + 1]!r}"
    # One optimizer step later the weights differ only by that noise too.
    assert abs(records[1]["loss"] - straight[HALF + 2]) <= 10 * CROSS_WORLD_RELATIVE_TOLERANCE * straight[HALF + 2]


def test_fsdp2_checkpoint_resumes_under_fsdp1_at_world_3(fsdp2_pair, tmp_path):
    run_trainer(tmp_path, "--fsdp", "1", "--resume", fsdp2_pair.checkpoint("straight", HALF),
                "--stop-at", str(HALF + 1), nproc=3, steps=STEPS)
    first = read_log(tmp_path)[0]
    expected = losses(fsdp2_pair.straight)[HALF + 1]
    assert first["step"] == HALF + 1
    assert abs(first["loss"] - expected) <= CROSS_WORLD_RELATIVE_TOLERANCE * expected


def test_world3_resume_shards_parameters_three_ways(fsdp2_pair, resumed_at_world):
    records = read_log(resumed_at_world(3))
    param_bytes = records[0]["param_bytes"]
    assert len(param_bytes) == 3
    full = sum(tensor.numel() * 4 for tensor in load_file(fsdp2_pair.straight / "full.safetensors").values())
    assert sum(param_bytes) == full


def test_checkpoint_directory_layout(fsdp2_pair):
    ckpt = fsdp2_pair.straight / "ckpt"
    assert sorted(path.name for path in ckpt.iterdir()) == [
        "latest", "step-00000005", "step-00000010", "step-00000015", "step-00000020"]
    assert (ckpt / "latest").read_text() == "step-00000020\n"
    assert sorted(path.name for path in (ckpt / "step-00000020").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_keep_removes_older_checkpoints(tmp_path):
    # `python -m train_minimal` itself (its ranks from its own forkserver), where the other runs
    # fork the launcher from the test session's forkserver
    ckpt = run_trainer(tmp_path, "--save-every", "1", "--keep", "2", steps=4, subprocess_run=True)
    assert sorted(path.name for path in ckpt.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert latest_step(ckpt).name == "step-00000004"


def test_checkpoint_keys_are_model_optim_and_train_state(fsdp2_pair):
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(fsdp2_pair.checkpoint("straight", STEPS))).read_metadata()
    keys = set(metadata.state_dict_metadata)
    assert {key.split(".")[0] for key in keys} == {"model", "optim", "scheduler", "train", "rng"}
    exported = load_file(fsdp2_pair.straight / "full.safetensors")
    assert {key for key in keys if key.startswith("model.")} == {"model." + name for name in exported}
    assert "model.blocks.0.attn.qkv.weight" in keys
    for state in ("exp_avg", "exp_avg_sq", "step"):
        assert f"optim.state.blocks.0.attn.qkv.weight.{state}" in keys
    assert "optim.param_groups.0.lr" in keys
    assert {"train.step", "train.data_position", "train.world_size", "train.config"} <= keys
    assert {"rng.rank_0.torch", "rng.rank_1.torch"} <= keys


def test_checkpoint_model_entries_equal_the_exported_full_weights(fsdp2_pair, tmp_path):
    state = read_checkpoint(fsdp2_pair.checkpoint("straight", STEPS), tmp_path)
    model = {key[len("model."):]: value for key, value in state.items() if key.startswith("model.")}
    assert_same_tensors(model, load_file(fsdp2_pair.straight / "full.safetensors"))
    assert state["train.step"] == STEPS and state["train.data_position"] == STEPS * 12
    assert json.loads(state["train.config"])["steps"] == STEPS


def test_init_from_exported_weights_reproduces_them_at_world_1(fsdp2_pair, tmp_path):
    out = tmp_path / "again.safetensors"
    run_trainer(tmp_path, "--init-from", fsdp2_pair.straight / "full.safetensors", "--lr", "0",
                "--weight-decay", "0", "--export", out, nproc=1, steps=1)
    assert_same_tensors(load_file(out), load_file(fsdp2_pair.straight / "full.safetensors"))


def _checkpoints_to_validate(name: str, request) -> tuple[Path, int]:
    if name == "fsdp2":
        return request.getfixturevalue("fsdp2_pair").checkpoint("straight", STEPS), 2
    if name == "fsdp2_async":
        return request.getfixturevalue("fsdp2_pair").checkpoint("resumed", STEPS), 2
    if name == "fsdp1":
        return request.getfixturevalue("fsdp1_pair").checkpoint("straight", STEPS), 2
    return request.getfixturevalue("extra_checkpoints")[name]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_async", "fsdp1", "hsdp", "bf16", "bf16_params"])
def test_ckpttool_validates_and_inspects_every_checkpoint_the_trainer_writes(name, request):
    cli = pytest.importorskip("ckpttool.cli")
    from click.testing import CliRunner

    checkpoint, shards = _checkpoints_to_validate(name, request)
    runner = CliRunner()
    validated = runner.invoke(cli.main, ["validate", str(checkpoint), "--deep", "--json"], catch_exceptions=False)
    assert validated.exit_code == 0, validated.output
    assert json.loads(validated.output)["valid"] is True

    inspected = runner.invoke(cli.main, ["inspect", str(checkpoint), "--json"], catch_exceptions=False)
    assert inspected.exit_code == 0, inspected.output
    tensors = {tensor["fqn"]: tensor for tensor in json.loads(inspected.output)["tensors"]}
    model_dtype = "bfloat16" if name == "bf16_params" else "float32"
    sharded = [fqn for fqn in tensors if fqn.startswith("model.") or fqn.endswith((".exp_avg", ".exp_avg_sq"))]
    assert "model.blocks.0.attn.qkv.weight" in sharded
    for fqn in sharded:
        tensor = tensors[fqn]
        assert tensor["sharding"] == "dim0", (fqn, tensor["sharding"])
        assert tensor["chunk_count"] == shards, fqn
        assert tensor["dtype"] == model_dtype, fqn
        assert len({chunk["file"] for chunk in tensor["chunks"]}) == shards, fqn  # one shard per rank file
    for fqn, tensor in tensors.items():
        if fqn.startswith("rng.") or fqn.endswith(".step"):
            assert tensor["sharding"] == "replicated", fqn


def test_global_batch_that_the_world_size_does_not_divide_is_a_usage_error(tmp_path):
    result = run_trainer_expecting_failure(tmp_path, nproc=5)
    assert result.returncode == 2
    assert "--global-batch 12 is not divisible by --nproc 5" in result.stderr


def test_local_launch_takes_master_port_from_the_environment_and_refuses_one_that_is_not_a_port(
        tmp_path, monkeypatch):
    from ports import free_port
    from train_minimal.launch import master_port

    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert master_port() == port
    monkeypatch.delenv("MASTER_PORT")
    assert 0 < master_port() < 65536
    monkeypatch.setenv("MASTER_PORT", "http")
    result = run_trainer_expecting_failure(tmp_path, nproc=1)
    assert result.returncode == 2
    assert "MASTER_PORT='http' is not a TCP port" in result.stderr


def test_cpu_offload_on_a_cpu_only_run_is_an_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --cpu-offload is valid here")
    result = run_trainer_expecting_failure(tmp_path, "--cpu-offload", nproc=1)
    assert result.returncode == 2
    assert "--cpu-offload" in result.stderr and "on the CPU already" in result.stderr


def test_fresh_run_refuses_a_directory_with_checkpoints(fsdp2_pair, tmp_path):
    result = run_trainer_expecting_failure(tmp_path, "--ckpt-dir", fsdp2_pair.straight / "ckpt", nproc=1)
    assert result.returncode == 2
    assert "already holds checkpoints: pass --resume" in result.stderr


def test_help_runs_without_torch():
    environment = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    code = "import sys, runpy; sys.argv=['x', '--help']\ntry: runpy.run_module('train_minimal', run_name='__main__')\n" \
           "except SystemExit: pass\nassert 'torch' not in sys.modules, 'the launcher imported torch'"
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--global-batch" in result.stdout


def test_help_says_each_default_once():
    """`--dim` says "(default: from --size)" and nothing more; no flag says "(default: None)"."""
    from train_minimal.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "(default: None)" not in text and "(default: from --size) (default" not in text
    assert "embedding width (default: from --size)" in text and "(default: tiny)" in text
