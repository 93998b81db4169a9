"""`ckpttool.load_into` of transformers 5's fused-expert MoE modules (Qwen3-MoE, DeepSeek-V3,
Mixtral: `mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]) from
checkpoints that store one key per expert: a framework's (torchtitan, Megatron-Core at tensor
parallel 2 and expert parallel 2) under `assets=`, `export`'s folder of one, and transformers'
own `save_pretrained` folder. Each module tensor must be byte for byte what `from_pretrained`
of the exported folder holds; the joining is naming/fused.py's table (transformers'
conversion_mapping.py as data), planned without files first.
"""

from __future__ import annotations

import pytest

from conftest import FIXTURES, assert_same_bytes

from ckpttool.core.errors import UsageError
from ckpttool.naming.fused import Slot, plan_fill

TITAN = FIXTURES / "frameworks" / "torchtitan_families"
MEGATRON = FIXTURES / "frameworks" / "megatron_families"
# name -> (checkpoint, its transformers config folder)
SOURCES = {
    "torchtitan-qwen3_moe": (TITAN / "qwen3_moe" / "checkpoint" / "step-2", TITAN / "qwen3_moe" / "hf"),
    "torchtitan-qwen3_moe-ep2": (TITAN / "qwen3_moe" / "ep2_world4" / "checkpoint" / "step-2", TITAN / "qwen3_moe" / "hf"),
    "megatron-moe-tp2": (MEGATRON / "moe" / "checkpoints", MEGATRON / "moe" / "hf"),
    "megatron-moe-ep2": (MEGATRON / "moe_ep2" / "checkpoints", MEGATRON / "moe_ep2" / "hf"),
}


# -- the plan, without files -----------------------------------------------------------------------

def test_experts_stack_on_dim_0_and_gate_rows_come_before_up_rows():
    parts = {f"l.mlp.experts.{e}.{p}_proj.weight": (3, 5) for e in range(2) for p in ("up", "gate")}
    plan = plan_fill({"l.mlp.experts.gate_up_proj": (2, 6, 5)}, parts, "ckpt")
    assert plan.fused["l.mlp.experts.gate_up_proj"] == (
        Slot("l.mlp.experts.0.gate_proj.weight", 0, 0, 3), Slot("l.mlp.experts.0.up_proj.weight", 0, 3, 3),
        Slot("l.mlp.experts.1.gate_proj.weight", 1, 0, 3), Slot("l.mlp.experts.1.up_proj.weight", 1, 3, 3))
    assert (plan.missing, plan.unexpected, plan.direct) == ([], [], {})


def test_mixtral_names_are_renamed_to_the_modules_and_w1_w3_fused():
    checkpoint = {"l.block_sparse_moe.gate.weight": (2, 4), **{f"l.block_sparse_moe.experts.{e}.w{w}.weight": (3, 4)
                                                                for e in range(2) for w in (1, 3)}}
    plan = plan_fill({"l.mlp.gate.weight": (2, 4), "l.mlp.experts.gate_up_proj": (2, 6, 4)}, checkpoint, "ckpt")
    assert plan.direct == {"l.mlp.gate.weight": "l.block_sparse_moe.gate.weight"}
    assert [slot.key for slot in plan.fused["l.mlp.experts.gate_up_proj"]] == [
        "l.block_sparse_moe.experts.0.w1.weight", "l.block_sparse_moe.experts.0.w3.weight",
        "l.block_sparse_moe.experts.1.w1.weight", "l.block_sparse_moe.experts.1.w3.weight"]


def test_an_expert_short_is_missing_the_fused_tensor_and_the_others_unexpected():
    checkpoint = {f"l.experts.{e}.down_proj.weight": (4, 3) for e in range(2)}
    plan = plan_fill({"l.experts.down_proj": (3, 4, 3)}, checkpoint, "ckpt")
    assert plan.missing == ["l.experts.down_proj"] and plan.unexpected == sorted(checkpoint)


def test_parts_that_do_not_add_up_to_the_fused_shape_name_the_tensor():
    checkpoint = {f"l.experts.{e}.{p}_proj.weight": (3, 5) for e in range(2) for p in ("gate", "up")}
    with pytest.raises(UsageError, match=r"ckpt: l.experts.0.gate_proj.weight \+ l.experts.0.up_proj.weight give 6 rows"):
        plan_fill({"l.experts.gate_up_proj": (2, 8, 5)}, checkpoint, "ckpt")
    with pytest.raises(UsageError, match=r"ckpt: l.experts.0.gate_proj.weight has shape \[3, 5\]"):
        plan_fill({"l.experts.gate_up_proj": (2, 6, 4)}, checkpoint, "ckpt")


# -- real checkpoints ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict:
    """Each source exported once (`ckpttool export --assets`), and transformers' model of it."""
    import transformers

    root = tmp_path_factory.mktemp("fused")
    out = {}
    for name, (checkpoint, assets) in SOURCES.items():
        drop = ("--drop", "*.moe.expert_bias_E") if "qwen3_moe" in name else ()  # the router bias: told to leave it out
        result = run("export", checkpoint, root / name, "--assets", assets, "-q", *drop)
        assert result.exit_code == 0, result.output
        out[name] = (root / name, transformers.AutoModelForCausalLM.from_pretrained(root / name))
    return out


def fresh_model(config_dir, dtype=None):
    import torch
    import transformers

    torch.manual_seed(5)  # random init: every byte the load does not write shows
    config = transformers.AutoConfig.from_pretrained(config_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def assert_same_model(model, reference) -> None:
    expected = reference.state_dict()
    assert list(model.state_dict()) == list(expected)
    for key, value in model.state_dict().items():
        assert_same_bytes(value, expected[key], key)


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("source", ["checkpoint", "export"])
def test_load_into_fills_fused_experts_as_from_pretrained_of_the_export(exports, name, source):
    import ckpttool

    checkpoint, assets = SOURCES[name]
    export_dir, reference = exports[name]
    model = fresh_model(assets)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    if source == "checkpoint":
        result = ckpttool.load_into(model, checkpoint, assets=assets)
    else:
        result = ckpttool.load_into(model, export_dir)
    assert result == ([], [])
    assert_same_model(model, reference)


def test_fused_experts_are_read_into_the_modules_memory_one_part_at_a_time(exports, monkeypatch):
    """No whole tensor is assembled beside the module: each part lands in a slice of the fused
    tensor's own bytes (get_tensor, which allocates, is never called)."""
    import ckpttool
    from ckpttool.load import CheckpointFile

    fills = []
    fill = CheckpointFile._fill

    def recording_fill(self, tensor, dtype, view):
        fills.append((tensor.fqn, view.obj is not None and len(view)))
        return fill(self, tensor, dtype, view)

    def no_get_tensor(self, *args, **kwargs):
        raise AssertionError("a tensor was allocated whole")

    monkeypatch.setattr(CheckpointFile, "_fill", recording_fill)
    monkeypatch.setattr(CheckpointFile, "get_tensor", no_get_tensor)
    export_dir, reference = exports["megatron-moe-ep2"]
    model = fresh_model(export_dir)
    assert ckpttool.load_into(model, export_dir) == ([], [])
    assert_same_model(model, reference)
    experts = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    part_bytes = experts[0, : experts.shape[1] // 2].numel() * experts.element_size()
    assert ("model.layers.0.mlp.experts.3.up_proj.weight", part_bytes) in fills


def test_a_bfloat16_module_gets_each_part_cast_as_from_pretrained_casts(exports):
    import torch

    import ckpttool

    export_dir, _ = exports["torchtitan-qwen3_moe"]
    model = fresh_model(export_dir, dtype=torch.bfloat16)
    assert ckpttool.load_into(model, export_dir) == ([], [])
    import transformers

    assert_same_model(model, transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16))


def test_strict_names_a_fused_tensor_the_checkpoint_cannot_fill(exports, tmp_path):
    """An export with one expert's up_proj taken out: layer 0's gate_up_proj is missing, its
    other parts unexpected (none fills half a fused tensor); strict=False loads the rest."""
    import shutil

    from safetensors.torch import load_file, save_file

    import ckpttool

    export_dir, reference = exports["megatron-moe-ep2"]
    shutil.copytree(export_dir, tmp_path / "hf")
    (weights,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(weights))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    model = fresh_model(export_dir)
    with pytest.raises(UsageError, match="missing model.layers.0.mlp.experts.gate_up_proj, unexpected "
                                         "model.layers.0.mlp.experts.0.gate_proj.weight"):
        ckpttool.load_into(model, tmp_path / "hf")
    result = ckpttool.load_into(model, tmp_path / "hf", strict=False)
    assert result.missing_keys == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert sorted(result.unexpected_keys) == sorted([f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)]
                                                    + [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(3)])
    expected = reference.state_dict()
    for key, value in model.state_dict().items():
        if key != "model.layers.0.mlp.experts.gate_up_proj":
            assert_same_bytes(value, expected[key], key)


def test_a_mixtral_saved_by_transformers_loads_back_byte_for_byte(tmp_path):
    """save_pretrained writes Mixtral's hub names (`block_sparse_moe.experts.N.w1/w2/w3`)."""
    import torch
    import transformers

    import ckpttool

    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
                                        num_experts_per_tok=2, max_position_embeddings=16)
    torch.manual_seed(0)
    saved = transformers.MixtralForCausalLM(config)
    saved.save_pretrained(tmp_path)
    torch.manual_seed(1)
    model = transformers.MixtralForCausalLM(config)
    assert ckpttool.load_into(model, tmp_path) == ([], [])
    assert_same_model(model, saved)
    assert_same_model(model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path))


def test_deepseek_v3s_extra_layer_is_unexpected_as_transformers_reports_it(tmp_path, run):
    """transformers builds no multi-token-prediction layer (`model.layers.2.*`): its keys are
    what is unexpected (as the checkpoint names them: one per expert, where from_pretrained
    names its fused ones), every module tensor is what from_pretrained holds."""
    import transformers
    from safetensors import safe_open

    import ckpttool

    checkpoint, assets = TITAN / "deepseek_v3" / "checkpoint" / "step-2", TITAN / "deepseek_v3" / "hf"
    result = run("export", checkpoint, tmp_path / "hf", "--assets", assets, "-q")
    assert result.exit_code == 0, result.output
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    model = fresh_model(assets)
    loaded = ckpttool.load_into(model, checkpoint, assets=assets, strict=False)
    with safe_open(next((tmp_path / "hf").glob("*.safetensors")), "pt") as written:
        extra_layer = sorted(key for key in written.keys() if key.startswith("model.layers.2."))
    assert loaded.missing_keys == [] and sorted(loaded.unexpected_keys) == extra_layer
    assert {key.removeprefix("model.layers.2.").split(".")[0] for key in info["unexpected_keys"]} == {
        key.removeprefix("model.layers.2.").split(".")[0] for key in extra_layer}
    assert_same_model(model, reference)
