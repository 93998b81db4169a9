"""A source whose records are all bad (a sparse data file: zeros where the records should be)
fails on the first chunk in (tensor, chunk) order, as locating each chunk alone does, after
locating about one record per data file, holding one error per file: keeping every chunk's
error (each with its traceback) grew to 10 GB at 3.5M chunks before the error was raised."""

from __future__ import annotations

import shutil

import pytest

from conftest import FIXTURES

from ckpttool.run import locating
from ckpttool.dcp.blobs import DataFiles, locate
from ckpttool.core.errors import CheckpointError
from ckpttool.plan import unique_chunks
from ckpttool.readers import dcp as dcp_reader
from ckpttool.readers.dcp import read_checkpoint


def zeroed_copy(source, destination):
    """`source` copied with every data file replaced by zeros of its size (a sparse file)."""
    shutil.copytree(source, destination)
    for path in destination.glob("*.distcp"):
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.truncate(0)
            handle.truncate(size)
    return destination


def first_error_alone(checkpoint) -> str:
    """The error of the first chunk, in (tensor, chunk) order, that fails when located alone."""
    with DataFiles(checkpoint.path) as files:
        for tensor in checkpoint.tensors.values():
            for index in unique_chunks(tensor):
                try:
                    locate(files, tensor, tensor.chunks[index])
                except CheckpointError as error:
                    return f"{type(error).__name__}: {error}"
    raise AssertionError("no chunk fails")


@pytest.mark.parametrize("tables", [False, True], ids=["chunk-tuples", "chunk-tables"])
def test_a_source_of_zeroed_records_fails_on_the_first_chunk_after_about_one_record_per_file(tables, tmp_path,
                                                                                               monkeypatch):
    if tables:  # read as a large `.metadata` is: every tensor's chunks a ChunkTable, located from columns
        monkeypatch.setattr(dcp_reader, "COLUMNS_FROM_BYTES", 0)
    source = zeroed_copy(FIXTURES / "fsdp2_world3_uneven", tmp_path / "zeroed")
    checkpoint = read_checkpoint(source)
    chunks = sum(len(unique_chunks(tensor)) for tensor in checkpoint.tensors.values())
    data_files = len(list(source.glob("*.distcp")))
    expected = first_error_alone(checkpoint)
    located_alone = []
    locate_one = locating._locate_one
    monkeypatch.setattr(locating, "_locate_one", lambda *args: located_alone.append(args) or locate_one(*args))
    for threads in (1, 4):
        located_alone.clear()
        with DataFiles(source) as files, pytest.raises(CheckpointError) as raised:
            locating.locate_chunks(files, checkpoint.tensors.values(), threads=threads)
        assert f"{type(raised.value).__name__}: {raised.value}" == expected
        # each file's walk stops at its first failure in job order (its records lie in that order)
        assert len(located_alone) <= 2 * data_files < chunks, (len(located_alone), data_files, chunks)


def test_a_sound_source_still_locates_every_chunk():
    """The early stop changes nothing when no chunk fails: every chunk is located."""
    checkpoint = read_checkpoint(FIXTURES / "fsdp2_world3_uneven")
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
        alone = {tensor.fqn: {index: locate(files, tensor, tensor.chunks[index]) for index in unique_chunks(tensor)}
                 for tensor in checkpoint.tensors.values()}
    assert {fqn: dict(found) for fqn, found in located.items()} == alone
