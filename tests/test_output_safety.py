"""No output may land on its own source: consolidate and reshard refuse an OUT/DST that is the
source checkpoint, lies inside it or contains it (symlinks resolved), with or without --force,
with exit 2 and the source untouched."""

from __future__ import annotations

import hashlib
import shutil

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
