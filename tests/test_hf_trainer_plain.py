"""The `checkpoint-N/` folders Hugging Face's Trainer writes without DeepSpeed, read from the checkpoint
folder and from the run folder (the Trainer's output_dir) by the CLI: inspect, validate, consolidate,
export, with the exported folder loaded by transformers.

Fixtures: fixtures/frameworks/hf_trainer_plain/<case>/ written by transformers 5.24.0's Trainer
(fixtures/frameworks/generate_hf_trainer_plain.py), a tiny untied LlamaForCausalLM, 10 steps:
- plain: one CPU process; run/checkpoint-5/ and run/checkpoint-10/, each with the Trainer's own
  model.safetensors + config.json beside optimizer.pt, scheduler.pt, rng_state.pth, ...
- fsdp: FSDP2 (`fsdp=True`, SHARDED_STATE_DICT) at world size 2 on gloo; run/checkpoint-10/ holds
  accelerate's DCP folders pytorch_model_fsdp_0/ and optimizer_0/ and no config.json, so export takes
  model_config/ (the model's config, written by the generator) as --assets.
expected.json: name, shape, dtype and sha256 of every tensor of the model at step 10.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from test_deepspeed import sha256_of

ROOT = FIXTURES / "frameworks" / "hf_trainer_plain"
CASES = {  # case -> (layout, files of run/checkpoint-10 the test relies on, --assets folder or None)
    "plain": ("hub-folder", ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                             "trainer_state.json", "training_args.bin"], None),
    "fsdp": ("accelerate", ["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                            "pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "optimizer_0/__0_0.distcp",
                            "optimizer_0/__1_0.distcp", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
                            "trainer_state.json"], "model_config"),
}
RUNS = {"plain": ["checkpoint-10", "checkpoint-5"], "fsdp": ["checkpoint-10"]}  # fsdp: save_total_limit 1
WHERE = ("checkpoint", "run")


def source(case: str, where: str) -> Path:
    """The Trainer's checkpoint folder, or its output_dir holding the checkpoint folders."""
    return ROOT / case / "run" / ("checkpoint-10" if where == "checkpoint" else "")


def expected(case: str) -> dict:
    return json.loads((ROOT / case / "expected.json").read_text())["tensors"]


@pytest.mark.parametrize("case", CASES)
def test_the_fixture_holds_the_files_the_trainer_wrote(case):
    _, files, assets = CASES[case]
    assert sorted(p.name for p in (ROOT / case / "run").iterdir()) == RUNS[case]
    for name in files:
        assert (ROOT / case / "run" / "checkpoint-10" / name).is_file(), name
    if assets:
        assert (ROOT / case / assets / "config.json").is_file()
        assert not (ROOT / case / "run" / "checkpoint-10" / "config.json").exists()
    assert len(expected(case)) == 21


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CASES)
def test_inspect_names_the_layout_and_validate_passes(cli, case, where):
    result = cli("inspect", source(case, where), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layout"] == CASES[case][0]
    result = cli("validate", source(case, where))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CASES)
def test_consolidate_gives_the_step_10_model_byte_for_byte_with_exactly_its_keys(cli, tmp_path, case, where):
    from safetensors.torch import load_file

    result = cli("consolidate", source(case, where), tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.output
    ours, reference = load_file(tmp_path / "out.safetensors"), expected(case)
    assert sorted(ours) == sorted(reference)
    for fqn, fact in reference.items():
        assert (str(ours[fqn].dtype).removeprefix("torch."), list(ours[fqn].shape)) == (fact["dtype"], fact["shape"]), fqn
        assert sha256_of(ours[fqn]) == fact["sha256"], fqn


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_nothing_missing_or_unexpected(cli, tmp_path, case, where):
    transformers = pytest.importorskip("transformers")
    assets = CASES[case][2]
    out = tmp_path / "hf"
    result = cli("export", source(case, where), out, *(["--assets", ROOT / case / assets] if assets else []))
    assert result.exit_code == 0, result.output
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    for fqn, fact in expected(case).items():
        assert sha256_of(state[fqn]) == fact["sha256"], fqn
