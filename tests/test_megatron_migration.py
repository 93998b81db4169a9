"""A Megatron-Core torch_dist save with its optimizer state migrated to FSDP2 (issue 48 item 5):
`reshard(SAVE, DST, world_size=N, to="transformers")` writes transformers' model and AdamW
state, which stock `dcp.load` + `set_state_dict` load into `fully_shard(transformers model)` +
torch's AdamW on N gloo ranks.

Fixtures (fixtures/frameworks/generate_megatron_families.py, megatron-core 0.16.1, 2 Adam steps by
Megatron-LM's own optimizer, saved by its own save path): llama_tp2 (tensor parallel 2) and
moe_ep2 (Qwen3-MoE-style, expert parallel 2, a chained dense + expert optimizer). The tensor-parallel
`moe` fixture is saved without an optimizer, so it is not migrated here.

Megatron cannot reload its optimizer on CPU for the distributed optimizer, and does not step here,
so the acceptance is the alternative: every parameter's exp_avg, exp_avg_sq and step equal, byte for
byte, Megatron's saved state after the naming conversion (computed below with torch alone: q/k/v
split per query group, gate/up split, the experts as transformers 5 fuses them), the weights equal
Megatron-Bridge's own export (hf/model.safetensors), each group's lr/betas/eps/weight_decay are
Megatron's saved group's, and one AdamW step then runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

MEGATRON = FIXTURES / "frameworks" / "megatron_families"
TRAINED = ("llama_tp2", "moe_ep2")  # the fixtures saved with Megatron's optimizer
WORLDS = (2, 3)
MOMENTS = ("exp_avg", "exp_avg_sq")


def iteration_dir(name: str) -> Path:
    return next((MEGATRON / name / "checkpoints").glob("iter_*"))


def sha256(tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


# -- the expected side: Megatron's saved tensors converted with torch alone -------------------------

def megatron_tensors(name: str) -> dict:
    """Every tensor of the save, by stock dcp.load in this one process (byte entries left out)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(iteration_dir(name))).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in entries.items()
             if isinstance(entry, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(iteration_dir(name)))
    return state


def common_state(path: Path) -> dict:
    """common.pt by torch.load, megatron's one enum (AttnBackend) stood in for the unpickling."""
    import enum

    import torch

    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    saved = {module: sys.modules.get(module) for module in names}
    for module in names:
        sys.modules[module] = types.ModuleType(module)
    sys.modules["megatron.core.transformer.enums"].AttnBackend = enum.Enum(  # type: ignore[attr-defined]
        "AttnBackend", {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5},
        module="megatron.core.transformer.enums")
    try:
        return torch.load(path, weights_only=False)
    finally:
        for module, value in saved.items():
            if value is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = value


def as_transformers(stacked: dict, config: dict) -> dict:
    """Megatron's model keys (layers stacked on dim 0, experts on dim 1) -> the transformers
    module's state dict names and tensors (transformers 5 fuses the experts: gate_up_proj [E, 2F, D],
    down_proj [E, D, F])."""
    import torch

    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_group = heads // groups
    out = {}
    plain = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    per_layer = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                 "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
                 "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                 "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                 "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                 "mlp.linear_fc2.weight": "mlp.down_proj.weight", "mlp.router.weight": "mlp.gate.weight",
                 "mlp.experts.experts.linear_fc2.weight": "mlp.experts.down_proj"}
    for key, tensor in stacked.items():
        if key in plain:
            out[plain[key]] = tensor
            continue
        rest = key.removeprefix("decoder.layers.")
        for layer in range(tensor.shape[0]):
            value, head = tensor[layer], f"model.layers.{layer}."
            if rest in per_layer:
                out[head + per_layer[rest]] = value.clone()
            elif rest == "self_attention.linear_qkv.weight":
                blocks = value.view(groups, (per_group + 2) * head_dim, -1)
                out[head + "self_attn.q_proj.weight"] = blocks[:, :per_group * head_dim].reshape(-1, value.shape[-1])
                out[head + "self_attn.k_proj.weight"] = blocks[:, per_group * head_dim:(per_group + 1) * head_dim].reshape(
                    -1, value.shape[-1])
                out[head + "self_attn.v_proj.weight"] = blocks[:, (per_group + 1) * head_dim:].reshape(-1, value.shape[-1])
            elif rest == "mlp.linear_fc1.weight":
                out[head + "mlp.gate_proj.weight"], out[head + "mlp.up_proj.weight"] = (
                    part.clone() for part in value.chunk(2, dim=0))
            elif rest == "mlp.experts.experts.linear_fc1.weight":  # per expert [gate; up], then fused as transformers does
                experts = [torch.cat(expert.chunk(2, dim=0)) for expert in value]
                out[head + "mlp.experts.gate_up_proj"] = torch.stack(experts)
            else:
                raise AssertionError(f"no transformers name for {key}")
    return out


def bridge_weights(name: str) -> dict:
    """Megatron-Bridge's export (one key per expert) as the transformers module holds it."""
    import re

    import torch
    from safetensors.torch import load_file

    saved = load_file(MEGATRON / name / "hf" / "model.safetensors")
    out = {key: value for key, value in saved.items() if ".experts." not in key}
    layers = sorted({int(m[1]) for key in saved if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", key))})
    for layer in layers:
        head = f"model.layers.{layer}.mlp.experts."
        count = len({key.split(".")[5] for key in saved if key.startswith(head)})
        out[head + "gate_up_proj"] = torch.stack([torch.cat([saved[f"{head}{e}.gate_proj.weight"],
                                                            saved[f"{head}{e}.up_proj.weight"]]) for e in range(count)])
        out[head + "down_proj"] = torch.stack([saved[f"{head}{e}.down_proj.weight"] for e in range(count)])
    return out


@pytest.fixture(scope="module")
def expected() -> dict:
    """name -> the migration's expected values (sha256), from the save and from Megatron-Bridge."""
    found = {}
    for name in TRAINED:
        config = json.loads((MEGATRON / name / "hf" / "config.json").read_text())
        saved = megatron_tensors(name)
        model = {key: value for key, value in saved.items() if not key.startswith("optimizer.")}
        moments = {kind: as_transformers({key.removeprefix(f"optimizer.state.{kind}."): value for key, value in saved.items()
                                          if key.startswith(f"optimizer.state.{kind}.")}, config) for kind in MOMENTS}
        common = common_state(iteration_dir(name) / "common.pt")["optimizer"]
        optimizers = [common[key] for key in sorted(common)] if 0 in common else [common]
        found[name] = {
            "converted": {key: sha256(value) for key, value in as_transformers(model, config).items()},
            "bridge": {key: sha256(value) for key, value in bridge_weights(name).items()},
            "moments": {kind: {key: sha256(value) for key, value in tensors.items()} for kind, tensors in moments.items()},
            "steps": [tensor_bytes(optimizer["state"]["common_step"]).hex() for optimizer in optimizers],
            "groups": [[{key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}
                        for group in optimizer["param_groups"]] for optimizer in optimizers],
        }
    return found


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """(name, world) -> what the ranks loaded from `reshard(..., to="transformers")` at that world."""
    from fsdp_loads import free_port
    from rank_forks import run_ranks

    from ckpttool import reshard

    root = tmp_path_factory.mktemp("megatron-migration")
    results = {}
    for world in WORLDS:
        jobs = []
        for name in TRAINED:
            report = reshard(MEGATRON / name / "checkpoints", root / f"{name}-{world}", world_size=world, to="transformers")
            assert sorted(p.name for p in report.destination.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]
            assert not (report.destination / "common.pt").exists() and not (report.destination / "metadata.json").exists()
            jobs.append((name, str(report.destination)))
        out = root / f"world{world}.json"
        run_ranks("test_megatron_migration:_rank", world, world, free_port(), jobs, str(out), timeout=300)
        results.update({(name, world): result for name, result in json.loads(out.read_text()).items()})
    return results


# -- the ranks ------------------------------------------------------------------------------------

def _rank(rank: int, world: int, port: int, jobs: list, out: str) -> None:
    import os

    import torch.distributed as dist

    from fsdp_loads import exit_spawned_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {name: _load_and_step(name, source) for name, source in jobs}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _load_and_step(name: str, source: str) -> dict:
    """fully_shard(transformers model) + AdamW (other weights and settings than the save's: the load
    must replace them), stock dcp.load + set_state_dict, what was loaded, then one step."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MEGATRON / name / "hf"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    parameters = list(model.named_parameters())
    decay = [p for _, p in parameters if p.ndim > 1]  # Megatron's rule: no weight decay for 1-D parameters
    no_decay = [p for _, p in parameters if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.25}],
                                  lr=0.125, betas=(0.5, 0.75), eps=0.1)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    result: dict = {"weights": {}, "moments": {kind: {} for kind in MOMENTS}, "steps": {}, "groups": {}}
    for key, parameter in parameters:
        result["weights"][key] = sha256(_full(parameter.detach()))
        held = optimizer.state[parameter]
        for kind in MOMENTS:
            result["moments"][kind][key] = sha256(_full(held[kind]))
        result["steps"][key] = [str(held["step"].dtype), list(held["step"].shape), tensor_bytes(held["step"]).hex()]
        group = group_of[id(parameter)]
        result["groups"][key] = {setting: list(value) if isinstance(value, tuple) else value
                                 for setting, value in group.items() if setting in ("lr", "betas", "eps", "weight_decay")}
    ids = torch.tensor(json.loads((MEGATRON / name / "inputs.json").read_text())["input_ids"])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    result["loss"] = float(loss)
    result["after"] = sorted({float(optimizer.state[p]["step"]) for _, p in parameters})
    result["changed"] = sum(sha256(_full(p.detach())) != result["weights"][key] for key, p in parameters)
    return result


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TRAINED)
def test_fsdp2_loads_the_weights_megatron_bridge_exports(loaded, expected, name, world):
    """Every parameter of the fully_shard model, gathered, is Megatron-Bridge's export byte for
    byte (and what the torch-only conversion of the save gives)."""
    weights = loaded[(name, world)]["weights"]
    assert weights == expected[name]["bridge"] == expected[name]["converted"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TRAINED)
def test_every_parameters_adam_moments_and_step_are_megatrons_saved_state(loaded, expected, name, world):
    """exp_avg and exp_avg_sq of each parameter, after set_state_dict into AdamW on `world` ranks,
    are Megatron's saved moments converted by the table (q/k/v per query group, gate/up, fused
    experts) byte for byte; `step` is a 0-d float32 tensor holding common.pt's common_step bytes."""
    result = loaded[(name, world)]
    for kind in MOMENTS:
        assert result["moments"][kind] == expected[name]["moments"][kind], kind
    import struct

    [step] = set(expected[name]["steps"])  # the chained optimizers of moe_ep2 share one step
    assert struct.unpack("<f", bytes.fromhex(step)) == (2.0,)  # 2 Adam steps
    assert {tuple(map(str, value)) for value in result["steps"].values()} == {("torch.float32", "[]", step)}
    assert len(result["steps"]) == len(result["weights"])


@pytest.mark.parametrize("name", TRAINED)
def test_each_parameter_has_the_settings_of_its_megatron_param_group(loaded, expected, name):
    """lr (the scheduler's current one), betas, eps and weight_decay as Megatron saved the group
    it puts the parameter in: no weight decay for 1-D ones, experts in the expert optimizer's
    decay group; the AdamW built with other settings is overwritten."""
    groups = expected[name]["groups"]
    for world in WORLDS:
        result = loaded[(name, world)]
        for key, settings in result["groups"].items():
            one_dimensional = "norm" in key  # every 1-D parameter of these models is a norm weight
            expert = ".mlp.experts." in key
            saved = [group for optimizer in groups for group in optimizer
                     if group["wd_mult"] == (0.0 if one_dimensional else 1.0) and group["is_expert_parallel"] == expert]
            assert len(saved) == 1, key
            assert settings == {setting: saved[0][setting] for setting in ("lr", "betas", "eps", "weight_decay")}, key


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TRAINED)
def test_one_adamw_step_runs_after_the_load(loaded, name, world):
    result = loaded[(name, world)]
    assert result["after"] == [3.0]
    assert 0 < result["loss"] < 10 and result["changed"] == len(result["weights"])


def test_the_cli_writes_the_librarys_bytes(tmp_path):
    """`ckpttool reshard SAVE DST --world 2 --to transformers`, a real subprocess of the installed
    command: the same files, byte for byte, as the library call the ranks above load."""
    import subprocess

    from ckpttool import reshard

    source = MEGATRON / "moe_ep2" / "checkpoints"
    reshard(source, tmp_path / "lib", world_size=2, to="transformers")
    done = subprocess.run([sys.executable, "-m", "ckpttool", "reshard", str(source), str(tmp_path / "cli"), "--world", "2",
                           "--to", "transformers", "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli").iterdir()) and ".metadata" in names
    for name in names:  # .metadata names its own folder (storage_meta.checkpoint_id, as torch writes it)
        written = (tmp_path / "cli" / name).read_bytes().replace(b"\x03\x00\x00\x00cli", b"\x03\x00\x00\x00lib")
        assert written == (tmp_path / "lib" / name).read_bytes(), name


# -- refusals -------------------------------------------------------------------------------------

def test_the_distributed_optimizers_state_is_refused_by_its_sharding_type(tmp_path):
    """A save whose common.pt says the distributed optimizer wrote it (`param_state_sharding_type`,
    DistributedOptimizer.sharded_state_dict) names that, exit 1, nothing written."""
    import torch

    from ckpttool import reshard
    from ckpttool.core.errors import UnsupportedFormat

    copy = tmp_path / "iter_0000002"
    shutil.copytree(iteration_dir("llama_tp2"), copy)
    state = common_state(copy / "common.pt")
    state["optimizer"]["param_state_sharding_type"] = "dp_reshardable"
    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    saved = {module: sys.modules.get(module) for module in names}
    for module in names:
        sys.modules[module] = types.ModuleType(module)
    sys.modules["megatron.core.transformer.enums"].AttnBackend = type(state["args"].attention_backend)  # type: ignore[attr-defined]
    try:
        torch.save(state, copy / "common.pt")
    finally:
        for module, value in saved.items():
            if value is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = value
    with pytest.raises(UnsupportedFormat) as raised:
        reshard(copy, tmp_path / "out", world_size=2, to="transformers")
    message = str(raised.value)
    assert "\n" not in message and "common.pt: optimizer: param_state_sharding_type 'dp_reshardable'" in message
    assert raised.value.exit_code == 1 and not (tmp_path / "out").exists()


def test_a_checkpoint_that_is_not_a_megatron_save_is_a_usage_error(tmp_path):
    from ckpttool import reshard
    from ckpttool.core.errors import UsageError

    source = next(path for path in sorted(FIXTURES.glob("fsdp2_*")) if (path / ".metadata").is_file())
    with pytest.raises(UsageError) as raised:
        reshard(source, tmp_path / "out", world_size=2, to="transformers")
    assert "not" not in str(raised.value).split(":")[0] and "Megatron-Core torch_dist" in str(raised.value)
    assert raised.value.exit_code == 2 and not (tmp_path / "out").exists()
