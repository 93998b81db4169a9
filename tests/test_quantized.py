"""Quantised checkpoints (FP8, MXFP4): recognised in every layout, dequantised bit for bit as the
references compute it, never cast without their scales.

The fixtures (fixtures/quantized/generate_quantized.py) are real transformers models, a tiny
DeepseekV3ForCausalLM quantised to fine-grained FP8 by DeepSeek's weight_quant rule and a tiny
GptOssForCausalLM to MXFP4, sharded like their Hub repos; the references are
tests/quant_reference.py (DeepSeek's weight_dequant ported block by block; transformers' own
convert_moe_packed_tensors). Exports are compared by the sha256 of every tensor and loaded by
transformers itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES

from ckpttool.core.errors import UsageError
from quant_reference import (deepseek_weight_dequant, deepseek_weight_quant, read_folder_tensors,
                             reference_dequantized_state_dict, sha256_of)

FP8 = FIXTURES / "quantized" / "deepseek_v3_fp8"
MXFP4 = FIXTURES / "quantized" / "gpt_oss_mxfp4"
FOLDERS = {"fp8": FP8, "mxfp4": MXFP4}
INPUT_IDS = [[3, 17, 42, 5, 99, 1, 64, 7]]


def config_without_quantization(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    return config


def model_class(config: dict):
    import transformers

    return getattr(transformers, config["architectures"][0])


def logits_of(folder: Path, **kwargs):
    import torch
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits, info


def write_reference_folder(folder: Path, out: Path, dtype) -> Path:
    """A folder of the reference dequantisation: its state dict, config.json without the
    quantization_config (what DeepSeek's fp8_cast_bf16 and transformers' dequantize leave)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(reference_dequantized_state_dict(folder, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = config_without_quantization(folder)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run) -> dict[str, Path]:
    """Each fixture exported with --dtype bf16 (and without --dtype), once per module."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, folder in FOLDERS.items():
        for mode, extra in (("bf16", ["--dtype", "bf16"]), ("as-is", [])):
            target = root / f"{name}-{mode}"
            result = run("export", folder, target, "--max-shard-size", "200KB", *extra)
            assert result.exit_code == 0, result.output
            out[f"{name}-{mode}"] = target
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    import torch

    root = tmp_path_factory.mktemp("reference")
    return {name: write_reference_folder(folder, root / name, torch.bfloat16) for name, folder in FOLDERS.items()}


# ---------------------------------------------------------------------------------------------
# Recognition: inspect and validate


@pytest.mark.parametrize("name", FOLDERS)
def test_inspect_counts_the_dequantized_model_as_transformers_does(run, name):
    folder = FOLDERS[name]
    document = json.loads(run("inspect", folder, "--json").output)
    assert document["layout"] == "hub-folder"  # gpt-oss's shards have no __metadata__: still a Hub folder
    found = document["quantization"]
    config = config_without_quantization(folder)
    import transformers

    model = model_class(config)(transformers.AutoConfig.for_model(**config))
    # a checkpoint holds parameters and persistent buffers alike (DeepSeek's router keeps
    # e_score_correction_bias as a buffer): the count is num_parameters() plus those buffers
    saved_buffers = sum(b.numel() for key, b in model.named_buffers() if key in model.state_dict())
    assert found["dequantized_parameters"] == document["summary"]["parameters"] == model.num_parameters() + saved_buffers
    assert found["dequantized_parameters"] == sum(t.numel() for t in model.state_dict().values())
    assert found["scheme"] == name and found["problems"] == []
    tensors = read_folder_tensors(folder)
    if name == "fp8":
        assert found["block_size"] == [128, 128] and found["layouts"] == ["fp8-block"]
        assert found["quantized_tensors"] == sum(1 for t in tensors.values() if t.dtype == __import__("torch").float8_e4m3fn)
    else:
        assert found["block_size"] is None and found["layouts"] == ["mxfp4"]
        assert found["quantized_tensors"] == sum(1 for key in tensors if key.endswith("_blocks"))
    scales = [t for key, t in tensors.items() if key.endswith(("_scale_inv", "_scales"))]
    assert found["scale_bytes"] == sum(t.numel() * t.element_size() for t in scales)
    text = run("inspect", folder).output
    assert f"quantized: {name}" in text


def test_a_scale_in_another_shard_than_its_weight_is_found():
    weight_map = json.loads((FP8 / "model.safetensors.index.json").read_text())["weight_map"]
    apart = [key for key in weight_map if key.endswith("_scale_inv")
             and weight_map[key] != weight_map[key.removesuffix("_scale_inv")]]
    assert apart, "the fixture must hold a scale in another shard than its weight"
    import ckpttool

    with ckpttool.open(FP8) as handle:
        assert all(key.removesuffix("_scale_inv") in handle.quantization.weights for key in apart)


def damaged(tmp_path: Path, source: Path, change) -> Path:
    """A copy of `source` whose shard holding a tensor is rewritten by `change(tensors)`."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / source.name
    shutil.copytree(source, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    for name in files:
        tensors = load_file(str(target / name))
        changed = change(dict(tensors))
        if changed.keys() != tensors.keys() or any(changed[k] is not v for k, v in tensors.items()):
            save_file(changed, str(target / name), metadata={"format": "pt"})
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != name or k in changed}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


SCALE = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
BLOCKS = "model.layers.1.mlp.experts.down_proj_blocks"


def without(key):
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def misshapen(key):
    import torch

    return lambda tensors: {k: (torch.ones(v.shape[0] + 1, *v.shape[1:], dtype=v.dtype) if k == key else v)
                            for k, v in tensors.items()}


CASES = {
    "missing-fp8-scale": (FP8, without(SCALE), SCALE.removesuffix("_scale_inv")),
    "misshapen-fp8-scale": (FP8, misshapen(SCALE), SCALE),
    "missing-mxfp4-scales": (MXFP4, without(BLOCKS.replace("_blocks", "_scales")), BLOCKS),
    "misshapen-mxfp4-scales": (MXFP4, misshapen(BLOCKS.replace("_blocks", "_scales")),
                               BLOCKS.replace("_blocks", "_scales")),
}


@pytest.mark.parametrize("case", CASES)
def test_a_missing_or_misshapen_scale_is_refused_naming_the_tensor(tmp_path, cli, case):
    source, change, named = CASES[case]
    folder = damaged(tmp_path, source, change)
    result = cli("validate", folder)
    assert result.exit_code == 1 and named in result.output, result.output
    out = tmp_path / "out"
    for command in (["export", folder, out, "--dtype", "bf16"], ["consolidate", folder, tmp_path / "m.safetensors",
                                                                 "--dtype", "fp32"]):
        result = cli(*command)
        assert result.exit_code == 1, result.output
        assert named in result.output and "\n" not in result.output.strip(), result.output
        assert not out.exists() and not (tmp_path / "m.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # nothing half-written beside


def test_a_truncated_shard_is_refused_naming_the_tensor_and_nothing_is_written(tmp_path, cli):
    folder = tmp_path / "fp8"
    shutil.copytree(FP8, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[SCALE]
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:
        handle.truncate(size - 100)
    out = tmp_path / "out"
    result = cli("export", folder, out, "--dtype", "bf16")
    assert result.exit_code == 1 and shard.name in result.output, result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


# ---------------------------------------------------------------------------------------------
# Dequantised exports: bit for bit as the references, loaded by transformers


@pytest.mark.parametrize("name", FOLDERS)
def test_dequantized_export_equals_the_reference_dequantization_bit_for_bit(exported, name):
    import torch

    written = read_folder_tensors(exported[f"{name}-bf16"])
    reference = reference_dequantized_state_dict(FOLDERS[name], torch.bfloat16)
    assert sorted(written) == sorted(reference)  # scales and blocks gone, MXFP4's `_blocks` dropped
    assert {key: sha256_of(t) for key, t in written.items()} == {key: sha256_of(t) for key, t in reference.items()}
    config = json.loads((exported[f"{name}-bf16"] / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    if name == "mxfp4":  # the E2M1 table has -0.0, and it survives
        experts = [t for key, t in written.items() if key.endswith(("gate_up_proj", "down_proj"))]
        assert any(bool(((t == 0) & torch.signbit(t)).any()) for t in experts)


@pytest.mark.parametrize("name", FOLDERS)
def test_transformers_loads_the_dequantized_folder_with_the_reference_logits(exported, references, name):
    import torch

    logits, info = logits_of(exported[f"{name}-bf16"])
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected, _ = logits_of(references[name])
    assert torch.equal(logits, expected)


def test_transformers_own_mxfp4_dequantize_gives_the_same_logits(exported):
    import torch
    from transformers import Mxfp4Config

    logits, _ = logits_of(exported["mxfp4-bf16"])
    theirs, info = logits_of(MXFP4, quantization_config=Mxfp4Config(dequantize=True))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(logits, theirs)


@pytest.mark.parametrize("name", FOLDERS)
def test_export_without_dtype_passes_codes_scales_and_config_through_byte_for_byte(exported, name):
    written = read_folder_tensors(exported[f"{name}-as-is"])
    source = read_folder_tensors(FOLDERS[name])
    assert {key: sha256_of(t) for key, t in written.items()} == {key: sha256_of(t) for key, t in source.items()}
    assert (exported[f"{name}-as-is"] / "config.json").read_bytes() == (FOLDERS[name] / "config.json").read_bytes()


def test_fp32_and_fp16_dequantize_as_the_reference_does(tmp_path, cli):
    import torch

    for flag, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        out = tmp_path / f"{flag}.safetensors"
        assert cli("consolidate", FP8, out, "--dtype", flag).exit_code == 0
        written = read_folder_tensors_file(out)
        reference = reference_dequantized_state_dict(FP8, dtype)
        assert {k: sha256_of(t) for k, t in written.items()} == {k: sha256_of(t) for k, t in reference.items()}


def read_folder_tensors_file(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------------------------------------
# Every layout: a single .safetensors file and DCP (chunks of rows)


def test_a_single_safetensors_file_and_a_dcp_checkpoint_dequantize_alike(tmp_path, cli):
    import torch

    single = tmp_path / "single.safetensors"
    assert cli("consolidate", FP8, single).exit_code == 0  # pass-through: one file of codes and scales
    dcp = tmp_path / "dcp"
    result = cli("import", FP8, dcp, "--world", "3")  # rows of each weight split over 3 ranks' files
    assert result.exit_code == 0, result.output
    reference = {k: sha256_of(t) for k, t in reference_dequantized_state_dict(FP8, torch.bfloat16).items()}
    for source, extra in ((single, []), (dcp, ["--model-prefix", "model"])):
        out = tmp_path / f"{source.stem}-bf16.safetensors"
        result = cli("consolidate", source, out, "--dtype", "bf16", *extra)
        assert result.exit_code == 0, result.output
        assert {k: sha256_of(t) for k, t in read_folder_tensors_file(out).items()} == reference


# ---------------------------------------------------------------------------------------------
# The library: open().get_tensor(dequantize=True), load_state_dict(dtype=...)


@pytest.mark.parametrize("name", FOLDERS)
def test_open_get_tensor_dequantizes_as_export_does(exported, name):
    import torch

    import ckpttool

    written = read_folder_tensors(exported[f"{name}-bf16"])
    with ckpttool.open(FOLDERS[name]) as handle:
        for weight in handle.quantization.weights.values():
            tensor = handle.get_tensor(weight.codes, dequantize=True, dtype=torch.bfloat16)
            assert sha256_of(tensor) == sha256_of(written[weight.name])
            assert sha256_of(handle.get_tensor(weight.name, dequantize=True)) == sha256_of(written[weight.name])
        if name == "fp8":  # float8 codes are never cast alone (MXFP4's are uint8, never cast)
            codes = next(iter(handle.quantization.weights))
            with pytest.raises(UsageError, match="dequantize=True"):
                handle.get_tensor(codes, dtype=torch.bfloat16)
    state = ckpttool.load_state_dict(FOLDERS[name], dtype=torch.bfloat16)
    assert {k: sha256_of(t) for k, t in state.items()} == {k: sha256_of(t) for k, t in written.items()}


# ---------------------------------------------------------------------------------------------
# --quantize fp8: DeepSeek's weight_quant, and back


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory) -> Path:
    """A tiny bf16 LlamaForCausalLM whose projections are multiples of 128 but one (k/v: 64 rows
    of 128 columns, a partial block)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=160,
                                      max_position_embeddings=64, torch_dtype="bfloat16")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("llama") / "bf16"
    model.save_pretrained(out)
    return out


def test_quantize_fp8_round_trip_equals_the_reference_quantize_then_dequantize(tmp_path, cli, llama_bf16):
    import torch

    quantized = tmp_path / "fp8"
    result = cli("export", llama_bf16, quantized, "--quantize", "fp8")
    assert result.exit_code == 0, result.output
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    source = read_folder_tensors(llama_bf16)
    written = read_folder_tensors(quantized)
    projections = [key for key in source if "_proj." in key]
    assert sorted(written) == sorted([*source, *(key + "_scale_inv" for key in projections)])
    for key, tensor in source.items():
        if key in projections:
            codes, scale = deepseek_weight_quant(tensor)
            assert sha256_of(written[key]) == sha256_of(codes) and sha256_of(written[key + "_scale_inv"]) == sha256_of(scale)
        else:  # embeddings, norms and lm_head stay as they are
            assert sha256_of(written[key]) == sha256_of(tensor)
    back = tmp_path / "bf16"
    assert cli("export", quantized, back, "--dtype", "bf16").exit_code == 0
    restored = read_folder_tensors(back)
    for key in projections:
        codes, scale = deepseek_weight_quant(source[key])
        assert sha256_of(restored[key]) == sha256_of(deepseek_weight_dequant(codes, scale, dtype=torch.bfloat16)), key


def test_transformers_loads_the_quantize_fp8_output_with_its_own_dequantize(tmp_path, cli, llama_bf16):
    import torch
    from transformers import FineGrainedFP8Config

    quantized, back = tmp_path / "fp8", tmp_path / "bf16"
    assert cli("export", llama_bf16, quantized, "--quantize", "fp8").exit_code == 0
    assert cli("export", quantized, back, "--dtype", "bf16").exit_code == 0
    theirs, info = logits_of(quantized, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours, _ = logits_of(back)
    assert torch.equal(theirs, ours)


def test_the_installed_command_dequantizes_in_a_subprocess(tmp_path):
    out = tmp_path / "out"
    process = subprocess.run([sys.executable, "-m", "ckpttool", "export", str(MXFP4), str(out), "--dtype", "bf16",
                              "--json"], capture_output=True, text=True)
    assert process.returncode == 0, process.stderr
    document = json.loads(process.stdout)
    assert document["dtype"] == "bfloat16"
    assert not any(key.endswith(("_blocks", "_scales")) for key in read_folder_tensors(out))


# ---------------------------------------------------------------------------------------------
# compressed-tensors FP8 (llm-compressor's float-quantized): per tensor, per channel


COMPRESSED = {name: FIXTURES / "quantized" / f"llama_fp8_{name}" for name in ("tensor", "channel")}


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_tensors_fp8_dequantizes_as_compressed_tensors_does(tmp_path, cli, name):
    """The reference is compressed-tensors 0.20's own model-free dequantiser
    (fixtures/quantized/generate_compressed.py): `x_q.to(scale.dtype) * scale`, then bf16."""
    import torch

    folder = COMPRESSED[name]
    document = json.loads(cli("inspect", folder, "--json").output)["quantization"]
    assert document["scheme"] == "compressed-tensors" and document["layouts"] == [f"fp8-{name}"]
    out = tmp_path / "bf16"
    result = cli("export", folder, out, "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    written = read_folder_tensors(out)
    reference = read_folder_tensors_file(FIXTURES / "quantized" / "compressed_reference" / f"llama_fp8_{name}.bf16.safetensors")
    assert {k: sha256_of(t) for k, t in written.items()} == {k: sha256_of(t) for k, t in reference.items()}
    assert not any(key.endswith(("weight_scale", "input_scale")) for key in written)  # activation scales leave too
    logits, info = logits_of(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference_folder = tmp_path / "reference"
    reference_folder.mkdir()
    shutil.copy(FIXTURES / "quantized" / "compressed_reference" / f"llama_fp8_{name}.bf16.safetensors",
                reference_folder / "model.safetensors")
    (reference_folder / "config.json").write_text(json.dumps({**config_without_quantization(folder), "dtype": "bfloat16"}))
    expected, _ = logits_of(reference_folder)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("code_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_code_dequantizes_as_deepseeks_weight_dequant(code_dtype, dtype):
    """The torch-free block path (formats.fp8.dequantize_block_rows) on all 256 codes of each
    float8 dtype (NaN, infinities, subnormals, -0.0), ragged blocks, scales of every size."""
    import numpy as np
    import torch

    from ckpttool.formats import fp8

    generator = torch.Generator().manual_seed(3)
    rows, cols, block = 300, 260, (128, 128)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator)
    codes[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale = torch.exp2(torch.randint(-30, 10, (3, 3), generator=generator).float()) * torch.rand(3, 3, generator=generator)
    expected = deepseek_weight_dequant(codes.view(getattr(torch, code_dtype)), scale, block, getattr(torch, dtype))
    out = np.empty((rows, cols), dtype=fp8.BITS[dtype])
    index = np.empty((block[0], cols), dtype=np.intp)
    fp8.dequantize_block_rows(codes.numpy(), code_dtype, scale.numpy(), block, dtype, out, index)
    assert out.tobytes() == expected.contiguous().view(torch.uint8).numpy().tobytes()
