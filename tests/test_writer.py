"""The writer's pickles are torch's, byte for byte, and writing them never imports torch.

`dcp/writer.py` writes `data.pkl`, the serialization id and `.metadata` from stand-ins, without
torch. The reference implementations here build the same bytes the direct way, with torch's
own classes (they are what writer.py did before it stopped importing torch), and every test
compares bytes exactly.
"""

from __future__ import annotations

import io
import pickle
import random
import shutil
import string
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path, PurePosixPath

import pytest
import torch

from conftest import FIXTURES, ROOT

import ckpttool.commands.reshard as reshard_command
from ckpttool import dtypes
from ckpttool.commands.reshard import reshard
from ckpttool.dcp import writer
from ckpttool.dcp.blobs import contiguous_strides
from ckpttool.dcp.metadata import read_checkpoint
from ckpttool.dcp.writer import StoredChunk, StoredObject, StoredTensor, metadata_bytes, tensor_pickle

TORCH_DTYPES = [name for name in dtypes.ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)]
SHAPES = [(5, 8), (0, 8), (), (3,), (2, 0), (1, 2, 3, 4)]
RESHARD_FIXTURES = ("fsdp2_world3_uneven", "fsdp2_world2_adamw")


# ---------------------------------------------------------------------------------------------
# Reference implementations: the same pickles made with torch's own objects


class _Storage:
    """Stands for the tensor's storage while pickling; becomes torch's persistent id."""

    def __init__(self, storage_class: object, numel: int):
        self.storage_class = storage_class
        self.numel = numel


class _Rebuild:
    def __init__(self, function: object, args: tuple):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: object):
        if isinstance(obj, _Storage):
            # torch/serialization.py `_save.persistent_id`
            return ("storage", obj.storage_class, "0", "cpu", obj.numel)
        return None


def torch_tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """Return `data.pkl` for a contiguous tensor, pickled from torch's own rebuild functions,
    storage classes and dtypes."""
    torch_dtype = getattr(torch, dtype)
    stride = contiguous_strides(shape)
    numel = 1
    for size in shape:
        numel *= size
    hooks = OrderedDict()
    if torch_dtype in torch.storage._new_dtypes():
        storage = _Storage(torch.UntypedStorage, numel * dtypes.ITEMSIZE[dtype])
        args = (storage, 0, tuple(shape), stride, False, hooks, torch_dtype)
        rebuild = _Rebuild(torch._utils._rebuild_tensor_v3, args)
    else:
        storage_class = getattr(torch, torch.storage._dtype_to_storage_type_map()[torch_dtype])
        args = (_Storage(storage_class, numel), 0, tuple(shape), stride, False, hooks)
        rebuild = _Rebuild(torch._utils._rebuild_tensor_v2, args)
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=writer.PICKLE_PROTOCOL).dump(rebuild)
    return buffer.getvalue()


def torch_metadata_bytes(tensors, objects, planner_data, checkpoint_id, save_id) -> bytes:
    """Return `.metadata` as `pickle.dumps` of torch's own `Metadata` dataclasses."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata: dict = {}
    storage_data: dict = {}
    for tensor in tensors:
        chunks = []
        for index, chunk in enumerate(tensor.chunks):
            chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
            key = MetadataIndex(tensor.fqn, chunk.offsets, index)
            storage_data[key] = _StorageInfo(chunk.file, chunk.offset, chunk.length)
        properties = TensorProperties(dtype=getattr(torch, tensor.dtype))
        state_dict_metadata[tensor.fqn] = TensorStorageMetadata(properties, torch.Size(tensor.shape), chunks)
    for obj in objects:
        state_dict_metadata[obj.fqn] = BytesStorageMetadata()
        storage_data[MetadataIndex(obj.fqn)] = _StorageInfo(obj.file, obj.offset, obj.length, list(obj.transforms) or None)
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=dict(planner_data),
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )
    return pickle.dumps(metadata)


def torch_save_serialization_id(value: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return zipfile.ZipFile(buffer).read(f"{writer.RECORD_ARCHIVE}/.data/serialization_id")


def first_difference(ours: bytes, theirs: bytes) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"{len(ours)} vs {len(theirs)} bytes, first difference at byte {at}"


# ---------------------------------------------------------------------------------------------
# The pickler on plain data: what CPython's C pickler writes


def plain_data() -> dict:
    shared_name, shared_tuple, shared_list = "shared", ("a", 1), [1, 2]
    return {
        "ints": [0, 1, 255, 256, 65535, 65536, -1, -128, -129, -2**31, 2**31 - 1, 2**31, -2**31 - 1,
                 2**63, -2**63, -2**63 - 1, 2**64, 2**2100, -2**2100, -(2**2047)],
        "atoms": (None, True, False),
        "strings": ["", "x", "é", "\ud800", "y" * 255, "y" * 256, "z" * 70000],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((),), ((1,), (2, (3,)))],
        "shared": [shared_name, shared_name, shared_tuple, shared_tuple, shared_list, shared_list],
        "batches": {"list": list(range(2500)), "dict 1000": {str(i): i for i in range(1000)},
                    "dict 1001": {str(i): i for i in range(1001)}, "one": {"k": [1]}, "empty": [{}, []]},
    }


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_data_is_pickled_as_cpythons_pickler_does(protocol):
    data = plain_data()
    assert writer._Pickler(protocol).dump(data) == pickle.dumps(data, protocol=protocol)


# ---------------------------------------------------------------------------------------------
# data.pkl


def test_storage_class_table_agrees_with_torch_for_every_dtype_ckpttool_knows():
    new_dtypes = torch.storage._new_dtypes()
    legacy = torch.storage._dtype_to_storage_type_map()
    for name in TORCH_DTYPES:
        torch_dtype = getattr(torch, name)
        assert (name in writer.NEW_DTYPES) == (torch_dtype in new_dtypes), name
        assert writer.LEGACY_STORAGE_CLASS.get(name) == legacy.get(torch_dtype), name
    assert writer.NEW_DTYPES == {str(d).removeprefix("torch.") for d in new_dtypes}
    for name in dtypes.ITEMSIZE:
        assert (name in writer.NEW_DTYPES) != (name in writer.LEGACY_STORAGE_CLASS), f"{name}: in neither or both tables"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_tensor_pickle_is_byte_identical_to_torchs(dtype, shape):
    assert tensor_pickle(dtype, shape) == torch_tensor_pickle(dtype, shape)


@pytest.mark.parametrize("shape", [(70000,), (3,) * 10, (2**31,), (2**40, 3)])
def test_tensor_pickle_of_long_and_many_dimensional_shapes_is_torchs(shape):
    for dtype in ("float32", "uint16"):
        assert tensor_pickle(dtype, shape) == torch_tensor_pickle(dtype, shape)


# ---------------------------------------------------------------------------------------------
# The serialization id


def test_record_name_hash_is_what_torch_save_writes():
    expected = torch_save_serialization_id(torch.zeros(0))[:20]
    assert writer._record_name_hash() == expected
    assert writer._record_name_hash_from_torch() == expected  # the fallback off Linux


def test_records_name_hash_half_of_the_serialization_id_is_the_same_for_every_shape_and_dtype():
    expected = writer._record_name_hash()
    for value in (torch.ones(3, 5, dtype=torch.bfloat16), torch.ones((), dtype=torch.uint16)):
        assert torch_save_serialization_id(value)[:20] == expected


def test_record_names_iterate_in_reverse_insertion_order_each_in_its_own_bucket():
    assert writer._unordered_set_order(writer._RECORD_NAMES) == list(reversed(writer._RECORD_NAMES))
    with pytest.raises(ValueError):
        writer._unordered_set_order([str(i) for i in range(14)])


UNORDERED_SET_PROGRAM = """
#include <iostream>
#include <string>
#include <unordered_set>
int main(int argc, char** argv) {
  std::unordered_set<std::string> names;
  for (int i = 1; i < argc; ++i) names.insert(argv[i]);
  for (const auto& name : names) std::cout << name << " " << std::hash<std::string>{}(name) << "\\n";
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ and libstdc++")
def test_std_hash_and_unordered_set_order_match_libstdcxx_including_shared_buckets(tmp_path):
    source = tmp_path / "unordered_set.cpp"
    source.write_text(UNORDERED_SET_PROGRAM)
    subprocess.run(["g++", "-o", str(tmp_path / "unordered_set"), str(source)], check=True, timeout=120)
    generator = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "./_"
    for _ in range(100):
        names = list(dict.fromkeys(
            "".join(generator.choices(alphabet, k=generator.randint(1, 30))) for _ in range(generator.randint(1, 13))
        ))
        output = subprocess.run([str(tmp_path / "unordered_set"), *names], capture_output=True, text=True, check=True)
        lines = [line.split(" ") for line in output.stdout.splitlines()]
        assert [name for name, _ in lines] == writer._unordered_set_order(names)
        assert all(writer._std_hash(name.encode()) == int(value) for name, value in lines)


# ---------------------------------------------------------------------------------------------
# .metadata


def test_dcp_version_constant_is_the_installed_torchs():
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    assert writer.DCP_VERSION == CURRENT_DCP_VERSION


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("name", RESHARD_FIXTURES)
def test_resharded_metadata_is_byte_identical_to_pickled_torch_metadata(tmp_path, monkeypatch, name, world_size):
    calls = []

    def recording_metadata_bytes(*args):
        calls.append(args)
        return metadata_bytes(*args)

    monkeypatch.setattr(reshard_command, "metadata_bytes", recording_metadata_bytes)
    reshard(FIXTURES / name, tmp_path / "out", world_size)
    (tensors, objects, planner_data, checkpoint_id, save_id), = calls
    written = (tmp_path / "out" / ".metadata").read_bytes()
    expected = torch_metadata_bytes(tensors, objects, planner_data, checkpoint_id, save_id)
    assert written == expected, first_difference(written, expected)


def many_entries(tensor_count: int, chunk_count: int, object_count: int, fqn_length: int = 12, big: bool = False):
    """Return (tensors, objects, planner_data) with every dtype and files shared across chunks."""
    files = [writer.data_file_name(rank) for rank in range(4)]
    step = 2**33 + 7 if big else 4096
    tensors, planner_data = [], {}
    for t in range(tensor_count):
        fqn = f"model.layers.{t}." + "w" * fqn_length
        chunks = tuple(
            StoredChunk((3 * c, 0), (3, 7), files[(t + c) % len(files)], (t * chunk_count + c) * step, step - 1)
            for c in range(chunk_count)
        )
        tensors.append(StoredTensor(fqn, TORCH_DTYPES[t % len(TORCH_DTYPES)], (3 * chunk_count, 7), chunks))
        planner_data[fqn] = tuple(fqn.split("."))
    objects = []
    for o in range(object_count):
        fqn = f"optim.param_groups.{o}.lr"
        objects.append(StoredObject(fqn, files[o % len(files)], o * 10, 10))
        planner_data[fqn] = ("optim", "param_groups", o, "lr")
    return tensors, objects, planner_data


METADATA_CASES = {
    # pickle batches dict items and list items 1000 at a time, and a dict of exactly 1000
    # ends with an empty batch
    "1000 entries": many_entries(1000, 1, 0),
    "1001 entries": many_entries(999, 1, 2),
    "2000 entries": many_entries(1000, 1, 1000),
    "1000 chunks": many_entries(1, 1000, 0),
    "2001 chunks": many_entries(2, 2001, 1),
    # names of 64 KiB and more go between frames
    "long names": many_entries(3, 2, 1, fqn_length=70000),
    "names just under a frame": many_entries(3, 1, 0, fqn_length=65536 - 24),
    # between two long names only MEMOIZE: a frame too short for a FRAME header
    "consecutive long names": ([], [StoredObject("o", "__0_0.distcp", 0, 1)], {"o": ("x" * 70000, "y" * 70000)}),
    "offsets past 2**32": many_entries(5, 5, 5, big=True),
    "nothing": ([], [], {}),
    "one object": ([], [StoredObject("step", "__0_0.distcp", 0, 1)], {"step": ("step",)}),
    "zstd-compressed objects": ([], [StoredObject("a", "__0_0.distcp", 0, 9, ("stream.zstd/1",)),
                                     StoredObject("b", "__0_0.distcp", 9, 9, ("stream.zstd/1",))], {"a": ("a",), "b": ("b",)}),
    "a tensor without chunks": ([StoredTensor("t", "float32", (0,), ())], [], {}),
    "0-d tensors": ([StoredTensor(f"t{i}", "bfloat16", (), (StoredChunk((), (), "__0_0.distcp", 64 * i, 64),)) for i in range(3)], [], {}),
}


@pytest.mark.parametrize("checkpoint_id", [Path("/ckpt/step-10-world3"), Path("relative/out"), PurePosixPath("/a"), "ckpt", None])
@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_is_byte_identical_to_pickled_torch_metadata_across_batches_and_frames(case, checkpoint_id):
    tensors, objects, planner_data = METADATA_CASES[case]
    ours = metadata_bytes(tensors, objects, planner_data, checkpoint_id, "save-0")
    expected = torch_metadata_bytes(tensors, objects, planner_data, checkpoint_id, "save-0")
    assert ours == expected, first_difference(ours, expected)


def test_written_metadata_reads_back_through_our_reader_and_torchs_pickle_load(tmp_path):
    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", 2)
    source, written = read_checkpoint(FIXTURES / "fsdp2_world3_uneven"), read_checkpoint(tmp_path / "out")
    assert written.version == writer.DCP_VERSION
    assert written.nesting == source.nesting
    assert {fqn: (t.dtype, t.shape) for fqn, t in written.tensors.items()} == {
        fqn: (t.dtype, t.shape) for fqn, t in source.tensors.items()
    }
    loaded = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())  # written by us just now
    assert type(loaded).__module__ == "torch.distributed.checkpoint.metadata"
    assert loaded.storage_meta.checkpoint_id == tmp_path / "out"
    properties = loaded.state_dict_metadata["model.embed.weight"].properties
    assert properties.memory_format == torch.contiguous_format and properties.layout == torch.strided


# ---------------------------------------------------------------------------------------------
# No torch


def test_reshard_of_a_torch_save_checkpoint_never_imports_torch(tmp_path):
    script = (
        "import sys\n"
        "from ckpttool.commands.reshard import reshard\n"
        f"reshard({str(FIXTURES / 'fsdp2_world3_uneven')!r}, {str(tmp_path / 'out')!r}, 2)\n"
        "imported = sorted(name for name in sys.modules if name.split('.')[0] == 'torch')\n"
        "assert not imported, imported[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_checkpoint(tmp_path / "out").tensors
