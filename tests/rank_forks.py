"""Processes forked from one server per test session that has imported torch, the parts of
torch.distributed the ranks use and the trainer once (multiprocessing's forkserver, `PRELOAD`): a fresh interpreter importing them costs ~6 CPU s on a small machine, which
every trainer run and every helper that saves or loads on gloo ranks used to pay.

    run_ranks(dcp_world._rank, 4, 4, path, port, ...)   # target(rank, *args) on 4 forked processes
    result = run_launcher(["--nproc", "2", ...], cwd=ROOT, env=environment)   # python -m train_minimal

`run_launcher` runs the trainer's own launcher (`train_minimal.launch.main`: argument checks,
rank processes, exit status), its ranks forked from that forked process instead of from a
forkserver of its own; the trainer, gloo and FSDP are the real ones. Tests of the command
itself (usage errors, exit codes, `--help` without torch) still run `python -m train_minimal`.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from train_minimal.launch import flushed_exit


# What the forkserver imports once, before it forks anything (each name on its own: one that fails
# to import is skipped). pytest: each forked child imports the test run's main module, pytest's.
PRELOAD = ["pytest", "torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.format_utils",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "torch.distributed.tensor",
           "train_minimal.train", "train_minimal.launch", "fsdp_loads", "dcp_world"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    return context


def _redirect(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _rank(target, rank: int, environment: dict, log: str, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    _redirect(log)
    try:
        if isinstance(target, str):  # "module:function", imported here only
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        target(rank, *args)
    except BaseException:
        traceback.print_exc()
        flushed_exit(1)
    flushed_exit(0)


def _wait(processes: list, timeout: float) -> list[int | None]:
    """Wait for every process; on the first failure stop the others (they would wait for it in a
    collective forever); at `timeout` kill them all. Return the exit codes."""
    deadline = time.monotonic() + timeout
    running = list(processes)
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for process in running:
                process.kill()
            break
        multiprocessing.connection.wait([process.sentinel for process in running], timeout=remaining)
        for process in [process for process in running if not process.is_alive()]:
            running.remove(process)
            if process.exitcode != 0:
                for other in running:
                    other.terminate()
    for process in processes:
        process.join()
    codes = [process.exitcode for process in processes]
    for process in processes:
        process.close()
    return codes


def run_ranks(target, world_size: int, *args, timeout: float = 600) -> None:
    """Run `target(rank, *args)` for rank 0..world_size-1 (`target` a function, or "module:function"
    to import in the ranks only), each in a process forked from the session's forkserver (with this process's environment); raise RuntimeError with the failed
    ranks' output if any exits nonzero or `timeout` passes."""
    context = _context()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(world_size)]
        environment = dict(os.environ)
        processes = [context.Process(target=_rank, args=(target, rank, environment, paths[rank], args),
                                     name=f"rank{rank}") for rank in range(world_size)]
        for process in processes:
            process.start()
        codes = _wait(processes, timeout)
        if any(code != 0 for code in codes):
            output = "".join(f"--- rank {rank} (exit {code}):\n{Path(paths[rank]).read_text()[-4000:]}"
                             for rank, code in enumerate(codes) if os.path.exists(paths[rank]))
            name = target if isinstance(target, str) else f"{target.__module__}:{target.__name__}"
            raise RuntimeError(f"{name} on {world_size} ranks: exit codes {codes}\n{output}")


def _launcher(argv: list[str], cwd: str, environment: dict, stdout: str, stderr: str) -> None:
    os.setpgrp()  # the launcher and its ranks: one group to kill at a timeout
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [str(Path(cwd) / "train_minimal" / "__main__.py"), *argv]  # as `python -m train_minimal` has it
    try:
        import train_minimal.launch
        from ports import free_port
        from train_minimal.launch import exit_now, main

        # its rendezvous port from this xdist worker's block, not from the ephemeral range
        # the other worker's connections draw from (ports.py)
        train_minimal.launch.free_port = free_port
        status = main(argv, start_method="fork")
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    exit_now(status)


def run_launcher(argv: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the trainer's launcher with `argv` in a process forked from the session's forkserver;
    return its exit status and output as `subprocess.run(..., capture_output=True, text=True)`
    would (raise subprocess.TimeoutExpired after killing it and its ranks at `timeout`)."""
    context = _context()
    with tempfile.TemporaryDirectory(prefix="launcher-") as directory:
        stdout, stderr = os.path.join(directory, "stdout"), os.path.join(directory, "stderr")
        process = context.Process(target=_launcher, args=(list(argv), str(cwd), dict(env), stdout, stderr),
                                  name="train_minimal")
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.join()
            raise subprocess.TimeoutExpired(["train_minimal", *argv], timeout)
        code = process.exitcode
        process.close()
        output = [Path(path).read_text() if os.path.exists(path) else "" for path in (stdout, stderr)]
        return subprocess.CompletedProcess(["train_minimal", *argv], code, *output)
