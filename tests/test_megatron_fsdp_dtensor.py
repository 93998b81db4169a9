"""Megatron-LM's `--ckpt-format fsdp_dtensor` saves (Megatron-FSDP), written by Megatron-LM's own
`save_checkpoint` (core_v0.16.1, megatron-core 0.16.1) from a Llama-style GPTModel wrapped in
Megatron-FSDP at data parallel 2 on gloo (fixtures/frameworks/generate_megatron_fsdp_dtensor.py):
torch DCP in `checkpoints/iter_0000002/` beside `latest_checkpointed_iteration.txt`, model tensors
`model.module.<GPTModel key>` unevenly sharded by rows, the SwiGLU fc1 as `weight_w` / `weight_v`,
the arguments as the DCP byte entry `args`, no common.pt.

The references are Megatron's own: expected.json is a fresh Megatron-FSDP model after Megatron-LM's
`load_checkpoint`, each parameter assembled at Megatron-FSDP's own chunk offsets; hf/ is
Megatron-Bridge 0.3.1's LlamaBridge export of those tensors. That save has no optimizer state
(megatron-core 0.16.1 cannot save it at data parallel 2 here: the generator's docstring says why);
`with_optimizer/` is the same run (one layer) at data parallel 1 with its optimizer state, and its
optimizer_expected.json each parameter's AdamW state after Megatron-LM's own load_checkpoint.
`megatron_torch_dcp/` is Megatron-LM's other DCP format, `--ckpt-format torch_dcp` (torch FSDP2,
`--use-torch-fsdp2`), same model, model only: its expected.json is torch's `dcp.load` of the save into
a fresh FSDP2 model (Megatron-LM's own load_checkpoint of torch_dcp fails in that release; the
generator says why). No megatron is imported here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes, tensor_bytes

FSDP = FIXTURES / "frameworks" / "megatron_fsdp_dtensor"
RUN_DIR = FSDP / "checkpoints"
ITERATION = RUN_DIR / "iter_0000002"
EXPECTED = json.loads((FSDP / "expected.json").read_text())
LAYOUT = "megatron-fsdp-dtensor"
WITH_OPTIMIZER = FSDP / "with_optimizer"
TORCH_DCP = FIXTURES / "frameworks" / "megatron_torch_dcp"
MOMENTS = ("exp_avg", "exp_avg_sq")


def written(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run):
    out = tmp_path_factory.mktemp("fsdp") / "hf"
    result = run("export", RUN_DIR, out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def copy_of_iteration(tmp_path: Path) -> Path:
    """A run folder holding a copy of the fixture's save, for damaging."""
    run_dir = tmp_path / "checkpoints"
    shutil.copytree(RUN_DIR, run_dir)
    return run_dir


# -- found by structure ---------------------------------------------------------------------------

@pytest.mark.parametrize("source", [FSDP / "checkpoints", ITERATION], ids=["run-folder", "iter-folder"])
def test_inspect_names_the_layout_from_the_run_and_the_iteration_folder(run, source):
    result = run("inspect", source, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["layout"] == LAYOUT
    assert Path(document["path"]).name == "iter_0000002"


def test_the_run_folder_newest_is_named_by_megatrons_tracker_file():
    from ckpttool.readers import detect

    detection = detect(RUN_DIR)
    assert (detection.layout, detection.newest, detection.newest_by) == (
        LAYOUT, "iter_0000002", "latest_checkpointed_iteration.txt")


def test_without_reading_metadata_it_is_plain_dcp():
    from ckpttool.readers import detect

    assert detect(ITERATION, read_metadata=False).layout == "dcp"


def test_inspect_shows_the_gptmodels_names_and_the_config_from_the_args_entry(run):
    result = run("inspect", RUN_DIR)
    assert result.exit_code == 0, result.output
    for name in EXPECTED["tensors"]:
        assert f"model.{name} " in result.output, name
    assert "weight_w" not in result.output and "model.module." not in result.output
    assert "writes them as LlamaForCausalLM names (the config: the Megatron-LM arguments in its DCP entry `args`" \
        in result.output, result.output


# -- the model view ------------------------------------------------------------------------------------

def test_the_swiglu_halves_are_one_tensor_pointing_at_the_stored_bytes():
    from ckpttool.readers import open_checkpoint

    saved = open_checkpoint(ITERATION, as_saved=True)
    view = open_checkpoint(ITERATION)
    fused = view.tensors["model.decoder.layers.0.mlp.linear_fc1.weight"]
    gate = saved.tensors["model.module.decoder.layers.0.mlp.linear_fc1.weight_w"]
    up = saved.tensors["model.module.decoder.layers.0.mlp.linear_fc1.weight_v"]
    assert fused.shape == (128, 32) and gate.shape == up.shape == (64, 32)
    assert [c.blob for c in fused.chunks] == [*(c.blob for c in gate.chunks), *(c.blob for c in up.chunks)]
    assert [c.offsets for c in fused.chunks] == [(0, 0), (64, 0)]
    assert view.model_prefix == "model"
    assert sorted(name for name in view.tensors if name.startswith("model.")) == sorted(
        f"model.{name}" for name in EXPECTED["tensors"])


def test_consolidate_equals_megatrons_own_load(tmp_path, run):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = run("consolidate", RUN_DIR, out, "--quiet")
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    assert sorted(tensors) == sorted(EXPECTED["tensors"])
    for name, tensor in tensors.items():
        expected = EXPECTED["tensors"][name]
        assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [expected["shape"], expected["dtype"]], name
        assert hashlib.sha256(tensor_bytes(tensor)).hexdigest() == expected["sha256"], name


# -- export ----------------------------------------------------------------------------------------------

def test_export_equals_megatron_bridges_export_byte_for_byte(exported):
    from safetensors.torch import load_file

    mine, expected = written(exported), load_file(str(FSDP / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(mine[key], tensor, key)


def test_export_writes_the_config_the_saved_arguments_state(exported):
    mine = json.loads((exported / "config.json").read_text())
    bridge = json.loads((FSDP / "hf" / "config.json").read_text())
    assert mine["architectures"] == bridge["architectures"] == ["LlamaForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert mine[field] == bridge[field], field


def test_reshard_to_transformers_of_a_save_without_optimizer_state_is_refused_by_name(tmp_path, run):
    out = tmp_path / "out"
    result = run("reshard", RUN_DIR, out, "--world", "2", "--to", "transformers")
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "a Megatron-FSDP (--ckpt-format fsdp_dtensor) save without optimizer state" in result.output
    assert not out.exists()


# -- the optimizer state: reshard --to transformers ----------------------------------------------------

@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> dict:
    """world -> the output of reshard(with_optimizer, to="transformers"), as torch's own
    dcp_to_torch_save reads it back ({"model": ..., "optim": {"state", "param_groups"}})."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpttool import reshard

    root = tmp_path_factory.mktemp("fsdp-migration")
    found = {}
    for world in (2, 3):
        report = reshard(WITH_OPTIMIZER / "checkpoints", root / f"world{world}", world_size=world, to="transformers")
        assert sorted(p.name for p in report.destination.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]
        dcp_to_torch_save(report.destination, root / f"world{world}.pt")
        found[world] = torch.load(root / f"world{world}.pt", weights_only=True)
        found[world]["destination"] = str(report.destination)
    return found


@pytest.fixture(scope="module")
def fully_sharded(migrated, tmp_path_factory) -> dict:
    """world -> what stock dcp.load + set_state_dict put in transformers' model under fully_shard
    (per layer and whole) and torch's AdamW (other settings and weights than the save's), on
    `world` gloo ranks: full tensors of each parameter, its moments and step, and its group."""
    import torch

    from fsdp_loads import free_port
    from rank_forks import run_ranks

    found = {}
    for world in (2, 3):
        out = tmp_path_factory.mktemp("fsdp-loaded") / f"world{world}.pt"
        run_ranks("test_megatron_fsdp_dtensor:_load_rank", world, world, free_port(), migrated[world]["destination"],
                  str(out), timeout=300)
        found[world] = torch.load(out, weights_only=True)
    return found


def _load_rank(rank: int, world: int, port: int, source: str, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_loads import exit_spawned_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(WITH_OPTIMIZER / "hf"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    parameters = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for _, p in parameters if p.ndim > 1], "weight_decay": 0.5},
                                   {"params": [p for _, p in parameters if p.ndim <= 1], "weight_decay": 0.25}],
                                  lr=0.125, betas=(0.5, 0.75), eps=0.1)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    result: dict = {}
    for key, parameter in parameters:
        entry = {"weight": parameter.detach().full_tensor().clone(), "step": optimizer.state[parameter]["step"].clone(),
                 "weight_decay": group_of[id(parameter)]["weight_decay"], "lr": group_of[id(parameter)]["lr"]}
        for kind in MOMENTS:
            entry[kind] = optimizer.state[parameter][kind].full_tensor().clone()
        result[key] = entry
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_every_parameters_moments_and_step_are_megatrons_own_loaded_state(migrated, world):
    """exp_avg and exp_avg_sq put back into Megatron's names (q/k/v per query group, [gate; up]) are
    byte for byte what Megatron-FSDP's optimizer held after Megatron-LM loaded the save; so is each
    parameter's 0-d step."""
    from test_megatron_legacy_migration import as_megatron

    config = json.loads((WITH_OPTIMIZER / "hf" / "config.json").read_text())
    expected = json.loads((WITH_OPTIMIZER / "optimizer_expected.json").read_text())["tensors"]
    state = migrated[world]["optim"]["state"]
    for kind in (*MOMENTS, "step"):
        if kind == "step":  # a 0-d tensor per parameter, the same (2.0) for all: compared as a set
            got = {(str(entry["step"].dtype).removeprefix("torch."), hashlib.sha256(tensor_bytes(entry["step"])).hexdigest())
                   for entry in state.values()}
            assert got == {(info["dtype"], info["sha256"]) for name, info in expected.items() if name.endswith(".step")}
            assert len(state) == len(migrated[world]["model"])
            continue
        values = as_megatron({name: entry[kind] for name, entry in state.items()}, config)
        assert sorted(f"{key}.{kind}" for key in values) == sorted(name for name in expected if name.endswith(f".{kind}"))
        for key, tensor in values.items():
            info = expected[f"{key}.{kind}"]
            assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [info["shape"], info["dtype"]], key
            assert hashlib.sha256(tensor_bytes(tensor)).hexdigest() == info["sha256"], (key, kind)


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_and_adamw_load_the_migration_with_set_state_dict(migrated, fully_sharded, world):
    """Every weight, moment and step that set_state_dict put in the fully_shard model and AdamW is
    byte for byte the migration's (which the test above holds to Megatron's own state), and each
    parameter has its saved group's settings, not the ones the script built AdamW with."""
    written_state, model = migrated[world]["optim"]["state"], migrated[world]["model"]
    loaded = fully_sharded[world]
    assert sorted(loaded) == sorted(model)
    for key, entry in loaded.items():
        assert_same_bytes(entry["weight"], model[key], key)
        for kind in (*MOMENTS, "step"):
            assert_same_bytes(entry[kind], written_state[key][kind], f"{key}.{kind}")
        assert entry["weight_decay"] == (0.0 if model[key].ndim == 1 else 0.01), key
        assert entry["lr"] != 0.125, key


def test_each_parameter_keeps_the_group_megatron_saved_it_in(migrated):
    """Megatron's standard overrides: no weight decay for 1-D parameters; the lr is the scheduler's
    at the save (the saved group's), its own bookkeeping keys left out."""
    groups = migrated[2]["optim"]["param_groups"]
    by_name = {name: group for group in groups for name in group["params"]}
    model = migrated[2]["model"]
    assert sorted(by_name) == sorted(model)
    for name, group in by_name.items():
        assert group["weight_decay"] == (0.0 if model[name].ndim == 1 else 0.01), name
        assert group["betas"] == (0.9, 0.999) and "wd_mult" not in group and "max_lr" not in group
    assert len({group["lr"] for group in groups}) == 1


def test_the_migrated_weights_are_the_export_of_the_same_save(migrated, tmp_path, run):
    result = run("export", WITH_OPTIMIZER / "checkpoints", tmp_path / "hf", "--quiet")
    assert result.exit_code == 0, result.output
    exported = written(tmp_path / "hf")
    assert sorted(exported) == sorted(migrated[2]["model"])
    for name, tensor in exported.items():
        assert_same_bytes(migrated[2]["model"][name], tensor, name)


def test_the_save_with_optimizer_consolidates_to_megatrons_own_tensors(tmp_path, run):
    from safetensors.torch import load_file

    expected = json.loads((WITH_OPTIMIZER / "expected.json").read_text())["tensors"]
    out = tmp_path / "model.safetensors"
    result = run("consolidate", WITH_OPTIMIZER / "checkpoints", out, "--quiet")
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    assert sorted(tensors) == sorted(expected)
    for name, tensor in tensors.items():
        assert hashlib.sha256(tensor_bytes(tensor)).hexdigest() == expected[name]["sha256"], name


# -- damaged and unsupported -------------------------------------------------------------------------

def test_a_missing_rank_file_exits_1_naming_it(tmp_path, run):
    run_dir = copy_of_iteration(tmp_path)
    (run_dir / "iter_0000002" / "__1_0.distcp").unlink()
    out = tmp_path / "model.safetensors"
    result = run("consolidate", run_dir, out)
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "__1_0.distcp" in result.output
    assert not out.exists()


def test_a_foreign_global_in_the_args_entry_exits_1_naming_it(tmp_path, run):
    """The `args` entry is dcp.save's torch.save of the Namespace: its pickle names argparse.Namespace.
    Renamed to a global outside the allow-list (same length), export refuses it in one line."""
    run_dir = copy_of_iteration(tmp_path)
    data = run_dir / "iter_0000002" / "__0_0.distcp"
    raw = data.read_bytes()
    assert raw.count(b"argparse\nNamespace\n") == 1
    data.write_bytes(raw.replace(b"argparse\nNamespace\n", b"argparse\nNamespacX\n"))
    out = tmp_path / "hf"
    result = run("export", run_dir, out)
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "__0_0.distcp" in result.output and "args" in result.output, result.output
    assert not out.exists()


def test_a_swiglu_half_without_its_partner_exits_1_naming_it(tmp_path, run):
    import pickle

    import torch.distributed.checkpoint as dcp

    run_dir = copy_of_iteration(tmp_path)
    folder = run_dir / "iter_0000002"
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    gone = "model.module.decoder.layers.1.mlp.linear_fc1.weight_v"
    del metadata.state_dict_metadata[gone]
    metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != gone}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    result = run("consolidate", run_dir, tmp_path / "model.safetensors")
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "decoder.layers.1.mlp.linear_fc1.weight_w (SwiGLU gate rows) is saved without its up rows" in result.output
    assert not (tmp_path / "model.safetensors").exists()


# -- Megatron-LM's torch_dcp format ---------------------------------------------------------------------

def test_a_torch_dcp_save_is_found_by_structure_from_its_run_folder(run):
    from ckpttool.readers import detect

    detection = detect(TORCH_DCP / "checkpoints")
    assert (detection.layout, detection.newest, detection.newest_by) == (
        "megatron-torch-dcp", "iter_0000002", "latest_checkpointed_iteration.txt")
    document = json.loads(run("inspect", TORCH_DCP / "checkpoints", "--json").stdout)
    assert document["layout"] == "megatron-torch-dcp"


def test_a_torch_dcp_save_exports_as_megatron_bridge_does_byte_for_byte(tmp_path, run):
    from safetensors.torch import load_file

    result = run("export", TORCH_DCP / "checkpoints", tmp_path / "hf", "--quiet")
    assert result.exit_code == 0, result.output
    mine, expected = written(tmp_path / "hf"), load_file(str(TORCH_DCP / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(mine[key], tensor, key)


def test_a_torch_dcp_save_consolidates_to_the_models_tensors_leaving_its_extra_state_out(tmp_path, run):
    from safetensors.torch import load_file

    expected = json.loads((TORCH_DCP / "expected.json").read_text())["tensors"]
    out = tmp_path / "model.safetensors"
    result = run("consolidate", TORCH_DCP / "checkpoints", out, "--quiet")
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out))
    assert sorted(tensors) == sorted(expected)
    for name, tensor in tensors.items():
        assert hashlib.sha256(tensor_bytes(tensor)).hexdigest() == expected[name]["sha256"], name


def test_reshard_to_transformers_of_a_torch_dcp_save_is_refused_by_name(tmp_path, run):
    result = run("reshard", TORCH_DCP / "checkpoints", tmp_path / "out", "--world", "2", "--to", "transformers")
    assert result.exit_code == 1, result.output
    assert "a Megatron-LM --ckpt-format torch_dcp save; it holds no optimizer state" in result.output
    assert not (tmp_path / "out").exists()
