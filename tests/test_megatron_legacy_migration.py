"""A legacy per-rank Megatron-LM save (`--ckpt-format torch`) with its optimizer state migrated to
FSDP2 (issue 48 items 1 and 5): `reshard(ITER, DST, world_size=N, to="transformers")` writes
transformers' model and AdamW state, which stock `dcp.load` + `set_state_dict` load into
`fully_shard(transformers model)` + torch's AdamW on N gloo ranks.

Fixtures (fixtures/frameworks/generate_megatron_legacy.py, megatron-core 0.16.1 + Megatron-LM
core_v0.16.1 `save_checkpoint`, TP 2 x PP 2, 2 Adam steps by Megatron's FP32Optimizer over torch
AdamW): `megatron_legacy/` and its `virtual_pipeline/` (2 model chunks per rank); and
`megatron_legacy_distopt/` (fixtures/frameworks/generate_megatron_legacy_distopt.py: the same run
with --use-distributed-optimizer, so distrib_optim.pt beside each rank's file); and
`megatron_legacy_distopt_dp2/` (generate_megatron_legacy_distopt_dp2.py: TP 2 x DP 2, the
distributed optimizer's buffers cut into 9 buckets each, every DP rank stepping its half; its
reference is Megatron-LM's own load_checkpoint of the save, tests/test_megatron_distopt.py says
more). The reference,
`optimizer_expected.json` beside each, is Megatron's own, by parameter identity, placed in the
global tensor by Megatron's sharding metadata (sha256 per tensor, the step's bytes, the group's
settings): each parameter's AdamW state after Megatron-LM's own `load_checkpoint` of the save
(generate_megatron_legacy_optimizer.py; for the DP 2 save generate_megatron_legacy_distopt_dp2.py,
with two stated workarounds of Megatron's fp32 reload), or, for `megatron_legacy_distopt/`, the live
optimizer's state just before the save. No megatron is imported here.

The acceptance where Megatron does not step here: every parameter's exp_avg, exp_avg_sq and step,
loaded into AdamW at world 2 and 3 (the issue's acceptance worlds), equal Megatron's loaded state byte for byte (the transformers
tensors put back into Megatron's names by torch alone: q/k/v per query group, gate/up); the weights
equal `ckpttool export`'s; one AdamW step on the fully_shard model equals, byte for byte, the step of
an unsharded transformers model + AdamW holding that same (checked) state.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes
from megatron_rank_files import resave

from ckpttool.outputs.temps import TEMP_PREFIX

LEGACY = FIXTURES / "frameworks" / "megatron_legacy"
# the same model saved with --use-distributed-optimizer: distrib_optim.pt beside each rank's file
DISTRIBUTED = FIXTURES / "frameworks" / "megatron_legacy_distopt"
# the same model at TP 2 x DP 2 (PP 1), the distributed optimizer's grad buffers in 9 buckets each
DISTRIBUTED_DP2 = FIXTURES / "frameworks" / "megatron_legacy_distopt_dp2"
SAVES = {"tp2_pp2": LEGACY, "virtual_pipeline": LEGACY / "virtual_pipeline", "distributed_optimizer": DISTRIBUTED,
         "distributed_optimizer_dp2": DISTRIBUTED_DP2}
WORLDS = (2, 3)
MOMENTS = ("exp_avg", "exp_avg_sq")
INPUT_IDS = json.loads((LEGACY / "expected.json").read_text())["input_ids"]


def iteration(name: str) -> Path:
    return SAVES[name] / "checkpoints" / "iter_0000002"


def reference(name: str) -> dict:
    return json.loads((SAVES[name] / "optimizer_expected.json").read_text())


def sha256(tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def as_megatron(hf: dict, config: dict) -> dict:
    """transformers' Llama names and tensors -> Megatron's (global layer numbers), by torch alone:
    q/k/v back into [q; k; v] per query group, gate and up into [gate; up]."""
    import torch

    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_group = heads // groups
    plain = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "lm_head.weight": "output_layer.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}
    per_layer = {"input_layernorm.weight": "input_layernorm.weight",
                 "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                 "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                 "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
    out = {plain[key]: value for key, value in hf.items() if key in plain}
    for layer in range(config["num_hidden_layers"]):
        head, to = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for key, megatron in per_layer.items():
            out[to + megatron] = hf[head + key]
        q, k, v = (hf[f"{head}self_attn.{p}_proj.weight"] for p in "qkv")
        width = q.shape[-1]
        out[to + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.view(groups, per_group * head_dim, width), k.view(groups, head_dim, width),
             v.view(groups, head_dim, width)], dim=1).reshape(-1, width)
        out[to + "mlp.linear_fc1.weight"] = torch.cat([hf[head + "mlp.gate_proj.weight"], hf[head + "mlp.up_proj.weight"]])
    assert len(out) == len(hf) - 3 * config["num_hidden_layers"]  # q, k, v -> 1 and gate, up -> 1 per layer
    return out


# -- the migration, loaded on gloo ranks ------------------------------------------------------------

@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> dict:
    """(name, world) -> the folder `reshard(..., to="transformers")` wrote."""
    from ckpttool import reshard

    root = tmp_path_factory.mktemp("legacy-migration")
    found = {}
    for name in SAVES:
        for world in (1, *WORLDS):  # world 1: the unsharded reference step
            report = reshard(SAVES[name] / "checkpoints", root / f"{name}-{world}", world_size=world, to="transformers")
            assert sorted(p.name for p in report.destination.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]
            found[(name, world)] = report.destination
    return found


@pytest.fixture(scope="module")
def loaded(migrated, tmp_path_factory) -> dict:
    """(name, world) -> what the ranks loaded, and their parameters after one AdamW step."""
    from fsdp_loads import free_port
    from rank_forks import run_ranks

    root = tmp_path_factory.mktemp("legacy-loaded")
    results = {}
    for world in WORLDS:
        jobs = [(name, str(migrated[(name, world)])) for name in SAVES]
        out = root / f"world{world}.pt"
        run_ranks("test_megatron_legacy_migration:_rank", world, world, free_port(), jobs, str(out), timeout=300)
        import torch

        results.update({(name, world): result for name, result in torch.load(out, weights_only=True).items()})
    return results


def _rank(rank: int, world: int, port: int, jobs: list, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from fsdp_loads import exit_spawned_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {name: _load_and_step(source, sharded=True) for name, source in jobs}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _load_and_step(source: str, sharded: bool) -> dict:
    """transformers' model (fully_shard per layer and whole when `sharded`) + AdamW built with other
    settings and weights than the save's, stock dcp.load + set_state_dict, what was loaded (full
    tensors), then one step on INPUT_IDS and the parameters after it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LEGACY / "hf"))
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    parameters = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for _, p in parameters if p.ndim > 1], "weight_decay": 0.5},
                                   {"params": [p for _, p in parameters if p.ndim <= 1], "weight_decay": 0.25}],
                                  lr=0.125, betas=(0.5, 0.75), eps=0.1)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=source, no_dist=not sharded)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    result: dict = {"weights": {}, "moments": {kind: {} for kind in MOMENTS}, "steps": {}, "groups": {}}
    for key, parameter in parameters:
        result["weights"][key] = _full(parameter.detach()).clone()
        for kind in MOMENTS:
            result["moments"][kind][key] = _full(optimizer.state[parameter][kind]).clone()
        result["steps"][key] = optimizer.state[parameter]["step"].clone()
        group = group_of[id(parameter)]
        result["groups"][key] = {setting: list(value) if isinstance(value, tuple) else value
                                 for setting, value in group.items() if setting in ("lr", "betas", "eps", "weight_decay")}
    ids = torch.tensor(INPUT_IDS)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    result["loss"] = loss.item()
    result["after"] = {key: _full(parameter.detach()).clone() for key, parameter in parameters}
    return result


@pytest.fixture(scope="module")
def unsharded(migrated) -> dict:
    """name -> the same load and step on one process without fully_shard: the reference step."""
    return {name: _load_and_step(str(migrated[(name, 1)]), sharded=False) for name in SAVES}


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(SAVES))
def test_every_parameters_moments_and_step_are_megatrons_own_loaded_state(loaded, name, world):
    """exp_avg and exp_avg_sq of each parameter after set_state_dict, put back into Megatron's
    names, are byte for byte what Megatron's optimizer held after Megatron-LM loaded the save;
    `step` is each parameter's own saved 0-d float32 step (2.0)."""
    config = json.loads((LEGACY / "hf" / "config.json").read_text())
    expected = reference(name)
    result = loaded[(name, world)]
    for kind in MOMENTS:
        got = {key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "sha256": sha256(value)}
               for key, value in as_megatron(result["moments"][kind], config).items()}
        assert got == {key: tensors[kind] for key, tensors in expected["tensors"].items()}, kind
    steps = {key: (str(value.dtype), tuple(value.shape), tensor_bytes(value).hex()) for key, value in result["steps"].items()}
    assert set(steps.values()) == {("torch.float32", (), step) for step in set(expected["step"].values())}
    assert set(expected["step"].values()) == {"00000040"} and len(steps) == len(result["weights"])  # 2.0: 2 Adam steps


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(SAVES))
def test_the_weights_are_the_export_of_the_same_save(loaded, tmp_path, run, name, world):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert run("export", SAVES[name] / "checkpoints", out, "--assets", LEGACY / "hf").exit_code == 0
    exported = {key: sha256(value) for path in sorted(out.glob("*.safetensors")) for key, value in load_file(path).items()}
    assert {key: sha256(value) for key, value in loaded[(name, world)]["weights"].items()} == exported


def megatron_name(key: str) -> str:
    """The Megatron parameter a transformers parameter is (a part of)."""
    plain = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "lm_head.weight": "output_layer.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}
    if key in plain:
        return plain[key]
    _, _, layer, rest = key.split(".", 3)
    parts = {"input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
             "self_attn.o_proj.weight": "self_attention.linear_proj.weight", "mlp.down_proj.weight": "mlp.linear_fc2.weight",
             "self_attn.q_proj.weight": "self_attention.linear_qkv.weight",
             "self_attn.k_proj.weight": "self_attention.linear_qkv.weight",
             "self_attn.v_proj.weight": "self_attention.linear_qkv.weight",
             "mlp.gate_proj.weight": "mlp.linear_fc1.weight", "mlp.up_proj.weight": "mlp.linear_fc1.weight"}
    return f"decoder.layers.{layer}.{parts[rest]}"


@pytest.mark.parametrize("name", sorted(SAVES))
def test_each_parameter_has_the_settings_of_the_group_megatron_put_it_in(loaded, name):
    """lr (the scheduler's current), betas, eps and weight_decay of the group Megatron's own
    optimizer held the parameter in (by identity, after its load), for each of its transformers
    names; the AdamW built with other settings is overwritten."""
    expected = reference(name)["groups"]
    for world in WORLDS:
        groups = loaded[(name, world)]["groups"]
        assert len(groups) == len(expected) + 3 * 4  # q/k/v and gate/up: 3 more names in each of 4 layers
        for key, settings in groups.items():
            want = expected[megatron_name(key)]
            assert settings == {setting: want[setting] for setting in ("lr", "betas", "eps", "weight_decay")}, key
    assert {group["weight_decay"] for group in expected.values()} == {0.0, 0.01}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(SAVES))
def test_one_adamw_step_equals_the_step_from_the_reference_state(loaded, unsharded, name, world):
    """The fully_shard model's parameters after one step equal those of an unsharded model +
    AdamW holding the same state (the reference: its moments checked against Megatron's here
    too): byte for byte at world 2, where every rank's gradient of the same batch averages
    exactly ((g + g) / 2 = g); at world 3 within rtol 1e-6, atol 1e-8: (g + g + g) / 3 rounds
    twice in float32 (|relative error| <= 2 ** -23), which moves each AdamW update (lr 1e-3 scale)
    by ~1e-9 and each parameter by at most a few ulps."""
    config = json.loads((LEGACY / "hf" / "config.json").read_text())
    reference_run = unsharded[name]
    for kind in MOMENTS:
        assert {key: sha256(value) for key, value in as_megatron(reference_run["moments"][kind], config).items()} == {
            key: tensors[kind]["sha256"] for key, tensors in reference(name)["tensors"].items()}
    result = loaded[(name, world)]
    assert result["loss"] == reference_run["loss"] and 0 < result["loss"] < 10
    changed = 0
    for key, value in reference_run["after"].items():
        if world & (world - 1) == 0:
            assert sha256(result["after"][key]) == sha256(value), key
        else:
            import torch

            assert torch.allclose(result["after"][key], value, rtol=1e-6, atol=1e-8), key
        changed += sha256(value) != sha256(reference_run["weights"][key])
    assert changed == len(reference_run["after"])


def test_the_cli_writes_the_librarys_bytes(tmp_path):
    """`ckpttool reshard SAVE DST --world 2 --to transformers`, a real subprocess of the installed
    command: the same files, byte for byte, as the library call."""
    import subprocess
    import sys

    from ckpttool import reshard

    reshard(LEGACY / "checkpoints", tmp_path / "lib", world_size=2, to="transformers")
    done = subprocess.run([sys.executable, "-m", "ckpttool", "reshard", str(LEGACY / "checkpoints"), str(tmp_path / "cli"),
                           "--world", "2", "--to", "transformers", "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli").iterdir()) and ".metadata" in names
    for name in names:  # .metadata names its own folder (storage_meta.checkpoint_id, as torch writes it)
        written = (tmp_path / "cli" / name).read_bytes().replace(b"\x03\x00\x00\x00cli", b"\x03\x00\x00\x00lib")
        assert written == (tmp_path / "lib" / name).read_bytes(), name


def test_every_chunk_is_a_byte_range_of_a_rank_file():
    """Nothing is decoded: each output tensor's chunks (the steps too) are raw ranges of the rank files."""
    from ckpttool.core.checkpoint import is_raw_range
    from ckpttool.naming.megatron_optimizer import plan_migration
    from ckpttool.readers.detect import MEGATRON_LEGACY
    from ckpttool.readers.megatron_legacy import read_megatron_legacy

    migration = plan_migration(MEGATRON_LEGACY, read_megatron_legacy(iteration("tp2_pp2")))
    assert all(is_raw_range(chunk.blob) for tensor in migration.sources() for chunk in tensor.chunks)
    assert all(is_raw_range(blob) and blob.file.endswith("/model_optim_rng.pt") for _, blob in migration.steps.values())
    assert len(migration.steps) == 39 and not migration.step_values
    assert {target.rsplit(".", 1)[-1] for target in migration.targets if target.startswith("optim.state.")} == set(MOMENTS)


def test_the_distributed_optimizers_moments_are_byte_ranges_of_distrib_optim_pt():
    """Each parameter's moments are a range of its grad buffer's flat exp_avg / exp_avg_sq in
    distrib_optim.pt; the step, a number in the saved param groups, is the one value decoded."""
    from ckpttool.core.checkpoint import is_raw_range
    from ckpttool.naming.megatron_optimizer import plan_migration
    from ckpttool.readers.detect import MEGATRON_LEGACY
    from ckpttool.readers.megatron_legacy import read_megatron_legacy

    migration = plan_migration(MEGATRON_LEGACY, read_megatron_legacy(iteration("distributed_optimizer")))
    files = {chunk.blob.file.rsplit("/", 1)[-1]: is_raw_range(chunk.blob) for tensor in migration.sources()
             for chunk in tensor.chunks}
    assert files == {"model_optim_rng.pt": True, "distrib_optim.pt": True}
    assert not migration.steps and set(migration.step_values.values()) == {2.0} and len(migration.step_values) == 39


def test_the_distributed_optimizer_saves_model_consolidates_to_megatrons_own_tensors(run, tmp_path):
    """The model of the distributed-optimizer save reads as any legacy save's: consolidate equals
    Megatron-LM's own load of it, placed by Megatron's sharding metadata (its expected.json)."""
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert run("consolidate", DISTRIBUTED / "checkpoints", out, "--quiet").exit_code == 0
    got = {key: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "sha256": sha256(value)}
           for key, value in load_file(out).items()}
    assert got == json.loads((DISTRIBUTED / "expected.json").read_text())["tensors"]


# -- refusals -------------------------------------------------------------------------------------

def _no_optimizer(folder: Path) -> None:
    resave(folder / "mp_rank_01_001/model_optim_rng.pt", lambda state: state.pop("optimizer"))


def _groups_only(state) -> None:
    """What DistributedOptimizer.state_dict saves in model_optim_rng.pt: param groups without params."""
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["optimizer"]["param_groups"]]
    state["optimizer"] = {"optimizer": {"param_groups": groups}}


def _distributed_without_its_file(folder: Path) -> None:
    for rank in sorted(folder.glob("mp_rank_*")):
        resave(rank / "model_optim_rng.pt", _groups_only)


def _distributed_of_another_layout(folder: Path) -> None:
    """An older distrib_optim.pt (per-bucket, not `buckets_coalesced`)."""
    import torch

    for rank in sorted(folder.glob("mp_rank_*")):
        resave(rank / "model_optim_rng.pt", _groups_only)
        torch.save({0: {"exp_avg": torch.zeros(4)}}, rank / "distrib_optim.pt")


def _distributed_on_one_rank(folder: Path) -> None:
    resave(folder / "mp_rank_00_000/model_optim_rng.pt", _groups_only)


def _distrib_optim_of_another_buffer_layout(folder: Path) -> None:
    """A grad buffer 64 elements longer than the model's parameters laid out as Megatron does
    (another bucket split, or frozen parameters): the ranges cannot be told."""
    import torch

    path = folder / "mp_rank_01_001/distrib_optim.pt"
    state = torch.load(path, weights_only=False)
    [buffer] = state[0].values()
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        buffer[kind] = torch.cat([buffer[kind], torch.zeros(64)])
    buffer["numel_unpadded"] += 64
    torch.save(state, path)


def _left_over_distrib_optim(folder: Path) -> None:
    shutil.copy(DISTRIBUTED / "checkpoints/iter_0000002/mp_rank_00_000/distrib_optim.pt", folder / "mp_rank_00_000")


def _sgd(folder: Path) -> None:
    def edit(state):
        for held in state["optimizer"]["state"].values():
            held["momentum_buffer"] = held.pop("exp_avg")

    resave(folder / "mp_rank_01_000/model_optim_rng.pt", edit)


def _mixed_precision(folder: Path) -> None:
    def edit(state):
        state["optimizer"] = {"optimizer": state["optimizer"], "fp32_from_fp16_params": [[], []]}

    resave(folder / "mp_rank_00_001/model_optim_rng.pt", edit)


def _other_groups(folder: Path) -> None:
    def edit(state):
        state["optimizer"]["param_groups"][0]["lr_mult"] = 0.5

    for rank in sorted(folder.glob("mp_rank_*")):
        resave(rank / "model_optim_rng.pt", edit)


REFUSED = {
    "no-optimizer": (_no_optimizer, "mp_rank_01_001/model_optim_rng.pt: optimizer: none saved"),
    "distributed-without-distrib-optim": (_distributed_without_its_file, "mp_rank_00_000/distrib_optim.pt: missing"),
    "distrib-optim-of-another-layout": (_distributed_of_another_layout,
                                        "mp_rank_00_000/distrib_optim.pt: not the coalesced per-buffer state"),
    "distributed-on-one-rank": (_distributed_on_one_rank, "other ranks the distributed optimizer's"),
    "distrib-optim-of-another-buffer-layout": (_distrib_optim_of_another_buffer_layout, "mp_rank_01_001/distrib_optim.pt: "
                                               "grad buffer 0 holds 11616 elements"),
    "left-over-distrib-optim": (_left_over_distrib_optim, "mp_rank_00_000/distrib_optim.pt: the distributed optimizer's "
                                "state beside model_optim_rng.pt files holding the non-distributed optimizer's"),
    "sgd": (_sgd, "keeps `momentum_buffer`, not Adam's"),
    "mixed-precision": (_mixed_precision, "the mixed-precision optimizer's (fp32_from_fp16_params"),
    "other-param-groups": (_other_groups, "param group 0 (lr_mult=0.5) is not one of Megatron-LM's standard groups"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_save_whose_optimizer_is_not_read_is_refused_by_name_with_nothing_written(run, tmp_path, case):
    damage, message = REFUSED[case]
    copy = tmp_path / "checkpoints"
    shutil.copytree((DISTRIBUTED if "buffer-layout" in case else LEGACY) / "checkpoints", copy)
    damage(copy / "iter_0000002")
    result = run("reshard", copy, tmp_path / "out", "--world", "2", "--to", "transformers")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))


def test_the_model_still_consolidates_when_its_optimizer_is_not_read(run, tmp_path):
    """A refusal of the optimizer is the migration's only: export/consolidate read the model."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(LEGACY / "checkpoints", copy)
    _distributed_of_another_layout(copy / "iter_0000002")
    assert run("consolidate", copy, tmp_path / "model.safetensors", "--quiet").exit_code == 0
