"""The integrity gate: consolidate and reshard refuse whatever `validate` refuses.

Each corruption `validate` knows (tests/test_validate.py) is applied to a copy of a real
checkpoint; every data-reading command must exit 1 with validate's problem code and leave
nothing at its output. The case that motivated the gate: a chunk shifted into its neighbour,
leaving a gap of exactly the same volume, so the chunk volumes still add up to the tensor.
"""

from __future__ import annotations

import json

import pytest


from test_validate import CORRUPTIONS, EMBED, copy_fixture, rewrite_metadata, storage_key

OUTPUTS = ("model.safetensors", "hub-folder", "model.pt")


def shifted_chunk_with_equal_gap(path):
    """Move chunk 1 of the embedding up by one row: it overlaps chunk 0 by one row and leaves
    one uncovered row before chunk 2, so the chunk volumes still sum to the tensor's."""

    def edit(metadata):
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        key = storage_key(metadata, EMBED, 1)
        info = metadata.storage_data.pop(key)
        chunk = metadata.state_dict_metadata[EMBED].chunks[1]
        chunk.offsets = torch.Size([chunk.offsets[0] - 1, 0])
        metadata.storage_data[MetadataIndex(EMBED, chunk.offsets)] = info

    rewrite_metadata(path, edit)


GATE_CASES = {name: (corrupt, code) for name, (corrupt, code, deep_only) in CORRUPTIONS.items() if not deep_only}
GATE_CASES["chunk shifted into its neighbour, equal gap"] = (shifted_chunk_with_equal_gap, "overlap")


def test_the_shifted_chunk_keeps_the_volume_sum_so_only_exact_tiling_catches_it(tmp_path):
    from ckpttool.readers.dcp import read_checkpoint

    path = copy_fixture(tmp_path, "fsdp2_world3_uneven")
    shifted_chunk_with_equal_gap(path)
    tensor = read_checkpoint(path).tensors[EMBED]
    assert sum(chunk.numel for chunk in tensor.chunks) == tensor.numel


@pytest.mark.parametrize("name", GATE_CASES)
def test_validate_refuses_each_case(cli, tmp_path, name):
    corrupt, code = GATE_CASES[name]
    path = copy_fixture(tmp_path, "fsdp2_world3_uneven")
    corrupt(path)
    result = cli("validate", path, "--json")
    assert result.exit_code == 1
    assert code in {p["code"] for p in json.loads(result.stdout)["problems"]}


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("name", GATE_CASES)
def test_consolidate_refuses_what_validate_refuses_and_writes_nothing(cli, tmp_path, name, output):
    corrupt, code = GATE_CASES[name]
    path = copy_fixture(tmp_path, "fsdp2_world3_uneven")
    corrupt(path)
    out = tmp_path / "out" / output
    result = cli("consolidate", path, out, "--all" if output.endswith(".pt") else "--quiet", "--quiet")
    assert result.exit_code == 1, result.output
    assert f"[{code}]" in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() and not any((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True


@pytest.mark.parametrize("name", GATE_CASES)
def test_reshard_refuses_what_validate_refuses_and_writes_nothing(cli, tmp_path, name):
    corrupt, code = GATE_CASES[name]
    path = copy_fixture(tmp_path, "fsdp2_world3_uneven")
    corrupt(path)
    out = tmp_path / "resharded"
    result = cli("reshard", path, out, "--world", "2", "--quiet")
    assert result.exit_code == 1, result.output
    assert f"[{code}]" in result.stderr and "Traceback" not in result.output
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fsdp2_world3_uneven", *(["outside.distcp"] if "path" in name else [])])


def test_warnings_do_not_block_consolidate(cli, tmp_path):
    path = copy_fixture(tmp_path, "fsdp2_world3_uneven")
    (path / "stray.bin").write_bytes(b"left over")
    assert cli("validate", path).exit_code == 0
    result = cli("consolidate", path, tmp_path / "model.safetensors", "--quiet")
    assert result.exit_code == 0, result.output
