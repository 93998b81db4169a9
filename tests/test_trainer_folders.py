"""The folders trainers write, read as they are: Lightning's DeepSpeedStrategy run folders
(`checkpoints/epoch=0-step=N.ckpt/`, `latest` naming `checkpoint/`) and HF Trainer's with a
DeepSpeed config (`run/checkpoint-N/`: `global_stepN/`, `latest`, and at ZeRO-2 or ZeRO-3 with
the gathered module, `model.safetensors`). Written by the trainers' own save paths
(fixtures/frameworks/generate_lightning_deepspeed.py, generate_hf_trainer_deepspeed.py name the
versions). From the checkpoint folder and from the run folder:

- inspect, validate and consolidate exit 0, and consolidate is DeepSpeed's own
  `get_fp32_state_dict_from_zero_checkpoint` byte for byte, with exactly its keys (Lightning's:
  behind the LightningModule's `model.` attribute, which ckpttool reads past);
- export --assets loads in transformers with nothing missing or unexpected;
- reshard --world 2 carries each parameter's exp_avg, exp_avg_sq and step as DeepSpeed held them.

The trained model's logits are compared within a stated tolerance, not bit for bit: the weights
are checked byte for byte above, and float32 logits computed by another CPU's kernels may differ
in the last bits (the generator stored them on its machine).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import FIXTURES

FRAMEWORKS = FIXTURES / "frameworks"
LIGHTNING = FRAMEWORKS / "lightning_deepspeed"
LIGHTNING_CASES = ("zero2_tied", "zero2_untied", "zero3_tied", "zero3_untied", "zero2_bf16_tied")
NEWEST = "epoch=0-step=10.ckpt"  # sorts before epoch=0-step=5.ckpt: name order would take the older save
# logits of the same weights on another CPU: float32 sums of at most 17 products in another order
# (hidden 14, MLP 17) differ by a few ulps of values ~10; bf16 ones by a few bf16 ulps
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2}


def lightning_case(case: str) -> dict:
    root = LIGHTNING / case
    expected = json.loads((root / "expected.json").read_text())
    return {"root": root, "run": root / "checkpoints", "checkpoint": root / "checkpoints" / NEWEST,
            "expected": expected, "optimizer": json.loads((root / "optimizer.json").read_text()),
            "assets": root / "hf_config", "names": expected["transformers_names"],
            "bf16": "bf16" in case}


def sha256(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_every_listed_trainer_fixture_is_there():
    for case in LIGHTNING_CASES:
        root = LIGHTNING / case
        for name in ("expected.json", "optimizer.json", "hf_config/config.json", "logits.safetensors",
                     f"checkpoints/{NEWEST}/latest", f"checkpoints/{NEWEST}/checkpoint", "checkpoints/epoch=0-step=5.ckpt"):
            assert (root / name).exists(), root / name


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory, run):
    cache: dict = {}

    def get(case: str, where: str):
        if (case, where) not in cache:
            from safetensors.torch import load_file

            found = lightning_case(case)
            out = tmp_path_factory.mktemp("consolidated") / f"{case}-{where}.safetensors"
            result = run("consolidate", found[where], out, "--quiet")
            assert result.exit_code == 0, result.output
            cache[case, where] = load_file(out)
        return cache[case, where]

    return get


@pytest.mark.parametrize("where", ["run", "checkpoint"])
@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_deepspeed_inspects_validates_and_consolidates_as_zero_to_fp32(run, consolidated, case, where):
    found = lightning_case(case)
    inspected = run("inspect", found[where], "--json")
    assert inspected.exit_code == 0, inspected.output
    document = json.loads(inspected.stdout)
    assert document["layout"] == "deepspeed" and document["path"] == str(found["checkpoint"] / "checkpoint")
    assert run("validate", found[where]).exit_code == 0
    ours = consolidated(case, where)
    reference = {found["names"][key]: row for key, row in found["expected"]["tensors"].items()}
    assert sorted(ours) == sorted(reference)  # exactly zero_to_fp32's keys, in transformers' names
    for key, row in reference.items():
        assert (list(ours[key].shape), str(ours[key].dtype).removeprefix("torch."), sha256(ours[key])) == (
            row["shape"], row["dtype"], row["sha256"]), key


@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_deepspeed_export_loads_in_transformers_and_gives_the_trained_logits(run, tmp_path, case):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    found = lightning_case(case)
    out = tmp_path / "hf"
    cast = ("--dtype", "bf16") if found["bf16"] else ()  # the module trained in bf16: its masters' rounding
    result = run("export", found["run"], out, "--assets", found["assets"], "--quiet", *cast)
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()) or not any(info.values()), info
    stored = load_file(found["root"] / "logits.safetensors")
    with torch.no_grad():
        logits = model(stored["input_ids"]).logits.float()
    tolerance = LOGIT_TOLERANCE["bfloat16" if found["bf16"] else "float32"]
    assert torch.allclose(logits, stored["logits"], rtol=0, atol=tolerance), (logits - stored["logits"]).abs().max()


@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_deepspeed_reshard_carries_deepspeeds_optimizer_state(run, tmp_path, case):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    found = lightning_case(case)
    out = tmp_path / "fsdp2"
    result = run("reshard", found["run"], out, "--world", "2", "--quiet")
    assert result.exit_code == 0, result.output
    dcp_to_torch_save(out, tmp_path / "all.pt")  # torch's own reader of the DCP written
    state = torch.load(tmp_path / "all.pt", weights_only=True)
    optimizer = found["optimizer"]
    parameters = {key.rsplit(".", 1)[0] for key in optimizer["tensors"] if key.endswith(".exp_avg")}
    assert parameters and len(parameters) == len({k.rsplit(".", 1)[0] for k in optimizer["tensors"]})
    for fqn in sorted(parameters):
        saved = state["optim"]["state"][fqn]
        for name in ("exp_avg", "exp_avg_sq"):
            row = optimizer["tensors"][f"{fqn}.{name}"]
            assert (list(saved[name].shape), sha256(saved[name])) == (row["shape"], row["sha256"]), (fqn, name)
        assert float(saved["step"]) == optimizer["step"], fqn
        master = optimizer["tensors"][f"{fqn}.fp32"]
        assert sha256(state["model"][fqn]) == master["sha256"], fqn
