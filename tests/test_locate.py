"""Locating chunks' raw bytes: one task per data file walks its records in offset order,
reading neighbouring records' headers together, with the same results as locating each
chunk alone."""

from __future__ import annotations

import pytest

from conftest import FIXTURES

from ckpttool import execute
from ckpttool.dcp.blobs import DataFiles, locate
from ckpttool.errors import CheckpointError, CorruptBlob
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
    run_each = execute.run_each

    def counted(tasks, threads):
        counts.append(len(tasks))
        return run_each(tasks, threads)

    monkeypatch.setattr(execute, "run_each", counted)
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
        located = execute.locate_chunks(files, checkpoint.tensors.values(), threads=4)
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
        located = execute.locate_chunks(files, checkpoint.tensors.values(), threads=2)
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
            execute.locate_chunks(files, tensors, threads=4)
    assert str(together.value) == str(alone.value) and first.fqn in str(together.value)



def test_small_records_lying_close_together_are_checked_a_block_at_a_time(many_small_tensors, monkeypatch):
    checkpoint = read_checkpoint(many_small_tensors)
    with DataFiles(checkpoint.path) as files:
        expected = one_by_one(files, checkpoint)
    alone = []
    locate_one = execute._locate_one
    monkeypatch.setattr(execute, "_locate_one", lambda *args: alone.append(args) or locate_one(*args))
    with DataFiles(checkpoint.path) as files:
        located = execute.locate_chunks(files, checkpoint.tensors.values(), threads=1)
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
        for locating in (lambda files: one_by_one(files, checkpoint),
                         lambda files: execute.locate_chunks(files, checkpoint.tensors.values(), threads=1)):
            with DataFiles(copy) as files:
                try:
                    results.append(locating(files))
                except CheckpointError as error:
                    results.append(f"{type(error).__name__}: {error}")
        assert results[0] == results[1], trial
        outcomes.add(type(results[0]))
    assert outcomes == {dict, str}  # both kinds of outcome were met
