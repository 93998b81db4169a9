"""torch's HuggingFaceStorageWriter output (`dcp-hf`): inspect, validate --deep, consolidate and
reshard it like any DCP checkpoint, byte for byte what torch's own consolidator and
HuggingFaceStorageReader produce.

fixtures/dcp_hf_world2 is a 2-rank FSDP2 save (fixtures/generate_dcp_hf.py): per-rank
`shard-0000R-model-00001-of-00001.safetensors` with DCP_SHARDING_INFO, uneven splits and
an empty shard; fixtures/dcp_hf_world2_consolidated is torch's `consolidate_safetensors_files`
of it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES, assert_same_bytes

SHARDED = FIXTURES / "dcp_hf_world2"
CONSOLIDATED = FIXTURES / "dcp_hf_world2_consolidated"
TORCH_CONSOLIDATED_FILE = CONSOLIDATED / "model-00001-of-00001.safetensors"
SHARD_1 = "shard-00002-model-00001-of-00001.safetensors"  # rank 1 (torch numbers shards from 1)
TENSORS = {"embed.weight": [13, 8], "gate.bias": [1], "gate.weight": [1, 3], "norm.bias": [8],
           "norm.weight": [8], "proj.bias": [3], "proj.weight": [3, 8]}


@pytest.fixture(scope="session")
def torch_consolidated() -> dict:
    from safetensors.torch import load_file

    return load_file(TORCH_CONSOLIDATED_FILE)


@pytest.fixture(scope="session")
def torch_hf_reader_load(torch_consolidated) -> dict:
    """What stock `dcp.load` with torch's HuggingFaceStorageReader returns for the shards."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {name: torch.empty_like(value) for name, value in torch_consolidated.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(SHARDED)))
    return state


def test_inspect_shows_layout_global_shapes_and_shards(cli):
    text = cli("inspect", SHARDED)
    assert text.exit_code == 0 and "  layout: dcp-hf\n" in text.output
    document = json.loads(cli("inspect", SHARDED, "--json").stdout)
    assert document["layout"] == "dcp-hf"
    shapes = {t["fqn"]: t["shape"] for t in document["tensors"]}
    assert shapes == TENSORS
    gate = next(t for t in document["tensors"] if t["fqn"] == "gate.weight")
    assert [(c["offsets"], c["sizes"], c["file"]) for c in gate["chunks"]] == [
        ([0, 0], [1, 3], "shard-00001-model-00001-of-00001.safetensors"), ([1, 0], [0, 3], SHARD_1)]


@pytest.mark.parametrize("path", [SHARDED, CONSOLIDATED], ids=["sharded", "consolidated"])
def test_validate_deep_reads_every_byte_and_finds_nothing(cli, path):
    result = cli("validate", path, "--deep", "--json")
    document = json.loads(result.stdout)
    assert result.exit_code == 0 and document["valid"], document["problems"]
    assert document["problems"] == []
    assert document["checked"]["bytes_read"] == sum(4 * n for n in (104, 1, 3, 8, 8, 3, 24))


def test_consolidate_is_byte_identical_to_torch_consolidator_and_hf_reader(cli, tmp_path, torch_consolidated,
                                                                            torch_hf_reader_load):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = cli("consolidate", SHARDED, out, "--all")
    assert result.exit_code == 0, result.output
    ours = load_file(out)
    assert ours.keys() == torch_consolidated.keys() == torch_hf_reader_load.keys()
    for name in ours:
        assert_same_bytes(ours[name], torch_consolidated[name], name)
        assert_same_bytes(ours[name], torch_hf_reader_load[name], name)


def test_reshard_to_world_3_loads_with_stock_dcp_load(cli, tmp_path, torch_consolidated):
    import torch
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "world3"
    result = cli("reshard", SHARDED, out, "--world", "3")
    assert result.exit_code == 0, result.output
    state = {name: torch.empty_like(value) for name, value in torch_consolidated.items()}
    dcp.load(state, checkpoint_id=str(out))
    for name, value in torch_consolidated.items():
        assert_same_bytes(state[name], value, name)


def test_a_truncated_shard_is_reported_and_refused(cli, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(SHARDED, path)
    data = (path / SHARD_1).read_bytes()
    (path / SHARD_1).write_bytes(data[:-8])
    document = json.loads(cli("validate", path, "--json").stdout)
    assert not document["valid"]
    assert any(SHARD_1 in p["message"] and "proj.weight" in p["message"] for p in document["problems"])
    result = cli("consolidate", path, tmp_path / "out.safetensors", "--all")
    assert result.exit_code == 1 and not (tmp_path / "out.safetensors").exists()


def test_damaged_sharding_info_is_reported(cli, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(SHARDED, path)
    raw = bytearray((path / SHARD_1).read_bytes())
    start = raw.index(b"[7, 0]")  # embed.weight's rank-1 shard, inside the JSON string
    raw[start:start + 6] = b"[7, 9]"
    (path / SHARD_1).write_bytes(bytes(raw))
    document = json.loads(cli("validate", path, "--json").stdout)
    assert {p["code"] for p in document["problems"]} >= {"gap"}, document["problems"]
    raw[start:start + 6] = b"[7   ]"
    (path / SHARD_1).write_bytes(bytes(raw))
    document = json.loads(cli("validate", path, "--json").stdout)
    assert any("embed.weight: DCP_SHARDING_INFO has no valid saved_offsets" in p["message"]
               for p in document["problems"]), document["problems"]
