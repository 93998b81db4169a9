"""Megatron-Core `torch_dist` checkpoints with optimizer state, as Megatron-LM's save_checkpoint
writes them (generate_megatron_families.py), each after 2 Adam steps of a real Megatron optimizer
(`get_megatron_optimizer`, fp32, not distributed), exp_avg and exp_avg_sq saved as
`optimizer.state.exp_avg.<model key>` sharded tensors beside the model, at world 2:

- llama_tp2: tensor parallel 2;
- moe_ep2: Qwen3-MoE-style, expert parallel 2 (data parallel 2 for the dense part): experts 0-1
  in rank 0's files, 2-3 in rank 1's, the dense parameters (and their moments) once, from rank 0;
  the model view stitches each layer's experts from both ranks' files.

The tensor-parallel `moe` fixture has no optimizer (see the generator's docstring). Export, diff
--assets and the bridge's conversion are tested in test_naming.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, assert_same_bytes

MEGATRON = FIXTURES / "frameworks" / "megatron_families"
_DENSE = ["decoder.final_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
          "decoder.layers.self_attention.linear_proj.weight",
          "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
          "decoder.layers.self_attention.linear_qkv.weight", "embedding.word_embeddings.weight",
          "output_layer.weight"]
# fixtures saved with optimizer state -> Megatron's parameters (its stacked layer keys) that Adam
# updates, one exp_avg and one exp_avg_sq each
PARAMETERS = {
    "llama_tp2": [*_DENSE, "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight"],
    "moe_ep2": [*_DENSE, "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                "decoder.layers.mlp.experts.experts.linear_fc2.weight", "decoder.layers.mlp.router.weight",
                "decoder.layers.self_attention.k_layernorm.weight", "decoder.layers.self_attention.q_layernorm.weight"],
}
TRAINED = sorted(PARAMETERS)


def moments(name: str) -> list[str]:
    return sorted(f"optimizer.state.{moment}.{parameter}" for moment in ("exp_avg", "exp_avg_sq")
                  for parameter in PARAMETERS[name])


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
    assert sorted(fqn for fqn, group in groups.items() if group == "optimizer") == moments(name)
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
    assert sorted(written) == moments(name) and written == source


@pytest.mark.parametrize("name", TRAINED)
def test_diff_of_the_resharded_checkpoint_says_identical(run, resharded, name):
    """reshard carries common.pt and metadata.json (it stays a Megatron save), and the model
    view cuts its multi-layer slabs into layers again."""
    target, result = resharded[name]
    assert result.exit_code == 0, result.output
    compared = run("diff", checkpoint(name), target)
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output


@pytest.mark.parametrize("name", TRAINED)
def test_consolidate_of_the_save_and_of_its_reshard_are_byte_identical(run, resharded, tmp_path, name):
    """The model and the Adam moments, each written whole: every tensor of the world-2 save
    (an expert-parallel one stitched from both ranks' files) equals the world-1 reshard's."""
    from safetensors.torch import load_file

    target, result = resharded[name]
    assert result.exit_code == 0, result.output
    written = {}
    for label, source in (("save", checkpoint(name)), ("reshard", target)):
        out = tmp_path / f"{label}.safetensors"
        consolidated = run("consolidate", source, out, "--all", "--filter", "model.*", "--filter", "optimizer.state.*",
                           "-q")
        assert consolidated.exit_code == 0, consolidated.output
        written[label] = load_file(str(out))
    model = {t["fqn"] for t in inspected(run, checkpoint(name))["tensors"] if t["group"] == "model"}
    assert sorted(written["save"]) == sorted(written["reshard"]) == sorted(model | set(moments(name)))
    for key, tensor in written["save"].items():
        assert_same_bytes(written["reshard"][key], tensor, key)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process
@pytest.mark.parametrize("name", TRAINED)
def test_stock_dcp_load_of_the_save_gives_what_consolidate_writes(run, tmp_path, name):
    """A second opinion without megatron: torch's own `dcp.load` of every stored tensor (Megatron's
    keys, layers stacked) against consolidate's model (one tensor per layer) and moments."""
    import re

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration = next(checkpoint(name).glob("iter_*"))
    entries = FileSystemReader(iteration).read_metadata().state_dict_metadata
    state = {key: torch.full(tuple(entry.size), 7, dtype=entry.properties.dtype) for key, entry in entries.items()
             if isinstance(entry, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(iteration))
    out = tmp_path / "all.safetensors"
    result = run("consolidate", checkpoint(name), out, "--all", "--filter", "model.*", "--filter", "optimizer.state.*",
                 "-q")
    assert result.exit_code == 0, result.output
    written = load_file(str(out))
    stacked = re.compile(r"^(?P<prefix>decoder\.layers\.)(?P<rest>[^\d].*)$")
    for key, tensor in state.items():
        found = stacked.match(key)
        if key.startswith("optimizer.") or found is None:
            assert_same_bytes(written[key if key.startswith("optimizer.") else f"model.{key}"], tensor, key)
            continue
        for layer in range(tensor.shape[0]):
            assert_same_bytes(written[f"model.{found['prefix']}{layer}.{found['rest']}"], tensor[layer], key)
    assert len(written) == len(state) + sum(state[k].shape[0] - 1 for k in state if stacked.match(k))


@pytest.mark.parametrize("name, family", [("llama_tp2", "megatron gpt"), ("moe", "megatron qwen moe"),
                                          ("moe_ep2", "megatron qwen moe")])
def test_inspect_names_the_family_whose_table_takes_every_key(run, name, family):
    """Megatron's families share their names; without a config, inspect names the first whose
    rules take every key (an MoE's experts and router are not the dense table's)."""
    document = inspected(run, checkpoint(name))
    assert document["family"]["name"] == family
    names = {t["fqn"]: t["hf_names"] for t in document["tensors"] if t["group"] == "model"}
    assert all(names.values()), [fqn for fqn, hf in names.items() if not hf]
