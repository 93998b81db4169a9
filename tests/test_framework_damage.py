"""Damaged framework checkpoints fail cleanly: exit 1, one line naming the fault, nothing written.

What is guaranteed, for every framework layout ckpttool reads (fixtures/frameworks/: torchtitan's
DCP step dir, its run dir whose newest step is torch's HuggingFaceStorageWriter output, that
output's per-rank `sharded/` files, accelerate's save_state folder, Lightning's sharded folder,
and Megatron-Core torch_dist when its fixture exists), and each of three damages:

- a truncated data shard (`.distcp`, or a `.safetensors` shard cut in its data section);
- a header that lies about where a chunk's bytes are (a `.metadata` storage offset moved half a
  blob into its neighbour; a safetensors header's `data_offsets` moved one element into the next
  tensor's bytes);
- a sharding gap: one chunk of a tensor moved down one row (in `.metadata`, or in the shard's
  DCP_SHARDING_INFO), which leaves a row uncovered and a row covered twice, so the chunk volumes
  still add up to the tensor and only exact tiling catches it;

`validate`, `validate --deep`, `consolidate` to a `.safetensors` file and to a Hub folder, and
`reshard --world 3` each exit 1. validate lists the fault with its problem code; the others
print one line `error: [CODE] ...` (the code validate reports) naming the file or tensor, no
traceback, and leave nothing at OUT or beside it (no `.ckpttool-*` temp entries).

Each damaged copy is made once per module from the committed fixtures; commands run in-process
through click, and once as a real `python -m ckpttool` subprocess. `.metadata` edits go through
torch's own reader and pickle.dump (tests/test_validate.py `rewrite_metadata`), the way a buggy
writer would produce them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest

from conftest import FIXTURES
from test_validate import rewrite_metadata, storage_key

from ckpttool.outputs.temps import TEMP_PREFIX

FRAMEWORKS = FIXTURES / "frameworks"
TORCHTITAN = FRAMEWORKS / "torchtitan"
ACCELERATE = FRAMEWORKS / "accelerate"
LIGHTNING = FRAMEWORKS / "lightning"
MEGATRON = FRAMEWORKS / "megatron"
MEGATRON_DCP = MEGATRON / "checkpoints" / "iter_0000002"  # named, not globbed: missing, its cases fail
HF_MODEL_FILE = "model-00001-of-00001.safetensors"  # torch's consolidated HF output (_hf_utils.py FILE_NAME)
HF_SHARD_0 = "shard-00001-model-00001-of-00001.safetensors"  # rank 0 (torch numbers shards from 1)
HF_SHARD_1 = "shard-00002-model-00001-of-00001.safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py CUSTOM_METADATA_KEY


# -- the damages -------------------------------------------------------------------------------

def truncate(file: Path) -> None:
    """Cut a data file to half its length (an interrupted copy or a full disk)."""
    os.truncate(file, file.stat().st_size // 2)


def lie_about_offset(dcp_dir: Path, fqn: str, position: int = 0) -> None:
    """Move the storage offset of chunk `position` of `fqn` forward by half its blob, into the
    bytes of the next blob in the same file (still inside the file)."""

    def edit(metadata):
        info = metadata.storage_data[storage_key(metadata, fqn, position)]
        info.offset += info.length // 2

    rewrite_metadata(dcp_dir, edit)


def shift_chunk(dcp_dir: Path, fqn: str, position: int = 0, dim: int = 0) -> None:
    """Move chunk `position` of `fqn` (one at offset 0 along `dim`) one row along `dim`: row 0
    is left uncovered and the chunk overlaps its neighbour by a row of the same volume (torch
    keys storage by the chunk's offsets, so that key moves too)."""

    def edit(metadata):
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = metadata.storage_data.pop(storage_key(metadata, fqn, position))
        chunk = metadata.state_dict_metadata[fqn].chunks[position]
        offsets = list(chunk.offsets)
        offsets[dim] += 1
        chunk.offsets = torch.Size(offsets)
        metadata.storage_data[MetadataIndex(fqn, chunk.offsets)] = info

    rewrite_metadata(dcp_dir, edit)


def edit_safetensors_header(file: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header in place, same length (padded with spaces, which the format
    allows), so the data section stays where it was."""
    raw = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length, "the edit lengthened the header"
    raw[8:8 + length] = encoded.ljust(length, b" ")
    file.write_bytes(bytes(raw))


def lie_about_data_offsets(file: Path, fqn: str) -> None:
    """Move `fqn`'s data_offsets one element forward, into the next tensor's bytes; its size
    still matches dtype and shape and it still lies inside the data section."""

    def edit(header):
        begin, end = header[fqn]["data_offsets"]
        assert any(other.get("data_offsets", [None])[0] == end for other in header.values() if isinstance(other, dict))
        header[fqn]["data_offsets"] = [begin + 4, end + 4]

    edit_safetensors_header(file, edit)


def shift_saved_offsets(file: Path, fqn: str) -> None:
    """Move `fqn`'s shard down one row in the file's DCP_SHARDING_INFO (a gap at row 0, an
    overlap of one row with the next rank's shard)."""

    def edit(header):
        info = json.loads(header["__metadata__"][SHARDING_INFO_KEY])
        info[fqn]["saved_offsets"][0] += 1
        header["__metadata__"][SHARDING_INFO_KEY] = json.dumps(info)

    edit_safetensors_header(file, edit)


# -- the cases ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    fixture: Path                  # copied to a tmp dir, then damaged
    src: str                       # what the user points ckpttool at, relative to the copy
    damage: Callable[[Path], None]  # applied to the copy
    code: str                      # what validate reports and every other command prints
    names: tuple[str, ...]         # the error line names at least one (file or tensor)


def _dcp(label: str, fixture: Path, dcp_dir: str, shard: str, lie: tuple, gap: tuple) -> list[Case]:
    """The three damages of a DCP-based layout (ckpttool pointed at the copy of `fixture`):
    data file `shard` truncated, and in the `.metadata` of `dcp_dir` the offset of chunk
    `lie` = (fqn, position) lied about and chunk `gap` = (fqn, position, dim) shifted."""
    shard_file = f"{dcp_dir}/{shard}".lstrip("/")
    return [
        Case(f"{label}-truncated-shard", fixture, "", lambda root: truncate(root / shard_file), "beyond-eof",
             (shard_file,)),
        Case(f"{label}-metadata-offset-lie", fixture, "", lambda root: lie_about_offset(root / dcp_dir, *lie),
             "blob-overlap", (lie[0],)),
        Case(f"{label}-sharding-gap", fixture, "", lambda root: shift_chunk(root / dcp_dir, *gap), "overlap",
             (gap[0],)),
    ]


STEP_30 = "checkpoint/step-30"
CASES = [
    # torchtitan's CheckpointManager step dir: model fqns at the top level beside optimizer.*
    *_dcp("torchtitan-step", TORCHTITAN / "checkpoint" / "step-20", "", "__1_0.distcp",
          lie=("tok_embeddings.weight", 0), gap=("tok_embeddings.weight", 0, 0)),
    # the run dir: its newest step (step-30) is the HF writer's consolidated file, each tensor
    # whole (its shape is its extent, so there is no tiling to break: the gap case is below)
    Case("torchtitan-run-dir-truncated-shard", TORCHTITAN, "checkpoint",
         lambda root: truncate(root / STEP_30 / HF_MODEL_FILE), "metadata-unreadable", (HF_MODEL_FILE,)),
    Case("torchtitan-run-dir-header-offset-lie", TORCHTITAN, "checkpoint",
         lambda root: lie_about_data_offsets(root / STEP_30 / HF_MODEL_FILE, "model.norm.weight"),
         "blob-overlap", ("model.norm.weight",)),
    # step-30/sharded: the per-rank files, placed by DCP_SHARDING_INFO
    Case("torchtitan-hf-shards-truncated-shard", TORCHTITAN, f"{STEP_30}/sharded",
         lambda root: truncate(root / STEP_30 / "sharded" / HF_SHARD_1), "metadata-unreadable", (HF_SHARD_1,)),
    Case("torchtitan-hf-shards-header-offset-lie", TORCHTITAN, f"{STEP_30}/sharded",
         lambda root: lie_about_data_offsets(root / STEP_30 / "sharded" / HF_SHARD_1,
                                             "model.layers.0.input_layernorm.weight"),
         "blob-overlap", ("model.layers.0.input_layernorm.weight",)),
    Case("torchtitan-hf-shards-sharding-gap", TORCHTITAN, f"{STEP_30}/sharded",
         lambda root: shift_saved_offsets(root / STEP_30 / "sharded" / HF_SHARD_0, "model.embed_tokens.weight"),
         "overlap", ("model.embed_tokens.weight",)),
    # accelerate's save_state folder reads as one checkpoint: model dir and optimizer_0/ together
    *_dcp("accelerate", ACCELERATE / "checkpoints" / "checkpoint_0", "pytorch_model_fsdp_0", "__1_0.distcp",
          lie=("model.model.embed_tokens.weight", 0), gap=("model.model.embed_tokens.weight", 0, 0)),
    Case("accelerate-truncated-optimizer-shard", ACCELERATE / "checkpoints" / "checkpoint_0", "",
         lambda root: truncate(root / "optimizer_0" / "__1_0.distcp"), "beyond-eof", ("optimizer_0/__1_0.distcp",)),
    # Lightning's FSDPStrategy folder: DCP plus meta.pt
    *_dcp("lightning", LIGHTNING / "checkpoints" / "epoch=0-step=2.ckpt", "", "__1_0.distcp",
          lie=("model.model.embed.weight", 0), gap=("model.model.embed.weight", 0, 0)),
]
MEGATRON_DAMAGES = ("truncated-shard", "metadata-offset-lie", "sharding-gap")
IDS = [case.id for case in CASES] + [f"megatron-{damage}" for damage in MEGATRON_DAMAGES]


def megatron_cases() -> list[Case]:
    """The three damages of the Megatron torch_dist fixture (its first DCP dir), on targets
    chosen from its metadata: the last data file; the first chunk (tensors by name) with
    another blob after it in its file; the first chunk at offset 0 along a dim with a
    neighbour right after it along that dim."""
    from ckpttool.readers.dcp import read_checkpoint

    dcp_dir = MEGATRON_DCP
    assert (dcp_dir / ".metadata").is_file(), f"{dcp_dir}: the megatron fixture is missing"
    tensors = list(read_checkpoint(dcp_dir).tensors.values())
    last_start: dict[str, int] = {}
    for tensor in tensors:
        for chunk in tensor.chunks:
            last_start[chunk.blob.file] = max(last_start.get(chunk.blob.file, 0), chunk.blob.offset)
    lie = next((t.fqn, i) for t in tensors for i, c in enumerate(t.chunks) if c.blob.offset < last_start[c.blob.file])
    gap = next(((t.fqn, i, d) for t in tensors for i, c in enumerate(t.chunks) for d in range(len(c.offsets))
                if c.offsets[d] == 0 and c.sizes[d] > 1 and any(
                    o.offsets[d] == c.sizes[d] and o.offsets[:d] + o.offsets[d + 1:] == c.offsets[:d] + c.offsets[d + 1:]
                    for o in t.chunks)), None)
    assert gap is not None, f"{dcp_dir}: no tensor of the megatron fixture is split (its sharding-gap case needs one)"
    cases = _dcp("megatron", dcp_dir, "", sorted(last_start)[-1], lie, gap)
    # consolidate and validate read the model view, one tensor per layer (decoder.layers.0.X for
    # the stacked decoder.layers.X): the line names the layer's tensor; reshard keeps the stacked name
    cases = [replace(case, names=case.names + tuple(n.rsplit("layers.", 1)[-1] for n in case.names)) for case in cases]
    return cases


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """`damaged(case_id)` -> (the damaged checkpoint to point ckpttool at, its Case), each
    copy made once."""
    root = tmp_path_factory.mktemp("damaged")
    cases = {case.id: case for case in CASES}
    made: dict[str, Path] = {}

    def get(case_id: str) -> tuple[Path, Case]:
        if case_id.startswith("megatron-") and case_id not in cases:
            cases.update({case.id: case for case in megatron_cases()})
        case = cases[case_id]
        if case_id not in made:
            building, copy = root / f"building-{case_id}", root / case_id
            shutil.rmtree(building, ignore_errors=True)  # a damage that failed its own checks
            shutil.copytree(case.fixture, building)
            case.damage(building)
            building.rename(copy)
            made[case_id] = copy / case.src if case.src else copy
        return made[case_id], case

    return get


by_case = pytest.mark.parametrize("case_id", IDS)


# -- validate names the fault ------------------------------------------------------------------

@by_case
@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_validate_exits_1_and_reports_the_fault_by_code_naming_file_or_tensor(cli, damaged, case_id, deep):
    src, case = damaged(case_id)
    flags = ("--deep",) if deep else ()
    result = cli("validate", src, "--json", *flags)
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    errors = [p for p in document["problems"] if p["severity"] == "error"]
    assert case.code in {p["code"] for p in errors}, errors
    assert any(name in p["message"] or name == p["fqn"] for p in errors if p["code"] == case.code for name in case.names), errors
    text = cli("validate", src, *flags)
    assert text.exit_code == 1 and "Traceback" not in text.output
    assert any(f"[{case.code}]" in line and any(name in line for name in case.names) for line in text.output.splitlines()), text.output


# -- every writing command refuses, in one line, and writes nothing ----------------------------

COMMANDS = {
    "consolidate-safetensors": lambda src, out: ("consolidate", src, out / "model.safetensors", "--quiet"),
    "consolidate-hub-folder": lambda src, out: ("consolidate", src, out / "hub", "--quiet"),
    "reshard-world-3": lambda src, out: ("reshard", src, out / "world3", "--world", "3", "--quiet"),
}


@by_case
@pytest.mark.parametrize("command", COMMANDS)
def test_writing_commands_exit_1_with_validates_code_in_one_line_and_write_nothing(cli, damaged, tmp_path, case_id,
                                                                                   command):
    src, case = damaged(case_id)
    out = tmp_path / "out"
    out.mkdir()
    result = cli(*COMMANDS[command](src, out))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: [{case.code}] "), result.stderr
    assert any(name in lines[0] for name in case.names), lines[0]
    assert list(out.iterdir()) == []  # neither OUT nor a .ckpttool-* temp beside it
    assert not list(src.rglob(f"{TEMP_PREFIX}*")), "temp entries left in the source"


def test_the_installed_command_refuses_a_sharding_gap_in_one_line(damaged, tmp_path):
    """The same, through a real `python -m ckpttool` process (no click test runner)."""
    src, case = damaged("torchtitan-step-sharding-gap")
    out = tmp_path / "model.safetensors"
    result = subprocess.run([sys.executable, "-m", "ckpttool", "consolidate", str(src), str(out), "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: [{case.code}] "), result.stderr
    assert "tok_embeddings.weight" in result.stderr
    assert list(tmp_path.iterdir()) == []


# -- a newest save whose data went missing -----------------------------------------------------

def test_a_run_dir_whose_newest_step_lost_its_data_file_is_refused_not_replaced_by_the_step_before(cli, tmp_path):
    run = tmp_path / "checkpoint"
    shutil.copytree(TORCHTITAN / "checkpoint", run)
    (run / "step-30" / HF_MODEL_FILE).unlink()  # the index that lists it is still there
    result = cli("validate", run, "--json")
    assert result.exit_code == 1, "exit 0: the run dir fell back to step-20 and validated that"
    assert any(p["code"] == "missing-file" and HF_MODEL_FILE in p["message"] for p in json.loads(result.stdout)["problems"])
    out = tmp_path / "model.safetensors"
    result = cli("consolidate", run, out, "--quiet")
    assert result.exit_code == 1 and result.stderr.startswith("error: [missing-file] ") and not out.exists()
