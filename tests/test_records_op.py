"""A Records operation (reshard's many small records, as columns) writes exactly what its
`records()` write, one Record at a time: from local files in a few large reads and writes,
elsewhere (remote sources, output objects) as those records."""

from __future__ import annotations

import io
import os
import shutil
import typing

import pytest

from conftest import assert_same_bytes

from ckpttool.run import distributed, execute, locating, record_writes
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CorruptBlob, VerificationFailed
from ckpttool.plan.operations import Record, Records
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.torchsave.record import record_layout

RUN = dict(threads=4, max_memory=64 << 20)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """torch's own dcp.save of mixed dtypes and shapes (0-d to 3-d), one file per tensor:
    (checkpoint path, state)."""
    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    state = {
        "scalar": torch.tensor(2.5),
        "bias": torch.randn(9, generator=generator).to(torch.bfloat16),
        "weight": torch.randn(6, 5, generator=generator).to(torch.float16),
        "cube": torch.arange(4 * 3 * 2, dtype=torch.int64).reshape(4, 3, 2),
        "rows": torch.randn(7, 4, generator=generator),
    }
    path = tmp_path_factory.mktemp("records") / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False), no_dist=True)
    return path, state


def slab_records(path, dst: str = "out", offset: int = 0, parts: int = 2) -> tuple[Records, list[tuple[str, slice]]]:
    """A Records op of every tensor cut into `parts` dim-0 slabs (0-d: whole), in reverse
    source order (the executor sorts its reads); with the (fqn, rows) each record holds."""
    checkpoint = read_checkpoint(path)
    with DataFiles(checkpoint.path) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values())
    shapes: list = []
    columns: dict[str, list] = {name: [] for name in ("kind", "fqn", "start", "src", "src_offset")}
    held = []
    for fqn, tensor in sorted(checkpoint.tensors.items(), reverse=True):
        raw = located[fqn][0]
        shape = tuple(tensor.shape)
        rows = shape[0] if shape else 1
        row_bytes = raw.length // rows
        cuts = sorted({rows * k // parts for k in range(parts + 1)})
        for begin, end in reversed(list(zip(cuts, cuts[1:]))):
            piece = ((end - begin, *shape[1:]) if shape else ())
            key = (tensor.dtype, piece)
            if key not in shapes:
                shapes.append(key)
            for name, value in zip(columns, (shapes.index(key), fqn, begin, raw.file, raw.offset + begin * row_bytes)):
                columns[name].append(value)
            held.append((fqn, slice(begin, end) if shape else ()))
    op = Records(dst, offset, tuple(shapes), *(tuple(values) for values in columns.values()))
    return op, held


def written(path, operations, tmp_path, name: str) -> bytes:
    out = tmp_path / name
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with DataFiles(path) as files:
            execute.run(operations, files, {"out": fd}, **RUN)
    finally:
        os.close(fd)
    return out.read_bytes()


def test_records_write_the_same_bytes_as_their_records_and_each_loads_as_its_slab(saved, tmp_path):
    import torch

    path, state = saved
    op, held = slab_records(path, offset=100)
    assert len(op.shapes) > 4 and len({*op.src}) == 5
    fast = written(path, [op], tmp_path, "records")
    slow = written(path, op.records(), tmp_path, "record")
    assert fast == slow and len(fast) == 100 + op.length
    for record, (fqn, rows) in zip(op.records(), held):
        data = fast[record.offset:record.offset + record_layout(record.dtype, record.shape).length]
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert_same_bytes(loaded, state[fqn][rows].contiguous(), fqn)


def test_records_from_few_large_reads_and_writes(saved, tmp_path, monkeypatch):
    path, _ = saved
    op, _ = slab_records(path, parts=3)
    reads, writes = [], []
    read_into, write_pieces = DataFiles.read_into, record_writes._write_pieces
    monkeypatch.setattr(DataFiles, "read_into", lambda self, *args: reads.append(args[:2]) or read_into(self, *args))
    monkeypatch.setattr(record_writes, "_write_pieces", lambda *args: writes.append(args[2]) or write_pieces(*args))
    written(path, [op], tmp_path, "records")
    assert len(reads) == len({*op.src}) < len(op), "one read per source file: its runs lie close together"
    assert writes == [0], "the whole output in one write"


def test_a_records_op_runs_as_one_task_of_its_own():
    op = Records("out", 0, (("float32", (2,)),), (0,) * 3, ("a",) * 3, (0, 2, 4), ("f",) * 3, (0, 8, 16))
    assert [len(batch) for batch in execute.batches([op, op])] == [1, 1]
    assert execute.first_offset(op) == 0
    assert execute.source_ranges(op) == [("f", 0, 8), ("f", 8, 16), ("f", 16, 24)]


def test_a_truncated_source_raises_corrupt_blob_naming_the_file(saved, tmp_path):
    path, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    op, _ = slab_records(copy)
    victim = op.src[0]
    with open(copy / victim, "r+b") as handle:
        handle.truncate(op.src_offset[0] + 1)
    with pytest.raises(CorruptBlob, match=f"{copy / victim}: byte range .* beyond the file"):
        written(copy, [op], tmp_path, "records")


def test_verify_names_the_fqn_and_chunk_of_a_flipped_output_byte(saved, tmp_path):
    path, _ = saved
    op, held = slab_records(path)
    out = tmp_path / "out"
    out.write_bytes(written(path, [op], tmp_path, "records"))
    record = op.records()[3]
    flipped = bytearray(out.read_bytes())
    flipped[record.parts[0].dst_offset + 1] ^= 1  # in its data
    out.write_bytes(flipped)
    describe = lambda r: f"{r.fqn} chunk at {list(r.chunk_offsets)}" if isinstance(r, Record) else "?"  # noqa: E731
    fd = os.open(out, os.O_RDONLY)
    try:
        with DataFiles(path) as files, pytest.raises(VerificationFailed, match=rf"^{held[3][0]} chunk at \["):
            execute.verify([op], files, {"out": fd}, describe=describe, **RUN)
    finally:
        os.close(fd)


def test_an_intact_records_output_is_verified_a_block_at_a_time_not_record_by_record(saved, tmp_path, monkeypatch):
    path, _ = saved
    op, _ = slab_records(path)
    out = tmp_path / "out"
    out.write_bytes(written(path, [op], tmp_path, "records"))
    per_record = []
    compare = execute._compare
    monkeypatch.setattr(execute, "_compare", lambda *args: per_record.append(args) or compare(*args))
    fd = os.open(out, os.O_RDONLY)
    try:
        with DataFiles(path) as files:
            execute.verify([op], files, {"out": fd}, describe=lambda r: "?", **RUN)
    finally:
        os.close(fd)
    assert per_record == []  # the record-by-record comparison only runs to name a difference


def test_split_keeps_a_records_op_whole_on_one_rank(saved):
    op, _ = slab_records(saved[0])
    shares = distributed.split([op], 3)
    assert sorted(len(share) for share in shares) == [0, 0, 1]
    assert [o for share in shares for o in share] == [op]


class Sink:
    """An output object without an fd, as a remote upload is."""

    def __init__(self):
        self.data = bytearray()

    def write_at(self, data, offset: int) -> None:
        end = offset + len(data)
        self.data.extend(bytes(max(0, end - len(self.data))))
        self.data[offset:end] = data


def test_into_an_output_object_records_write_what_their_records_write(saved, tmp_path):
    path, _ = saved
    op, _ = slab_records(path)
    sink = Sink()
    with DataFiles(path) as files:
        assert not record_writes.runs_fast(op, files, {"out": sink})
        execute.run([op], files, {"out": sink}, **RUN)
    assert bytes(sink.data) == written(path, op.records(), tmp_path, "record")


def test_from_a_remote_source_records_are_expanded_into_their_records(saved):
    op, _ = slab_records(saved[0])
    with DataFiles("s3://bucket/ckpt") as files:  # nothing is fetched: no request is made
        assert not files.local
        assert list(record_writes.expanded([op], files, {"out": 3})) == op.records()


def test_a_short_vectored_write_is_completed(saved, tmp_path, monkeypatch):
    path, _ = saved
    op, _ = slab_records(path)
    pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, pieces, offset: pwritev(fd, pieces[:2], offset))
    assert written(path, [op], tmp_path, "records") == written(path, op.records(), tmp_path, "record")


# ---------------------------------------------------------------------------------------------
# A large record of copies (a chunk straddling source chunks): copied in the kernel, its CRC-32
# combined from those torch.save stored


@pytest.mark.parametrize("seed", range(4))
def test_crc32_of_joined_and_cut_bytes_follows_from_the_crcs_of_their_parts(seed):
    import random
    import zlib

    from ckpttool.torchsave.crc32 import crc32_combine, crc32_remove_prefix, crc32_remove_suffix, crc32_slice

    rng = random.Random(seed)
    for _ in range(50):
        whole = rng.randbytes(rng.choice([0, 1, 7, 4096, rng.randrange(1, 70000)]))
        start = rng.randrange(len(whole) + 1)
        end = rng.randrange(start, len(whole) + 1)
        before, part, after = whole[:start], whole[start:end], whole[end:]
        crc = zlib.crc32
        assert crc32_combine(crc(before), crc(part + after), len(part + after)) == crc(whole)
        assert crc32_remove_suffix(crc(whole), crc(after), len(after)) == crc(before + part)
        assert crc32_remove_prefix(crc(whole), crc(before), len(part + after)) == crc(part + after)
        assert crc32_slice(crc(whole), crc(before), crc(after), len(part), len(after)) == crc(part)


def straddling_record(path, dst: str = "out", offset: int = 64, wrong_stored_crc: bool = False) -> Record:
    """A (13, 4) float32 Record of `rows`' data whole, then its rows 0..4, then its row 6, its
    parts listed in reverse: the first part has the stored CRC-32, the second one the stored
    CRC-32 of the record it is cut from (2 rows left: less to sum than its 5), the third too
    (6 rows left: it is summed itself)."""
    import dataclasses

    from ckpttool.plan.operations import Copy

    checkpoint = read_checkpoint(path)
    with DataFiles(checkpoint.path) as files:
        raw = locating.locate_chunks(files, checkpoint.tensors.values())["rows"][0]
    if wrong_stored_crc:
        raw = dataclasses.replace(raw, crc32=raw.crc32 ^ 1)
    row = raw.length // 7
    layout = record_layout("float32", (13, 4))
    at = offset + layout.data_offset
    parts = (Copy(raw.file, raw.offset, dst, at, raw.length, raw.crc32),
             Copy(raw.file, raw.offset, dst, at + 7 * row, 5 * row, within=raw),
             Copy(raw.file, raw.offset + 6 * row, dst, at + 12 * row, row, within=raw))
    return Record(dst, offset, "rows", (0, 0), "float32", (13, 4), tuple(reversed(parts)))


def streamed(op: Record, files: DataFiles) -> bytes:
    """What the general path writes for `op` (head, data read and summed block by block, tail), end to end."""
    return b"".join(bytes(block) for _, block in execute._blocks(op, files))


def test_a_record_of_copies_is_written_in_the_kernel_with_the_bytes_the_general_path_writes(saved, tmp_path, monkeypatch):
    import torch

    path, state = saved
    record = straddling_record(path)
    copies, summed = [], []
    copy_range, source_crc = record_writes.copy_range, record_writes.source_crc
    monkeypatch.setattr(record_writes, "copy_range", lambda *args: copies.append(args[4]) or copy_range(*args))
    monkeypatch.setattr(record_writes, "source_crc", lambda *args: summed.append(args[3]) or source_crc(*args))
    monkeypatch.setattr(execute, "SMALL_OPERATION", 0)  # not built whole in memory: a large record's path
    out = written(path, [record], tmp_path, "record")
    row = 4 * 4
    assert sorted(copies) == [row, 5 * row, 7 * row]  # every part in the kernel
    assert sorted(summed) == [0, row, 2 * row]  # the rows before and after the cut of 5, and the row of 1
    with DataFiles(path) as files:
        assert out[record.offset:] == streamed(record, files)
    rows = state["rows"]
    loaded = torch.load(io.BytesIO(out[record.offset:]), weights_only=True)
    assert_same_bytes(loaded, torch.cat([rows, rows[:5], rows[6:]]))


def test_a_cut_record_crc_comes_from_the_stored_one_and_verify_catches_a_wrong_stored_crc(saved, tmp_path):
    import zlib

    path, _ = saved
    record = straddling_record(path, wrong_stored_crc=True)
    out = tmp_path / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with DataFiles(path) as files:
            record_writes.write_record(record, files, fd)
            layout = record_layout(record.dtype, record.shape)
            data = os.pread(fd, layout.data_length, record.offset + layout.data_offset)
            assert os.pread(fd, len(layout.tail(0)), record.offset + layout.data_offset + layout.data_length) \
                != layout.tail(zlib.crc32(data)), "the stored CRC-32 is taken, not summed"
            with pytest.raises(VerificationFailed, match="^rows differs"):
                execute.verify([record], files, {"out": fd}, describe=lambda op: op.fqn, **RUN)
    finally:
        os.close(fd)


def test_a_stored_crc_of_zero_is_not_taken(saved, tmp_path):
    """torch.save writes 0 in every CRC-32 field under torch.serialization.set_crc32_options(False)."""
    import dataclasses
    import zlib

    from ckpttool.plan.operations import Copy

    path, _ = saved
    record = straddling_record(path)
    with DataFiles(path) as files:
        for part in record.parts:
            part = typing.cast(Copy, part)
            unstored = dataclasses.replace(part, crc32=0 if part.crc32 is not None else None,
                                           within=dataclasses.replace(part.within, crc32=0) if part.within else None)
            assert record_writes.copy_crc(unstored, files) == zlib.crc32(files.read(part.src, part.src_offset, part.length))


def test_output_crc_reads_back_where_a_stored_crc_is_zero(tmp_path):
    """consolidate's .pt tensors: CRC-32s combined from the stored ones, but not from a 0."""
    import zlib

    from ckpttool.plan.operations import Copy

    out = tmp_path / "out"
    out.write_bytes(b"x" * 8 + b"abcdef")
    parts = [Copy("src", 0, "out", 8, 3, zlib.crc32(b"abc")), Copy("src", 3, "out", 11, 3, zlib.crc32(b"def"))]
    fd = os.open(out, os.O_RDONLY)
    try:
        assert execute.output_crc(fd, 8, 6, parts) == zlib.crc32(b"abcdef")
        unstored = [parts[0], Copy("src", 3, "out", 11, 3, 0)]
        assert execute.output_crc(fd, 8, 6, unstored) == zlib.crc32(b"abcdef")
        wrong = [parts[0], Copy("src", 3, "out", 11, 3, zlib.crc32(b"xyz"))]
        assert execute.output_crc(fd, 8, 6, wrong) != zlib.crc32(b"abcdef"), "a stored CRC-32 is taken as it is"
    finally:
        os.close(fd)


def permuted_rows_record(path, dst: str = "out", offset: int = 64) -> Record:
    """A (7, 4) float32 Record of `rows`' rows in the order 0, 4, 1, 5, 2, 6, 3 (a rotary
    head's halves interleaved, as import --to torchtitan lays q and k), one Copy per row,
    none of which a stored CRC-32 covers: each is cut from the middle of the source record."""
    import dataclasses

    from ckpttool.plan.operations import Copy

    checkpoint = read_checkpoint(path)
    with DataFiles(checkpoint.path) as files:
        raw = locating.locate_chunks(files, checkpoint.tensors.values())["rows"][0]
    raw = dataclasses.replace(raw, crc32=None)  # as a safetensors source: no stored CRC-32
    row = raw.length // 7
    layout = record_layout("float32", (7, 4))
    at = offset + layout.data_offset
    order = [0, 4, 1, 5, 2, 6, 3]
    parts = tuple(Copy(raw.file, raw.offset + source * row, dst, at + number * row, row, within=raw)
                  for number, source in enumerate(order))
    return Record(dst, offset, "rows", (0, 0), "float32", (7, 4), parts)


def test_a_record_of_short_rows_is_read_in_one_span_and_written_from_memory(saved, tmp_path, monkeypatch):
    """Per row, a copy_file_range, a read for its CRC-32 and a CRC-32 combine cost more than
    the row (30k rows of 4 KiB in a 1.3 GB Llama import): the rows are read as one span,
    laid out and summed in memory, and written at once; the bytes are the general path's."""
    import torch

    path, state = saved
    record = permuted_rows_record(path)
    assert [len(group) for group in record_writes.copy_groups(record.parts)] == [7]
    copies, summed = [], []
    copy_range, source_crc = record_writes.copy_range, record_writes.source_crc
    monkeypatch.setattr(record_writes, "copy_range", lambda *args: copies.append(args[4]) or copy_range(*args))
    monkeypatch.setattr(record_writes, "source_crc", lambda *args: summed.append(args[3]) or source_crc(*args))
    monkeypatch.setattr(execute, "SMALL_OPERATION", 0)  # not built whole in memory: a large record's path
    out = written(path, [record], tmp_path, "record")
    assert copies == [] and summed == []
    with DataFiles(path) as files:
        assert out[record.offset:] == streamed(record, files)
    loaded = torch.load(io.BytesIO(out[record.offset:]), weights_only=True)
    assert_same_bytes(loaded, state["rows"][[0, 4, 1, 5, 2, 6, 3]])
    monkeypatch.setattr(execute, "SMALL_OPERATION", 1 << 20)  # a small record, built whole: the same bytes
    assert written(path, [record], tmp_path, "small") == out


def test_short_copies_far_apart_or_with_a_stored_crc_are_not_gathered():
    from ckpttool.plan.operations import GATHER_SPAN, GATHER_WINDOW, Copy

    row = 4096
    near = [Copy("a", n * 2 * row, "out", n * row, row) for n in range(3)]
    assert [len(group) for group in record_writes.copy_groups(near)] == [3]
    far = [Copy("a", 0, "out", 0, row), Copy("a", GATHER_WINDOW + GATHER_SPAN, "out", row, row)]
    assert [len(group) for group in record_writes.copy_groups(far)] == [1, 1]
    stored = [Copy("a", 0, "out", 0, row, crc32=1), Copy("a", row, "out", row, row)]
    assert [len(group) for group in record_writes.copy_groups(stored)] == [1, 1]
    files = [Copy(name, 0, "out", n * row, row) for n, name in enumerate("abcdefghi")]  # one more than GATHER_FILES
    assert [len(group) for group in record_writes.copy_groups(files)] == [8, 1]


def test_the_row_pieces_of_tensor_parallel_ranks_are_gathered_from_a_span_of_each_file(tmp_path):
    """A weight cut on dim 1 gives each output row a piece from each rank's file: the pieces
    alternate between the files, each file's rows lie end to end, so one span of each is read."""
    from ckpttool.plan.operations import Copy

    row = 4096
    (tmp_path / "a").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "b").write_bytes(bytes(reversed(range(256))) * 64)
    parts = [Copy(name, 100 + n * row, "out", (2 * n + k) * row, row) for n in range(3) for k, name in enumerate("ab")]
    assert [len(group) for group in record_writes.copy_groups(parts)] == [6]
    a, b = (tmp_path / "a").read_bytes(), (tmp_path / "b").read_bytes()
    with DataFiles(tmp_path) as files:
        got = bytes(record_writes.gathered(parts, files))
    assert got == b"".join((a if k == 0 else b)[100 + n * row:100 + (n + 1) * row] for n in range(3) for k in range(2))


def test_a_large_source_range_is_summed_from_maps_of_its_pages(tmp_path, monkeypatch):
    """The CRC-32 of bytes the kernel copied: from the page cache in place, not read into a buffer."""
    import zlib

    data = os.urandom(3 << 20)
    (tmp_path / "src").write_bytes(data)
    read_into = DataFiles.read_into
    reads = []
    monkeypatch.setattr(DataFiles, "read_into", lambda self, *args: reads.append(args) or read_into(self, *args))
    with DataFiles(tmp_path) as files:
        assert record_writes.source_crc(files, "src", 12345, 2 << 20) == zlib.crc32(data[12345:12345 + (2 << 20)])
        assert reads == []
        pieces = [bytes(piece) for piece in files.mapped("src", 12345, (1 << 20) + 7, block=1 << 18)]
        assert b"".join(pieces) == data[12345:12345 + (1 << 20) + 7] and len(pieces) == 5
        with pytest.raises(CorruptBlob, match="src: byte range"):
            record_writes.source_crc(files, "src", 2 << 20, 2 << 20)
