"""LoRA fine-tunes: `inspect` shows the adapter, `export --adapter` writes the folder PEFT loads,
`--merge-adapter` writes what PEFT's `merge_and_unload` gives, proven with PEFT and transformers.

The fixtures (fixtures/peft/generate_peft.py) are PEFT's own `get_peft_model` on a tiny
`LlamaForCausalLM`, trained 2 AdamW steps under FSDP2 on 2 gloo ranks and saved with
`dcp.save({"model", "optim"})` from `get_state_dict`; beside each, PEFT's own `save_pretrained`
folder and `merge_and_unload()` state dict, the base model folder, and logits. Three
configurations: attention only (q/v, r 4, alpha 8), every projection with rsLoRA (r 8,
alpha 16), and a tied-embedding base. Logits are compared with those of a model built on this
machine from PEFT's own files (the recorded logits come from the CPU that wrote them, whose
kernels may round differently in the last bit). Other shapes (DoRA, modules_to_save, two
adapters, keys without PeftModel's wrapper, broken adapters) are written here with a
single-process `dcp.save` of a real PEFT model's state dict.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes

pytest.importorskip("peft")

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
PEFT_FIXTURES = FIXTURES / "peft"
# name -> the flags that say what the weights cannot (fixtures/peft/generate_peft.py FIXTURES)
CONFIGS = {"attention": ["--lora-alpha", "8"], "mlp_rslora": ["--lora-alpha", "16", "--rslora"],
           "tied": ["--lora-alpha", "8"]}
INPUT_IDS = [[1, 5, 9, 2, 33, 127, 0, 17], [40, 3, 3, 8, 21, 100, 11, 4]]


@pytest.fixture(scope="module")
def hf():
    """(transformers, peft), imported once per module, quiet."""
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers, peft


def load_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_state(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert_same_bytes(actual[key], expected[key], key)


def logits(model):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT_IDS)).logits


def peft_logits(hf, fixture: Path, adapter: Path):
    transformers, peft = hf
    base = transformers.AutoModelForCausalLM.from_pretrained(fixture / "base")
    return logits(peft.PeftModel.from_pretrained(base, adapter).eval())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Each fixture exported once with --adapter and the flags alone: name -> folder."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    root = tmp_path_factory.mktemp("adapters")
    for name, flags in CONFIGS.items():
        result = CliRunner().invoke(main, ["export", str(PEFT_FIXTURES / name / "checkpoint"), str(root / name),
                                           "--adapter", *flags, "-q"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return {name: root / name for name in CONFIGS}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each fixture exported once with --merge-adapter --assets base/: name -> folder."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    root = tmp_path_factory.mktemp("merged")
    for name, flags in CONFIGS.items():
        fixture = PEFT_FIXTURES / name
        result = CliRunner().invoke(main, ["export", str(fixture / "checkpoint"), str(root / name), "--merge-adapter",
                                           "--assets", str(fixture / "base"), *flags, "-q"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return {name: root / name for name in CONFIGS}


# ---------------------------------------------------------------------------------------------
# inspect

def test_inspect_shows_the_adapter_its_rank_targets_and_trainable_and_frozen_counts(cli):
    result = cli("inspect", PEFT_FIXTURES / "mlp_rslora" / "checkpoint")
    assert result.exit_code == 0
    assert ("adapter 'default': LoRA r=8 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj "
            "(14 modules); 7,424 trainable, 23,712 frozen parameters") in result.output
    document = json.loads(cli("inspect", PEFT_FIXTURES / "attention" / "checkpoint", "--json").output)
    [adapter] = document["adapters"]
    assert adapter["targets"] == ["q_proj", "v_proj"] and adapter["ranks"] == [4]
    assert {"module": "model.layers.1.self_attn.v_proj", "rank": 4} in adapter["modules"]
    # 2 layers x (q: 4x32 + 32x4, v: 4x32 + 16x4)
    assert adapter["trainable_parameters"] == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert json.loads(cli("inspect", FIXTURES / "llama_world2" / "checkpoint", "--json").output)["adapters"] == []


# ---------------------------------------------------------------------------------------------
# export --adapter

@pytest.mark.parametrize("name", CONFIGS)
def test_adapter_file_equals_peft_save_pretrained_tensor_for_tensor(adapters, name):
    ours = adapters[name] / "adapter_model.safetensors"
    theirs = PEFT_FIXTURES / name / "adapter" / "adapter_model.safetensors"
    assert_same_state(load_file(ours), load_file(theirs))
    assert ours.read_bytes() == theirs.read_bytes()  # the same header order too


@pytest.mark.parametrize("name", CONFIGS)
def test_adapter_folder_loads_in_peft_with_the_trained_models_logits(hf, adapters, name):
    import torch

    fixture = PEFT_FIXTURES / name
    config = json.loads((adapters[name] / "adapter_config.json").read_text())
    expected = json.loads((fixture / "adapter" / "adapter_config.json").read_text())
    for field in ("r", "lora_alpha", "use_rslora", "peft_type", "fan_in_fan_out", "rank_pattern", "alpha_pattern"):
        assert config[field] == expected[field], field
    assert sorted(config["target_modules"]) == sorted(expected["target_modules"])  # PEFT saves a set: any order
    assert torch.equal(peft_logits(hf, fixture, adapters[name]), peft_logits(hf, fixture, fixture / "adapter"))


def test_adapter_config_beside_the_checkpoint_needs_no_flags_and_the_installed_cli_writes_it(tmp_path):
    """The bundled trainer writes adapter_config.json into the step directory."""
    source = tmp_path / "step-00000002"
    shutil.copytree(PEFT_FIXTURES / "mlp_rslora" / "checkpoint", source)
    shutil.copy(PEFT_FIXTURES / "mlp_rslora" / "adapter" / "adapter_config.json", source)
    out = tmp_path / "adapter"
    result = subprocess.run([CKPTTOOL, "export", source, out, "--adapter", "-q"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (PEFT_FIXTURES / "mlp_rslora" / "adapter" / "adapter_config.json").read_text())
    assert (out / "adapter_model.safetensors").read_bytes() == (
        PEFT_FIXTURES / "mlp_rslora" / "adapter" / "adapter_model.safetensors").read_bytes()


def test_adapter_without_alpha_from_config_or_flags_is_refused_and_nothing_written(cli, tmp_path):
    result = cli("export", PEFT_FIXTURES / "attention" / "checkpoint", tmp_path / "out", "--adapter")
    assert result.exit_code == 2 and "--lora-alpha" in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# --merge-adapter

@pytest.mark.parametrize("name", CONFIGS)
def test_merged_export_equals_merge_and_unload_bit_for_bit_and_loads_in_transformers(hf, merged, name):
    """Same ops in the same dtype (float32) as PEFT's get_delta_weight + merge: equal bytes."""
    import torch

    transformers, peft = hf
    fixture = PEFT_FIXTURES / name
    assert_same_state(load_file(merged[name] / "model.safetensors"), load_file(fixture / "merged.safetensors"))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    base = transformers.AutoModelForCausalLM.from_pretrained(fixture / "base")
    reference = peft.PeftModel.from_pretrained(base, fixture / "adapter").merge_and_unload()
    assert torch.equal(logits(model.eval()), logits(reference.eval()))


def test_consolidate_merge_adapter_in_bf16_equals_peft_merging_into_a_bf16_base(hf, cli, tmp_path):
    """--dtype bf16: the base is written in bf16 and merged as PEFT merges into a base loaded in
    bf16 (the adapter kept in float32 by from_pretrained's autocast_adapter_dtype, the delta
    computed in float32 and added to the bf16 weight): equal bytes."""
    import torch

    transformers, peft = hf
    fixture = PEFT_FIXTURES / "mlp_rslora"
    out = tmp_path / "merged.safetensors"
    result = cli("consolidate", fixture / "checkpoint", out, "--merge-adapter", "--dtype", "bf16",
                 "--lora-alpha", "16", "--rslora", "-q")
    assert result.exit_code == 0, result.output
    base = transformers.AutoModelForCausalLM.from_pretrained(fixture / "base", dtype=torch.bfloat16)
    model = peft.PeftModel.from_pretrained(base, fixture / "adapter").merge_and_unload()
    assert_same_state(load_file(out), model.state_dict())


def test_merge_of_the_adapter_with_a_config_in_assets_uses_its_alpha(cli, tmp_path):
    """alpha from adapter_config.json in --assets (the folder PEFT wrote) rather than flags."""
    assets = tmp_path / "assets"
    shutil.copytree(PEFT_FIXTURES / "mlp_rslora" / "base", assets)
    shutil.copy(PEFT_FIXTURES / "mlp_rslora" / "adapter" / "adapter_config.json", assets)
    result = cli("export", PEFT_FIXTURES / "mlp_rslora" / "checkpoint", tmp_path / "out", "--merge-adapter",
                 "--assets", assets, "-q")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(tmp_path / "out" / "model.safetensors"),
                      load_file(PEFT_FIXTURES / "mlp_rslora" / "merged.safetensors"))


def test_export_of_a_lora_checkpoint_without_merge_is_refused_against_the_base_config(cli, tmp_path):
    result = cli("export", PEFT_FIXTURES / "attention" / "checkpoint", tmp_path / "out", "--assets",
                 PEFT_FIXTURES / "attention" / "base")
    assert result.exit_code == 1 and "config-mismatch" in result.output
