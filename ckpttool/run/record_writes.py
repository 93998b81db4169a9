"""Writing a `Records` operation: many small torch.save records end to end, from local files.

Reshard's common case is 300k+ records of a few KiB each. One `Record` (and one `Copy`)
per record costs a read, a few objects and a write per record; here a whole operation
reads its source bytes in a few large preads (neighbouring runs coalesced into spans,
`READ_GAP` and `READ_SPAN`), builds the records end to end in a buffer (head, data, tail
holding the data's CRC-32: `torchsave.assembly`, in C when built) and writes the output in
pwrites of about `RECORDS_WRITE_BLOCK` bytes. What it writes is what `Records.records()` writes, byte for
byte; operations it cannot run this way (remote sources, outputs without an fd) are
expanded into those records by `expanded` and take the general path.

A large `Record` whose parts are all copies (a chunk straddling source chunks) is written by
`write_record`: its data moves in the kernel (`copy_file_range`), like consolidate's, and its
CRC-32 is combined from those torch.save stored for the source records, so only the bytes a
stored CRC-32 does not cover are read and summed (`copy_crc`; from maps of the source's pages,
not copied into a buffer first: `source_crc`). Short copies whose bytes would
be summed anyway (a weight the naming engine cuts into rows, a few KiB each and a row or a
few apart in the source: a rotary head that straddles source chunks) are read with their
neighbours in one span instead (`copy_groups`), laid
end to end in memory, summed there and written in one pwrite (`gathered`): each byte is read
once, and a record of 256 rows costs a few syscalls, not a copy, a read and a CRC-32 combine
per row.

Example:
    >>> write_records(op, files, fd)  # op: Records; files.local; fd: an int
    op.output_length
    >>> write_record(record, files, fd)  # record: a Record of Copy parts
    record.output_length
"""

from __future__ import annotations

import functools
import os
import typing
import zlib
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from ckpttool.dcp.blobs import DataFiles, RawData
from ckpttool.core.errors import CorruptBlob
from ckpttool.store.io import Output, copy_range, thread_buffer, write_at
from ckpttool.plan.operations import (GATHER_FILES, GATHER_PART, GATHER_SPAN, GATHER_WINDOW, RECORDS_WRITE_BLOCK,
                                      STREAM_BLOCK, Copy, Operation, Record, Records)
from ckpttool.torchsave import native
from ckpttool.torchsave.assembly import assemble
from ckpttool.torchsave.crc32 import crc32_combine, crc32_slice
from ckpttool.torchsave.record import record_layout

MAP_AT_LEAST = 1 << 20  # a source range summed from maps of its pages, not reads (smaller: a map costs more)
# source runs closer than this are read as one span, the bytes between them read through:
# one 64 KiB read costs less than a second syscall and its Python around it
READ_GAP = 64 << 10
READ_SPAN = 8 << 20  # the longest span read at once (a few of them per operation, at most)


def runs_fast(op: Operation, files: DataFiles, outputs: Mapping[str, Output]) -> bool:
    """True when `op` is a Records operation `write_records` can run: local sources, an fd output."""
    return type(op) is Records and files.local and isinstance(outputs[op.dst], int)


def expanded(operations: Iterable[Operation], files: DataFiles, outputs: Mapping[str, Output]) -> Iterator[Operation]:
    """Yield the operations, each Records operation that `write_records` cannot run replaced
    by its `Record` operations (which the general path runs: remote reads, output objects)."""
    for op in operations:
        if type(op) is Records and not runs_fast(op, files, outputs):
            yield from op.records()
        else:
            yield op


def source_spans(op: Records) -> tuple[list[tuple[str, int, int]], list[int], list[int]]:
    """Return the (file, start, end) spans that hold `op`'s source runs, and for each record
    (in output order) the index of its span and where its data starts in it.

    Runs are taken in (file, offset) order; a run joins the span before it when the gap is
    at most READ_GAP, the span stays within READ_SPAN, and the gap bytes read through so far
    stay within `op.read_through` (so the spans hold at most the records' data and that
    many bytes more: `Records.memory` counts on it). A record with no source file (an empty
    chunk's) reads nothing: its span and start are 0.

    Example:
        >>> source_spans(op)  # two records' runs 100 bytes apart in one file
        ([('__0_0.distcp', 704, 4900)], [0, 0], [0, 2148])
    """
    lengths = [record_layout(dtype, shape).data_length for dtype, shape in op.shapes]
    if native.records is not None:  # the same loop in C (a reshard runs it for 300k+ records)
        return native.records.spans(op.src, op.src_offset, op.kind, lengths, READ_GAP, READ_SPAN, op.read_through)
    return source_spans_in_python(op, lengths)


def source_spans_in_python(op: Records, lengths: list[int]) -> tuple[list[tuple[str, int, int]], list[int], list[int]]:
    """`source_spans` without the C module (`lengths`: each kind's data bytes)."""
    kind, src, src_offset = op.kind, op.src, op.src_offset
    count = len(kind)
    gap_budget = op.read_through  # bytes read through between runs: spans hold at most data + this
    keys = list(zip(src, src_offset))
    order = sorted(range(count), key=keys.__getitem__)
    spans: list[tuple[str, int, int]] = []
    span_of = [0] * count
    start_in = [0] * count
    file, start, end = None, 0, 0
    for i in order:
        if not src[i]:  # an empty chunk: no data
            continue
        at = src_offset[i]
        stop = at + lengths[kind[i]]
        gap = at - end if at > end else 0  # runs that overlap (a run read twice) join at no cost
        if file == src[i] and gap <= READ_GAP and (stop if stop > end else end) - start <= READ_SPAN and gap <= gap_budget:
            gap_budget -= gap
            if stop > end:
                end = stop
        else:
            if file is not None:
                spans.append((file, start, end))
            file, start, end = src[i], at, stop
        span_of[i] = len(spans)
        start_in[i] = at - start
    if file is not None:
        spans.append((file, start, end))
    return spans, span_of, start_in


def write_records(op: Records, files: DataFiles, fd: int, turns: AbstractContextManager | None = None) -> int:
    """Write all of `op`'s records into `fd` from `op.offset`; return its data bytes
    (`output_length`, as a Record counts them: the progress and split measure).
    `turns` (a lock shared with other tasks) is held throughout when the records are built
    in Python: Records tasks reading while another builds only contend for the GIL (4
    threads took 1.4x the time of one). The C module builds them without the GIL, and the
    reads and writes release it too, so then tasks run side by side, on every core.

    A source file that ends before a record's data raises the CorruptBlob that reading that
    record alone raises (naming the file and the record's byte range).
    """
    with turns if turns is not None and native.records is None else nullcontext():
        source, positions = _sources(op, files)
        _build(op, source, positions, functools.partial(_write_pieces, fd))
    return op.output_length


def records_match(op: Records, files: DataFiles, fd: int) -> bool:
    """Return True when `fd` holds exactly what `write_records` writes for `op`: the records
    built again from the source, compared a block at a time (a pread and one comparison per
    few MiB, not a check per record). The caller finds and names a difference record by record."""
    source, positions = _sources(op, files)
    try:
        _build(op, source, positions, functools.partial(_compare_pieces, fd))
    except _Differs:
        return False
    return True


class _Differs(Exception):
    """The output differs from the records built again (records_match)."""


def _compare_pieces(fd: int, pieces: list, offset: int, length: int) -> None:
    if os.pread(fd, length, offset) != b"".join(pieces):
        raise _Differs


def _sources(op: Records, files: DataFiles) -> tuple[memoryview, list[int]]:
    """Read `op`'s source spans (`source_spans`) end to end into this thread's buffer; return
    a view of them and where each record's data starts in it."""
    spans, span_of, start_in = source_spans(op)
    # into this thread's reused buffer: a fresh MiB-sized bytes per span is a fresh mapping
    # whose every page faults in (that doubled the time of the reads)
    total = sum(end - start for _, start, end in spans)
    buffer = memoryview(thread_buffer(total, "records"))[:total]
    bases, at = [], 0
    for span in spans:
        _read_span(op, files, span, buffer[at:at + span[2] - span[1]])
        bases.append(at)
        at += span[2] - span[1]
    if not bases:  # every record is an empty chunk's
        return buffer, [0] * len(span_of)
    return buffer, [bases[span] + start for span, start in zip(span_of, start_in)]


def _build(op: Records, source: memoryview, positions: list[int], put: Callable[[list, int, int], None]) -> None:
    """Build `op`'s records from the source bytes (each record's data at `positions[i]`) and
    hand them to `put(pieces, offset, length)` a block of about RECORDS_WRITE_BLOCK bytes at a
    time (`torchsave.assembly`: in C when built)."""
    layouts = [record_layout(dtype, shape) for dtype, shape in op.shapes]
    size = min(op.length, RECORDS_WRITE_BLOCK + max((layout.length for layout in layouts), default=0))
    out = memoryview(thread_buffer(size, "records-out"))
    # each call is given only the records one block can take, not all of them from `first`
    # on: the C module converts the lists it is given, once per block
    window = RECORDS_WRITE_BLOCK // max(1, min((layout.length for layout in layouts), default=1)) + 1
    first, at = 0, op.offset
    while first < len(op.kind):
        done, written = assemble(out, source, op.kind[first:first + window], positions[first:first + window],
                                 layouts, 0, RECORDS_WRITE_BLOCK)
        put([out[:written]], at, written)
        first += done
        at += written


def _write_pieces(fd: int, pieces: list, offset: int, length: int) -> None:
    """Write `pieces` (`length` bytes) end to end at `offset`: one pwritev, without joining them."""
    written = os.pwritev(fd, pieces, offset)
    if written < length:  # a short write: the rest as one block
        write_at(fd, b"".join(pieces)[written:], offset + written)


def _read_span(op: Records, files: DataFiles, span: tuple[str, int, int], view: memoryview) -> None:
    file, start, end = span
    if end > files.size(file):  # name the first record that runs past the end, as reading it alone does
        lengths = [record_layout(dtype, shape).data_length for dtype, shape in op.shapes]
        for kind, src, src_offset in zip(op.kind, op.src, op.src_offset):
            if src == file and start <= src_offset < end:
                files.read(src, src_offset, lengths[kind])
    files.read_into(file, start, view)


def copies_only(op: Operation, files: DataFiles, outputs: Mapping[str, Output]) -> bool:
    """True when `op` is a Record `write_record` can run: every part a Copy, local sources, an fd output."""
    return (type(op) is Record and files.local and isinstance(outputs[op.dst], int)
            and all(type(part) is Copy for part in op.parts))


def write_record(op: Record, files: DataFiles, fd: int) -> int:
    """Write the record `op` (its parts all copies) into `fd`: each part copied in the kernel,
    or short ones read with their neighbours and written from memory (`copy_groups`), the
    head, and the tail holding the data's CRC-32 (`copy_crc` for kernel copies, summed over
    the gathered bytes for the others). Returns its data bytes."""
    layout = record_layout(op.dtype, op.shape)
    crc, at = 0, op.offset + layout.data_offset
    copies = typing.cast(list[Copy], list(op.parts))  # all copies: `copies_only`
    for group in copy_groups(sorted(copies, key=lambda part: part.dst_offset)):
        part = group[0]
        assert part.dst_offset == at  # the parts cover the data exactly once (Record)
        if len(group) > 1:
            data = gathered(group, files)
            crc = zlib.crc32(data, crc)  # in output order: the data's CRC-32 runs on over them
            write_at(fd, data, at)
            at += len(data)
            continue
        try:
            copy_range(files.fd(part.src), part.src_offset, fd, part.dst_offset, part.length)
        except EOFError:
            raise CorruptBlob(f"{files.path(part.src)}: ends before byte {part.src_offset + part.length} "
                              "(truncated file?)") from None
        crc = crc32_combine(crc, copy_crc(part, files), part.length)
        at += part.length
    write_at(fd, layout.head, op.offset)
    write_at(fd, layout.tail(crc), at)
    return op.output_length


def copy_groups(copies: Sequence[Copy]) -> list[list[Copy]]:
    """Return `copies` (in output order) as groups: neighbouring short copies (under
    GATHER_PART bytes each, their CRC-32 to be summed from their own bytes: `sums_own_bytes`)
    from at most GATHER_FILES files, laid end to end in the output, whose source lies in one
    span of each file, the spans together at most GATHER_SPAN bytes and at most twice what
    they copy or GATHER_WINDOW (the rows of a permuted head alternate between its two halves;
    the rows of a weight cut on dim 1 alternate between its tensor-parallel ranks' files),
    together; every other copy alone. A group copies at most GATHER_SPAN bytes (`Record.memory`
    counts the spans and them).

    Example (three rows of 4 KiB, 8 KiB apart in the source, then a 1 MiB copy):
        >>> [len(group) for group in copy_groups([row0, row2, row4, big])]
        [3, 1]
    """
    groups: list[list[Copy]] = []
    group: list[Copy] = []
    spans: dict[str, tuple[int, int]] = {}
    copied = reached = 0
    for part in copies:
        at, length = part.src_offset, part.length
        if length >= GATHER_PART or not sums_own_bytes(part):
            group = []
            groups.append([part])
            continue
        if group and part.dst_offset == reached:
            low, high = spans.get(part.src, (at, at + length))
            joined = {**spans, part.src: (min(low, at), max(high, at + length))}
            read = sum(end - start for start, end in joined.values())
            if (len(joined) <= GATHER_FILES and copied + length <= GATHER_SPAN
                    and read <= min(GATHER_SPAN, max(2 * (copied + length), GATHER_WINDOW))):
                group.append(part)
                spans, copied, reached = joined, copied + length, reached + length
                continue
        group = [part]
        groups.append(group)
        spans, copied, reached = {part.src: (at, at + length)}, length, part.dst_offset + length
    return groups


def gathered(group: Sequence[Copy], files: DataFiles) -> memoryview:
    """Return the bytes `group` (a `copy_groups` group) copies, end to end, read in one span
    of each of its files: a view of this thread's buffer, valid until the next call."""
    spans: dict[str, tuple[int, int]] = {}
    for part in group:
        low, high = spans.get(part.src, (part.src_offset, part.src_offset + part.length))
        spans[part.src] = (min(low, part.src_offset), max(high, part.src_offset + part.length))
    size = sum(end - start for start, end in spans.values())
    read = memoryview(thread_buffer(size, "gather-span"))[:size]
    base: dict[str, int] = {}  # file -> where its span starts in `read`, less the span's source offset
    at = 0
    for file, (start, end) in spans.items():
        files.read_into(file, start, read[at:at + end - start])
        base[file] = at - start
        at += end - start
    total = sum(part.length for part in group)
    out = memoryview(thread_buffer(total, "gather-out"))[:total]
    at = 0
    for part in group:
        begin = base[part.src] + part.src_offset
        out[at:at + part.length] = read[begin:begin + part.length]
        at += part.length
    return out


def sums_own_bytes(part: Copy) -> bool:
    """True when `copy_crc` reads and sums the bytes `part` copies (no stored CRC-32 gives theirs)."""
    return _slice_crc_sides(part) is None and not part.crc32


def _slice_crc_sides(part: Copy) -> tuple[int, int] | None:
    """Return (bytes before, bytes after) `part` in the torch.save record it is cut from when
    its CRC-32 follows from the record's stored one and those sides' (shorter than it); else None."""
    within = part.within
    if part.crc32 or within is None or not within.crc32 or within.file != part.src:
        return None
    before = part.src_offset - within.offset
    after = within.offset + within.length - part.src_offset - part.length
    if before >= 0 and after >= 0 and before + after < part.length:
        return before, after
    return None


def copy_crc(part: Copy, files: DataFiles) -> int:
    """Return the CRC-32 of the bytes `part` copies: the one torch.save stored when they are a
    whole record's data; from a stored one and the CRC-32 of the rest of its record when the
    rest is shorter than the part; else summed from the source.

    A stored 0 counts as none: torch.save writes 0 when asked not to compute CRC-32s
    (`torch.serialization.set_crc32_options(False)`); summing is right in any case.
    """
    if part.crc32:
        return part.crc32
    sides = _slice_crc_sides(part)
    if sides is not None:
        within = typing.cast(RawData, part.within)
        before, after = sides
        return crc32_slice(typing.cast(int, within.crc32), source_crc(files, part.src, within.offset, before),
                           source_crc(files, part.src, part.src_offset + part.length, after),
                           part.length, after)
    return source_crc(files, part.src, part.src_offset, part.length)


def source_crc(files: DataFiles, file: str, offset: int, length: int) -> int:
    """Return the CRC-32 of `length` bytes at `offset` of a source file: of a local file from
    maps of its pages when they are at least MAP_AT_LEAST bytes (the kernel copied them; read
    into a buffer they would be copied a second time), else read a STREAM_BLOCK at a time."""
    if not length:
        return 0
    if files.local and length >= MAP_AT_LEAST:
        crc = 0
        for piece in files.mapped(file, offset, length):
            crc = zlib.crc32(piece, crc)
        return crc
    size = min(length, STREAM_BLOCK)
    buffer = memoryview(thread_buffer(size))[:size]
    crc = 0
    for piece in files.pieces(file, offset, length, buffer):
        crc = zlib.crc32(piece, crc)
    return crc
