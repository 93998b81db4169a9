"""Reshard's records built in C (`torchsave/_records.c`) are the bytes the Python code builds:
the serialization id's BLAKE2b, whole records end to end, the coalesced source spans, and a
whole reshard of a real checkpoint with and without the C module (empty chunks included)."""

from __future__ import annotations

import hashlib
import random
import sys
import zlib

import pytest

from conftest import FIXTURES, import_native

from ckpttool.run import record_writes
from ckpttool.commands.reshard import reshard
from ckpttool.plan.operations import Record, Records
from ckpttool.plan.rank_files import plan_writes
from ckpttool.plan.reshard import Mesh, plan_reshard
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.torchsave import archive, assembly
from ckpttool.torchsave import native as native_module
from ckpttool.torchsave.record import record_layout

native = import_native("ckpttool.torchsave._records")

SHAPES = [("float32", (4,)), ("bfloat16", (3, 5)), ("float32", ()), ("int64", (2, 2, 2)), ("float32", (0, 64)),
          ("float8_e4m3fn", (17,))]


@pytest.mark.parametrize("name", ["ckpttool.torchsave._records", "ckpttool.readers._dcpscan"])
def test_a_c_module_not_built_fails_its_tests_under_ckpttool_require_native(monkeypatch, name):
    """CI sets CKPTTOOL_REQUIRE_NATIVE=1 (README's test command): an install without the C
    modules (no compiler) fails the tests that need them instead of skipping them."""
    monkeypatch.setitem(sys.modules, name, None)  # not built: `import` fails
    monkeypatch.setenv("CKPTTOOL_REQUIRE_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception, match="CKPTTOOL_REQUIRE_NATIVE is set"):
        import_native(name)
    monkeypatch.delenv("CKPTTOOL_REQUIRE_NATIVE")
    with pytest.raises(pytest.skip.Exception, match="not built"):
        import_native(name)


def test_the_serialization_id_in_c_is_the_blake2b_one_for_any_length():
    generator = random.Random(0)
    for length in [*range(0, 300), 1024, 4099]:  # one block, several, and exactly 128 and 256 bytes
        packed = generator.randbytes(length)
        expected = b"%040d" % int.from_bytes(hashlib.blake2b(packed, digest_size=16).digest(), "little")
        assert native.serialization_id_of(packed) == expected == archive.serialization_id_of(packed), length


@pytest.mark.parametrize("seed", range(3))
def test_records_built_in_c_are_the_records_built_in_python_block_by_block(seed):
    generator = random.Random(seed)
    layouts = [record_layout(dtype, shape) for dtype, shape in SHAPES]
    source = generator.randbytes(20_000)
    kinds = [generator.randrange(len(layouts)) for _ in range(400)]
    positions = [generator.randrange(0, 19_000) for _ in kinds]
    expected = b"".join(layouts[k].head + source[p:p + layouts[k].data_length]
                        + layouts[k].tail(zlib.crc32(source[p:p + layouts[k].data_length])) for k, p in zip(kinds, positions))
    limit = (1, 5000, 1 << 30)[seed]  # a record a call, a few, all at once
    pieces = {}
    for build in (assembly.assemble, assembly.assemble_in_python):
        out, first, joined = bytearray(min(limit, len(expected)) + max(layout.length for layout in layouts)), 0, []
        while first < len(kinds):
            first, written = build(out, source, kinds, positions, layouts, first, limit)
            joined.append(bytes(out[:written]))
        pieces[build] = joined
    assert pieces[assembly.assemble] == pieces[assembly.assemble_in_python]
    assert b"".join(pieces[assembly.assemble]) == expected


@pytest.mark.parametrize("build", [assembly.assemble, assembly.assemble_in_python])
def test_records_past_the_source_or_the_output_are_refused_before_anything_is_written(build):
    layout = record_layout("float32", (4,))
    out = bytearray(3 * layout.length)
    with pytest.raises(ValueError, match="runs past the source"):
        build(out, bytes(40), [0, 0, 0], [0, 16, 32], [layout], 0, len(out))
    with pytest.raises(ValueError, match="do not fit"):
        build(bytearray(layout.length), bytes(48), [0, 0], [0, 16], [layout], 0, 1 << 20)
    assert out == bytearray(len(out))


def test_source_spans_in_c_are_those_of_the_python_loop(monkeypatch):
    generator = random.Random(5)
    for trial in range(800):
        count = generator.randrange(0, 30)
        shapes = (("float32", (generator.randrange(1, 2000),)), ("bfloat16", (generator.randrange(1, 900), 3)),
                  ("float32", (0, 8)))
        kinds = tuple(generator.randrange(3) for _ in range(count))
        files = tuple("" if kind == 2 else f"__{generator.randrange(3)}_0.distcp" for kind in kinds)
        op = Records("out", 0, shapes, kinds, ("w",) * count, (0,) * count, files,
                     tuple(0 if kind == 2 else generator.randrange(0, 100_000) for kind in kinds))
        monkeypatch.setattr(record_writes, "READ_GAP", generator.choice([0, 100, 1 << 16]))
        monkeypatch.setattr(record_writes, "READ_SPAN", generator.choice([500, 1 << 20]))
        lengths = [record_layout(dtype, shape).data_length for dtype, shape in shapes]
        assert record_writes.source_spans(op) == record_writes.source_spans_in_python(op, lengths), trial


def written_files(source, destination, world_size: int) -> dict[str, bytes]:
    reshard(source, destination, world_size=world_size)
    found = {path.name: path.read_bytes() for path in sorted(destination.iterdir())}
    for path in destination.iterdir():
        path.unlink()
    destination.rmdir()
    return found


def test_a_reshard_without_the_c_module_writes_the_same_bytes_empty_chunks_included(tmp_path, monkeypatch):
    source = FIXTURES / "fsdp2_world3_uneven"
    checkpoint = read_checkpoint(source)
    plan = plan_reshard(checkpoint, Mesh(1, 16))  # more ranks than some tensors have rows: empty chunks
    writes = plan_writes(plan, checkpoint, {fqn: {index: None for index in range(len(tensor.chunks))}
                                            for fqn, tensor in checkpoint.tensors.items()})
    assert not [op for op in writes.operations if type(op) is Record and not op.output_length], \
        "a record of an empty chunk is grouped into a Records"
    empty = [op for op in writes.operations if type(op) is Records and "" in op.src]
    assert empty, "the plan has empty chunks in Records operations"
    with_c = written_files(source, tmp_path / "out", 16)
    monkeypatch.setattr(native_module, "records", None)
    without = written_files(source, tmp_path / "out", 16)
    assert with_c.keys() == without.keys() and len(with_c) == 17
    assert with_c == without


def test_record_headers_compared_in_c_match_the_numpy_comparison_on_damaged_blocks(monkeypatch):
    """`ParsedRecords.match_block` with the C comparison and without: the same layout and
    CRC-32 for every record of blocks of three layouts of one length, damaged anywhere."""
    import numpy as np

    from ckpttool.torchsave.record import ParsedRecords, record_bytes

    generator = random.Random(11)
    shapes = [(4, 8), (8, 4), (32,)]
    goods = [record_bytes("float32", shape, bytes(128)) for shape in shapes]
    length = len(goods[0])
    hits = misses = 0
    for trial in range(40):
        records = []
        for _ in range(60):
            record = bytearray(record_bytes("float32", generator.choice(shapes), generator.randbytes(128)))
            for _ in range(generator.choice((0, 0, 1, 3))):
                record[generator.choice((generator.randrange(4), generator.randrange(len(record))))] = generator.randrange(256)
            records.append(bytes(record))
        lead, gap = generator.randrange(8), generator.choice((0, 1, 7))
        block = np.frombuffer(bytes(lead) + b"".join(record + bytes(gap) for record in records) + bytes(8), np.uint8)
        starts = np.array([lead + i * (length + gap) for i in range(len(records))], dtype=np.int64)
        parsed = ParsedRecords()
        for good in goods[:generator.choice((1, 2, 3))]:
            parsed.parse(lambda start, count, good=good: good[start:start + count], length, "test", 0)
        answers = []
        for module in (native, None):
            monkeypatch.setattr(native_module, "records", module)
            which, crcs, layouts = parsed.match_block(block, starts, length)
            answers.append((which.tolist(), crcs.tolist(), layouts))
        assert answers[0] == answers[1], trial
        hits += sum(number >= 0 for number in answers[0][0])
        misses += sum(number < 0 for number in answers[0][0])
    assert hits > 500 and misses > 100
    with pytest.raises(IndexError):
        native.match(np.zeros(16, np.uint8), np.array([12], np.int64), [(0, 2, np.zeros(2, "<u8"), None)])


INT_EDGES = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**39, 2**47 + 3, 2**55, 2**62, 2**63 - 1,
             -1, -128, -129, -256, -2**31, -2**31 - 1, -2**39 - 1, -2**63]


def expected_rows(rows: int, spec: list) -> list[bytes]:
    """Each row of `spec` (see `dcp.writer._encoded_rows`) as the pickle writer itself writes it."""
    from ckpttool.dcp import writer
    from ckpttool.torchsave.pickle import Writer, int_bytes

    found = []
    for row in range(rows):
        parts = []
        for part in spec:
            if isinstance(part, bytes):
                parts.append(part)
            elif part[0] == writer._INT:
                parts.append(int_bytes(int(part[1][row])))
            elif part[0] == writer._TUPLE:
                tuple_writer = Writer()
                tuple_writer.write(tuple(part[1][row, :int(part[2][row])].tolist()))
                parts.append(bytes(tuple_writer.out))
            else:
                parts.append(part[1][int(part[2][row])])
        found.append(b"".join(parts))
    return found


def random_spec(generator, rows: int) -> list:
    """Fixed bytes, int columns (every int encoding), tuples of 0 to 5 ints and memo fetches
    (BINGET and LONG_BINGET, from a real Writer's memo of 70,000 strings) in random order."""
    import numpy as np

    from ckpttool.dcp import writer
    from ckpttool.torchsave.pickle import Writer

    memo = Writer()
    memo.memo = {f"s{slot}": slot for slot in range(70_000)}
    table = tuple(memo.fragment(f"s{slot}") for slot in (0, 1, 255, 256, 65535, 65536, 69_999))
    assert {len(fetch) for fetch in table} == {2, 5}  # BINGET slot, LONG_BINGET slot (4 bytes)

    def ints(shape):
        edges = np.array(INT_EDGES, np.int64)[generator.integers(0, len(INT_EDGES), shape)]
        return np.where(generator.random(shape) < 0.5, edges, generator.integers(0, 70_000, shape))

    spec: list = []
    for _ in range(int(generator.integers(1, 12))):
        kind = int(generator.integers(0, 4))
        if kind == 0:
            spec.append(bytes(generator.integers(0, 256, int(generator.integers(0, 30)), dtype=np.uint8)))
        elif kind == 1:
            spec.append((writer._INT, ints(rows)))
        elif kind == 2:
            width = int(generator.integers(0, 6))
            spec.append((writer._TUPLE, ints((rows, width)), generator.integers(0, width + 1, rows)))
        else:
            spec.append((writer._FETCH, table, generator.integers(0, len(table), rows)))
    return spec


@pytest.mark.parametrize("seed", range(4))
def test_metadata_rows_encoded_in_c_are_the_numpy_rows_and_the_pickle_writers(monkeypatch, seed):
    """`dcp.writer._encoded_rows` in C (`encode_rows`) and by numpy: the bytes the pickle
    writer writes for each row (ints of every length, tuples of 0 to 5 ints, memo fetches of
    1- and 4-byte slots), and where each row starts."""
    from ckpttool.dcp import writer

    generator = __import__("numpy").random.default_rng(seed)
    for rows in (0, 1, 7, 64, 65, 500):
        spec = random_spec(generator, rows)
        expected = expected_rows(rows, spec)
        encoded = []
        for module in (native, None):
            monkeypatch.setattr(native_module, "records", module)
            data, starts = writer._encoded_rows(spec, rows, starts=True)
            assert writer._encoded_rows(spec, rows)[0] == data
            encoded.append((data, starts.tolist()))
        assert encoded[0] == encoded[1], rows
        data, starts = encoded[0]
        assert [data[starts[row]:starts[row + 1]] for row in range(rows)] == expected
        assert starts[0] == 0 and starts[-1] == len(data)


def test_metadata_rows_refuse_columns_they_cannot_read_safely():
    """`encode_rows` checks every column before reading one: dtype, contiguity, length, each
    ndim and each fetch in range; a ValueError, never a read out of bounds."""
    import numpy as np

    values, ndim = np.arange(12, dtype=np.int64).reshape(4, 3), np.array([0, 1, 3, 2], np.int64)
    table = (b"h\x00", b"j\x00\x01\x00\x00")
    good = [b"(", (0, values[:, 0].copy()), (1, values, ndim), (2, table, np.array([0, 1, 1, 0], np.int64))]
    assert native.encode_rows(good, 4, None)
    bad = {
        "an int32 column": [(0, np.arange(4, dtype=np.int32))],
        "a float column": [(0, np.arange(4, dtype=np.float64))],
        "a column of other rows": [(0, np.arange(5, dtype=np.int64))],
        "a strided column": [(0, values[:, 0])],
        "bytes as a column": [(0, bytes(32))],
        "a 1-d size column": [(1, np.arange(4, dtype=np.int64), ndim)],
        "an ndim past the width": [(1, values, np.array([0, 1, 4, 2], np.int64))],
        "a negative ndim": [(1, values, np.array([0, -1, 1, 2], np.int64))],
        "a fetch past the table": [(2, table, np.array([0, 1, 2, 0], np.int64))],
        "a negative fetch": [(2, table, np.array([0, -1, 1, 0], np.int64))],
        "a table of str": [(2, ("h", "j"), np.zeros(4, np.int64))],
        "a table as a list": [(2, list(table), np.zeros(4, np.int64))],
        "an unknown kind": [(7, np.zeros(4, np.int64))],
        "a part of the wrong length": [(0, np.zeros(4, np.int64), ndim)],
        "a str part": ["x"],
        "a str kind": [("0", np.zeros(4, np.int64))],
    }
    for name, spec in bad.items():
        with pytest.raises(ValueError):
            native.encode_rows(spec, 4, None)
            pytest.fail(name)
    for starts in (np.zeros(4, np.int64), np.zeros(5, np.int32), np.zeros(5, np.int64)[::1].view(np.uint64)):
        with pytest.raises(ValueError):
            native.encode_rows(good, 4, starts)
    with pytest.raises((ValueError, BufferError, TypeError)):
        native.encode_rows(good, 4, bytes(40))  # read-only
    with pytest.raises(ValueError):
        native.encode_rows(good, -1, None)
    # `starts` may even be one of the columns: it is written after the rows are
    shared = np.array([1, 2, 3, 4, 5], np.int64)
    data = native.encode_rows([(0, shared[:4])], 4, shared)
    assert data == b"K\x01K\x02K\x03K\x04" and shared.tolist() == [0, 2, 4, 6, 8]


def test_records_built_in_c_run_beside_other_tasks_and_in_python_take_turns(tmp_path, monkeypatch):
    """`write_records` holds the shared `turns` lock only when the records are built in
    Python (GIL-bound work): built in C it runs while another task holds the lock, and
    writes the same bytes either way."""
    import os
    import threading

    from ckpttool.run import locating
    from ckpttool.dcp.blobs import DataFiles

    source = FIXTURES / "fsdp2_world3_uneven"
    checkpoint = read_checkpoint(source)
    with DataFiles(checkpoint.path) as files:
        writes = plan_writes(plan_reshard(checkpoint, Mesh(1, 16)), checkpoint,
                             locating.locate_chunks(files, checkpoint.tensors.values()))
        op = max((op for op in writes.operations if type(op) is Records), key=lambda op: len(op.kind))
        assert op.output_length > 0 and len(op.kind) > 1
        outputs = {}
        for module in (native, None):
            monkeypatch.setattr(native_module, "records", module)
            turns, done = threading.Lock(), threading.Event()
            fd = os.open(tmp_path / f"out-{module is None}", os.O_RDWR | os.O_CREAT)
            try:
                def run(fd: int, turns: threading.Lock, done: threading.Event) -> None:
                    record_writes.write_records(op, files, fd, turns)
                    done.set()

                with turns:  # another task's turn
                    worker = threading.Thread(target=run, args=(fd, turns, done))
                    worker.start()
                    finished_in_turn = done.wait(10 if module is not None else 0.5)
                worker.join(10)
                assert done.is_set()
                assert finished_in_turn == (module is not None), module
                outputs[module is None] = os.pread(fd, op.offset + op.length, 0)
            finally:
                os.close(fd)
    assert outputs[False] == outputs[True] and len(outputs[False]) == op.offset + op.length


def test_a_reshard_on_one_thread_and_on_several_writes_the_same_bytes(tmp_path):
    """Records tasks built in C run side by side (into the same rank files); the output is
    that of one thread running them in turn."""
    from ckpttool.options import WriteOptions

    source = FIXTURES / "fsdp2_world3_uneven"
    found = []
    for threads in (1, 6):
        destination = tmp_path / f"threads-{threads}"
        reshard(source, tmp_path / "out", world_size=16, write=WriteOptions(threads=threads))
        (tmp_path / "out").rename(destination)
        found.append({path.name: path.read_bytes() for path in sorted(destination.iterdir())})
    # `.metadata` names the output path: both were written to the same one
    assert found[0] == found[1] and len(found[0]) == 17
