"""The C reader of `.metadata` (readers/_dcpscan.c) reads exactly what the checking Python
loader reads, into chunk tables instead of a Chunk per chunk, or declines and leaves the file
to the loader: on every fixture torch (and each framework) wrote, on our own writer's
protocol-2 pickles, and on seeded mutants of them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ckpttool.core.checkpoint import Checkpoint, ChunkTable
from ckpttool.dcp.writer import StoredChunk, StoredObject, StoredTensor, metadata_bytes
from ckpttool.core.errors import CheckpointError
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers import dcp
from ckpttool.safepickle.unpickler import unpickle_metadata

from conftest import FIXTURES

ALL_METADATA = sorted(FIXTURES.glob("**/" + METADATA_FILENAME))
# Megatron keeps its SavePlans on the Metadata (all_local_plans): only the Python loader reads it
DECLINED = {"frameworks/megatron/checkpoints/iter_0000002", "frameworks/megatron_families/llama_tp2/checkpoints/iter_0000002",
            "frameworks/megatron_families/moe/checkpoints/iter_0000003",
            "frameworks/megatron_families/moe_ep2/checkpoints/iter_0000002",
            "frameworks/megatron_more_families/mixtral_ep2/checkpoints/iter_0000003",
            "frameworks/megatron_more_families/qwen2_tp2/checkpoints/iter_0000002",
            "frameworks/megatron_more_families/deepseek_v3_ep2/checkpoints/iter_0000002",
            "frameworks/megatron_distopt_torch_dist/checkpoints/iter_0000002",
            "frameworks/megatron_gpt_oss/gpt_oss_ep2/checkpoints/iter_0000002",
            # Megatron-Bridge's own import, saved by dist_checkpointing.save (the reference ckpttool's import equals)
            "frameworks/megatron_import/llama/reference/iter_0000000",
            "frameworks/megatron_import/qwen3_moe/reference/iter_0000000",
            # Megatron-FSDP's chunk metadata: sizes pickled as torch.Size (uneven_dtensor.py `gather_and_compute_chunk_metadata`)
            "frameworks/megatron_fsdp_dtensor/checkpoints/iter_0000002",
            "frameworks/megatron_fsdp_dtensor/with_optimizer/checkpoints/iter_0000002",
            # NeMo 2's weights/, written by NeMo's MegatronCheckpointIO through dist_checkpointing.save
            *(f"frameworks/nemo2/llama/checkpoints/model_name=0--val_loss=0.00-step=3-consumed_samples=4.0{last}/weights"
              for last in ("", "-last")),
            *(f"frameworks/nemo2_families/{name}/checkpoints/model_name=0--val_loss=0.00-step=3-consumed_samples=4.0-last/weights"
              for name in ("qwen3", "qwen3_moe", "mixtral", "qwen2"))}


def _columns(path: Path, raw: bytes) -> Checkpoint | None:
    scanned = dcp.scan_columns(raw)
    return None if scanned is None else dcp.columns.checkpoint(path.parent, path, scanned)


def _loader(path: Path, raw: bytes) -> Checkpoint:
    return dcp._convert(path.parent, path, unpickle_metadata(raw, str(path)))


def _plain(checkpoint: Checkpoint) -> tuple:
    """Everything a checkpoint says, with chunk tables as tuples of Chunk."""
    tensors = [(t.fqn, t.dtype, t.shape, tuple(t.chunks)) for t in checkpoint.tensors.values()]
    return (checkpoint.version, checkpoint.save_id, tensors, checkpoint.objects, checkpoint.nesting,
            checkpoint.orphan_blobs, checkpoint.notes, checkpoint.metadata_file)


def _outcome(read, path: Path, raw: bytes) -> tuple:
    try:
        return ("read", _plain(read(path, raw)))
    except CheckpointError as error:
        return ("refused", type(error).__name__)


@pytest.mark.parametrize("path", ALL_METADATA, ids=lambda p: str(p.parent.relative_to(FIXTURES)))
def test_the_c_reader_reads_every_fixture_as_the_loader_does(path):
    raw = path.read_bytes()
    columns = _columns(path, raw)
    if str(path.parent.relative_to(FIXTURES)) in DECLINED:
        assert columns is None
        return
    assert columns is not None
    assert _plain(columns) == _plain(_loader(path, raw))
    assert all(isinstance(t.chunks, ChunkTable) for t in columns.tensors.values())


def test_the_c_reader_reads_our_writers_protocol_2_pickles():
    source = dcp.read_checkpoint(FIXTURES / "fsdp2_world2_adamw")
    tensors = [
        StoredTensor(t.fqn, t.dtype, t.shape, tuple(StoredChunk(c.offsets, c.sizes, c.blob.file, c.blob.offset, c.blob.length)
                                                    for c in t.chunks))
        for t in source.tensors.values()
    ]
    objects = [StoredObject(o.fqn, o.blob.file, o.blob.offset, o.blob.length) for o in source.objects.values()]
    raw = metadata_bytes(tensors, objects, source.nesting, "/tmp/x", "save-1")
    path = FIXTURES / "fsdp2_world2_adamw" / METADATA_FILENAME
    columns = _columns(path, raw)
    assert columns is not None
    assert _plain(columns) == _plain(_loader(path, raw))
    assert [(t.fqn, tuple(t.chunks)) for t in columns.tensors.values()] == [(t.fqn, tuple(t.chunks)) for t in source.tensors.values()]


def _mutant(data: bytes, rng: random.Random) -> bytes:
    """One to three changes: a one-byte int's value (offsets, sizes, lengths; what the reader
    reads rather than declines), byte flips, a truncation, a deleted or repeated range."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(7)
        at = rng.randrange(len(data))
        if kind >= 5:
            ints = [i for i in range(len(data) - 1) if data[i] == ord("K")]
            if ints:
                data[rng.choice(ints) + 1] = rng.choice((0, 1, 2, 3, 4, 7, 8, 64, 255))
        elif kind == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[at] = rng.randrange(256)
        elif kind == 2:
            del data[at:]
        elif kind == 3:
            del data[at:at + rng.randint(1, 40)]
        else:
            data[at:at] = data[at:at + rng.randint(1, 40)]
        if not data:
            data = bytearray(b"\x80")
    return bytes(data)


def test_mutants_are_read_the_same_or_left_to_the_loader():
    rng = random.Random(0)
    sources = [FIXTURES / name / METADATA_FILENAME for name in ("fsdp2_world2", "fsdp2_world3_uneven", "llama_world2/checkpoint")]
    read = declined = 0
    for _ in range(600):
        path = rng.choice(sources)
        raw = _mutant(path.read_bytes(), rng)
        try:
            columns = _columns(path, raw)
        except CheckpointError as error:  # both refuse what they read alike (a bad name, say)
            assert _outcome(_loader, path, raw) == ("refused", type(error).__name__)
            continue
        if columns is None:
            declined += 1
            continue
        read += 1
        assert ("read", _plain(columns)) == _outcome(_loader, path, raw), f"mutant {_} of {path}"
    assert read > 100 and declined > 200  # both kinds are exercised


def test_a_large_metadata_is_mapped_and_read_alike(monkeypatch):
    path = FIXTURES / "fsdp2_world2_adamw"
    monkeypatch.setattr(dcp, "MAP_METADATA_BYTES", 0)
    mapped = dcp._scan_mapped(path / METADATA_FILENAME)
    assert mapped is not None
    assert _plain(dcp.columns.checkpoint(path, path / METADATA_FILENAME, mapped)) == _plain(dcp.read_checkpoint(path))


def test_without_the_c_reader_the_loader_reads_every_checkpoint(monkeypatch):
    monkeypatch.setattr(dcp, "scan_columns", lambda raw, mapped=False: None)
    for path in ALL_METADATA:
        checkpoint = dcp.read_checkpoint(path.parent)
        assert not any(isinstance(t.chunks, ChunkTable) for t in checkpoint.tensors.values())


def test_records_a_writer_shares_between_entries_are_read_alike(tmp_path):
    """One TensorProperties for every tensor of a dtype and one BytesStorageMetadata for every
    object, as a writer that reuses them pickles it (memo fetches instead of new records)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    properties, opaque = TensorProperties(dtype=torch.bfloat16), BytesStorageMetadata()
    state, stored, end = {}, {}, 0
    for name in ("a", "b", "c"):
        chunks = [ChunkStorageMetadata(torch.Size([row, 0]), torch.Size([2, 3])) for row in (0, 2)]
        state[f"model.{name}"] = TensorStorageMetadata(properties, torch.Size([4, 3]), chunks)
        for chunk in chunks:
            stored[MetadataIndex(f"model.{name}", chunk.offsets)] = _StorageInfo("__0_0.distcp", end, 12)
            end += 12
        state[f"optim.{name}.lr"] = opaque
        stored[MetadataIndex(f"optim.{name}.lr")] = _StorageInfo("__0_0.distcp", end, 7)
        end += 7
    raw = pickle.dumps(Metadata(state_dict_metadata=state, storage_data=stored))
    path = tmp_path / METADATA_FILENAME
    columns = _columns(path, raw)
    assert columns is not None and len(columns.objects) == 3
    assert _plain(columns) == _plain(_loader(path, raw))


def test_small_checkpoints_keep_chunk_tuples_and_large_ones_read_as_tables(monkeypatch):
    """Below COLUMNS_FROM_BYTES the loader is quicker than importing numpy for tables; above
    it every command sees tables, with the same verdicts."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    source = FIXTURES / "fsdp2_world3_uneven"
    small = dcp.read_checkpoint(source)
    assert not any(isinstance(t.chunks, ChunkTable) for t in small.tensors.values())
    before = [CliRunner().invoke(main, [command, "--json", str(source)]) for command in ("inspect", "validate")]
    monkeypatch.setattr(dcp, "COLUMNS_FROM_BYTES", 0)
    large = dcp.read_checkpoint(source)
    assert all(isinstance(t.chunks, ChunkTable) for t in large.tensors.values())
    after = [CliRunner().invoke(main, [command, "--json", str(source)]) for command in ("inspect", "validate")]
    assert [(r.exit_code, _untimed(r.output)) for r in after] == [(r.exit_code, _untimed(r.output)) for r in before]
    assert before[1].exit_code == 0


def _untimed(document: str) -> dict:
    import json

    found = json.loads(document)
    found.pop("seconds", None)
    return found


def test_entries_out_of_step_with_the_chunks_are_matched_as_the_loader_matches_them(tmp_path):
    """The C reader takes each storage entry as the next chunk of its tensor; entries in
    another order, repeated, naming no chunk, or chunks listed out of order leave the tensor
    to the matching by sorting, with the loader's result (and a table where it can be one)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    state, stored, end = {}, {}, [0]

    def entry(fqn, offsets, file="__0_0.distcp", length=24):
        stored[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(file, end[0], length)
        end[0] += length

    def tensor(fqn, rows):
        chunks = [ChunkStorageMetadata(torch.Size([row, 0]), torch.Size([2, 3])) for row in rows]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2 * len(rows), 3]), chunks)
        return [chunk.offsets for chunk in chunks]

    for offsets in tensor("model.clean", (0, 2, 4)):
        entry("model.clean", offsets)
    for offsets in reversed(tensor("model.reversed", (0, 2, 4))):
        entry("model.reversed", offsets, "__1_0.distcp")
    for offsets in tensor("model.repeated", (0, 2)):
        entry("model.repeated", offsets)
    entry("model.repeated", (0, 0), "__1_0.distcp")  # the last of equal keys is kept
    for offsets in tensor("model.orphaned", (0, 2)):
        entry("model.orphaned", offsets)
    entry("model.orphaned", (8, 0))
    for offsets in tensor("model.descending", (4, 2, 0)):
        entry("model.descending", offsets)
    tensor("model.unstored", (0, 2))
    entry("model.unstored", (0, 0))
    state["optim.lr"] = BytesStorageMetadata()
    stored[MetadataIndex("optim.lr")] = _StorageInfo("__0_0.distcp", end[0], 7)
    stored[MetadataIndex("optim.gone", torch.Size([0]))] = _StorageInfo("__1_0.distcp", 0, 7)
    raw = pickle.dumps(Metadata(state_dict_metadata=state, storage_data=stored))
    path = tmp_path / METADATA_FILENAME
    columns = _columns(path, raw)
    assert columns is not None
    assert _plain(columns) == _plain(_loader(path, raw))
    tables = {fqn for fqn, t in columns.tensors.items() if isinstance(t.chunks, ChunkTable)}
    assert {"model.clean", "model.reversed", "model.descending"} <= tables
    assert [blob.file for _, blob in columns.orphan_blobs].count("__1_0.distcp") == 1  # optim.gone
    assert columns.tensors["model.repeated"].chunks[0].blob.file == "__1_0.distcp"


def test_records_in_another_field_order_or_split_by_frames_are_read_alike(tmp_path):
    """The C reader's fast path takes a chunk or storage entry laid out as torch pickles it and
    leaves anything else to its general parser: fields in another order (sizes before offsets,
    MetadataIndex's index first), transform_descriptors present, literal file names, FRAMEs
    falling inside records (a 300 kB pickle) and protocol 2's PUTs read as the loader reads them."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    def reordered(cls, **fields):
        record = object.__new__(cls)
        for name, value in fields.items():  # the pickled state keeps this order
            object.__setattr__(record, name, value)
        return record

    state, stored, end = {}, {}, 0
    for t in range(60):
        chunks = []
        for rank in range(24):
            offsets, sizes = torch.Size([rank, 0]), torch.Size([1, 5])
            chunks.append(reordered(ChunkStorageMetadata, sizes=sizes, offsets=offsets) if t % 3 == 1 else
                          ChunkStorageMetadata(offsets, sizes))
            key = (reordered(MetadataIndex, index=rank, offset=torch.Size(offsets), fqn=f"model.t{t}") if t % 3 == 2 else
                   MetadataIndex(f"model.t{t}", offsets, rank))
            info = _StorageInfo(f"__{rank}_0.distcp", end, 20)
            if t % 5 == 4:
                info.transform_descriptors = []
            stored[key] = info
            end += 20
        state[f"model.t{t}"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([24, 5]), chunks)
    metadata = Metadata(state_dict_metadata=state, storage_data=stored)
    path = tmp_path / METADATA_FILENAME
    for protocol in (2, 4):
        raw = pickle.dumps(metadata, protocol=protocol)
        assert protocol == 2 or raw.count(b"\x95") > 1  # frames
        columns = _columns(path, raw)
        assert columns is not None
        assert _plain(columns) == _plain(_loader(path, raw))
        assert all(isinstance(t.chunks, ChunkTable) for t in columns.tensors.values())
