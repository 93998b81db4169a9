"""Megatron-DeepSpeed's pipeline-parallel save: its GPTModelPipe at tensor parallel 2 x pipeline
parallel 2 (world 4, gloo, CPU) saved by DeepSpeed's pipeline engine through Megatron-DeepSpeed's
`save_checkpoint` (fixtures/frameworks/generate_megatron_deepspeed.py `run_pipeline_engine`:
microsoft/Megatron-DeepSpeed 6acc370a, deepspeed 0.19.8; the Llama-style model of
tests/test_megatron_deepspeed.py, fp32).

The tag folder `global_step0/` holds `layer_XX-model_TT-model_states.pt` per GPTModelPipe layer
index (1 the embedding, 2-3 the transformer layers, 4 the final norm, 5 LMHeadPipe) and
tensor-parallel rank, each the layer module's state dict under its own names, beside DeepSpeed's
`mp_rank_0M_model_states.pt` (`module` None, Megatron-DeepSpeed's args) and ZeRO's optimizer
files. reference/reference.safetensors holds the HF-named tensors of Megatron-DeepSpeed's converter
run on the GPTModelPipe it converts, the logits of the pipeline's forward (stage 0's layers, its
hidden states sent to stage 1's), and `megatron.<GPTModel name>`: each parameter's ranks merged as
its universal_checkpoint_info says. No megatron or deepspeed is imported here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes

ENGINE = FIXTURES / "frameworks" / "megatron_deepspeed" / "pipeline_engine"
RUN_DIR = ENGINE / "checkpoints"
TAG = RUN_DIR / "global_step0"
REFERENCE = ENGINE / "reference" / "reference.safetensors"
EXPECTED = json.loads((ENGINE / "expected.json").read_text())
NOT_WEIGHTS = ("logits", "input_ids")
MEGATRON_PREFIX = "megatron."
# the megatron-deepspeed gpt family's tolerance (naming/families/megatron_legacy_gpt.py): Megatron-DeepSpeed's
# forward (tensor-parallel partial sums gathered, its own rotary and softmax) and transformers' eager one
# add float32 in other orders
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    from safetensors.torch import load_file

    return load_file(REFERENCE)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run):
    out = tmp_path_factory.mktemp("mds_pipe") / "hf"
    result = run("export", RUN_DIR, out)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_fixture_is_small_and_holds_the_pipeline_engines_files(reference):
    assert sum(p.stat().st_size for p in ENGINE.rglob("*") if p.is_file()) < 1_000_000
    assert sorted(EXPECTED["tensors"]) == sorted(reference)
    layers = sorted(p.name for p in TAG.glob("layer_*"))
    assert layers == [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(1, 6) for t in range(2)]
    assert sorted(p.name for p in TAG.glob("mp_rank_*")) == [f"mp_rank_{m:02d}_model_states.pt" for m in range(4)]


@pytest.mark.parametrize("source", [RUN_DIR, TAG], ids=["run-folder", "tag-folder"])
def test_inspect_finds_the_pipeline_save_by_its_layer_files_and_names_its_family(run, source):
    document = json.loads(run("inspect", source, "--json").stdout)
    assert (document["layout"], Path(document["path"]).name) == ("megatron-legacy", "global_step0")
    assert document["groups"]["model"]["tensors"] == 15
    files = {chunk["file"] for tensor in document["tensors"] for chunk in tensor["chunks"]}
    assert files == {p.name for p in TAG.glob("layer_*")} - {"layer_04-model_01-model_states.pt"}  # norms: rank 0's
    assert "megatron-deepspeed gpt's" in run("inspect", source).output


def test_layer_indices_map_to_gptmodels_names_as_the_converter_numbers_them():
    from ckpttool.readers.megatron_deepspeed_pipe import global_name, spec_of

    assert [spec_of(index, num_layers=2) for index in range(7)] == [
        None, ("embedding", None), ("layer", 0), ("layer", 1), ("final_norm", None), ("head", None), None]
    assert global_name(1, "word_embeddings.weight", 2) == "language_model.embedding.word_embeddings.weight"
    assert global_name(3, "mlp.dense_4h_to_h.weight", 2) == "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"
    assert global_name(4, "weight", 2) == "language_model.encoder.final_layernorm.weight"
    assert global_name(5, "lm_head.weight", 2) == "language_model.output_layer.weight"
    assert global_name(5, "lm_head.bias", 2) is None


def test_export_equals_megatron_deepspeeds_converter_on_gptmodelpipe_byte_for_byte(exported, reference):
    from safetensors.torch import load_file

    out, output = exported
    assert f"config: {TAG / 'mp_rank_00_model_states.pt'}: args" in output
    weights = load_file(out / "model.safetensors")
    expected = {name: tensor for name, tensor in reference.items()
                if name not in NOT_WEIGHTS and not name.startswith(MEGATRON_PREFIX)}
    assert sorted(weights) == sorted(expected) and len(expected) == 21
    for name, tensor in expected.items():
        assert_same_bytes(weights[name], tensor, name)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["vocab_size"], config["num_key_value_heads"]) == (
        ["LlamaForCausalLM"], 2, 128, 2)


def test_transformers_loads_the_export_and_its_logits_match_the_pipelines_forward(exported, reference):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = exported
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(reference["input_ids"]).logits
    assert logits.shape == reference["logits"].shape == (1, 16, 128)
    assert float((logits - reference["logits"]).abs().max()) < LOGIT_TOLERANCE


def test_consolidate_gives_gptmodels_tensors_merged_as_universal_checkpoint_info_says(run, tmp_path, reference):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert run("consolidate", RUN_DIR, out, "--quiet").exit_code == 0
    consolidated = load_file(out)
    expected = {name.removeprefix(MEGATRON_PREFIX): tensor for name, tensor in reference.items()
                if name.startswith(MEGATRON_PREFIX)}
    assert sorted(consolidated) == sorted(expected) and len(expected) == 15
    for name, tensor in expected.items():
        assert_same_bytes(consolidated[name], tensor, name)


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "global_step0"
    shutil.copytree(TAG, copy)
    return copy


def _refused(run, copy: Path, tmp_path: Path) -> str:
    out = tmp_path / "hf"
    result = run("export", copy, out)
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()
    return result.output


def test_a_missing_layer_file_is_refused_in_one_line_naming_it(run, tmp_path):
    copy = _copy(tmp_path)
    (copy / "layer_03-model_01-model_states.pt").unlink()
    output = _refused(run, copy, tmp_path)
    assert "layer_03-model_01-model_states.pt: missing: layer 3 of tensor-parallel rank 1" in output, output


def test_a_layer_file_of_a_wider_tensor_parallel_save_left_beside_is_refused_in_one_line(run, tmp_path):
    copy = _copy(tmp_path)
    shutil.copy(copy / "layer_02-model_01-model_states.pt", copy / "layer_02-model_02-model_states.pt")
    output = _refused(run, copy, tmp_path)
    assert "layer_02-model_02-model_states.pt: tensor-parallel rank 2, beyond the save's tensor parallel 2" in output


def test_a_layer_file_from_a_save_at_another_tensor_parallel_degree_is_refused_by_its_shapes(run, tmp_path):
    import torch

    copy = _copy(tmp_path)
    whole = {}  # layer 3 as a tensor parallel 1 save holds it: both ranks' parts in one file
    parts = [torch.load(copy / f"layer_03-model_{t:02d}-model_states.pt") for t in range(2)]
    for name, tensor in parts[0].items():
        dim = 1 if name.endswith(("dense.weight", "dense_4h_to_h.weight")) else 0
        whole[name] = tensor if tensor.dim() == 1 else torch.cat([part[name] for part in parts], dim=dim)
    torch.save(whole, copy / "layer_03-model_01-model_states.pt")
    output = _refused(run, copy, tmp_path)
    assert "layer_03-model_01-model_states.pt" in output and "tensor-parallel parts are equal in shape" in output, output


def test_the_zero_optimizer_files_are_refused_by_name_for_migration(run, tmp_path):
    out = tmp_path / "fsdp"
    result = run("reshard", RUN_DIR, out, "--to", "transformers", "--world", "2")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "pipeline engine keeps the optimizer state in ZeRO's" in result.output
    assert not out.exists()


def test_a_layer_file_naming_a_global_outside_the_allowlist_is_refused_in_one_line(run, tmp_path):
    import os

    import torch

    copy = _copy(tmp_path)
    layer = copy / "layer_02-model_00-model_states.pt"
    state = torch.load(layer)
    state["hook"] = os.getcwd  # pickled as a global reference; the checking loader must refuse, never call it
    torch.save(state, layer)
    output = _refused(run, copy, tmp_path)
    assert "layer_02-model_00-model_states.pt" in output and "getcwd" in output, output
