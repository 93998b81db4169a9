"""Under torchrun, consolidate and reshard split the plan's bytes across processes and write
exactly what one process writes; a failure on any rank commits nothing.

`split` is pure and tested without processes. The torchrun runs are real (`python -m
torch.distributed.run`, gloo on CPU). Each worker spends seconds importing torch, so there is
one job per process count (1, 2 as two "hosts", 3, 4) in which every process runs every case
in turn (`tests/torchrun_cases.py`: consolidate to .safetensors, a Hub directory and a bf16
.pt, reshard to world 3, an FP8 Hub folder dequantised to bf16; of a fixture and of a
checkpoint our trainer writes), and all the jobs, the trainer and the failing runs start at
once in one session fixture (`runs`). Each output is compared by sha256 with what one process
(no torchrun) writes at the same path.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchrun_cases
from conftest import FIXTURES
from ports import free_port

from ckpttool.options import ConvertOptions
from ckpttool.core import dtypes
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.import_framework import import_to_framework
from ckpttool.commands.reshard import reshard
from ckpttool.run.distributed import environment, split
from ckpttool.plan.operations import Convert, Copy, Gather
from ckpttool.core.testpoints import FAIL_ENV, PAUSE_ENV

SOURCE = FIXTURES / "fsdp2_world2_adamw"
FP8 = FIXTURES / "quantized" / "deepseek_v3_fp8"
TITAN_HUB = FIXTURES / "frameworks" / "torchtitan_families" / "qwen3_moe" / "hf"
MEGATRON_HUB = FIXTURES / "frameworks" / "megatron_families" / "moe" / "hf"


# ---------------------------------------------------------------------------------------------
# split: pure


def covered(share) -> list[tuple[str, int, int]]:
    """Return the (file, start, end) output ranges a list of Copy/Convert operations writes."""
    return [(op.dst, op.dst_offset, op.dst_offset + op.output_length) for op in share]


def test_split_cuts_one_huge_copy_into_equal_disjoint_ranges():
    huge = Copy("__0_0.distcp", 4096, "model.safetensors", 96, 10**9 + 7)
    shares = split([huge], 4)
    sizes = [sum(op.length for op in share) for share in shares]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == huge.length
    ranges = sorted(r for share in shares for r in covered(share))
    assert ranges[0][1] == 96 and ranges[-1][2] == 96 + huge.length
    assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))  # disjoint, no gap
    for share in shares:
        for op in share:  # each piece reads the source bytes that belong at its output offset
            assert op.src_offset - 4096 == op.dst_offset - 96 and op.crc32 is None


def test_split_balances_many_operations_within_one_unsplittable_operation():
    operations = [Copy("a", 10 * i, "out", 5000 * i, 700 + 37 * i) for i in range(50)]
    gather = Gather(tensor=None, chunk=0, source=None, dtype="float32", dst="out", pieces=((0, 10**6, 5000),))
    operations.insert(20, gather)
    total = sum(op.output_length for op in operations)
    for world_size in (2, 3, 4, 7):
        shares = split(operations, world_size)
        sizes = [sum(op.output_length for op in share) for share in shares]
        assert sum(sizes) == total
        assert max(sizes) - min(sizes) <= gather.output_length + 1
        assert sum(op is gather for share in shares for op in share) == 1
        pieces = [r for share in shares for op in share if isinstance(op, Copy) for r in covered([op])]
        assert sum(end - start for _, start, end in pieces) == total - gather.output_length  # no overlap
        assert _merged(pieces) == _merged(covered(op for op in operations if isinstance(op, Copy)))


def _merged(ranges):
    """Return the ranges with touching neighbours joined."""
    out = []
    for file, start, end in sorted(ranges):
        if out and out[-1][0] == file and out[-1][2] == start:
            out[-1] = (file, out[-1][1], end)
        else:
            out.append((file, start, end))
    return out


def test_split_cuts_a_cast_between_elements_and_follows_the_source():
    cast = Convert("a", 1000, 4 * 1001, "float32", "bfloat16", "out", 64)  # 1001 elements
    shares = split([cast], 3)
    pieces = [op for share in shares for op in share]
    assert sum(op.output_length for op in pieces) == cast.output_length
    at_source, at_output = 1000, 64
    for op in pieces:
        assert op.length % dtypes.ITEMSIZE["float32"] == 0
        assert (op.src_offset, op.dst_offset) == (at_source, at_output)
        at_source += op.length
        at_output += op.output_length
    sizes = [sum(op.output_length for op in share) for share in shares]
    assert max(sizes) - min(sizes) <= 2


def test_split_for_one_process_is_the_plan_itself():
    operations = [Copy("a", 0, "out", 0, 10), Copy("a", 10, "out", 10, 0)]
    assert split(operations, 1) == [operations]


def test_environment_needs_a_world_of_two_or_more(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert environment() is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert environment() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert environment() == (3, 4, 1)


# ---------------------------------------------------------------------------------------------
# torchrun: one job per process count, every case in each


COUNTS = (1, 2, 3, 4)  # processes per job; the job of 2 is two "hosts" of one process each
KINDS = {  # kind: (OUT name, ckpttool args, one-process call); bf16 splits Converts between ranks
    "safetensors": ("model.safetensors", ["consolidate", "{src}", "{out}", "--json"],
                    lambda src, out: consolidate(src, out)),
    "hub": ("hub", ["consolidate", "{src}", "{out}", "--max-shard-size", "1KB", "--json", "--verify"],
            lambda src, out: consolidate(src, out, convert=ConvertOptions(max_shard_size="1KB"))),
    "pt": ("everything.pt", ["consolidate", "{src}", "{out}", "--all", "--dtype", "bf16"],
           lambda src, out: consolidate(src, out, convert=ConvertOptions(everything=True, dtype="bf16"))),
    "reshard": ("world3", ["reshard", "{src}", "{out}", "--world", "3", "--json", "--verify"],
                lambda src, out: reshard(src, out, world_size=3)),
    # a quantised Hub folder (whatever the source), dequantised: its rows shared out by rank
    "fp8": ("fp8-bf16", ["consolidate", str(FP8), "{out}", "--dtype", "bf16", "--max-shard-size", "100KB", "--json",
                         "--verify"],
            lambda src, out: consolidate(FP8, out, convert=ConvertOptions(dtype="bf16", max_shard_size="100KB"))),
    # a Hub model (whatever the source) written as torchtitan's and Megatron's own checkpoints (issue 46)
    "titan": ("titan", ["import", str(TITAN_HUB), "{out}", "--to", "torchtitan", "--world", "3", "--json"],
              lambda src, out: import_to_framework(TITAN_HUB, out, "torchtitan", 3)),
    "megatron": ("megatron", ["import", str(MEGATRON_HUB), "{out}", "--to", "megatron", "--json"],
                 lambda src, out: import_to_framework(MEGATRON_HUB, out, "megatron")),
}
SOURCES = ("fixture", "trainer")  # SOURCE; a checkpoint `python -m train_minimal` writes (world 2)
CASES = [f"{source}-{kind}" for source in SOURCES for kind in KINDS]
TRAINER_STEPS = 1
ERROR_COUNT = 4  # the job whose last case fails on rank 1
KILL_COUNT = 3  # processes of the run whose rank 1 is killed
TIMEOUT = 300  # seconds for the trainer and every job together (torch imports on a loaded 2-core machine)


@dataclass
class Run:
    out: Path  # what the run writes
    reference: Path | None  # what one process wrote for the same command at the same path
    codes: list[int]  # exit code of each rank (-1: the rank reported none)
    stdout: str  # rank 0's stdout for this case
    stderr: str  # the whole job's stderr
    printed: int = 1  # how many times the case's mark was printed (once: by rank 0 alone)
    launchers: tuple[int, ...] = ()  # exit codes of the torchrun launchers


def torchrun(count: int) -> list[list[str]]:
    """Return the launcher command lines (one per host) of a torchrun job of `count` processes."""
    if count != 2:
        return [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(count)]]
    port = str(free_port())
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port] for node in (0, 1)]


def one_process_reference(kind: str, source: Path, out: Path) -> Path:
    """Write what one process (no torchrun) writes at `out` and move it aside to
    `reference-<name>` (a resharded `.metadata` names its own path)."""
    KINDS[kind][2](source, out)
    reference = out.with_name("reference-" + out.name)
    out.rename(reference)
    return reference


def parts(stdout: str) -> dict[str, list[str]]:
    """Cut a job's stdout at the case marks: name -> every part printed under that name."""
    found: dict[str, list[str]] = {}
    name = None
    for line in stdout.splitlines(keepends=True):
        if line.startswith(torchrun_cases.MARK):
            name = line[len(torchrun_cases.MARK):].strip()
            found.setdefault(name, []).append("")
        elif name is not None:
            found[name][-1] += line
    return found


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Return "<count>-<case>" -> Run of every torchrun case, plus "error" (the last case of
    the job of 4: rank 1 fails with an EIO half-way through its share) and "kill" (3 processes
    started as torchrun starts them: rank 1 is killed half-way through its share).

    The trainer, the jobs and the killed run start at once; the jobs' trainer cases wait for
    the trainer's checkpoint and their one-process references (the `after` file)."""
    from trainer_runs import ROOT, latest_step, trainer_command

    root = tmp_path_factory.mktemp("distributed")
    processes: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, command: list, **extra) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra.pop("env", {})}
        process = subprocess.Popen([str(a) for a in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env, **extra)
        processes.append((name, process))

    trainer = root / "trainer"
    checkpoint = trainer / "ckpt" / f"step-{TRAINER_STEPS:08d}"
    start("trainer", trainer_command(trainer, nproc=2, steps=TRAINER_STEPS), cwd=ROOT,
          env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    sources = {"fixture": SOURCE, "trainer": checkpoint}
    ready = root / "trainer-ready"

    results: dict[str, Run] = {}
    for count in COUNTS:
        job = root / f"n{count}"
        cases = []
        for source in SOURCES:
            for kind, (output, args, _) in KINDS.items():
                out = job / f"{source}-{kind}" / output
                out.parent.mkdir(parents=True)
                reference = one_process_reference(kind, SOURCE, out) if source == "fixture" else None
                results[f"{count}-{source}-{kind}"] = Run(out, reference, [], "", "")
                cases.append({"name": f"{source}-{kind}", "after": str(ready) if source == "trainer" else None,
                              "args": [a.format(src=sources[source], out=out) for a in args] + ["--quiet"]})
        if count == ERROR_COUNT:  # last: a command that fails on every rank ends this job's cases
            out = job / "error" / "everything.pt"
            out.parent.mkdir()
            results["error"] = Run(out, None, [], "", "")
            cases.append({"name": "error", "args": ["consolidate", str(SOURCE), str(out), "--all", "--quiet"],
                          "env": {"*": {FAIL_ENV: "1:error"}, "1": {PAUSE_ENV: "copy:0"}}})
        (job / "results").mkdir()
        (job / "cases.json").write_text(json.dumps({"results": str(job / "results"), "cases": cases}))
        for launcher in torchrun(count):
            start(f"n{count}", launcher + [Path(__file__).with_name("torchrun_cases.py"), job / "cases.json"])

    # the environment torchrun gives its processes, without the agent that would stop the
    # others once rank 1 dies: they must notice by themselves
    kill = root / "kill" / "world3"
    kill.parent.mkdir()
    results["kill"] = Run(kill, None, [], "", "")
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(KILL_COUNT),
                  FAIL_ENV: "1:kill"}
    for rank in range(KILL_COUNT):
        pause = {PAUSE_ENV: "copy:0"} if rank == 1 else {}
        start("kill", [sys.executable, "-m", "ckpttool", "reshard", SOURCE, kill, "--world", "3", "--quiet"],
              env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank), **pause})

    watchdog = threading.Timer(TIMEOUT, lambda: [p.kill() for _, p in processes])
    watchdog.start()
    outputs: dict[str, list[tuple[int, str, str]]] = {}
    try:
        _, process = processes[0]
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the trainer failed ({process.returncode}):\n{stderr[-4000:]}")
        assert latest_step(trainer / "ckpt") == checkpoint
        for count in COUNTS:
            for kind in KINDS:
                run = results[f"{count}-trainer-{kind}"]
                run.reference = one_process_reference(kind, checkpoint, run.out)
        ready.touch()
        for name, process in processes[1:]:
            stdout, stderr = process.communicate()
            outputs.setdefault(name, []).append((process.returncode, stdout, stderr))
    finally:
        watchdog.cancel()
        for _, process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    run = results["kill"]
    for rank, (code, stdout, stderr) in enumerate(outputs["kill"]):
        run.codes.append(code)
        run.stdout += stdout
        run.stderr += f"--- rank {rank}\n{stderr}"
    for count in COUNTS:
        launchers = outputs[f"n{count}"]
        stdout = "".join(out for _, out, _ in launchers)
        stderr = "".join(err for _, _, err in launchers)
        codes = {}
        for rank in range(count):
            written = root / f"n{count}" / "results" / f"rank{rank}.json"
            codes[rank] = json.loads(written.read_text()) if written.exists() else {}
        printed = parts(stdout)
        for case in CASES + (["error"] if count == ERROR_COUNT else []):
            run = results[case if case == "error" else f"{count}-{case}"]
            run.codes = [codes[rank].get(case, -1) for rank in range(count)]
            run.stdout, run.stderr = "".join(printed.get(case, [])), stderr
            run.printed, run.launchers = len(printed.get(case, [])), tuple(code for code, _, _ in launchers)
    return results


def sha256s(path: Path) -> dict[str, str]:
    """Return file name (relative to `path`) -> sha256 of every file at `path` (a file or a directory)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path)) if path.is_dir() else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if not p.name.startswith("reference-"))


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("case", CASES)
def test_torchrun_output_is_byte_identical_to_one_process(runs, count, case):
    run = runs[f"{count}-{case}"]
    assert run.codes == [0] * count and run.launchers == (0,) * len(run.launchers), run.stderr
    reference = sha256s(run.reference)
    assert len(reference) >= (2 if run.out.suffix == "" else 1)
    assert sha256s(run.out) == {name.removeprefix("reference-"): digest for name, digest in reference.items()}
    assert left_beside(run.out) == [run.out.name]  # no temporary left


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("case", [case for case in CASES if "--json" in KINDS[case.split("-")[1]][1]])
def test_rank_0_alone_prints_one_document_listing_every_process(runs, count, case):
    run = runs[f"{count}-{case}"]
    assert run.printed == 1, f"only rank 0 prints; the job printed:\n{run.stdout}\n{run.stderr}"
    document = json.loads(run.stdout)  # one document: a second rank printing would break this
    processes = document["processes"]
    assert [p["rank"] for p in processes] == list(range(count))
    assert all(p["bytes"] > 0 for p in processes)
    assert all(type(p["seconds"]) is float for p in processes)  # reported, not judged: tests assert no timings
    if case.endswith(("reshard", "titan", "megatron")):  # an import's rank files hold no more than reshard's
        assert sum(p["bytes"] for p in processes) >= document["tensor_bytes"]
    else:
        assert sum(p["bytes"] for p in processes) == document["tensor_bytes"]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("source", SOURCES)
def test_rank_0_alone_prints_the_summary_naming_every_process(runs, count, source):
    run = runs[f"{count}-{source}-pt"]
    assert run.printed == 1, f"only rank 0 prints; the job printed:\n{run.stdout}\n{run.stderr}"
    assert run.stdout.count("wrote ") == 1
    assert ("processes:" in run.stdout) == (count > 1)
    if count > 1:
        assert f"{count} processes: rank 0" in run.stdout and f"rank {count - 1} " in run.stdout


def test_a_failing_rank_fails_every_rank_and_commits_nothing(runs):
    run = runs["error"]
    assert run.codes == [1] * ERROR_COUNT, run.stderr
    assert left_beside(run.out) == [], "nothing at OUT and no temporary beside it"
    assert run.stdout == "" and run.printed == 1
    # rank 1 failed after its first IO task was done (the `copy` pause point, set on rank 1 alone)
    assert run.stderr.index("ckpttool-test: paused at copy") < run.stderr.index("ckpttool-test: rank 1 fails (error)")
    assert "test failure on rank 1" in run.stderr  # rank 1 says why; the others name rank 1
    assert run.stderr.count(f"process 1 of {ERROR_COUNT} failed") == ERROR_COUNT - 1, run.stderr


def test_a_rank_killed_mid_copy_fails_every_rank_and_commits_nothing(runs):
    run = runs["kill"]
    assert run.codes == [1, -9] + [1] * (KILL_COUNT - 2), run.stderr
    assert left_beside(run.out) == [], "nothing at OUT and no temporary beside it"
    assert run.stdout == ""
    rank_1 = run.stderr.split("--- rank 1\n")[1].split("--- rank 2\n")[0]
    # killed after its first IO task was done (the `copy` pause point), before its share's end
    assert rank_1.index("ckpttool-test: paused at copy") < rank_1.index("ckpttool-test: rank 1 fails (kill)")
    # every other rank sees rank 1's connection close, reports it and exits 1
    assert run.stderr.count("lost contact with the other torchrun processes") == KILL_COUNT - 1, run.stderr
