"""The DeepSpeed saves Hugging Face's Trainer writes (`TrainingArguments(deepspeed=...)`), ZeRO-2
and ZeRO-3, fp32 and bf16, and a PEFT LoRA run saved with `exclude_frozen_parameters`, read
without DeepSpeed and compared with DeepSpeed's own answers.

Fixtures: fixtures/frameworks/hf_trainer_deepspeed/<case>/ written by transformers 5.24.0's Trainer
with DeepSpeed 0.19.8 at world size 2 (fixtures/frameworks/generate_hf_trainer_deepspeed.py):
`run/checkpoint-10/` holds the Trainer's own files beside DeepSpeed's `global_step10/`, read here;
- expected.json: `get_fp32_state_dict_from_zero_checkpoint` per tensor (sha256), its exact key set;
- optimizer.json: each trainable parameter's fp32 master / exp_avg / exp_avg_sq from the live
  engine right before the save, the AdamW `step`, the param groups with their member names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from test_deepspeed import sha256_of

ROOT = FIXTURES / "frameworks" / "hf_trainer_deepspeed"
CASES = ("zero2_fp32", "zero2_bf16", "zero3_fp32", "zero3_bf16")
PEFT = "peft_zero2_exclude_frozen"
SETTINGS = ("lr", "initial_lr", "betas", "eps", "weight_decay")  # what optimizer.json records of a group


def save(case: str) -> Path:
    """The DeepSpeed save of the Trainer's last checkpoint (its tag folder)."""
    return ROOT / case / "run" / "checkpoint-10" / "global_step10"


def facts(case: str, name: str) -> dict:
    return json.loads((ROOT / case / name).read_text())


@pytest.mark.parametrize("case", CASES)
def test_consolidate_equals_zero_to_fp32_with_exactly_its_keys(tmp_path, case):
    """Every tensor of zero_to_fp32 (the fp32 masters, lm_head untied), byte for byte, and no other."""
    from safetensors.torch import load_file

    from ckpttool import consolidate

    consolidate(save(case), tmp_path / "model.safetensors")
    ours, reference = load_file(tmp_path / "model.safetensors"), facts(case, "expected.json")["tensors"]
    assert sorted(ours) == sorted(reference) and len(ours) == len(reference) == 21
    for fqn, fact in reference.items():
        assert (str(ours[fqn].dtype).removeprefix("torch."), list(ours[fqn].shape)) == (fact["dtype"], fact["shape"]), fqn
        assert sha256_of(ours[fqn]) == fact["sha256"], fqn


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """case -> `ckpttool reshard SAVE DST --world 2`, read back whole by torch's dcp_to_torch_save."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpttool import reshard

    root = tmp_path_factory.mktemp("hf-trainer-deepspeed")
    done: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in done:
            destination = reshard(save(case), root / case, world_size=2).destination
            dcp_to_torch_save(destination, root / f"{case}.pt")
            done[case] = torch.load(root / f"{case}.pt", weights_only=True)
        return done[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_the_migration_carries_every_parameters_moments_and_step(migrated, case):
    """exp_avg and exp_avg_sq byte for byte as the live engine had them at step 10, and AdamW's
    0-d float32 step (10.0), for every trained parameter and nothing else."""
    import torch

    reference = facts(case, "optimizer.json")
    assert reference["step"] == 10.0
    state = migrated(case)["optim"]["state"]
    trained = {entry.rsplit(".", 1)[0] for entry in reference["tensors"]}
    assert set(state) == trained and len(trained) == 21
    for fqn in trained:
        assert set(state[fqn]) == {"exp_avg", "exp_avg_sq", "step"}, fqn
        for key in ("exp_avg", "exp_avg_sq"):
            fact = reference["tensors"][f"{fqn}.{key}"]
            assert list(state[fqn][key].shape) == fact["shape"] and sha256_of(state[fqn][key]) == fact["sha256"], (fqn, key)
        step = state[fqn]["step"]
        assert step.dtype == torch.float32 and step.shape == () and float(step) == 10.0, fqn


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_keeps_the_hyperparameters_of_its_param_group(migrated, case):
    """The Trainer's one param group (lr 0.0 after its linear schedule, initial_lr 0.01), every
    stage-3 sub-group in it."""
    groups = migrated(case)["optim"]["param_groups"]
    expected_groups = facts(case, "optimizer.json")["param_groups"]
    for group in expected_groups:
        settings = {key: group[key] for key in SETTINGS}
        for fqn in group["fqns"]:
            [ours] = [g for g in groups if fqn in g["params"]]
            assert json.loads(json.dumps({key: ours[key] for key in SETTINGS})) == settings, fqn  # betas: a tuple
    assert sorted(fqn for g in groups for fqn in g["params"]) == sorted(fqn for g in expected_groups for fqn in g["fqns"])


def _raw_tensor(folder: Path, tensor):
    """A tensor assembled from the reader's chunks, each a raw byte range of a file (what
    every command reads once past the integrity gate, which refuses this save)."""
    import numpy as np

    from ckpttool.core.checkpoint import is_raw_range

    dtype = {"float32": np.float32, "bfloat16": np.uint16}[tensor.dtype]
    whole = np.zeros(tensor.shape, dtype=dtype)
    for chunk in tensor.chunks:
        assert is_raw_range(chunk.blob)
        with open(folder / chunk.blob.file, "rb") as file:
            file.seek(chunk.blob.offset)
            data = np.frombuffer(file.read(chunk.blob.length), dtype=dtype).reshape(chunk.sizes)
        whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = data
    return whole


def test_an_exclude_frozen_parameters_save_says_what_it_left_out():
    """The PEFT run's save holds the LoRA weights only (its frozen base deleted from `module`,
    frozen_param_shapes None): they equal zero_to_fp32's, with exactly its keys, and the
    checkpoint's note says the frozen parameters are absent, naming LoRA base layers."""
    import torch

    from ckpttool.readers import open_checkpoint
    from ckpttool.readers.deepspeed import EXCLUDED_FROZEN

    reference = facts(PEFT, "expected.json")
    assert reference["exclude_frozen_parameters"] is True
    checkpoint = open_checkpoint(save(PEFT))
    model = sorted(name.removeprefix("model.") for name in checkpoint.tensors if name.startswith("model."))
    assert model == sorted(reference["tensors"]) and len(model) == 12
    for fqn, fact in reference["tensors"].items():
        tensor = checkpoint.tensors[f"model.{fqn}"]
        assert (tensor.dtype, list(tensor.shape)) == (fact["dtype"], fact["shape"]), fqn
        assert sha256_of(torch.from_numpy(_raw_tensor(checkpoint.path, tensor))) == fact["sha256"], fqn
    [note] = checkpoint.notes
    assert note.startswith(EXCLUDED_FROZEN) and "6 LoRA layers" in note, note
    assert "model.base_model.model.model.layers.0.mlp.down_proj.base_layer.weight" in note, note


@pytest.mark.parametrize("command", ["consolidate", "export"])
def test_a_full_model_from_an_exclude_frozen_parameters_save_exits_1_naming_what_is_missing(tmp_path, cli, command):
    out = tmp_path / ("model.safetensors" if command == "consolidate" else "hf")
    result = cli(command, save(PEFT), out)
    line = result.stderr.strip()
    assert result.exit_code == 1 and "\n" not in line, result.output
    assert "exclude_frozen_parameters" in line and "q_proj.base_layer.weight" in line, line
    assert not out.exists()
