"""Interrupted runs leave nothing behind, whatever the signal.

A real `ckpttool` subprocess is paused at a known point of its run (the test-only
`CKPTTOOL_TEST_PAUSE=<phase>:<seconds>` hook in `ckpttool.core.testpoints`, which prints
`ckpttool-test: paused at <phase>` on stderr), then sent SIGINT, SIGTERM, SIGHUP or SIGKILL.
Each run is bounded by `TIMEOUT`: a watchdog kills a run that never pauses or never ends.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FIXTURES

from ckpttool.options import ConvertOptions
from ckpttool import outputs
from ckpttool.core import testpoints
from ckpttool.store import io
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.reshard import reshard
from ckpttool.outputs import local, signals, temps

SOURCE = FIXTURES / "fsdp2_world3_uneven"
PREVIOUS_SOURCE = FIXTURES / "fsdp2_world2"  # what an earlier run wrote at OUT
TIMEOUT = 30  # seconds a paused run may wait for its signal, and a test run may take
SIGINT, SIGTERM, SIGHUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
MARKER = "ckpttool-test: paused at "


# ---------------------------------------------------------------------------------------------
# Running the command line, paused


def default_signals() -> None:
    """Start the run as a shell starts a foreground command: a test run in the background
    (`pytest &`) or under `nohup` would pass on SIGINT or SIGHUP ignored."""
    for signum in (SIGINT, SIGTERM, SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def run_until(phase: str, *args) -> subprocess.Popen:
    """Start `python -m ckpttool ARGS --quiet`; return it once it is paused at `phase`."""
    env = {**os.environ, testpoints.PAUSE_ENV: f"{phase}:{TIMEOUT}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", *map(str, args), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_signals,
    )
    process.watchdog = threading.Timer(TIMEOUT, process.kill)
    process.watchdog.start()
    process.early_stderr = []
    while True:
        line = process.stderr.readline()
        if not line:
            process.watchdog.cancel()
            pytest.fail(f"exited {process.wait()} before pausing at {phase}: {''.join(process.early_stderr)}")
        if line.strip() == MARKER + phase:
            return process
        process.early_stderr.append(line)


def stop(process: subprocess.Popen, signum: int) -> tuple[int, list[str]]:
    """Send `signum`; return the exit code and stderr lines (without pause markers)."""
    os.kill(process.pid, signum)
    _, stderr = process.communicate(timeout=TIMEOUT)
    process.watchdog.cancel()
    lines = process.early_stderr + stderr.splitlines(keepends=True)
    return process.returncode, [line.rstrip("\n") for line in lines if not line.startswith(MARKER)]


def run(*args) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args), "--quiet"],
                            capture_output=True, text=True, timeout=TIMEOUT)
    return result.returncode, result.stderr.splitlines()


def one_line_for(signum: int) -> list[str]:
    return [f"interrupted by {signal.Signals(signum).name}; nothing was left half-written"]


def entries(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file's bytes, by path relative to `path` (a file: one entry)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def write_previous(out: Path) -> dict[str, bytes]:
    """Put an earlier run's output at `out`; return its bytes."""
    if out.suffix:
        consolidate(PREVIOUS_SOURCE, out)
    else:
        shutil.copytree(PREVIOUS_SOURCE, out)
    return snapshot(out)


def supports_unnamed_files(directory: Path) -> bool:
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600))
    except (AttributeError, OSError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# SIGINT, SIGTERM, SIGHUP: exit 128 + signal, one line, nothing left, the previous OUT intact


CONSOLIDATE_ARGS = ("--threads", "1", "--max-memory", "1kB")  # one operation at a time


@pytest.mark.parametrize("output, phase, signum, previous", [
    ("model.safetensors", "start", SIGINT, False),
    ("model.safetensors", "copy", SIGTERM, False),
    ("model.safetensors", "commit", SIGHUP, True),
    ("model.pt", "start", SIGTERM, True),
    ("model.pt", "copy", SIGHUP, True),
    ("model.pt", "commit", SIGINT, False),
    ("shards", "start", SIGHUP, True),
    ("shards", "copy", SIGINT, True),
    ("shards", "commit", SIGTERM, False),
])
def test_a_signal_during_consolidate_leaves_nothing_and_the_previous_output_as_it_was(
    tmp_path, output, phase, signum, previous
):
    out = tmp_path / output
    before = write_previous(out) if previous else None
    args = ["consolidate", SOURCE, out, *CONSOLIDATE_ARGS, "--force"]
    if not out.suffix:
        args += ["--max-shard-size", "1kB"]
    returncode, stderr = stop(run_until(phase, *args), signum)
    assert returncode == 128 + signum
    assert stderr == one_line_for(signum)
    assert entries(tmp_path) == ([output] if previous else [])
    if previous:
        assert snapshot(out) == before


@pytest.mark.parametrize("phase, signum, previous", [
    ("start", SIGTERM, False),
    ("copy", SIGHUP, True),
    ("commit", SIGINT, True),
])
def test_a_signal_during_reshard_leaves_nothing_and_the_previous_destination_as_it_was(
    tmp_path, phase, signum, previous
):
    out = tmp_path / "out"
    before = write_previous(out) if previous else None
    process = run_until(phase, "reshard", SOURCE, out, "--world", "2", "--threads", "1", "--force")
    returncode, stderr = stop(process, signum)
    assert returncode == 128 + signum
    assert stderr == one_line_for(signum)
    assert entries(tmp_path) == (["out"] if previous else [])
    if previous:
        assert snapshot(out) == before


@pytest.mark.parametrize("signum", [SIGINT, SIGTERM, SIGHUP])
def test_a_signal_while_reshard_force_removes_the_old_destination_finishes_the_removal(tmp_path, signum):
    out = tmp_path / "out"
    reshard(SOURCE, out, world_size=2)
    expected = snapshot(out)
    shutil.rmtree(out)
    write_previous(out)
    process = run_until("remove-old", "reshard", SOURCE, out, "--world", "2", "--force")
    assert len(list(tmp_path.glob(temps.OLD_PREFIX + "out.*"))) == 1  # the old one, partly removed
    returncode, stderr = stop(process, signum)
    assert returncode == 128 + signum
    assert stderr == one_line_for(signum)
    assert entries(tmp_path) == ["out"]
    assert snapshot(out) == expected  # the new destination, complete


def test_a_signal_while_consolidate_force_removes_the_old_shard_directory_finishes_the_removal(tmp_path):
    out = tmp_path / "shards"
    consolidate(SOURCE, tmp_path / "reference", convert=ConvertOptions(max_shard_size="1kB"))
    expected = snapshot(tmp_path / "reference")
    shutil.rmtree(tmp_path / "reference")
    write_previous(out)
    process = run_until("remove-old", "consolidate", SOURCE, out, "--max-shard-size", "1kB", "--force")
    returncode, stderr = stop(process, SIGTERM)
    assert (returncode, stderr) == (143, one_line_for(SIGTERM))
    assert entries(tmp_path) == ["shards"]
    assert snapshot(out) == expected


# ---------------------------------------------------------------------------------------------
# SIGKILL: nothing visible for one file; a directory's leftover removed by the next run


@pytest.mark.parametrize("output, phase", [("model.safetensors", "copy"), ("model.pt", "commit")])
def test_sigkill_leaves_nothing_visible_beside_a_single_file_output(tmp_path, output, phase):
    if not supports_unnamed_files(tmp_path):
        pytest.skip("the filesystem of tmp_path has no O_TMPFILE")
    out = tmp_path / output
    before = write_previous(out)
    process = run_until(phase, "consolidate", SOURCE, out, *CONSOLIDATE_ARGS, "--force")
    returncode, _ = stop(process, signal.SIGKILL)
    assert returncode == -signal.SIGKILL
    assert entries(tmp_path) == [output]
    assert snapshot(out) == before


@pytest.mark.parametrize("command, previous", [
    (("reshard", SOURCE, "{out}", "--world", "2", "--threads", "1"), False),
    (("reshard", SOURCE, "{out}", "--world", "2", "--threads", "1", "--force"), True),
    (("consolidate", SOURCE, "{out}", *CONSOLIDATE_ARGS, "--max-shard-size", "1kB", "--force"), True),
])
def test_after_sigkill_the_next_run_removes_the_leftover_directory_and_says_so(tmp_path, command, previous):
    out = tmp_path / "out"
    if previous:
        write_previous(out)
    args = [str(out) if part == "{out}" else part for part in command]
    process = run_until("copy", *args)
    stop(process, signal.SIGKILL)
    [leftover] = tmp_path.glob(temps.WRITING_PREFIX + "out.*")
    returncode, stderr = run(*args)
    assert returncode == 0, stderr
    assert f"removed stale temp {leftover} left by a killed run (pid {process.pid})" in stderr
    assert entries(tmp_path) == ["out"]


def test_after_sigkill_during_removal_of_the_old_destination_the_next_run_finishes_it(tmp_path):
    out = tmp_path / "out"
    write_previous(out)
    process = run_until("remove-old", "reshard", SOURCE, out, "--world", "2", "--force")
    stop(process, signal.SIGKILL)
    [old] = tmp_path.glob(temps.OLD_PREFIX + "out.*")
    written = snapshot(out)
    returncode, stderr = run("reshard", SOURCE, out, "--world", "2")  # no --force: refuses, but cleans up
    assert returncode == 2
    assert stderr[0] == f"removed stale temp {old} left by a killed run (pid {process.pid})"
    assert stderr[1].startswith("error: ") and "already exists" in stderr[1]
    assert entries(tmp_path) == ["out"]
    assert snapshot(out) == written


def test_a_run_killed_between_its_two_renames_gets_the_previous_destination_back(tmp_path):
    out = tmp_path / "out"
    before = write_previous(out)
    process = run_until("commit", "reshard", SOURCE, out, "--world", "2", "--force")
    stop(process, signal.SIGKILL)
    # the state a kill between "old destination aside" and "new one into place" leaves
    [new] = tmp_path.glob(temps.WRITING_PREFIX + "out.*")
    old = tmp_path / new.name.replace(temps.WRITING_PREFIX, temps.OLD_PREFIX)
    out.rename(old)
    returncode, stderr = run("reshard", SOURCE, out, "--world", "2")
    assert returncode == 2  # the previous destination is back, so it exists
    assert f"restored {out} from {old}, moved aside by a killed run (pid {process.pid})" in stderr
    assert f"removed stale temp {new} left by a killed run (pid {process.pid})" in stderr
    assert entries(tmp_path) == ["out"]
    assert snapshot(out) == before


def test_a_temp_of_a_live_process_is_left_alone(tmp_path):
    out = tmp_path / "out"
    process = run_until("copy", "reshard", SOURCE, out, "--world", "2", "--threads", "1")
    stop(process, signal.SIGKILL)
    [leftover] = tmp_path.glob(temps.WRITING_PREFIX + "out.*")
    live = leftover.with_name(leftover.name.replace(f".{process.pid}.", f".{os.getpid()}."))
    leftover.rename(live)  # as if this test process were writing it
    returncode, stderr = run("reshard", SOURCE, out, "--world", "2")
    assert returncode == 0 and not any("stale" in line for line in stderr)
    assert entries(tmp_path) == sorted(["out", live.name])


# ---------------------------------------------------------------------------------------------
# The pieces, in process


def test_interruptible_turns_sigterm_into_interrupted_and_restores_the_handler():
    before = signal.getsignal(SIGTERM)
    with pytest.raises(signals.Interrupted) as raised, signals.interruptible():
        os.kill(os.getpid(), SIGTERM)
        time.sleep(TIMEOUT)
    assert (raised.value.exit_code, str(raised.value)) == (143, "interrupted by SIGTERM")
    assert signal.getsignal(SIGTERM) == before


def test_atomic_output_has_no_name_while_written(tmp_path):
    if not supports_unnamed_files(tmp_path):
        pytest.skip("the filesystem of tmp_path has no O_TMPFILE")
    with outputs.atomic_output(tmp_path / "model.safetensors") as handle:
        handle.write(b"tensor bytes")
        assert entries(tmp_path) == []
    assert (tmp_path / "model.safetensors").read_bytes() == b"tensor bytes"


def test_atomic_output_falls_back_to_a_named_temp_where_o_tmpfile_is_unsupported(tmp_path, monkeypatch):
    real_open = os.open

    def no_unnamed_files(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_unnamed_files)
    monkeypatch.setattr(local, "_unnamed_files_work", {})  # forget what the filesystem allowed so far
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous")
    with pytest.raises(signals.Interrupted), outputs.atomic_output(out) as handle:
        handle.write(b"half")
        handle.flush()
        [temp] = tmp_path.glob(temps.WRITING_PREFIX + "model.safetensors.*")
        assert temp.read_bytes() == b"half"
        raise signals.Interrupted(SIGTERM)
    assert entries(tmp_path) == ["model.safetensors"] and out.read_bytes() == b"previous"
    with outputs.atomic_output(out) as handle:
        handle.write(b"new")
    assert entries(tmp_path) == ["model.safetensors"] and out.read_bytes() == b"new"


def test_run_tasks_stops_running_tasks_at_their_next_block_when_one_fails(tmp_path):
    def slow_writer() -> int:
        with open(tmp_path / "data", "wb") as handle:
            for block in range(1000):  # 10 s unless stopped
                io.write_at(handle.fileno(), b"x", block)
                time.sleep(0.01)
        return 1000

    def failing() -> int:
        time.sleep(0.1)
        raise ValueError("disk on fire")

    with pytest.raises(ValueError, match="disk on fire"):
        io.run_tasks([io.Task(slow_writer), io.Task(failing)], threads=2, max_memory=1 << 20)
    assert (tmp_path / "data").stat().st_size < 1000  # returned after the writer stopped, early
