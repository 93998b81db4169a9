"""Under torchrun, one process dying never hangs the others or commits anything.

Each case is a real job (`python -m torch.distributed.run --standalone --nproc-per-node 2 -m
ckpttool consolidate|reshard SRC OUT`, gloo on CPU) in which one chosen process dies at a named
step of the commit protocol, deterministically, through the test hooks of `ckpttool.core.testpoints`
(`CKPTTOOL_TEST_FAIL`: half-way through its share; `CKPTTOOL_TEST_DIE`: before joining, before
the first collective, before the commit), by SIGKILL, an exception or SIGTERM. The other
process must exit non-zero within BOUND seconds of the death, with one line naming the process
that died, leaving nothing at the destination (no output, no temporary, for S3 no unfinished
multipart upload) and the source as it was; and the next run, with no clean-up, must succeed.

Every job starts at once in one module fixture (each pays seconds to import torch); the reruns
run as one process (no torch): what a dead process left must not stop them.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FIXTURES
from ports import free_port

from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.reshard import reshard
from ckpttool.run.distributed import JOIN_TIMEOUT_ENV
from ckpttool.core.testpoints import DIE_ENV, FAIL_ENV, PART_SIZE_ENV, PAUSE_ENV

SOURCE = FIXTURES / "fsdp2_world2"  # written by torch's dcp.save from a real FSDP2 run (fixtures/generate.py)
BOUND = 30.0  # s from the death to the other process's exit: torchrun's own grace before SIGKILL is 30 s
JOIN_TIMEOUT = 5  # s, the join timeout of the job launched without torchrun's agent
TIMEOUT = 240  # s for all the jobs together on a loaded 2-core machine (a hang fails the test, it does not stall it)
BUCKET = "faults"

OUTPUTS = {"consolidate": "model.safetensors", "reshard": "world3"}
ARGS = {"consolidate": [], "reshard": ["--world", "3"]}


@dataclass(frozen=True)
class Case:
    command: str  # consolidate or reshard
    rank: int  # the process that dies; rank 0 is the lead: it creates the temporary output and commits
    env: dict  # the test hooks that make it die
    launcher: str = "torchrun"  # or "env": the environment torchrun gives, without the agent that stops the others
    s3: bool = False  # the destination is s3://


CASES = {
    "lead-killed-mid-copy": Case("consolidate", 0, {FAIL_ENV: "0:kill", PAUSE_ENV: "copy:0"}),
    "other-killed-mid-copy": Case("reshard", 1, {FAIL_ENV: "1:kill", PAUSE_ENV: "copy:0"}),
    "lead-killed-before-commit": Case("reshard", 0, {DIE_ENV: "0:commit:kill"}),
    "other-fails-before-commit": Case("consolidate", 1, {DIE_ENV: "1:commit:error"}),
    "other-terminated-before-first-collective": Case("consolidate", 1, {DIE_ENV: "1:start:term"}),
    "lead-killed-joining-without-agent": Case("consolidate", 0, {DIE_ENV: "0:join:kill",
                                                                 JOIN_TIMEOUT_ENV: str(JOIN_TIMEOUT)}, launcher="env"),
    "lead-killed-mid-upload-to-s3": Case("consolidate", 0, {FAIL_ENV: "0:kill", PAUSE_ENV: "copy:0",
                                                            PART_SIZE_ENV: "1000"}, s3=True),
}


@dataclass
class Job:
    out: str  # the destination: a local path or an s3:// URL
    processes: list[subprocess.Popen] = field(default_factory=list)  # the launcher, or each process without torchrun
    stderr: dict[int, str] = field(default_factory=dict)  # rank -> what it printed on stderr
    died: float | None = None  # when the dying process said so (monotonic)
    said: dict[int, float] = field(default_factory=dict)  # rank -> when it printed its error (just before exiting)
    ended: float | None = None  # when the last process exited (torchrun: when the launcher did)

    def timings(self) -> str:
        died = self.died or 0.0
        return ("after the death: " + ", ".join(f"rank {rank} said its error at {at - died:.1f} s"
                                                for rank, at in sorted(self.said.items()))
                + f", the job ended at {(self.ended or died) - died:.1f} s")


def command_line(command: str, out: str) -> list[str]:
    return [command, str(SOURCE), out, *ARGS[command], "--quiet"]


def start(case: Case, out: str, env: dict, logs: Path) -> list[subprocess.Popen]:
    """Start the job of `case`: one torchrun launcher (each process's stderr teed to the
    console with a `[default<rank>]:` prefix), or (launcher "env") each process as torchrun
    would start it."""
    args = command_line(case.command, out)
    if case.launcher == "torchrun":
        return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", "--tee", "2", "--log-dir", str(logs), "-m", "ckpttool", *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    return [subprocess.Popen([sys.executable, "-m", "ckpttool", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(2)]


def watch(job: Job) -> list[threading.Thread]:
    """Read every process's stderr as it comes, by rank, noting when the dying process announces its death."""

    def read(index: int, process: subprocess.Popen) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            rank, teed, text = index, re.match(r"\[default(\d+)\]:(.*\n?)", line), line
            if teed:  # torchrun --tee; its own lines are left out
                rank, text = int(teed[1]), teed[2]
            elif len(job.processes) == 1:
                continue
            if text.startswith("ckpttool-test: rank ") and job.died is None:
                job.died = time.monotonic()
            elif text.startswith(("error:", "interrupted by")):
                job.said.setdefault(rank, time.monotonic())
            job.stderr[rank] = job.stderr.get(rank, "") + text
        process.wait()
        job.ended = max(job.ended or 0.0, time.monotonic())

    threads = [threading.Thread(target=read, args=(index, process)) for index, process in enumerate(job.processes)]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 and the environment pointing at it; yields an s3fs filesystem."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import s3fs
    from storage_emulators import aws_environment, moto_s3

    with moto_s3() as endpoint, aws_environment(endpoint):
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield fs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, s3) -> dict[str, Job]:
    """Return name -> Job of every case, all run at once; the source's sha256s are checked
    before and after."""
    root = tmp_path_factory.mktemp("faults")
    before = sha256s(SOURCE)
    found: dict[str, Job] = {}
    processes: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    for name, case in CASES.items():
        out = f"s3://{BUCKET}/{name}/{OUTPUTS[case.command]}" if case.s3 else str(root / name / OUTPUTS[case.command])
        if not case.s3:
            (root / name).mkdir()
        job = found[name] = Job(out)
        job.processes = start(case, out, {**os.environ, "OMP_NUM_THREADS": "1", **case.env}, root / "logs" / name)
        processes += job.processes
        threads += watch(job)
    watchdog = threading.Timer(TIMEOUT, lambda: [p.kill() for p in processes])
    watchdog.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        watchdog.cancel()
    assert sha256s(SOURCE) == before, "the source was modified"
    return found


def sha256s(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def left_at(out: str, s3) -> list[str]:
    """Everything at or beside the destination: outputs, temporaries, unfinished multipart uploads."""
    if out.startswith("s3://"):
        prefix = out[len("s3://"):].rsplit("/", 1)[0]
        s3.invalidate_cache()
        keys = [key for key in s3.find(prefix, withdirs=True)]
        listing = s3.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix[len(BUCKET) + 1:])
        return keys + [f"unfinished upload {upload['Key']}" for upload in listing.get("Uploads", [])]
    return sorted(os.listdir(Path(out).parent))


@pytest.mark.parametrize("name", CASES)
def test_the_others_exit_within_the_bound_naming_the_dead_process_and_commit_nothing(jobs, s3, name):
    case, job = CASES[name], jobs[name]
    assert job.died is not None, f"rank {case.rank} never reached its step: {job.stderr}"
    # the surviving process prints its error just before it exits (os._exit); torchrun's own
    # teardown after that (a second or two, far more on a loaded machine) is not ckpttool's
    assert job.said.get(1 - case.rank, float("inf")) - job.died <= BOUND, job.timings()
    assert all(process.returncode != 0 for process in job.processes), [p.returncode for p in job.processes]
    survivor = "".join(line for line in job.stderr.get(1 - case.rank, "").splitlines(keepends=True)
                       if not line.startswith("ckpttool-test: "))  # the hooks' own lines
    assert len(survivor.splitlines()) == 1, f"one line from the surviving process:\n{survivor[-3000:]}"
    assert survivor.startswith("error: ") and f"process {case.rank} of 2" in survivor, survivor
    assert "nothing was committed" in survivor and "rerun" in survivor, survivor
    assert left_at(job.out, s3) == [], "nothing at the destination, no temporary, no unfinished upload"


def test_the_next_run_succeeds_without_any_clean_up(jobs, s3, tmp_path):
    """The same command at the same destination writes what a run that never failed writes."""
    rerun = {name: subprocess.Popen([sys.executable, "-m", "ckpttool", *command_line(case.command, jobs[name].out)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, case in CASES.items()}
    consolidate(SOURCE, tmp_path / OUTPUTS["consolidate"])  # what a run that never failed writes
    reshard(SOURCE, tmp_path / OUTPUTS["reshard"], world_size=3)
    for name, process in rerun.items():
        _, stderr = process.communicate(timeout=TIMEOUT)
        assert process.returncode == 0, f"{name}: {stderr[-3000:]}"
        assert written(jobs[name].out, s3) == written(str(tmp_path / OUTPUTS[CASES[name].command]), s3), name


def written(out: str, s3) -> dict[str, str]:
    """name -> sha256 of every file of an output (a resharded `.metadata` names its own path: left out)."""
    if out.startswith("s3://"):
        s3.invalidate_cache()
        key = out[len("s3://"):]
        files = {path.rsplit("/", 1)[-1]: s3.cat_file(path) for path in s3.find(key)}
    else:
        path = Path(out)
        files = {p.name: p.read_bytes() for p in ([path] if path.is_file() else sorted(path.iterdir()))}
    files.pop(".metadata", None)
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
