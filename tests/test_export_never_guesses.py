"""Export never exits 0 with a guess: a framework's names with no config ask for --assets (exit
2), a check against transformers that cannot run says so (stderr and `"checked": false`), and
every float8 kind counts as codes that need their scales, which come only in the dtypes the FP8
formats define. Each of these exited 0 with something wrong before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES

TORCHTITAN_QWEN3 = FIXTURES / "frameworks" / "torchtitan_families" / "qwen3" / "checkpoint" / "step-2"
MEGATRON_MOE = FIXTURES / "frameworks" / "megatron_families" / "moe" / "checkpoints"


def test_framework_names_with_no_config_exit_2_asking_for_assets_and_write_nothing(tmp_path, cli):
    result = cli("export", TORCHTITAN_QWEN3, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "torchtitan qwen3's names" in result.stderr and "--assets" in result.stderr
    assert not (tmp_path / "out").exists()
    assets = TORCHTITAN_QWEN3.parents[1] / "hf"
    assert cli("export", TORCHTITAN_QWEN3, tmp_path / "out", "--assets", assets, "--quiet").exit_code == 0


def test_a_check_transformers_cannot_make_is_never_silent(tmp_path):
    """Without transformers (an import that fails, as on a machine that lacks it), a Qwen3-MoE
    export cannot be checked key by key: it still writes, says so on stderr, and `--json` has
    `"checked": false` with the reason."""
    blocked = tmp_path / "blocked" / "transformers"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('transformers blocked by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "ckpttool", "export", str(MEGATRON_MOE), str(tmp_path / "out"),
                             "--json", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["checked"] is False
    assert "transformers is not installed" in document["check"] and "pip install 'transformers>=5'" in document["check"]
    assert "the weights were not checked against" in result.stderr and "transformers is not installed" in result.stderr
    ours = subprocess.run([sys.executable, "-m", "ckpttool", "export", str(MEGATRON_MOE), str(tmp_path / "checked"),
                           "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr
    assert json.loads(ours.stdout)["checked"] is True and "not checked" not in ours.stderr


def _save(path: Path, state: dict) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_float8_codes_of_a_kind_no_format_scales_are_never_cast(tmp_path, cli, dtype):
    import torch

    codes = torch.arange(16, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(4, 4)
    src = _save(tmp_path / "ckpt", {"model": {"proj.weight": codes, "norm.weight": torch.ones(4)}})
    result = cli("consolidate", src, tmp_path / "out.safetensors", "--dtype", "bf16", "--quiet")
    assert result.exit_code == 1, result.output
    assert "model.proj.weight" in result.stderr and f"{dtype} codes" in result.stderr and "refusing to cast" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()
    inspected = json.loads(cli("inspect", src, "--json").stdout)
    assert inspected["quantization"] is not None and any("proj.weight" in p for p in inspected["quantization"]["problems"])


@pytest.mark.parametrize("scale_dtype", ["float8_e8m0fnu", "float8_e4m3fn", "float64"])
def test_an_fp8_scale_in_a_dtype_the_format_does_not_define_is_refused(tmp_path, cli, scale_dtype):
    import torch

    codes = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    scale = torch.ones(1, 1).to(getattr(torch, scale_dtype))
    src = _save(tmp_path / "ckpt", {"model": {"proj.weight": codes, "proj.weight_scale_inv": scale}})
    result = cli("consolidate", src, tmp_path / "out.safetensors", "--dtype", "bf16", "--quiet")
    assert result.exit_code == 1, result.output
    assert f"({scale_dtype}) does not scale" in result.stderr
    float32 = _save(tmp_path / "float32", {"model": {"proj.weight": codes, "proj.weight_scale_inv": torch.ones(1, 1)}})
    assert cli("consolidate", float32, tmp_path / "ok.safetensors", "--dtype", "bf16", "--quiet").exit_code == 0


TITAN = FIXTURES / "frameworks" / "torchtitan_families"


def test_a_non_zero_router_bias_the_table_leaves_out_exits_1_unless_drop_names_it(tmp_path, cli):
    step, assets = TITAN / "qwen3_moe" / "checkpoint" / "step-2", TITAN / "qwen3_moe" / "hf"
    result = cli("export", step, tmp_path / "out", "--assets", assets, "--quiet")
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "[dropped-tensor]" in line and "layers.0.moe.expert_bias_E is not zero" in line
    assert "--drop 'layers.*.moe.expert_bias_E'" in line and not (tmp_path / "out").exists()
    result = cli("export", step, tmp_path / "out", "--assets", assets, "--drop", "*.moe.expert_bias_E", "--json", "--quiet")
    assert result.exit_code == 0, result.output
    left_out = {row["key"]: row["rule"] for row in json.loads(result.stdout)["left_out"]}
    assert left_out["layers.0.moe.expert_bias_E"] == "torchtitan qwen3 leaves out layers.{L}.moe.expert_bias_E"
    assert set(left_out) == {"layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"}
    assert "left out layers.0.moe.expert_bias_E" in result.stderr


def test_every_model_tensor_is_written_or_listed_as_left_out(tmp_path, cli):
    from safetensors import safe_open

    step, assets = TITAN / "qwen3_moe" / "checkpoint" / "step-2", TITAN / "qwen3_moe" / "hf"
    result = cli("export", step, tmp_path / "out", "--assets", assets, "--drop", "*.moe.expert_bias_E", "--json", "--quiet")
    left_out = {row["key"] for row in json.loads(result.stdout)["left_out"]}
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        written = set(f.keys())
    model = [t for t in json.loads(cli("inspect", step, "--json").stdout)["tensors"] if t["group"] == "model"]
    assert model and left_out
    for tensor in model:  # each source tensor: its transformers names written, or listed as left out
        assert (tensor["hf_names"] and set(tensor["hf_names"]) <= written) != (tensor["fqn"] in left_out), tensor["fqn"]


def test_a_tied_config_whose_head_is_not_the_embedding_exits_1(tmp_path, cli):
    """A config saying tie_word_embeddings for a model trained with its own head would load the
    embedding in the head's place: refused, naming the head."""
    config = json.loads((TITAN / "llama3" / "hf" / "config.json").read_text())
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    result = cli("export", TITAN / "llama3" / "checkpoint" / "step-2", tmp_path / "out", "--assets", tmp_path / "assets")
    assert result.exit_code == 1, result.output
    assert "lm_head.weight differs from tok_embeddings.weight" in result.stderr and "[dropped-tensor]" in result.stderr
    assert not (tmp_path / "out").exists()
