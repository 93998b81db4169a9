"""torchtitan 0.2's names (before 0.3 renamed its modules: `attention.wq`, `output`, grouped
experts `moe.experts.w1`), one family file each (naming/families/torchtitan_v02_*.py), on
checkpoints torchtitan 0.2.2 wrote itself from 2-rank FSDP2 runs
(fixtures/frameworks/generate_torchtitan_v02.py): `export` writes exactly the tensors torchtitan
0.2.2's own `to_hf` gives (expected_hf.json: every key, shape, dtype and sha256), and
transformers loads the folder with nothing missing, unexpected or misshapen.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import FIXTURES

V02 = FIXTURES / "frameworks" / "torchtitan_v02"
CASES = sorted(p.parent.name for p in V02.glob("*/expected_hf.json")) if V02.is_dir() else []
FAMILY = {"llama3": "torchtitan 0.2 llama3", "qwen3_moe": "torchtitan 0.2 qwen3"}


def step_of(case: str):
    return next((V02 / case / "checkpoint").iterdir())


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("v02")
    return {case: (root / case, run("export", step_of(case), root / case, "--assets", V02 / case / "hf_config"))
            for case in CASES}


def test_both_cases_are_there():
    assert CASES == ["llama3", "qwen3_moe"]


@pytest.mark.parametrize("case", CASES)
def test_the_family_is_chosen_by_structure_and_each_tensor_named(case, cli):
    """The 0.2 names are found by their signature, before 0.3's tables whose signatures they
    also meet (qwen3's q_norm): `inspect` names the 0.2 family and every tensor's transformers names."""
    document = json.loads(cli("inspect", step_of(case), "--json").output)
    assert document["family"]["name"] == FAMILY[case]
    names = {t["fqn"]: t["hf_names"] for t in document["tensors"] if t["group"] == "model"}
    assert names["output.weight"] == ["lm_head.weight"]
    assert names["layers.1.attention.wq.weight"] == ["model.layers.1.self_attn.q_proj.weight"]
    if case == "qwen3_moe":
        assert names["layers.0.moe.experts.w2"] == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]
        assert names["layers.0.moe.expert_bias"] == []  # dropped by to_hf


@pytest.mark.parametrize("case", CASES)
def test_export_gives_exactly_torchtitan_02s_to_hf_byte_for_byte(exports, case):
    import torch
    from safetensors import safe_open

    target, result = exports[case]
    assert result.exit_code == 0, result.output
    assert f"converted {FAMILY[case]} names" in result.output
    expected = json.loads((V02 / case / "expected_hf.json").read_text())["tensors"]
    written = {}
    for file in sorted(target.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                written[key] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                                "sha256": hashlib.sha256(raw).hexdigest()}
    assert sorted(written) == sorted(expected)
    for key, found in written.items():
        assert found == {name: expected[key][name] for name in ("shape", "dtype", "sha256")}, key


@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_the_export_with_nothing_missing_or_unexpected(exports, case):
    import torch
    import transformers

    target, result = exports[case]
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 17, 42, 5]])).logits).all()


@pytest.mark.parametrize("case", CASES)
def test_diff_of_the_checkpoint_against_its_export_says_identical(exports, case, cli):
    target, result = exports[case]
    assert result.exit_code == 0, result.output
    compared = cli("diff", step_of(case), target, "--assets", V02 / case / "hf_config")
    assert compared.exit_code == 0 and compared.output.startswith("IDENTICAL"), compared.output
