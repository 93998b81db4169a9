"""`ckpttool validate --numerics`: every floating tensor's NaN/Inf (exit 1, the tensor and its
first bad element named on one line), all-zero tensors, subnormals and max |x|, each figure
equal to torch's own computation on the tensors torch saved.

Checkpoints are written by torch's own `dcp.save` (fp32, bf16, fp16; torch_save and zstd
blobs), `safetensors.torch.save_file` and `torch.save`; the sharded case is the committed
FSDP2 world-2 fixture with NaN/Inf written into its `.distcp` bytes at known elements.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES

import ckpttool
from ckpttool import readers
from ckpttool.check import numbers
from ckpttool.check.numbers import scan_numbers
from ckpttool.commands.validate import validate

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
ZERO_TENSORS = 7  # more than the summary names on one line


def make_state(bad: bool) -> dict[str, torch.Tensor]:
    """A model's tensors in fp32, bf16 and fp16 with subnormals, zeros and large values; with
    `bad`, NaN and Inf at known elements."""
    generator = torch.Generator().manual_seed(47)
    w32 = torch.randn(64, 48, generator=generator)
    w32[3, 5], w32[40, 1], w32[63, 47] = 1e-40, -3e-39, 6.5e4  # two fp32 subnormals, a large value
    wbf = torch.randn(32, 16, generator=generator).to(torch.bfloat16)
    wbf[0, 2], wbf[7, 7] = 1e-40, -2e-39  # bf16 subnormals (tiny is 1.18e-38)
    w16 = torch.randn(16, 8, generator=generator).to(torch.float16)
    w16[1, 1], w16[2, 2], w16[3, 3] = 1e-6, -3e-7, 0.0  # fp16 subnormals (tiny is 6.1e-5) and a zero
    state = {"w32": w32, "wbf": wbf, "w16": w16, "ids": torch.arange(10), "scalar": torch.tensor(2.5)}
    for k in range(ZERO_TENSORS):
        state[f"zero{k}.bias"] = torch.zeros(4 + k, dtype=torch.bfloat16 if k % 2 else torch.float32)
    if bad:
        w32[5, 7], w32[9, 1] = float("nan"), float("nan")
        wbf[1, 4], wbf[3, 2] = float("nan"), float("inf")
        w16[15, 0] = -float("inf")
    return state


def torch_figures(fqn: str, x: torch.Tensor) -> dict:
    """The figures validate --numerics reports, as torch computes them."""
    flat = x.flatten()
    bad = torch.nonzero(~torch.isfinite(flat)).flatten()
    finite = flat[torch.isfinite(flat)]
    return {"fqn": fqn, "dtype": str(x.dtype).removeprefix("torch."), "numel": x.numel(),
            "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum()),
            "first_bad": int(bad[0]) if len(bad) else None,
            "all_zero": bool((x == 0).all()) and x.numel() > 0,
            "subnormal": int(((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).sum()),
            "max_abs": float(finite.abs().max()) if finite.numel() else 0.0}


def ours(document: dict) -> dict[str, dict]:
    keys = ("fqn", "dtype", "numel", "nan", "inf", "first_bad", "all_zero", "subnormal", "max_abs")
    return {n["fqn"]: {k: n[k] for k in keys} for n in document["numbers"]}


@pytest.fixture(scope="session")
def steps(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (checkpoint, its model tensors): a clean and a bad step by dcp.save, the bad one
    also zstd-compressed, as one .safetensors file and as a torch.save pytorch_model.bin."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter

    root = tmp_path_factory.mktemp("numerics")
    made = {}
    for name, bad in (("clean", False), ("bad", True)):
        state = make_state(bad)
        dcp.save({"model": state, "step": 12}, checkpoint_id=root / name, no_dist=True)
        made[name] = (root / name, {f"model.{k}": v for k, v in state.items()})
    bad_state = make_state(True)
    try:
        from torch.distributed.checkpoint._extension import ZStandard

        import zstandard  # noqa: F401
        dcp.save({"model": bad_state}, storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]), no_dist=True)
        made["zstd"] = (root / "zstd", {f"model.{k}": v for k, v in bad_state.items()})
    except ImportError:
        pass
    (root / "hub").mkdir()
    save_file({k: v.contiguous() for k, v in bad_state.items()}, root / "hub" / "model.safetensors")
    made["safetensors"] = (root / "hub" / "model.safetensors", dict(bad_state))
    (root / "bin").mkdir()
    torch.save(bad_state, root / "bin" / "pytorch_model.bin")
    made["bin"] = (root / "bin", dict(bad_state))
    return made


def expected_figures(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {fqn: torch_figures(fqn, x) for fqn, x in tensors.items() if x.is_floating_point()}


def test_a_clean_step_exits_0_with_zeros_subnormals_and_max_abs_as_torch_computes_them(cli, steps):
    path, tensors = steps["clean"]
    result = cli("validate", path, "--numerics", "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert document["valid"] and document["numerics"] == []
    assert ours(document) == expected_figures(tensors)
    found = ours(document)
    assert found["model.w32"]["subnormal"] == 2 and found["model.wbf"]["subnormal"] == 2 and found["model.w16"]["subnormal"] == 2
    assert found["model.w32"]["max_abs"] == 65000.0
    assert sum(f["all_zero"] for f in found.values()) == ZERO_TENSORS and "model.ids" not in found


def test_nan_and_inf_exit_1_naming_each_tensor_its_first_bad_element_and_counts_on_one_line(cli, steps):
    path, tensors = steps["bad"]
    result = cli("validate", path, "--numerics")
    assert result.exit_code == 1
    lines = [line for line in result.stdout.splitlines() if "[non-finite]" in line]
    assert lines == [
        "error: [non-finite] __0_0.distcp: model.w16: 0 NaN and 1 Inf of 128 elements, the first at element 120 "
        "(flat row-major index, shape [16, 8])",
        "error: [non-finite] __0_0.distcp: model.w32: 2 NaN and 0 Inf of 3072 elements, the first at element 247 "
        "(flat row-major index, shape [64, 48])",
        "error: [non-finite] __0_0.distcp: model.wbf: 1 NaN and 1 Inf of 512 elements, the first at element 20 "
        "(flat row-major index, shape [32, 16])",
    ]
    expected = expected_figures(tensors)
    assert [expected[f"model.{name}"]["first_bad"] for name in ("w16", "w32", "wbf")] == [120, 247, 20]
    assert "INVALID: 3 error(s)" in result.stdout and "3 with NaN/Inf, 7 all zero, 3 with subnormals" in result.stdout
    # the summary names 5 of the 7 all-zero tensors, not every one
    assert "all zero: model.zero0.bias, model.zero1.bias, model.zero2.bias, model.zero3.bias, model.zero4.bias (and 2 more" in result.stdout
    document = json.loads(cli("validate", path, "--numerics", "--json").stdout)
    assert ours(document) == expected
    assert {(n["fqn"], n["nan"], n["inf"]) for n in document["numerics"]} == {
        ("model.w16", 0, 1), ("model.w32", 2, 0), ("model.wbf", 1, 1)}


@pytest.mark.parametrize("name", ["zstd", "safetensors", "bin"])
def test_other_blob_kinds_and_files_give_torchs_figures(cli, steps, name):
    """zstd blobs decoded, a lone .safetensors file, a torch.save pytorch_model.bin."""
    if name not in steps:
        pytest.skip("zstandard is not installed")
    path, tensors = steps[name]
    result = cli("validate", path, "--numerics", "--json")
    assert result.exit_code == 1
    assert ours(json.loads(result.stdout)) == expected_figures(tensors)


def test_deep_and_numerics_read_the_bytes_once_with_the_same_figures(steps):
    path, _ = steps["bad"]
    alone = validate(path, numerics=True)
    deep = validate(path, deep=True)
    both = validate(path, deep=True, numerics=True)
    assert both.numbers == alone.numbers
    assert both.bytes_read == deep.bytes_read  # one pass: --deep's bytes, not --deep's plus a scan
    assert [p for p in both.problems if p.code == "non-finite"] == [p for p in alone.problems if p.code == "non-finite"]
    assert {p.severity for p in deep.problems if p.code == "non-finite"} == {"info"}  # --deep alone: information


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_small_blocks_pieces_and_threads_find_the_same_figures(monkeypatch, steps, mapped):
    """Many blocks per chunk and many pieces per tensor, scanned by 3 threads, from maps of
    the file (at offsets inside a page) or read into a buffer: the first bad element is the
    least index over all of them."""
    path, tensors = steps["bad"]
    checkpoint = readers.open_checkpoint(path)
    whole = scan_numbers(checkpoint)
    monkeypatch.setattr(numbers, "SCAN_BLOCK", 64)
    monkeypatch.setattr(numbers, "SCAN_PIECE", 256)
    monkeypatch.setattr(numbers, "MAP_AT_LEAST", 0 if mapped else 1 << 62)
    assert scan_numbers(checkpoint, threads=3) == whole
    expected = expected_figures({f: x for f, x in tensors.items()})
    assert {n.fqn: torch_figures(n.fqn, tensors[n.fqn])["first_bad"] for n in whole} == {
        n.fqn: n.first_bad for n in whole} and len(whole) == len(expected)


def test_stop_at_first_bad_returns_a_bad_tensor_and_only_whole_others(steps):
    checkpoint = readers.open_checkpoint(steps["bad"][0])
    found = scan_numbers(checkpoint, stop_at_first_bad=True, threads=1)
    everything = {n.fqn: n for n in scan_numbers(checkpoint)}
    in_file_order = sorted(everything, key=lambda fqn: checkpoint.tensors[fqn].chunks[0].blob.offset)
    first = next(fqn for fqn in in_file_order if everything[fqn].bad)  # one thread reads in file order
    assert [n.fqn for n in found if n.bad] == [first]
    assert {n.fqn for n in found if not n.bad} == set(in_file_order[:in_file_order.index(first)])
    assert all(n == everything[n.fqn] for n in found)  # the bad tensor's only block holds all of it
    assert scan_numbers(checkpoint, ["model.w32"]) == [everything["model.w32"]]


def write_element(checkpoint: Path, fqn: str, full: torch.Tensor, chunk_rows: slice, row: int, column: int,
                  value: float) -> int:
    """Write `value` into the .distcp bytes of element [row, column] of `fqn`'s chunk holding
    rows `chunk_rows`, found by its bytes inside the chunk's blob (torch's storage entry);
    return the element's flat index in the whole tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint).read_metadata()
    key = next(k for k in metadata.storage_data if k.fqn == fqn and k.offset[0] == chunk_rows.start)
    info = metadata.storage_data[key]
    path = checkpoint / info.relative_path
    data = bytearray(path.read_bytes())
    chunk = full[chunk_rows].contiguous().numpy().tobytes()
    blob = bytes(data[info.offset:info.offset + info.length])
    assert blob.count(chunk) == 1
    local = (row - chunk_rows.start) * full.shape[1] + column
    at = info.offset + blob.index(chunk) + 4 * local
    data[at:at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))
    return row * full.shape[1] + column


def test_first_bad_is_the_global_index_in_an_fsdp2_checkpoint_of_two_ranks(cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "step"
    shutil.copytree(FIXTURES / "fsdp2_world2", checkpoint)
    embed, fc1 = "model.embed.weight", "model.layers.0.fc1.weight"
    state = {embed: torch.empty(13, 8), fc1: torch.empty(20, 8)}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    assert write_element(checkpoint, embed, state[embed], slice(7, 13), 9, 5, float("nan")) == 77  # rank 1's chunk
    # an Inf in rank 1's chunk, a NaN two elements before it in rank 0's: the NaN is the first
    assert write_element(checkpoint, fc1, state[fc1], slice(10, 20), 10, 1, float("inf")) == 81
    assert write_element(checkpoint, fc1, state[fc1], slice(0, 10), 9, 7, float("nan")) == 79
    loaded = {embed: torch.empty(13, 8), fc1: torch.empty(20, 8)}
    dcp.load(loaded, checkpoint_id=checkpoint, no_dist=True)  # torch reads the damaged values
    result = cli("validate", checkpoint, "--numerics", "--json")
    assert result.exit_code == 1
    found = {n["fqn"]: n for n in json.loads(result.stdout)["numbers"]}
    for fqn in (embed, fc1):
        assert {k: found[fqn][k] for k in torch_figures(fqn, loaded[fqn])} == torch_figures(fqn, loaded[fqn])
    assert (found[embed]["first_bad"], found[embed]["file"]) == (77, "__1_0.distcp")
    assert (found[fc1]["first_bad"], found[fc1]["nan"], found[fc1]["inf"], found[fc1]["file"]) == (79, 1, 1, "__0_0.distcp")
    assert sum(n["nan"] + n["inf"] for n in found.values()) == 3


@pytest.mark.parametrize("source", ["megatron", "hf_trainer_deepspeed/zero3_bf16/run", "verl/checkpoints/global_step_2",
                                    "lightning_deepspeed/zero2_bf16_tied/checkpoints"])
def test_framework_layouts_give_torchs_figures_of_the_tensors_they_hold(source):
    """Megatron, DeepSpeed ZeRO-3 (bf16), verl and Lightning's DeepSpeed files: each tensor's
    figures are torch's on the tensor `ckpttool.open` assembles from the same bytes."""
    path = FIXTURES / "frameworks" / source
    with ckpttool.open(path) as opened:
        found = scan_numbers(opened.checkpoint)
        assert found and len(found) == len(numbers.floating(opened.checkpoint))
        for figures in found:
            expected = torch_figures(figures.fqn, opened.get_tensor(figures.fqn))
            assert {k: getattr(figures, k) for k in expected} == expected


def test_the_installed_ckpttool_names_the_nan_tensor_and_exits_1(steps):
    path, _ = steps["bad"]
    result = subprocess.run([str(CKPTTOOL), "validate", str(path), "--numerics"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "error: [non-finite] __0_0.distcp: model.w32: 2 NaN and 0 Inf of 3072 elements, the first at element 247" in result.stdout
    clean = subprocess.run([str(CKPTTOOL), "validate", str(steps["clean"][0]), "--numerics"], capture_output=True, text=True,
                           timeout=120)
    assert clean.returncode == 0 and clean.stdout.startswith("VALID: ")
