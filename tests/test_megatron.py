"""A Megatron-Core `torch_dist` checkpoint written by megatron-core 0.16.1's own
`dist_checkpointing.save` (fixtures/frameworks/generate_megatron.py: GPTModel, 2 layers, tensor
parallel 2 on gloo) in a Megatron-LM run dir (`checkpoints/iter_0000002/`,
`latest_checkpointed_iteration.txt`).

Megatron saves each layer-stacked tensor (`decoder.layers.self_attention.linear_qkv.weight`,
shape (2, 48, 16)) with one chunk per layer and tensor-parallel rank; ckpttool takes the layer
axis apart, so consolidate writes `decoder.layers.0.self_attention.linear_qkv.weight` etc.,
byte for byte what a fresh model holds after Megatron's own `dist_checkpointing.load`
(expected.json). No megatron is imported here; torch's own `dcp.load` is the second opinion.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes
from test_validate import rewrite_metadata, storage_key

from ckpttool.outputs.temps import TEMP_PREFIX

MEGATRON = FIXTURES / "frameworks" / "megatron"
RUN_DIR = MEGATRON / "checkpoints"
ITERATION = RUN_DIR / "iter_0000002"
EXPECTED = json.loads((MEGATRON / "expected.json").read_text())
STACKED = re.compile(r"^(?P<prefix>.*\blayers\.)(?P<rest>[^\d].*)$")  # decoder.layers.<rest>, no layer number
LAYER = re.compile(r"^(?P<prefix>.*\blayers\.)(?P<layer>\d+)\.(?P<rest>.*)$")


@pytest.fixture(scope="module")
def run():
    from click.testing import CliRunner

    from ckpttool.cli import main

    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


# -- inspect, validate ---------------------------------------------------------------------------

def test_inspect_names_the_layout_and_the_newest_iteration(run):
    from ckpttool.readers import detect

    document = json.loads(run("inspect", RUN_DIR, "--json").stdout)
    assert document["layout"] == "megatron-torch-dist"
    assert Path(document["path"]).name == "iter_0000002"
    assert document["groups"]["model"]["tensors"] == len(EXPECTED["tensors"])
    detection = detect(RUN_DIR)
    assert (detection.newest, detection.newest_by) == ("iter_0000002", "latest_checkpointed_iteration.txt")


@pytest.mark.parametrize("flags", [(), ("--deep",)], ids=["validate", "validate-deep"])
def test_validate_finds_nothing(run, flags):
    result = run("validate", RUN_DIR, *flags)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("VALID"), result.output


# -- consolidate ---------------------------------------------------------------------------------

def test_consolidate_writes_megatrons_own_names_shapes_dtypes_and_bytes(run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", RUN_DIR, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert {key: describe(value) for key, value in load_file(out).items()} == EXPECTED["tensors"]


def test_consolidate_all_keeps_byte_entries_and_nests_the_model(run, tmp_path):
    import torch

    out = tmp_path / "all.pt"
    result = run("consolidate", ITERATION, out, "--all", "--quiet")
    assert result.exit_code == 0, result.output
    state = torch.load(out, weights_only=True)
    assert {key: describe(value) for key, value in state["model"].items()} == EXPECTED["tensors"]
    # `_extra_state` ShardedObjects, saved as `<key>/shard_<layer>_<layers>` byte entries
    linear_qkv = state["decoder"]["layers"]["self_attention"]["linear_qkv"]
    assert sorted(linear_qkv) == ["_extra_state/shard_0_2", "_extra_state/shard_1_2"]
    assert linear_qkv["_extra_state/shard_0_2"] == [None]  # torch.save([sh_obj.data ...]), None for local layers


# -- reshard -------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process
def test_reshard_to_world_3_keeps_megatrons_keys_and_loads_with_stock_dcp_load(run, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = tmp_path / "world3"
    result = run("reshard", RUN_DIR, out, "--world", "3", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    entries = FileSystemReader(out).read_metadata().state_dict_metadata
    saved = FileSystemReader(RUN_DIR / "iter_0000002").read_metadata().state_dict_metadata
    assert sorted(entries) == sorted(saved)  # keys as Megatron saved them: its own loader can read the reshard
    state = {key: torch.full(tuple(entry.size), 7, dtype=entry.properties.dtype) for key, entry in entries.items()
             if isinstance(entry, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(out))
    assert {key: describe(value) for key, value in model_tensors(state).items()} == EXPECTED["tensors"]


def model_tensors(state: dict) -> dict:
    """Megatron's model names for what reshard wrote: a `model.` prefix dropped, a layer-stacked
    tensor (kept as saved) split along its layer axis."""
    tensors = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        stacked = STACKED.match(key)
        if stacked is None:
            tensors[key] = value
            continue
        for layer in range(value.shape[0]):
            tensors[f"{stacked['prefix']}{layer}.{stacked['rest']}"] = value[layer]
    return tensors


# -- damaged copies fail cleanly -------------------------------------------------------------------

def truncate_a_shard(root: Path) -> None:
    shard = root / "__1_1.distcp"  # rank 1's second writer thread: layer 1's tensor-parallel parts
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def move_a_stacked_chunk_offset(root: Path) -> None:
    """The storage offset of one layer's chunk moved half a blob on (a buggy writer)."""
    fqn = "decoder.layers.self_attention.linear_qkv.weight"

    def edit(metadata):
        key = storage_key(metadata, fqn, 1)
        info = metadata.storage_data[key]
        info.offset += info.length // 2

    rewrite_metadata(root, edit)


@pytest.mark.parametrize("damage, code", [(truncate_a_shard, "beyond-eof"),
                                          (move_a_stacked_chunk_offset, "blob-overlap")],
                         ids=["truncated-shard", "metadata-offset-lie"])
@pytest.mark.parametrize("command", ["validate", "validate-deep", "consolidate"])
def test_a_damaged_copy_exits_1_naming_the_fault_and_writes_nothing(run, tmp_path, damage, code, command):
    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    damage(copy / ITERATION.name)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    args = {"validate": ("validate", copy), "validate-deep": ("validate", copy, "--deep"),
            "consolidate": ("consolidate", copy, out, "--quiet")}[command]
    result = run(*args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"[{code}]" in result.output, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == []
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))
