"""Hostile data files and names: special files, symlinks out of the checkpoint, names that
would garble a terminal or cannot be a path, and blobs that torch refuses. Every command
answers in one line, exits 1 or 2 in time, writes nothing at OUT, and runs no code.

Checkpoints are real ones written by torch's `dcp.save` (names included: torch writes a
tensor called "model.\\x1b[31mred" as it is), then damaged here as a careless user or an
attacker would: a data file swapped for a FIFO, a directory, a symlink to /dev/zero or to a
file outside the checkpoint; a storage path holding a NUL byte.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import BadName, UnsafeDataFile

from test_hostile_metadata import COMMANDS as EVERY_COMMAND, MAX_RSS_MB, TIMEOUT_S, run_cli
from test_reader import save_single_process

COMMANDS = {name: args for name, args in EVERY_COMMAND.items() if name != "inspect"}  # the ones that read data


class RunsCode:
    """Unpickling this object would create MARKER: proof that code from a checkpoint ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A real two-tensor checkpoint (one data file) plus a python object entry."""
    import torch

    path = tmp_path_factory.mktemp("plain") / "ckpt"
    save_single_process(path, {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
                                         "b": torch.ones(8)}, "extra": {"step": 3}})
    return path


def data_file(checkpoint: Path) -> Path:
    (only,) = checkpoint.glob("*.distcp")
    return only


def run_every_command(checkpoint: Path, work: Path, commands=COMMANDS, timeout: float = TIMEOUT_S) -> dict[str, tuple]:
    """Run each command as a subprocess (a hang would fail the test, not the run), two at a time."""
    runs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, args in commands.items():
            (work / name).mkdir(parents=True)
            runs[name] = pool.submit(run_cli, args(str(checkpoint), work / name / "out"), work / name, timeout)
    return {name: run.result() for name, run in runs.items()}


def assert_refused_in_one_line(results: dict[str, tuple], work: Path, code: str) -> None:
    for command, (exit_code, stdout, stderr, elapsed, rss) in results.items():
        assert exit_code in (1, 2), (command, exit_code, stdout, stderr)
        assert elapsed < TIMEOUT_S and rss < MAX_RSS_MB, (command, elapsed, rss)
        assert "Traceback" not in stdout + stderr, command
        assert f"[{code}]" in stdout + stderr, (command, stdout, stderr)
        if not command.startswith("validate"):
            assert len(stderr.strip().splitlines()) == 1, (command, stderr)
        assert sorted(p.name for p in (work / command).iterdir()) == ["rss.txt", "stderr.txt", "stdout.txt"], command


# ---------------------------------------------------------------------------------------------
# Special files and symlinks


@pytest.mark.parametrize("kind, code", [("fifo", "not-regular-file"), ("directory", "not-regular-file"),
                                        ("link-to-dev-zero", "symlink-escapes")])
def test_a_data_file_that_is_not_a_regular_file_is_refused_by_every_command_without_blocking(plain, tmp_path, kind, code):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(plain, checkpoint)
    target = data_file(checkpoint)
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)  # opening it for reading without O_NONBLOCK would wait for a writer forever
    elif kind == "directory":
        target.mkdir()
    else:
        target.symlink_to("/dev/zero")
    assert_refused_in_one_line(run_every_command(checkpoint, tmp_path / "work"), tmp_path / "work", code)


def test_a_device_reached_with_follow_symlinks_is_still_refused_as_not_a_regular_file(plain, tmp_path, cli):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(plain, checkpoint)
    target = data_file(checkpoint)
    target.unlink()
    target.symlink_to("/dev/zero")
    result = cli("consolidate", checkpoint, tmp_path / "out.safetensors", "--follow-symlinks")
    assert result.exit_code == 1
    assert "[not-regular-file]" in result.output and "a character device, not a regular file" in result.output
    assert not (tmp_path / "out.safetensors").exists()


def test_the_reader_refuses_a_fifo_even_when_it_appears_after_the_gate_ran(plain, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(plain, checkpoint)
    target = data_file(checkpoint)
    target.unlink()
    os.mkfifo(target)
    with DataFiles(checkpoint) as files, pytest.raises(UnsafeDataFile, match="a FIFO, not a regular file") as raised:
        files.fd(target.name)
    assert raised.value.code == "not-regular-file"


def test_a_data_file_symlinked_outside_the_checkpoint_is_refused_unless_follow_symlinks(plain, tmp_path, cli):
    checkpoint, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    shutil.copytree(plain, checkpoint)
    elsewhere.mkdir()
    target = data_file(checkpoint)
    shutil.move(target, elsewhere / target.name)
    target.symlink_to(elsewhere / target.name)

    refused = cli("consolidate", checkpoint, tmp_path / "refused.safetensors")
    assert refused.exit_code == 1 and "[symlink-escapes]" in refused.output
    assert "pass --follow-symlinks" in refused.output and not (tmp_path / "refused.safetensors").exists()
    report = json.loads(cli("validate", checkpoint, "--json").output)
    assert [p["code"] for p in report["problems"]] == ["symlink-escapes"]  # not also "unreferenced"

    followed = cli("consolidate", checkpoint, tmp_path / "followed.safetensors", "--follow-symlinks")
    assert followed.exit_code == 0, followed.output
    assert cli("validate", "--deep", "--follow-symlinks", checkpoint).exit_code == 0
    assert cli("consolidate", plain, tmp_path / "plain.safetensors").exit_code == 0
    assert (tmp_path / "followed.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()


def test_a_symlink_that_stays_inside_the_checkpoint_is_read_as_usual(plain, tmp_path, cli):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(plain, checkpoint)
    target = data_file(checkpoint)
    (checkpoint / "store").mkdir()
    shutil.move(target, checkpoint / "store" / target.name)
    target.symlink_to(Path("store") / target.name)
    assert cli("validate", "--deep", checkpoint).exit_code == 0
    assert cli("reshard", checkpoint, tmp_path / "w2", "--world", "2").exit_code == 0


# ---------------------------------------------------------------------------------------------
# Names


def test_control_characters_and_ansi_escapes_in_names_are_shown_escaped_never_raw(tmp_path, cli):
    import torch

    checkpoint = tmp_path / "ckpt"
    evil = "model.\x1b[31mred\x1b[0m\rbell\x07\u202eright-to-left"
    save_single_process(checkpoint, {"model": {"w": torch.ones(2)}, evil: torch.zeros(3)})
    for args in (("inspect", checkpoint), ("inspect", "--chunks", checkpoint), ("validate", checkpoint),
                 ("reshard", checkpoint, tmp_path / "w2", "--world", "2", "--dry-run"),
                 ("consolidate", checkpoint, tmp_path / "all.safetensors", "--all", "--dry-run")):
        result = cli(*args)
        assert result.exit_code == 0, (args, result.output)
        assert not any(c in result.output for c in "\x1b\r\x07\u202e"), args
    shown = cli("inspect", checkpoint).output
    assert "model.\\x1b[31mred\\x1b[0m\\x0dbell\\x07\\u202eright-to-left" in shown
    assert evil in [t["fqn"] for t in json.loads(cli("inspect", "--json", checkpoint).output)["tensors"]]  # JSON keeps it
    # the written file keeps the name byte for byte
    assert cli("consolidate", checkpoint, tmp_path / "all.safetensors", "--all").exit_code == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "all.safetensors", "np") as handle:
        assert evil in handle.keys()


@pytest.mark.parametrize("name, why", [("model.w\x00evil", "a NUL byte"), ("model.w\ud800", "an unpaired surrogate")])
def test_a_name_no_path_or_header_can_hold_is_a_named_fault_in_every_command(tmp_path, name, why):
    import torch

    checkpoint = tmp_path / "ckpt"
    save_single_process(checkpoint, {"model": {"w": torch.ones(2)}, name: torch.zeros(3)})
    commands = EVERY_COMMAND
    results = run_every_command(checkpoint, tmp_path / "work", commands)
    assert_refused_in_one_line(results, tmp_path / "work", "bad-name")
    assert why in results["inspect"][2]


def test_a_data_file_path_with_a_nul_byte_is_a_named_fault_not_a_traceback(plain, tmp_path, cli):
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(plain, checkpoint)
    metadata = FileSystemReader(checkpoint).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "__0_0.distcp\x00.txt"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(BadName, match="data file path '__0_0.distcp\\\\x00.txt' holds a NUL byte"):
        from ckpttool import read_checkpoint

        read_checkpoint(checkpoint)
    for args in (("inspect", checkpoint), ("validate", checkpoint), ("consolidate", checkpoint, tmp_path / "o.pt")):
        result = cli(*args)
        assert result.exit_code == 1 and "[bad-name]" in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == (2 if args[0] == "validate" else 1)  # + validate's verdict
    assert not (tmp_path / "o.pt").exists()


# ---------------------------------------------------------------------------------------------
# Objects torch refuses: one line in our words, and nothing runs


def test_an_object_that_would_run_code_is_refused_in_one_line_without_torchs_advice(tmp_path):
    import torch

    checkpoint, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    save_single_process(checkpoint, {"model": {"w": torch.ones(2)}, "extra": {"payload": RunsCode(str(marker))}})
    # (reshard copies an object's bytes as they are, never decoding them: it is not asked here)
    commands = {name: COMMANDS[name] for name in ("validate-deep", "consolidate-pt-all")}
    # both import torch (its unpickler is the one refusing), which alone takes 10 s and more on
    # a loaded machine: the bound that catches a hang grows with the load, not the code's time
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    results = run_every_command(checkpoint, tmp_path / "work", commands, timeout=TIMEOUT_S * busy)
    for command, (exit_code, stdout, stderr, *_) in results.items():
        assert exit_code == 1, (command, stdout, stderr)
        text = stdout + stderr
        assert "extra.payload" in text and "refused by torch.load(weights_only=True)" in text, (command, text)
        assert "weights_only=False" not in text and "Traceback" not in text, (command, text)
        assert "Unsupported global: GLOBAL io.open was not an allowed global by default;" in text, (command, text)
    assert not marker.exists()
