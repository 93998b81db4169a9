"""Launch (what `python -m train_minimal` runs): `python -m train_minimal --nproc N ...` starts N local ranks itself (free port,
gloo on CPU, nccl on CUDA); under `torchrun --nproc-per-node N -m train_minimal ...` each
process is one rank and reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the env.

The launcher parses and checks the command line before it imports torch, so a usage error
costs a fraction of a second. If one rank fails, the others are stopped. Spawned ranks
start from this module (multiprocessing cannot import a package's `__main__`).
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys

from train_minimal.config import TrainConfig, parse_args

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def main(argv: list[str] | None = None, start_method: str = "forkserver") -> int:
    """Return the exit status of the whole job (0 when every rank succeeded). `start_method`
    "fork" forks the ranks from this process: only for a caller that is itself a fresh
    process which imported torch and nothing else ran in (the tests' forkserver)."""
    config = parse_args(argv)
    if all(name in os.environ for name in TORCHRUN_VARIABLES):
        if config.nproc is not None:
            print("train_minimal: error: --nproc is for local launches; under torchrun use "
                  "--nproc-per-node and --nnodes", file=sys.stderr)
            return 2
        return _run_rank(config)
    nproc = config.nproc or 1
    try:
        port = master_port()
    except ValueError as error:
        print(f"train_minimal: error: {error}", file=sys.stderr)
        return 2
    if nproc == 1:
        os.environ.update(rank_environment(0, 1, port))
        return _run_rank(config)
    return spawn(config, nproc, port, start_method)


def spawn(config: TrainConfig, nproc: int, port: int, start_method: str = "forkserver") -> int:
    """Run `nproc` ranks as processes forked from one fresh server process that has imported
    torch and the training code once (multiprocessing's forkserver): each rank starts without
    importing torch again (~5 CPU s a rank on a small machine), and nothing of this launcher's
    state is inherited. Return the first nonzero exit status, or 0."""
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "train_minimal.train"])
    processes = [context.Process(target=_spawned_rank, args=(config, rank, nproc, port), name=f"rank{rank}")
                 for rank in range(nproc)]
    for process in processes:
        process.start()
    status = 0
    running = list(processes)
    while running:
        multiprocessing.connection.wait([process.sentinel for process in running])
        for process in [process for process in running if not process.is_alive()]:
            running.remove(process)
            process.join()
            if process.exitcode != 0 and status == 0:
                if process.exitcode < 0:
                    print(f"train_minimal: rank {processes.index(process)} was killed by signal "
                          f"{-process.exitcode}", file=sys.stderr)
                status = process.exitcode if process.exitcode and process.exitcode > 0 else 1
                for other in running:  # the others would wait for it in a collective forever
                    other.terminate()
    return status


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """Return the torchrun-style environment of one local rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def master_port() -> int:
    """Return the rendezvous port of a local launch: MASTER_PORT when it is set (as torch's
    launchers take it, so a caller that reserves ports can hand one down), else a free one.
    Raise ValueError when MASTER_PORT is not a port number."""
    given = os.environ.get("MASTER_PORT")
    if given is None:
        return free_port()
    if not given.isdigit() or not 0 < int(given) < 65536:
        raise ValueError(f"MASTER_PORT={given!r} is not a TCP port (1-65535); unset it to pick a free one")
    return int(given)


def free_port() -> int:
    """Return a TCP port that was free a moment ago on localhost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(config: TrainConfig, rank: int, world_size: int, port: int) -> None:
    faulthandler.enable()  # a crash in native code still leaves a Python stack on stderr
    os.environ.update(rank_environment(rank, world_size, port))
    exit_now(_run_rank(config))


def exit_now(status: int) -> None:
    """End this process with `status` once its output is flushed, skipping interpreter teardown.

    Every rank has finished its work by then (checkpoints published, async saves awaited,
    logs closed, process group destroyed). What is left is the interpreter's teardown, where
    torch's gloo worker threads are sometimes still joinable and abort the process with
    "terminate called without an active exception" (pytorch/pytorch#190489): a finished run
    would then exit with SIGABRT. Seen here once in CI on a world-1 resume.
    """
    atexit._run_exitfuncs()  # what atexit would run anyway (multiprocessing's cleanup among it)
    flushed_exit(status)


def flushed_exit(status: int) -> None:
    """End this process with `status` once stdout and stderr are flushed, running nothing else."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _run_rank(config: TrainConfig) -> int:
    from train_minimal.train import run_rank

    return run_rank(config)
