"""One torch.save file (`torch-pt`: `.pt`, `.pth`, `.bin`, `.ckpt`, or a folder's
`pytorch_model.bin`): read without torch and without running anything from its pickle, each
tensor a raw byte range of the file, and converted byte for byte.

The files are written once per session by torch's own `torch.save`: a flat state dict (float32,
bf16, int64, a scalar, an empty tensor, a tied pair, views into one storage), a nested
checkpoint (`{"model": state_dict(), "optimizer": ..., plain values, a list of dicts}`), and
Lightning's consolidated `.ckpt` from fixtures/frameworks/lightning.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections import OrderedDict

import pytest

from conftest import FIXTURES, assert_same_bytes, flatten, tensor_bytes

LIGHTNING = FIXTURES / "frameworks" / "lightning"
LIGHTNING_DCP = LIGHTNING / "checkpoints" / "epoch=0-step=2.ckpt"
LIGHTNING_CONSOLIDATED = LIGHTNING_DCP.with_name(LIGHTNING_DCP.name + ".consolidated")


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> dict:
    """{name: path} of the torch.save files, written once."""
    import torch

    root = tmp_path_factory.mktemp("torch_pt")
    torch.manual_seed(0)
    embed = torch.randn(8, 4)
    storage = torch.arange(20, dtype=torch.float32)
    flat = {"embed.weight": embed, "lm_head.weight": embed,  # tied: one storage, two keys
            "norm.weight": torch.randn(3, 5).to(torch.bfloat16), "positions": torch.arange(6).reshape(2, 3),
            "scale": torch.tensor(3.5), "unused": torch.empty(0, 4),
            "head": storage[4:10].view(2, 3), "tail": storage[12:16]}  # views at offsets of one storage
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    nested = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
              "config": {"lr": 0.1, "names": ["a", "b"], "shape": torch.Size([2, 3]), "dtype": torch.float16},
              "history": [{"weight": torch.ones(2), "step": 1}, {"weight": torch.zeros(2)}], "nothing": None}
    paths = {"flat": root / "flat.pt", "nested": root / "nested.pth", "lightning": root / "lightning.ckpt",
             "hub": root / "hub" / "pytorch_model.bin", "legacy": root / "legacy.pt",
             "transposed": root / "transposed.pt"}
    torch.save(flat, paths["flat"])
    torch.save(nested, paths["nested"])
    shutil.copyfile(LIGHTNING_CONSOLIDATED, paths["lightning"])
    paths["hub"].parent.mkdir()
    torch.save(model.state_dict(), paths["hub"])
    torch.save(flat, paths["legacy"], _use_new_zipfile_serialization=False)
    torch.save({"weight": torch.randn(3, 4).T}, paths["transposed"])
    return paths


def loaded(path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def tensors_of(state: dict) -> dict:
    import torch

    return {key: value for key, value in flatten(state).items() if isinstance(value, torch.Tensor)}


# -- reading ---------------------------------------------------------------------------------------

def test_inspect_names_the_layout_and_every_tensor_with_torchs_shapes_and_dtypes(cli, saved):
    for name in ("flat", "nested", "lightning"):
        result = cli("inspect", saved[name], "--json")
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert document["layout"] == "torch-pt"
        expected = tensors_of(loaded(saved[name]))
        found = {t["fqn"]: (t["dtype"], t["shape"]) for t in document["tensors"]}
        assert found == {key: (str(t.dtype).removeprefix("torch."), list(t.shape)) for key, t in expected.items()}


def test_nested_keys_flatten_as_dcp_names_them_and_plain_values_are_left_out(saved):
    from ckpttool.readers import open_checkpoint

    checkpoint = open_checkpoint(saved["nested"])
    assert checkpoint.model_prefix == "model" and checkpoint.objects == {}
    assert checkpoint.nesting["history.1.weight"] == ("history", 1, "weight")
    assert checkpoint.nesting["optimizer.state.0.exp_avg"] == ("optimizer", "state", 0, "exp_avg")
    assert set(checkpoint.tensors) == set(tensors_of(loaded(saved["nested"])))
    assert open_checkpoint(saved["flat"]).model_prefix == ""
    assert open_checkpoint(saved["lightning"]).model_prefix == "state_dict"


def test_tied_weights_and_views_are_raw_ranges_of_the_file(saved):
    from ckpttool.readers import open_checkpoint

    checkpoint = open_checkpoint(saved["flat"])
    blob = {fqn: tensor.chunks[0].blob for fqn, tensor in checkpoint.tensors.items()}
    assert blob["embed.weight"] == blob["lm_head.weight"]
    assert blob["tail"].offset - blob["head"].offset == 8 * 4 and blob["tail"].length == 16
    data = saved["flat"].read_bytes()
    reference = loaded(saved["flat"])
    for fqn, entry in blob.items():
        assert data[entry.offset:entry.offset + entry.length] == tensor_bytes(reference[fqn]), fqn


def test_validate_deep_reads_every_byte_and_finds_nothing(cli, saved):
    for name in ("flat", "nested", "lightning", "hub"):
        result = cli("validate", saved[name], "--deep", "--json")
        document = json.loads(result.stdout)
        assert result.exit_code == 0 and document["valid"] and document["problems"] == [], (name, document["problems"])


def test_a_folder_with_pytorch_model_bin_reads_as_torch_pt(cli, saved):
    document = json.loads(cli("inspect", saved["hub"].parent, "--json").stdout)
    assert document["layout"] == "torch-pt"
    assert {t["fqn"] for t in document["tensors"]} == set(loaded(saved["hub"]))


# -- converting ------------------------------------------------------------------------------------

def test_consolidate_to_safetensors_equals_torch_load_byte_for_byte(cli, saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "flat.safetensors"
    assert cli("consolidate", saved["flat"], out, "-q").exit_code == 0
    ours, reference = load_file(out), loaded(saved["flat"])
    assert sorted(ours) == sorted(reference)
    for key, value in reference.items():
        assert_same_bytes(ours[key], value, key)


def test_consolidate_of_a_nested_file_takes_the_model_subtree_and_all_keeps_every_tensor(cli, saved, tmp_path):
    from safetensors.torch import load_file

    reference = tensors_of(loaded(saved["nested"]))
    assert cli("consolidate", saved["nested"], tmp_path / "model.safetensors", "-q").exit_code == 0
    model = load_file(tmp_path / "model.safetensors")
    assert sorted(model) == sorted(key.removeprefix("model.") for key in reference if key.startswith("model."))
    for key, value in model.items():
        assert_same_bytes(value, reference["model." + key], key)
    assert cli("consolidate", saved["nested"], tmp_path / "all.pt", "--all", "-q").exit_code == 0
    everything = tensors_of(loaded(tmp_path / "all.pt"))
    assert sorted(everything) == sorted(reference)
    for key, value in reference.items():
        assert_same_bytes(everything[key], value, key)


def test_diff_of_a_dcp_checkpoint_and_its_own_consolidated_pt_is_identical(cli, tmp_path):
    out = tmp_path / "model.pt"
    assert cli("consolidate", FIXTURES / "fsdp2_world2", out, "-q").exit_code == 0
    result = cli("diff", FIXTURES / "fsdp2_world2", out, "--normalize", "-q")
    assert result.exit_code == 0 and result.output.startswith("IDENTICAL"), result.output


def test_import_of_a_pt_at_world_3_loads_with_stock_dcp(saved, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    imported = tmp_path / "world3"
    ckpttool = [sys.executable, "-m", "ckpttool"]
    result = subprocess.run([*ckpttool, "import", saved["flat"], imported, "--world", "3", "-q"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    reference = loaded(saved["flat"])
    state = {"model": {key: torch.zeros_like(value) for key, value in reference.items()}}
    dcp.load(state, checkpoint_id=str(imported), no_dist=True)
    for key, value in reference.items():
        assert_same_bytes(state["model"][key], value, key)


def test_lightning_consolidated_ckpt_gives_its_state_dict_weights(cli, saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "lightning.safetensors"
    result = cli("consolidate", saved["lightning"], out, "--json", "-q")
    assert result.exit_code == 0 and json.loads(result.stdout)["selected"].startswith("model weights"), result.output
    # the LightningModule's `model` attribute holds every parameter: read past, as for its DCP save
    expected = {name.removeprefix("model."): row for name, row in json.loads((LIGHTNING / "expected.json").read_text())["tensors"].items()}
    described = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        "sha256": hashlib.sha256(tensor_bytes(t)).hexdigest()} for name, t in load_file(out).items()}
    assert described == expected


def test_lightning_consolidated_ckpt_matches_lightnings_dcp_checkpoint_model(cli, saved):
    # the model keys line up (`state_dict.` and `model.` subtrees cut); the optimizer's do not
    # (DCP's `optimizer_0.state.<fqn>` vs the file's `optimizer_states.0.state.<fqn>`)
    result = cli("diff", LIGHTNING_DCP, saved["lightning"], "--normalize", "--only", "model", "-q")
    assert result.exit_code == 0 and result.output.startswith("IDENTICAL"), result.output


# -- refusing --------------------------------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["value", "nested-state-dict-attribute"])
def test_a_pickle_naming_os_system_is_refused_in_one_line_and_never_runs(cli, tmp_path, where):
    marker = tmp_path / "marker"
    inner = OrderedDict(weight=1)
    if where == "value":
        inner["bias"] = _RunsCode(marker)
    else:  # a nested state_dict()'s `_metadata`: a BUILD in the middle of the pickle
        inner._metadata = _RunsCode(marker)
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("evil/data.pkl", pickle.dumps({"model": inner, "epoch": 1}, protocol=2))
        archive.writestr("evil/byteorder", "little")
        archive.writestr("evil/version", "3\n")
    for command in (("inspect", path), ("consolidate", path, tmp_path / "out.safetensors")):
        result = cli(*command)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and "posix.system" in result.output and len(lines) == 1, lines
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_a_truncated_file_is_a_one_line_error(cli, saved, tmp_path):
    path = tmp_path / "truncated.pt"
    data = saved["flat"].read_bytes()
    path.write_bytes(data[:len(data) // 2])
    for command in (("inspect", path), ("consolidate", path, tmp_path / "out.safetensors")):
        result = cli(*command)
        assert result.exit_code == 1 and str(path) in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("name, words", [("legacy", "legacy (non-zip) torch.save file"),
                                         ("transposed", "weight: not contiguous")])
def test_what_this_build_does_not_read_is_one_line_naming_the_file(cli, saved, name, words):
    result = cli("inspect", saved[name])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and words in result.output and str(saved[name]) in result.output, result.output
    assert len(lines) == 1, lines


def test_reading_never_imports_torch(saved):
    code = ("import sys; from ckpttool.commands.validate import validate; "
            f"assert validate({str(saved['nested'])!r}, deep=True).valid; "
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
