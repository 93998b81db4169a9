"""What ckpttool writes in torch's formats, stock torch loads, and writing never imports torch.

`torchsave/` writes torch.save records (one per chunk), nested `.pt` files and the pickles in
them; `dcp/writer.py` writes `.metadata`. torch is the oracle: a record loads with
`torch.load(weights_only=True)` to the same dtype, shape and bytes; `.metadata` unpickles to
the `Metadata` torch's own classes would hold; resharded checkpoints load with
`dcp_to_torch_save` to the source's values, and `validate --deep` accepts them.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import subprocess
import sys
import zipfile
import zlib
from dataclasses import replace
from pathlib import Path, PurePosixPath

import pytest
import torch

from conftest import FIXTURES, ROOT, assert_same_bytes, flatten, import_native, tensor_bytes

import ckpttool.commands.reshard as reshard_command
from ckpttool.core import dtypes
from ckpttool.commands.reshard import reshard
from ckpttool.commands.validate import validate
from ckpttool.dcp import writer
from ckpttool.core.checkpoint import Blob
from ckpttool.dcp.blobs import DataFiles, read_tensor_record, record_problems
from ckpttool.dcp.writer import StoredChunk, StoredChunks, StoredObject, StoredTensor, metadata_bytes
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.torchsave import ptfile
from ckpttool.torchsave.pickle import Global, NewObject, Reduce, dumps
from ckpttool.torchsave.record import record_bytes, record_layout
from ckpttool.torchsave.zip import read_directory

TORCH_DTYPES = [name for name in dtypes.ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)]
SHAPES = [(5, 8), (0, 8), (), (3,), (2, 0), (1, 2, 3, 4)]
RESHARD_FIXTURES = ("fsdp2_world3_uneven", "fsdp2_world2_adamw")


def sample(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor whose bytes differ element to element (0..255 repeating)."""
    numel = math.prod(shape)
    data = torch.arange(numel * dtypes.ITEMSIZE[dtype]).remainder(256).to(torch.uint8)
    return data.view(getattr(torch, dtype)).reshape(shape) if numel else torch.empty(shape, dtype=getattr(torch, dtype))


def load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


# ---------------------------------------------------------------------------------------------
# One tensor's record (a DCP blob)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_record_loads_with_torch_load_as_the_same_tensor(dtype, shape):
    value = sample(dtype, shape)
    assert_same_bytes(load(record_bytes(dtype, shape, tensor_bytes(value))), value, f"{dtype} {shape}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_record_reads_back_through_ckpttool_and_passes_its_record_checks(dtype, shape, tmp_path):
    data = tensor_bytes(sample(dtype, shape))
    before = b"x" * 100  # a record sits at some offset of its data file
    (tmp_path / "blobs").write_bytes(before + record_bytes(dtype, shape, data))
    blob = Blob("blobs", len(before), record_layout(dtype, shape).length)
    with DataFiles(tmp_path) as files:
        record = read_tensor_record(files, blob, "test")
        assert (record.dtype, record.shape, record.is_plain, record.crc32) == (dtype, shape, True, zlib.crc32(data))
        assert files.read("blobs", record.data_offset, record.data_length) == data
        assert record_problems(files, blob, "test", skip_largest=False) == []
        assert record_problems(files, blob, "test", skip_largest=True) == []


def test_record_is_head_then_the_data_at_an_aligned_offset_then_a_tail_that_only_the_crc_changes():
    layout = record_layout("bfloat16", (3, 5))
    data = tensor_bytes(sample("bfloat16", (3, 5)))
    record = record_bytes("bfloat16", (3, 5), data)
    assert record == layout.head + data + layout.tail(zlib.crc32(data))
    assert len(record) == layout.length and layout.data_offset % 64 == 0
    assert record_bytes("bfloat16", (3, 5), data) == record  # deterministic
    assert len(layout.tail(0)) == len(layout.tail(zlib.crc32(data)))
    assert zipfile.ZipFile(io.BytesIO(record)).testzip() is None  # every CRC-32 is right


# ---------------------------------------------------------------------------------------------
# The pickle writer


PLAIN = {
    "ints": [0, 1, 255, 256, 65535, 65536, -1, -129, -2**31, 2**31 - 1, 2**31, 2**63, -2**63 - 1, 2**2000, -2**2000],
    "floats": [0.0, -0.0, 1e-310, 3.5, float("inf"), -float("inf")],
    "atoms": (None, True, False, b"", b"\x00\xff raw"),
    "strings": ["", "x", "é", "\ud800", "y" * 70000, *(f"name{i}" for i in range(300))],  # 300: past 256 memo slots
    "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((),), ((1,), (2, (3,)))],
    "nested": {1: {"a": [{"b": ()}]}, (1, "k"): "tuple key", "name0": "name0"},
    "long": list(range(2500)),
}


def test_plain_data_round_trips_through_stock_pickle():
    huge = [2**2100, -2**2100]  # LONG4, which torch's weights_only unpickler refuses (as for torch.save)
    assert pickle.loads(dumps({**PLAIN, "huge": huge})) == {**PLAIN, "huge": huge}


def test_plain_data_round_trips_through_torchs_weights_only_unpickler(tmp_path):
    pickled = ptfile.pickle_state([], [(("plain",), PLAIN)])
    assert load(pt_bytes(pickled, {}))["plain"] == PLAIN


def test_stand_ins_load_as_the_objects_they_name():
    ordered = Reduce(Global("collections", "OrderedDict"), ())
    path = Reduce(Global("pathlib", "PurePosixPath"), ("a", "b"))
    loaded = pickle.loads(dumps([ordered, path, Global("torch", "bfloat16"), NewObject(Global("argparse", "Namespace"), {"x": 1})]))
    assert loaded[:3] == [{}, PurePosixPath("a/b"), torch.bfloat16] and type(loaded[0]).__name__ == "OrderedDict"
    assert vars(loaded[3]) == {"x": 1}


def test_pickles_are_deterministic():
    assert dumps(PLAIN) == dumps(PLAIN)


# ---------------------------------------------------------------------------------------------
# A nested .pt


def pt_bytes(pickled: ptfile.PickledState, tensors: dict[int, bytes]) -> bytes:
    """Return the whole .pt for a pickled state whose planned storages hold `tensors`."""
    layout = ptfile.lay_out(pickled, [len(tensors[key]) for key in sorted(tensors)])
    out = bytearray(layout.size)
    crcs = {}
    for key, offset in enumerate(layout.data_offsets):
        out[offset:offset + len(tensors[key])] = tensors[key]
        crcs[f"{ptfile.ARCHIVE}/data/{key}"] = zlib.crc32(tensors[key])
    for offset, data in ptfile.zip_records(layout, crcs):
        out[offset:offset + len(data)] = data
    return bytes(out)


def test_pt_of_nested_tensors_and_python_objects_loads_with_weights_only():
    values = {("model", "w"): sample("float32", (3, 4)), ("model", "layers", 0, "b"): sample("float8_e5m2", (5,)),
              ("model", "layers", 1, "b"): sample("bfloat16", ())}
    objects = [(("optim", "param_groups", 0, "lr"), 0.01), (("optim", "param_groups", 0, "params"), [0, 1]),
               (("extra", "shape"), torch.Size([2, 3])), (("extra", "pair"), (torch.ones(2, dtype=torch.int16), {"k"}))]
    pickled = ptfile.pickle_state([(path, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for path, v in values.items()], objects)
    loaded = load(pt_bytes(pickled, {key: tensor_bytes(v) for key, v in enumerate(values.values())}))
    for (*parents, name), value in values.items():
        node = loaded
        for key in parents:
            node = node[key]
        assert_same_bytes(node[name], value, name)
    assert isinstance(loaded["model"]["layers"], list)
    assert loaded["optim"] == {"param_groups": [{"lr": 0.01, "params": [0, 1]}]}
    assert loaded["extra"]["shape"] == torch.Size([2, 3]) and loaded["extra"]["pair"][1] == {"k"}
    assert_same_bytes(loaded["extra"]["pair"][0], torch.ones(2, dtype=torch.int16))


def test_pt_of_plain_python_objects_is_written_without_torchs_pickler(monkeypatch):
    monkeypatch.setattr(ptfile, "_python_pickled", None)  # would fail if called
    pickled = ptfile.pickle_state([], [(("step",), 7), (("groups",), [{"lr": 0.1, "betas": (0.9, 0.99)}])])
    assert load(pt_bytes(pickled, {})) == {"step": 7, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}


def test_pt_with_a_storage_past_4_gib_has_zip64_entries_python_and_ckpttool_read(tmp_path):
    pickled = ptfile.pickle_state([(("a",), "uint8", (10,)), (("big",), "uint8", (5 << 30,)), (("c",), "uint8", (3,))], [])
    layout = ptfile.lay_out(pickled, [10, 5 << 30, 3])
    path = tmp_path / "big.pt"
    with open(path, "wb") as handle:  # sparse: the 5 GiB storage is never written
        handle.truncate(layout.size)
        names = [f"{ptfile.ARCHIVE}/data/{key}" for key in range(3)]
        crcs = {names[0]: zlib.crc32(bytes(10)), names[1]: 0, names[2]: zlib.crc32(bytes(3))}
        for offset, data in ptfile.zip_records(layout, crcs):
            handle.seek(offset)
            handle.write(data)
    with zipfile.ZipFile(path) as archive:
        assert [archive.getinfo(name).file_size for name in names] == [10, 5 << 30, 3]
        assert archive.open(names[2]).read() == b"\x00\x00\x00"  # local header offset past 4 GiB
    with DataFiles(tmp_path) as files:
        entries = read_directory(lambda offset, length: files.read("big.pt", offset, length), layout.size, "test")
        assert [entries[name].size for name in names] == [10, 5 << 30, 3]
        assert entries[names[2]].local_offset > 1 << 32


# ---------------------------------------------------------------------------------------------
# .metadata


def test_dcp_version_constant_is_the_installed_torchs():
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    assert writer.DCP_VERSION == CURRENT_DCP_VERSION


def torch_metadata(tensors, objects, planner_data, checkpoint_id, save_id):
    """Return the `Metadata` torch's own classes hold for these entries."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
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
            storage_data[MetadataIndex(tensor.fqn, chunk.offsets, index)] = _StorageInfo(chunk.file, chunk.offset, chunk.length)
        properties = TensorProperties(dtype=getattr(torch, tensor.dtype))
        state_dict_metadata[tensor.fqn] = TensorStorageMetadata(properties, torch.Size(tensor.shape), chunks)
    for obj in objects:
        state_dict_metadata[obj.fqn] = BytesStorageMetadata()
        storage_data[MetadataIndex(obj.fqn)] = _StorageInfo(obj.file, obj.offset, obj.length, list(obj.transforms) or None)
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=dict(planner_data),
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
        version=writer.DCP_VERSION,
    )


def many_entries(tensor_count: int, chunk_count: int, object_count: int, big: bool = False):
    """Return (tensors, objects, planner_data) with every dtype and files shared across chunks."""
    files = [writer.data_file_name(rank) for rank in range(4)]
    step = 2**33 + 7 if big else 4096
    tensors, planner_data = [], {}
    for t in range(tensor_count):
        fqn = f"model.layers.{t}.weight"
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
    "every dtype, shared files": many_entries(2 * len(TORCH_DTYPES), 3, 4),
    "300 chunks: past 256 memo slots": many_entries(3, 100, 0),
    "offsets past 2**32": many_entries(5, 5, 5, big=True),
    "nothing": ([], [], {}),
    "zstd-compressed objects": ([], [StoredObject("a", "__0_0.distcp", 0, 9, ("stream.zstd/1",)),
                                     StoredObject("b", "__0_0.distcp", 9, 9, ("stream.zstd/1",))], {"a": ("a",), "b": ("b",)}),
    "a tensor without chunks": ([StoredTensor("t", "float32", (0,), ())], [], {}),
    "0-d tensors": ([StoredTensor(f"t{i}", "bfloat16", (), (StoredChunk((), (), "__0_0.distcp", 64 * i, 64),)) for i in range(3)], [], {}),
}


@pytest.mark.parametrize("checkpoint_id", [Path("/ckpt/step-10-world3"), PurePosixPath("relative/out"), "ckpt", None])
@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_unpickles_to_the_metadata_torchs_classes_hold(case, checkpoint_id):
    tensors, objects, planner_data = METADATA_CASES[case]
    ours = pickle.loads(metadata_bytes(tensors, objects, planner_data, checkpoint_id, "save-0"))  # our own bytes
    assert ours == torch_metadata(tensors, objects, planner_data, checkpoint_id, "save-0")


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_reads_through_ckpttool_as_torchs_pickled_metadata_does(case, tmp_path):
    tensors, objects, planner_data = METADATA_CASES[case]
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    (tmp_path / "ours" / ".metadata").write_bytes(metadata_bytes(tensors, objects, planner_data, tmp_path, "save-0"))
    reference = pickle.dumps(torch_metadata(tensors, objects, planner_data, tmp_path, "save-0"))
    (tmp_path / "torch" / ".metadata").write_bytes(reference)
    ours, theirs = read_checkpoint(tmp_path / "ours"), read_checkpoint(tmp_path / "torch")
    assert replace(ours, path=None) == replace(theirs, path=None)


# ---------------------------------------------------------------------------------------------
# .metadata from columns: reshard's plan gives each tensor's chunks as StoredChunks (numpy
# columns); the writer encodes their rows without a StoredChunk each, to the same bytes


def as_columns(tensor: StoredTensor) -> StoredTensor:
    """The same tensor with its chunks as StoredChunks, over its own tuple of file names (in
    another order than the chunks name them, and with one no chunk uses)."""
    import numpy as np

    chunks = tensor.chunks
    ndim = len(chunks[0].offsets) if chunks else len(tensor.shape)
    files = tuple(sorted({chunk.file for chunk in chunks}, reverse=True)) + ("__unused_0.distcp",)
    return replace(tensor, chunks=StoredChunks(
        offsets=np.array([chunk.offsets for chunk in chunks], np.int64).reshape(len(chunks), ndim),
        sizes=np.array([chunk.sizes for chunk in chunks], np.int64).reshape(len(chunks), ndim),
        files=files,
        file=np.array([files.index(chunk.file) for chunk in chunks], np.int64),
        offset=np.array([chunk.offset for chunk in chunks], np.int64),
        length=np.array([chunk.length for chunk in chunks], np.int64),
    ))


def boxes_tensor(fqn: str, shape: tuple[int, ...], boxes, files, start: int = 0, length: int = 1000) -> StoredTensor:
    """A tensor whose chunks are these (offsets, sizes) boxes, round-robin over `files`, blobs
    one after the other from `start`."""
    chunks = tuple(StoredChunk(tuple(offsets), tuple(sizes), files[c % len(files)], start + c * length, length)
                   for c, (offsets, sizes) in enumerate(boxes))
    return StoredTensor(fqn, "float32", shape, chunks)


def dim0_tensor(fqn: str, shape: tuple[int, ...], count: int, files, start: int = 0) -> StoredTensor:
    """A tensor split along dim 0 into `count` slabs (the last ones empty when too few rows)."""
    per = -(-shape[0] // count) if shape[0] else 0
    boxes = [((min(c * per, shape[0]), *(0 for _ in shape[1:])), (max(0, min(per, shape[0] - c * per)), *shape[1:]))
             for c in range(count)]
    return boxes_tensor(fqn, shape, boxes, files, start)


FILES = [writer.data_file_name(rank) for rank in range(5)]
INT_EDGES = [0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**39, 2**47 + 3, 2**55, 2**62, 2**63 - 1,
             -1, -256, -2**31, -2**31 - 1, -2**39 - 1, -2**63]
COLUMN_CASES = {
    "several tensors and files, shapes repeated across tensors": (
        [dim0_tensor(f"model.layers.{i}.{name}", shape, 4, FILES, 10**4 * i)
         for i in range(3) for name, shape in (("wq", (16, 8)), ("wk", (4, 8)), ("norm", (16,)))], [], {}),
    "0-d, 1-d, 3-d and 4-d tensors": ([
        boxes_tensor("step", (), [((), ())], FILES),
        dim0_tensor("bias", (10,), 3, FILES, 100),
        boxes_tensor("conv", (4, 6, 8), [((0, 0, 0), (2, 6, 8)), ((2, 0, 0), (2, 3, 8)), ((2, 3, 0), (2, 3, 8))], FILES, 200),
        boxes_tensor("cube", (2, 2, 2, 2), [((0, 0, 0, 0), (1, 2, 2, 2)), ((1, 0, 0, 0), (1, 2, 2, 2))], FILES, 300),
        boxes_tensor("step2", (), [((), ())], FILES[3:], 400),
    ], [], {}),
    "empty chunks and a tensor without chunks": ([
        dim0_tensor("short", (3, 4), 5, FILES),  # torch.chunk of 3 rows for 5 ranks: two empty slabs
        dim0_tensor("empty", (0, 4), 2, FILES, 50),
        StoredTensor("none", "float32", (0, 4), ()),
        dim0_tensor("after", (8,), 2, FILES, 90),
    ], [], {}),
    "a repeated (fqn, offsets): first index, last blob": ([
        boxes_tensor("twice", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((0, 0), (2, 4)), ((2, 0), (2, 4))], FILES),
        boxes_tensor("unordered", (6,), [((4,), (2,)), ((0,), (2,)), ((2,), (2,))], FILES, 500),  # distinct
        boxes_tensor("same", (4,), [((0,), (2,)), ((2,), (2,))], FILES, 600),
        boxes_tensor("other", (4,), [((0,), (4,))], FILES, 700),
        boxes_tensor("same", (4,), [((2,), (2,)), ((0,), (2,))], FILES[2:], 800),  # the same fqn again
        boxes_tensor("zero-d twice", (), [((), ()), ((), ())], FILES, 900),
    ], [], {}),
    "past 256 memo slots: 300 files, 300 tensors": (
        [dim0_tensor(f"model.layers.{i}.weight", (8, 3), 4, [writer.data_file_name(r) for r in range(300)], 64 * i)
         for i in range(300)], [], {}),
    "every int encoding in offsets, sizes, blob offsets and lengths": ([
        StoredTensor("ints", "uint8", (2**63 - 1,), tuple(StoredChunk((value,), (value >> 1,), FILES[i % 5], value, ~value)
                                                          for i, value in enumerate(INT_EDGES))),
        boxes_tensor("far", (2**40, 2), [((2**39, 0), (2**39, 2))], FILES, 2**45, 2**33),
    ], [], {}),
    "objects, zstd objects and tensors given as tuples among them": ([
        boxes_tensor("first", (4,), [((0,), (4,))], ["objects.distcp"]),
        as_columns(boxes_tensor("kept as a tuple", (4,), [((0,), (2,)), ((2,), (2,))], FILES[1:])),
        boxes_tensor("last", (4,), [((0,), (2,)), ((2,), (2,))], FILES[2:], 40),
    ], [StoredObject("a", "objects.distcp", 0, 9, ("stream.zstd/1",)), StoredObject("b", FILES[4], 9, 9)],
       {"a": ("a",), "b": ("b",)}),
}


def with_columns(tensors: list[StoredTensor]) -> list[StoredTensor]:
    """The tensors with every tuple of chunks as StoredChunks (and StoredChunks as tuples: the
    case above that mixes them keeps one of each)."""
    return [replace(t, chunks=tuple(t.chunks)) if isinstance(t.chunks, StoredChunks) else as_columns(t) for t in tensors]


@pytest.mark.parametrize("case", [*COLUMN_CASES, *METADATA_CASES])
def test_metadata_from_stored_chunks_is_byte_identical_to_metadata_from_tuples_of_stored_chunk(case):
    tensors, objects, planner_data = COLUMN_CASES.get(case) or METADATA_CASES[case]
    from_tuples = metadata_bytes(tensors, objects, planner_data, Path("/ckpt"), "save-0")
    assert metadata_bytes(with_columns(tensors), objects, planner_data, Path("/ckpt"), "save-0") == from_tuples


def test_metadata_from_stored_chunks_is_byte_identical_on_random_checkpoints():
    rng = random.Random(0)
    files = [writer.data_file_name(rank) for rank in range(270)]
    for trial in range(40):
        tensors, start = [], 0
        for _tensor in range(rng.randint(0, 30)):
            ndim = rng.choice((0, 1, 2, 3, 4))
            boxes = []
            for _ in range(rng.randint(1, 40) if ndim else rng.randint(1, 2)):
                offsets = tuple(rng.choice((0, 1, 255, 256, 65536, 2**31, 2**40)) for _ in range(ndim))
                boxes.append((offsets, tuple(rng.randint(0, 300) for _ in range(ndim))))
            tensor = boxes_tensor(f"t{rng.randint(0, 40)}", (9,) * ndim, boxes, rng.sample(files, rng.randint(1, 270)),
                                  start, rng.choice((100, 70000, 2**31)))
            tensors.append(tensor if rng.random() < 0.8 else as_columns(tensor))
            start += 2**rng.randint(8, 40)
        objects = [StoredObject(f"o{o}", rng.choice(files), o, 9, rng.choice(((), ("stream.zstd/1",))))
                   for o in range(rng.randint(0, 3))]
        before = metadata_bytes(tensors, objects, {}, f"/ckpt/{trial}", "save")
        assert metadata_bytes(with_columns(tensors), objects, {}, f"/ckpt/{trial}", "save") == before, trial


def random_column_tensors(rng: random.Random, files: list[str]) -> list[StoredTensor]:
    """Tensors of 0 to 5 dims and several dtypes (one repeated fqn at times), chunks as columns."""
    tensors, start = [], 0
    for _ in range(rng.randint(1, 30)):
        ndim = rng.choice((0, 1, 2, 3, 4, 5))
        boxes = []
        for _ in range(rng.randint(0, 40) if ndim else rng.randint(1, 2)):
            offsets = tuple(rng.choice((0, 1, 255, 256, 65536, 2**31, 2**40, 2**63 - 1)) for _ in range(ndim))
            boxes.append((offsets, tuple(rng.randint(0, 300) for _ in range(ndim))))
        tensor = boxes_tensor(f"t{rng.randint(0, 40)}", (9,) * ndim, boxes, rng.sample(files, rng.randint(1, 270)),
                              start, rng.choice((100, 70000, 2**31)))
        tensors.append(as_columns(replace(tensor, dtype=rng.choice(("float32", "bfloat16", "int64")))))
        start += 2**rng.randint(8, 40)
    return tensors


def test_metadata_from_stored_chunks_is_the_same_without_the_c_module(monkeypatch):
    """The rows encoded by `_records.encode_rows` and by numpy (no compiler): the same
    `.metadata`, for every case above and random checkpoints of 0- to 5-d tensors."""
    from ckpttool.torchsave import native

    import_native("ckpttool.torchsave._records")  # skips, or fails under CKPTTOOL_REQUIRE_NATIVE
    rng = random.Random(1)
    files = [writer.data_file_name(rank) for rank in range(270)]
    cases = [(with_columns(tensors), objects, planner_data)
             for tensors, objects, planner_data in [*COLUMN_CASES.values(), *METADATA_CASES.values()]]
    cases += [(random_column_tensors(rng, files), [StoredObject("o", files[0], 0, 9)], {}) for _ in range(20)]
    for number, (tensors, objects, planner_data) in enumerate(cases):
        encoded = []
        for module in (native.records, None):
            monkeypatch.setattr(native, "records", module)
            encoded.append(metadata_bytes(tensors, objects, planner_data, Path("/ckpt"), "save-0"))
        assert encoded[0] == encoded[1], number
        as_tuples = [replace(tensor, chunks=tuple(tensor.chunks)) for tensor in tensors]
        assert encoded[0] == metadata_bytes(as_tuples, objects, planner_data, Path("/ckpt"), "save-0"), number


@pytest.mark.parametrize("case", list(COLUMN_CASES))
def test_metadata_from_stored_chunks_loads_in_torch_as_the_metadata_of_its_tuples(case, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    tensors, objects, planner_data = COLUMN_CASES[case]
    (tmp_path / ".metadata").write_bytes(metadata_bytes(with_columns(tensors), objects, planner_data, tmp_path, "save-0"))
    loaded = FileSystemReader(tmp_path).read_metadata()
    loaded.storage_meta.load_id = None  # the reader's own, set as it reads
    assert loaded == pickle.loads(metadata_bytes(tensors, objects, planner_data, tmp_path, "save-0"))
    if "repeated" not in case:  # torch's classes keep a repeated key's last MetadataIndex (dict assignment)
        assert loaded == torch_metadata(tensors, objects, planner_data, tmp_path, "save-0")


# ---------------------------------------------------------------------------------------------
# Resharded checkpoints


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("name", RESHARD_FIXTURES)
def test_resharded_checkpoint_loads_with_dcp_to_torch_save_and_passes_validate_deep(tmp_path, reference, name, world_size):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reshard(FIXTURES / name, tmp_path / "out", world_size)
    dcp_to_torch_save(tmp_path / "out", tmp_path / "out.pt")
    loaded = flatten(torch.load(tmp_path / "out.pt", weights_only=True))
    expected = reference(FIXTURES / name)
    assert loaded.keys() == expected.keys()
    for fqn, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_same_bytes(loaded[fqn], value, fqn)
        else:
            assert loaded[fqn] == value, fqn
    report = validate(tmp_path / "out", deep=True)
    assert report.valid and not report.warnings, report.problems


def test_resharded_metadata_is_what_torchs_classes_hold_for_the_same_entries(tmp_path, monkeypatch):
    calls = []

    def recording_metadata_bytes(*args):
        calls.append(args)
        return metadata_bytes(*args)

    monkeypatch.setattr(reshard_command, "metadata_bytes", recording_metadata_bytes)
    reshard(FIXTURES / "fsdp2_world3_uneven", tmp_path / "out", 2)
    (arguments,) = calls
    written = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())  # written by us just now
    assert written == torch_metadata(*arguments)
    assert written.storage_meta.checkpoint_id == tmp_path / "out"


def test_resharding_twice_writes_the_same_bytes(tmp_path):
    for out in ("a", "b"):
        reshard(FIXTURES / "fsdp2_world2_adamw", tmp_path / out, 3)
    for path in sorted((tmp_path / "a").iterdir()):
        if path.suffix == ".distcp":
            assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


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
