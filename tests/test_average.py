"""`average`: the weighted average of k checkpoints of one model, in any layouts, equals the
formula computed by torch (float64 products and sums in the given order, then `.to(dtype)`)
bit for bit; refusals write nothing; a DCP output loads with stock `dcp.load`; an averaged
Llama exported with --assets loads in transformers; torchrun writes the same bytes.

Sources are real saves: the bundled fixtures (torch's dcp.save from FSDP2 runs at world 2
and 3, fp32 and bf16), a bf16 TinyModel saved by 3 gloo ranks here (once per session), and
.safetensors files of perturbed copies written with safetensors' own torch writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, assert_same_bytes

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
WORLD2, WORLD3, BF16_WORLD2 = FIXTURES / "fsdp2_world2", FIXTURES / "fsdp2_world3_uneven", FIXTURES / "fsdp2_world2_bf16"
LLAMA = FIXTURES / "llama_world2"


def model_state(reference, path: Path) -> dict:
    """The model's state dict of a source, as torch reads it: a DCP checkpoint through
    dcp_to_torch_save (its `model.` entries), a .safetensors file through safetensors."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return {key[len("model."):]: value for key, value in reference(path).items() if key.startswith("model.")}


def torch_average(states: list[dict], weights: list[float] | None = None) -> dict:
    """The issue's formula in torch: acc = w1 * x1, then acc = acc + w_i * x_i in float64,
    then `.to(dtype)`; integer and bool tensors are the first source's."""
    weights = weights or [1.0 / len(states)] * len(states)
    out = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            out[key] = first
            continue
        acc = weights[0] * first.double()
        for weight, state in zip(weights[1:], states[1:]):
            acc = acc + weight * state[key].double()
        out[key] = acc.to(first.dtype)
    return out


def assert_equal_states(written: dict, expected: dict) -> None:
    assert set(written) == set(expected)  # exactly the model's keys
    for key, value in expected.items():
        assert_same_bytes(written[key], value, key)


def perturbed(state: dict, seed: int, scale: float = 0.01, specials: bool = False) -> dict:
    """A copy of `state` with seeded noise on its floating tensors; `specials` puts an Inf, a
    -Inf, a NaN (float32 only: see `test_the_cast_is_torchs`), a subnormal and a huge value
    (overflows in the sum) into the first floating tensor."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in state.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32) * scale
            value = (value.float() + noise).to(value.dtype)
        out[key] = value.clone()
    if specials:
        key = next(k for k, v in out.items() if v.is_floating_point() and v.numel() >= 6)
        flat = out[key].view(-1)
        flat[0], flat[1], flat[2] = float("inf"), float("-inf"), torch.finfo(flat.dtype).max
        flat[3] = torch.finfo(flat.dtype).smallest_normal / 4  # subnormal
        if flat.dtype == torch.float32:
            flat[4] = float("nan")
    return out


def save_safetensors(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _bf16_world3_rank(rank: int, port: int, path: str) -> None:
    """fixtures/generate.py's TinyModel in bf16 with another seed, sharded by fully_shard on 3
    gloo ranks (head's 2 rows leave rank 2 empty), saved by dcp.save as `{"model": ...}`."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_loads import exit_spawned_rank

    sys.path.insert(0, str(FIXTURES))
    from generate import TinyModel  # fixtures/generate.py: the bundled fixtures' model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    torch.manual_seed(77)
    model = TinyModel().to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (3,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


@pytest.fixture(scope="session")
def sources(tmp_path_factory, reference) -> dict[str, Path]:
    """name -> checkpoint: the fixtures, a bf16 DCP save at world 3, and .safetensors files of
    perturbed copies (fp32 with Inf, NaN, a subnormal and float32's largest value; bf16)."""
    from fsdp_loads import free_port
    from rank_forks import run_ranks

    root = tmp_path_factory.mktemp("average-sources")
    bf16_world3 = root / "bf16_world3"
    run_ranks(_bf16_world3_rank, 3, free_port(), str(bf16_world3), timeout=600)
    return {
        "world2": WORLD2, "world3": WORLD3, "bf16_world2": BF16_WORLD2, "bf16_world3": bf16_world3,
        "fp32.safetensors": save_safetensors(perturbed(model_state(reference, WORLD2), 1, specials=True),
                                             root / "fp32.safetensors"),
        "bf16.safetensors": save_safetensors(perturbed(model_state(reference, BF16_WORLD2), 2, scale=0.1, specials=True),
                                             root / "bf16.safetensors"),
    }


def run_average(cli, *args) -> None:
    result = cli("average", *args, "-q")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("names, weights, out", [
    (("world2", "world3"), None, "avg.safetensors"),
    (("world3", "fp32.safetensors", "world2"), [0.5, 0.25, 0.25], "avg.pt"),
    (("bf16_world2", "bf16_world3"), None, "avg.safetensors"),
    (("bf16_world3", "bf16.safetensors", "bf16_world2"), None, "hub"),  # 1/3 each, Hub shards
    (("bf16.safetensors", "bf16_world2", "bf16_world3"), [0.7, -0.2, 0.5], "avg.pt"),
], ids=["fp32-2-default", "fp32-3-mixed-weights-pt", "bf16-2-default", "bf16-3-mixed-default-hub",
        "bf16-3-mixed-weights-pt"])
def test_average_equals_torchs_float64_formula_bit_for_bit(cli, reference, sources, tmp_path, names, weights, out):
    import torch

    paths = [sources[name] for name in names]
    args = [*paths, tmp_path / out] + (["--weights", ",".join(map(repr, weights))] if weights else [])
    if out == "hub":
        args += ["--max-shard-size", "1kB"]
    run_average(cli, *args)
    if out == "hub":
        index = json.loads((tmp_path / out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        written = {}
        for shard in sorted(set(index["weight_map"].values())):
            written.update(model_state(reference, tmp_path / out / shard))
    elif out.endswith(".pt"):
        written = torch.load(tmp_path / out, weights_only=True)
    else:
        written = model_state(reference, tmp_path / out)
    states = [model_state(reference, path) for path in paths]
    assert_equal_states(written, torch_average(states, weights))
    if "fp32.safetensors" in names:  # the specials went through: +-Inf, NaN
        values = torch.cat([v.view(-1).double() for v in written.values() if v.is_floating_point()])
        assert values.isnan().any() and values.isposinf().any() and values.isneginf().any()


@pytest.mark.parametrize("layout", ["block-sharded", "zstd"])
def test_chunks_gathered_from_2d_blocks_or_decoded_average_as_torch_computes(cli, reference, tmp_path, layout,
                                                                            request):
    """Sources whose bytes are not runs of the tensor: 2-D block sharding on 4 gloo ranks with a
    tied head and a 0-d bf16 tensor (conftest's block_tied_buffers), and zstd-compressed blobs
    (decoded); each averaged with a perturbed .safetensors copy, weights 0.625/0.375."""
    from conftest import save_with_writer_options

    if layout == "zstd":
        source = tmp_path / "zstd"
        save_with_writer_options(source, "zstd")
    else:
        source = request.getfixturevalue("block_tied_buffers")
    state = model_state(reference, source)
    other = save_safetensors(perturbed(state, 4), tmp_path / "other.safetensors")
    run_average(cli, source, other, tmp_path / "avg.safetensors", "--weights", "0.625,0.375")
    from safetensors.torch import load_file

    expected = torch_average([state, load_file(str(other))], [0.625, 0.375])
    assert_equal_states(load_file(str(tmp_path / "avg.safetensors")), expected)

def test_the_cast_is_torchs_on_ties_subnormals_overflow_and_nan():
    """float64 -> float32/float16/bfloat16 as torch's `.to` on this CPU: every bit, through
    float32 for the 16-bit types (a double rounding), except a bfloat16 NaN, which torch writes
    as 0x7FC0 or 0xFFFF depending on its loop; ours is always 0x7FC0."""
    import numpy as np
    import torch

    from ckpttool.run.average import cast_float64

    generator = np.random.default_rng(0)
    ties = []
    for exponent in range(-150, 130, 7):
        for mantissa in range(0, 256, 5):
            for bits in (8, 11, 24):  # halfway between two bfloat16, float16, float32 values
                x = np.ldexp(1 + mantissa / 256 + 2.0 ** -bits, exponent)
                ties += [x, -x, np.nextafter(x, 0), np.nextafter(x, np.inf), x + np.ldexp(1, exponent - 40)]
    values = np.concatenate([
        generator.integers(0, 2 ** 64, 100_000, dtype=np.uint64).view(np.float64),  # every exponent, NaN payloads
        generator.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32).astype(np.float64),
        np.array(ties),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-300, 3.4028235e38, 3.5e38, 65519.99, 65520.0,
                  2.980232238769531e-8, 1e-45, 7e-46, float.fromhex("0x1.ff00000p+127"), float.fromhex("0x1.fefffffp+127")]),
    ])
    reference = torch.from_numpy(values.copy())
    for name in ("float32", "float16", "bfloat16"):
        dtype = getattr(torch, name)
        ours = cast_float64(values.copy(), name).copy().view(np.uint8).reshape(len(values), -1)
        theirs = reference.to(dtype).view(torch.uint8).numpy().reshape(len(values), -1)
        differ = np.flatnonzero((ours != theirs).any(axis=1))
        if name != "bfloat16":
            assert len(differ) == 0, (name, values[differ[:5]])
            continue
        assert len(differ) and np.isnan(values[differ]).all()  # torch's vectorised loop: 0xFFFF
        assert (ours[np.isnan(values)].view(np.uint16) == 0x7FC0).all()


def test_small_blocks_write_the_same_bytes_as_large_ones(cli, sources, tmp_path):
    """--max-memory 64kB cuts every tensor into 4096-element blocks (at most), spanning the
    sources' chunk boundaries anywhere: the bytes are those of whole-tensor blocks."""
    paths = [sources["world3"], sources["fp32.safetensors"], sources["world2"]]
    run_average(cli, *paths, tmp_path / "large.safetensors")
    run_average(cli, *paths, tmp_path / "small.safetensors", "--max-memory", "64kB", "--threads", "1")
    assert (tmp_path / "small.safetensors").read_bytes() == (tmp_path / "large.safetensors").read_bytes()


def test_blocks_tile_each_tensor_and_name_each_sources_byte_ranges():
    from ckpttool.dcp.blobs import RawData
    from ckpttool.plan.average import OutputTensor, SourceMap, Segment, blocks

    tensor = OutputTensor("w", "float32", (6, 2))  # 48 bytes
    a = SourceMap((Segment(0, RawData("a0", 100, 24)), Segment(24, RawData("a1", 200, 24))), (0, 24))
    b = SourceMap((Segment(0, RawData("b0", 0, 48)),), (0,))
    made = blocks(tensor, [a, b], 0, 12, "out", 8, block_elements=5)
    assert [(op.start, op.count, op.dst_offset) for op in made] == [(0, 5, 8), (5, 5, 28), (10, 2, 48)]
    assert made[1].reads == ((RawData("a0", 120, 4), RawData("a1", 200, 16)), (RawData("b0", 20, 20),))


def test_world_n_output_loads_with_stock_dcp_load(cli, sources, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    paths = [sources["bf16_world2"], sources["bf16_world3"], sources["bf16.safetensors"]]
    run_average(cli, *paths, tmp_path / "avg.safetensors", "--weights", "0.5,0.3,0.2")
    run_average(cli, *paths, tmp_path / "dcp4", "--world", "4", "--weights", "0.5,0.3,0.2")
    assert sorted(p.name for p in (tmp_path / "dcp4").iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    expected = load_file(str(tmp_path / "avg.safetensors"))
    state = {"model": {key: torch.empty_like(value) for key, value in expected.items()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp4"), no_dist=True)
    assert_equal_states(state["model"], expected)


@pytest.mark.parametrize("change, named", [
    ("extra-key", "extra.weight"), ("missing-key", "layers.1.fc2.bias"), ("shape", "embed.weight"),
    ("dtype", "head.weight"), ("int", "position_ids"), ("bool", "mask"),
])
def test_a_refusal_exits_1_naming_the_tensor_and_writes_nothing(cli, reference, tmp_path, change, named):
    import torch

    state = model_state(reference, WORLD2)
    if change == "extra-key":
        state["extra.weight"] = torch.zeros(3)
    elif change == "missing-key":
        del state[named]
    elif change == "shape":
        state[named] = state[named][:-1]
    elif change == "dtype":
        state[named] = state[named].double()
    elif change == "int":
        state[named] = state[named] + 1
    else:
        state[named] = ~state[named]
    other = save_safetensors(state, tmp_path / "other.safetensors")
    before = sorted(os.listdir(tmp_path))
    for out in ("avg.safetensors", "hub", "dcp"):
        result = cli("average", WORLD2, WORLD3, other, tmp_path / out, *(["--world", "2"] if out == "dcp" else []), "-q")
        assert result.exit_code == 1, result.output
        assert named in result.output and "nothing was written" in result.output, result.output
        assert result.output.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary left beside it


def test_usage_errors_exit_2(cli, tmp_path):
    for args, said in [((WORLD2, tmp_path / "a.safetensors"), "at least two sources"),
                       ((WORLD2, WORLD3, tmp_path / "a.safetensors", "--weights", "1,2,3"), "3 weights for 2 sources"),
                       ((WORLD2, WORLD3, tmp_path / "a.safetensors", "--weights", "1,x"), "comma-separated"),
                       ((WORLD2, WORLD3, tmp_path / "a.safetensors", "--weights", "1,nan"), "finite"),
                       ((WORLD2, WORLD3, WORLD2 / "inside.safetensors"), "")]:
        result = cli("average", *args, "-q")
        assert result.exit_code == 2 and said in result.output, result.output
    assert not list(tmp_path.iterdir())


def test_the_averaged_llama_exported_with_assets_loads_in_transformers(cli, tmp_path):
    """A DCP save and a perturbed copy as .safetensors, averaged with 0.75/0.25, exported with
    the model's config: from_pretrained misses nothing and holds the averaged weights."""
    pytest.importorskip("transformers")
    import transformers
    from safetensors.torch import load_file

    original = load_file(str(LLAMA / "reference.safetensors"))  # the live model's state dict = the DCP save's
    other = save_safetensors(perturbed(original, 3), tmp_path / "other.safetensors")
    run_average(cli, LLAMA / "checkpoint", other, tmp_path / "avg.safetensors", "--weights", "0.75,0.25")
    result = cli("export", tmp_path / "avg.safetensors", tmp_path / "hf", "--assets", LLAMA / "config", "-q")
    assert result.exit_code == 0, result.output
    transformers.logging.set_verbosity_error()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    expected = torch_average([original, load_file(str(other))], [0.75, 0.25])
    assert_equal_states(model.state_dict(), expected)


def test_the_installed_command_prints_its_json_document(sources, tmp_path):
    out = tmp_path / "avg.safetensors"
    result = subprocess.run([str(CKPTTOOL), "average", str(WORLD2), str(sources["world3"]), str(sources["fp32.safetensors"]),
                             str(out), "--weights", "0.5,0.25,0.5", "--json", "-q"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == "ckpttool.average/1" and document["files"] == [str(out)]
    assert [s["weight"] for s in document["sources"]] == [0.5, 0.25, 0.5]
    assert document["sources"][2]["path"] == str(sources["fp32.safetensors"])
    assert [s["layout"] for s in document["sources"]] == ["dcp", "dcp", "safetensors"]
    assert (document["averaged"], document["copied"]) == (14, 2)
    assert "note: the weights sum to 1.25, not 1" in result.stderr  # allowed (extrapolation), but said


def test_under_torchrun_the_output_is_byte_identical_to_one_process(cli, sources, tmp_path):
    """Two torchrun processes, each writing a share of the blocks (tests/torchrun_cases.py), into
    a .safetensors file and a DCP checkpoint for 3 ranks, at the paths one process wrote first."""
    from fsdp_loads import free_port

    paths = [str(sources["world2"]), str(sources["world3"]), str(sources["fp32.safetensors"])]
    outputs = {"file": tmp_path / "avg.safetensors", "dcp": tmp_path / "dcp3"}
    extra = {"file": [], "dcp": ["--world", "3"]}
    references = {}
    for name, out in outputs.items():
        run_average(cli, *paths, out, "--max-memory", "64kB", *extra[name])
        references[name] = out.with_name("reference-" + out.name)
        out.rename(references[name])
    cases = [{"name": name, "args": ["average", *paths, str(out), "--max-memory", "64kB", "-q", *extra[name]]}
             for name, out in outputs.items()]
    (tmp_path / "results").mkdir()
    (tmp_path / "cases.json").write_text(json.dumps({"results": str(tmp_path / "results"), "cases": cases}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             str(ROOT / "tests" / "torchrun_cases.py"), str(tmp_path / "cases.json")],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / "results" / f"rank{rank}.json").read_text()) == {"file": 0, "dcp": 0}
    assert outputs["file"].read_bytes() == references["file"].read_bytes()
    for name in sorted(os.listdir(references["dcp"])):
        assert (outputs["dcp"] / name).read_bytes() == (references["dcp"] / name).read_bytes(), name
    assert sorted(os.listdir(outputs["dcp"])) == sorted(os.listdir(references["dcp"]))



@pytest.mark.parametrize("dtype, k, split", [
    ("float32", 3, False), ("float32", 3, True), ("bfloat16", 3, False), ("bfloat16", 3, True),
    ("float16", 2, False), ("float64", 2, True), ("float64", 4, True), ("float32", 9, True),
], ids=["fp32-3", "fp32-3-split", "bf16-3", "bf16-3-split", "fp16-2", "fp64-2-split", "fp64-4-in-turn",
        "fp32-9-in-turn"])
def test_large_blocks_summed_in_cache_sized_steps_are_torchs_formula(tmp_path, dtype, k, split):
    """A block of many sub-blocks (and a remainder), each source one range of a file or two
    (`split`: a sub-block straddles them), or more sources than the interleaved sum keeps at
    once (summed source by source): the bytes of torch's formula, with NaN, +-Inf, overflow,
    subnormals and negative zeros among the values."""
    import torch

    from ckpttool.dcp.blobs import DataFiles, RawData
    from ckpttool.plan.average import Average
    from ckpttool.run import average as averaging

    count = 16 * averaging.SUB_BLOCK + 12_345
    generator = torch.Generator().manual_seed(5)
    tensors, reads = [], []
    for number in range(k):
        values = torch.randn(count, generator=generator, dtype=torch.float64) * 10.0 ** (number - 1)
        values[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38, -3e38])
        values[100 + number] = float("nan")
        x = values.to(getattr(torch, dtype))
        tensors.append(x)
        data = x.view(torch.uint8).numpy().tobytes()
        (tmp_path / f"s{number}").write_bytes(b"\0" * 13 + data)  # an offset off the page size
        half = len(data) // 2 // x.element_size() * x.element_size()
        pieces = (RawData(f"s{number}", 13, half), RawData(f"s{number}", 13 + half, len(data) - half)) if split \
            else (RawData(f"s{number}", 13, len(data)),)
        reads.append(pieces)
    weights = [(-1.0) ** number * (number + 1) / (k + 2) for number in range(k)]
    op = Average("w", dtype, 0, count, tuple(reads), "out", 0)
    with DataFiles(tmp_path) as files:
        data = bytes(averaging.block_bytes(op, weights, [files] * k))
    acc = weights[0] * tensors[0].double()
    for weight, x in zip(weights[1:], tensors[1:]):
        acc = acc + weight * x.double()
    expected = acc.to(tensors[0].dtype)
    ours = torch.frombuffer(bytearray(data), dtype=expected.dtype)
    if dtype == "bfloat16":  # torch's NaN varies with its loop (test_the_cast_is_torchs_...): ours is 0x7FC0
        nan = expected.isnan()
        assert (ours.view(torch.int16)[nan] == 0x7FC0).all()
        ours, expected = ours[~nan], expected[~nan]
    assert_same_bytes(ours, expected, dtype)


def test_local_averages_run_no_more_blocks_at_once_than_cores_remote_ones_keep_threads(monkeypatch):
    from types import SimpleNamespace

    from ckpttool.run.average import compute_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    local, remote = SimpleNamespace(local=True), SimpleNamespace(local=False)
    assert compute_threads(8, [local, local]) == 3
    assert compute_threads(2, [local]) == 2
    assert compute_threads(8, [local, remote]) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert compute_threads(8, [local]) == 2  # never below 2: a read overlaps the other block's arithmetic
