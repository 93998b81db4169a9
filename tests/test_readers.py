"""`readers.detect` names each layout from its files; `open_checkpoint` reads the ones this
build reads, opens a run directory's newest checkpoint, and says clearly when nothing matches.

Layouts are built in tmp dirs from the bundled checkpoints (torch's own writers); the
framework marker files (meta.pt, common.pt, verl's per-rank .pt) are never read, so their
bytes do not matter here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpttool import readers
from ckpttool.core.errors import CorruptBlob, CorruptMetadata, NotACheckpoint
from ckpttool.readers.detect import is_torchtitan
from conftest import FIXTURES

DCP = FIXTURES / "fsdp2_world2"
DCP_HF = FIXTURES / "dcp_hf_world2"
CONSOLIDATED = FIXTURES / "dcp_hf_world2_consolidated"
CONSOLIDATED_FILE = CONSOLIDATED / "model-00001-of-00001.safetensors"


def copy_dcp(path: Path) -> Path:
    shutil.copytree(DCP, path)
    return path


def test_detect_plain_dcp_and_open_reads_its_metadata():
    detection = readers.detect(DCP)
    assert (detection.layout, detection.path, detection.run_directory) == ("dcp", DCP, False)
    assert "model.embed.weight" in readers.open_checkpoint(DCP).tensors


def test_detect_torch_hf_writer_output_sharded_and_consolidated():
    assert readers.detect(DCP_HF).layout == "dcp-hf"
    assert readers.detect(CONSOLIDATED).layout == "dcp-hf"


def test_detect_lightning_by_meta_pt_beside_dcp(tmp_path):
    path = copy_dcp(tmp_path / "epoch=0-step=10.ckpt")
    (path / "meta.pt").write_bytes(b"not read")
    detection, checkpoint = readers.read(path)
    assert detection.layout == "lightning"
    assert checkpoint.tensors.keys() == readers.open_checkpoint(DCP).tensors.keys()


def test_detect_megatron_torch_dist_by_metadata_json_and_common_pt(tmp_path):
    path = copy_dcp(tmp_path / "iter_0000010")
    (path / "common.pt").write_bytes(b"not read")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    assert readers.detect(path).layout == "megatron-torch-dist"
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert readers.detect(path).layout == "dcp"


def test_detect_accelerate_reads_its_model_folder(tmp_path):
    copy_dcp(tmp_path / "pytorch_model_fsdp_0")
    detection, checkpoint = readers.read(tmp_path)
    assert detection.layout == "accelerate"
    assert detection.path == tmp_path / "pytorch_model_fsdp_0" == checkpoint.path
    # with an optimizer_0 beside it, the two read as one checkpoint of the folder; here both
    # copies name the same entries, which is refused
    copy_dcp(tmp_path / "optimizer_0")
    with pytest.raises(CorruptMetadata, match="pytorch_model_fsdp_0 and optimizer_0 name the same entries"):
        readers.read(tmp_path)


def test_detect_torchtitan_by_its_top_level_keys(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"tok_embeddings.weight": torch.arange(6.0).reshape(3, 2),
             "optimizer": {"state.tok_embeddings.weight.step": torch.tensor(1.0)},
             "lr_scheduler": {"last_epoch": 1}, "train_state": {"step": torch.tensor(1)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"))
    assert readers.detect(tmp_path / "step-1").layout == "torchtitan"
    assert is_torchtitan(["model.x", "optim.state.x", "scheduler"]) is False  # train_minimal's keys


def test_detect_verl_per_rank_files_and_refuse_unreadable_ones_in_one_line(tmp_path):
    for rank in range(2):
        (tmp_path / "actor").mkdir(exist_ok=True)
        (tmp_path / "actor" / f"model_world_size_2_rank_{rank}.pt").write_bytes(b"not read")
    assert readers.detect(tmp_path).layout == "verl"
    with pytest.raises(CorruptBlob, match="model_world_size_2_rank_0.pt: torch.save record has no zip directory"):
        readers.open_checkpoint(tmp_path)


def test_detect_single_safetensors_file_and_torch_pt_file(tmp_path):
    detection, checkpoint = readers.read(CONSOLIDATED_FILE)
    assert detection.layout == "safetensors"
    assert checkpoint.path == CONSOLIDATED and checkpoint.metadata_file == CONSOLIDATED_FILE.name
    assert checkpoint.tensors["embed.weight"].shape == (13, 8)
    (tmp_path / "model.pt").write_bytes(b"not read")
    assert readers.detect(tmp_path / "model.pt").layout == "torch-pt"


def test_hub_folder_with_single_file_or_index_reads_the_same_tensors(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(CONSOLIDATED_FILE, single / "model.safetensors")
    (single / "config.json").write_text("{}")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(CONSOLIDATED_FILE, sharded / "weights-a.safetensors")
    weight_map = json.loads((CONSOLIDATED / "model.safetensors.index.json").read_text())["weight_map"]
    index = {"metadata": {"total_size": 604}, "weight_map": dict.fromkeys(weight_map, "weights-a.safetensors")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = readers.open_checkpoint(CONSOLIDATED).tensors
    for path in (single, sharded):
        detection, checkpoint = readers.read(path)
        assert detection.layout == "hub-folder"
        assert {f: (t.dtype, t.shape) for f, t in checkpoint.tensors.items()} == \
            {f: (t.dtype, t.shape) for f, t in expected.items()}


def test_hub_index_naming_a_tensor_its_file_lacks_is_refused(tmp_path):
    shutil.copy(CONSOLIDATED_FILE, tmp_path / "a.safetensors")
    index = {"weight_map": {"embed.weight": "a.safetensors", "lm_head.weight": "a.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="lm_head.weight is mapped to a.safetensors"):
        readers.open_checkpoint(tmp_path)
    index["weight_map"]["lm_head.weight"] = "../outside.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="leaves the checkpoint directory"):
        readers.open_checkpoint(tmp_path)


def make_run(root: Path, names: list[str]) -> Path:
    root.mkdir()
    for name in names:
        copy_dcp(root / name)
    (root / "logs").mkdir()
    return root


def test_run_directory_opens_the_highest_step_and_says_so(tmp_path):
    run = make_run(tmp_path / "run", ["step-2", "step-10", "step-9"])
    detection, checkpoint = readers.read(run)
    assert detection.checkpoints == ("step-2", "step-9", "step-10")
    assert (detection.newest, detection.newest_by, detection.layout) == ("step-10", "highest number", "dcp")
    assert checkpoint.path == run / "step-10"
    assert detection.describe() == f"dcp: step-10, newest of 3 checkpoints in {run} (by highest number)"


def test_run_directory_follows_latest_link_or_file(tmp_path):
    run = make_run(tmp_path / "run", ["step-2", "step-9"])
    (run / "latest").symlink_to("step-2")
    assert readers.detect(run).newest == "step-2"
    (run / "latest").unlink()
    (run / "latest").write_text("step-9\n")
    assert (readers.detect(run).newest, readers.detect(run).newest_by) == ("step-9", "latest")


def test_run_directory_follows_megatron_and_verl_iteration_tracker(tmp_path):
    megatron = make_run(tmp_path / "megatron", ["iter_0000005", "iter_0000010"])
    (megatron / "latest_checkpointed_iteration.txt").write_text("5")
    assert readers.detect(megatron).newest == "iter_0000005"
    verl = tmp_path / "verl"
    for step in (3, 6):
        (verl / f"global_step_{step}" / "actor").mkdir(parents=True)
        (verl / f"global_step_{step}" / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"")
    (verl / "latest_checkpointed_iteration.txt").write_text("3")
    detection = readers.detect(verl)
    assert (detection.layout, detection.newest, detection.checkpoints) == ("verl", "global_step_3", ("global_step_3", "global_step_6"))


def test_no_match_is_one_line_naming_what_was_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotACheckpoint) as caught:
        readers.open_checkpoint(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{tmp_path}: no checkpoint found")
    for looked_for in (".metadata", "DCP_SHARDING_INFO", "model.safetensors.index.json", "pytorch_model_fsdp_0",
                       "model_world_size_W_rank_R.pt", "step-*"):
        assert looked_for in message
    with pytest.raises(NotACheckpoint, match="not a checkpoint file"):
        readers.detect(tmp_path / "notes.txt")
    with pytest.raises(NotACheckpoint, match="no such file or directory"):
        readers.detect(tmp_path / "absent")


def test_cli_inspect_of_a_run_directory_shows_the_newest(cli, tmp_path):
    run = make_run(tmp_path / "run", ["step-1", "step-2"])
    result = cli("inspect", run, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert (document["layout"], document["path"]) == ("dcp", str(run / "step-2"))
