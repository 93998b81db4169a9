"""config.json from Megatron-LM's common.pt: a Megatron-Core checkpoint exports with no --assets.

The fixtures (generate_megatron_families.py) were saved by Megatron-LM's own argument parsing;
their hf/config.json is what Megatron-Bridge 0.3.1's `megatron_to_hf_config` wrote for the same
model, and hf/model.safetensors its conversion of the weights.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from conftest import FIXTURES, assert_same_bytes

from ckpttool.core.errors import UnsupportedFormat
from ckpttool.naming.megatron_config import common_file, hf_config, megatron_hf_config, read_args

MEGATRON = FIXTURES / "frameworks" / "megatron_families"
CASES = sorted(p.name for p in MEGATRON.iterdir() if (p / "hf" / "config.json").is_file()
               and (p / "checkpoints").is_dir()) if MEGATRON.is_dir() else []
# What Megatron-Bridge writes beyond the transformers config class's own fields (its provider's
# settings: `aux_loss_alpha`, `hidden_dropout`, `scoring_func`, `use_qk_norm`, `n_routed_experts`,
# and for a dense Llama `num_experts_per_tok`; `mlp_bias` for Qwen3-MoE): no transformers class
# reads them, so they are left out. Every field the class has agrees.
BRIDGE_ONLY = {"aux_loss_alpha", "hidden_dropout", "scoring_func", "use_qk_norm", "n_routed_experts",
               "num_experts_per_tok", "mlp_bias"}


def common_pt(name: str):
    return common_file(MEGATRON / name / "checkpoints")


@pytest.mark.parametrize("name", CASES)
def test_the_config_from_common_pt_agrees_with_megatron_bridges_on_every_field_transformers_has(name):
    from transformers import AutoConfig

    ours = AutoConfig.for_model(**megatron_hf_config(common_pt(name)))
    bridge = AutoConfig.for_model(**json.loads((MEGATRON / name / "hf" / "config.json").read_text()))
    assert type(ours) is type(bridge)
    fields = AutoConfig.for_model(ours.model_type).to_dict()  # the class's own fields, with defaults
    mine, theirs = ours.to_dict(), bridge.to_dict()
    differing = {key for key in mine.keys() | theirs.keys() if mine.get(key, "absent") != theirs.get(key, "absent")}
    assert differing <= BRIDGE_ONLY - fields.keys(), {key: (mine.get(key), theirs.get(key)) for key in differing}


def test_which_args_decide_the_architecture():
    args = read_args(common_pt("moe"))
    assert [hf_config({**args, **change}, "common.pt")["architectures"] for change in (
        {"num_experts": None, "qk_layernorm": False}, {"num_experts": None, "qk_layernorm": False, "add_qkv_bias": True},
        {"num_experts": None}, {}, {"qk_layernorm": False})] == [
        ["LlamaForCausalLM"], ["Qwen2ForCausalLM"], ["Qwen3ForCausalLM"], ["Qwen3MoeForCausalLM"], ["MixtralForCausalLM"]]
    assert hf_config({**args, "moe_router_pre_softmax": True}, "common.pt")["norm_topk_prob"] is False
    assert hf_config({**args, "bf16": True}, "common.pt")["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("change, named", [
    ({"swiglu": False}, "swiglu=False"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type='learned_absolute'"),
    ({"add_bias_linear": True}, "add_bias_linear=True"),
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"window_size": (128, 0)}, "window_size=(128, 0)"),
    ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64"),
    ({"padded_vocab_size": None}, "no padded_vocab_size"),
])
def test_a_model_transformers_cannot_represent_is_refused_naming_common_pt_and_the_arg(change, named):
    args = read_args(common_pt("moe"))
    with pytest.raises(UnsupportedFormat) as error:
        hf_config({**args, **change}, "iter_0000003/common.pt")
    message = str(error.value)
    assert message.startswith("iter_0000003/common.pt: args ") and named in message and "\n" not in message


# ---------------------------------------------------------------------------------------------
# export with no --assets


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("megatron-args")
    return {name: (root / name, run("export", MEGATRON / name / "checkpoints", root / name, "--json"))
            for name in CASES}


@pytest.mark.parametrize("name", CASES)
def test_export_without_assets_says_the_config_came_from_common_pt(exports, name):
    target, result = exports[name]
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == f"{common_pt(name)}: args"
    written = json.loads((target / "config.json").read_text())
    assert written["architectures"] == json.loads((MEGATRON / name / "hf" / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("name", CASES)
def test_transformers_loads_the_export_without_assets_byte_for_byte_megatron_bridges(exports, name):
    """And with Megatron's logits (within 1e-4, as tests/test_naming.py: float32 sums in other
    orders): the config's settings (norm_topk_prob, rope, eps) are the ones Megatron ran with."""
    import torch
    import transformers
    from safetensors.torch import load_file

    target, result = exports[name]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = {}
    for file in sorted(target.glob("*.safetensors")):
        written.update(load_file(str(file)))
    expected = load_file(str(MEGATRON / name / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(written[key], tensor, key)
    ids = json.loads((MEGATRON / name / "inputs.json").read_text())["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    (reference,) = load_file(str(MEGATRON / name / "logits.safetensors")).values()
    assert float((logits - reference).abs().max()) < 1e-4


def test_an_assets_config_json_still_wins(tmp_path, cli):
    assets = MEGATRON / "llama_tp2" / "hf"
    result = cli("export", MEGATRON / "llama_tp2" / "checkpoints", tmp_path / "out", "--assets", assets, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == str(assets / "config.json")


def test_diff_and_open_with_assets_but_no_config_json_read_common_pt(tmp_path, cli, exports):
    import ckpttool

    target, result = exports["llama_tp2"]
    assert result.exit_code == 0, result.output
    tokenizer_only = tmp_path / "assets"
    tokenizer_only.mkdir()
    source = MEGATRON / "llama_tp2" / "checkpoints"
    compared = cli("diff", source, target, "--assets", tokenizer_only)
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output
    key = "model.layers.1.self_attn.k_proj.weight"
    with ckpttool.open(source, assets=tokenizer_only) as handle, ckpttool.open(target) as exported:
        assert_same_bytes(handle.get_tensor(key), exported.get_tensor(key), key)


# ---------------------------------------------------------------------------------------------
# A crafted common.pt: refused in one line, nothing written


def crafted_copy(tmp_path, edit) -> tuple:
    """A copy of llama_tp2's checkpoints whose common.pt data.pkl is `edit(bytes)`; returns
    (the run directory, the common.pt)."""
    run = tmp_path / "checkpoints"
    shutil.copytree(MEGATRON / "llama_tp2" / "checkpoints", run)
    common = common_file(run)
    with zipfile.ZipFile(common) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(common, "w", zipfile.ZIP_STORED) as archive:
        for filename, data in members:
            archive.writestr(filename, edit(data) if filename.endswith("/data.pkl") else data)
    return run, common


def test_a_common_pt_naming_a_foreign_global_exits_1_in_one_line_and_writes_nothing(tmp_path, cli):
    def foreign(data: bytes) -> bytes:
        assert data.count(b"csignal\nSignals\n") == 1
        return data.replace(b"csignal\nSignals\n", b"cos\nsystem\n")

    run, common = crafted_copy(tmp_path, foreign)
    result = cli("export", run, tmp_path / "out")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{common}:" in lines[0] and "os.system" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_a_common_pt_of_a_model_without_swiglu_exits_1_naming_the_arg(tmp_path, cli):
    def without_swiglu(data: bytes) -> bytes:  # the BUILD dict's `"swiglu": True` -> False
        key = b"X\x06\x00\x00\x00swigluq"  # BINUNICODE "swiglu", BINPUT n, then NEWTRUE
        at = data.index(key) + len(key) + 1
        assert data.count(key) == 1 and data[at:at + 1] == b"\x88"
        return data[:at] + b"\x89" + data[at + 1:]  # NEWFALSE

    run, common = crafted_copy(tmp_path, without_swiglu)
    result = cli("export", run, tmp_path / "out")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{common}: args swiglu=False" in lines[0] and "--assets" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_with_assets_a_common_pt_setting_the_tables_cannot_represent_still_exits_1_naming_it(tmp_path, cli):
    """--assets gives config.json, but common.pt says what the model computes: a rotary layout or
    activation the tables cannot write is refused whatever the config says (it was not checked
    when a config was given)."""
    def interleaved(data: bytes) -> bytes:  # the BUILD dict's `"rotary_interleaved": False` -> True
        key = b"X\x12\x00\x00\x00rotary_interleavedq"
        at = data.index(key) + len(key) + 1
        assert data.count(key) == 1 and data[at:at + 1] == b"\x89", data[at:at + 1]  # NEWFALSE
        return data[:at] + b"\x88" + data[at + 1:]  # NEWTRUE

    run, common = crafted_copy(tmp_path, interleaved)
    assets = MEGATRON / "llama_tp2" / "hf"
    result = cli("export", run, tmp_path / "out", "--assets", assets)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{common}: args rotary_interleaved=True" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    unchanged, _ = crafted_copy(tmp_path / "unchanged", lambda data: data)
    assert cli("export", unchanged, tmp_path / "unchanged" / "out", "--assets", assets, "--quiet").exit_code == 0


def test_a_common_pt_without_megatron_lms_args_still_asks_for_assets(tmp_path, cli):
    """A save by megatron-core alone keeps no `args`: the head counts come from --assets, as before."""
    def without_args(data: bytes) -> bytes:
        key = b"X\x04\x00\x00\x00args"
        assert data.count(key) == 1
        return data.replace(key, b"X\x04\x00\x00\x00argz")

    run, common = crafted_copy(tmp_path, without_args)
    assert read_args(common) is None
    result = cli("export", run, tmp_path / "out")
    assert result.exit_code == 2 and "num_attention_heads" in result.output and "--assets" in result.output
