"""`import --to megatron` of GPT-OSS (issue 46 with issue 48's GPT-OSS table): the export table run
backwards, its expert transposes inverted (naming/backward.py `_experts_as_rows`, a `rows` piece
per expert: naming/expert_columns.py `row_chunks`).

The proofs need no framework installed. The fixture fixtures/frameworks/megatron_gpt_oss/gpt_oss_ep2
(generate_megatron_gpt_oss.py) holds a `torch_dist` save of megatron-core 0.16.1's own GPT-OSS
GPTModel at expert parallel 2 and hf/, Megatron-Bridge 0.3.1's GPTOSSBridge export of it:
- importing hf/ gives back every model tensor and `_extra_state` entry of megatron-core's save,
  byte for byte (`ckpttool diff --exact-names`): what Megatron-Bridge's import would write, in the
  names megatron-core's torch_dist `sharded_state_dict` asks for (the experts stacked);
- the round trip: export of the import gives back hf/'s tensors byte for byte;
- the inverses, on tensors cut into chunks as a DCP save of the Hub names cuts them, equal
  torch's own un-interleave and transposes, one chunk per expert (or per band of its rows).
megatron-core's strict `dist_checkpointing.load` of the import into the fixture's GPTModel, at
TP 1, TP 2 and EP 2, runs in fixtures/frameworks/check_megatron_import.py (`gpt_oss`, in
/work/fwvenv-fam; its docstring has the results: max |logits - Megatron's own| <= 5.4e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES, assert_same_bytes

FIXTURE = FIXTURES / "frameworks" / "megatron_gpt_oss" / "gpt_oss_ep2"
HUB = FIXTURE / "hf"
SAVE = FIXTURE / "checkpoints" / "iter_0000002"


@pytest.fixture(scope="module")
def imports(tmp_path_factory, run) -> dict:
    root = tmp_path_factory.mktemp("gpt_oss_import")
    out = {}
    for world in (1, 2):
        target = root / f"world{world}"
        out[world] = (target, run("import", HUB, target, "--to", "megatron", "--world", world, "--json"))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_import_gives_back_megatron_cores_own_gpt_oss_save_byte_for_byte(imports, run, world):
    target, result = imports[world]
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["family"] == "megatron gpt_oss" and report["architecture"] == "GptOssForCausalLM"
    assert report["made"] == [] and report["left_out"] == []
    found = json.loads(run("diff", SAVE, target, "--exact-names", "--json", "--limit", "0").output)
    summary = found["summary"]
    # every model tensor (the experts stacked, gate/up un-interleaved, transposed back) and every
    # `_extra_state` entry; only the save's RNG state is not the model's
    assert summary["tensors"] == summary["equal"] == 29 and summary["different"] == 0, summary
    assert summary["objects"] == 20 and summary["objects_different"] == 0 and not found["only_b"], summary
    assert all(entry["key"].startswith("rng_state") for entry in found["only_a"]), found["only_a"]


def test_import_then_export_gives_back_the_hub_tensors_byte_for_byte(imports, run, tmp_path):
    from safetensors.torch import load_file

    target, _ = imports[2]
    result = run("export", target, tmp_path / "hub", "--assets", HUB)
    assert result.exit_code == 0, result.output
    mine = {}
    for file in sorted((tmp_path / "hub").glob("*.safetensors")):
        mine.update(load_file(str(file)))
    expected = load_file(str(HUB / "model.safetensors"))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_bytes(mine[key], tensor, key)
    same = run("diff", HUB, target, "--assets", HUB)  # and through the names, without exporting
    assert same.exit_code == 0 and "IDENTICAL" in same.output, same.output


def test_each_expert_is_one_chunk_so_import_holds_one_expert_matrix_at_a_time():
    """The memory bound: what import copies (its converted checkpoint, before the write) holds
    each stacked expert tensor as one chunk per layer and expert, a rows-as-columns blob of that
    expert's bytes: decoding one holds that matrix and its transposed copy, never a layer's experts."""
    from ckpttool import readers
    from ckpttool.core.checkpoint import rows_as_columns
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.naming import family
    from ckpttool.naming.backward import backward, stack_layers
    from ckpttool.naming.engine import converted_checkpoint
    from ckpttool.run import locating

    _, checkpoint = readers.read(HUB)
    shapes = {key: tensor.shape for key, tensor in checkpoint.tensors.items()}
    config = json.loads((HUB / "config.json").read_text())
    targets = stack_layers(backward(family("megatron gpt_oss"), shapes, config, "hub").targets, "decoder.layers.")
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        tensors = converted_checkpoint(checkpoint, targets, located).tensors
    for name, sizes in {"linear_fc1.weight": (64, 32), "linear_fc1.bias": (64,), "linear_fc2.weight": (32, 32)}.items():
        tensor = tensors["decoder.layers.mlp.experts.experts." + name]
        assert tensor.shape == (2, 4, *sizes)
        assert len(tensor.chunks) == 2 * 4 and all(rows_as_columns(chunk.blob) for chunk in tensor.chunks)
        assert {chunk.sizes for chunk in tensor.chunks} == {(1, 1, *sizes)}


def gpt_oss_config(experts: int) -> dict:
    return {"num_local_experts": experts, "num_attention_heads": 2}


def expert_rule(source_end: str):
    from ckpttool.naming import family

    table = family("megatron gpt_oss")
    rule = next(r for r in table.rules if r.source == "decoder.layers.{L}.mlp.experts.experts." + source_end)
    return type(table)(table.name, table.signature, table.converts_to, (rule,))


def megatron_reference(name: str, hub):
    """Megatron-Bridge's GPT-OSS import, as torch ops: transformers' interleaved `gate_up_proj`
    [E, H, 2F] -> [E, 2F, H] = [gate; up] per expert, its bias likewise, `down_proj` transposed."""
    if name == "linear_fc1.weight":
        experts, hidden, both = hub.shape
        return hub.reshape(experts, hidden, both // 2, 2).permute(0, 3, 2, 1).reshape(experts, both, hidden)
    if name == "linear_fc1.bias":
        experts, both = hub.shape
        return hub.reshape(experts, both // 2, 2).transpose(1, 2).reshape(experts, both)
    return hub.transpose(1, 2)


CASES = [("linear_fc1.weight", "model.layers.0.mlp.experts.gate_up_proj", (3, 5, 8)),
         ("linear_fc1.bias", "model.layers.0.mlp.experts.gate_up_proj_bias", (3, 8)),
         ("linear_fc2.weight", "model.layers.0.mlp.experts.down_proj", (3, 4, 5))]


# a bias has no rows to cut inside an expert
@pytest.mark.parametrize("name, hub_key, shape, cuts", [(*case, cuts) for case in CASES
                                                        for cuts in [(), (1,), (1, (1, 2), 2)][:3 if len(case[2]) == 3 else 2]])
def test_the_expert_inverses_are_megatron_bridges_import_on_chunked_sources(tmp_path, name, hub_key, shape, cuts):
    """Source chunks cut between experts ((1,): expert 0 | 1-2) or inside an expert's rows
    ((1, 2): expert 1's rows 0-1 | 2-: a DCP save cut on dim 1) give one target chunk per part."""
    import torch

    from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms
    from ckpttool.dcp.blobs import DataFiles, read_chunk
    from ckpttool.naming.backward import backward
    from ckpttool.naming.engine import converted_checkpoint
    from ckpttool.run import locating

    hub = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    (tmp_path / "w.bin").write_bytes(hub.numpy().tobytes())
    row = hub[0, 0].numel() * 4 if len(shape) == 3 else 0
    expert_bytes = hub[0].numel() * 4
    bounds = [0]  # in bytes: whole experts, or (expert, row) inside one
    for cut in cuts:
        bounds.append(cut[0] * expert_bytes + cut[1] * row if isinstance(cut, tuple) else cut * expert_bytes)
    bounds.append(hub.numel() * 4)
    chunks = []
    for start, stop in zip(bounds, bounds[1:]):
        expert, rest = divmod(start, expert_bytes)
        if rest:  # the rest of one expert's rows
            first = rest // row
            chunks.append(Chunk((expert, first, 0), (1, shape[1] - first, shape[2]),
                                Blob("w.bin", start, stop - start, raw_range_transforms())))
            continue
        if stop % expert_bytes:  # the first rows of one expert
            count = stop % expert_bytes // row
            chunks.append(Chunk((expert, 0, 0), (1, count, shape[2]), Blob("w.bin", start, stop - start,
                                                                             raw_range_transforms())))
            continue
        count = (stop - start) // expert_bytes
        chunks.append(Chunk((expert, *(0,) * (len(shape) - 1)), (count, *shape[1:]),
                            Blob("w.bin", start, stop - start, raw_range_transforms())))
    checkpoint = Checkpoint(tmp_path, "", None, {hub_key: Tensor(hub_key, "float32", shape, tuple(chunks))}, {})
    targets = backward(expert_rule(name), {hub_key: shape}, gpt_oss_config(shape[0]), "test").targets
    key = "decoder.layers.0.mlp.experts.experts." + name
    expected = megatron_reference(name, hub)
    with DataFiles(tmp_path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        tensor = converted_checkpoint(checkpoint, targets, located).tensors[key]
        made = torch.full(tensor.shape, float("nan"))
        for chunk in tensor.chunks:
            box = tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))
            made[box] = torch.frombuffer(bytearray(read_chunk(files, tensor, chunk)),
                                         dtype=torch.float32).reshape(chunk.sizes)
    assert_same_bytes(made, expected.contiguous(), key)
    parts = len(shape) == 3 and any(isinstance(cut, tuple) for cut in cuts)
    assert len(tensor.chunks) == shape[0] + parts  # one per expert, two for the expert cut inside


def test_a_source_chunk_cutting_an_experts_columns_is_refused_naming_it(tmp_path):
    from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms
    from ckpttool.core.errors import UsageError
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.naming.backward import backward
    from ckpttool.naming.engine import converted_checkpoint
    from ckpttool.run import locating

    hub_key, shape = "model.layers.0.mlp.experts.gate_up_proj", (1, 2, 4)
    (tmp_path / "w.bin").write_bytes(bytes(32))
    # a tensor-parallel style cut on the last dim: each chunk holds half of every row
    chunks = tuple(Chunk((0, 0, half * 2), (1, 2, 2), Blob("w.bin", half * 16, 16, raw_range_transforms()))
                   for half in range(2))
    checkpoint = Checkpoint(tmp_path, "", None, {hub_key: Tensor(hub_key, "float32", shape, chunks)}, {})
    targets = backward(expert_rule("linear_fc1.weight"), {hub_key: shape}, gpt_oss_config(1), "test").targets
    with DataFiles(tmp_path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        with pytest.raises(UsageError, match=f"{hub_key} chunk at \\[0, 0, 0\\] cuts the rows of expert 0"):
            converted_checkpoint(checkpoint, targets, located)


def test_a_gate_up_proj_of_odd_width_exits_1_naming_it_with_nothing_written(tmp_path, cli):
    import shutil

    from safetensors.torch import load_file, save_file

    hub = tmp_path / "hub"
    shutil.copytree(HUB, hub)
    tensors = load_file(hub / "model.safetensors")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[key] = tensors[key][..., :-1].contiguous()
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    result = cli("import", hub, tmp_path / "out", "--to", "megatron")
    assert result.exit_code == 1 and key in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_config_whose_expert_count_disagrees_with_the_weights_exits_1_naming_the_key(tmp_path, cli):
    import shutil

    hub = tmp_path / "hub"
    shutil.copytree(HUB, hub)
    config = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    result = cli("import", hub, tmp_path / "out", "--to", "megatron")
    assert result.exit_code == 1 and "model.layers.0.mlp.experts." in result.output, result.output
    assert "num_local_experts=8" in result.output and not (tmp_path / "out").exists()


def test_the_import_loads_with_stock_dcp_at_megatrons_shapes(imports):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target, _ = imports[2]
    metadata = dcp.FileSystemReader(str(target / "iter_0000000")).read_metadata().state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in metadata.items()
             if isinstance(entry, TensorStorageMetadata)}
    saved = dcp.FileSystemReader(str(SAVE)).read_metadata().state_dict_metadata
    assert {key: tuple(entry.size) for key, entry in saved.items() if key in state} == \
        {key: tuple(value.shape) for key, value in state.items()}
    dcp.load(state, checkpoint_id=str(target / "iter_0000000"), no_dist=True)
    assert tuple(state["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape) == (2, 4, 64, 32)


def test_the_fixture_files_are_on_disk():
    assert [str(path) for path in (HUB / "model.safetensors", HUB / "config.json", SAVE / ".metadata")
            if not Path(path).exists()] == []
