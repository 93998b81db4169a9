"""Megatron-Core `torch_dist` checkpoints with optimizer state, as Megatron-LM's save_checkpoint
writes them (generate_megatron_families.py): llama_tp2 after 2 Adam steps of a real Megatron
optimizer (`get_megatron_optimizer`, fp32, not distributed), its exp_avg and exp_avg_sq saved as
`optimizer.state.exp_avg.<model key>` sharded tensors beside the model, at world 2 (tensor
parallel 2). The moe fixture has none (see the generator's docstring). Export, diff --assets and
the bridge's conversion are tested in test_naming.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES

MEGATRON = FIXTURES / "frameworks" / "megatron_families"
TRAINED = ["llama_tp2"]  # fixtures saved with optimizer state
# Megatron's parameters (its stacked layer keys) that Adam updates, one exp_avg and one exp_avg_sq each
PARAMETERS = ["decoder.final_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
              "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
              "decoder.layers.self_attention.linear_proj.weight",
              "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
              "decoder.layers.self_attention.linear_qkv.weight", "embedding.word_embeddings.weight",
              "output_layer.weight"]
MOMENTS = sorted(f"optimizer.state.{moment}.{name}" for moment in ("exp_avg", "exp_avg_sq") for name in PARAMETERS)


def checkpoint(name: str):
    return MEGATRON / name / "checkpoints"


def inspected(run, path) -> dict:
    result = run("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("megatron-optimizer")
    return {name: (root / name, run("reshard", checkpoint(name), root / name, "--world", 1, "-q")) for name in TRAINED}


@pytest.mark.parametrize("name", TRAINED)
def test_inspect_lists_every_adam_moment_in_the_optimizer_group(run, name):
    document = inspected(run, checkpoint(name))
    assert document["layout"] == "megatron-torch-dist"
    groups = {tensor["fqn"]: tensor["group"] for tensor in document["tensors"]}
    assert sorted(fqn for fqn, group in groups.items() if group == "optimizer") == MOMENTS
    assert not [fqn for fqn, group in groups.items() if fqn.startswith("optimizer.") and group != "optimizer"]
    # two moments per parameter element, the parameters counted once (the model view's own count)
    assert document["groups"]["optimizer"]["numel"] == 2 * document["groups"]["model"]["numel"]


@pytest.mark.parametrize("name", TRAINED)
def test_validate_deep_passes(run, name):
    """Megatron-LM's rng_state holds numpy's RNG state (numpy arrays), which torch.load's
    weights_only mode refuses by default: decoded with exactly numpy's array globals admitted."""
    result = run("validate", "--deep", checkpoint(name))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", TRAINED)
def test_reshard_to_world_1_keeps_every_optimizer_tensor(run, resharded, name):
    target, result = resharded[name]
    assert result.exit_code == 0, result.output
    source = {t["fqn"]: (t["dtype"], t["shape"]) for t in inspected(run, checkpoint(name))["tensors"]
              if t["fqn"].startswith("optimizer.")}
    written = {t["fqn"]: (t["dtype"], t["shape"]) for t in inspected(run, target)["tensors"]
               if t["fqn"].startswith("optimizer.")}
    assert sorted(written) == MOMENTS and written == source


@pytest.mark.parametrize("name", TRAINED)
def test_diff_of_the_resharded_checkpoint_says_identical(run, resharded, name):
    """reshard carries common.pt and metadata.json (it stays a Megatron save), and the model
    view cuts its multi-layer slabs into layers again."""
    target, result = resharded[name]
    assert result.exit_code == 0, result.output
    compared = run("diff", checkpoint(name), target)
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output
