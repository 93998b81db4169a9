"""verl's FSDP actor checkpoints (`model_world_size_W_rank_R.pt`): detected, read without torch
and without running anything from the pickles, and consolidated byte for byte as verl's own
merger does.

fixtures/frameworks/verl is written by verl 0.9.1's FSDPCheckpointManager on FSDP2, 2 ranks
(fixtures/frameworks/generate_verl.py); `merged/model.safetensors` is verl's merger output
(`python -m verl.model_merger merge --backend fsdp`), which casts to bf16, and `expected.json`
lists its tensors (sha256 of the row-major bytes). The .pt files hold float32 shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections import OrderedDict

import pytest

from conftest import FIXTURES, assert_same_bytes

VERL = FIXTURES / "frameworks" / "verl"
RUN = VERL / "checkpoints"
ACTOR = RUN / "global_step_2" / "actor"
MERGED = VERL / "merged" / "model.safetensors"
EXPECTED = json.loads((VERL / "expected.json").read_text())["tensors"]
RANK_1 = "model_world_size_2_rank_1.pt"


@pytest.fixture(scope="session")
def merged() -> dict:
    from safetensors.torch import load_file

    return load_file(MERGED)


def sha256(tensor) -> str:
    from ckpttool.torchsave.archive import tensor_bytes

    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


@pytest.mark.parametrize("path", [RUN, RUN / "global_step_2", ACTOR], ids=["run-dir", "step-dir", "actor-dir"])
def test_detect_names_verl_in_the_run_step_and_actor_dir(path):
    from ckpttool.readers import detect

    detection = detect(path)
    assert detection.layout == "verl"
    if path == RUN:
        assert (detection.checkpoints, detection.newest) == (("global_step_2",), "global_step_2")
        assert detection.newest_by == "latest_checkpointed_iteration.txt"


def test_reader_places_each_rank_shard_as_dtensor_does():
    from ckpttool.readers import open_checkpoint

    checkpoint = open_checkpoint(RUN)
    assert checkpoint.model_prefix == "" and not checkpoint.objects
    assert checkpoint.path == ACTOR and checkpoint.metadata_file == "model_world_size_2_rank_*.pt"
    assert {fqn: list(t.shape) for fqn, t in checkpoint.tensors.items()} == {
        name: doc["shape"] for name, doc in EXPECTED.items()}
    embed = checkpoint.tensors["model.embed_tokens.weight"]
    assert embed.dtype == "float32"  # verl saves the fp32 master weights; its merger casts to bf16
    assert [(c.offsets, c.sizes, c.blob.file) for c in embed.chunks] == [
        ((0, 0), (16, 16), "model_world_size_2_rank_0.pt"), ((16, 0), (16, 16), RANK_1)]


def test_inspect_shows_layout_and_global_shapes(cli):
    result = cli("inspect", ACTOR)
    assert result.exit_code == 0 and "  layout: verl\n" in result.output
    document = json.loads(cli("inspect", RUN, "--json").stdout)
    assert document["layout"] == "verl"
    assert {t["fqn"]: t["shape"] for t in document["tensors"]} == {n: d["shape"] for n, d in EXPECTED.items()}


def test_validate_deep_reads_and_checksums_every_byte(cli):
    result = cli("validate", ACTOR, "--deep", "--json")
    document = json.loads(result.stdout)
    assert result.exit_code == 0 and document["valid"] and document["problems"] == [], document["problems"]
    assert document["checked"]["bytes_read"] == 4 * sum(math.prod(d["shape"]) for d in EXPECTED.values())


def test_consolidate_model_cast_to_bf16_is_verls_merger_output_byte_for_byte(cli, tmp_path, merged):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = cli("consolidate", ACTOR, out, "--dtype", "bf16", "--quiet")
    assert result.exit_code == 0, result.output
    ours = load_file(out)
    assert ours.keys() == merged.keys() == EXPECTED.keys()
    for name, tensor in ours.items():
        assert_same_bytes(tensor, merged[name], name)
        assert sha256(tensor) == EXPECTED[name]["sha256"], name


def test_consolidate_all_keeps_fp32_shards_that_cast_as_the_merger_casts(cli, tmp_path, merged):
    from safetensors.torch import load_file

    out = tmp_path / "all.safetensors"
    result = cli("consolidate", RUN, out, "--all", "--quiet")
    assert result.exit_code == 0, result.output
    ours = load_file(out)
    assert ours.keys() == merged.keys()
    for name, tensor in ours.items():
        assert str(tensor.dtype) == "torch.float32"
        assert_same_bytes(tensor.bfloat16(), merged[name], name)  # verl: `_local_tensor.bfloat16()`, then cat


def test_reshard_to_world_3_loads_with_stock_dcp_load(cli, tmp_path, merged):
    import torch
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "world3"
    result = cli("reshard", ACTOR, out, "--world", "3", "--quiet")
    assert result.exit_code == 0, result.output
    state = {name: torch.empty(tuple(value.shape), dtype=torch.float32) for name, value in merged.items()}
    dcp.load(state, checkpoint_id=str(out))
    for name, value in state.items():
        assert_same_bytes(value.bfloat16(), merged[name], name)


def test_reader_never_imports_torch():
    code = ("import sys; from ckpttool.readers import open_checkpoint; from ckpttool.commands.validate import validate; "
            f"open_checkpoint({str(RUN)!r}); assert validate({str(ACTOR)!r}, deep=True).valid; "
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _write_pt(path, state_pickle: bytes) -> None:
    """A torch.save-shaped zip (stored entries under one folder) holding `state_pickle`."""
    folder = path.name.removesuffix(".pt")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{folder}/data.pkl", state_pickle)
        archive.writestr(f"{folder}/byteorder", "little")
        archive.writestr(f"{folder}/version", "3\n")


@pytest.mark.parametrize("where", ["value", "state-dict-attribute"])
def test_a_pickle_naming_os_system_is_refused_in_one_line_and_never_runs(cli, tmp_path, where):
    marker = tmp_path / "marker"
    if where == "value":
        state = OrderedDict(weight=_RunsCode(marker))
    else:  # where state_dict()'s `_metadata` goes: a BUILD after the items
        state = OrderedDict()
        state._metadata = _RunsCode(marker)
    checkpoint = tmp_path / "actor"
    checkpoint.mkdir()
    _write_pt(checkpoint / "model_world_size_1_rank_0.pt", pickle.dumps(state, protocol=2))
    for command in (("inspect", checkpoint), ("validate", checkpoint, "--deep"),
                    ("consolidate", checkpoint, tmp_path / "out.safetensors", "--all")):
        result = cli(*command)
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert "posix.system" in result.output and len(lines) == (2 if command[0] == "validate" else 1), lines
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_a_truncated_rank_file_is_one_line_error_and_nothing_is_written(cli, tmp_path):
    checkpoint = tmp_path / "actor"
    shutil.copytree(ACTOR, checkpoint)
    data = (checkpoint / RANK_1).read_bytes()
    (checkpoint / RANK_1).write_bytes(data[:len(data) // 2])
    out = tmp_path / "out.safetensors"
    for command in (("inspect", checkpoint), ("consolidate", checkpoint, out)):
        result = cli(*command)
        assert result.exit_code == 1 and RANK_1 in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()
    document = json.loads(cli("validate", checkpoint, "--json").stdout)
    assert not document["valid"] and any(RANK_1 in p["message"] for p in document["problems"])


def test_a_missing_rank_file_is_named(cli, tmp_path):
    checkpoint = tmp_path / "actor"
    shutil.copytree(ACTOR, checkpoint)
    (checkpoint / RANK_1).unlink()
    result = cli("inspect", checkpoint)
    assert result.exit_code == 1 and f"{RANK_1}: missing" in result.output, result.output


def test_a_non_contiguous_local_shard_is_refused_naming_file_and_tensor(tmp_path):
    from ckpttool.core.errors import UnsupportedFormat
    from ckpttool.readers import open_checkpoint

    checkpoint = tmp_path / "actor"
    shutil.copytree(ACTOR, checkpoint)
    path = checkpoint / RANK_1
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    name = next(n for n in entries if n.endswith("/data.pkl"))
    raw = entries[name]
    # q_proj's local (8, 16) shard: stride (16, 1) -> (1, 8), same byte count (BININT1 16, 1 -> 1, 8)
    at = raw.index(b"model.layers.0.self_attn.q_proj.weight")
    at = raw.index(b"K\x08K\x10\x86", at) + 5  # its local size (8, 16)
    at = raw.index(b"K\x10K\x01\x86", at)
    entries[name] = raw[:at] + b"K\x01K\x08\x86" + raw[at + 5:]
    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)
    with pytest.raises(UnsupportedFormat, match=rf"{RANK_1}: model.layers.0.self_attn.q_proj.weight: .*not contiguous"):
        open_checkpoint(checkpoint)


def test_tied_weights_share_one_storage_and_validate(tmp_path):
    """A DTensor saved under two names (tie_word_embeddings) points both at the same bytes."""
    from ckpttool.check import integrity
    from ckpttool.readers import open_checkpoint

    checkpoint = tmp_path / "actor"
    shutil.copytree(ACTOR, checkpoint)
    for rank in (0, 1):
        path = checkpoint / f"model_world_size_2_rank_{rank}.pt"
        with zipfile.ZipFile(path) as archive:
            entries = {info.filename: archive.read(info) for info in archive.infolist()}
        name = next(n for n in entries if n.endswith("/data.pkl"))
        entries[name] = _tie(entries[name])
        path.unlink()
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            for entry, data in entries.items():
                archive.writestr(entry, data)
    tied = open_checkpoint(checkpoint)
    assert tied.tensors["lm_head.weight"].chunks == tied.tensors["model.embed_tokens.weight"].chunks
    assert not integrity.check(tied).errors


def _tie(raw: bytes) -> bytes:
    """Make `lm_head.weight` the same DTensor object as `model.embed_tokens.weight`, as pickle
    writes an object seen before (a GET of its memo slot): lm_head's own value is still built,
    then POPped, so every memo slot stays where it was."""
    import pickletools

    ops = list(pickletools.genops(raw))
    depth, depths = 0, []  # MARK nesting after each opcode; the state dict's items are at 1
    for op, _, _ in ops:
        depth += 1 if op.name == "MARK" else -1 if pickletools.markobject in op.stack_before else 0
        depths.append(depth)

    def value_end(key: str) -> int:  # index of the PUT that memoizes the key's DTensor
        at = next(i for i, (_, arg, _) in enumerate(ops) if arg == key)
        return next(i for i in range(at, len(ops)) if ops[i][0].name == "REDUCE" and depths[i] == 1) + 1

    slot = ops[value_end("model.embed_tokens.weight")][1]
    insert_at = ops[value_end("lm_head.weight") + 1][2]
    get = (b"h" + bytes([slot])) if slot < 256 else (b"j" + slot.to_bytes(4, "little"))
    return raw[:insert_at] + pickle.POP + get + raw[insert_at:]
