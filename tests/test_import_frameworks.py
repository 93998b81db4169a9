"""`import --to torchtitan|megatron`: a Hub model written as the framework's own checkpoint,
by the family tables run backwards (issue 46).

The proofs here need no framework installed:
- **against the framework's own saves**: the committed fixtures hold, per family, a checkpoint
  written by torchtitan 0.3.0's checkpointer or megatron-core 0.16.1's `dist_checkpointing.save`
  (torchtitan_families/*/checkpoint, megatron_families/*/checkpoints) and the Hub folder the
  framework's own converter made of it (`to_hf`; Megatron-Bridge). Importing the Hub folder
  gives back every model tensor of the framework's save byte for byte (`ckpttool diff`), and
  for Megatron its `_extra_state` entries too;
- **with stock torch**: `dcp.load` reads every import at the key set and shapes it states;
- **the round trip**: import then export gives the Hub folder's tensors back byte for byte.
The framework-side loads (torchtitan's model at world 1 and 2, megatron-core's strict
`dist_checkpointing.load` at TP 1/2 and EP 2) run in fixtures/frameworks/check_*_import.py,
in the frameworks' own environments (their README has the results).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES

CKPTTOOL = Path(sys.executable).with_name("ckpttool")
TITAN = FIXTURES / "frameworks" / "torchtitan_families"
MEGATRON = FIXTURES / "frameworks" / "megatron_families"
TITAN_CASES = ["deepseek_v3", "llama3", "qwen3", "qwen3_moe"]
# torchtitan 0.3.0's own from_hf and Megatron-Bridge 0.3.1's own mapping of tiny Hub models
# (fixtures/frameworks/generate_{torchtitan,megatron}_import.py, their README: the frameworks'
# loads of ckpttool's imports, check_*_import.py, at world 1 and 2, TP 1 and 2, EP 2)
TITAN_IMPORT = FIXTURES / "frameworks" / "torchtitan_import"
MEGATRON_IMPORT = FIXTURES / "frameworks" / "megatron_import"
MEGATRON_CASES = ["llama_tp2", "moe", "moe_ep2"]


def titan_step(name: str) -> Path:
    return next((TITAN / name / "checkpoint").iterdir())


def megatron_step(name: str) -> Path:
    return next(path for path in (MEGATRON / name / "checkpoints").iterdir() if path.is_dir())


@pytest.fixture(scope="module")
def titan_imports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("titan")
    out = {}
    for name in TITAN_CASES:
        for world in (1, 2):
            target = root / f"{name}-{world}"
            result = run("import", TITAN / name / "hf", target, "--to", "torchtitan", "--world", str(world), "--json")
            out[name, world] = (target, result)
    return out


@pytest.fixture(scope="module")
def megatron_imports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name in MEGATRON_CASES:
        target = root / name
        out[name] = (target, run("import", MEGATRON / name / "hf", target, "--to", "megatron", "--json"))
    return out


def diff_document(run, a: Path, b: Path, *extra) -> dict:
    result = run("diff", a, b, "--json", "--limit", "0", *extra)
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", TITAN_CASES)
def test_torchtitan_import_gives_back_torchtitans_own_save_byte_for_byte(titan_imports, run, name, world):
    target, result = titan_imports[name, world]
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["framework"] == "torchtitan" and report["family"].startswith("torchtitan ")
    assert report["world_size"] == world and report["rule"] == "every-tensor"
    assert [entry["file"] for entry in report["files"]] == [f"__{rank}_0.distcp" for rank in range(world)]
    found = diff_document(run, titan_step(name), target)
    made = {entry["key"] for entry in report["made"]}
    # a trained torchtitan save holds a load-balancing bias the Hub model has no place for: the
    # import writes it as torchtitan initialises it (zeros), and says so (the fixture's layer 0
    # bias moved in training, layer 1's did not)
    differing = {entry["key"] for entry in found["tensors"] if entry["status"] != "equal"}
    assert differing <= made and (not made or differing), (name, differing, made)
    assert not found["only_a"] and not found["only_b"] and found["summary"]["tensors"] > 10, found["summary"]


def test_torchtitan_moe_import_lists_the_buffers_it_made_as_zeros(titan_imports):
    import torch
    import torch.distributed.checkpoint as dcp

    target, result = titan_imports["qwen3_moe", 2]
    made = json.loads(result.output)["made"]
    assert [entry["key"] for entry in made] == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]
    state = {entry["key"]: torch.full((4,), 7.0) for entry in made}
    dcp.load(state, checkpoint_id=str(target))
    assert all(torch.equal(value, torch.zeros(4)) for value in state.values())


@pytest.mark.parametrize("name", TITAN_CASES)
def test_stock_dcp_load_reads_every_key_of_the_torchtitan_import(titan_imports, name):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target, _ = titan_imports[name, 2]
    metadata = dcp.FileSystemReader(str(target)).read_metadata()
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    reference = dcp.FileSystemReader(str(titan_step(name))).read_metadata().state_dict_metadata
    # the import holds exactly the model keys torchtitan saved (beside its training state)
    training = ("optimizer.", "lr_scheduler", "train_state", "dataloader")
    assert set(state) == {key for key, entry in reference.items()
                          if isinstance(entry, TensorStorageMetadata) and not key.startswith(training)}
    dcp.load(state, checkpoint_id=str(target))


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_megatron_import_gives_back_megatron_cores_own_save(megatron_imports, run, name):
    target, result = megatron_imports[name]
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["extra_files"] == ["common.pt", "metadata.json"]
    # Megatron-LM's run folder: `--load DST` reads the tracker, then iter_0000000/
    assert report["run_files"] == ["latest_checkpointed_iteration.txt", "iter_0000000/"]
    assert (target / "latest_checkpointed_iteration.txt").read_text() == "0"
    found = diff_document(run, megatron_step(name), target, "--exact-names")
    # every model tensor and `_extra_state` entry of megatron-core's save, byte for byte; what
    # is only in the save is its training state (optimizer, RNG), not the model
    summary = found["summary"]
    assert summary["tensors"] == summary["equal"] > 5 and summary["objects_different"] == 0, summary
    assert summary["objects"] >= 8 and not found["only_b"], summary
    assert all(entry["key"].startswith(("optimizer.", "rng_state")) for entry in found["only_a"]), found["only_a"]
    saved = json.loads((megatron_step(name) / "metadata.json").read_text())
    assert json.loads((target / "iter_0000000" / "metadata.json").read_text()) == saved


def test_megatron_common_pt_is_empty_as_a_model_save_writes_it(megatron_imports):
    import torch

    target, _ = megatron_imports["llama_tp2"]
    # its entries come back from dist_checkpointing.load beside the model's: any key here fails a
    # strict load_state_dict (fixtures/frameworks/megatron_import/*/probes.json)
    assert torch.load(target / "iter_0000000" / "common.pt", weights_only=True) == {}


@pytest.mark.parametrize("framework, name", [("torchtitan", "llama3"), ("torchtitan", "qwen3_moe"),
                                             ("torchtitan", "deepseek_v3"), ("megatron", "moe")])
def test_import_then_export_gives_back_the_hub_tensors_byte_for_byte(titan_imports, megatron_imports, run,
                                                                       tmp_path, framework, name):
    hub = (TITAN if framework == "torchtitan" else MEGATRON) / name / "hf"
    target = titan_imports[name, 2][0] if framework == "torchtitan" else megatron_imports[name][0]
    drop = ("--drop", "*.moe.expert_bias_E") if name == "qwen3_moe" else ()
    result = run("export", target, tmp_path / "hub", "--assets", hub, *drop)
    assert result.exit_code == 0, result.output
    assert run("diff", hub, tmp_path / "hub").exit_code == 0
    # and diff compares the Hub folder with the import itself through the names
    same = run("diff", hub, target, "--assets", hub, *(("--drop", "*.moe.expert_bias_E") if drop else ()))
    assert same.exit_code == 0 or drop, same.output


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", TITAN_CASES)
def test_torchtitan_import_equals_torchtitans_own_from_hf_with_its_key_set(run, tmp_path, name, world):
    import hashlib

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    expected = json.loads((TITAN_IMPORT / name / "expected.json").read_text())
    result = run("import", TITAN_IMPORT / name / "hub", tmp_path / "tt", "--to", "torchtitan", "--world", str(world),
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    metadata = dcp.FileSystemReader(str(tmp_path / "tt")).read_metadata().state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in metadata.items()
             if isinstance(entry, TensorStorageMetadata)}
    assert set(state) == set(expected["tensors"])  # exactly the keys torchtitan's model state dict holds
    dcp.load(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    for key, row in expected["tensors"].items():
        # stored as from_hf gives it (the Hub tensor's dtype); torchtitan's float32 model takes it
        # widened, exactly, as its own HF load does: compared in the model's float32
        allowed = {row["dtype"], *(f"torch.{d}" for d in row.get("hf_dtypes", ())), *row.get("hf_dtypes", ())}
        assert str(state[key].dtype).removeprefix("torch.") in {d.removeprefix("torch.") for d in allowed}, key
        value = state[key].to(getattr(torch, row["dtype"])).contiguous()
        assert hashlib.sha256(value.view(torch.uint8).numpy().tobytes()).hexdigest() == row["sha256"], key
    assert sorted(made["key"] for made in report["made"]) == sorted(expected["init_keys"])
    assert sorted(entry["key"] for entry in report["left_out"]) == sorted(expected["hf_keys_unused"])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_megatron_import_equals_megatron_bridges_conversion_as_megatron_core_saved_it(run, tmp_path, name, world):
    result = run("import", MEGATRON_IMPORT / name / "hub", tmp_path / "mg", "--to", "megatron", "--world", str(world))
    assert result.exit_code == 0, result.output
    found = diff_document(run, MEGATRON_IMPORT / name / "reference", tmp_path / "mg", "--exact-names")
    summary = found["summary"]
    # every tensor and `_extra_state` entry, byte for byte, and nothing else on either side
    assert found["verdict"] == "identical", summary
    assert summary["objects"] > 0 and summary["objects_different"] == 0


def write_hub(tmp_path: Path, source: Path, **changes) -> Path:
    import shutil

    hub = tmp_path / "hub"
    shutil.copytree(source, hub)
    config = json.loads((hub / "config.json").read_text())
    config.update(changes)
    (hub / "config.json").write_text(json.dumps(config))
    return hub


def test_a_config_whose_heads_disagree_with_the_weights_exits_1_naming_the_key(tmp_path, cli):
    hub = write_hub(tmp_path, MEGATRON / "llama_tp2" / "hf", num_key_value_heads=3)
    result = cli("import", hub, tmp_path / "out", "--to", "megatron")
    assert result.exit_code == 1, result.output
    assert "model.layers.0.self_attn.q_proj.weight" in result.output and "head" in result.output
    assert not (tmp_path / "out").exists()


def test_an_architecture_with_no_table_exits_2_naming_what_it_writes(tmp_path, cli):
    hub = write_hub(tmp_path, TITAN / "llama3" / "hf", architectures=["GPT2LMHeadModel"])
    result = cli("import", hub, tmp_path / "out", "--to", "torchtitan", "--world", "1")
    assert result.exit_code == 2, result.output
    assert "GPT2LMHeadModel" in result.output and "LlamaForCausalLM" in result.output
    assert not (tmp_path / "out").exists()


def test_options_that_do_not_fit_exit_2(tmp_path, cli):
    hub = TITAN / "llama3" / "hf"
    assert cli("import", hub, tmp_path / "a", "--to", "torchtitan").exit_code == 2  # torchtitan needs --world
    assert cli("import", hub, tmp_path / "b", "--to", "megatron", "--mesh", "1,2").exit_code == 2
    assert cli("import", hub, tmp_path / "c", "--world", "1", "--assets", hub).exit_code == 2
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_hub_key_no_rule_takes_exits_1_naming_it(tmp_path, cli):
    from safetensors.torch import load_file, save_file

    hub = write_hub(tmp_path, TITAN / "llama3" / "hf")
    tensors = load_file(hub / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    result = cli("import", hub, tmp_path / "out", "--to", "torchtitan", "--world", "1")
    assert result.exit_code == 1 and "model.layers.0.self_attn.extra.weight" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_safetensors_file_needs_assets_for_its_config(tmp_path, cli):
    weights = TITAN / "llama3" / "hf" / "model.safetensors"
    assert cli("import", weights, tmp_path / "a", "--to", "torchtitan", "--world", "1").exit_code == 2
    result = cli("import", weights, tmp_path / "b", "--to", "torchtitan", "--world", "1", "--assets", TITAN / "llama3" / "hf")
    assert result.exit_code == 0, result.output
    assert cli("diff", titan_step("llama3"), tmp_path / "b").exit_code == 0


def test_the_installed_command_imports_into_megatron(tmp_path):
    done = subprocess.run([str(CKPTTOOL), "import", str(MEGATRON / "moe" / "hf"), str(tmp_path / "out"), "--to", "megatron"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "megatron qwen moe" in done.stdout and "--load" in done.stdout
    assert (tmp_path / "out" / "iter_0000000" / ".metadata").is_file()


def test_a_failed_megatron_import_leaves_no_run_folder(tmp_path, cli):
    hub = write_hub(tmp_path, MEGATRON / "moe" / "hf", num_attention_heads=3)
    result = cli("import", hub, tmp_path / "out", "--to", "megatron")
    assert result.exit_code == 1, result.output
    assert not (tmp_path / "out").exists()


FP8 = FIXTURES / "quantized" / "deepseek_v3_fp8"


def test_an_fp8_hub_model_is_dequantised_on_the_way_as_consolidate_dequantises_it(tmp_path, cli):
    refused = cli("import", FP8, tmp_path / "refused", "--to", "torchtitan", "--world", "2")
    assert refused.exit_code == 2 and "--dtype bf16" in refused.output, refused.output
    assert not (tmp_path / "refused").exists()
    result = cli("import", FP8, tmp_path / "imported", "--to", "torchtitan", "--world", "2", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["imported", "refused"] or \
        sorted(path.name for path in tmp_path.iterdir()) == ["imported"]  # the scratch folder is gone
    # the same as dequantising with consolidate first, then importing the bf16 Hub folder
    assert cli("consolidate", FP8, tmp_path / "bf16", "--dtype", "bf16").exit_code == 0
    config = json.loads((FP8 / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    assert cli("import", tmp_path / "bf16", tmp_path / "two-steps", "--to", "torchtitan", "--world", "2").exit_code == 0
    same = cli("diff", tmp_path / "imported", tmp_path / "two-steps")
    assert same.exit_code == 0 and "IDENTICAL" in same.output, same.output


# the inverses, as pure data (no files): each framework tensor's pieces, read back as indices

def pieces_as_rows(target, shapes) -> list[tuple[str, int]]:
    """Return (transformers key, row) for every row of a target built of whole-row pieces."""
    rows = []
    for piece in target.pieces:
        (first, *_), (count, *_) = piece.box
        if piece.transposed is not None:  # target row y * X + x is box row x * Y + y
            x, y = piece.transposed
            rows.extend((piece.source, first + number % x * y + number // x) for number in range(count))
            continue
        rows.extend((piece.source, first + number * piece.step) for number in range(count))
    return rows


def titan_reverse_permute(w, heads: int):
    """torchtitan 0.3.0 llama3/state_dict_adapter.py `_reverse_permute`, what from_hf applies to q and k."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("rows, heads", [(8, 2), (64, 4), (48, 1), (96, 12)])
def test_unpermute_is_torchtitans_reverse_permute(rows, heads):
    import torch

    from ckpttool.naming import family
    from ckpttool.naming.backward import backward

    shapes = {"model.layers.0.self_attn.q_proj.weight": (rows, 3)}
    table = family("torchtitan llama3")
    rule = next(r for r in table.rules if r.source.endswith("wq.weight"))
    trimmed = type(table)(table.name, table.signature, table.converts_to, (rule,))
    target = backward(trimmed, shapes, {"num_attention_heads": heads}, "test").targets[
        "layers.0.attention.qkv_linear.wq.weight"]
    weight = torch.arange(rows * 3).reshape(rows, 3)
    order = [row for _, row in pieces_as_rows(target, shapes)]
    assert torch.equal(weight[order], titan_reverse_permute(weight, heads))


@pytest.mark.parametrize("heads, groups, head_dim", [(4, 2, 8), (8, 1, 4), (6, 6, 2)])
def test_join_qkv_is_the_inverse_of_split_qkv(heads, groups, head_dim):
    from ckpttool.naming import convert, family
    from ckpttool.naming.backward import backward

    config = {"num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim}
    table = family("megatron gpt")
    rule = next(r for r in table.rules if r.source.endswith("linear_qkv.weight"))
    trimmed = type(table)(table.name, table.signature, table.converts_to, (rule,))
    fused = "decoder.layers.0.self_attention.linear_qkv.weight"
    forward = convert(trimmed, {fused: ((heads + 2 * groups) * head_dim, 5)}, config, "test")
    hub_rows = {key: pieces_as_rows(target, {}) for key, target in forward.items()}  # hf row -> fused row
    shapes = {key: target.shape for key, target in forward.items()}
    back = backward(trimmed, shapes, config, "test").targets[fused]
    # framework row r is made of hub row (key, i), which forward made of fused row hub_rows[key][i]: r itself
    assert [hub_rows[key][row][1] for key, row in pieces_as_rows(back, shapes)] == list(range(back.shape[0]))


def test_a_rule_with_no_inverse_is_refused_by_name(monkeypatch):
    from ckpttool.naming import engine, family
    from ckpttool.naming.backward import NoInverse, backward

    table = family("torchtitan llama3")
    rule = next(r for r in table.rules if r.source == "norm.weight")
    renames = dict(engine.TRANSFORMS)
    renames["rename"] = engine.Transform(renames["rename"].apply, 1, inverse=None)
    monkeypatch.setattr("ckpttool.naming.backward.TRANSFORMS", renames)
    trimmed = type(table)(table.name, table.signature, table.converts_to, (rule,))
    with pytest.raises(NoInverse, match="norm.weight <- model.norm.weight"):
        backward(trimmed, {"model.norm.weight": (4,)}, {}, "test")


@pytest.mark.parametrize("cuts", [(), (40,), (16, 17, 90)])
def test_an_unpermuted_weight_is_a_chunk_per_head_whose_bytes_are_torchtitans_reverse_permute(tmp_path, cuts):
    """A head held in one source chunk is one chunk (its rows' range and the grid transposed,
    not a chunk per row); one straddling source chunks falls back to a chunk per row."""
    import torch

    from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms, rows_transposed
    from ckpttool.dcp.blobs import DataFiles, read_chunk
    from ckpttool.naming import family
    from ckpttool.naming.backward import backward
    from ckpttool.naming.engine import converted_checkpoint
    from ckpttool.run import locating

    rows, cols, heads = 96, 3, 4
    weight = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + weight.numpy().tobytes())
    row_bytes = cols * 4
    bounds = [0, *cuts, rows]
    hub = "model.layers.0.self_attn.q_proj.weight"
    chunks = tuple(Chunk((a, 0), (b - a, cols), Blob("w.bin", 8 + a * row_bytes, (b - a) * row_bytes,
                                                      raw_range_transforms()))
                   for a, b in zip(bounds, bounds[1:]))
    checkpoint = Checkpoint(tmp_path, "", None, {hub: Tensor(hub, "float32", (rows, cols), chunks)}, {})
    table = family("torchtitan llama3")
    rule = next(r for r in table.rules if r.source.endswith("wq.weight"))
    trimmed = type(table)(table.name, table.signature, table.converts_to, (rule,))
    targets = backward(trimmed, {hub: (rows, cols)}, {"num_attention_heads": heads}, "test").targets
    with DataFiles(tmp_path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        converted = converted_checkpoint(checkpoint, targets, located)
        tensor = converted.tensors["layers.0.attention.qkv_linear.wq.weight"]
        made = torch.empty(rows, cols)
        for chunk in tensor.chunks:
            (first, _), (count, _) = chunk.offsets, chunk.sizes
            made[first:first + count] = torch.frombuffer(bytearray(read_chunk(files, tensor, chunk)),
                                                         dtype=torch.float32).reshape(count, cols)
    assert torch.equal(made, titan_reverse_permute(weight, heads))
    head_dim = rows // heads
    whole_heads = sum(1 for h in range(heads) if not any(h * head_dim < cut < (h + 1) * head_dim for cut in cuts))
    assert sum(1 for chunk in tensor.chunks if rows_transposed(chunk.blob)) == whole_heads
    assert len(tensor.chunks) == whole_heads + (heads - whole_heads) * head_dim
