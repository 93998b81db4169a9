"""DeepSpeed ZeRO saves of optimizers other than torch's AdamW, and of a parameter no optimizer
owns, at world size 3, read without DeepSpeed and compared with DeepSpeed's own answers.

Fixtures: fixtures/frameworks/deepspeed_optimizers/<case>/ written by DeepSpeed 0.19.8
(fixtures/frameworks/generate_deepspeed_optimizers.py):
- zero2_cpuadam_offload, zero3_cpuadam_offload: ZeRO-Offload with DeepSpeedCPUAdam, whose Adam
  `step` is a Python int in the optim files (FusedAdam keeps it so too), two param groups
  (weight decay 0.1 and 0.0), stage 3 over several sub-groups;
- zero3_param_outside_optimizer: a trainable parameter (`model.norm.weight`) left out of every
  optimizer param group, which ZeRO-3 saves only as an empty placeholder;
- expected.json: `get_fp32_state_dict_from_zero_checkpoint` per tensor (sha256), its exact key set;
- optimizer.json: each parameter's fp32 master / exp_avg / exp_avg_sq from the live engine, the
  `step` value and type, and the param groups with their member names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from test_deepspeed import sha256_of

ROOT = FIXTURES / "frameworks" / "deepspeed_optimizers"
CPU_ADAM = ("zero2_cpuadam_offload", "zero3_cpuadam_offload")
OUTSIDE = "zero3_param_outside_optimizer"


def run_dir(case: str) -> Path:
    return ROOT / case / "checkpoints"


def facts(case: str, name: str) -> dict:
    return json.loads((ROOT / case / name).read_text())


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """case -> `ckpttool reshard SAVE DST --world 2`, read back whole by torch's own
    dcp_to_torch_save (values as stock dcp.load gives them)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpttool import reshard

    root = tmp_path_factory.mktemp("deepspeed-optimizers")
    done: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in done:
            destination = reshard(run_dir(case), root / case, world_size=2).destination
            dcp_to_torch_save(destination, root / f"{case}.pt")
            done[case] = torch.load(root / f"{case}.pt", weights_only=True)
        return done[case]

    return get


@pytest.mark.parametrize("case", CPU_ADAM)
def test_consolidate_equals_zero_to_fp32_with_exactly_its_keys(tmp_path, case):
    from safetensors.torch import load_file

    from ckpttool import consolidate

    consolidate(run_dir(case), tmp_path / "model.safetensors")
    ours, reference = load_file(tmp_path / "model.safetensors"), facts(case, "expected.json")["tensors"]
    assert sorted(ours) == sorted(reference) and len(ours) == len(reference) == 14
    for fqn, fact in reference.items():
        assert (str(ours[fqn].dtype).removeprefix("torch."), list(ours[fqn].shape)) == (fact["dtype"], fact["shape"]), fqn
        assert sha256_of(ours[fqn]) == fact["sha256"], fqn


@pytest.mark.parametrize("case", CPU_ADAM)
def test_the_migration_carries_every_parameters_moments_and_its_int_step(migrated, case):
    """exp_avg and exp_avg_sq byte for byte as DeepSpeed's live engine had them, and `step` the
    Python int DeepSpeedCPUAdam keeps (2), for every trained parameter and nothing else."""
    reference = facts(case, "optimizer.json")
    assert (reference["step"], reference["step_type"]) == (2, "int")
    state = migrated(case)["optim"]["state"]
    trained = {entry.rsplit(".", 1)[0] for entry in reference["tensors"]}
    assert set(state) == trained and len(trained) == 10
    for fqn in trained:
        assert set(state[fqn]) == {"exp_avg", "exp_avg_sq", "step"}, fqn
        for key in ("exp_avg", "exp_avg_sq"):
            fact = reference["tensors"][f"{fqn}.{key}"]
            assert list(state[fqn][key].shape) == fact["shape"] and sha256_of(state[fqn][key]) == fact["sha256"], (fqn, key)
        assert type(state[fqn]["step"]) is int and state[fqn]["step"] == 2, fqn
    model = migrated(case)["model"]
    for fqn in trained:
        assert sha256_of(model[fqn]) == reference["tensors"][f"{fqn}.fp32"]["sha256"], fqn


@pytest.mark.parametrize("case", CPU_ADAM)
def test_every_parameter_keeps_the_hyperparameters_of_its_param_group(migrated, case):
    """Stage 3: each sub-group in the param group DeepSpeed's state lists it in (the norm
    weights' sub-group in the no-decay group), every setting as DeepSpeedCPUAdam saved it."""
    groups = migrated(case)["optim"]["param_groups"]
    for group in facts(case, "optimizer.json")["param_groups"]:
        settings = {key: value for key, value in group.items() if key != "fqns"}
        for fqn in group["fqns"]:
            [ours] = [g for g in groups if fqn in g["params"]]
            assert json.loads(json.dumps({key: ours[key] for key in settings})) == settings, fqn
    assert sorted(fqn for g in groups for fqn in g["params"]) == sorted(
        fqn for g in facts(case, "optimizer.json")["param_groups"] for fqn in g["fqns"])


def test_torch_adamw_resumes_from_the_migration_with_its_float32_step(tmp_path):
    """Loaded by stock dcp.load + set_state_dict into torch's AdamW, the int step becomes AdamW's
    own 0-d float32 step (Adam.__setstate__), as for a run that used torch's AdamW. DeepSpeedCPUAdam's
    groups do not have the settings only torch's AdamW has (`maximize`, `foreach`, ...), so the
    load allows a partial plan: those keep AdamW's defaults."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckpttool import reshard

    sys.path.insert(0, str(FIXTURES / "frameworks"))
    import generate_deepspeed as generator

    case = "zero3_cpuadam_offload"
    destination = reshard(run_dir(case), tmp_path / "fsdp2", world_size=2).destination
    model = generator.build_model(seed=1)
    groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in generator.param_groups(model)]
    optimizer = torch.optim.AdamW(groups, lr=generator.LR, betas=generator.BETAS, eps=generator.EPS)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=destination, planner=DefaultLoadPlanner(allow_partial_load=True))  # no process group: one process
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    reference = facts(case, "optimizer.json")["tensors"]
    for name, parameter in model.named_parameters():
        if f"{name}.exp_avg" not in reference:
            continue  # the frozen parameter
        step = optimizer.state[parameter]["step"]
        assert step.dtype == torch.float32 and step.shape == () and float(step) == 2.0, name
        assert sha256_of(optimizer.state[parameter]["exp_avg_sq"]) == reference[f"{name}.exp_avg_sq"]["sha256"], name


@pytest.mark.parametrize("command", ["inspect", "consolidate", "reshard"])
def test_a_stage_3_trainable_parameter_outside_the_optimizer_is_refused_by_name(tmp_path, cli, command):
    """ZeRO-3 keeps its value nowhere (an empty placeholder in `module`, not in param_shapes
    nor frozen_param_fragments; zero_to_fp32 drops it, load_checkpoint leaves it as
    initialised): one line naming the file and the parameter, exit 1, nothing written."""
    outside = facts(OUTSIDE, "expected.json")["outside_optimizer"]
    assert (outside["fqn"], outside["in_param_shapes"], outside["in_frozen_param_shapes"]) == ("model.norm.weight", False, False)
    extra = {"inspect": [], "consolidate": [tmp_path / "out.safetensors"], "reshard": [tmp_path / "out", "--world", "2"]}
    result = cli(command, run_dir(OUTSIDE), *extra[command])
    line = result.stderr.strip()
    assert result.exit_code == 1 and "\n" not in line, result.output
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt: module: model.norm.weight" in line and "no optimizer" in line, line
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out").exists()
