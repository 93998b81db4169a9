"""Parsing each record layout of a data file once (`ParsedRecords`) gives what parsing every
record in full gives: the same results, and on damaged bytes the same errors."""

from __future__ import annotations

import io
import random
import zlib

import pytest
import torch

from ckpttool.core.errors import CheckpointError
from ckpttool.torchsave.record import ParsedRecords, parse_tensor_record, record_bytes, record_layout


def reader(data: bytes, base: int):
    def read(start: int, count: int) -> bytes:
        if start < 0 or count < 0 or start + count > len(data) - base:
            raise CheckpointError(f"range {start}+{count} is outside the record")
        return data[base + start:base + start + count]
    return read


def outcome(parse, data: bytes, base: int, length: int):
    try:
        return parse(reader(data, base), length, "test", base)
    except Exception as error:  # compared by type and message
        return (type(error).__name__, str(error))


def torch_record(values: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(values, buffer)  # miniz: CRC-32 in the local header too, no data descriptor
    return buffer.getvalue()


@pytest.mark.parametrize("writer", ["ckpttool", "torch"])
def test_records_of_one_layout_are_parsed_once_with_each_its_own_offset_and_crc(writer):
    rng = random.Random(0)
    records = []
    for _ in range(20):
        shape = rng.choice([(4, 8), (4, 8), (32,), ()])
        values = torch.randn(shape)
        data = values.numpy().tobytes()
        records.append(record_bytes("float32", shape, data) if writer == "ckpttool" else torch_record(values))
    parsed = ParsedRecords()
    at = 0
    blob = b"".join(records)
    for record in records:
        found = parsed.parse(reader(blob, at), len(record), "test", at)
        assert found == parse_tensor_record(reader(blob, at), len(record), "test", at)
        assert found.crc32 == zlib.crc32(blob[found.data_offset:found.data_offset + found.data_length])
        at += len(record)
    assert parsed._kept <= 4  # one layout per (shape, writer): reused for the rest


def test_a_record_damaged_anywhere_outside_its_data_fails_or_parses_as_a_full_parse_would():
    rng = random.Random(1)
    layout = record_layout("float32", (4, 8))
    good = record_bytes("float32", (4, 8), bytes(128))
    for trial in range(1500):
        damaged = bytearray(record_bytes("float32", (4, 8), rng.randbytes(128)))
        for _ in range(rng.choice((1, 1, 2, 4))):
            position = rng.randrange(len(damaged))
            if layout.data_offset <= position < layout.data_offset + 128:
                continue  # the data may be anything
            damaged[position] = rng.randrange(256)
        parsed = ParsedRecords()
        parsed.parse(reader(good, 0), len(good), "test", 0)  # the layout it may reuse
        data = good + bytes(damaged)
        assert outcome(parsed.parse, data, len(good), len(damaged)) == \
            outcome(parse_tensor_record, data, len(good), len(damaged)), trial


def test_a_record_of_the_same_length_but_another_dtype_is_parsed_in_full():
    parsed = ParsedRecords()
    a = record_bytes("float32", (8,), bytes(32))
    b = record_bytes("int32", (8,), bytes(32))
    assert len(a) == len(b)
    parsed.parse(reader(a, 0), len(a), "test", 0)
    assert parsed.parse(reader(b, 0), len(b), "test", 0).dtype == "int32"


@pytest.mark.parametrize("dtype, shape", [("float32", (4, 8)), ("bfloat16", ()), ("int8", (0, 3)), ("float64", (70000,)),
                                          ("float8_e4m3fn", (3, 5, 7))])
def test_a_record_tail_patched_for_a_crc_is_the_tail_written_in_full(dtype, shape):
    from ckpttool.torchsave import archive

    layout = record_layout(dtype, shape)
    end = layout.data_offset + layout.data_length
    for crc in (0, 1, 0xFFFFFFFF, 0x12345678, random.Random(2).getrandbits(32)):
        written = b"".join(data for offset, data in archive.writes(layout.archive_layout, [crc]) if offset >= end)
        assert layout.tail(crc) == written


def reuse_by_rows(parsed: ParsedRecords, block: bytes, starts: list[int], length: int) -> list:
    """The reference `match_block` is held to: each record's bytes as a row, compared piece by
    piece with what each parsed layout's parse read (`_Layout.spans`, the CRC-32 fields left
    out), the record starting with a zip local header; (record, data offset in the block,
    CRC-32) or None per record."""
    import numpy as np

    from ckpttool.torchsave.zip import LOCAL_MAGIC

    rows = np.lib.stride_tricks.sliding_window_view(np.frombuffer(block, np.uint8), length)[starts]
    found: list = [None] * len(starts)
    pending = (rows[:, :len(LOCAL_MAGIC)] == np.frombuffer(LOCAL_MAGIC, np.uint8)).all(axis=1)
    for layout in parsed._layouts.get(length, ()):
        matched = pending.copy()
        if any(start + span > length for start, span, _ in layout.spans) or layout.crc_at + 4 > length:
            continue  # the parse read past the record: only a parse decides
        for start, _, pieces in layout.spans:
            for begin, end, expected in pieces:
                matched &= (rows[:, start + begin:start + end] == np.frombuffer(expected, np.uint8)).all(axis=1)
        pending &= ~matched
        crcs = rows[:, layout.crc_at:layout.crc_at + 4].copy().view("<u4").ravel().tolist()
        for index in np.flatnonzero(matched).tolist():
            found[index] = (layout.record, starts[index] + layout.data_start, crcs[index])
    return found


def reuse_by_words(parsed: ParsedRecords, block: bytes, starts: list[int], length: int) -> list:
    """`match_block`'s answer in `reuse_by_rows`' form."""
    import numpy as np

    which, crcs, layouts = parsed.match_block(np.frombuffer(block + bytes(8), np.uint8),
                                              np.array(starts, dtype=np.int64), length)
    return [None if number < 0 else (layouts[number][0], start + layouts[number][1], crc)
            for start, number, crc in zip(starts, which.tolist(), crcs.tolist())]


def test_a_block_of_records_reuses_a_layout_exactly_where_parsing_each_alone_would():
    """`match_block` compares many records at once: for every record, damaged or not, it gives
    what `parse` gives through the same layout (offset and CRC-32 its own), or None."""
    rng = random.Random(2)
    layout = record_layout("float32", (4, 8))
    good = record_bytes("float32", (4, 8), bytes(128))
    reused_records = missed = 0
    for trial in range(30):
        records = []
        for _ in range(50):
            record = bytearray(record_bytes("float32", (4, 8), rng.randbytes(128)))
            for _ in range(rng.choice((0, 0, 1, 2))):
                position = rng.randrange(len(record))
                if not layout.data_offset <= position < layout.data_offset + 128:
                    record[position] = rng.randrange(256)
            records.append(bytes(record))
        gap = rng.choice((0, 0, 7))  # end to end, or with bytes between
        block = b"".join(record + bytes(gap) for record in records)
        starts = [i * (len(good) + gap) for i in range(len(records))]
        parsed = ParsedRecords()
        parsed.parse(reader(good, 0), len(good), "test", 0)
        (kept,) = parsed._layouts[len(good)]
        for start, found in zip(starts, reuse_by_words(parsed, block, starts, len(good))):
            alone = ParsedRecords()
            alone.parse(reader(good, 0), len(good), "test", 0)
            expected = outcome(alone.parse, block, start, len(good))
            # what `parse` tries first: the record's bytes are the kept layout's (else it parses in full)
            reused = kept.reuse(reader(block, start), start)
            assert (found is None) == (reused is None), trial
            if found is None:
                missed += 1
                continue
            record, data_at, crc = found
            assert expected == reused == type(record)(record.dtype, record.shape, record.stride, record.storage_offset,
                                                      data_at, record.data_length, crc, record.byteorder), trial
            assert data_at - start == layout.data_offset
            reused_records += 1
    assert reused_records > 100 and missed > 100  # both answers given, many times


def test_match_block_reuses_exactly_what_comparing_rows_reuses():
    """`match_block` (masked 8-byte words) against `reuse_by_rows` (the comparisons `parse`
    makes, row by row) on blocks of records of two layouts of one length, damaged
    anywhere, signature bytes included, at any alignment."""
    import numpy as np

    rng = random.Random(7)
    shapes = [(4, 8), (8, 4), (32,)]  # one record length, three layouts
    goods = [record_bytes("float32", shape, bytes(128)) for shape in shapes]
    assert len({len(good) for good in goods}) == 1
    length = len(goods[0])
    for trial in range(40):
        records = []
        for _ in range(60):
            shape = rng.choice(shapes)
            record = bytearray(record_bytes("float32", shape, rng.randbytes(128)))
            for _ in range(rng.choice((0, 0, 1, 3))):
                position = rng.choice((rng.randrange(4), rng.randrange(len(record))))
                record[position] = rng.randrange(256)
            records.append(bytes(record))
        lead = rng.randrange(8)  # records at any alignment of the block
        gap = rng.choice((0, 1, 7))
        block = bytes(lead) + b"".join(record + bytes(gap) for record in records) + rng.randbytes(8)
        starts = [lead + i * (length + gap) for i in range(len(records))]
        parsed = ParsedRecords()
        for good in goods[:rng.choice((1, 2, 3))]:
            parsed.parse(reader(good, 0), length, "test", 0)
        expected = reuse_by_rows(parsed, block, starts, length)
        which, crcs, layouts = parsed.match_block(np.frombuffer(block, np.uint8), np.array(starts, dtype=np.int64), length)
        for start, found, number, crc in zip(starts, expected, which.tolist(), crcs.tolist()):
            if found is None:
                assert number == -1, trial
            else:
                record, data_start = layouts[number]
                assert found == (record, start + data_start, crc), trial
        assert (which >= 0).any() and (which < 0).any()
