"""`ckpttool diff A B`: entry by entry, byte for byte, across layouts and shardings; exit 0
identical, 1 different, 2 could not compare.

Every "different" case is checked against torch: the expected element index and difference
come from tensors torch itself loaded (`dcp_to_torch_save`), never from ckpttool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES
from ckpttool.options import ConvertOptions
from ckpttool.commands.consolidate import consolidate
from ckpttool.commands.diff import diff
from ckpttool.core.geometry import overlapping_boxes as overlapping_chunks, slabs
from ckpttool.core.numerics import float8_table
from ckpttool.commands.reshard import reshard
from ckpttool.dcp.blobs import DataFiles, locate
from ckpttool.core.checkpoint import Chunk
from ckpttool.readers.dcp import read_checkpoint

SOURCE = FIXTURES / "fsdp2_world3_uneven"  # model, AdamW state and plain objects, uneven world 3


@pytest.fixture(scope="session")
def derived(tmp_path_factory) -> dict[str, Path]:
    """SOURCE resharded to world 2, and its model consolidated to one .safetensors and to Hub shards."""
    root = tmp_path_factory.mktemp("diff")
    reshard(SOURCE, root / "world2", world_size=2)
    consolidate(SOURCE, root / "single" / "model.safetensors")
    consolidate(SOURCE, root / "hub", convert=ConvertOptions(max_shard_size="1kB"))
    return {"world2": root / "world2", "safetensors": root / "single" / "model.safetensors", "hub": root / "hub"}


def torch_state(checkpoint: Path, tmp: Path) -> dict:
    """The nested state dict torch's own `dcp_to_torch_save` reads from a checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{checkpoint.name}-{len(list(tmp.iterdir()))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="session")
def edited(tmp_path_factory):
    """SOURCE loaded by torch, one weight moved up by one ulp and the learning rate changed,
    saved again by torch's `dcp.save` in one process (world 1 against the source's world 3)."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("edited")
    state = torch_state(SOURCE, root)
    weight = state["model"]["layers.0.fc1.weight"]
    before = weight[3, 4].clone()
    weight[3, 4] = torch.nextafter(before, torch.tensor(float("inf")))
    state["optim"]["param_groups"][0]["lr"] = 0.5
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=root / "ckpt")
    return root / "ckpt", float(weight[3, 4].double() - before.double())


def flipped_copy(source: Path, target: Path, fqn: str, chunk_index: int, element: int) -> Path:
    """Copy a checkpoint and flip the lowest bit of one element of one chunk (one ulp for a
    float), in the raw bytes of its data file; the CRC in the record is left stale, as a bad
    disk would leave it."""
    shutil.copytree(source, target)
    checkpoint = read_checkpoint(target)
    tensor = checkpoint.tensors[fqn]
    with DataFiles(target) as files:
        raw = locate(files, tensor, tensor.chunks[chunk_index])
    path = target / raw.file
    data = bytearray(path.read_bytes())
    data[raw.offset + element * tensor.itemsize] ^= 0x01  # little-endian: the lowest mantissa bit
    path.write_bytes(bytes(data))
    return target


FLIPS = {  # fixture: (tensor, chunk, element of that chunk)
    "fsdp2_world3_uneven": ("model.layers.1.fc2.weight", 1, 27),
    "fsdp2_world2_bf16": ("model.embed.weight", 1, 9),
}


@pytest.fixture(scope="session", params=sorted(FLIPS))
def flipped(request, tmp_path_factory):
    """(source, flipped copy, tensor, torch's index of the changed element, torch's |a - b|)."""
    source = FIXTURES / request.param
    fqn, chunk, element = FLIPS[request.param]
    root = tmp_path_factory.mktemp("flipped")
    copy = flipped_copy(source, root / request.param, fqn, chunk, element)
    key = fqn.removeprefix("model.")
    a, b = torch_state(source, root)["model"][key], torch_state(copy, root)["model"][key]
    changed = (a != b).nonzero()
    assert len(changed) == 1
    return source, copy, fqn, tuple(changed[0].tolist()), float((a.double() - b.double()).abs().max())


def test_a_checkpoint_is_identical_to_itself(cli):
    result = cli("diff", SOURCE, SOURCE, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [f"IDENTICAL: {SOURCE} and {SOURCE}: 58 tensors (10.3 kB) and 14 objects, byte for byte"]


def test_a_reshard_to_another_world_size_is_identical_though_chunked_differently(derived):
    report = diff(SOURCE, derived["world2"])
    assert report.verdict == "identical"
    assert len(report.tensors) == 58 and len(report.objects) == 14
    assert report.bytes_compared == sum(t.nbytes for t in read_checkpoint(SOURCE).tensors.values())
    # slabs far smaller than a chunk, cut across the two chunkings: the same answer
    assert diff(SOURCE, derived["world2"], block_size=16).verdict == "identical"


@pytest.mark.parametrize("output", ["safetensors", "hub"])
def test_the_consolidated_model_is_identical_with_normalize(cli, derived, output):
    result = cli("diff", SOURCE, derived[output], "--normalize", "--only", "model", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("IDENTICAL: ") and "16 tensors" in result.stdout


def test_without_normalize_nothing_matches_and_the_hint_says_so(cli, derived):
    result = cli("diff", SOURCE, derived["safetensors"], "--only", "model", "--quiet")
    assert result.exit_code == 1
    assert "16 only in A, 16 only in B" in result.stdout.splitlines()[0]
    assert "hint: no entry names in common; --normalize matches 16 of them" in result.stdout


def test_a_flipped_byte_names_the_tensor_and_the_element_torch_sees_changed(cli, flipped):
    source, copy, fqn, index, max_abs = flipped
    result = cli("diff", source, copy, "--quiet")
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"DIFFERENT: {source} and {copy}: 1 of ")
    assert lines[1].startswith(f"  differs: {fqn}: 1 of ") and f"(first at {list(index)})" in lines[1]
    changed = diff(source, copy, block_size=16).different
    assert [(t.fqn_a, t.differing, t.first_index, t.max_abs) for t in changed] == [(fqn, 1, index, max_abs)]


def test_tolerances_accept_a_difference_only_when_asked(cli, flipped):
    source, copy, fqn, index, max_abs = flipped
    result = cli("diff", source, copy, "--atol", str(max_abs * 2), "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("WITHIN TOLERANCE") and f"close: {fqn}: 1 of " in result.stdout
    assert cli("diff", source, copy, "--atol", str(max_abs / 4), "--quiet").exit_code == 1
    assert cli("diff", source, copy, "--rtol", "0", "--quiet").exit_code == 1


def test_what_changed_between_two_torch_saves(edited):
    checkpoint, step = edited
    report = diff(SOURCE, checkpoint)
    assert report.verdict == "different"
    (changed,) = report.different
    assert (changed.key, changed.differing, changed.first_index, changed.max_abs) == ("model.layers.0.fc1.weight", 1, (3, 4), step)
    assert [(o.key, o.a, o.b) for o in report.different_objects] == [("optim.param_groups.0.lr", "0.01", "0.5")]
    assert len(report.tensors) == 58 and not report.only_a and not report.only_b and not report.mismatches


def test_missing_and_extra_tensors_are_listed_with_escaped_names(cli, derived, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(derived["safetensors"])
    del tensors["head.weight"]
    tensors["bad\x1b[2Jname"] = tensors["embed.weight"][:2]
    (tmp_path / "edited").mkdir()
    save_file(tensors, tmp_path / "edited" / "model.safetensors")
    result = cli("diff", derived["safetensors"], tmp_path / "edited" / "model.safetensors", "--quiet")
    assert result.exit_code == 1, result.output
    assert "0 of 15 tensors differ, 0 dtype/shape changes, 1 only in A, 1 only in B" in result.stdout.splitlines()[0]
    assert "  only in A: head.weight" in result.stdout.splitlines()
    assert "  only in B: bad\\x1b[2Jname" in result.stdout.splitlines() and "\x1b" not in result.stdout


def test_bf16_against_float32_is_a_dtype_change_per_weight(cli):
    a, b = FIXTURES / "fsdp2_world2", FIXTURES / "fsdp2_world2_bf16"
    report = diff(a, b)
    assert {(m.field, m.a, m.b) for m in report.mismatches} == {("dtype", "float32", "bfloat16")}
    assert len(report.mismatches) == 14
    assert [t.key for t in report.tensors if t.status == "equal"] == ["model.mask", "model.position_ids"]
    result = cli("diff", a, b, "--limit", "3", "--quiet")
    assert result.exit_code == 1
    assert result.stdout.splitlines()[1:] == [
        "  dtype differs: model.embed.weight: float32 -> bfloat16",
        "  dtype differs: model.head.weight: float32 -> bfloat16",
        "  dtype differs: model.layers.0.fc1.bias: float32 -> bfloat16",
        "  ... and 11 more (--limit 0 lists all; --json has every entry)",
    ]


def test_json_document_lists_every_entry(cli, flipped):
    source, copy, fqn, index, max_abs = flipped
    result = cli("diff", source, copy, "--json", "--quiet")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.diff/1"
    assert document["verdict"] == "different" and document["same"] is False
    assert document["a"] == str(source) and document["b"] == str(copy)
    assert document["summary"]["different"] == 1 and document["summary"]["tensors"] == len(document["tensors"])
    (changed,) = [t for t in document["tensors"] if t["status"] != "equal"]
    assert (changed["key"], changed["differing"], changed["first_index"], changed["max_abs"]) == (fqn, 1, list(index), max_abs)
    assert document["only_a"] == document["only_b"] == document["mismatches"] == [] and document["problems"] == []


def test_anything_that_stops_the_comparison_exits_2(cli, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(SOURCE, damaged)
    with open(damaged / "__1_0.distcp", "r+b") as handle:
        handle.truncate(1000)
    result = cli("diff", SOURCE, damaged, "--quiet")
    assert result.exit_code == 2  # the gate's InvalidCheckpoint exits 1 elsewhere
    assert result.stderr.startswith("error: [beyond-eof] ") and "Traceback" not in result.stderr
    (tmp_path / "empty").mkdir()
    assert cli("diff", SOURCE, tmp_path / "empty", "--quiet").exit_code == 2
    assert cli("diff", SOURCE, SOURCE, "--only", "scheduler").exit_code == 2  # click's usage error


def test_diff_never_imports_torch(derived):
    from test_no_torch import imported_modules

    for args in ((SOURCE, derived["world2"]), (SOURCE, derived["safetensors"], "--normalize", "--only", "model")):
        modules = imported_modules("diff", *map(str, args), "--quiet")
        assert "ckpttool.commands.diff" in modules
        assert not {m for m in modules if m == "torch" or m.startswith("torch.")}


def test_overlapping_chunks_meet_across_block_shardings():
    a = [Chunk((0, 0), (4, 6), None), Chunk((4, 0), (3, 6), None), Chunk((7, 0), (0, 6), None)]
    b = [Chunk((r, c), (2, 3), None) for r in range(0, 8, 2) for c in (0, 3)][:7]
    b[6] = Chunk((6, 0), (1, 6), None)
    pairs = list(overlapping_chunks(a, b))
    assert sum(box[1][0] * box[1][1] for _, _, box in pairs) == 7 * 6  # every element once
    assert (1, 6, ((6, 0), (1, 6))) in pairs and all(i != 2 for i, _, _ in pairs)
    assert list(slabs(((2, 1), (3, 4)), 4, 20)) == [((2, 1), (1, 4)), ((3, 1), (1, 4)), ((4, 1), (1, 4))]
    assert list(slabs(((0, 0), (1, 10)), 4, 16)) == [((0, 0), (1, 4)), ((0, 4), (1, 4)), ((0, 8), (1, 2))]


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_float8_values_are_torchs(name):
    import numpy as np
    import torch

    expected = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name)).double().numpy()
    assert np.array_equal(float8_table(name), expected, equal_nan=True)
