"""DeepSpeed ZeRO checkpoints (stages 1-3, fp32 and bf16) read without DeepSpeed: every command,
compared with DeepSpeed's own zero_to_fp32 and its per-parameter optimizer state, migrated to
FSDP2 and trained on.

Fixtures: fixtures/frameworks/deepspeed/<case>/ written by DeepSpeed 0.19.8's
`engine.save_checkpoint` (fixtures/frameworks/generate_deepspeed.py), with
- expected.json: `get_fp32_state_dict_from_zero_checkpoint` per tensor (sha256), and the true
  value of the frozen parameter zero_to_fp32 loses at stage 1;
- optimizer.json: each parameter's fp32 master / exp_avg / exp_avg_sq from the live engine
  (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`) and the param groups;
- step_reference.*: DeepSpeed's next training step from the checkpoint (loss, parameters).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from ckpttool.readers import detect

DEEPSPEED = FIXTURES / "frameworks" / "deepspeed"
CASES = ("zero1_fp32", "zero2_fp32", "zero3_fp32", "zero1_bf16", "zero2_bf16", "zero3_bf16")


def run_dir(case: str) -> Path:
    return DEEPSPEED / case / "checkpoints"


def expected(case: str, name: str = "expected.json") -> dict:
    return json.loads((DEEPSPEED / case / name).read_text())


def sha256_of(tensor) -> str:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


@pytest.fixture(scope="session")
def consolidated(tmp_path_factory):
    """case -> the safetensors file `ckpttool consolidate` wrote from the run directory."""
    from ckpttool import consolidate

    root = tmp_path_factory.mktemp("deepspeed")
    outputs = {}
    for case in CASES:
        outputs[case] = root / f"{case}.safetensors"
        consolidate(run_dir(case), outputs[case])
    return outputs


@pytest.mark.parametrize("case", CASES)
def test_a_run_directory_is_read_as_its_latest_zero_save(case):
    detection = detect(run_dir(case))
    assert detection.layout == "deepspeed" and detection.newest == "global_step2" and detection.newest_by == "latest"


@pytest.mark.parametrize("case", CASES)
def test_consolidate_equals_zero_to_fp32_tensor_for_tensor(consolidated, case):
    """Every tensor zero_to_fp32 gives and no other, byte for byte (sha256), the tied head
    included; floating buffers of a bf16 run are kept as the module saved them (bf16), where
    zero_to_fp32 upcasts them: equal after that exact upcast. At stage 1 one tensor more: the
    frozen parameter zero_to_fp32 loses (next test)."""
    import torch
    from safetensors.torch import load_file

    ours = load_file(consolidated[case])
    reference = expected(case)
    lost = {reference["frozen"]["fqn"]} - set(reference["tensors"])
    assert lost == ({reference["frozen"]["fqn"]} if case.startswith("zero1") else set()), lost
    assert sorted(ours) == sorted({*reference["tensors"], *lost}) and len(ours) == len(reference["tensors"]) + len(lost)
    for fqn, facts in reference["tensors"].items():
        tensor = ours[fqn]
        if tensor.dtype == torch.bfloat16 and facts["dtype"] == "float32":
            assert fqn in reference["buffers"], fqn
            tensor = tensor.float()
        assert (str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) == (facts["dtype"], facts["shape"]), fqn
        assert sha256_of(tensor) == facts["sha256"], fqn


@pytest.mark.parametrize("case", CASES)
def test_the_frozen_parameter_is_kept_even_at_stage_1(consolidated, case):
    """zero_to_fp32 drops it at stage 1 (DeepSpeed saves frozen_param_shapes from stage 2 on);
    it is in `module` there."""
    from safetensors.torch import load_file

    frozen = expected(case)["frozen"]
    tensor = load_file(consolidated[case])[frozen["fqn"]]
    assert str(tensor.dtype).removeprefix("torch.") == frozen["true_value"]["dtype"]
    assert sha256_of(tensor) == frozen["true_value"]["sha256"]


@pytest.mark.parametrize("case", CASES)
def test_the_optimizer_state_per_parameter_equals_deepspeeds(case):
    """fp32 master, exp_avg, exp_avg_sq of each parameter as the live engine gave them
    (safe_get_full_fp32_param / safe_get_full_optimizer_state), and its step."""
    import ckpttool

    facts = expected(case, "optimizer.json")
    trained = {entry.rsplit(".", 1)[0] for entry in facts["tensors"]}
    states = {f"optim.state.{entry}" for entry in facts["tensors"] if not entry.endswith(".fp32")}
    with ckpttool.open(run_dir(case)) as checkpoint:
        names = set(checkpoint.keys())
        assert {name for name in names if name.startswith("optim.state.")} == states | {f"optim.state.{fqn}.step" for fqn in trained}
        model = {name for name in names if name.startswith("model.")}
        reference = expected(case)
        assert model == {f"model.{fqn}" for fqn in {*reference["tensors"], reference["frozen"]["fqn"]}}, model
        for entry, fact in facts["tensors"].items():
            fqn, key = entry.rsplit(".", 1)
            name = f"model.{fqn}" if key == "fp32" else f"optim.state.{fqn}.{key}"
            tensor = checkpoint.get_tensor(name)
            assert list(tensor.shape) == fact["shape"], name
            assert sha256_of(tensor) == fact["sha256"], name
            assert float(checkpoint.get_tensor(f"optim.state.{fqn}.step")) == facts["step"]


@pytest.mark.parametrize("case", ["zero2_fp32", "zero3_bf16"])
def test_inspect_names_the_layout_and_the_optimizer_state(cli, case):
    result = cli("inspect", run_dir(case), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == "deepspeed"
    names = {t["fqn"]: t for t in report["tensors"]}
    assert names["model.lm_head.weight"]["shape"] == [37, 11]
    assert {"optim.state.model.embed_tokens.weight.exp_avg", "optim.state.model.embed_tokens.weight.step"} <= set(names)


@pytest.fixture(scope="session")
def migrated(tmp_path_factory):
    """(case, world) -> the DCP checkpoint `ckpttool reshard ZERO_RUN DST --world N` wrote."""
    from ckpttool import reshard

    root = tmp_path_factory.mktemp("deepspeed-migrated")
    done = {}

    def get(case: str, world: int) -> Path:
        if (case, world) not in done:
            done[case, world] = reshard(run_dir(case), root / f"{case}-world{world}", world_size=world).destination
        return done[case, world]

    return get


@pytest.mark.parametrize("case", ["zero1_bf16", "zero3_fp32"])
def test_diff_of_a_save_and_its_fsdp2_migration_is_identical(cli, migrated, case):
    result = cli("diff", run_dir(case), migrated(case, 3))
    assert result.exit_code == 0 and result.stdout.startswith("IDENTICAL"), result.output
    assert "24 objects" in result.stdout  # the param groups' settings, compared as values


FP32 = [case for case in CASES if case.endswith("fp32")]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_resumes_from_the_migration_and_takes_deepspeeds_next_step(tmp_path, migrated, world):
    """Stages 1-3 (fp32) migrated with `reshard --world N`, loaded by stock dcp.load +
    set_state_dict into fully_shard + torch AdamW, one step: the loss is DeepSpeed's bit for
    bit, and every parameter, exp_avg and exp_avg_sq after the step within 2.5e-7 of
    DeepSpeed's (both are torch AdamW in fp32; the gradients are summed over ranks in another
    order and clipped by a norm computed in another order: 2 ulp at the weights' magnitude ~1)."""
    from fsdp_loads import free_port
    from rank_forks import run_ranks

    jobs = [(case, str(migrated(case, world))) for case in FP32]
    out = tmp_path / "resumed.json"
    # deepspeed_resume's ranks, forked from the session's forkserver (torch imported once)
    run_ranks("deepspeed_resume:_rank", world, world, free_port(), jobs, str(out), timeout=600)
    results = json.loads(out.read_text())
    for case in FP32:
        reference = expected(case, "step_reference.json")
        result = results[case]
        assert result["loss"] == reference["loss"], case
        assert result["steps"] == [reference["step_after"]], case
        worst = max(result["differences"].items(), key=lambda item: item[1])
        assert worst[1] <= 2.5e-7, (case, worst)
        assert len(result["differences"]) == len([k for k in json.loads(json.dumps(reference["tensors"]))
                                                  if k.split(".", 1)[0] in ("param", "exp_avg", "exp_avg_sq")])


def test_a_missing_rank_file_exits_1_naming_it(tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(run_dir("zero2_fp32"), run)
    victim = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    result = cli("consolidate", run, tmp_path / "out.safetensors")
    assert result.exit_code == 1 and victim.name in result.stderr and not (tmp_path / "out.safetensors").exists()
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_truncated_rank_file_exits_1_naming_it(tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(run_dir("zero3_fp32"), run)
    victim = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result = cli("validate", run)
    assert result.exit_code == 1 and str(victim) in result.stderr + result.stdout


def _rewritten(run: Path, name: str, edit) -> None:
    path = run / "global_step2" / name
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for filename, data in members:
            archive.writestr(filename, edit(data) if filename.endswith("/data.pkl") else data)


def test_a_global_outside_the_allowlist_exits_1_and_runs_nothing(tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(run_dir("zero2_fp32"), run)
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def planted(data: bytes) -> bytes:
        key = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n"
        assert data.count(key) == 1
        return data.replace(key, b"cposix\nsystem\n")

    _rewritten(run, name, planted)
    result = cli("consolidate", run, tmp_path / "out.safetensors")
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and name in line and "posix.system" in line and not (tmp_path / "out.safetensors").exists()


def test_partition_sizes_that_disagree_exit_1_naming_file_and_group(tmp_path, cli):
    """Rank 1 says it stripped more padding than rank 0: the parts differ in length."""
    run = tmp_path / "run"
    shutil.copytree(run_dir("zero2_fp32"), run)

    def more_padding(data: bytes) -> bytes:  # `group_paddings: [K n, ...]`: the first entry + 7
        key = b"X\x0e\x00\x00\x00group_paddingsq"
        at = data.index(key) + len(key) + 1
        assert data[at:at + 2] == b"]q" and data[at + 3:at + 5] == b"(K"  # EMPTY_LIST, BINPUT n, MARK, BININT1
        return data[:at + 5] + bytes([data[at + 5] + 7]) + data[at + 6:]

    _rewritten(run, "zero_pp_rank_1_mp_rank_00_optim_states.pt", more_padding)
    result = cli("inspect", run)
    assert result.exit_code == 1 and "param group 0" in result.stderr and "partition sizes" in result.stderr, result.stderr


def test_a_sub_group_in_no_param_group_exits_1_naming_the_file_and_the_sub_group(tmp_path, cli):
    """Stage 3's optimizer state lists each sub-group in its param group (`params: [0, 1, 2, 3]`
    and `[4]` here); with sub-group 3 listed in none, its hyperparameters are unknown: refused,
    never put in group 0."""
    run = tmp_path / "run"
    shutil.copytree(run_dir("zero3_fp32"), run)
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def unlisted(data: bytes) -> bytes:  # `params: [0, 1, 2, 3]` -> `[0, 1, 2, 0]`
        key = b"K\x00K\x01K\x02K\x03e"
        assert data.count(key) == 1
        return data.replace(key, b"K\x00K\x01K\x02K\x00e")

    _rewritten(run, name, unlisted)
    result = cli("consolidate", run, tmp_path / "out.safetensors")
    line = result.stderr.strip()
    assert result.exit_code == 1 and "\n" not in line and name in line, result.output
    assert "sub-group 3 of 5 (model.layers.0.mlp.down_proj.weight)" in line and "in none of" in line, line
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("case", ["zero1_fp32", "zero3_bf16"])
def test_export_writes_one_copy_of_the_tied_pair_and_the_frozen_parameter(tmp_path, cli, case):
    """(The fixture's model persists its rotary `inv_freq` and `position_ids` buffers, which
    transformers' Llama does not have, so no Llama config.json is checked here.)"""
    result = cli("export", run_dir(case), tmp_path / "hf", "--drop-tied")
    assert result.exit_code == 0, result.output
    import torch
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    frozen = expected(case)["frozen"]
    assert sha256_of(tensors[frozen["fqn"]]) == frozen["true_value"]["sha256"]
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32  # the master weights, as stored


def test_open_gives_the_tied_head_as_the_embedding_as_numpy():
    import ckpttool

    with ckpttool.open(run_dir("zero3_fp32"), framework="np") as checkpoint:
        head = checkpoint.get_tensor("model.lm_head.weight")
        embedding = checkpoint.get_tensor("model.model.embed_tokens.weight")
    assert head.shape == (37, 11) and head.dtype == np.float32 and np.array_equal(head, embedding)


def test_the_reader_refuses_tensor_parallel_saves_in_one_line(tmp_path, cli):
    run = tmp_path / "global_step2"
    shutil.copytree(run_dir("zero2_fp32") / "global_step2", run)
    shutil.copy(run / "mp_rank_00_model_states.pt", run / "mp_rank_01_model_states.pt")
    result = cli("inspect", run)
    assert result.exit_code == 1 and "mp_rank_01" in result.stderr and "ds_to_universal" in result.stderr


@pytest.mark.parametrize("case", FP32)
def test_a_universal_checkpoint_reads_as_the_zero_save_it_was_made_from(cli, case):
    """ds_to_universal's per-parameter files (stage 1/2: {"param": t}; stage 3: the bare flat
    tensor, the step in optimizer_state.pt) give the same entries, byte for byte."""
    universal = DEEPSPEED / case / "universal"
    assert detect(universal).layout == "deepspeed-universal" and detect(universal).newest_by == "latest_universal"
    result = cli("diff", universal, run_dir(case))
    assert result.exit_code == 0 and result.stdout.startswith("IDENTICAL") and "24 objects" in result.stdout, result.output


@pytest.mark.parametrize("case", ["zero1_fp32", "zero3_bf16"])
def test_load_into_fills_the_model_deepspeed_trained_with_its_master_weights(case):
    """The generator's own model class, freshly initialised with other weights: every
    parameter and buffer comes from the save (the fp32 masters; the tied head through the
    embedding), and its logits on the reference input equal, bit for bit, those of the same
    class holding DeepSpeed's own module state, both computed here (fp32 runs; a bf16 run's
    module is not its masters)."""
    import sys

    import torch

    import ckpttool

    sys.path.insert(0, str(FIXTURES / "frameworks"))
    import generate_deepspeed as generator

    model = generator.build_model(seed=1)
    result = ckpttool.load_into(model, run_dir(case))
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    facts = expected(case, "optimizer.json")["tensors"]
    for name, parameter in model.named_parameters():
        if f"{name}.fp32" in facts:
            assert sha256_of(parameter) == facts[f"{name}.fp32"]["sha256"], name
    if case.endswith("fp32"):
        # The oracle: DeepSpeed's `module` in its save (what its load_checkpoint restores; pinned to the
        # live engine's module by expected.json), in the same class, its forward run on this machine: the
        # stored logits_before came from the BLAS kernels of the generator's CPU, not comparable bit for bit
        saved = torch.load(run_dir(case) / "global_step2" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        live = {name: facts["sha256"] for name, facts in expected(case)["live_module_state"].items() if name != "note"}
        assert {name: sha256_of(tensor) for name, tensor in saved.items()} == live
        oracle = generator.build_model(seed=2)  # other weights again: whatever load_into missed would differ
        oracle.load_state_dict(saved)
        ids = torch.tensor(expected(case, "step_reference.json")["input_ids"])
        with torch.no_grad():
            assert torch.equal(model(ids), oracle(ids))


def test_the_bundled_trainer_continues_a_deepspeed_run_from_its_migration(tmp_path, migrated):
    """DeepSpeed trained the trainer's own Llama 2 steps (ZeRO-2); `reshard --world 2` of that
    save, then the trainer's `--resume` with the same model flags (its `train` on 2 ranks, the
    command line `python -m train_minimal` gets): what it loaded is DeepSpeed's, every fp32
    master weight, exp_avg and exp_avg_sq byte for byte (optimizer.json, from the live engine),
    and the first step is AdamW's third (step 3.0 in the trainer's own checkpoint), on a fresh
    LR schedule."""
    import ckpttool
    from fsdp_loads import free_port
    from rank_forks import run_ranks
    from trainer_runs import latest_step, trainer_command

    case = "trainer_llama_zero2"
    flags = json.loads((DEEPSPEED / case / "train_config.json").read_text())
    source = migrated(case, 2)
    argv = trainer_command(tmp_path, *flags, "--resume", str(source), "--steps", "1", steps=1)[3:]  # past `python -m train_minimal`
    run_ranks("deepspeed_resume:_trainer_rank", 2, 2, free_port(), argv, str(tmp_path / "loaded.json"), timeout=600)
    ckpt = tmp_path / "ckpt"
    facts = expected(case, "optimizer.json")
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded["steps"] == [facts["step"]]
    reference = {name: tensor["sha256"] for name, tensor in facts["tensors"].items()}
    assert sorted(loaded["tensors"]) == sorted(reference)
    assert [name for name in reference if loaded["tensors"][name] != reference[name]] == []
    with ckpttool.open(latest_step(ckpt)) as resumed:
        steps = {float(resumed.get_tensor(name)) for name in resumed.keys() if name.startswith("optim.state.") and name.endswith(".step")}
        assert steps == {facts["step"] + 1}
        embedding = resumed.get_tensor("model.model.embed_tokens.weight")
    with ckpttool.open(run_dir(case)) as saved:
        assert embedding.shape == saved.get_tensor("model.model.embed_tokens.weight").shape
