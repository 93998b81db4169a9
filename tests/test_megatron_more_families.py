"""Megatron-Core families beyond Llama and Qwen3 (issue 48 item 4): Mixtral, Qwen2 with q/k/v
biases and DeepSeek-V3 (multi-latent attention, shared experts, the router's expert bias, a
multi-token-prediction layer), each a `torch_dist` checkpoint that megatron-core 0.16.1's own
GPTModel and `dist_checkpointing.save` wrote on 2 gloo ranks from Megatron-LM's own arguments
(fixtures/frameworks/generate_megatron_more_families.py: mixtral_ep2 at expert parallel 2,
qwen2_tp2 at tensor parallel 2, deepseek_v3_ep2 at expert parallel 2).

The references were written by the frameworks, and no megatron is imported here:
- hf/model.safetensors: Megatron-Bridge 0.3.1's own mapping of the weights (its Qwen2Bridge; its
  DeepSeekV3Bridge, with its Qwen3-MoE SequentialMLP expert mappings, the MTP layer mapped as the
  decoder layer it is; for Mixtral, which has no bridge there, its Qwen3MoEBridge mapping renamed
  to Mixtral's names): export, from the given config.json or from Megatron-LM's arguments in
  common.pt, writes exactly those bytes;
- logits.safetensors: Megatron's forward; transformers loads the export with nothing missing
  (and only DeepSeek's MTP layer, which it does not build, unexpected) and its logits match within
  the tolerance the family states (1e-4: the same bytes, float32 sums in other orders);
- expected.json: what Megatron's own `dist_checkpointing.load` put in a fresh model, gathered by
  Megatron's sharding metadata: consolidate writes those bytes (sha256).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import FIXTURES, assert_same_bytes, tensor_bytes

from ckpttool import naming
from ckpttool.core.errors import UnsupportedFormat
from ckpttool.naming.megatron_config import common_file, hf_config, megatron_hf_config, read_args

MORE = FIXTURES / "frameworks" / "megatron_more_families"
# listed, not globbed: a fixture that went missing fails (test_every_fixture_is_on_disk), never skips
CASES = ["mixtral_ep2", "qwen2_tp2", "deepseek_v3_ep2"]
FAMILY = {"mixtral_ep2": "megatron mixtral", "qwen2_tp2": "megatron gpt", "deepseek_v3_ep2": "megatron deepseek_v3"}
SOURCES = ["assets", "args"]  # export's config.json: the reference's (--assets), or from common.pt's arguments


def run_dir(name: str):
    return MORE / name / "checkpoints"


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


def written(target) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("more_families")
    out = {}
    for name in CASES:
        for source in SOURCES:
            target = root / f"{name}-{source}"
            assets = ("--assets", MORE / name / "hf") if source == "assets" else ()
            out[name, source] = (target, run("export", run_dir(name), target, *assets))
    return out


def test_every_fixture_is_on_disk():
    paths = [MORE / name / file for name in CASES for file in (
        "hf/config.json", "hf/model.safetensors", "checkpoints/latest_checkpointed_iteration.txt", "expected.json",
        "logits.safetensors", "inputs.json")]
    assert [str(path) for path in paths if not path.exists()] == []


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", CASES)
def test_export_equals_megatron_bridges_mapping_byte_for_byte(exports, name, source):
    from safetensors.torch import load_file

    target, result = exports[name, source]
    assert result.exit_code == 0, result.output
    assert f"converted {FAMILY[name]} names" in result.output, result.output
    mine, expected = written(target), load_file(str(MORE / name / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(mine[key], tensor, key)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", CASES)
def test_transformers_loads_the_export_with_megatrons_logits(exports, name, source):
    """Nothing missing or mismatched; only DeepSeek's MTP layer (layer num_hidden_layers, which
    transformers does not build) is unexpected. The tolerance is the one the family states for
    the architecture (`Architecture.logit_tolerance`)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    target, result = exports[name, source]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    config = json.loads((target / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    unexpected = [key for key in info["unexpected_keys"] if not (config.get("num_nextn_predict_layers") and key.startswith(mtp))]
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
    ids = json.loads((MORE / name / "inputs.json").read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    (reference,) = load_file(str(MORE / name / "logits.safetensors")).values()
    (architecture_name,) = config["architectures"]
    architecture = naming.family(FAMILY[name]).architecture(architecture_name)
    assert architecture is not None and architecture.logit_tolerance is not None
    assert float((logits - reference).abs().max()) < architecture.logit_tolerance


@pytest.mark.parametrize("name", CASES)
def test_consolidate_writes_what_megatrons_own_load_gives(run, tmp_path, name):
    """Megatron's names (the layer axis taken apart, the experts stacked as torch_dist stores
    them, DeepSeek's MTP layer as `mtp.layers.0.*`), shapes, dtypes and bytes."""
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", run_dir(name), out, "--quiet")
    assert result.exit_code == 0, result.output
    expected = json.loads((MORE / name / "expected.json").read_text())["tensors"]
    assert {key: describe(value) for key, value in load_file(out).items()} == expected


# What Megatron-Bridge writes beyond the transformers config class's own fields (see
# tests/test_megatron_config.py; for Qwen2 also `attention_bias`: transformers' Qwen2 always has
# q/k/v biases and no such field): only fields the class does not have are excused.
BRIDGE_ONLY = {"aux_loss_alpha", "hidden_dropout", "scoring_func", "use_qk_norm", "n_routed_experts",
               "num_experts_per_tok", "mlp_bias", "attention_bias"}


@pytest.mark.parametrize("name", CASES)
def test_the_config_from_common_pt_agrees_with_the_references_on_every_field_transformers_has(name):
    from transformers import AutoConfig

    ours = AutoConfig.for_model(**megatron_hf_config(common_file(run_dir(name))))
    reference = AutoConfig.for_model(**json.loads((MORE / name / "hf" / "config.json").read_text()))
    assert type(ours) is type(reference)
    fields = AutoConfig.for_model(ours.model_type).to_dict()
    mine, theirs = ours.to_dict(), reference.to_dict()
    differing = {key for key in mine.keys() | theirs.keys() if mine.get(key, "absent") != theirs.get(key, "absent")}
    assert differing <= BRIDGE_ONLY - fields.keys(), {key: (mine.get(key), theirs.get(key)) for key in differing}


@pytest.mark.parametrize("name", CASES)
def test_diff_of_the_checkpoint_against_its_export_says_identical(exports, cli, name):
    target, result = exports[name, "args"]
    assert result.exit_code == 0, result.output
    compared = cli("diff", run_dir(name), target, "--assets", MORE / name / "hf")
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output
    compared = cli("diff", run_dir(name), target)  # without --assets: common.pt's args, as export reads them
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3: what its table states, without files


def test_deepseeks_mtp_layer_is_numbered_after_the_main_layers():
    """Megatron's `mtp.layers.M` is transformers' layer `num_hidden_layers + M`, as DeepSeek-V3's
    Hub checkpoint (layer 61 of 61 main layers) and torchtitan's table number it; the main layers
    are counted from Megatron's `decoder.layers.N.` keys."""
    family = naming.family("megatron deepseek_v3")
    keys = [f"decoder.layers.{n}.input_layernorm.weight" for n in range(61)]
    assert naming.main_layer_count(keys) == 61
    assert naming.hf_names(family, "mtp.layers.0.enorm.weight", (32,), 61) == ("model.layers.61.enorm.weight",)
    assert naming.hf_names(family, "mtp.layers.0.final_layernorm.weight", (32,), 61) == (
        "model.layers.61.shared_head.norm.weight",)
    assert naming.hf_names(family, "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight",
                           (20, 32), 61) == ("model.layers.61.self_attn.kv_a_proj_with_mqa.weight",)
    assert naming.hf_names(family, "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight",
                           (2, 32, 16), 61) == ("model.layers.61.mlp.experts.0.down_proj.weight",
                                                "model.layers.61.mlp.experts.1.down_proj.weight")


def test_deepseeks_router_expert_bias_is_written_not_left_out(exports):
    """DeepSeek-V3's router adds `e_score_correction_bias` to its scores as Megatron's adds its
    expert bias: the fixture's is not zero, and it is exported (also for the MTP layer)."""
    target, result = exports["deepseek_v3_ep2", "args"]
    assert result.exit_code == 0, result.output
    tensors = written(target)
    for layer in (1, 2):
        assert tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].count_nonzero() == 4


def test_the_family_is_found_by_its_mla_names(run):
    document = json.loads(run("inspect", run_dir("deepseek_v3_ep2"), "--json").stdout)
    assert document["family"] == {"name": "megatron deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                  "named_by": {"architecture": "DeepseekV3ForCausalLM",
                                               "config": "common.pt's Megatron-LM arguments"}}
    assert naming.candidates(["embedding.word_embeddings.weight",
                              "decoder.layers.0.self_attention.linear_kv_down_proj.weight"]) == ["megatron deepseek_v3"]


@pytest.mark.parametrize("change, named", [
    ({"rope_type": None}, "rope_type=None"),  # Megatron's MLA default: yarn
    ({"rope_type": "yarn"}, "rope_type='yarn'"),
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function='softmax'"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    ({"qk_layernorm": False}, "qk_layernorm=False"),
    ({"moe_layer_freq": [1, 0]}, "moe_layer_freq=[1, 0]"),
    ({"moe_shared_expert_intermediate_size": 24}, "moe_shared_expert_intermediate_size=24"),
    ({"num_experts": None}, "without num_experts"),
    ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size=0"),
    ({"moe_router_topk": 3}, "moe_router_topk=3, moe_router_group_topk=1"),  # groups ranked by top 3, not 2
    ({"rotary_interleaved": True}, "rotary_interleaved=True"),
])
def test_mla_arguments_deepseek_v3_cannot_state_are_refused_naming_the_argument(change, named):
    args = read_args(common_file(run_dir("deepseek_v3_ep2")))
    with pytest.raises(UnsupportedFormat, match="--assets") as raised:
        hf_config({**args, **change}, "common.pt")
    assert named in str(raised.value)


@pytest.mark.parametrize("name, family, architecture", [
    ("mixtral_ep2", "megatron mixtral", "MixtralForCausalLM"),  # the same names as Qwen-MoE's: its arguments choose
    ("qwen2_tp2", "megatron gpt", "Qwen2ForCausalLM"),
])
def test_inspect_names_the_family_its_megatron_arguments_choose(run, name, family, architecture):
    result = run("inspect", run_dir(name))
    assert f"names: {family}'s, not transformers'; `ckpttool export` writes them as {architecture} names (the config: common.pt's Megatron-LM arguments" in result.stdout
    document = json.loads(run("inspect", run_dir(name), "--json").stdout)
    assert (document["family"]["name"], document["family"]["named_by"]["architecture"]) == (family, architecture)


def test_mixtral_and_qwen2_are_what_their_arguments_choose():
    assert megatron_hf_config(common_file(run_dir("mixtral_ep2")))["architectures"] == ["MixtralForCausalLM"]
    assert megatron_hf_config(common_file(run_dir("qwen2_tp2")))["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("name", CASES)
def test_load_into_a_transformers_model_straight_from_megatrons_checkpoint(name):
    """`load_into` fills transformers' own modules (Mixtral's and DeepSeek-V3's fused experts
    one expert's part at a time) with the bytes transformers itself loads from Megatron-Bridge's
    export; DeepSeek's MTP layer, which the model does not build, is what is left over (refused
    unless strict=False, as load_state_dict refuses keys the module lacks)."""
    import transformers

    import ckpttool

    assets = MORE / name / "hf"
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(assets))
    missing, unexpected = ckpttool.load_into(model, run_dir(name), assets=assets, strict=name != "deepseek_v3_ep2")
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    assert missing == [] and all(key.startswith(mtp) for key in unexpected), (missing, unexpected)
    assert bool(unexpected) == (name == "deepseek_v3_ep2")
    reference = transformers.AutoModelForCausalLM.from_pretrained(assets)
    expected = reference.state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for key, value in model.state_dict().items():
        assert_same_bytes(value, expected[key], key)
