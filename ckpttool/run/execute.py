"""Run any plan: the operations of `plan.operations` against open data files and outputs.

One executor for consolidate and reshard: in-kernel copies, casts, gathers of decoded or
block-sharded chunks, torch.save records whose CRC-32 is computed as their data streams, all
on one thread pool under one memory budget; then, on request, a verification that reads the
output back and compares it byte for byte with what the source says it must be.

Example (the planners take where the chunks are from `locate.locate_chunks`):
    >>> with DataFiles(checkpoint.path) as files:
    ...     run(operations, files, {"m.safetensors": fd}, threads=4, max_memory=512 << 20)
"""

from __future__ import annotations

import errno
import os
import threading
import typing
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from ckpttool.core import dtypes
from ckpttool.run import record_writes
from ckpttool.store import storage
from ckpttool.run.dequantizing import dequantized_bytes, quantized_bytes, row_ranges
from ckpttool.dcp.blobs import DataFiles, read_chunk
from ckpttool.core.errors import CorruptBlob, VerificationFailed
from ckpttool.store.io import Output, Task, copy_range, run_tasks, thread_buffer, write_at
from ckpttool.plan.operations import (STREAM_BLOCK, Band, Convert, Copy, Dequantize, Gather, Operation, Put, Quantize, Record,
                                      Records)
from ckpttool.torchsave.ptfile import crc32_combine
from ckpttool.torchsave.record import RecordLayout, record_layout

VERIFY_BLOCK = 16 << 20  # bytes compared per step of --verify
# operations writing less than SMALL_OPERATION run as one pool task per batch of neighbours
# (up to BATCH_BYTES or BATCH_OPERATIONS): a task per 256-byte record costs more in thread
# hand-offs than the record's IO
SMALL_OPERATION = 1 << 20
BATCH_BYTES = 4 << 20
BATCH_OPERATIONS = 256
# a batch's small copies from one file whose outputs lie end to end are read as one span of at
# most this many bytes (and at most twice the bytes they copy), then written from memory: a
# permuted weight's rows (naming's rotary heads) are neighbours in the source, a row apart
SPAN_BYTES = BATCH_BYTES

def write_file(path: Path, data: bytes) -> None:
    """Write a small file whole and fsync it (inside an atomic output directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def reserve(fd: Output, size: int) -> None:
    """Give an output file its final size up front; allocating it makes a full disk fail now."""
    if not isinstance(fd, int):
        fd.reserve(size)
        return
    os.ftruncate(fd, size)
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise  # ENOSPC: the disk cannot hold the output; fail before copying


def run(operations: Iterable[Operation], files: DataFiles, outputs: Mapping[str, int], *, threads: int,
        max_memory: int, on_done: Callable[[int], None] | None = None,
        on_file_done: Callable[[str], None] | None = None,
        on_written: Callable[[str, int, int], None] | None = None) -> None:
    """Run every operation, writing into the open `outputs` (name -> fd), at most `threads`
    at once and `max_memory` bytes of buffers in flight; `on_done(bytes)` after each task
    (one operation, or a batch of small ones: `batches`). From coalesced remote files the
    source ranges of all operations are fetched ahead, in order. A Records operation runs as
    one task (`record_writes`) from local files into an fd, else as its records.

    `on_file_done(name)` is called once per output, from a worker thread, as soon as every
    operation writing into it has run (so its fsync can overlap the copies still running),
    and at the end for outputs no operation wrote (or, from coalesced files, for all).
    `on_written(name, start, end)` is called from a worker thread after each task, before
    any `on_file_done` it leads to, with where the task's writes into each output begin and
    about where they end (its operations' first offset plus their data bytes: a record's
    tail lies a little past), a hint to start flushing them to disk."""
    operations = record_writes.expanded(operations, files, outputs)
    split: list[Record] = []
    if files.coalesced:
        operations = list(operations)
        if all(isinstance(fd, int) for fd in outputs.values()):
            operations, split = in_source_order(operations)
        files.expect([span for op in operations for span in source_ranges(op)])
    finished = _Finished(on_file_done, on_written)
    if on_file_done is not None and not files.coalesced:  # coalesced: split records' tails come last
        operations = finished.counting(operations)
    # a batch of small operations is interpreter work between short syscalls: several of
    # them at once only contend for the GIL (twice the CPU for the same work), so they take
    # turns; large operations (in-kernel copies, long reads) still run `threads` at once
    turns = threading.Lock()
    tasks = (finished.task(batch, _batch_task(batch, files, outputs, turns)) for batch in batches(operations))
    run_tasks(tasks, threads, max_memory, on_done)
    for op in split:  # their data is written: the head, and the tail with the data's CRC-32
        layout = record_layout(op.dtype, op.shape)
        fd = typing.cast(int, outputs[op.dst])
        data_at = op.offset + layout.data_offset
        write_at(fd, layout.head, op.offset)
        write_at(fd, layout.tail(output_crc(fd, data_at, layout.data_length, op.parts)), data_at + layout.data_length)
    finished.rest(outputs)


class _Finished:
    """Tells `on_written` what each task wrote, and `on_file_done` which outputs are
    complete: each output's operations are counted up front (`counting`), and a task that
    ran counts its batch's down (`task`)."""

    def __init__(self, on_file_done: Callable[[str], None] | None,
                 on_written: Callable[[str, int, int], None] | None = None):
        self.on_file_done = on_file_done
        self.on_written = on_written
        self.left: dict[str, int] | None = None
        self.told: set[str] = set()
        self.lock = threading.Lock()

    def counting(self, operations: Iterable[Operation]) -> list[Operation]:
        operations = list(operations)
        self.left = {}
        for op in operations:
            self.left[op.dst] = self.left.get(op.dst, 0) + 1
        return operations

    def task(self, batch: list[Operation], task: Task) -> Task:
        if self.left is None and self.on_written is None:
            return task

        def run_counted() -> int:
            written = task.run()
            if self.on_written is not None:
                self._wrote(batch, self.on_written)
            if self.left is not None:
                self._ran(batch)
            return written

        return Task(run_counted, task.memory)

    @staticmethod
    def _wrote(batch: list[Operation], on_written: Callable[[str, int, int], None]) -> None:
        spans: dict[str, tuple[int, int]] = {}
        for op in batch:
            start = first_offset(op)
            end = start + op.output_length
            low, high = spans.get(op.dst, (start, end))
            spans[op.dst] = (min(low, start), max(high, end))
        for name, (start, end) in spans.items():
            on_written(name, start, end)

    def _ran(self, batch: list[Operation]) -> None:
        left = typing.cast(dict[str, int], self.left)
        complete = []
        with self.lock:
            for op in batch:
                left[op.dst] -= 1
                if not left[op.dst]:
                    complete.append(op.dst)
                    self.told.add(op.dst)
        for name in complete:
            typing.cast(Callable[[str], None], self.on_file_done)(name)

    def rest(self, outputs: Mapping[str, int]) -> None:
        if self.on_file_done is not None:
            for name in outputs:
                if name not in self.told:
                    self.told.add(name)
                    self.on_file_done(name)


def in_source_order(operations: list[Operation]) -> tuple[list[Operation], list[Record]]:
    """Return `operations` in the (file, offset) order of the first source byte each reads,
    for coalesced remote sources writing into local fds: a file's spans are then read through
    one after another and freed, rather than a span of every file held while the outputs'
    order visits them side by side. A record whose data comes in several copies is split
    into them (returned too: `run` writes its head and tail once they ran)."""
    ordered: list[Operation] = []
    split: list[Record] = []
    for op in operations:
        if type(op) is Record and len(op.parts) > 1 and all(type(part) is Copy for part in op.parts):
            ordered.extend(op.parts)
            split.append(op)
        else:
            ordered.append(op)

    def first_read(op: Operation) -> tuple[str, int]:
        ranges = source_ranges(op)
        return min(ranges)[:2] if ranges else ("", -1)

    ordered.sort(key=first_read)
    return ordered, split


def source_ranges(op: Operation) -> list[tuple[str, int, int]]:
    """Return the (file, start, end) byte ranges of the source that running `op` reads."""
    if isinstance(op, Records):
        return [span for record in op.records() for span in source_ranges(record)]
    if isinstance(op, Record):
        return list(dict.fromkeys(span for part in op.parts for span in source_ranges(part)))  # a chunk is decoded once
    if isinstance(op, (Copy, Convert)):
        return [(op.src, op.src_offset, op.src_offset + op.length)]
    if isinstance(op, Dequantize):
        return row_ranges(op.codes) + row_ranges(op.scale)
    if isinstance(op, Quantize):
        return row_ranges(op.source)
    if isinstance(op, Put):
        return []
    if isinstance(op, Band):
        return [span for part in op.parts for span in source_ranges(part)]
    source = op.source if op.source is not None else op.tensor.chunks[op.chunk].blob
    return [(source.file, source.offset, source.offset + source.length)] if source is not None else []


def batches(operations: Iterable[Operation]) -> Iterator[list[Operation]]:
    """Yield the operations in order, in lists: one large operation alone, or neighbouring
    small ones (each under SMALL_OPERATION bytes) together, up to BATCH_BYTES or
    BATCH_OPERATIONS a list.

    Example:
        >>> [len(batch) for batch in batches([small] * 300 + [large] + [small])]
        [256, 44, 1, 1]
    """
    batch: list[Operation] = []
    size = 0
    for op in operations:
        length = op.output_length
        if length >= SMALL_OPERATION or type(op) is Records:  # a Records operation is a batch already
            if batch:
                yield batch
                batch, size = [], 0
            yield [op]
            continue
        batch.append(op)
        size += length
        if size >= BATCH_BYTES or len(batch) >= BATCH_OPERATIONS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _batch_task(batch: list[Operation], files: DataFiles, outputs: Mapping[str, int], turns: threading.Lock) -> Task:
    """Return one task running the operations of `batch` in turn on one thread (so it holds
    the largest one's buffers at a time, and at most SMALL_OPERATION gathered writes); a
    batch of several holds `turns` while it runs."""
    memory = max(op.memory for op in batch)
    if type(batch[0]) is Records:  # interpreter work per record, like a batch: takes turns
        op = batch[0]

        def run_records() -> int:
            return record_writes.write_records(op, files, outputs[op.dst], turns)

        return Task(run_records, memory)
    if len(batch) == 1:
        return Task(_runner(batch[0], files, outputs, None), memory)
    groups = _copy_spans(batch, files, outputs)
    spans = [_span(typing.cast(list[Copy], group)) for group in groups if len(group) > 1]  # several: copies
    span = max((end - start for start, end in spans), default=0)

    def run_all() -> int:
        with turns:
            gathered = _GatheredWrites(SMALL_OPERATION)
            written = 0
            for group in groups:
                if len(group) > 1:
                    written += _copy_span(typing.cast(list[Copy], group), files, outputs[group[0].dst], gathered)
                    continue
                op = group[0]
                whole = _small_record(op, record_layout(op.dtype, op.shape), files) if type(op) is Record else None
                fd = outputs[op.dst]
                if whole is not None and isinstance(fd, int):  # a small record's bytes, built whole
                    gathered.write_at(fd, whole, typing.cast(Record, op).offset)  # only a Record is built whole
                    written += op.output_length
                else:
                    written += _runner(op, files, outputs, gathered)()
            gathered.flush()
        return written

    return Task(run_all, memory + SMALL_OPERATION + span)


def _copy_spans(batch: list[Operation], files: DataFiles, outputs: Mapping[str, int]) -> list[list[Operation]]:
    """Return `batch` in order as groups: neighbouring copies from one local file into one fd
    whose outputs lie end to end and whose sources fit in one span (SPAN_BYTES, at most twice
    what they copy) together, every other operation alone."""
    if not files.local:
        return [[op] for op in batch]
    groups: list[list[Operation]] = []
    group: list[Operation] = []
    src = dst = None
    start = end = copied = reached = 0
    for op in batch:
        if type(op) is not Copy or not isinstance(outputs[op.dst], int):
            group, src = [], None
            groups.append([op])
            continue
        at, length = op.src_offset, op.length
        if op.dst_offset == reached and op.src == src and op.dst == dst:
            low, high = min(start, at), max(end, at + length)
            if high - low <= SPAN_BYTES and high - low <= 2 * (copied + length):
                group.append(op)
                start, end, copied, reached = low, high, copied + length, reached + length
                continue
        group = [op]
        groups.append(group)
        src, dst, start, end, copied, reached = op.src, op.dst, at, at + length, length, op.dst_offset + length
    return groups


def _span(group: list[Copy]) -> tuple[int, int]:
    return min(op.src_offset for op in group), max(op.src_offset + op.length for op in group)


def _copy_span(group: list[Copy], files: DataFiles, fd: int, gathered: _GatheredWrites) -> int:
    """Run copies from one source span (`_copy_spans`): one read of the span into this thread's
    buffer, each copy's bytes written from there (gathered: they lie end to end)."""
    start, end = _span(group)
    buffer = memoryview(thread_buffer(end - start, "span"))[:end - start]
    files.read_into(group[0].src, start, buffer)
    for op in group:
        gathered.write_at(fd, buffer[op.src_offset - start:op.src_offset - start + op.length], op.dst_offset)
    return sum(op.length for op in group)


class _GatheredWrites:
    """One task's small writes, gathered into one pwrite per contiguous run of one output:
    the records of a batch lie end to end (head, data, tail, next head...)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.fd: int | None = None
        self.start = 0
        self.data = bytearray()

    def write_at(self, fd: int, block: bytes | memoryview, offset: int) -> None:
        if fd == self.fd and offset == self.start + len(self.data) and len(self.data) + len(block) <= self.limit:
            self.data += block
            return
        self.flush()
        if len(block) >= self.limit:
            write_at(fd, block, offset)
            return
        self.fd, self.start = fd, offset
        self.data += block

    def flush(self) -> None:
        if self.data:
            write_at(self.fd, typing.cast(bytes, self.data), self.start)  # any buffer: it writes memoryview(data)
            del self.data[:]
        self.fd = None


def _runner(op: Operation, files: DataFiles, outputs: Mapping[str, int],
            gathered: _GatheredWrites | None) -> Callable[[], int]:
    fd = outputs[op.dst]
    if record_writes.copies_only(op, files, outputs):  # copied in the kernel, its CRC-32 from the stored ones
        record = typing.cast(Record, op)
        return lambda: record_writes.write_record(record, files, fd)
    if isinstance(op, Copy) and files.local and isinstance(fd, int):  # else it streams through `write` below
        def copy() -> int:
            try:
                copy_range(files.fd(op.src), op.src_offset, fd, op.dst_offset, op.length)
            except EOFError:
                raise CorruptBlob(f"{files.path(op.src)}: ends before byte {op.src_offset + op.length} (truncated file?)") from None
            return op.length
        return copy

    size = STREAM_BLOCK if files.local and isinstance(fd, int) else storage.PIECE  # remote: small pieces
    # small local writes are gathered; from remote files each piece is written as it comes (bounded by PIECE)
    put = gathered.write_at if gathered is not None and isinstance(fd, int) and files.local else write_at

    def write() -> int:
        for offset, block in _blocks(op, files, size):
            put(fd, block, offset)
        return op.output_length

    return write


def _blocks(op: Operation, files: DataFiles, block: int = STREAM_BLOCK) -> Iterator[tuple[int, bytes | memoryview]]:
    """Yield (output offset, bytes) of all that `op` writes: for a record its head, the data
    of its parts in output order (so the CRC-32 runs over the data as it lies), then its tail."""
    if not isinstance(op, Record):
        assert not isinstance(op, Records)  # run by record_writes, or split into its records (`expanded`, `verify`)
        yield from output_blocks(op, files, {}, block)
        return
    layout = record_layout(op.dtype, op.shape)
    whole = _small_record(op, layout, files)
    if whole is not None:
        yield op.offset, whole
        return
    yield op.offset, layout.head
    pieces = sorted(
        ((offset, part, index) for part in op.parts for index, offset in enumerate(_piece_offsets(part))),
        key=lambda item: item[0],
    )
    decoded: dict = {}
    crc = 0
    for _, part, index in pieces:
        if isinstance(part, Gather):
            part = replace(part, pieces=(part.pieces[index],))
        for offset, data in output_blocks(part, files, decoded, block):
            crc = zlib.crc32(data, crc)
            yield offset, data
    yield op.offset + layout.data_offset + layout.data_length, layout.tail(crc)


def _small_record(op: Record, layout: RecordLayout, files: DataFiles) -> bytes | None:
    """Return the whole record (head, data, tail) when it is small and its parts are copies
    from local files laid end to end in output order: one read per part (neighbouring short
    ones in one span: `record_writes.copy_groups`) and one CRC-32, without streaming it block
    by block. None for any other record."""
    if layout.length > SMALL_OPERATION or not files.local:
        return None
    at = op.offset + layout.data_offset
    for part in op.parts:
        if type(part) is not Copy or part.dst_offset != at:
            return None
        at += part.length
    if at - op.offset - layout.data_offset != layout.data_length:
        return None
    data = [bytes(record_writes.gathered(group, files)) if len(group) > 1
            else files.read(group[0].src, group[0].src_offset, group[0].length)
            for group in record_writes.copy_groups(typing.cast(tuple[Copy, ...], op.parts))]
    joined = b"".join(data)
    return b"".join((layout.head, joined, layout.tail(zlib.crc32(joined))))


def _piece_offsets(part: Copy | Gather) -> list[int]:
    return [part.dst_offset] if isinstance(part, Copy) else [offset for _, offset, _ in part.pieces]


def output_blocks(op: Convert | Gather | Band | Copy | Put | Dequantize | Quantize, files: DataFiles, decoded: dict,
                  block: int = STREAM_BLOCK) -> Iterator[tuple[int, bytes | memoryview]]:
    """Yield (output offset, bytes) that `op` writes, in output order; a block is valid only
    until the next is asked for (they share this thread's buffers). `decoded` caches decoded
    chunks across the parts of one record. A copy moves `block` bytes at a time (from a
    remote source: one GET read in pieces of at most `storage.PIECE`)."""
    if isinstance(op, Copy):
        size = block if files.local else min(block, storage.PIECE)
        buffer = memoryview(thread_buffer(size))[:size]
        at = op.dst_offset
        for piece in files.pieces(op.src, op.src_offset, op.length, buffer):
            yield at, piece
            at += len(piece)
    elif isinstance(op, Convert):
        raw = thread_buffer(op.length)
        files.read_into(op.src, op.src_offset, memoryview(raw)[:op.length])
        yield op.dst_offset, cast_in_place(raw, op.length, op.source_dtype, op.dtype)
    elif isinstance(op, Dequantize):
        yield op.dst_offset, dequantized_bytes(op, files)
    elif isinstance(op, Quantize):
        yield op.dst_offset, quantized_bytes(op, files)
    elif isinstance(op, Put):
        yield op.dst_offset, op.data
    elif isinstance(op, Band):
        yield op.offset, band_bytes(op, files)
    else:
        key = (op.tensor.fqn, op.chunk, op.dtype)
        data = decoded.get(key)
        if data is None:
            data = decoded[key] = gather_bytes(op, files)
        view = memoryview(data)
        for start, offset, length in op.pieces:
            yield offset, view[start:start + length]


def band_bytes(op: Band, files: DataFiles) -> memoryview:
    """Return the band's output bytes: each part's rows read (and cast), its pieces placed."""
    band = memoryview(thread_buffer(op.length, "band"))[:op.length]
    for part in op.parts:
        source = part.source
        if source is not None and part.dtype == part.tensor.dtype:  # read in place: no bytes object per part
            data = memoryview(thread_buffer(source.length, "read"))[:source.length]
            files.read_into(source.file, source.offset, data)
        else:
            data = memoryview(gather_bytes(part, files))
        for start, at, length in part.pieces:
            at -= op.offset
            band[at:at + length] = data[start:start + length]
    return band


def gather_bytes(op: Gather, files: DataFiles) -> bytes:
    """Return the chunk's row-major bytes, decoded when needed, cast to the op's dtype."""
    if op.source is not None:
        data = files.read(op.source.file, op.source.offset, op.source.length)
    else:
        data = read_chunk(files, op.tensor, op.tensor.chunks[op.chunk])
    return cast(data, op.tensor.dtype, op.dtype)


def cast_in_place(buffer: bytearray, length: int, source_dtype: str, dtype: str) -> memoryview:
    """Return the first `length` bytes of `buffer` converted as `tensor.to(dtype)` converts
    them, as a view of this thread's reusable cast buffer.

    torch reads `buffer` where it is and `copy_` writes into the reused buffer: `.to(dtype)`
    is `empty` + `copy_` in torch (`_to_copy`), so the bytes are the same, without a fresh
    allocation per block.
    """
    import torch

    count = length // dtypes.ITEMSIZE[source_dtype]
    output_length = count * dtypes.ITEMSIZE[dtype]
    output = thread_buffer(output_length, "cast")
    values = torch.frombuffer(buffer, dtype=getattr(torch, source_dtype), count=count)
    torch.frombuffer(output, dtype=getattr(torch, dtype), count=count).copy_(values)
    return memoryview(output)[:output_length]


def cast(data: bytes, source_dtype: str, dtype: str) -> bytes:
    """Return the bytes of `data` (elements of `source_dtype`) converted as torch's
    `tensor.to(dtype)` converts them."""
    if source_dtype == dtype or not data:
        return data
    return bytes(cast_in_place(bytearray(data), len(data), source_dtype, dtype))


def output_crc(fd: int, offset: int, length: int, operations: Sequence[Operation]) -> int:
    """Return the CRC-32 of `length` output bytes at `offset`: combined from the CRCs
    torch.save stored for the source chunks when `operations` are whole-chunk copies laid end
    to end over exactly that range, else computed by reading the written bytes back (also
    where a stored CRC-32 is 0: torch.save writes 0 under `set_crc32_options(False)`)."""
    at, crc = offset, 0
    for op in sorted(operations, key=first_offset):
        if not isinstance(op, Copy) or not op.crc32 or op.dst_offset != at:
            break
        crc = crc32_combine(crc, op.crc32, op.length)
        at += op.length
    else:
        if at == offset + length:
            return crc
    crc = 0
    for start in range(offset, offset + length, VERIFY_BLOCK):
        crc = zlib.crc32(os.pread(fd, min(VERIFY_BLOCK, offset + length - start), start), crc)
    return crc


def first_offset(op: Operation) -> int:
    if isinstance(op, Gather):
        return min(offset for _, offset, _ in op.pieces) if op.pieces else 0
    return op.offset if isinstance(op, (Record, Records, Band)) else op.dst_offset


def verify(operations: Iterable[Operation], files: DataFiles, outputs: Mapping[str, int], *, threads: int,
           max_memory: int, describe: Callable[[Operation], str],
           on_done: Callable[[int], None] | None = None) -> None:
    """Read the output back and compare it byte for byte with what each operation must have
    written (source re-read, re-cast or re-decoded; a record's head and tail as well); raise
    VerificationFailed naming `describe(op)` and the output byte at the first difference
    (a Records operation is compared a block at a time from local files, and where it differs,
    or from remote ones, record by record: the message names the record)."""

    def check(op: Operation) -> Callable[[], int]:
        def run_check() -> int:
            if (record_writes.runs_fast(op, files, outputs)  # a Records operation
                    and record_writes.records_match(typing.cast(Records, op), files, outputs[op.dst])):
                return op.output_length
            for part in op.records() if type(op) is Records else (op,):
                for offset, block in _blocks(part, files):
                    _compare(outputs[part.dst], offset, block, part, describe)
            return op.output_length

        return run_check

    tasks = (_checks([check(op) for op in batch], max(2 * op.memory or 2 * STREAM_BLOCK for op in batch))
             for batch in batches(operations))
    run_tasks(tasks, threads, max_memory, on_done)


def _checks(checks: list[Callable[[], int]], memory: int) -> Task:
    """Return one task running `checks` in turn."""
    return Task(lambda: sum(check() for check in checks), memory)


def _compare(fd: int, offset: int, expected: bytes | memoryview, op: Operation,
             describe: Callable[[Operation], str]) -> None:
    expected = bytes(expected)  # bytes == bytes is one memcmp; a memoryview compares per element
    actual = os.pread(fd, len(expected), offset)
    if actual != expected:
        position = next((i for i, (x, y) in enumerate(zip(actual, expected)) if x != y), len(actual))
        raise VerificationFailed(
            f"{describe(op)} differs from the source at output byte {offset + position}; the output was not kept"
        )
