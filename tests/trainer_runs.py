"""Run the real trainer (`python -m train_minimal`) from tests and read what it wrote.

Tests import this module directly (`tests/` is on sys.path through conftest.py):

    from trainer_runs import latest_step, read_log, run_trainer

    ckpt = run_trainer(tmp_path)                               # FSDP2, world 2, tiny, 2 steps
    ckpt = run_trainer(tmp_path, nproc=3)                      # FSDP2 world 3 (uneven splits)
    ckpt = run_trainer(tmp_path, "--fsdp", "1")                # FSDP1 SHARDED_STATE_DICT
    ckpt = run_trainer(tmp_path, "--replicate", "2", nproc=4)  # HSDP: 2 replicas x 2 shards
    ckpt = run_trainer(tmp_path, "--param-dtype", "bfloat16")  # bf16 tensors in the checkpoint
    ckpt = run_trainer(tmp_path, "--mixed-precision", "bf16")  # bf16 compute, fp32 checkpoint
    ckpt = run_trainer(tmp_path, "--export", str(tmp_path / "full.safetensors"))  # + full weights
    checkpoint = latest_step(ckpt)                             # tmp_path/ckpt/step-00000002
    records = read_log(tmp_path)                               # [{"step": 1, "loss": ...}, ...]

Each call runs `python -m train_minimal --size tiny --steps 2 --nproc N --quiet --ckpt-dir
DIR/ckpt --log-file DIR/log.jsonl ARGS...` (the launcher forked from the session's forkserver,
`rank_forks.py`, so torch is imported once per session rather than once per run; with
`subprocess_run=True` as a real subprocess) and returns `DIR/ckpt`; ARGS come last, so they override those
defaults (`"--steps", "20"`, `"--size", "small"`). The step directory is
`DIR/ckpt/step-0000000S` (S = steps; the last step is always saved) and `DIR/ckpt/latest`
names it. A failed run raises TrainerRunError with the trainer's stderr.

`--export` writes exactly the full model state dict (keys without the `model.` prefix, as
torch's `get_model_state_dict(full_state_dict=True)` returns them): a reference for what a
consolidation of the checkpoint's `model.*` entries must produce, byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_DIRECTORY = "ckpt"
LOG_FILE = "log.jsonl"


class TrainerRunError(RuntimeError):
    """The trainer exited with a nonzero status; the message holds its command and stderr."""


def trainer_command(directory: Path, *args: str, nproc: int = 2, steps: int = 2, size: str = "tiny") -> list[str]:
    """Return the command line `run_trainer` runs (for a test that launches it itself)."""
    directory = Path(directory)
    return [sys.executable, "-m", "train_minimal", "--size", size, "--steps", str(steps), "--nproc", str(nproc),
            "--quiet", "--ckpt-dir", str(directory / CHECKPOINT_DIRECTORY), "--log-file", str(directory / LOG_FILE),
            *[str(arg) for arg in args]]


def run_trainer(directory: Path, *args: str, nproc: int = 2, steps: int = 2, size: str = "tiny",
                timeout: float = 600, subprocess_run: bool = False) -> Path:
    """Run the trainer into `directory` and return its checkpoint directory
    (`directory/ckpt`, or the `--ckpt-dir` given in `args`). The launcher runs forked from the
    session's forkserver, which imported torch and the trainer once (`rank_forks.run_launcher`);
    `subprocess_run=True` runs `python -m train_minimal` itself.

    Example:
        >>> ckpt = run_trainer(tmp_path, "--fsdp", "1", nproc=2, steps=4)
        >>> sorted(p.name for p in ckpt.iterdir())
        ['latest', 'step-00000004']
    """
    command = trainer_command(directory, *args, nproc=nproc, steps=steps, size=size)
    environment = _environment()
    if subprocess_run:
        result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    else:
        from rank_forks import run_launcher

        result = run_launcher(command[3:], cwd=ROOT, env=environment, timeout=timeout)
    if result.returncode != 0:
        raise TrainerRunError(f"exit status {result.returncode}: {' '.join(command)}\n{result.stderr[-6000:]}")
    given = [args[index + 1] for index, arg in enumerate(args[:-1]) if arg == "--ckpt-dir"]
    return Path(given[-1]) if given else Path(directory) / CHECKPOINT_DIRECTORY


def run_trainer_expecting_failure(directory: Path, *args: str, nproc: int = 2, steps: int = 2,
                                  size: str = "tiny") -> subprocess.CompletedProcess:
    """Run the trainer and return the finished process (exit status, stdout, stderr)
    without raising; for tests of error messages."""
    command = trainer_command(directory, *args, nproc=nproc, steps=steps, size=size)
    environment = _environment()
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)


def _environment() -> dict[str, str]:
    """The trainer's environment: this checkout first on the path, and a rendezvous port from
    this xdist worker's block (ports.py) for a `python -m train_minimal` launch, which takes
    MASTER_PORT when set rather than probing the range the other worker's connections use."""
    from ports import free_port

    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    environment.setdefault("MASTER_PORT", str(free_port()))
    return environment


def latest_step(ckpt_dir: Path) -> Path:
    """Return the step directory `ckpt_dir/latest` names (e.g. `ckpt_dir/step-00000002`)."""
    return Path(ckpt_dir) / (Path(ckpt_dir) / "latest").read_text().strip()


def read_log(path: Path) -> list[dict]:
    """Return the trainer's JSON-lines log as a list of records, one per step, in file order.
    `path` is the log file or the directory given to `run_trainer`. Each record has `step`,
    `loss` (the full-precision float32 value), `lr`, `tokens_per_s`, `world_size` and
    per-rank lists `param_bytes`, `optimizer_bytes`, `peak_rss_bytes`."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> dict[int, float]:
    """Return {step: loss} from a trainer log (a resumed run appends to the same file)."""
    return {record["step"]: record["loss"] for record in read_log(path)}
