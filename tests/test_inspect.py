"""`ckpttool inspect`: what a checkpoint holds, from metadata alone, agreeing with torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES


def inspect_json(cli, path, *flags):
    result = cli("inspect", path, "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inspect_json_matches_torchs_own_consolidation(cli, fixture_checkpoint, reference):
    import torch

    document = inspect_json(cli, fixture_checkpoint)
    expected = {k: v for k, v in reference(fixture_checkpoint).items() if isinstance(v, torch.Tensor)}
    listed = {t["fqn"]: t for t in document["tensors"]}
    assert set(listed) == set(expected)
    for fqn, tensor in expected.items():
        assert listed[fqn]["shape"] == list(tensor.shape), fqn
        assert listed[fqn]["dtype"] == str(tensor.dtype).removeprefix("torch."), fqn
    non_tensors = {k for k, v in reference(fixture_checkpoint).items() if not isinstance(v, torch.Tensor)}
    assert {o["fqn"] for o in document["objects"]} == non_tensors


def test_inspect_shows_uneven_and_empty_fsdp2_shards():
    from ckpttool.commands.inspect import inspect

    report = inspect(FIXTURES / "fsdp2_world3_uneven")
    by_name = {t.fqn: t for t in report.tensors}
    embed = by_name["model.embed.weight"]
    assert (embed.sharding.kind, embed.sharding.uneven) == ("dim0", True)
    assert [c.sizes[0] for c in embed.chunks] == [5, 5, 3]
    head = by_name["model.head.weight"]
    assert head.sharding.kind == "dim0" and head.sharding.empty_chunks == 1
    assert by_name["model.position_ids"].sharding.kind == "replicated"
    assert by_name["optim.state.embed.weight.step"].shape == ()
    assert report.summary.ranks == (0, 1, 2)
    assert report.summary.parameters == sum(t.numel for t in report.tensors if t.group == "model")
    assert report.groups["optimizer"].tensors == 42 and report.groups["other"].objects == 2


def test_inspect_bytes_per_file_add_up_to_the_tensor_bytes(cli):
    document = inspect_json(cli, FIXTURES / "fsdp2_world3_uneven")
    per_file = sum(sum(f["tensor_bytes"].values()) for f in document["files"])
    assert per_file == document["summary"]["tensor_bytes"]
    assert [f["rank"] for f in document["files"]] == [0, 1, 2]
    sizes = sorted(f["size"] for f in document["files"])
    assert sizes == sorted(p.stat().st_size for p in (FIXTURES / "fsdp2_world3_uneven").glob("*.distcp"))


def test_filter_keeps_summary_but_lists_only_matching_entries(cli):
    document = inspect_json(cli, FIXTURES / "fsdp2_world2_adamw", "--filter", "model.layers.0.*", "--filter", "*.step")
    fqns = [t["fqn"] for t in document["tensors"]]
    assert fqns and all(f.startswith("model.layers.0.") or f.endswith(".step") for f in fqns)
    assert document["summary"]["tensors"] == 58


def test_human_output_lists_groups_chunks_and_files(cli):
    result = cli("inspect", FIXTURES / "fsdp2_world3_uneven", "--chunks", "--by-file")
    assert result.exit_code == 0
    for text in ("model: 16 tensors", "optimizer: 42 tensors", "dim0 uneven", "1 empty", "__2_0.distcp", "OFFSETS", "RANK"):
        assert text in result.stdout


def test_inspect_does_not_import_torch_or_read_tensor_bytes():
    """Every file the process opens is seen by an audit hook (`open`: builtins.open, os.open,
    io.open_code): of the checkpoint, inspect opens its .metadata alone, never a .distcp."""
    root = FIXTURES / "fsdp2_world2"
    code = (
        "import sys\n"
        "opened = []\n"
        "sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == 'open' else None)\n"
        "import ckpttool.cli as c\n"
        "from click.testing import CliRunner\n"
        f"r = CliRunner().invoke(c.main, ['inspect', '--json', {str(root)!r}])\n"
        "assert r.exit_code == 0\n"
        "print('torch' in sys.modules)\n"
        f"print(sorted({{path.removeprefix({str(root) + '/'!r}) for path in opened if path.startswith({str(root)!r})}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False", "['.metadata']"]
    assert sorted(p.name for p in root.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # left unopened


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_and_version(cli, flag):
    assert "inspect" in cli(flag).stdout
    assert "ckpttool, version" in cli("--version").stdout
