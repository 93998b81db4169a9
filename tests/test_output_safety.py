"""No output may land on its own source: consolidate and reshard refuse an OUT/DST that is the
source checkpoint, lies inside it or contains it (symlinks resolved), with or without --force,
with exit 2 and the source untouched."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES


def snapshot(directory) -> dict:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "runs" / "step-2"
    shutil.copytree(FIXTURES / "fsdp2_world2", path)
    return path


def outputs(source):
    """(command, output) pairs that would overwrite or delete the source."""
    link = source.parent / "link-to-step-2"
    link.symlink_to(source, target_is_directory=True)
    return [
        ("consolidate", source),
        ("consolidate", source / "model.safetensors"),
        ("consolidate", source / "sub" / "model.pt"),
        ("consolidate", source.parent),
        ("consolidate", link),
        ("reshard", source),
        ("reshard", source / "sub"),
        ("reshard", source.parent),
        ("reshard", link / "w3"),
        ("reshard", source / "sub" / ".." / ".."),  # the parent, spelled through a missing folder
        ("export", source / "hub"),
    ]


def test_every_output_that_overlaps_the_source_is_refused_and_the_source_survives(cli, source):
    before = snapshot(source)
    for command, out in outputs(source):
        extra = ("--world", "3") if command == "reshard" else ()
        for force in ((), ("--force",)):
            result = cli(command, source, out, *extra, *force, "--quiet")
            assert result.exit_code == 2, (command, out, force, result.output)
            assert "source checkpoint" in result.stderr and "Traceback" not in result.output
            assert len(result.stderr.strip().splitlines()) == 1
            assert snapshot(source) == before, (command, out, force)
    assert not (source / "sub").exists()


def test_an_output_beside_the_source_is_fine(cli, source):
    result = cli("reshard", source, source.parent / "step-2-world3", "--world", "3", "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("where", ["parent-is-a-file", "cannot-be-created"])
@pytest.mark.parametrize("command", ["consolidate", "reshard", "export"])
def test_an_output_that_cannot_be_created_is_one_line_and_nothing_is_left(cli, source, tmp_path, command, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    parent = blocker if where == "parent-is-a-file" else Path("/proc/ckpttool-test")  # not even root can mkdir
    out = parent / ("m.safetensors" if command == "consolidate" else "out")
    args = [command, source, out] + (["--world", "2"] if command == "reshard" else [])
    before = snapshot(tmp_path)
    result = cli(*args, "--quiet")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: [write-failed]") and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output and snapshot(tmp_path) == before
