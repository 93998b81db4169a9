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

import pytest

from conftest import FIXTURES

FRAMEWORKS = FIXTURES / "frameworks"
LIGHTNING = FRAMEWORKS / "lightning_deepspeed"
LIGHTNING_CASES = ("zero2_tied", "zero2_untied", "zero3_tied", "zero3_untied", "zero2_bf16_tied")
HF_TRAINER = FRAMEWORKS / "hf_trainer_deepspeed"
HF_TRAINER_CASES = ("zero2_fp32", "zero2_bf16", "zero3_fp32", "zero3_bf16")  # ZeRO-3 fp32: no module written
CASES = LIGHTNING_CASES + tuple(f"hf-{case}" for case in HF_TRAINER_CASES)
NEWEST = "epoch=0-step=10.ckpt"  # sorts before epoch=0-step=5.ckpt: name order would take the older save
# logits of the same weights on another CPU: float32 sums of at most 17 products in another order
# (hidden 14, MLP 17) differ by a few ulps of values ~10; bf16 ones by a few bf16 ulps
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2}


def lightning_case(case: str) -> dict:
    root = LIGHTNING / case
    expected = json.loads((root / "expected.json").read_text())
    return {"root": root, "run": root / "checkpoints", "checkpoint": root / "checkpoints" / NEWEST,
            "save": root / "checkpoints" / NEWEST / "checkpoint",
            "expected": expected, "optimizer": json.loads((root / "optimizer.json").read_text()),
            "assets": root / "hf_config", "names": expected["transformers_names"],
            "bf16": "bf16" in case}


def trainer_case(case: str) -> dict:
    """HF Trainer's output_dir (`run/`), its newest `checkpoint-10/` and the ZeRO save inside."""
    root = HF_TRAINER / case
    expected = json.loads((root / "expected.json").read_text())
    checkpoint = root / "run" / "checkpoint-10"
    return {"root": root, "run": root / "run", "checkpoint": checkpoint, "save": checkpoint / "global_step10",
            "expected": expected, "optimizer": json.loads((root / "optimizer.json").read_text()),
            "assets": checkpoint, "names": {key: key for key in expected["tensors"]}, "bf16": "bf16" in case,
            "module": expected["trainer_files"].get("model.safetensors")}


def case_of(case: str) -> dict:
    return trainer_case(case.removeprefix("hf-")) if case.startswith("hf-") else lightning_case(case)


def sha256(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_every_listed_trainer_fixture_is_there():
    for case in LIGHTNING_CASES:
        root = LIGHTNING / case
        for name in ("expected.json", "optimizer.json", "hf_config/config.json", "logits.safetensors",
                     f"checkpoints/{NEWEST}/latest", f"checkpoints/{NEWEST}/checkpoint", "checkpoints/epoch=0-step=5.ckpt"):
            assert (root / name).exists(), root / name
    for case in HF_TRAINER_CASES:
        root = HF_TRAINER / case
        for name in ("expected.json", "optimizer.json", "logits.safetensors", "run/checkpoint-10/config.json",
                     "run/checkpoint-10/latest", "run/checkpoint-10/global_step10", "run/checkpoint-5/global_step5"):
            assert (root / name).exists(), root / name
        assert (root / "run" / "checkpoint-10" / "model.safetensors").exists() == (case != "zero3_fp32")


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory, run):
    cache: dict = {}

    def get(case: str, where: str):
        if (case, where) not in cache:
            from safetensors.torch import load_file

            found = case_of(case)
            out = tmp_path_factory.mktemp("consolidated") / f"{case}-{where}.safetensors"
            result = run("consolidate", found[where], out, "--quiet")
            assert result.exit_code == 0, result.output
            cache[case, where] = load_file(out)
        return cache[case, where]

    return get


@pytest.mark.parametrize("where", ["run", "checkpoint"])
@pytest.mark.parametrize("case", CASES)
def test_trainer_folder_inspects_validates_and_consolidates_as_zero_to_fp32(run, consolidated, case, where):
    found = case_of(case)
    inspected = run("inspect", found[where], "--json")
    assert inspected.exit_code == 0, inspected.output
    document = json.loads(inspected.stdout)
    assert document["layout"] == "deepspeed" and document["path"] == str(found["save"])
    if found.get("module"):  # the Trainer's model.safetensors beside the ZeRO save: shown, not read
        assert f"not read: hub-folder {found['checkpoint']}" in document["found"]
    assert run("validate", found[where]).exit_code == 0
    ours = consolidated(case, where)
    reference = {found["names"][key]: row for key, row in found["expected"]["tensors"].items()}
    assert sorted(ours) == sorted(reference)  # exactly zero_to_fp32's keys, in transformers' names
    for key, row in reference.items():
        assert (list(ours[key].shape), str(ours[key].dtype).removeprefix("torch."), sha256(ours[key])) == (
            row["shape"], row["dtype"], row["sha256"]), key


@pytest.mark.parametrize("case", [f"hf-{case}" for case in HF_TRAINER_CASES if case != "zero3_fp32"])
def test_the_trainers_16_bit_module_is_the_zero_saves_masters_cast(run, tmp_path, case):
    """Why the ZeRO save is read by default: the model.safetensors the Trainer writes beside it
    is its fp32 masters rounded to the module's dtype, byte for byte, so nothing is lost."""
    from safetensors.torch import load_file

    found = case_of(case)
    module = found["module"]["tensors"]
    dtype = {row["dtype"] for row in module.values()}
    assert len(dtype) == 1
    out = tmp_path / "cast.safetensors"
    cast = ("--dtype", "bf16") if dtype == {"bfloat16"} else ()
    assert run("consolidate", found["run"], out, "--quiet", *cast).exit_code == 0
    ours = load_file(out)
    assert sorted(ours) == sorted(module)
    assert all(sha256(ours[key]) == row["sha256"] for key, row in module.items())


@pytest.mark.parametrize("case", CASES)
def test_trainer_folder_export_loads_in_transformers_and_gives_the_trained_logits(run, tmp_path, case):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    found = case_of(case)
    out = tmp_path / "hf"
    # Lightning's bf16 logits are the bf16 module's, its masters' rounding; HF Trainer's oracle
    # logits come from the fp32 masters (the generator loaded zero_to_fp32's tensors)
    cast = ("--dtype", "bf16") if found["bf16"] and not case.startswith("hf-") else ()
    result = run("export", found["run"], out, "--assets", found["assets"], "--quiet", *cast)
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()) or not any(info.values()), info
    stored = load_file(found["root"] / "logits.safetensors")
    with torch.no_grad():
        logits = model(stored["input_ids"]).logits.float()
    tolerance = LOGIT_TOLERANCE["bfloat16" if cast else "float32"]
    assert torch.allclose(logits, stored["logits"], rtol=0, atol=tolerance), (logits - stored["logits"]).abs().max()


@pytest.mark.parametrize("case", CASES)
def test_trainer_folder_reshard_carries_deepspeeds_optimizer_state(run, tmp_path, case):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    found = case_of(case)
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


# -- HF Trainer with PEFT: a save that left its frozen base out (exclude_frozen_parameters) ----------

PEFT = HF_TRAINER / "peft_zero2_exclude_frozen"


def test_an_exclude_frozen_save_says_so_in_inspect_and_validate_and_refuses_a_full_model(run, tmp_path):
    inspected = json.loads(run("inspect", PEFT / "run", "--json").stdout)
    [note] = inspected["notes"]
    assert "exclude_frozen_parameters" in note and "q_proj.base_layer.weight" in note
    result = run("validate", PEFT / "run", "--json")
    assert result.exit_code == 0 and [p["code"] for p in json.loads(result.stdout)["problems"]] == ["parameters-absent"]
    for command, out in (("consolidate", tmp_path / "m.safetensors"), ("export", tmp_path / "hf")):
        result = run(command, PEFT / "run", out)
        assert result.exit_code == 1 and "[parameters-absent]" in result.stderr and "export --adapter" in result.stderr
        assert not out.exists()


def test_an_exclude_frozen_save_exports_its_adapter_which_peft_loads_on_the_base(run, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    expected = json.loads((PEFT / "expected.json").read_text())["tensors"]
    out = tmp_path / "adapter"
    result = run("export", PEFT / "run", out, "--adapter", "--quiet")  # adapter_config.json: in checkpoint-10/
    assert result.exit_code == 0, result.output
    ours = load_file(out / "adapter_model.safetensors")
    assert sorted(ours) == sorted(key.replace(".default.", ".") for key in expected)  # PEFT's file names
    for key, row in expected.items():
        assert sha256(ours[key.replace(".default.", ".")]) == row["sha256"], key  # zero_to_fp32's masters
    base = AutoModelForCausalLM.from_pretrained(PEFT / "base_model")
    model = PeftModel.from_pretrained(base, out)
    loaded = {name: tensor for name, tensor in model.state_dict().items() if "lora_" in name}
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[key], ours[key.replace(".default.", ".")]) for key in expected)


@pytest.mark.parametrize("case", ["zero3_fp32", "zero2_bf16"])
def test_export_of_a_trainer_run_takes_config_json_from_the_step_folder(run, tmp_path, case):
    """No --assets: the config.json the Trainer wrote beside global_stepN/ names the model."""
    from transformers import AutoModelForCausalLM

    found = trainer_case(case)
    result = run("export", found["run"], tmp_path / "hf", "--quiet")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info


# -- the other fixtures, from the folder their own tests do not start at --------------------------

@pytest.mark.parametrize("case", ["zero2_cpuadam_offload", "zero3_cpuadam_offload"])
def test_a_cpuadam_world_3_save_consolidates_from_its_tag_folder_as_from_its_save_dir(run, tmp_path, case):
    from safetensors.torch import load_file

    save_dir = FRAMEWORKS / "deepspeed_optimizers" / case / "checkpoints"
    expected = json.loads((save_dir.parent / "expected.json").read_text())["tensors"]
    for name, src in (("save-dir", save_dir), ("tag", save_dir / "global_step2")):
        assert run("consolidate", src, tmp_path / f"{name}.safetensors", "--quiet").exit_code == 0
    assert (tmp_path / "save-dir.safetensors").read_bytes() == (tmp_path / "tag.safetensors").read_bytes()
    ours = load_file(tmp_path / "tag.safetensors")
    assert sorted(ours) == sorted(expected) and all(sha256(ours[k]) == row["sha256"] for k, row in expected.items())


@pytest.mark.parametrize("case", ["llama3", "qwen3_moe"])
def test_a_torchtitan_0_2_run_folder_exports_as_its_step_folder(run, tmp_path, case):
    root = FRAMEWORKS / "torchtitan_v02" / case
    [step] = (root / "checkpoint").iterdir()
    for name, src in (("run", root / "checkpoint"), ("step", step)):
        result = run("export", src, tmp_path / name, "--assets", root / "hf_config", "--quiet")
        assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (tmp_path / "step" / "model.safetensors").read_bytes()
