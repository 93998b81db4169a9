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


def test_recognition_reads_peft_file_keys_embeddings_and_transposed_bases_from_shapes_alone():
    from ckpttool.model.lora import find_lora

    layout = find_lora({
        "base_model.model.wte.base_layer.weight": (10, 4), "base_model.model.wte.lora_embedding_A": (2, 10),
        "base_model.model.wte.lora_embedding_B": (4, 2), "base_model.model.h.0.attn.c_attn.base_layer.weight": (4, 12),
        "base_model.model.h.0.attn.c_attn.lora_A.weight": (2, 4), "base_model.model.h.0.attn.c_attn.lora_B.weight": (12, 2),
    })
    [adapter] = layout.adapters
    modules = {m.path: m for m in adapter.modules}
    assert adapter.name == "default" and adapter.targets == ("c_attn", "wte")
    assert modules["wte"].kind == "embedding" and modules["h.0.attn.c_attn"].transposed  # GPT-2 Conv1D: (in, out)
    assert layout.base_keys["base_model.model.h.0.attn.c_attn.base_layer.weight"] == "h.0.attn.c_attn.weight"


def test_inspect_of_an_exported_adapter_folder_shows_the_adapter(cli, adapters):
    assert "adapter 'default': LoRA r=4 on q_proj, v_proj (4 modules)" in cli("inspect", adapters["attention"]).output


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
                 "--lora-alpha", "16", "--rslora", "--verify", "-q")  # --verify: the merged bytes read back too
    assert result.exit_code == 0, result.output
    base = transformers.AutoModelForCausalLM.from_pretrained(fixture / "base", dtype=torch.bfloat16)
    model = peft.PeftModel.from_pretrained(base, fixture / "adapter").merge_and_unload()
    assert_same_state(load_file(out), model.state_dict())


def test_merge_into_shards_with_the_config_in_assets_uses_its_alpha(cli, tmp_path):
    """alpha from adapter_config.json in --assets (the folder PEFT wrote) rather than flags."""
    assets = tmp_path / "assets"
    shutil.copytree(PEFT_FIXTURES / "mlp_rslora" / "base", assets)
    shutil.copy(PEFT_FIXTURES / "mlp_rslora" / "adapter" / "adapter_config.json", assets)
    result = cli("export", PEFT_FIXTURES / "mlp_rslora" / "checkpoint", tmp_path / "out", "--merge-adapter",
                 "--assets", assets, "--max-shard-size", "20KB", "-q")  # 6 shards: a merge writes into each
    assert result.exit_code == 0, result.output
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 6
    merged = {key: value for name in set(weight_map.values()) for key, value in load_file(tmp_path / "out" / name).items()}
    assert_same_state(merged, load_file(PEFT_FIXTURES / "mlp_rslora" / "merged.safetensors"))


def test_export_of_a_lora_checkpoint_without_merge_is_refused_against_the_base_config(cli, tmp_path):
    result = cli("export", PEFT_FIXTURES / "attention" / "checkpoint", tmp_path / "out", "--assets",
                 PEFT_FIXTURES / "attention" / "base")
    assert result.exit_code == 1 and "config-mismatch" in result.output
    assert "the weights are a LoRA model" in result.output and "--merge-adapter" in result.output


# ---------------------------------------------------------------------------------------------
# Other PEFT shapes, each a real PEFT model's state dict saved with a single-process dcp.save

def tiny_llama(hf, tied: bool = False):
    import torch

    transformers, _ = hf
    torch.manual_seed(7)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def peft_model(hf, base_dir: Path, **lora):
    """A PeftModel on a seeded tiny Llama (saved to `base_dir` first), its adapter weights random
    (init_lora_weights=False: B is not zero, so a merge changes the weights)."""
    _, peft = hf
    base = tiny_llama(hf)
    base.save_pretrained(base_dir)
    return peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))


def assert_exported_adapter_is_peft_s(cli, source: Path, out: Path, peft_folder: Path) -> None:
    """`export --adapter` of `source`, with PEFT's own save of the model as its assets, writes
    the adapter weights PEFT wrote."""
    result = cli("export", source, out, "--adapter", "--assets", peft_folder, "-q")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(out / "adapter_model.safetensors"), load_file(peft_folder / "adapter_model.safetensors"))


def save_checkpoint(model, path: Path, wrapped: bool = True, change=None) -> Path:
    """dcp.save({"model": state dict}) of `model` (keys without `base_model.model.` unless wrapped)."""
    import torch.distributed.checkpoint as dcp

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not wrapped:
        state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    if change is not None:
        change(state)
    dcp.save({"model": state}, checkpoint_id=str(path))
    return path


def test_dora_adapter_exports_as_peft_saves_it_and_merges_as_merge_and_unload(hf, cli, tmp_path):
    import torch

    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # a trained magnitude: not the base weight's norm it starts as
        for name, parameter in model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(1.5)
    model.save_pretrained(tmp_path / "peft")
    source = save_checkpoint(model, tmp_path / "ckpt")
    assert "adapter 'default': DoRA r=4" in cli("inspect", source).output
    result = cli("export", source, tmp_path / "out", "--adapter", "--lora-alpha", "8", "-q")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(tmp_path / "out" / "adapter_model.safetensors"),
                      load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["use_dora"] is True
    merged = cli("consolidate", source, tmp_path / "merged.safetensors", "--merge-adapter", "--lora-alpha", "8", "-q")
    assert merged.exit_code == 0, merged.output
    assert_same_state(load_file(tmp_path / "merged.safetensors"), model.merge_and_unload().state_dict())


def test_dora_on_an_embedding_is_refused_in_one_line_naming_the_module(hf, cli, tmp_path):
    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, use_dora=True, target_modules=["embed_tokens"])
    source = save_checkpoint(model, tmp_path / "ckpt")
    refused = cli("export", source, tmp_path / "merged", "--merge-adapter", "--lora-alpha", "8")
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "model.embed_tokens: a DoRA adapter on an embedding" in refused.output
    assert not (tmp_path / "merged").exists()


def test_modules_to_save_export_and_merge_equal_peft_save_pretrained_and_merge_and_unload(hf, cli, tmp_path):
    import torch

    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                       modules_to_save=["lm_head"])
    with torch.no_grad():  # a trained copy that differs from the original lm_head
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.25)
    model.save_pretrained(tmp_path / "peft")
    source = save_checkpoint(model, tmp_path / "ckpt")
    assert_exported_adapter_is_peft_s(cli, source, tmp_path / "out", tmp_path / "peft")
    merged = cli("consolidate", source, tmp_path / "merged.safetensors", "--merge-adapter", "--lora-alpha", "8", "-q")
    assert merged.exit_code == 0, merged.output
    assert_same_state(load_file(tmp_path / "merged.safetensors"), model.merge_and_unload().state_dict())


def test_second_adapter_is_chosen_by_name_and_equals_peft_saving_it(hf, cli, tmp_path):
    _, peft = hf
    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["up_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "peft", selected_adapters=["second"])
    source = save_checkpoint(model, tmp_path / "ckpt")
    unnamed = cli("export", source, tmp_path / "none", "--adapter", "--lora-alpha", "4")
    assert unnamed.exit_code == 2 and "2 adapters (default, second)" in unnamed.output
    result = cli("export", source, tmp_path / "out", "--adapter", "second", "--lora-alpha", "4", "-q")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(tmp_path / "out" / "adapter_model.safetensors"),
                      load_file(tmp_path / "peft" / "second" / "adapter_model.safetensors"))


def test_lora_injected_without_peftmodel_gets_peft_prefix_and_loads_with_the_same_logits(hf, cli, tmp_path):
    """inject_adapter_in_model and the bundled trainer save no `base_model.model.` wrapper."""
    import torch

    transformers, peft = hf
    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model.save_pretrained(tmp_path / "peft")
    source = save_checkpoint(model, tmp_path / "ckpt", wrapped=False)
    assert_exported_adapter_is_peft_s(cli, source, tmp_path / "out", tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "out").eval()
    assert torch.equal(logits(loaded), logits(model.eval()))


def _drop_first_b(state):
    del state[next(k for k in sorted(state) if ".lora_B." in k)]


def _narrow_first_a(state):
    key = next(k for k in sorted(state) if ".lora_A." in k)
    state[key] = state[key][:3].clone()


@pytest.mark.parametrize("damage, words", [
    (_drop_first_b, "model.layers.0.self_attn.q_proj: adapter 'default' has"),
    (_narrow_first_a, "model.layers.0.self_attn.q_proj: adapter 'default' has lora_A [3, 32] and lora_B [32, 4]"),
])
def test_broken_adapter_exits_1_naming_the_module_and_writes_nothing(hf, cli, tmp_path, damage, words):
    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    source = save_checkpoint(model, tmp_path / "ckpt", change=damage)
    for command in (["export", source, tmp_path / "out", "--adapter", "--lora-alpha", "8"],
                    ["export", source, tmp_path / "out", "--merge-adapter", "--lora-alpha", "8"],
                    ["consolidate", source, tmp_path / "out.safetensors", "--merge-adapter", "--lora-alpha", "8"]):
        result = cli(*command)
        assert result.exit_code == 1 and words in result.output and "adapter-invalid" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.safetensors").exists()
    assert "LoRA keys that do not form an adapter" in cli("inspect", source).output


def test_config_whose_rank_or_targets_disagree_with_the_weights_exits_1_naming_the_module(cli, tmp_path):
    fixture = PEFT_FIXTURES / "attention"
    for change, words in ((("r", 8), "model.layers.0.self_attn.q_proj has rank 4 in the weights, the config says r=8"),
                          (("target_modules", ["q_proj"]), "does not select model.layers.0.self_attn.v_proj"),
                          (("target_modules", ["q_proj", "v_proj", "k_proj"]), "names 'k_proj', but no k_proj"),
                          (("fan_in_fan_out", True), "v_proj's base weight [16, 32] is stored (out, in)"),
                          (("use_dora", True), "model.layers.0.self_attn.q_proj has no lora_magnitude_vector")):
        assets = tmp_path / f"assets-{change[0]}-{len(str(change[1]))}"
        assets.mkdir()
        config = json.loads((fixture / "adapter" / "adapter_config.json").read_text())
        config[change[0]] = change[1]
        (assets / "adapter_config.json").write_text(json.dumps(config))
        result = cli("export", fixture / "checkpoint", tmp_path / "out", "--adapter", "--assets", assets)
        assert result.exit_code == 1 and "config-mismatch" in result.output and words in result.output, result.output
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant_type, double", [("nf4", True), ("fp4", False)])
def test_qlora_adapter_exports_and_merge_dequantizes_as_bitsandbytes_and_peft_do(hf, cli, tmp_path, quant_type, double):
    """A real QLoRA model (transformers' BitsAndBytesConfig, 4-bit on CPU): --adapter equals
    save_pretrained; --merge-adapter equals, byte for byte, for each LoRA module PEFT's own
    Linear4bit.merge before it requantises (`dequantize_4bit(W) + get_delta_weight`), and for
    every other 4-bit weight bitsandbytes' `dequantize_4bit`, both with the dequantisation of
    bitsandbytes' reference implementation, the same on every CPU. Its CPU kernel, what PEFT
    runs here, gives the same values: it differs from the reference only in the sign of fp4's
    zero (code 8), by CPU (formats/bnb4bit.py). Rows are 64 and 128 values, whole blocks of 64."""
    import torch

    bnb = pytest.importorskip("bitsandbytes")
    transformers, peft = hf
    from peft.utils.integrations import dequantize_bnb_weight

    torch.manual_seed(11)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                   bnb_4bit_use_double_quant=double)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization,
                                                             device_map="cpu")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                      init_lora_weights=False))
    model.save_pretrained(tmp_path / "peft")
    source = save_checkpoint(model, tmp_path / "ckpt")
    assert_exported_adapter_is_peft_s(cli, source, tmp_path / "adapter", tmp_path / "peft")

    merged = cli("export", source, tmp_path / "merged", "--merge-adapter", "--assets", tmp_path / "base",
                 "--lora-alpha", "8", "-q")
    assert merged.exit_code == 0, merged.output
    expected, kernel = {}, {}  # kernel: what PEFT and bitsandbytes compute with the CPU kernel of this machine
    with torch.no_grad():
        for name, module in model.base_model.model.named_modules():
            if isinstance(module, peft.tuners.lora.bnb.Linear4bit):
                weight = module.get_base_layer().weight
                delta = module.get_delta_weight("default")
                expected[f"{name}.weight"] = reference_dequantize_4bit(bnb, weight) + delta
                kernel[f"{name}.weight"] = dequantize_bnb_weight(weight, state=weight.quant_state) + delta
            elif isinstance(module, bnb.nn.Linear4bit) and not name.endswith("base_layer"):
                expected[f"{name}.weight"] = reference_dequantize_4bit(bnb, module.weight)
                kernel[f"{name}.weight"] = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        for key, value in model.base_model.model.state_dict().items():
            if ".lora_" not in key and "base_layer" not in key and key not in expected and value.dtype != torch.uint8 \
                    and not any(part in key for part in ("absmax", "quant_map", "quant_state")):
                expected[key] = value
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert_same_state(written, expected)
    assert [key for key in kernel if not torch.equal(written[key], kernel[key])] == []  # -0.0 == 0.0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def reference_dequantize_4bit(bnb, weight):
    """`bitsandbytes.functional.dequantize_4bit(weight)` as its reference implementation
    computes it (backends/default/ops.py `_dequantize_4bit_compute`: the quant_map's value times
    the block's absmax, in float32), the same on every CPU; a double-quantised absmax restored
    first as dequantize_4bit does."""
    import torch
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    state = weight.quant_state
    absmax = state.absmax
    if state.nested:
        absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
    return _dequantize_4bit_compute(weight.data.view(torch.uint8).reshape(-1), absmax.float(), state.code,
                                    state.blocksize, state.shape, state.dtype)


def test_packed_4bit_base_without_a_readable_quant_state_exports_the_adapter_and_refuses_to_merge(hf, cli, tmp_path):
    """A base packed as Params4bit saves it, (out*in/2, 1) uint8, but its quant state unreadable."""
    import torch

    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model.save_pretrained(tmp_path / "peft")

    def pack(state):
        for key in [k for k in state if k.endswith(".base_layer.weight")]:
            numel = state[key].numel()
            state[key] = torch.randint(0, 256, (numel // 2, 1), dtype=torch.uint8)
            state[key + ".absmax"] = torch.rand(numel // 64)
            state[key + ".quant_map"] = torch.linspace(-1, 1, 16)
            state[key + ".quant_state.bitsandbytes__nf4"] = torch.zeros(64, dtype=torch.uint8)

    source = save_checkpoint(model, tmp_path / "ckpt", change=pack)
    assert_exported_adapter_is_peft_s(cli, source, tmp_path / "out", tmp_path / "peft")
    refused = cli("consolidate", source, tmp_path / "merged.safetensors", "--merge-adapter", "--lora-alpha", "8")
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert ("model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight.quant_state.bitsandbytes__nf4: "
            "not a bitsandbytes quant state") in refused.output
    assert not (tmp_path / "merged.safetensors").exists()


def test_merge_in_row_blocks_equals_merge_and_unload_for_linear_and_embedding_loras(hf, cli, tmp_path, monkeypatch):
    """The base weight is read, added to and rewritten a block of rows at a time (here 256 bytes:
    several blocks per tensor); an embedding's delta is (B @ A) transposed."""
    from ckpttool.run import merge

    monkeypatch.setattr(merge, "MERGE_BLOCK", 256)
    model = peft_model(hf, tmp_path / "base", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens"])
    source = save_checkpoint(model, tmp_path / "ckpt")
    assert "adapter 'default': LoRA r=4 on down_proj, embed_tokens, q_proj" in cli("inspect", source).output
    result = cli("consolidate", source, tmp_path / "merged.safetensors", "--merge-adapter", "--lora-alpha", "8", "-q")
    assert result.exit_code == 0, result.output
    assert_same_state(load_file(tmp_path / "merged.safetensors"), model.merge_and_unload().state_dict())


@pytest.mark.parametrize("name", ["full.safetensors", "full.pt"])
def test_adapter_and_merge_from_a_consolidated_file_equal_peft_as_from_the_dcp_checkpoint(cli, tmp_path, name):
    """Any layout ckpttool reads: the LoRA model consolidated to one file first."""
    fixture = PEFT_FIXTURES / "attention"
    assert cli("consolidate", fixture / "checkpoint", tmp_path / name, "-q").exit_code == 0
    result = cli("export", tmp_path / name, tmp_path / "adapter", "--adapter", "--lora-alpha", "8", "-q")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (fixture / "adapter" / "adapter_model.safetensors").read_bytes()
    merged = cli("export", tmp_path / name, tmp_path / "merged", "--merge-adapter", "--assets", fixture / "base",
                 "--lora-alpha", "8", "-q")
    assert merged.exit_code == 0, merged.output
    assert_same_state(load_file(tmp_path / "merged" / "model.safetensors"), load_file(fixture / "merged.safetensors"))


def test_merge_to_a_pt_file_has_the_crcs_of_the_merged_bytes(tmp_path):
    """A .pt zip stores each record's CRC-32: a merged tensor's is of its merged bytes."""
    import zipfile

    import torch

    fixture = PEFT_FIXTURES / "attention"
    result = subprocess.run([CKPTTOOL, "consolidate", fixture / "checkpoint", tmp_path / "merged.pt", "--merge-adapter",
                             "--lora-alpha", "8", "-q"], capture_output=True, text=True)  # the installed CLI
    assert result.returncode == 0, result.stderr
    assert "merged LoRA adapter 'default' into 4 base weights" in result.stderr
    with zipfile.ZipFile(tmp_path / "merged.pt") as archive:
        assert archive.testzip() is None
    assert_same_state(torch.load(tmp_path / "merged.pt", weights_only=True), load_file(fixture / "merged.safetensors"))


@pytest.mark.parametrize("command, option", [("export", "--adapter"), ("export", "--merge-adapter"),
                                             ("consolidate", "--merge-adapter")])
def test_a_checkpoint_path_given_as_the_adapter_name_is_a_usage_error_saying_where_the_option_goes(command, option, tmp_path):
    """`--adapter [NAME]` takes an optional value: before SRC it would swallow SRC as the name."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    source = str(PEFT_FIXTURES / "attention" / "checkpoint")
    result = CliRunner().invoke(main, [command, option, source, str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "looks like a path, not an adapter name" in result.output and f"SRC OUT {option}" in result.output
    assert not (tmp_path / "out").exists()
