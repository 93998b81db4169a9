"""`.metadata` written through cached fragments is byte for byte what walking every chunk's
stand-ins writes (the reference below is `dcp.writer`'s earlier, straightforward writer)."""

from __future__ import annotations

import pickle
import random
from pathlib import PurePosixPath
from typing import Any

from ckpttool.dcp import writer
from ckpttool.dcp.writer import StoredChunk, StoredObject, StoredTensor, metadata_bytes
from ckpttool.torchsave.pickle import NewObject, Writer, dumps, int_bytes


def reference_metadata_bytes(tensors, objects, planner_data, checkpoint_id, save_id) -> bytes:
    """Every chunk and storage entry built as stand-ins and walked by the generic writer."""
    state_dict_metadata: dict[str, NewObject] = {}
    storage_data: dict[tuple, list] = {}

    def store(key: NewObject, fqn: str, offsets: Any, info: NewObject) -> None:
        entry = storage_data.setdefault((fqn, offsets), [key, info])
        entry[1] = info

    for tensor in tensors:
        chunks = []
        for index, chunk in enumerate(tensor.chunks):
            chunks.append(NewObject(writer._CHUNK_STORAGE_METADATA,
                                    {"offsets": writer._size(chunk.offsets), "sizes": writer._size(chunk.sizes)}))
            info = writer._storage_info(chunk.file, chunk.offset, chunk.length)
            store(writer._metadata_index(tensor.fqn, chunk.offsets, index), tensor.fqn, tuple(chunk.offsets), info)
        state_dict_metadata[tensor.fqn] = NewObject(writer._TENSOR_STORAGE_METADATA, {
            "properties": writer._tensor_properties(tensor.dtype), "size": writer._size(tensor.shape), "chunks": chunks})
    for obj in objects:
        state_dict_metadata[obj.fqn] = NewObject(writer._BYTES_STORAGE_METADATA, None)
        store(writer._metadata_index(obj.fqn, None, None), obj.fqn, None,
              writer._storage_info(obj.file, obj.offset, obj.length, obj.transforms))
    storage_meta = NewObject(writer._STORAGE_META, {"checkpoint_id": writer._path_object(checkpoint_id),
                                                    "save_id": save_id, "load_id": None, "modules": []})
    return dumps(NewObject(writer._METADATA, {
        "state_dict_metadata": state_dict_metadata, "planner_data": dict(planner_data),
        "storage_data": {key: info for key, info in storage_data.values()},
        "storage_meta": storage_meta, "version": writer.DCP_VERSION}))


def random_entries(rng: random.Random) -> tuple[list[StoredTensor], list[StoredObject], dict]:
    tensors, objects, offset = [], [], 0
    for t in range(rng.randint(0, 40)):
        dims = rng.choice((0, 1, 2, 3))
        shape = tuple(rng.randint(0, 400) for _ in range(dims))
        chunks = []
        for c in range(rng.randint(1, 6) if dims else 1):
            offsets = tuple(rng.choice((0, c, 255, 256, 70000, 2**31 + 5)) for _ in range(dims))
            sizes = tuple(rng.randint(0, 300) for _ in range(dims))
            length = rng.choice((900, 70000, 2**33))
            chunks.append(StoredChunk(offsets, sizes, f"__{rng.randint(0, 300)}_0.distcp", offset, length))
            offset += rng.choice((1, 255, 65536, 2**32))
        if chunks and rng.random() < 0.2:  # a repeated (fqn, offsets): first index, last storage
            chunks.append(replace_offset(chunks[0], offset))
        tensors.append(StoredTensor(f"model.layers.{t}.w{rng.randint(0, 3)}", rng.choice(("float32", "bfloat16")),
                                    shape, tuple(chunks)))
    for o in range(rng.randint(0, 5)):
        objects.append(StoredObject(f"optim.param_groups.0.k{o}", "__0_0.distcp", rng.randint(0, 10**6),
                                    rng.randint(1, 1000), rng.choice(((), ("stream.zstd/1",)))))
    names = [t.fqn for t in tensors] + [o.fqn for o in objects]
    return tensors, objects, {name: tuple(name.split(".")) for name in names}


def replace_offset(chunk: StoredChunk, offset: int) -> StoredChunk:
    return StoredChunk(chunk.offsets, chunk.sizes, chunk.file, offset, chunk.length)


def test_metadata_bytes_are_those_of_the_stand_in_walk_on_random_checkpoints():
    rng = random.Random(0)
    for trial in range(80):
        tensors, objects, planner_data = random_entries(rng)
        args = (tensors, objects, planner_data, PurePosixPath("/out"), f"save-{trial}")
        data = metadata_bytes(*args)
        assert data == reference_metadata_bytes(*args), trial


def test_a_fragment_is_none_until_its_strings_are_in_the_memo_and_leaves_the_memo_as_it_was():
    w = Writer()
    assert w.fragment(["a", 1]) is None and w.memo == {} and not w.out
    w.write("a")
    assert w.fragment(["a", 1]) is not None
    before = bytes(w.out)
    w.write(["a", 1])
    assert bytes(w.out)[len(before):] == w.fragment(["a", 1])
    assert int_bytes(-1) == b"J\xff\xff\xff\xff" and int_bytes(2**40)[:1] == pickle.LONG1
