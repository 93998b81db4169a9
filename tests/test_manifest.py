"""Manifests: one fingerprint per tensor that survives resharding, consolidation and export,
and checking a checkpoint against one (`validate --manifest`, `diff SRC FILE.json`).

The reference is independent of ckpttool's reading: the SHA-256 of the bytes of the tensors
torch's own `dcp_to_torch_save` + `torch.load` give, and of those `safetensors` loads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, tensor_bytes

from ckpttool.run import locating
from ckpttool.commands.manifest import compute, manifest
from ckpttool.dcp.blobs import DataFiles
from ckpttool.check.manifest import Manifest, parse, plan_tensor, Block, Stream
from ckpttool.options import WriteOptions
from ckpttool.readers import open_checkpoint

UNEVEN = FIXTURES / "fsdp2_world3_uneven"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, run) -> dict[str, Path]:
    """The uneven world-3 fixture, its reshard to 4, its .safetensors and its export (--manifest)."""
    root = tmp_path_factory.mktemp("manifest-layouts")
    for args in (("reshard", UNEVEN, root / "world4", "--world", "4", "-q"),
                 ("consolidate", UNEVEN, root / "model.safetensors", "-q"),
                 ("export", UNEVEN, root / "hub", "--manifest", "-q"),
                 ("manifest", UNEVEN, "-o", root / "uneven.json")):
        result = run(*args)
        assert result.exit_code == 0, result.output
    return {"dcp": UNEVEN, "world4": root / "world4", "safetensors": root / "model.safetensors", "hub": root / "hub",
            "manifest": root / "uneven.json"}


def test_manifest_of_a_checkpoint_its_reshard_its_safetensors_and_its_export_are_byte_identical(layouts, run):
    expected = layouts["manifest"].read_bytes()
    for name in ("world4", "safetensors", "hub"):
        result = run("manifest", layouts[name], "-q")
        assert result.exit_code == 0, result.output
        assert result.stdout.encode() == expected, name
    document = json.loads(expected)
    assert len(document["tensors"]) == 16 and "embed.weight" in document["tensors"]  # model. prefix gone


def test_export_manifest_is_the_manifest_of_the_source_committed_with_the_folder(layouts, tmp_path, run):
    assert (layouts["hub"] / "manifest.json").read_bytes() == layouts["manifest"].read_bytes()
    result = run("export", UNEVEN, tmp_path / "plain", "-q")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "plain" / "manifest.json").exists()  # only when asked for
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpttool")]  # nothing left beside it


def test_manifest_entries_are_the_sha256_of_torch_and_safetensors_tensors(layouts, reference):
    from safetensors.torch import load_file

    document = json.loads(layouts["manifest"].read_text())
    torch_state = reference(UNEVEN)
    loaded = load_file(layouts["safetensors"])
    for key, entry in document["tensors"].items():
        tensor = torch_state[f"model.{key}"]
        assert entry["sha256"] == sha256(tensor_bytes(tensor)), key
        assert entry["shape"] == list(tensor.shape) and entry["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert entry["sha256"] == sha256(tensor_bytes(loaded[key])), key
    canonical = json.dumps(document["tensors"], sort_keys=True, separators=(",", ":"))
    assert document["digest"] == "sha256:" + sha256(canonical.encode())


def test_manifest_is_deterministic_and_all_covers_the_optimizer_state(tmp_path, run, reference):
    first, second = run("manifest", UNEVEN, "--all", "-q"), run("manifest", UNEVEN, "--all", "-q")
    assert first.exit_code == 0 and first.stdout == second.stdout
    tensors = json.loads(first.stdout)["tensors"]
    optimizer = [key for key in tensors if key.startswith("optim.")]
    assert optimizer and len(tensors) == 58
    torch_state = reference(UNEVEN)
    assert all(tensors[key]["sha256"] == sha256(tensor_bytes(torch_state[key])) for key in optimizer)


def test_files_lists_the_sha256_of_each_data_file(run):
    result = run("manifest", UNEVEN, "--files", "-q")
    files = json.loads(result.stdout)["files"]
    assert sorted(files) == sorted(p.name for p in UNEVEN.glob("*.distcp"))
    for name, entry in files.items():
        data = (UNEVEN / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": sha256(data)}


def _flip(checkpoint: Path, fqn: str, position: float = 0.5) -> None:
    """Flip one byte inside the tensor data of `fqn`'s first chunk (located by its record)."""
    loaded = open_checkpoint(checkpoint)
    tensor = loaded.tensors[fqn]
    with DataFiles(checkpoint) as files:
        raw = locating.locate_chunks(files, [tensor])[fqn][0]
    path = checkpoint / raw.file
    data = bytearray(path.read_bytes())
    data[raw.offset + int(raw.length * position)] ^= 0x40
    path.write_bytes(bytes(data))


def test_one_flipped_byte_makes_validate_manifest_exit_1_naming_the_tensor(layouts, tmp_path, cli):
    damaged = tmp_path / "damaged"
    shutil.copytree(UNEVEN, damaged)
    _flip(damaged, "model.layers.1.fc1.weight")
    assert cli("validate", damaged).exit_code == 0  # the metadata and sizes still agree
    result = cli("validate", damaged, "--manifest", layouts["manifest"])
    assert result.exit_code == 1, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("error: [manifest-mismatch] layers.1.fc1.weight: its bytes differ"), result.output
    document = json.loads(cli("validate", damaged, "--manifest", layouts["manifest"], "--json").output)
    assert [p["fqn"] for p in document["problems"]] == ["layers.1.fc1.weight"]
    assert document["manifest"]["differences"][0]["kind"] == "sha256"


def test_diff_against_a_manifest_names_the_first_differing_tensor(layouts, tmp_path, cli):
    damaged = tmp_path / "damaged"
    shutil.copytree(UNEVEN, damaged)
    _flip(damaged, "model.layers.1.fc2.weight")
    _flip(damaged, "model.layers.0.norm.weight", 0.0)
    result = cli("diff", damaged, layouts["manifest"])
    assert result.exit_code == 1, result.output
    assert "first: differs: layers.0.norm.weight:" in result.output.splitlines()[0]
    assert "differs: layers.1.fc2.weight" in result.output
    same = cli("diff", layouts["manifest"], layouts["hub"])  # either side may be the manifest
    assert same.exit_code == 0 and same.output.startswith("MATCHES:"), same.output


def test_missing_and_extra_tensors_are_named(layouts, tmp_path, cli):
    expected = parse(layouts["manifest"].read_bytes(), "m")
    tensors = dict(expected.tensors)
    tensors["layers.9.fc1.weight"] = tensors.pop("layers.1.fc1.weight")
    edited = tmp_path / "edited.json"
    edited.write_bytes(Manifest(tensors).to_json())
    result = cli("diff", layouts["safetensors"], edited, "--json")
    assert result.exit_code == 1
    differences = json.loads(result.output)["differences"]
    assert [(d["key"], d["kind"]) for d in differences] == [("layers.1.fc1.weight", "extra"),
                                                            ("layers.9.fc1.weight", "missing")]
    validated = cli("validate", UNEVEN, "--manifest", edited)
    assert validated.exit_code == 1 and "[manifest-extra] layers.1.fc1.weight" in validated.output


def test_an_edited_manifest_is_refused_by_its_digest(layouts, tmp_path, cli):
    document = json.loads(layouts["manifest"].read_text())
    document["tensors"]["mask"]["sha256"] = "0" * 64
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    result = cli("validate", UNEVEN, "--manifest", edited)
    assert result.exit_code == 2 and "does not match its tensors" in result.output


# ---------------------------------------------------------------------------------------------
# 2-D block sharding, HSDP replicas, a tied head, a 0-d bf16 tensor: assembled in blocks


@pytest.fixture(scope="module")
def block_sharded(block_tied_buffers) -> Path:
    return block_tied_buffers  # the world-4 save consolidate's tests use (conftest, once per session)


def test_block_sharded_tensors_hash_as_their_row_major_bytes_in_tiny_blocks(block_sharded, reference, tmp_path, cli):
    tiny = compute(block_sharded, write=WriteOptions(max_memory=64, threads=2))[0]  # one row per block
    default = compute(block_sharded)[0]
    assert tiny == default
    torch_state = reference(block_sharded)
    for key, entry in default.tensors.items():
        assert entry.sha256 == sha256(tensor_bytes(torch_state[f"model.{key}"])), key
    assert default.tensors["scale"].shape == () and default.tensors["scale"].dtype == "bfloat16"
    out = tmp_path / "m.safetensors"
    assert cli("consolidate", block_sharded, out, "-q").exit_code == 0
    assert compute(out)[0] == default


def test_plan_streams_dim0_slabs_and_assembles_2d_blocks(block_sharded):
    checkpoint = open_checkpoint(block_sharded)
    with DataFiles(block_sharded) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
    block = checkpoint.tensors["model.block.weight"]  # 7x10 over a 2x2 mesh: 4 boxes, rows cut at 4
    plan = plan_tensor("block.weight", block, located[block.fqn], block_bytes=2 * 10 * 4)
    assert all(isinstance(step, Block) for step in plan.steps)
    assert [(s.start, s.stop) for s in plan.steps] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert all(len(step.parts) == 2 for step in plan.steps)
    embedding = checkpoint.tensors["model.tok_emb.weight"]  # HSDP: dim-0 shards, replicas read once
    streamed = plan_tensor("tok_emb.weight", embedding, located[embedding.fqn])
    assert all(isinstance(step, Stream) for step in streamed.steps) and sum(s.length for s in streamed.steps) == 11 * 6 * 4


def test_a_tied_head_left_out_by_export_is_reported_not_a_difference(block_sharded, tmp_path, cli):
    reference_manifest = tmp_path / "source.json"
    assert cli("manifest", block_sharded, "-o", reference_manifest).exit_code == 0
    exported = tmp_path / "hub"
    result = cli("export", block_sharded, exported, "--drop-tied", "--manifest", "-q")
    assert result.exit_code == 0, result.output
    assert "lm_head.weight" not in json.loads((exported / "manifest.json").read_text())["tensors"]
    checked = cli("validate", exported, "--manifest", reference_manifest)
    assert checked.exit_code == 0, checked.output
    assert "tied: lm_head.weight is not in the checkpoint; its bytes are tok_emb.weight's" in checked.output
    back = cli("diff", block_sharded, exported / "manifest.json")  # the other way: extra in the checkpoint
    assert back.exit_code == 0 and "tied: lm_head.weight is not in the manifest" in back.output, back.output


def test_installed_cli_writes_a_manifest_and_validates_against_it(tmp_path):
    out = tmp_path / "m.json"
    binary = Path(sys.executable).parent / "ckpttool"
    subprocess.run([binary, "manifest", UNEVEN, "-o", out, "-q"], check=True, capture_output=True)
    checked = subprocess.run([binary, "validate", UNEVEN, "--manifest", out], capture_output=True, text=True)
    assert checked.returncode == 0 and "MATCHES" in checked.stdout
    assert manifest(UNEVEN).manifest.to_json() == out.read_bytes()
