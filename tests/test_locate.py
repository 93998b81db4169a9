"""Locating chunks' raw bytes: one task per data file walks its records in offset order,
reading neighbouring records' headers together, with the same results as locating each
chunk alone."""

from __future__ import annotations

import pytest

from conftest import FIXTURES

from ckpttool.run import locating
from ckpttool.dcp.blobs import DataFiles, locate
from ckpttool.core.errors import CheckpointError, CorruptBlob
from ckpttool.plan import unique_chunks
from ckpttool.readers.dcp import read_checkpoint


@pytest.fixture(scope="module")
def many_small_tensors(tmp_path_factory):
    """A checkpoint from torch's own dcp.save with 300 small tensors: 300 records in one file."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("locate") / "many"
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(3 + i % 5, 7, generator=generator) for i in range(300)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True))
    return path


def one_by_one(files: DataFiles, checkpoint) -> dict:
    return {tensor.fqn: {index: locate(files, tensor, tensor.chunks[index]) for index in unique_chunks(tensor)}
            for tensor in checkpoint.tensors.values()}


def counting_tasks(monkeypatch) -> list[int]:
    counts = []
    run_each = locating.run_each

    def counted(tasks, threads):
        counts.append(len(tasks))
        return run_each(tasks, threads)

    monkeypatch.setattr(locating, "run_each", counted)
    return counts


def test_many_chunks_of_one_file_are_located_by_one_task_with_few_reads(many_small_tensors, monkeypatch):
    checkpoint = read_checkpoint(many_small_tensors)
    assert {chunk.blob.file for tensor in checkpoint.tensors.values() for chunk in tensor.chunks} == {"__0_0.distcp"}
    with DataFiles(checkpoint.path) as files:
        expected = one_by_one(files, checkpoint)
    counts = counting_tasks(monkeypatch)
    reads = []
    read = DataFiles.read
    monkeypatch.setattr(DataFiles, "read", lambda self, *args: reads.append(args) or read(self, *args))
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values(), threads=4)
    assert counts == [1]
    assert located == expected and len(expected) == 300
    assert len(reads) < 10  # 300 records, their headers in a few windows


@pytest.mark.parametrize("name", ["fsdp2_world2_adamw", "fsdp2_world3_uneven"])
def test_locating_runs_one_task_per_data_file_and_finds_what_each_chunk_alone_finds(name, monkeypatch):
    checkpoint = read_checkpoint(FIXTURES / name)
    with DataFiles(checkpoint.path) as files:
        expected = one_by_one(files, checkpoint)
    counts = counting_tasks(monkeypatch)
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values(), threads=2)
    data_files = {chunk.blob.file for tensor in checkpoint.tensors.values() for chunk in tensor.chunks}
    assert counts == [len(data_files)] and located == expected


def test_of_several_bad_records_the_error_names_the_first_chunk_in_order(many_small_tensors, tmp_path):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(many_small_tensors, copy)
    checkpoint = read_checkpoint(copy)
    tensors = list(checkpoint.tensors.values())
    # damage the last record in the file, then one before it: the first tensor in order wins
    by_offset = sorted(tensors, key=lambda tensor: tensor.chunks[0].blob.offset)
    late, early = by_offset[-1], by_offset[100]
    first = min((late, early), key=tensors.index)
    with open(copy / "__0_0.distcp", "r+b") as handle:
        for tensor in (late, early):
            blob = tensor.chunks[0].blob
            handle.seek(blob.offset + blob.length - 22)  # the zip end record
            handle.write(b"\0" * 22)
    with DataFiles(copy) as files:
        with pytest.raises(CorruptBlob) as alone:
            for tensor in tensors:
                locate(files, tensor, tensor.chunks[0])
        with pytest.raises(CorruptBlob) as together:
            locating.locate_chunks(files, tensors, threads=4)
    assert str(together.value) == str(alone.value) and first.fqn in str(together.value)



def test_small_records_lying_close_together_are_checked_a_block_at_a_time(many_small_tensors, monkeypatch):
    checkpoint = read_checkpoint(many_small_tensors)
    with DataFiles(checkpoint.path) as files:
        expected = one_by_one(files, checkpoint)
    alone = []
    locate_one = locating._locate_one
    monkeypatch.setattr(locating, "_locate_one", lambda *args: alone.append(args) or locate_one(*args))
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values(), threads=1)
    assert located == expected
    assert len(alone) <= 10  # 300 records of five shapes: one parse per layout, the rest compared as arrays


def test_records_damaged_anywhere_in_a_block_give_what_locating_each_chunk_alone_gives(many_small_tensors, tmp_path):
    import random
    import shutil

    rng = random.Random(3)
    copy = tmp_path / "damaged"
    shutil.copytree(many_small_tensors, copy)
    checkpoint = read_checkpoint(copy)
    blobs = sorted((chunk.blob for tensor in checkpoint.tensors.values() for chunk in tensor.chunks),
                   key=lambda blob: blob.offset)
    original = (copy / "__0_0.distcp").read_bytes()
    outcomes = set()
    for trial in range(40):
        data = bytearray(original)
        for blob in rng.sample(blobs[1:], rng.choice((1, 2, 5))):  # never the first: it is parsed alone
            for _ in range(rng.choice((1, 3))):
                data[blob.offset + rng.randrange(blob.length)] = rng.randrange(256)
        (copy / "__0_0.distcp").write_bytes(bytes(data))
        results = []
        for locate_all in (lambda files: one_by_one(files, checkpoint),
                           lambda files: locating.locate_chunks(files, checkpoint.tensors.values(), threads=1)):
            with DataFiles(copy) as files:
                try:
                    results.append(locate_all(files))
                except CheckpointError as error:
                    results.append(f"{type(error).__name__}: {error}")
        assert results[0] == results[1], trial
        outcomes.add(type(results[0]))
    assert outcomes == {dict, str}  # both kinds of outcome were met


# ChunkTable tensors (what a large `.metadata` is read into) are located from their columns:
# the same results and errors as locating each chunk alone, on real and damaged checkpoints.


def read_as_tables(path, monkeypatch):
    """The checkpoint at `path` read as a large `.metadata` is: every tensor's chunks a ChunkTable."""
    from ckpttool.core.checkpoint import ChunkTable
    from ckpttool.readers import dcp as dcp_reader

    monkeypatch.setattr(dcp_reader, "COLUMNS_FROM_BYTES", 0)
    checkpoint = read_checkpoint(path)
    assert checkpoint.tensors and all(isinstance(t.chunks, ChunkTable) for t in checkpoint.tensors.values())
    return checkpoint


def outcome(locating, path) -> dict | str:
    with DataFiles(path) as files:
        try:
            return locating(files)
        except CheckpointError as error:
            return f"{type(error).__name__}: {error}"


def both_ways(checkpoint, path=None, threads: int = 2) -> tuple:
    """(locating each chunk alone, in job order; locate_chunks), each a Located or the error."""
    path = path or checkpoint.path
    return (outcome(lambda files: one_by_one(files, checkpoint), path),
            outcome(lambda files: locating.locate_chunks(files, checkpoint.tensors.values(), threads=threads), path))


@pytest.fixture(scope="module")
def interleaved_tables(tmp_path_factory):
    """torch's dcp.save of 240 interleaved tensors of six dtypes and five shapes (0-d to 3-d):
    240 records of many layouts in one file."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("locate-tables") / "interleaved"
    generator = torch.Generator().manual_seed(1)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.float64)
    shapes = ((5, 7), (3,), (), (2, 3, 4), (4, 7))
    state = {}
    for i in range(240):
        value = torch.randn(shapes[i % len(shapes)], generator=generator) * 100
        state[f"layers.{i:03d}.{'weight' if i % 2 else 'bias'}"] = value.to(dtypes[i % len(dtypes)])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True))
    return path


@pytest.fixture(scope="module")
def world4_tables(tmp_path_factory):
    """A checkpoint of 40 small tensors saved by 4 real gloo ranks (dcp_world): 4 files of 41 records."""
    import dcp_world

    return dcp_world.write_forked(tmp_path_factory.mktemp("locate-world") / "w4", world=4, tensors=40, rows=16, columns=8)


def counting_alone(monkeypatch) -> list:
    alone = []
    locate_one = locating._locate_one
    monkeypatch.setattr(locating, "_locate_one", lambda *args: alone.append(args) or locate_one(*args))
    return alone


@pytest.mark.parametrize("source", ["interleaved", "world4", "fsdp2_world2_adamw", "fsdp2_world3_uneven", "fsdp2_world2_bf16"])
def test_chunk_tables_are_located_from_columns_as_each_chunk_alone(source, interleaved_tables, world4_tables, monkeypatch):
    path = {"interleaved": interleaved_tables, "world4": world4_tables}.get(source, FIXTURES / source)
    checkpoint = read_as_tables(path, monkeypatch)
    alone_first, together = both_ways(checkpoint)
    assert isinstance(together, dict) and together == alone_first
    assert sum(len(found) for found in together.values()) > 0
    # and the same as the chunk walk gives the same tensors as chunk tuples
    tuples = [replace_chunks(tensor, tuple(tensor.chunks)) for tensor in checkpoint.tensors.values()]
    with DataFiles(path) as files:
        assert locating.locate_chunks(files, tuples, threads=2) == together


def replace_chunks(tensor, chunks):
    from ckpttool.core.checkpoint import Tensor

    return Tensor(tensor.fqn, tensor.dtype, tensor.shape, chunks)


def test_records_of_tables_are_compared_as_arrays_one_parse_per_layout(interleaved_tables, world4_tables, monkeypatch):
    for path, most in ((interleaved_tables, 30), (world4_tables, 2)):
        checkpoint = read_as_tables(path, monkeypatch)
        expected = both_ways(checkpoint)[0]
        alone = counting_alone(monkeypatch)
        with DataFiles(path) as files:
            located = locating.locate_chunks(files, checkpoint.tensors.values(), threads=1)
        assert located == expected
        chunks = sum(len(found) for found in located.values())
        # 240 records of 30 layouts / 164 records of 2 layouts (rows and the bias), parsed once each per thread
        assert chunks > 150 and len(alone) <= most, (chunks, len(alone))
        monkeypatch.undo()


def test_tables_mixed_with_chunk_tuples_keep_job_order(interleaved_tables, monkeypatch):
    checkpoint = read_as_tables(interleaved_tables, monkeypatch)
    tensors = [replace_chunks(t, tuple(t.chunks)) if n % 3 == 0 else t for n, t in enumerate(checkpoint.tensors.values())]
    mixed = dataclasses_replace(checkpoint, {t.fqn: t for t in tensors})
    assert both_ways(mixed)[0] == both_ways(mixed)[1]
    # a bad record in each kind: the first in job order is raised, whichever path found it
    import shutil

    copy = interleaved_tables.parent / "mixed-damaged"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(interleaved_tables, copy)
    chosen = [tensors[10], tensors[9]]  # a table, then a tuple tensor (9 % 3 == 0)
    with open(copy / "__0_0.distcp", "r+b") as handle:
        for tensor in chosen:
            blob = tensor.chunks[0].blob
            handle.seek(blob.offset + blob.length - 22)
            handle.write(b"\0" * 22)
    first, together = both_ways(mixed, copy)
    assert isinstance(first, str) and first == together and tensors[9].fqn in first


def dataclasses_replace(checkpoint, tensors):
    import dataclasses

    return dataclasses.replace(checkpoint, tensors=tensors)


def with_columns(checkpoint, change) -> object:
    """`checkpoint` with each table's columns passed through `change(fqn, columns)` (a dict of
    copies of `blob_offset`, `blob_length`, ... it may modify)."""
    from ckpttool.core.checkpoint import ChunkTable

    tensors = {}
    for fqn, tensor in checkpoint.tensors.items():
        table = tensor.chunks
        columns = {name: getattr(table, name).copy() for name in ("offsets", "sizes", "file", "blob_offset", "blob_length")}
        change(fqn, columns)
        tensors[fqn] = replace_chunks(tensor, ChunkTable(**columns, files=table.files))
    return dataclasses_replace(checkpoint, tensors)


@pytest.mark.parametrize("source,form", [("interleaved", "tables"), ("world4", "tables"), ("interleaved", "tuples")])
def test_damaged_records_of_tables_give_what_locating_each_chunk_alone_gives(source, form, interleaved_tables, world4_tables,
                                                                             monkeypatch, tmp_path):
    """Mutants: bytes changed in record headers and tails, anywhere in records, lengths and
    offsets that disagree with the records (overlapping ones), truncated files. The same
    mutants as chunk tuples check the chunk walk (a truncated file once raised the error of
    re-reading a parsed layout's ranges, not that of the parse locating alone makes)."""
    import random
    import shutil

    path = {"interleaved": interleaved_tables, "world4": world4_tables}[source]
    checkpoint = read_as_tables(path, monkeypatch)
    copy = tmp_path / "damaged"
    shutil.copytree(path, copy)
    files = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    originals = {name: (path / name).read_bytes() for name in files}
    with DataFiles(path) as data:
        raws = {(fqn, index): raw for fqn, found in one_by_one(data, checkpoint).items() for index, raw in found.items()}
    records = [(tensor.chunks[index].blob, raws[(fqn, index)]) for fqn, tensor in checkpoint.tensors.items()
               for index in unique_chunks(tensor)]
    rng = random.Random(21)
    kinds: dict[str, set] = {}
    for trial in range(60):
        kind = ("header", "anywhere", "length", "overlap", "truncated")[trial % 5]
        datas = {name: bytearray(data) for name, data in originals.items()}
        damaged = checkpoint
        if kind in ("header", "anywhere"):
            for blob, raw in rng.sample(records, rng.choice((1, 2, 6))):
                for _ in range(rng.choice((1, 3))):
                    if kind == "header":  # outside the data: what parsing reads
                        at = rng.choice((rng.randrange(blob.offset, raw.offset), rng.randrange(raw.offset + raw.length, blob.offset + blob.length)))
                    else:
                        at = blob.offset + rng.randrange(blob.length)
                    datas[blob.file][at] = rng.randrange(256)
        elif kind in ("length", "overlap"):
            picked = set(rng.sample(sorted(checkpoint.tensors), rng.choice((1, 3))))

            def change(fqn, columns, kind=kind, picked=picked):
                if fqn not in picked or not len(columns["blob_length"]):
                    return
                row = rng.randrange(len(columns["blob_length"]))
                if kind == "length":
                    columns["blob_length"][row] += rng.choice((-300, -22, -1, 1, 8, 4096))
                else:  # start inside the record before (or after) it
                    columns["blob_offset"][row] += rng.choice((-1000, -64, -1, 1, 64))
            damaged = with_columns(checkpoint, change)
        else:
            name = rng.choice(files)
            datas[name] = datas[name][:rng.randrange(len(datas[name]))]
        for name, data in datas.items():
            (copy / name).write_bytes(bytes(data))
        if form == "tuples":
            damaged = dataclasses_replace(damaged, {fqn: replace_chunks(t, tuple(t.chunks)) for fqn, t in damaged.tensors.items()})
        first, together = both_ways(damaged, copy, threads=rng.choice((1, 3)))
        assert first == together, (trial, kind)
        kinds.setdefault(kind, set()).add(type(first))
    assert all(str in outcomes for outcomes in kinds.values()), kinds  # every kind of damage met an error
    assert any(dict in outcomes for outcomes in kinds.values())


def test_unique_table_rows_are_unique_chunks_of_each_table():
    import random

    import numpy as np

    from ckpttool.core.checkpoint import Blob, Chunk, ChunkTable, Tensor
    from ckpttool.plan import unique_table_rows

    rng = random.Random(5)
    tables = []
    for _ in range(200):
        ndim = rng.choice((0, 1, 2, 3))
        chunks = []
        for _ in range(rng.randrange(0, 8)):
            offsets = tuple(rng.randrange(3) for _ in range(ndim))
            sizes = tuple(rng.choice((0, 1, 2)) for _ in range(ndim))
            chunks.append(Chunk(offsets, sizes, Blob("f", rng.randrange(100), 10)))
        table = ChunkTable.from_chunks(chunks, ndim)
        if rng.random() < 0.3 and len(chunks) > 1:  # rows out of order: no sorting is assumed
            order = np.array(rng.sample(range(len(chunks)), len(chunks)))
            table = ChunkTable(table.offsets[order], table.sizes[order], table.file[order], table.blob_offset[order],
                               table.blob_length[order], table.files)
        tables.append(table)
    found = unique_table_rows(tables)
    for table, rows in zip(tables, found):
        assert rows.tolist() == unique_chunks(Tensor("t", "float32", (9,) * table.offsets.shape[1], tuple(table)))


@pytest.mark.parametrize("offset,length", [((1 << 63) - 100, 1000), (-5, 1000), (100, (1 << 63) - 1), (0, 0), (10 ** 12, 64)])
def test_hostile_numbers_in_table_columns_give_what_locating_alone_gives(offset, length, interleaved_tables, monkeypatch):
    checkpoint = read_as_tables(interleaved_tables, monkeypatch)
    victims = {"layers.050.bias", "layers.051.weight"}

    def change(fqn, columns):
        if fqn in victims:
            columns["blob_offset"][0], columns["blob_length"][0] = offset, length

    damaged = with_columns(checkpoint, change)
    first, together = both_ways(damaged, interleaved_tables)
    assert isinstance(first, str) and first == together  # (the message is what locating alone says, whatever it names)


def test_more_layouts_than_are_kept_still_locate_as_each_chunk_alone(interleaved_tables, world4_tables, monkeypatch):
    """Past ParsedRecords.MAX_LAYOUTS a record of a new layout is parsed alone, and a walk that
    finds its thread's layouts full starts afresh: the results stay those of locating alone."""
    from ckpttool.torchsave.record import ParsedRecords

    monkeypatch.setattr(ParsedRecords, "MAX_LAYOUTS", 2)
    for path in (interleaved_tables, world4_tables):
        checkpoint = read_as_tables(path, monkeypatch)
        first, together = both_ways(checkpoint, threads=1)
        assert isinstance(together, dict) and first == together
