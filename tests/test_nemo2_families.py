"""NeMo 2 checkpoints beyond Llama: run folders written by NeMo 2.7.3's own `llm.train`
(ModelCheckpoint and MegatronCheckpointIO) on CPU, one per model class NeMo names
(fixtures/frameworks/generate_nemo2_families.py):

- qwen3: `Qwen3Model(Qwen3Config)`, dense, q/k RMSNorm;
- qwen3_moe: `Qwen3Model(Qwen3MoEConfig)`, 4 experts, top 2, expert parallel 1;
- mixtral: `MixtralModel(MixtralConfig)`, 4 experts, top 2, expert parallel 1;
- qwen2: `Qwen2Model(Qwen2Config)`, q/k/v biases.

Each holds `checkpoints/<name>--...-step=3-consumed_samples=4.0-last/` (context/ beside weights/) and
`reference/`: NeMo's own HF export of that checkpoint (`llm.export_ckpt(..., target="hf")`), the
sha256 of every tensor of the model that exporter loaded (megatron's dist_checkpointing.load), and
that model's forward. No NeMo or megatron is imported here. The Llama class: tests/test_nemo2.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

from ckpttool.outputs.temps import TEMP_PREFIX

FAMILIES = FIXTURES / "frameworks" / "nemo2_families"
NEWEST = "model_name=0--val_loss=0.00-step=3-consumed_samples=4.0-last"
# name -> (the architecture model.yaml gives, ckpttool's naming family, model tensors in weights/, in the
# export, the vocabulary rows the export keeps). Each model has 384 rows (config.vocab_size) for a
# ByteLevelTokenizer of 256: NeMo's Qwen exporters keep every row, its Mixtral exporter cuts them to 256.
CASES = {
    "qwen3": ("Qwen3ForCausalLM", "megatron gpt", 19, 25, 384),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "megatron qwen moe", 21, 45, 384),
    "mixtral": ("MixtralForCausalLM", "megatron mixtral", 17, 41, 256),
    "qwen2": ("Qwen2ForCausalLM", "megatron gpt", 17, 27, 384),
}
# NeMo's forward (megatron-core's local spec) and transformers' eager models add float32 in other
# orders: the same logit tolerance as the Llama class and the megatron gpt family
LOGIT_TOLERANCE = 1e-4
# config.json keys NeMo's exporters write that ckpttool's does not, each a default or not the model's:
# bos/eos ids (HFQwen3Exporter's hard-coded 151643/151645, beyond this vocabulary; Mixtral's are
# transformers' 1/2); transformers' defaults save_pretrained writes (use_cache, rope_scaling,
# transformers_version, output_router_logits, router_jitter_noise); the Qwens' `sliding_window`, None
# with `use_sliding_window` false, so `layer_types` is all full attention and `max_window_layers` unused;
# HFMixtralExporter's `seq_length` (no transformers field); and the MoE load-balancing loss coefficient,
# a training setting (0.001 in both MoE exports: Qwen3's from moe_aux_loss_coeff, Mixtral's
# transformers' default, HFMixtralExporter not mapping MixtralConfig's 0.01). ckpttool's config.json
# adds torch_dtype and rope_parameters.
NOT_WRITTEN = {"bos_token_id", "eos_token_id", "use_cache", "rope_scaling", "transformers_version",
               "output_router_logits", "router_jitter_noise", "sliding_window", "layer_types", "max_window_layers",
               "seq_length", "router_aux_loss_coef"}


def run_dir(name: str) -> Path:
    return FAMILIES / name / "checkpoints"


def reference(name: str) -> Path:
    return FAMILIES / name / "reference"


def describe(tensor) -> dict:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run):
    """name -> `ckpttool export RUN_DIR OUT` without --assets: config.json from context/model.yaml."""
    outs = {}
    for name in CASES:
        out = tmp_path_factory.mktemp("nemo2_families") / name
        result = run("export", run_dir(name), out)
        assert result.exit_code == 0, result.output
        assert f"config: {run_dir(name) / NEWEST / 'context' / 'model.yaml'}" in result.output
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", sorted(CASES))
def test_inspect_names_the_architecture_nemos_model_yaml_gives(run, name):
    architecture, family, tensors, _, _ = CASES[name]
    result = run("inspect", run_dir(name), "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["layout"] == "nemo2"
    assert Path(document["path"]) == run_dir(name) / NEWEST / "weights"
    assert document["groups"]["model"]["tensors"] == tensors
    assert document["family"]["name"] == family
    assert document["family"]["named_by"] == {"architecture": architecture, "config": "NeMo's context/model.yaml"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_consolidate_equals_the_tensors_megatron_loaded_into_nemos_model(run, tmp_path, name):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", run_dir(name), out, "--quiet")
    assert result.exit_code == 0, result.output
    expected = json.loads((reference(name) / "expected.json").read_text())["tensors"]
    assert {key: describe(value) for key, value in load_file(out).items()} == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_equals_nemos_own_exporter_byte_for_byte(exported, name):
    from safetensors.torch import load_file

    ours = load_file(exported[name] / "model.safetensors")
    nemo = load_file(reference(name) / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(nemo) and len(ours) == CASES[name][3]
    assert ours["model.embed_tokens.weight"].shape[0] == ours["lm_head.weight"].shape[0] == CASES[name][4]
    assert {key: describe(value) for key, value in ours.items()} == {key: describe(value) for key, value in nemo.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_config_json_states_what_nemos_exporter_states(exported, name):
    ours = json.loads((exported[name] / "config.json").read_text())
    nemo = json.loads((reference(name) / "hf" / "config.json").read_text())
    assert ours["architectures"] == nemo["architectures"] == [CASES[name][0]]
    assert {key: ours[key] for key in nemo if key not in NOT_WRITTEN} == {
        key: value for key, value in nemo.items() if key not in NOT_WRITTEN}
    assert set(ours) - set(nemo) == {"torch_dtype", "rope_parameters"}
    assert nemo.get("sliding_window") is None and ours.get("sliding_window") is None
    assert ours["head_dim"] == 8 and ours["vocab_size"] == CASES[name][4]  # kv_channels; the rows kept


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_loads_in_transformers_and_its_logits_match_nemos_forward(exported, name):
    import torch
    from transformers import AutoModelForCausalLM

    recorded = json.loads((reference(name) / "logits.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(exported[name], output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    assert type(model).__name__ == CASES[name][0]
    with torch.no_grad():
        logits = model(torch.tensor(recorded["input_ids"])).logits
    nemo = torch.tensor(recorded["logits"], dtype=torch.float32)
    assert nemo.shape == (1, 12, 384) and logits.shape == (1, 12, CASES[name][4])
    assert float((logits - nemo[..., :CASES[name][4]]).abs().max()) < LOGIT_TOLERANCE


@pytest.mark.parametrize("name", sorted(CASES))
def test_diff_compares_the_run_with_nemos_export_under_transformers_names(run, name):
    result = run("diff", run_dir(name), reference(name) / "hf")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"IDENTICAL: {run_dir(name)} and {reference(name) / 'hf'}: "
                                    f"{CASES[name][3]} tensors"), result.output


# -- what the Qwen3 class's fields must give -----------------------------------------------------

def _edit(old: str, new: str):
    def edit(yaml_path: Path) -> None:
        text = yaml_path.read_text()
        assert text.count(old) == 1, old
        yaml_path.write_text(text.replace(old, new))
    return edit


# (fixture, the edit of its model.yaml, what the one line says)
REFUSED = {
    # Qwen3Model without q/k norms: the fields give a Llama, which NeMo's Qwen3 exporter would write
    # as a Qwen3 with q_norm/k_norm missing
    "qwen3-without-qk-norm": ("qwen3", _edit("  qk_layernorm: true\n", "  qk_layernorm: false\n"),
                              "the fields give LlamaForCausalLM, not Qwen3ForCausalLM or Qwen3MoeForCausalLM"),
    # a Qwen3 config class under the Llama model class: not one of LlamaModel's configs
    "qwen3-config-under-llama-model": (
        "qwen3", _edit("_target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Model\n",
                       "_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n"),
        "config._target_='nemo.collections.llm.gpt.model.qwen3.Qwen3Config': not a config class ckpttool reads "
        "for LlamaModel"),
    "moe-config-under-mixtral-model": (
        "qwen3_moe", _edit("_target_: nemo.collections.llm.gpt.model.qwen3.Qwen3Model\n",
                           "_target_: nemo.collections.llm.gpt.model.mixtral.MixtralModel\n"),
        "config._target_='nemo.collections.llm.gpt.model.qwen3.Qwen3MoEConfig': not a config class"),
    "mixtral-with-qk-norm": ("mixtral", _edit("  qk_layernorm: false\n", "  qk_layernorm: true\n"),
                             "the fields give Qwen3MoeForCausalLM, not MixtralForCausalLM"),
    "moe-other-activation": ("qwen3_moe", _edit("    _target_: torch.nn.functional.silu\n",
                                                "    _target_: torch.nn.functional.gelu\n"),
                             "config.activation_func="),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fields_the_model_class_cannot_have_exit_1_in_one_line_and_write_nothing(run, tmp_path, case):
    name, edit, message = REFUSED[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree(run_dir(name), copy)
    model_yaml = copy / NEWEST / "context" / "model.yaml"
    edit(model_yaml)
    out = tmp_path / "out"
    out.mkdir()
    result = run("export", copy, out / "hf")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert message in lines[0] and str(model_yaml) in lines[0], lines[0]
    assert list(out.iterdir()) == []
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


def test_the_moe_fields_map_to_transformers_qwen3_moe_config(exported):
    """num_moe_experts, moe_ffn_hidden_size, moe_router_topk (model.yaml) -> num_experts,
    moe_intermediate_size, num_experts_per_tok; softmax after top-k -> norm_topk_prob."""
    from ckpttool.naming.nemo_config import read_model_yaml

    model = read_model_yaml(run_dir("qwen3_moe") / NEWEST / "context" / "model.yaml")
    config = json.loads((exported["qwen3_moe"] / "config.json").read_text())
    nemo = model["config"]
    assert (nemo["num_moe_experts"], nemo["moe_ffn_hidden_size"], nemo["moe_router_topk"],
            nemo["moe_router_pre_softmax"]) == (4, 32, 2, False)
    assert (config["num_experts"], config["moe_intermediate_size"], config["num_experts_per_tok"],
            config["norm_topk_prob"], config["decoder_sparse_step"], config["mlp_only_layers"]) == (4, 32, 2, True, 1, [])


def test_mixtrals_fields_map_to_transformers_mixtral_config(exported):
    """MixtralConfig's own rms eps (1e-5) and rotary base (1e6), and its experts of ffn_hidden_size."""
    from ckpttool.naming.nemo_config import read_model_yaml

    nemo = read_model_yaml(run_dir("mixtral") / NEWEST / "context" / "model.yaml")["config"]
    config = json.loads((exported["mixtral"] / "config.json").read_text())
    assert (nemo["layernorm_epsilon"], nemo["rotary_base"], nemo["num_moe_experts"], nemo["ffn_hidden_size"]) == (
        1e-5, 1000000.0, 4, 32)
    assert (config["rms_norm_eps"], config["rope_theta"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (1e-5, 1000000.0, 4, 2, 32)


def test_the_vocabulary_rows_kept_are_the_model_classes_exporters_rule():
    """Llama and Mixtral: NeMo's exporter cuts the rows to the tokenizer's vocabulary; Qwen2 and
    Qwen3: it keeps the config's vocab_size, every row (and with it null, the tokenizer's rule)."""
    from ckpttool.naming.nemo_config import read_model_yaml, vocabulary

    path = Path("model.yaml")
    for name, kept in (("qwen3", 384), ("qwen3_moe", 384), ("mixtral", 256), ("qwen2", 384)):
        model = read_model_yaml(run_dir(name) / NEWEST / "context" / "model.yaml")
        found = vocabulary(model, path)
        assert (found.rows, found.size, found.padded) == (384, kept, kept < 384), name
    model = read_model_yaml(run_dir("qwen2") / NEWEST / "context" / "model.yaml")
    model["config"]["vocab_size"] = None  # the rows: the tokenizer's 300 padded to a multiple of 128 x TP 1
    model["tokenizer"]["vocab_size"] = 300
    found = vocabulary(model, path)
    assert (found.rows, found.size) == (384, 300)
