"""Megatron-DeepSpeed's own save (`megatron.checkpointing.save_checkpoint`, Megatron's path:
`iter_N/mp_rank_TT/model_optim_rng.pt`), written by its GPTModel at tensor parallel 2 on 2 gloo
ranks (fixtures/frameworks/generate_megatron_deepspeed.py: microsoft/Megatron-DeepSpeed 6acc370a,
Llama-style: GQA 4 heads / 2 groups, SwiGLU, RMSNorm, rotary, untied, no biases, 128 tokens); the
same model saved through DeepSpeed's engine (`deepspeed_engine/global_step0/mp_rank_0T_model_states.pt`,
ZeRO-1); and a bfloat16 one at tensor parallel 2 x pipeline parallel 2 (`pipeline/`).

Its model is the legacy one (megatron/model/): a nested `language_model` state dict under the old
names (`language_model.encoder.layers.N.self_attention.query_key_value.weight`, ...). The
references are Megatron-DeepSpeed's own: reference/reference.safetensors holds the HF-named tensors its
converter (tools/hf2megads_weight_converter.py) makes of the live model, the logits of its
forward, and `megatron.<name>`, the whole tensors its `universal_checkpoint_info` tells
DeepSpeed's universal-checkpoint merge to make. No megatron or deepspeed is imported here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes
from megatron_rank_files import resave

MDS = FIXTURES / "frameworks" / "megatron_deepspeed"
RUN_DIR = MDS / "checkpoints"
ITERATION = RUN_DIR / "iter_0000002"
RANK_FILES = [f"mp_rank_{t:02d}/model_optim_rng.pt" for t in range(2)]
ENGINE = MDS / "deepspeed_engine"  # the same model saved through DeepSpeed's engine (--deepspeed, ZeRO-1)
PIPELINE = MDS / "pipeline"  # a bfloat16 model of its kind at tensor parallel 2 x pipeline parallel 2, Megatron's path
EXPECTED = json.loads((MDS / "expected.json").read_text())
NOT_WEIGHTS = ("logits", "input_ids")
MEGATRON_PREFIX = "megatron."  # the generator's merged Megatron-named tensors
# Megatron-DeepSpeed's forward (TP-partial sums gathered, its own rotary and softmax) and
# transformers' eager one add float32 in other orders: the megatron-deepspeed gpt family's tolerance
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    from safetensors.torch import load_file

    return load_file(MDS / "reference" / "reference.safetensors")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run):
    out = tmp_path_factory.mktemp("mds") / "hf"
    result = run("export", RUN_DIR, out)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_fixture_is_small_and_its_reference_is_the_one_the_generator_recorded(reference):
    # pipeline_engine/ (tests/test_megatron_deepspeed_pipeline.py) is under 1 MB on its own
    assert sum(p.stat().st_size for p in MDS.rglob("*") if p.is_file() and "pipeline_engine" not in p.parts) < 1_000_000
    assert sorted(EXPECTED["tensors"]) == sorted(reference)
    assert EXPECTED["versions"]["megatron-deepspeed"] == "6acc370a41440098031227e881bd9f1f23aa369e"


@pytest.mark.parametrize("source", [RUN_DIR, ITERATION], ids=["run-folder", "iter-folder"])
def test_inspect_finds_the_save_by_structure_and_names_its_family(run, source):
    document = json.loads(run("inspect", source, "--json").stdout)
    assert document["layout"] == "megatron-legacy"
    assert Path(document["path"]).name == "iter_0000002"
    assert document["groups"]["model"]["tensors"] == 15
    text = run("inspect", source).output
    assert "megatron-deepspeed gpt's" in text and "LlamaForCausalLM" in text


def test_the_tensor_parallel_parts_merge_as_megatron_deepspeeds_universal_checkpoint_info_says(run, tmp_path, reference):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert run("consolidate", RUN_DIR, out, "--quiet").exit_code == 0
    consolidated = load_file(out)
    expected = {name.removeprefix(MEGATRON_PREFIX): tensor for name, tensor in reference.items()
                if name.startswith(MEGATRON_PREFIX)}
    assert sorted(consolidated) == sorted(expected) and len(expected) == 15
    for name, tensor in expected.items():
        assert_same_bytes(consolidated[name], tensor, name)


def test_export_equals_megatron_deepspeeds_converter_byte_for_byte(exported, reference):
    from safetensors.torch import load_file

    out, _ = exported
    weights = load_file(out / "model.safetensors")
    expected = {name: tensor for name, tensor in reference.items()
                if name not in NOT_WEIGHTS and not name.startswith(MEGATRON_PREFIX)}
    assert sorted(weights) == sorted(expected) and len(expected) == 21
    for name, tensor in expected.items():
        assert_same_bytes(weights[name], tensor, name)


def test_export_takes_config_json_from_megatron_deepspeeds_pickled_args(exported):
    out, output = exported
    assert f"config: {ITERATION / RANK_FILES[0]}: args" in output
    config = json.loads((out / "config.json").read_text())
    assert {name: config[name] for name in (
        "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size",
        "attention_bias", "mlp_bias")} == {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000,
        "tie_word_embeddings": False, "vocab_size": 128, "attention_bias": False, "mlp_bias": False}


def test_transformers_loads_the_export_and_its_logits_match_megatron_deepspeeds_forward(exported, reference):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = exported
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(reference["input_ids"]).logits
    assert logits.shape == reference["logits"].shape == (1, 16, 128)
    assert float((logits - reference["logits"]).abs().max()) < LOGIT_TOLERANCE


def test_megatron_deepspeeds_argument_names_become_megatron_lms():
    from ckpttool.readers.megatron_legacy import megatron_lm_arguments

    saved = {"use_rotary_position_embeddings": True, "add_position_embedding": False, "normalization": "rmsnorm",
             "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000, "apply_layernorm_1p": False,
             "num_experts": [1], "moe_expert_parallel_size": 1}
    named = megatron_lm_arguments(saved, "f")
    assert {name: named[name] for name in ("position_embedding_type", "normalization", "num_query_groups",
                                           "group_query_attention", "rotary_base", "num_experts")} == {
        "position_embedding_type": "rope", "normalization": "RMSNorm", "num_query_groups": 2,
        "group_query_attention": True, "rotary_base": 10000, "num_experts": None}
    assert megatron_lm_arguments({**saved, "num_experts": [8]}, "f")["num_experts"] == [8]  # refused as MoE
    megatron_lm = {"position_embedding_type": "rope", "normalization": "RMSNorm"}  # Megatron-LM's own: as they are
    assert megatron_lm_arguments(megatron_lm, "f") is megatron_lm


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, copy)
    return copy


def test_a_save_from_the_fpdt_change_on_is_refused_in_one_line_writing_nothing(run, tmp_path):
    copy = _copy(tmp_path)
    for name in RANK_FILES:  # Megatron-DeepSpeed from 676a482c on saves --ds-sequence-parallel-fpdt
        resave(copy / "iter_0000002" / name, lambda state: setattr(state["args"], "ds_sequence_parallel_fpdt", False))
    out = tmp_path / "hf"
    result = run("export", copy, out)
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert "676a482c" in result.output and "[q | k | v] thirds" in result.output, result.output
    assert not out.exists()


def test_a_moe_save_is_refused_by_name(run, tmp_path):
    copy = _copy(tmp_path)
    for name in RANK_FILES:
        resave(copy / "iter_0000002" / name, lambda state: setattr(state["args"], "num_experts", [4]))
    result = run("inspect", copy)
    assert result.exit_code == 1 and "mixture-of-experts" in result.output, result.output


def test_a_missing_rank_file_is_refused_naming_it(run, tmp_path):
    copy = _copy(tmp_path)
    (copy / "iter_0000002" / RANK_FILES[1]).unlink()
    (copy / "iter_0000002" / RANK_FILES[1]).parent.rmdir()
    out = tmp_path / "hf"
    result = run("export", copy, out)
    assert result.exit_code == 1 and "mp_rank_01/model_optim_rng.pt: missing" in result.output, result.output
    assert not out.exists()



# -- the same model saved through DeepSpeed's engine (--deepspeed): global_step0/mp_rank_0T_model_states.pt ----

@pytest.mark.parametrize("source", [ENGINE, ENGINE / "global_step0"], ids=["run-folder", "tag-folder"])
def test_the_deepspeed_engine_save_is_read_by_its_mp_rank_files_and_exports_the_same_bytes(run, source, tmp_path, exported):
    document = json.loads(run("inspect", source, "--json").stdout)
    assert (document["layout"], Path(document["path"]).name) == ("megatron-legacy", "global_step0")
    out = tmp_path / "hf"
    result = run("export", source, out)
    assert result.exit_code == 0, result.output
    assert f"config: {ENGINE / 'global_step0' / 'mp_rank_00_model_states.pt'}: args" in result.output
    megatron_path, _ = exported  # Megatron's own save of the same model: the converter's bytes
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (megatron_path / name).read_bytes(), name


def test_the_deepspeed_engine_save_consolidates_as_its_universal_checkpoint_info_says(run, tmp_path, reference):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert run("consolidate", ENGINE, out, "--quiet").exit_code == 0
    consolidated = load_file(out)
    expected = {name.removeprefix(MEGATRON_PREFIX): tensor for name, tensor in reference.items()
                if name.startswith(MEGATRON_PREFIX)}
    assert sorted(consolidated) == sorted(expected)
    for name, tensor in expected.items():
        assert_same_bytes(consolidated[name], tensor, name)


def test_the_zero_optimizer_files_beside_the_engine_save_are_refused_by_name_for_migration(run, tmp_path):
    out = tmp_path / "fsdp"
    result = run("reshard", ENGINE, out, "--to", "transformers", "--world", "2")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "zero_pp_rank_D_mp_rank_TT_optim_states.pt files, which this build does not read" in result.output
    assert not out.exists()


def test_a_deepspeed_engine_save_without_megatrons_args_is_refused_in_one_line(run, tmp_path):
    copy = tmp_path / "global_step0"
    shutil.copytree(ENGINE / "global_step0", copy)
    for rank in range(2):
        resave(copy / f"mp_rank_{rank:02d}_model_states.pt", lambda state: state.pop("args"))
    result = run("inspect", copy)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "without Megatron's `args`" in result.output and "ds_to_universal" in result.output, result.output


# -- tensor parallel 2 x pipeline parallel 2, bfloat16 (Megatron's own path, world 4) -----------------------

def test_the_pipeline_stages_are_renumbered_and_merge_as_universal_checkpoint_info_says(run, tmp_path):
    from safetensors.torch import load_file

    reference = load_file(PIPELINE / "reference" / "reference.safetensors")
    out = tmp_path / "model.safetensors"
    assert run("consolidate", PIPELINE / "checkpoints", out, "--quiet").exit_code == 0
    consolidated = load_file(out)
    expected = {name.removeprefix(MEGATRON_PREFIX): tensor for name, tensor in reference.items()
                if name.startswith(MEGATRON_PREFIX)}
    assert sorted(consolidated) == sorted(expected) and len(expected) == 15
    assert "language_model.encoder.layers.1.self_attention.query_key_value.weight" in expected  # stage 1's layer 0
    for name, tensor in expected.items():
        assert_same_bytes(consolidated[name], tensor, name)


def test_the_pipeline_save_exports_as_megatron_deepspeeds_converter_does(run, tmp_path):
    from safetensors.torch import load_file

    reference = load_file(PIPELINE / "reference" / "reference.safetensors")
    out = tmp_path / "hf"
    result = run("export", PIPELINE / "checkpoints", out)
    assert result.exit_code == 0, result.output
    weights = load_file(out / "model.safetensors")
    expected = {name: tensor for name, tensor in reference.items() if not name.startswith(MEGATRON_PREFIX)}
    assert sorted(weights) == sorted(expected) and len(expected) == 21
    for name, tensor in expected.items():
        assert_same_bytes(weights[name], tensor, name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_diff_finds_the_two_saves_of_one_model_identical(run):
    result = run("diff", RUN_DIR, ENGINE)
    assert result.exit_code == 0 and result.output.startswith(f"IDENTICAL: {RUN_DIR} and {ENGINE}: 15 tensors"), result.output
