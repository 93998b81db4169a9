"""SRC is found by structure wherever it sits: a run's newest step by the step its name carries
(never name order), a save a `latest` file names, one a few folders down, and where one step
holds a module export beside its training save, the training save (or the one `--layout`
names), saying so. Several runs below SRC, or a model beside saves of unknown step, exit 2
listing the candidates.

The folders are built from real checkpoints (torch's own dcp.save, DeepSpeed's own save) in
the shapes trainers give them: HF Trainer's `checkpoint-N/` (model.safetensors + `latest` +
`global_stepN/`), Lightning's `epoch=E-step=S.ckpt/` (`latest` naming `checkpoint/`) and
`lightning_logs/version_V/checkpoints/`. The trainers' own saves are tested in
test_trainer_folders.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpttool import readers
from ckpttool.core.errors import AmbiguousSource, UsageError
from conftest import FIXTURES

DCP = FIXTURES / "fsdp2_world2"
ZERO2 = FIXTURES / "frameworks" / "deepspeed" / "zero2_fp32" / "checkpoints" / "global_step2"


def dcp_copy(path: Path) -> Path:
    shutil.copytree(DCP, path)
    return path


def zero_save(folder: Path, tag: str) -> Path:
    """A DeepSpeed save dir as `engine.save_checkpoint(folder, tag)` leaves it: the tag folder and `latest`."""
    shutil.copytree(ZERO2, folder / tag)
    (folder / "latest").write_text(tag)
    return folder


@pytest.fixture(scope="module")
def module_weights(tmp_path_factory):
    """The ZeRO save's model in bf16, as the Trainer's `save_model` writes it beside the save."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    out = tmp_path_factory.mktemp("module") / "model.safetensors"
    result = CliRunner().invoke(main, ["consolidate", str(ZERO2), str(out), "--dtype", "bf16", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def trainer_step(folder: Path, step: int, module_weights: Path | None) -> Path:
    """HF Trainer's `checkpoint-N/`: the ZeRO save (global_stepN + latest) and, at ZeRO-2, model.safetensors."""
    zero_save(folder, f"global_step{step}")
    if module_weights is not None:
        shutil.copy(module_weights, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_a_run_of_step_names_of_any_padding_opens_the_highest_step_not_the_last_name(tmp_path):
    for name in ("step-900", "step-1000", "step-00000950"):
        dcp_copy(tmp_path / "run" / name)
    detection = readers.detect(tmp_path / "run")
    assert (detection.newest, detection.checkpoints) == ("step-1000", ("step-900", "step-00000950", "step-1000"))


def test_lightning_names_order_by_their_step_not_by_name(tmp_path):
    run = tmp_path / "checkpoints"
    for name in ("epoch=0-step=5.ckpt", "epoch=0-step=10.ckpt", "epoch=0-step=10-v1.ckpt"):
        dcp_copy(run / name)
    assert sorted(p.name for p in run.iterdir())[0] == "epoch=0-step=10-v1.ckpt"  # name order would pick step=5
    detection = readers.detect(run)
    assert detection.newest == "epoch=0-step=10-v1.ckpt"
    assert detection.checkpoints == ("epoch=0-step=5.ckpt", "epoch=0-step=10.ckpt", "epoch=0-step=10-v1.ckpt")


def test_a_save_that_latest_names_is_read_from_the_folder_holding_it(tmp_path):
    ckpt = zero_save(tmp_path / "epoch=0-step=10.ckpt", "checkpoint")  # Lightning's DeepSpeedStrategy
    detection, checkpoint = readers.read(ckpt)
    assert (detection.layout, detection.path, checkpoint.path) == ("deepspeed", ckpt / "checkpoint", ckpt / "checkpoint")
    assert detection.found_below and detection.describe() == f"deepspeed: {ckpt / 'checkpoint'}"


def test_a_run_folder_a_few_levels_down_is_found(tmp_path):
    run = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    for step in (5, 10):
        zero_save(run / f"epoch=0-step={step}.ckpt", "checkpoint")
    detection = readers.detect(tmp_path / "lightning_logs")
    assert (detection.layout, detection.newest, detection.path) == (
        "deepspeed", "epoch=0-step=10.ckpt", run / "epoch=0-step=10.ckpt" / "checkpoint")


def test_two_runs_below_src_exit_2_listing_both(tmp_path, cli):
    for version in (0, 1):
        dcp_copy(tmp_path / "lightning_logs" / f"version_{version}" / "checkpoints" / "epoch=0-step=2.ckpt")
    with pytest.raises(AmbiguousSource) as caught:
        readers.detect(tmp_path / "lightning_logs")
    message = str(caught.value)
    assert "\n" not in message and "version_0/checkpoints" in message and "version_1/checkpoints" in message
    result = cli("inspect", tmp_path / "lightning_logs")
    assert result.exit_code == 2 and "[ambiguous-source]" in result.output and "name one of them" in result.output


def test_trainer_step_with_model_and_zero_save_reads_the_zero_save_and_says_what_else_is_there(tmp_path, cli,
                                                                                                module_weights):
    step = trainer_step(tmp_path / "checkpoint-10", 10, module_weights)
    detection = readers.detect(step)
    assert (detection.layout, detection.path) == ("deepspeed", step / "global_step10")
    assert detection.beside == (("hub-folder", step),)
    result = cli("inspect", step, "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)["found"]
    assert "read the deepspeed save" in found and f"not read: hub-folder {step}" in found and "--layout hub-folder" in found
    text = cli("inspect", step).stdout
    assert "  found: deepspeed" in text and "optimizer:" in text  # the ZeRO save's optimizer state is there


def test_consolidate_says_on_stderr_and_in_json_which_save_it_read_and_layout_picks_the_other(tmp_path, cli,
                                                                                             module_weights):
    from safetensors import safe_open

    step = trainer_step(tmp_path / "checkpoint-10", 10, module_weights)
    result = cli("consolidate", step, tmp_path / "zero.safetensors", "--json", "--quiet")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["source_choice"].startswith(f"read the deepspeed save {step / 'global_step10'}")
    assert document["source_choice"] in result.stderr
    with safe_open(tmp_path / "zero.safetensors", "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} >= {"torch.float32"}  # the fp32 master weights
    result = cli("consolidate", step, tmp_path / "module.safetensors", "--layout", "hub-folder", "--json", "--quiet")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source_choice"].startswith(f"read the hub-folder save {step} (--layout)")
    assert (tmp_path / "module.safetensors").read_bytes() == module_weights.read_bytes()


def test_the_fp32_master_weights_cast_to_bf16_are_the_module_the_trainer_wrote(tmp_path, cli, module_weights):
    """Why the ZeRO save is the default: the 16-bit module is its rounding, so nothing is lost."""
    step = trainer_step(tmp_path / "checkpoint-10", 10, module_weights)
    result = cli("diff", module_weights, step, "--normalize", "--only", "model", "--quiet")
    assert result.exit_code == 1  # fp32 masters against their bf16 rounding
    result = cli("consolidate", step, tmp_path / "cast.safetensors", "--dtype", "bf16", "--quiet")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cast.safetensors").read_bytes() == module_weights.read_bytes()


def test_reshard_of_a_trainer_step_migrates_the_zero_save_with_its_optimizer_state(tmp_path, cli, module_weights):
    step = trainer_step(tmp_path / "checkpoint-10", 10, module_weights)
    result = cli("reshard", step, tmp_path / "fsdp2", "--world", "2", "--quiet")
    assert result.exit_code == 0, result.output
    keys = json.loads(cli("inspect", tmp_path / "fsdp2", "--json").stdout)["tensors"]
    assert any(".exp_avg_sq" in t["fqn"] for t in keys)


def test_a_run_of_trainer_steps_opens_the_newest_and_its_zero_save(tmp_path, module_weights):
    run = tmp_path / "out"
    trainer_step(run / "checkpoint-10", 10, None)  # ZeRO-3 without the gathered module
    trainer_step(run / "checkpoint-5", 5, None)
    detection = readers.detect(run)
    assert (detection.layout, detection.newest, detection.path) == (
        "deepspeed", "checkpoint-10", run / "checkpoint-10" / "global_step10")
    assert detection.describe().startswith("deepspeed: checkpoint-10, newest of 2 checkpoints")


def test_a_model_beside_saves_of_unknown_step_exits_2_unless_layout_chooses(tmp_path, module_weights):
    run = tmp_path / "out"
    for number in (5, 10):
        trainer_step(run / f"checkpoint-{number}", number, None)
    shutil.copy(module_weights, run / "model.safetensors")  # trainer.save_model() at the end of training
    with pytest.raises(AmbiguousSource, match="nothing says they are the same step"):
        readers.detect(run)
    assert readers.detect(run, layout="hub-folder").path == run
    assert readers.detect(run, layout="deepspeed").path == run / "checkpoint-10" / "global_step10"


def test_layout_naming_nothing_there_is_a_usage_error(tmp_path):
    step = trainer_step(tmp_path / "checkpoint-10", 10, None)
    with pytest.raises(UsageError, match="--layout hub-folder, but it holds no hub-folder checkpoint"):
        readers.detect(step, layout="hub-folder")
    with pytest.raises(UsageError, match="not a layout ckpttool reads"):
        readers.detect(step, layout="zero")


def test_lightnings_fsdp_run_folder_opens_its_save_and_reads_past_the_lightning_module(cli, tmp_path):
    """Lightning's FSDP strategy (DCP + meta.pt) from its run's checkpoints/ folder, as from the save."""
    from safetensors import safe_open

    run = FIXTURES / "frameworks" / "lightning" / "checkpoints"
    detection = readers.detect(run)
    assert (detection.layout, detection.newest) == ("lightning", "epoch=0-step=2.ckpt")
    for name, src in (("run", run), ("save", run / "epoch=0-step=2.ckpt")):
        assert cli("consolidate", src, tmp_path / f"{name}.safetensors", "--quiet").exit_code == 0
    assert (tmp_path / "run.safetensors").read_bytes() == (tmp_path / "save.safetensors").read_bytes()
    with safe_open(tmp_path / "run.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "fc1.bias", "fc1.weight", "fc2.weight"]


def test_lightnings_forward_module_wrapper_and_module_attribute_are_read_past(tmp_path, cli):
    """A LightningModule inside Lightning's wrapper (`_LightningModuleWrapperBase._forward_module`,
    what its DDP strategy wraps), saved with torch's dcp.save: the model's own names come out."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5)

    class LightningModule(torch.nn.Module):  # holds the model as `self.model`, as the fixtures' do
        def __init__(self):
            super().__init__()
            self.model = Model()

    class Wrapper(torch.nn.Module):  # lightning/pytorch/overrides/base.py's attribute name
        def __init__(self):
            super().__init__()
            self._forward_module = LightningModule()

    wrapper = Wrapper()
    dcp.save({"model": wrapper.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    result = cli("consolidate", tmp_path / "ckpt", tmp_path / "out.safetensors", "--quiet")
    assert result.exit_code == 0, result.output
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(Model().state_dict())
        assert torch.equal(f.get_tensor("embed.weight"), wrapper._forward_module.model.embed.weight)
