"""The model is found by the checkpoint's structure, not by the name `model`.

Each checkpoint here is written once per module by torch's own `dcp.save` (one process, no
process group), nesting the same small model the ways people nest it: torch's DCP recipe
(`{"app": AppState}` -> `app.model`, `app.optim` from `get_state_dict`), a plain
`model.state_dict()`, a Composer-like `{"state": {"model", "optimizers"}, "rng"}`, a name of the
user's choosing, an optimizer keyed by parameter ids, and two equally plausible models.
`consolidate` with no flags must give exactly `model.state_dict()`, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_same_bytes

torch = pytest.importorskip("torch")


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32))


def trained(seed: int = 0):
    """A Net after one AdamW step, and the state get_state_dict gives (keyed by FQN)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = Net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.embed(torch.tensor([1, 2, 3])).sum().backward()
    for layer in model.layers:
        layer(torch.ones(4)).sum().backward()
    model.norm(torch.ones(4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, optimizer, model_sd, optim_sd


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (checkpoint dir, the model's own state dict)."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("structures")
    model, optimizer, model_sd, optim_sd = trained()
    student, _, student_sd, _ = trained(seed=1)
    layouts = {
        "recipe": {"app": {"model": model_sd, "optim": optim_sd}},
        "plain": dict(model.state_dict()),
        "composer": {"state": {"model": model_sd, "optimizers": {"AdamW": optim_sd}, "timestamp": {"step": 1}},
                     "rng": {"torch": torch.get_rng_state()}},
        "weights_opt": {"weights": model_sd, "opt": optim_sd},
        "ids": {"model": model_sd, "optim": optimizer.state_dict()},
        "two_models": {"student": student_sd, "teacher": model_sd},
    }
    out = {}
    for name, state in layouts.items():
        dcp.save(state, checkpoint_id=str(root / name), no_dist=True)
        out[name] = root / name
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}, student_sd


def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("name, prefix, selected", [
    ("recipe", "app.model", "optimizer-state"),
    ("plain", "", "module-tree"),
    ("composer", "state.model", "optimizer-state"),
    ("weights_opt", "weights", "optimizer-state"),
    ("ids", "model", "module-tree"),
])
def test_the_model_is_found_where_the_structure_puts_it(saved, name, prefix, selected):
    from ckpttool.model.model_view import find_model
    from ckpttool.readers import open_checkpoint

    view = find_model(open_checkpoint(saved[0][name]))
    assert (view.prefix, view.selected) == (prefix, selected), view.reason
    assert sorted(view.keys.values()) == sorted(saved[1])


@pytest.mark.parametrize("name", ["recipe", "plain", "composer", "weights_opt", "ids"])
def test_consolidate_with_no_flags_writes_the_models_own_state_dict(cli, saved, tmp_path, name):
    checkpoints, expected, _ = saved
    result = cli("consolidate", checkpoints[name], tmp_path / "out.safetensors", "-q")
    assert result.exit_code == 0, result.output
    written = load_safetensors(tmp_path / "out.safetensors")
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(written[key], tensor, key)


@pytest.mark.parametrize("name", ["recipe", "plain", "composer"])
def test_inspect_counts_the_models_parameters_and_says_where_it_found_them(cli, saved, name):
    checkpoints, expected, _ = saved
    document = json.loads(cli("inspect", checkpoints[name], "--json").output)
    assert document["summary"]["parameters"] == sum(t.numel() for t in expected.values())
    assert document["model_view"]["selected"] in ("optimizer-state", "module-tree")
    text = cli("inspect", checkpoints[name]).output
    assert "model: " in text and document["model_view"]["selected"] in text


def test_two_equally_plausible_models_exit_2_naming_both_and_model_prefix_picks_one(cli, saved, tmp_path):
    checkpoints, expected, student = saved
    result = cli("consolidate", checkpoints["two_models"], tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert "'student'" in result.output and "'teacher'" in result.output and "--model-prefix" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out.safetensors").exists()
    result = cli("consolidate", checkpoints["two_models"], tmp_path / "out.safetensors", "--model-prefix", "student", "-q")
    assert result.exit_code == 0, result.output
    written = load_safetensors(tmp_path / "out.safetensors")
    for key, tensor in student.items():
        assert_same_bytes(written[key], tensor, key)


def test_model_prefix_overrides_the_detection_and_the_empty_prefix_is_the_top_level(cli, saved, tmp_path):
    checkpoints, expected, _ = saved
    result = cli("consolidate", checkpoints["recipe"], tmp_path / "optim.safetensors", "--model-prefix",
                 "app.optim.state.embed.weight", "-q")
    assert result.exit_code == 0, result.output
    assert sorted(load_safetensors(tmp_path / "optim.safetensors")) == ["exp_avg", "exp_avg_sq", "step"]
    document = json.loads(cli("inspect", checkpoints["plain"], "--json", "--model-prefix", "").output)
    assert document["model_view"]["selected"] == "option" and document["model_view"]["prefix"] == ""


def test_diff_of_a_checkpoint_and_its_consolidation_compares_the_model_views(cli, saved, tmp_path):
    checkpoints, expected, _ = saved
    out = tmp_path / "model.safetensors"
    assert cli("consolidate", checkpoints["recipe"], out, "-q").exit_code == 0
    result = cli("diff", checkpoints["recipe"], out, "-q")
    assert result.exit_code == 0, result.output
    assert "compared the model views" in result.output and "A's under app.model." in result.output
    assert cli("diff", checkpoints["recipe"], out, "-q", "--exact-names").exit_code == 1

    # one ulp of one element: DIFFERENT, naming the tensor
    from safetensors.torch import save_file

    tensors = load_safetensors(out)
    bits = tensors["layers.1.bias"].view(torch.int32)
    bits[2] += 1
    save_file(tensors, str(out), metadata={"format": "pt"})
    result = cli("diff", checkpoints["recipe"], out, "-q")
    assert result.exit_code == 1
    assert "differs: layers.1.bias: 1 of 4 elements (first at [2])" in result.output


def test_reshard_then_consolidate_round_trips_and_shards_the_parameters_the_optimizer_names(cli, saved, tmp_path):
    checkpoints, expected, _ = saved
    result = cli("reshard", checkpoints["recipe"], tmp_path / "w3", "--world", "3", "--json", "-q")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["rule"] == "optimizer-state" and document["model_view"]["prefix"] == "app.model"
    sharded = {t["fqn"] for t in document["tensors"] if t["sharded"]}
    assert "app.model.layers.0.weight" in sharded and "app.optim.state.layers.0.weight.exp_avg" in sharded
    assert "app.model.scale" not in sharded  # a buffer: no optimizer state names it
    assert cli("consolidate", tmp_path / "w3", tmp_path / "out.safetensors", "-q").exit_code == 0
    written = load_safetensors(tmp_path / "out.safetensors")
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(written[key], tensor, key)
