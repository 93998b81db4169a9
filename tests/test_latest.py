"""`ckpttool latest RUN`: the newest whole step of a run folder, on runs broken as real runs break.

The run is written once per session by torch's own `dcp.save` under torchrun (2 gloo ranks,
FSDP2 `fully_shard` + AdamW, a tiny MLP), one save per step: step-700 ... step-1200, so name
order (step-1000 < ... < step-900) is not step order. Then, as real runs break:

- step-1200: the save was killed after every rank wrote its data file, before rank 0 wrote
  `.metadata` (rank 0 dies inside `FileSystemWriter.finish`, the run exits non-zero);
- step-1100: one gradient element went NaN before the optimizer step, so AdamW wrote a NaN
  into that one weight, and the save holds it (the model diverged);
- step-1000: rank 1's `.distcp` cut short afterwards (a disk that filled up, a copy cut off);
- step-700 ... step-900: whole.

Run as a script (under torchrun) this file writes that run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_latest.py RUN
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ROOT / "fixtures" / "frameworks"
STEPS = (700, 800, 900, 1000, 1100, 1200)
NAN_STEP, KILLED_STEP, TRUNCATED_STEP = 1100, 1200, 1000
NAN_WEIGHT = "model.2.weight"  # the middle Linear's weight: row 0 is rank 0's shard (FSDP2 Shard(0))
KILLED_MARK = "killed in FileSystemWriter.finish, before .metadata"
KILLED_EXIT = 17


# --- the run: torchrun, FSDP2 + AdamW, torch's dcp.save ----------------------------------------------------

def _train_and_save(run: str) -> None:
    """One rank of the run (torchrun sets the world): a step, then a save, for each of STEPS."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class KilledBeforeMetadata(FileSystemWriter):
        """rank 0 dies where torch writes `.metadata`: after every rank's data files are written."""

        def finish(self, metadata, results) -> None:
            print(KILLED_MARK, file=sys.stderr, flush=True)
            os._exit(KILLED_EXIT)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    for step in STEPS:
        inputs, targets = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if step == NAN_STEP and rank == 0:  # one gradient element overflowed: AdamW carries it into the weight
            model[2].weight.grad.to_local()[0, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        path = f"{run}/step-{step}"
        writer = KilledBeforeMetadata(path) if step == KILLED_STEP else FileSystemWriter(path)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer)
    dist.destroy_process_group()
    os._exit(0)


def _write_broken_run(directory: Path) -> Path:
    run = directory / "run"
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          __file__, str(run)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert job.returncode != 0 and KILLED_MARK in job.stderr, job.stderr[-4000:]  # killed, as planned
    killed = run / f"step-{KILLED_STEP}"
    assert sorted(p.name for p in killed.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]  # data, no .metadata
    truncated = run / f"step-{TRUNCATED_STEP}" / "__1_0.distcp"
    os.truncate(truncated, truncated.stat().st_size // 2)
    return run


@pytest.fixture(scope="session")
def broken_run(tmp_path_factory) -> Path:
    """The run folder (read-only: copy it before changing it)."""
    from conftest import built_once

    return built_once(tmp_path_factory, "latest-run", _write_broken_run)


def _chunk_bytes(step: Path, fqn: str):
    """Return (data file, byte offset, float32 values) of the first chunk of `fqn`, as stored."""
    import numpy as np

    from ckpttool.dcp.blobs import DataFiles, locate, read_chunk
    from ckpttool.readers import open_checkpoint

    checkpoint = open_checkpoint(step)
    tensor = checkpoint.tensors[fqn]
    chunk = tensor.chunks[0]
    with DataFiles(step) as files:
        raw = locate(files, tensor, chunk)
        assert raw is not None
        values = np.frombuffer(bytes(read_chunk(files, tensor, chunk)), dtype=np.float32)
    return step / raw.file, raw.offset, values


def _names(report) -> list[tuple[str, str]]:
    return [(step.name, step.verdict) for step in report.steps]


# --- the torch run --------------------------------------------------------------------------------------------

def test_the_run_is_broken_as_planned(broken_run):
    """What the tests below rely on: name order is not step order, the NaN is in the saved
    weight (one element, put there by AdamW, saved by dcp.save), the other steps' weights are finite."""
    import numpy as np

    assert sorted(p.name for p in broken_run.iterdir())[-1] == "step-900"  # name order's "newest"
    _, _, values = _chunk_bytes(broken_run / f"step-{NAN_STEP}", NAN_WEIGHT)
    assert np.isnan(values).sum() == 1 and np.isnan(values[0])
    _, _, values = _chunk_bytes(broken_run / "step-900", NAN_WEIGHT)
    assert np.isfinite(values).all()


def test_latest_takes_the_newest_whole_step_by_number_and_reads_no_older_one(broken_run):
    from ckpttool.commands.latest import latest

    report = latest(broken_run)
    assert report.chosen == broken_run / f"step-{NAN_STEP}"  # whole: the NaN is not a metadata matter
    assert _names(report) == [("step-1200", "no-metadata"), ("step-1100", "whole")]
    assert report.not_looked_at == 4 and report.total == 6
    assert "2 .distcp data files but no .metadata" in report.steps[0].reason()
    assert [step.step for step in report.steps] == [1200, 1100]


def test_numerics_skips_the_step_whose_weight_went_nan_and_the_truncated_one(broken_run):
    from ckpttool.commands.latest import latest

    report = latest(broken_run, numerics=True)
    assert report.chosen == broken_run / "step-900"
    assert _names(report) == [("step-1200", "no-metadata"), ("step-1100", "non-finite"),
                              ("step-1000", "beyond-eof"), ("step-900", "whole")]
    nan = report.steps[1].problems
    assert [problem.fqn for problem in nan] == [NAN_WEIGHT]  # the model's only: AdamW's exp_avg is not the model
    assert f"{NAN_WEIGHT} holds NaN (float32, 256 elements; one at flat index 0" in nan[0].message
    assert report.not_looked_at == 2


def test_deep_skips_a_step_whose_bytes_changed_on_disk(broken_run, tmp_path):
    """A flipped bit keeps every size: plain `latest` still takes the step, `--deep` (CRC-32) does not."""
    import numpy as np

    from ckpttool.commands.latest import latest

    run = shutil.copytree(broken_run, tmp_path / "run")
    assert latest(run, deep=True).chosen == run / f"step-{NAN_STEP}"  # a NaN is no CRC matter
    file, offset, values = _chunk_bytes(run / f"step-{NAN_STEP}", "model.4.weight")
    with open(file, "r+b") as handle:  # the lowest mantissa bit of the first element: still a finite number
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 1]))
    changed = _chunk_bytes(run / f"step-{NAN_STEP}", "model.4.weight")[2]
    assert np.isfinite(changed).all() and changed[0] != values[0]
    assert latest(run).chosen == run / f"step-{NAN_STEP}"
    report = latest(run, deep=True)
    assert report.chosen == run / "step-900"
    assert _names(report) == [("step-1200", "no-metadata"), ("step-1100", "checksum"), ("step-1000", "beyond-eof"),
                              ("step-900", "whole")]
    assert _names(latest(run, deep=True, numerics=True)) == _names(report)  # 1100 fails on bytes before numbers


# --- the command line ---------------------------------------------------------------------------------------

def test_cli_prints_the_path_alone_and_names_each_skipped_step_on_stderr(broken_run, cli):
    result = cli("latest", broken_run)
    assert result.exit_code == 0
    assert result.stdout == f"{broken_run / 'step-1100'}\n"
    assert result.stderr.splitlines() == [f"skipped {broken_run / 'step-1200'}: 2 .distcp data files but no "
                                          ".metadata: the save was killed before it finished"]
    numerics = cli("latest", broken_run, "--numerics")
    assert numerics.exit_code == 0 and numerics.stdout == f"{broken_run / 'step-900'}\n"
    assert [line.split(":")[0] for line in numerics.stderr.splitlines()] == \
        [f"skipped {broken_run / f'step-{step}'}" for step in (1200, 1100, 1000)]


def test_json_lists_every_step_looked_at_with_its_step_path_and_verdict(broken_run, cli):
    result = cli("latest", broken_run, "--numerics", "--json")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.latest/1" and document["chosen"] == str(broken_run / "step-900")
    assert [(s["step"], s["path"], s["verdict"], s["whole"]) for s in document["steps"]] == [
        (1200, str(broken_run / "step-1200"), "no-metadata", False),
        (1100, str(broken_run / "step-1100"), "non-finite", False),
        (1000, str(broken_run / "step-1000"), "beyond-eof", False),
        (900, str(broken_run / "step-900"), "whole", True)]
    truncated = document["steps"][2]
    assert truncated["codes"] == ["beyond-eof"] and truncated["problem_count"] >= 1
    assert all(p["file"] == "__1_0.distcp" for p in truncated["problems"])
    assert document["steps"][1]["problems"][0]["fqn"] == NAN_WEIGHT
    assert (document["steps_in_run"], document["not_looked_at"], document["numerics"]) == (6, 2, True)


def test_no_whole_step_exits_1_with_one_line_on_the_newest(broken_run, tmp_path, cli):
    run = tmp_path / "run"
    for step in (KILLED_STEP, TRUNCATED_STEP):
        shutil.copytree(broken_run / f"step-{step}", run / f"step-{step}")
    result = cli("latest", run)
    assert result.exit_code == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: [no-whole-step] {run}: none of its 2 steps is whole; the newest: {run / 'step-1200'}")
    document = json.loads(cli("latest", run, "--json").stdout)
    assert document["chosen"] is None and [s["verdict"] for s in document["steps"]] == ["no-metadata", "beyond-eof"]
    (tmp_path / "empty").mkdir()
    empty = cli("latest", tmp_path / "empty")
    assert empty.exit_code == 1 and "no step folders" in empty.stderr
    assert cli("latest", tmp_path / "missing").exit_code == 2


def test_the_installed_ckpttool_gives_train_minimal_a_step_it_resumes_from(tmp_path):
    """`--resume "$(ckpttool latest runs/x)"`, as docs/trainer.md shows it: the trainer's run
    of 3 steps with its newest step cut short; the installed `ckpttool` (a real subprocess)
    names step 2, the trainer resumes from it and redoes step 3 with the same loss, bit for bit."""
    from trainer_runs import losses, run_trainer

    ckpt = run_trainer(tmp_path, "--save-every", "1", steps=3)
    first = losses(tmp_path)
    data = ckpt / "step-00000003" / "__1_0.distcp"
    os.truncate(data, data.stat().st_size - 100)
    latest = subprocess.run([str(Path(sys.executable).parent / "ckpttool"), "latest", str(ckpt)],
                            capture_output=True, text=True, timeout=120)
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout == f"{ckpt / 'step-00000002'}\n" and "step-00000003" in latest.stderr
    run_trainer(tmp_path, "--save-every", "1", "--resume", latest.stdout.rstrip("\n"), steps=3)
    resumed = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()][3:]
    assert [record["step"] for record in resumed] == [3]
    assert resumed[0]["loss"] == first[3]
    from ckpttool.commands.latest import latest as latest_step

    assert latest_step(ckpt).chosen == ckpt / "step-00000003"  # rewritten whole


# --- framework run folders ----------------------------------------------------------------------------------

def _copy_step(source: Path, target: Path) -> Path:
    return shutil.copytree(source, target, symlinks=True)


def test_torchtitan_run_takes_the_hf_export_then_the_dcp_step_when_it_breaks(tmp_path):
    """torchtitan's run folder: step-20 (DCP) and step-30 (its last save, in HF safetensors)."""
    from ckpttool.commands.latest import latest

    fixture = FRAMEWORKS / "torchtitan" / "checkpoint"
    report = latest(fixture)
    assert report.chosen == fixture / "step-30" and report.steps[0].layout == "dcp-hf"
    run = _copy_step(fixture, tmp_path / "checkpoint")
    (run / "step-30" / "model-00001-of-00001.safetensors").unlink()
    report = latest(run)
    assert report.chosen == run / "step-20" and report.steps[1].layout == "dcp"
    assert report.steps[0].verdict != "whole"


def test_lightning_fsdp_run_orders_epoch_step_names_by_step(tmp_path):
    """Lightning's `epoch=0-step=S.ckpt` folders (FSDP strategy: DCP + meta.pt): step=10 is newer
    than step=2 though it sorts first by name; step=20 lost a rank's file."""
    from ckpttool.commands.latest import latest

    source = FRAMEWORKS / "lightning" / "checkpoints" / "epoch=0-step=2.ckpt"
    run = tmp_path / "checkpoints"
    for step in (2, 10, 20):
        _copy_step(source, run / f"epoch=0-step={step}.ckpt")
    (run / "epoch=0-step=20.ckpt" / "__1_0.distcp").unlink()
    report = latest(run)
    assert _names(report) == [("epoch=0-step=20.ckpt", "missing-file"), ("epoch=0-step=10.ckpt", "whole")]
    assert report.steps[1].layout == "lightning"


def test_lightning_deepspeed_run_falls_back_when_the_newest_tag_is_cut_short(tmp_path, cli):
    """Lightning's DeepSpeed strategy: `epoch=0-step=S.ckpt/` holds `latest` naming its
    `checkpoint/` tag folder. A folder holding one run a few levels down is that run; one
    holding two is a usage error naming them."""
    from ckpttool.commands.latest import latest

    fixture = FRAMEWORKS / "lightning_deepspeed" / "zero3_tied" / "checkpoints"
    assert latest(fixture).chosen == fixture / "epoch=0-step=10.ckpt"
    assert latest(fixture.parent).chosen == fixture / "epoch=0-step=10.ckpt"
    for name in ("a", "b"):
        _copy_step(FRAMEWORKS / "lightning" / "checkpoints", tmp_path / "runs" / name / "checkpoints")
    several = cli("latest", tmp_path / "runs")
    assert several.exit_code == 2 and "holds 2 run folders, not one" in several.stderr
    run = _copy_step(fixture, tmp_path / "checkpoints")
    optimizer = sorted((run / "epoch=0-step=10.ckpt" / "checkpoint").glob("*optim_states.pt"))[0]
    os.truncate(optimizer, optimizer.stat().st_size // 2)
    report = latest(run)
    assert report.chosen == run / "epoch=0-step=5.ckpt" and not report.steps[0].whole
    assert report.steps[1].layout == "deepspeed"


def test_deepspeed_run_prefers_the_newest_whole_tag_over_the_latest_file(tmp_path, cli):
    """DeepSpeed's save dir: `latest` names global_step2; global_step10 (newer, whole) is taken,
    global_step11 (a truncated optimizer file) is skipped, and the pointer's lag is noted."""
    from ckpttool.commands.latest import latest

    fixture = FRAMEWORKS / "deepspeed" / "zero1_bf16" / "checkpoints"
    assert latest(fixture).chosen == fixture / "global_step2"
    run = _copy_step(fixture, tmp_path / "checkpoints")
    for step in (10, 11):
        _copy_step(run / "global_step2", run / f"global_step{step}")
    optimizer = sorted((run / "global_step11").glob("*optim_states.pt"))[0]
    os.truncate(optimizer, optimizer.stat().st_size - 10)
    report = latest(run)
    assert report.chosen == run / "global_step10" and report.steps[0].name == "global_step11"
    assert report.pointer == ("latest", "global_step2")
    result = cli("latest", run)
    assert result.stdout == f"{run / 'global_step10'}\n"
    assert "note: latest names global_step2, older than global_step10" in result.stderr


def test_hf_trainer_runs_name_the_checkpoint_folder_whatever_it_holds(tmp_path):
    """HF Trainer's `checkpoint-N/`: a plain save (model.safetensors, optimizer.pt), and a ZeRO
    save (global_stepN/ inside): the folder the Trainer's resume_from_checkpoint takes."""
    from ckpttool.commands.latest import latest

    plain = FRAMEWORKS / "hf_trainer_plain" / "plain" / "run"
    assert latest(plain).chosen == plain / "checkpoint-10"
    fixture = FRAMEWORKS / "hf_trainer_deepspeed" / "peft_zero2_exclude_frozen" / "run"
    assert latest(fixture).chosen == fixture / "checkpoint-10"
    run = _copy_step(fixture, tmp_path / "run")
    optimizer = sorted((run / "checkpoint-10" / "global_step10").glob("*optim_states.pt"))[-1]
    os.truncate(optimizer, optimizer.stat().st_size // 2)  # killed while rank 1 wrote its ZeRO partition
    report = latest(run)
    assert report.chosen == run / "checkpoint-5" and report.steps[0].name == "checkpoint-10"


if __name__ == "__main__":
    _train_and_save(sys.argv[1])
