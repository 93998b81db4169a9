"""Under torchrun, consolidate and reshard split the plan's bytes across processes and write
exactly what one process writes; a failure on any rank commits nothing.

`split` is pure and tested without processes. The torchrun runs are real (`python -m
torch.distributed.run`, gloo on CPU); each worker spends seconds importing torch, so every run
starts at once in one session fixture (`runs`) and each test checks its own run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIXTURES

from ckpttool import dtypes
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.reshard import reshard
from ckpttool.distributed import FAIL_ENV, environment, split
from ckpttool.plan.operations import Convert, Copy, Gather

SOURCE = FIXTURES / "fsdp2_world2_adamw"
TIMEOUT = 150  # seconds for all runs together (torch imports on a loaded 2-core machine)


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
# torchrun: all runs at once


@dataclass
class Run:
    out: Path  # what the run writes
    reference: Path | None  # what one process wrote for the same command
    codes: list[int]
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "ckpttool"]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Return name -> Run of every multi-process case, all started at once, each OUT in its own
    directory beside a `reference` one process wrote (then moved aside, so paths inside match)."""
    root = tmp_path_factory.mktemp("distributed")
    port = free_port()
    two_hosts = [f"--nnodes 2 --node-rank {node} --nproc-per-node 1 --master-addr 127.0.0.1 --master-port {port}"
                 for node in (0, 1)]
    cases = {  # name: (OUT name, launchers, ckpttool args, one-process call, env)
        "safetensors": ("model.safetensors", ["--standalone --nproc-per-node 2"], ["consolidate", SOURCE, "{out}", "--json"],
                        lambda out: consolidate(SOURCE, out)),
        "hub": ("hub", ["--standalone --nproc-per-node 3"],
                ["consolidate", SOURCE, "{out}", "--max-shard-size", "1KB", "--json", "--verify"],
                lambda out: consolidate(SOURCE, out, max_shard_size="1KB")),
        "reshard": ("world3", ["--standalone --nproc-per-node 2"],
                    ["reshard", SOURCE, "{out}", "--world", "3", "--json", "--verify"],
                    lambda out: reshard(SOURCE, out, world_size=3)),
        # two "hosts" of one process each meeting at 127.0.0.1; the bf16 cast splits Converts
        "nodes": ("everything.pt", two_hosts, ["consolidate", SOURCE, "{out}", "--all", "--dtype", "bf16"],
                  lambda out: consolidate(SOURCE, out, everything=True, dtype="bf16")),
        "error": ("everything.pt", [None], ["consolidate", SOURCE, "{out}", "--all"], None),
        "kill": ("world3", [None], ["reshard", SOURCE, "{out}", "--world", "3"], None),
    }
    results: dict[str, Run] = {}
    commands = []
    for name, (output, launchers, args, one_process) in cases.items():
        out = root / name / output
        out.parent.mkdir()
        reference = None
        if one_process is not None:
            one_process(out)
            reference = out.with_name("reference-" + out.name)
            out.rename(reference)
        results[name] = Run(out, reference, [], "", "")
        args = [str(a).format(out=out) for a in args] + ["--quiet"]
        for launcher in launchers:
            if launcher is not None:
                commands.append((name, torchrun(*launcher.split()) + args, {}))
                continue
            rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                          FAIL_ENV: f"1:{name}"}
            for rank in range(2):
                commands.append((name, [sys.executable, "-m", "ckpttool", *args],
                                 {**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    processes = []
    for name, command, env in commands:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        processes.append((name, process))
    watchdog = threading.Timer(TIMEOUT, lambda: [p.kill() for _, p in processes])
    watchdog.start()
    try:
        for name, process in processes:
            stdout, stderr = process.communicate()
            results[name].codes.append(process.returncode)
            results[name].stdout += stdout
            results[name].stderr += stderr
    finally:
        watchdog.cancel()
    return results


def same_bytes(a: Path, b: Path) -> bool:
    if a.is_dir():
        names = sorted(p.name for p in a.iterdir())
        return names == sorted(p.name for p in b.iterdir()) and all(same_bytes(a / n, b / n) for n in names)
    return a.read_bytes() == b.read_bytes()


def left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if not p.name.startswith("reference-"))


@pytest.mark.parametrize("name", ["safetensors", "hub", "reshard", "nodes"])
def test_torchrun_output_is_byte_identical_to_one_process(runs, name):
    run = runs[name]
    assert run.codes == [0] * len(run.codes), run.stderr
    assert same_bytes(run.out, run.reference)
    assert left_beside(run.out) == [run.out.name]  # no temporary left


@pytest.mark.parametrize("name", ["safetensors", "hub", "reshard"])
def test_rank_0_alone_prints_one_document_listing_every_process(runs, name):
    run = runs[name]
    document = json.loads(run.stdout)  # one document: a second rank printing would break this
    processes = document["processes"]
    world = 3 if name == "hub" else 2
    assert [p["rank"] for p in processes] == list(range(world))
    assert all(p["bytes"] > 0 and p["seconds"] >= 0 for p in processes)
    if name == "reshard":
        assert sum(p["bytes"] for p in processes) >= document["tensor_bytes"]
    else:
        assert sum(p["bytes"] for p in processes) == document["tensor_bytes"]


def test_two_hosts_print_once_from_rank_0(runs):
    run = runs["nodes"]
    assert run.stdout.count("wrote ") == 1 and "2 processes: rank 0" in run.stdout


@pytest.mark.parametrize("name", ["error", "kill"])
def test_a_failing_rank_fails_every_rank_and_commits_nothing(runs, name):
    run = runs[name]
    assert all(code != 0 for code in run.codes), run.codes
    assert left_beside(run.out) == [], "nothing at OUT and no temporary beside it"
    assert run.stdout == ""
    assert "ckpttool-test: rank 1 fails" in run.stderr
    if name == "error":  # rank 1 says why; rank 0 names rank 1
        assert run.codes == [1, 1]
        assert "test failure on rank 1" in run.stderr and "process 1 of 2 failed" in run.stderr
    else:  # rank 0 sees rank 1's connection close
        assert run.codes == [1, -9] and "lost contact with the other torchrun processes" in run.stderr
