"""`ckpttool.open`, `load_state_dict` and `load_into`: any tensor of any checkpoint in memory.

Every tensor of every fixture layout is read through the handle and compared byte for byte
with what `consolidate` wrote for it (`--all` to a .pt: optimizer state too; model-only to
.safetensors: the model keys), and every entry of the framework checkpoints (optimizer state
and objects too) with torch's own read of the same files; slices equal slicing the full
tensor and read only the chunks they meet, replicas once (every read counted); a damaged
checkpoint raises the problem code `validate` reports; a transformers Llama filled by
`load_into` gives `from_pretrained`'s logits; `s3://` through moto's server on loopback,
`storage_options` alone naming it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, assert_same_bytes, flatten, save_with_writer_options

import ckpttool
from ckpttool.core.checkpoint import ChunkTable, with_tables
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CheckpointError, MissingEntry, UsageError

FRAMEWORKS = FIXTURES / "frameworks"
# id -> (what the user points at, model_prefix)
LAYOUTS = {
    "fsdp2_world2": (FIXTURES / "fsdp2_world2", None),
    "fsdp2_world2_adamw": (FIXTURES / "fsdp2_world2_adamw", None),
    "fsdp2_world2_bf16": (FIXTURES / "fsdp2_world2_bf16", None),
    "fsdp2_world3_uneven": (FIXTURES / "fsdp2_world3_uneven", None),
    "dcp_hf_world2": (FIXTURES / "dcp_hf_world2", None),
    "dcp_hf_world2_consolidated": (FIXTURES / "dcp_hf_world2_consolidated", None),
    "llama_world2": (FIXTURES / "llama_world2" / "checkpoint", None),
    "llama_tied_world2": (FIXTURES / "llama_tied_world2" / "checkpoint", None),
    "structures-plain": (FIXTURES / "structures" / "plain", None),
    "structures-recipe": (FIXTURES / "structures" / "recipe", None),
    "structures-two_models": (FIXTURES / "structures" / "two_models", "student"),
    "structures-weights_opt": (FIXTURES / "structures" / "weights_opt", None),
    "torchtitan": (FRAMEWORKS / "torchtitan" / "checkpoint" / "step-20", None),
    "torchtitan-run-dir-hf": (FRAMEWORKS / "torchtitan" / "checkpoint", None),
    "torchtitan_model_only": (FRAMEWORKS / "torchtitan_model_only" / "checkpoint", None),
    "accelerate": (FRAMEWORKS / "accelerate" / "checkpoints" / "checkpoint_0", None),
    "lightning": (FRAMEWORKS / "lightning" / "checkpoints" / "epoch=0-step=2.ckpt", None),
    "composer": (FRAMEWORKS / "composer" / "checkpoints", None),
    "megatron": (FRAMEWORKS / "megatron" / "checkpoints", None),
    "olmo_core": (FRAMEWORKS / "olmo_core" / "run", None),
    "verl": (FRAMEWORKS / "verl" / "checkpoints", None),
    "safetensors-file": (FRAMEWORKS / "accelerate" / "merged" / "model.safetensors", None),
}
# Composer's callback state holds a datetime.timedelta, which torch.load(weights_only=True)
# refuses: `consolidate --all` to .pt cannot decode it, so only the model keys are compared
NO_ALL = {"composer"}


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory):
    """`consolidated(id)` -> ({fqn: value} of `consolidate --all` to .pt, {key: tensor} of
    `consolidate` to .safetensors), each written once per module."""
    import torch
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("consolidated")
    cache = {}

    def get(name: str):
        if name not in cache:
            path, prefix = LAYOUTS[name]
            source = ckpttool.SourceOptions(model_prefix=prefix)
            everything = {}
            if name not in NO_ALL:
                ckpttool.consolidate(path, root / f"{name}.pt", ckpttool.ConvertOptions(everything=True), source=source)
                everything = flatten(torch.load(root / f"{name}.pt", weights_only=True))
            ckpttool.consolidate(path, root / f"{name}.safetensors", source=source)
            cache[name] = everything, load_file(root / f"{name}.safetensors")
        return cache[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_tensor_equals_consolidates_output_bit_for_bit(consolidated, name):
    everything, model = consolidated(name)
    path, prefix = LAYOUTS[name]
    with ckpttool.open(path, model_prefix=prefix) as f:
        assert f.model_keys() and sorted(f.model_keys()) == sorted(model)
        for key, expected in model.items():
            assert_same_bytes(f.get_tensor(key), expected, key)
        if name in NO_ALL:
            return
        tensors = sorted(f.checkpoint.tensors)
        assert set(tensors) <= set(everything)  # the .pt holds every tensor under its fqn
        for fqn in tensors:
            assert f.metadata(fqn).shape == tuple(everything[fqn].shape)
            assert_same_bytes(f.get_tensor(fqn), everything[fqn], fqn)
        for fqn in sorted(f.checkpoint.objects.keys() & everything.keys()):
            assert f.get_object(fqn) == everything[fqn], fqn


# --- framework checkpoints against a reader that is not ckpttool --------------------------------
# Above, `--all` entries are checked against ckpttool's own consolidate. Here every entry of the
# frameworks' checkpoints (optimizer state and objects too) is checked against torch's own
# reading of the files: its DCP reader, or torch.load of verl's per-rank files.


def olmo_core_reader(directory):
    """torch's FileSystemReader for OLMo-core's DCP directory: its `.metadata` names OLMo-core's
    own `_StorageInfo` class (relative_path, offset, length), here unpickled as torch's."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader, filesystem

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"):
                return filesystem._StorageInfo  # its transform_descriptors keeps the default, None
            return super().find_class(module, name)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with (directory / ".metadata").open("rb") as stream:
                metadata = Unpickler(stream).load()
            metadata.storage_meta = metadata.storage_meta or filesystem.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(directory)


@pytest.fixture(scope="module")
def torch_read(tmp_path_factory):
    """`torch_read(name)` -> {fqn as ckpttool names it: tensor or object}: every entry of a
    framework's checkpoint as torch itself loads it (`dcp_to_torch_save`, or its
    `_load_state_dict` with the empty-state-dict planner; `torch.load` for verl), once per module."""
    import torch
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    root = tmp_path_factory.mktemp("torch_read")
    cache = {}

    def get(name: str) -> dict:
        if name in cache:
            return cache[name]
        if name == "olmo_core":
            state: dict = {}
            directory = FRAMEWORKS / "olmo_core" / "run" / "step2" / "model_and_optim"
            _load_state_dict(state, storage_reader=olmo_core_reader(directory),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            cache[name] = flatten(state)
        elif name == "torchtitan":
            dcp_to_torch_save(LAYOUTS[name][0], root / f"{name}.pt")
            cache[name] = flatten(torch.load(root / f"{name}.pt", weights_only=True))
        elif name == "megatron":  # decoder.layers.* are stored stacked: layer L is row L
            dcp_to_torch_save(FRAMEWORKS / "megatron" / "checkpoints" / "iter_0000002", root / f"{name}.pt")
            entries = {}
            for key, value in flatten(torch.load(root / f"{name}.pt", weights_only=True)).items():
                if not isinstance(value, torch.Tensor):
                    entries[key] = value  # the TransformerEngine `_extra_state` objects keep their names
                elif key.startswith("decoder.layers."):
                    entries.update({f"model.decoder.layers.{layer}.{key.removeprefix('decoder.layers.')}": row
                                    for layer, row in enumerate(value)})
                else:
                    entries[f"model.{key}"] = value
            cache[name] = entries
        elif name == "verl":  # verl's per-rank torch.save files: DTensor shards, joined along their Shard dim
            actor = FRAMEWORKS / "verl" / "checkpoints" / "global_step_2" / "actor"
            ranks = [torch.load(actor / f"model_world_size_2_rank_{rank}.pt", weights_only=False)  # verl's pickles
                     for rank in range(2)]
            entries = {}
            for key, value in ranks[0].items():
                (placement,) = value.placements
                assert placement.is_shard(), key
                entries[key] = torch.cat([rank[key]._local_tensor for rank in ranks], dim=placement.dim)
            cache[name] = entries
        return cache[name]

    return get


# what each framework keeps beside its model, all of it compared below (verl: its optimizer
# shards are separate files ckpttool does not read as entries; every entry is the model's)
BESIDE_THE_MODEL = {"olmo_core": ("optim.state.", "optim.param_groups."), "torchtitan": (
    "optimizer.state.", "optimizer.param_groups.", "lr_scheduler.", "dataloader.", "train_state."),
    "megatron": ("decoder.layers.",), "verl": ()}  # megatron: TransformerEngine's `_extra_state` objects


@pytest.mark.parametrize("name", sorted(BESIDE_THE_MODEL))
def test_every_entry_of_a_framework_checkpoint_equals_torchs_own_read(torch_read, consolidated, name):
    """Model, optimizer state and objects: `open()` and `consolidate --all` give what torch
    itself loads from the same files."""
    import torch

    expected = torch_read(name)
    everything, _ = consolidated(name)
    path, prefix = LAYOUTS[name]
    with ckpttool.open(path, model_prefix=prefix) as f:
        assert f.keys() == sorted(expected)
        assert sorted(everything) == sorted(expected)
        for kind in BESIDE_THE_MODEL[name]:
            assert any(fqn.startswith(kind) for fqn in expected), kind
        for fqn, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert_same_bytes(f.get_tensor(fqn), dense(value), fqn)
                assert_same_bytes(everything[fqn], dense(value), fqn)
            else:
                assert type(f.get_object(fqn)) is type(value) and f.get_object(fqn) == value, fqn
                assert type(everything[fqn]) is type(value) and everything[fqn] == value, fqn


def test_a_torch_save_file_reads_as_saved(tmp_path):
    import torch

    state = {"w": torch.arange(12, dtype=torch.float16).reshape(3, 4), "scale": torch.tensor(7), "b": torch.ones(2).bool()}
    torch.save(state, tmp_path / "model.pt")
    with ckpttool.open(tmp_path / "model.pt") as f:
        assert sorted(f.model_keys()) == sorted(state)
        for key, value in state.items():
            assert_same_bytes(f.get_tensor(key), value, key)


def test_the_same_tensor_through_a_chunk_table_and_tuples(consolidated):
    everything, _ = consolidated("fsdp2_world3_uneven")
    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        f.checkpoint = with_tables(f.checkpoint)
        assert any(isinstance(t.chunks, ChunkTable) for t in f.checkpoint.tensors.values())
        for fqn in f.checkpoint.tensors:
            assert_same_bytes(f.get_tensor(fqn), everything[fqn], fqn)
            rows = f.metadata(fqn).shape[0] if f.metadata(fqn).shape else 0
            if rows > 2:
                assert_same_bytes(f.get_slice(fqn)[1:rows - 1], everything[fqn][1:rows - 1], fqn)


@pytest.mark.parametrize("small", [1 << 20, 0], ids=["batched", "one-task-per-operation"])
def test_reads_on_the_thread_pool_give_the_same_bytes(consolidated, monkeypatch, small):
    import torch

    from ckpttool import load
    from ckpttool.run import execute

    monkeypatch.setattr(load, "INLINE_BYTES", 0)  # fixture tensors are small: every read would run inline
    monkeypatch.setattr(execute, "SMALL_OPERATION", small)
    for name in ("fsdp2_world3_uneven", "megatron"):
        everything, _ = consolidated(name)
        with ckpttool.open(LAYOUTS[name][0], threads=3, max_memory=4096) as f:
            for fqn in f.checkpoint.tensors:
                expected = everything[fqn]
                assert_same_bytes(f.get_tensor(fqn), expected, fqn)
                cast = torch.float16 if expected.is_floating_point() else expected.dtype  # ints keep theirs
                assert_same_bytes(f.get_tensor(fqn, dtype="float16"), expected.to(cast), fqn)
                if expected.dim() and expected.shape[0] > 3:
                    assert_same_bytes(f.get_slice(fqn)[1:-1], dense(expected[1:-1]), fqn)


@pytest.mark.parametrize("writer_options", ["safetensors", "zstd"])
def test_safetensors_format_and_zstd_blobs_read_as_saved(writer_options, tmp_path):
    import torch

    state = save_with_writer_options(tmp_path / "ckpt", writer_options)  # zstd: Gather without a raw source
    with ckpttool.open(tmp_path / "ckpt") as f:
        assert sorted(f.model_keys()) == ["b", "i", "s", "w"]
        for key, value in state["model"].items():
            assert_same_bytes(f.get_tensor(key), value, key)
            if value.dim():
                assert_same_bytes(f.get_slice(key)[1:3], value[1:3], key)
        assert_same_bytes(f.get_slice("w")[2:6, 1:4], dense(state["model"]["w"][2:6, 1:4]))
        assert_same_bytes(f.get_tensor("w", dtype="bfloat16"), state["model"]["w"].to(torch.bfloat16))
        assert f.get_object("extra.step") == 3


def test_dtype_casts_floating_tensors_as_consolidate_dtype_does(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    path = LAYOUTS["fsdp2_world3_uneven"][0]
    ckpttool.consolidate(path, tmp_path / "bf16.safetensors", ckpttool.ConvertOptions(dtype="bf16"))
    expected = load_file(tmp_path / "bf16.safetensors")
    import torch

    with ckpttool.open(path) as f:
        for key in f.model_keys():
            assert_same_bytes(f.get_tensor(key, dtype=torch.bfloat16), expected[key], key)  # ints keep theirs
    state = ckpttool.load_state_dict(path, dtype="bf16")
    monkeypatch.syspath_prepend(str(FIXTURES))
    from generate import TinyModel  # the model the fixture was saved from

    assert list(state) == list(TinyModel().state_dict())  # its keys, in its own order
    for key, value in expected.items():
        assert_same_bytes(state[key], value, key)


def test_numpy_framework_gives_the_same_bytes_and_refuses_dtypes_numpy_lacks():
    import numpy as np

    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as pt, ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0],
                                                                               framework="np") as f:
        for fqn in pt.checkpoint.tensors:
            array, tensor = f.get_tensor(fqn), pt.get_tensor(fqn)
            assert isinstance(array, np.ndarray) and array.dtype == tensor.numpy().dtype
            assert array.shape == tuple(tensor.shape) and array.tobytes() == tensor.numpy().tobytes()
        key = pt.model_keys()[2]
        assert np.array_equal(f.get_slice(key)[2:5, ::3], pt.get_tensor(key)[2:5, ::3].numpy())
    with ckpttool.open(LAYOUTS["fsdp2_world2_bf16"][0], framework="np") as f:
        key = next(k for k in f.model_keys() if f.metadata(k).dtype == "bfloat16")
        with pytest.raises(UsageError, match="numpy has no bfloat16"):
            f.get_tensor(key)
        assert f.get_tensor(key, dtype="float32").dtype == np.float32


def test_numpy_reads_of_raw_chunks_never_import_torch():
    code = (
        "import sys, ckpttool\n"
        f"f = ckpttool.open({str(LAYOUTS['fsdp2_world3_uneven'][0])!r}, framework='np')\n"
        "print(f.get_tensor('embed.weight').shape, f.get_slice('embed.weight')[3:9].shape)\n"
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["(13, 8) (6, 8)", "False"]


def test_read_into_fills_a_given_tensor_or_array_in_place():
    import numpy as np
    import torch

    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        expected = f.get_tensor("layers.0.fc1.weight")
        out = torch.zeros(20, 8)
        address = out.data_ptr()
        f.read_into("layers.0.fc1.weight", out)
        assert out.data_ptr() == address
        assert_same_bytes(out, expected)
        array = np.zeros((20, 8), dtype=np.float16)
        f.read_into("layers.0.fc1.weight", array)  # cast to the array's floating dtype
        assert array.tobytes() == expected.to(torch.float16).numpy().tobytes()
        with pytest.raises(UsageError, match=r"has shape \[20, 8\], the destination \[8, 20\]"):
            f.read_into("layers.0.fc1.weight", torch.zeros(8, 20))
        with pytest.raises(UsageError, match="is int64, the destination float32"):
            f.read_into("position_ids", torch.zeros(5))
    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0], framework="np") as f:
        assert f.get_tensor("embed.weight", dtype=np.float16).dtype == np.float16


INDICES = [
    slice(None), slice(2, 5), slice(-3, None), slice(1, 9, 3), 0, -1, (slice(None), 1), (Ellipsis, slice(2, 4)),
    (slice(3, 3),), (slice(None, None, 2), Ellipsis), (4, slice(1, None, 5)),
]


@pytest.mark.parametrize("name", ["fsdp2_world3_uneven", "megatron", "fsdp2_world2_bf16", "dcp_hf_world2"])
def test_get_slice_equals_slicing_the_full_tensor(name):
    path, prefix = LAYOUTS[name]
    with ckpttool.open(path, model_prefix=prefix) as f:
        checked = 0
        for fqn in f.checkpoint.tensors:
            full, sliced = f.get_tensor(fqn), f.get_slice(fqn)
            assert sliced.get_shape() == list(full.shape) and sliced.get_dtype() == str(full.dtype).removeprefix("torch.")
            if not full.dim():
                assert_same_bytes(sliced[...], full[...], fqn)
                continue
            for index in INDICES:
                try:
                    expected = full[index]
                except IndexError:
                    with pytest.raises(IndexError):
                        sliced[index]
                    continue
                assert_same_bytes(sliced[index], dense(expected), f"{fqn}[{index}]")
                checked += 1
        assert checked > 20


def dense(tensor):
    """A copy with row-major strides (a one-element view of a step keeps its step's stride)."""
    import torch

    return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)


class CountedReads:
    """Every byte range read from the data files (record headers and data alike)."""

    def __init__(self, monkeypatch):
        self.ranges: list[tuple[str, int, int]] = []
        for name in ("read", "read_into"):
            original = getattr(DataFiles, name)

            def counted(files, relative, offset, third, original=original):
                length = third if isinstance(third, int) else len(third)
                self.ranges.append((relative, offset, offset + length))
                return original(files, relative, offset, third)

            monkeypatch.setattr(DataFiles, name, counted)

    def chunks_touched(self, tensor) -> set[int]:
        touched = set()
        for relative, start, end in self.ranges:
            owners = [i for i, chunk in enumerate(tensor.chunks) if chunk.blob.file == relative
                      and chunk.blob.offset <= start and end <= chunk.blob.offset + chunk.blob.length]
            assert owners, f"read {relative} {start}..{end} is outside every chunk of {tensor.fqn}"
            touched.update(owners)
        return touched


@pytest.mark.parametrize("tables", [False, True], ids=["tuples", "chunk-table"])
def test_get_slice_reads_only_the_chunks_it_meets(monkeypatch, tables):
    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        if tables:
            f.checkpoint = with_tables(f.checkpoint)
        tensor = f.metadata("layers.0.fc1.weight")  # (20, 8) on 3 ranks: rows 0..7, 7..14, 14..20
        assert [chunk.offsets[0] for chunk in tensor.chunks] == [0, 7, 14]
        full = f.get_tensor("layers.0.fc1.weight")
        f._located.clear()
        counted = CountedReads(monkeypatch)
        for index, chunks in [((slice(8, 12),), {1}), ((slice(6, 8), 3), {0, 1}), ((19,), {2}), ((slice(5, 5),), set())]:
            counted.ranges.clear()
            assert_same_bytes(f.get_slice("layers.0.fc1.weight")[index], dense(full[index]), str(index))
            assert counted.chunks_touched(tensor) == chunks, index


def test_a_slice_of_a_gathered_chunk_scatters_many_short_runs(monkeypatch):
    from ckpttool import load

    monkeypatch.setattr(load, "MANY_RUNS", 2)  # so a (20, 8) chunk counts as many short rows
    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        full = f.get_tensor("layers.0.fc2.weight")  # (8, 20)
        assert_same_bytes(f.get_slice("layers.0.fc2.weight")[:, 2:19], dense(full[:, 2:19]))


def test_keys_objects_and_unknown_names():
    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        assert f.keys() == sorted(f.checkpoint.tensors.keys() | f.checkpoint.objects.keys())
        assert "model.embed.weight" in f and "embed.weight" in f and "nonsense" not in f
        assert f.metadata("embed.weight") == f.checkpoint.tensors["model.embed.weight"]
        assert f.get_object("extra.step") == 2 and f.get_object("extra.note") == "fixture"
        with pytest.raises(MissingEntry, match="no entry named 'nonsense'") as raised:
            f.get_tensor("nonsense")
        assert isinstance(raised.value, KeyError) and raised.value.code == "no-such-entry"
        with pytest.raises(UsageError, match="python object"):
            f.get_tensor("extra.step")
        with pytest.raises(UsageError, match="steps must be positive"):
            f.get_slice("embed.weight")[::-1]
    with pytest.raises(UsageError, match="closed"):
        f.get_tensor("embed.weight")


def test_an_ambiguous_model_needs_model_prefix():
    from ckpttool.model.model_view import AmbiguousModel

    with ckpttool.open(LAYOUTS["structures-two_models"][0]) as f:
        first = next(iter(f.checkpoint.tensors))
        assert tuple(f.get_tensor(first).shape) == f.metadata(first).shape  # stored names still read
        with pytest.raises(AmbiguousModel):
            f.model_keys()


def damaged_cases():
    import test_validate

    return {name: case for name, case in test_validate.CORRUPTIONS.items() if not case[2]}


@pytest.mark.parametrize("name", sorted(damaged_cases()))
def test_a_damaged_checkpoint_raises_the_code_validate_reports(tmp_path, name):
    import test_validate

    corrupt, code, _ = damaged_cases()[name]
    path = test_validate.copy_fixture(tmp_path)
    corrupt(path)
    report = ckpttool.validate(path)
    errors = [p for p in report.problems if p.severity == "error"]
    assert errors and errors[0].code == code
    with pytest.raises(CheckpointError) as raised:
        ckpttool.open(path)
    assert raised.value.code == code, str(raised.value)
    assert "\n" not in str(raised.value)


# --- whole models ----------------------------------------------------------------------------

LLAMA = FIXTURES / "llama_world2"
INPUT_IDS = [[1, 5, 9, 2, 33, 63, 0, 17], [40, 3, 3, 8, 21, 60, 11, 4]]  # fixtures/generate_llama.py


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.parametrize("fixture", [LLAMA, FIXTURES / "llama_tied_world2"], ids=["untied", "tied"])
def test_load_into_a_llama_gives_from_pretraineds_logits_exactly(transformers, tmp_path, fixture):
    import torch

    ckpttool.export(fixture / "checkpoint", tmp_path / "hf", fixture / "config")
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = transformers.AutoConfig.from_pretrained(fixture / "config")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert ckpttool.load_into(model, fixture / "checkpoint") == ([], [])
    for key, value in pretrained.state_dict().items():
        assert_same_bytes(model.state_dict()[key], value, key)
    with torch.no_grad():
        ids = torch.tensor(INPUT_IDS)
        assert_same_bytes(model(input_ids=ids).logits, pretrained(input_ids=ids).logits, "logits")


def test_load_state_dict_is_the_live_models_state_dict():
    from safetensors.torch import load_file

    reference = load_file(LLAMA / "reference.safetensors")
    state = ckpttool.load_state_dict(LLAMA / "checkpoint")
    assert sorted(state) == sorted(reference)
    for key, value in reference.items():
        assert_same_bytes(state[key], value, key)
    some = ckpttool.load_state_dict(LLAMA / "checkpoint", keys=["lm_head.weight"])
    assert list(some) == ["lm_head.weight"]
    with pytest.raises(MissingEntry, match="no model entry named 'nope'"):
        ckpttool.load_state_dict(LLAMA / "checkpoint", keys=["nope"])
    everything = ckpttool.load_state_dict(FIXTURES / "fsdp2_world2_adamw", model_only=False)
    assert any(key.startswith("optim.") for key in everything) and "model.embed.weight" in everything


def test_load_into_refuses_a_module_that_does_not_match_before_reading():
    import torch

    module = torch.nn.Linear(8, 20)
    with pytest.raises(UsageError, match="does not match the module: missing weight, bias"):
        ckpttool.load_into(module, FIXTURES / "fsdp2_world3_uneven")
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(13, 8)
    model.head = torch.nn.Linear(8, 3, bias=False)  # stored (2, 8)
    with pytest.raises(UsageError, match=r"model.head.weight has shape \[2, 8\], the module's head.weight \[3, 8\]"):
        ckpttool.load_into(model, FIXTURES / "fsdp2_world3_uneven", strict=False)


def test_load_into_casts_to_the_modules_dtype_in_place():
    import torch

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(13, 8, dtype=torch.bfloat16)
    weight = model.embed.weight
    missing, unexpected = ckpttool.load_into(model, FIXTURES / "fsdp2_world3_uneven", strict=False)
    assert missing == [] and "embed.weight" not in unexpected and len(unexpected) > 5
    assert model.embed.weight is weight  # filled where it lies
    expected = ckpttool.load_state_dict(FIXTURES / "fsdp2_world3_uneven", keys=["embed.weight"])["embed.weight"]
    assert_same_bytes(weight.detach(), expected.to(torch.bfloat16))


# --- object storage --------------------------------------------------------------------------

try:  # moto's S3 server on loopback with the fixture uploaded (tests/test_remote.py's fixture)
    from test_remote import s3  # noqa: F401
except pytest.skip.Exception:  # s3fs or moto missing: only these tests skip, not the module
    @pytest.fixture
    def s3():
        pytest.skip("the s3:// tests need s3fs and moto")


def test_s3_reads_the_same_bytes_by_ranged_gets(s3):
    local = FIXTURES / "fsdp2_world2"
    with ckpttool.open(local) as expected, ckpttool.open("s3://ckpts/src") as f:
        assert f.keys() == expected.keys() and f.model_keys() == expected.model_keys()
        for fqn in expected.checkpoint.tensors:
            assert_same_bytes(f.get_tensor(fqn), expected.get_tensor(fqn), fqn)
            rows = expected.metadata(fqn).shape[0] if expected.metadata(fqn).shape else 0
            if rows > 3:
                assert_same_bytes(f.get_slice(fqn)[1:3], expected.get_tensor(fqn)[1:3], fqn)
        for fqn in expected.checkpoint.objects:
            assert f.get_object(fqn) == expected.get_object(fqn)
        assert f._files.requests > 0
    state = ckpttool.load_state_dict("s3://ckpts/hub")
    with ckpttool.open(FIXTURES / "dcp_hf_world2_consolidated") as hub:
        for key in hub.model_keys():
            assert_same_bytes(state[key], hub.get_tensor(key), key)


def test_s3_slice_gets_only_from_the_file_of_the_chunk_it_meets(s3):
    with ckpttool.open(FIXTURES / "fsdp2_world2") as local, ckpttool.open("s3://ckpts/src") as f:
        rows = f.get_slice("embed.weight")[8:11]  # rows 7..13 are rank 1's chunk
        assert_same_bytes(rows, local.get_tensor("embed.weight")[8:11])
        assert set(f._files._readers) == {"__1_0.distcp"} and 0 < f._files.requests <= 3


def test_s3_damaged_checkpoint_raises_validates_code(s3, tmp_path):
    path = tmp_path / "damaged"
    shutil.copytree(FIXTURES / "fsdp2_world2", path)
    data = path / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    for item in sorted(path.iterdir()):
        s3.put_file(str(item), f"ckpts/damaged/{item.name}")
    code = next(p.code for p in ckpttool.validate("s3://ckpts/damaged").problems if p.severity == "error")
    with pytest.raises(CheckpointError) as raised:
        ckpttool.open("s3://ckpts/damaged")
    assert raised.value.code == code == "beyond-eof"


def test_storage_options_reach_the_reads(s3, monkeypatch):
    """The server is named by `storage_options` alone: the environment no longer points at it
    (the fixture's AWS_ENDPOINT_URL is removed), so an `open()` that dropped the options would
    send its listing and GETs to AWS itself. Every GET goes to the given endpoint."""
    import os

    from ckpttool.store import s3 as native

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    urls = []
    real_open = native.S3Client._open

    def logged(client, method, bucket, key, query=None, headers=None):
        urls.append(client.url(bucket, key) if key else client.url(bucket))
        return real_open(client, method, bucket, key, query, headers)

    monkeypatch.setattr(native.S3Client, "_open", logged)
    with ckpttool.open(FIXTURES / "fsdp2_world2") as local, \
            ckpttool.open("s3://ckpts/src", storage_options={"endpoint_url": endpoint}) as f:
        for fqn in local.checkpoint.tensors:
            assert_same_bytes(f.get_tensor(fqn), local.get_tensor(fqn), fqn)
        assert f._files.requests > 0
    assert any(url.endswith(".distcp") for url in urls), urls  # the data files were read through the options
    assert urls and all(url.startswith(endpoint + "/") for url in urls), urls


def test_replicated_chunks_are_read_once_and_device_moves_the_result(monkeypatch):
    """Every box of (20, 8) stored twice (as HSDP stores it): the whole tensor and a slice
    read each box they need exactly once, counted read by read."""
    import collections
    import dataclasses

    with ckpttool.open(LAYOUTS["fsdp2_world3_uneven"][0]) as f:
        full = f.get_tensor("layers.0.fc1.weight")
        tensor = f.metadata("layers.0.fc1.weight")
        twice = tuple(sorted(tensor.chunks + tensor.chunks, key=lambda chunk: chunk.offsets))  # HSDP: every box twice
        tensors = {**f.checkpoint.tensors, tensor.fqn: dataclasses.replace(tensor, chunks=twice)}
        f.checkpoint = dataclasses.replace(f.checkpoint, tensors=tensors)
        f._located.clear()
        assert_same_bytes(f.get_tensor(tensor.fqn), full)  # locates every chunk (record headers read here)
        counted = CountedReads(monkeypatch)

        def reads_per_box() -> collections.Counter:
            boxes = collections.Counter()
            for relative, start, end in counted.ranges:  # each read lies in one box (its replicas share a blob)
                owners = {chunk.offsets for chunk in twice if chunk.blob.file == relative
                          and chunk.blob.offset <= start and end <= chunk.blob.offset + chunk.blob.length}
                assert len(owners) == 1, (relative, start, end, owners)
                boxes.update(owners)
            counted.ranges.clear()
            return boxes

        assert_same_bytes(f.get_tensor(tensor.fqn), full)
        assert reads_per_box() == {(0, 0): 1, (7, 0): 1, (14, 0): 1}
        assert_same_bytes(f.get_slice(tensor.fqn)[6:9], full[6:9])
        assert reads_per_box() == {(0, 0): 1, (7, 0): 1}
        assert f.get_tensor(tensor.fqn, device="meta").device.type == "meta"
