"""Run an average plan: read each block's bytes from every source, compute, write atomically.

The arithmetic (docs/average.md), per floating tensor, in float64 with numpy (elementwise
ufuncs: each product and each sum rounded on its own, never fused):

    acc = w1 * x1;  acc = acc + w_i * x_i  for i = 2..k in the order given;  out = acc.to(dtype)

The cast is torch's `Tensor.to` on CPU, bit for bit, which goes through float32 for bfloat16
and float16 (torch's double -> Half/BFloat16 conversion converts to float first: two
roundings, both to nearest even). A bfloat16 NaN is the one exception, which torch itself
does not keep stable: its vectorised loop writes 0xFFFF where its scalar loop writes 0x7FC0,
depending on where the element falls in the loop (and on the CPU); here a bfloat16 NaN is
always 0x7FC0, c10's scalar rule. float16 NaNs are torch's in every position (numpy converts
float32 to float16 as the F16C instruction torch uses, payload and sign kept).

Each block is read, summed, cast and written SUB_BLOCK elements at a time (`block_pieces`):
every source's elements of a step are read by range into small buffers of the thread, so the
float64 passes work in a core's cache and the block's working memory is a few steps, whatever
its size. Blocks run on `threads` threads (numpy and the reads release the GIL).

Integer and bool tensors are compared across the sources before anything is written
(`check_copied`) and copied from the first.

Example:
    >>> files = [DataFiles(path) for path in sources]
    >>> check_copied(plan, files, threads=4, max_memory=512 << 20)
    >>> write_state_dict(plan, files, Path("avg.safetensors"), sharded=False, write=WriteOptions())
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, cast

import numpy as np

from ckpttool.core import dtypes
from ckpttool.core.errors import InvalidCheckpoint, UsageError, VerificationFailed, WriteFailed
from ckpttool.dcp.blobs import DataFiles, RawData, read_chunk
from ckpttool.dcp.writer import metadata_bytes
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.options import WriteOptions
from ckpttool.outputs import atomic_directory, atomic_output
from ckpttool.plan.average import WORKING_BYTES, Average, AverageOperation, AveragePlan, AverageRecord
from ckpttool.plan.operations import Operation
from ckpttool.run import distributed, execute
from ckpttool.run.distributed import ProcessStats
from ckpttool.store import io
from ckpttool.store.io import Task, run_tasks, thread_buffer, write_at
from ckpttool.torchsave import ptfile
from ckpttool.torchsave.record import record_layout

NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
         "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint64": np.uint64,
         "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8, "bool": np.uint8}
BFLOAT16_NAN = 0x7FC0  # c10::BFloat16's round_to_nearest_even for any NaN
# elements read, summed and written at a time: each source's elements, the float64 sum and
# product and the output stay in a core's caches from the read to the write, and numpy's
# per-call cost is spread over many elements. Measured on the benchmark's EPYC (L2 1 MiB, L3
# 32 MiB; 3 fp32 sources, numpy 2.4): the arithmetic on whole 1M-element blocks cost 12 ns
# per output element, in 32K-element steps 7 ns with numpy's casting multiply and 1.5 ns
# with the cast and the multiply as two passes; read + arithmetic in steps of 16K, 32K, 64K,
# 128K, 256K, 512K elements: 3.6, 3.2, 2.8-3.1, 2.6-3.0, 2.8, 3.2 ns. Reading 3 GB of page
# cache 128 KiB at a time cost 0.37 s of CPU (as `cat`), 4 MiB at a time or mapped 0.46-0.5 s
SUB_BLOCK = 128 << 10

Emit = Callable[[object, "bytes | memoryview", int], None]  # (output, bytes, offset): write, or compare


def _array(role: str, dtype, count: int) -> np.ndarray:
    """This thread's reusable buffer `role` as `count` elements of `dtype` (no allocation per block)."""
    size = count * np.dtype(dtype).itemsize
    return np.frombuffer(thread_buffer(max(size, 1), role), dtype=dtype, count=count)


def _read(op: Average, source: int, files: DataFiles, role: str = "average-read") -> np.ndarray:
    """Return the block's elements of source `source` (as stored: bfloat16 as uint16 bits),
    copied into this thread's buffer `role`."""
    view = _array(role, NUMPY[op.dtype], op.count)
    raw = view.data.cast("B")
    at = 0
    decoded: dict[int, bytes] = {}
    for piece in op.reads[source]:
        target = raw[at:at + piece.length]
        if isinstance(piece, RawData):
            files.read_into(piece.file, piece.offset, target)
        else:
            chunk = decoded.get(piece.chunk)
            if chunk is None:
                chunk = decoded[piece.chunk] = read_chunk(files, piece.tensor, piece.tensor.chunks[piece.chunk])
            target[:] = chunk[piece.start:piece.start + piece.length]
        at += piece.length
    return view


class _Source:
    """One source's elements of a block, `elements(start, stop)` at a time (each valid until
    the next call): read by range into a sub-block buffer of this thread when the block's
    pieces are raw ranges of local files, else the whole block read (decoded) once."""

    def __init__(self, op: Average, number: int, files: DataFiles, role: str):
        pieces = op.reads[number]
        self.dtype = np.dtype(NUMPY[op.dtype])
        self.streamed = files.local and all(isinstance(piece, RawData) for piece in pieces)
        if not self.streamed:
            self.whole = _read(op, number, files, role)
            return
        self.files = files
        self.pieces = cast("tuple[RawData, ...]", pieces)
        self.ends = list(itertools.accumulate(piece.length for piece in self.pieces))  # in bytes of the block
        self.buffer = _array(role, self.dtype, min(SUB_BLOCK, op.count))

    def elements(self, start: int, stop: int) -> np.ndarray:
        if not self.streamed:
            return self.whole[start:stop]
        view = self.buffer[:stop - start]
        raw = view.data.cast("B")
        begin, end = start * self.dtype.itemsize, stop * self.dtype.itemsize
        index = bisect.bisect_right(self.ends, begin)
        at = begin
        while at < end:
            piece, piece_end = self.pieces[index], self.ends[index]
            piece_start = piece_end - piece.length
            length = min(end, piece_end) - at
            self.files.read_into(piece.file, piece.offset + at - piece_start, raw[at - begin:at - begin + length])
            at += length
            index += 1
        return view


class _Terms:
    """Widens elements as stored to float64 and weighs them, `SUB_BLOCK` at a time, into this
    thread's float64 buffers (each product rounded once, in float64)."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        if dtype == "bfloat16":
            # bfloat16 is the top half of a float32: its bits go into the high halves of a
            # float32 buffer whose low halves are zero (never written: a buffer of its own)
            self.wide = _array("average-bf16-wide", np.float32, SUB_BLOCK)
            self.high = self.wide.view(np.uint16)[1::2]

    def weighted(self, x: np.ndarray, weight: np.float64, out: np.ndarray) -> None:
        """out = weight * float64(x), x's elements as stored (as many as out's)."""
        if self.dtype == "float64":
            np.multiply(x, weight, out=out)
            return
        if self.dtype == "bfloat16":
            high = self.high[:len(x)]
            np.copyto(high, x)
            x = self.wide[:len(x)]
        np.copyto(out, x)  # exact: every float32 and float16 is a float64
        np.multiply(out, weight, out=out)


def cast_float64(acc: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Return `acc` converted as torch's `acc_tensor.to(dtype)` converts it on CPU: float32
    rounds once; float16 and bfloat16 round to float32, then to 16 bits, each to nearest
    even; a bfloat16 NaN as c10's scalar conversion writes it (module doc). Into `out` (of
    the dtype's numpy type, bfloat16 as uint16) when given, else a thread buffer; float64 is
    `acc` itself (or copied into `out`)."""
    if out is None and dtype != "float64":
        out = _array("average-out", NUMPY[dtype], len(acc))
    if dtype == "float64":
        if out is None:
            return acc
        np.copyto(out, acc)
        return out
    assert out is not None
    if dtype == "float32":
        with np.errstate(over="ignore", invalid="ignore"):  # to +-inf, as torch
            np.copyto(out, acc, casting="unsafe")
        return out
    single = _array("average-single", np.float32, len(acc))
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(single, acc, casting="unsafe")
    if dtype == "float16":  # numpy converts as the F16C instruction torch uses: NaN payloads too
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out, single, casting="unsafe")
        return out
    wide = single.view(np.uint32)
    rounded = _array("average-rounded", np.uint32, len(acc))
    np.right_shift(wide, 16, out=rounded)
    np.bitwise_and(rounded, 1, out=rounded)
    np.add(rounded, 0x7FFF, out=rounded)
    np.add(rounded, wide, out=rounded)  # wraps only for negative NaNs, replaced below
    np.right_shift(rounded, 16, out=rounded)
    np.copyto(out, rounded, casting="unsafe")
    nan = _array("average-nan", np.bool_, len(acc))
    np.isnan(single, out=nan)
    if nan.any():
        np.copyto(out, BFLOAT16_NAN, where=nan)
    return out


def block_pieces(op: Average, weights: Sequence[float], sources: Sequence[DataFiles]) -> Iterator[tuple[int, memoryview]]:
    """Yield the bytes `op` writes as (offset in the block's output, bytes), each valid until
    the next: the weighted sum of the sources in order, cast, SUB_BLOCK elements at a time;
    an integer or bool block's bytes of the first source, whole.

    When every source's elements and the output fit the working memory the plan counts per
    element (WORKING_BYTES), each step reads its elements of every source, sums and casts
    them in this thread's cache (`_interleaved`); with more sources, one source at a time
    into a float64 sum of the whole block (`_in_turn`). The arithmetic is the same, in the
    same order."""
    if not op.averaged:
        yield 0, _read(op, 0, sources[0]).data.cast("B")
        return
    weights64 = [np.float64(weight) for weight in weights]
    itemsize = dtypes.ITEMSIZE[op.dtype]
    steps = _interleaved if (len(sources) + 1) * itemsize <= WORKING_BYTES else _in_turn
    for start, out in steps(op, weights64, sources):
        yield start * itemsize, out.data.cast("B")


def block_bytes(op: Average, weights: Sequence[float], sources: Sequence[DataFiles]) -> bytes:
    """Return the bytes `op` writes (`block_pieces` joined)."""
    return b"".join(bytes(piece) for _, piece in block_pieces(op, weights, sources))


def _interleaved(op: Average, weights: list[np.float64], sources: Sequence[DataFiles]
                 ) -> Iterator[tuple[int, np.ndarray]]:
    xs = [_Source(op, number, files, f"average-read-{number}") for number, files in enumerate(sources)]
    terms = _Terms(op.dtype)
    size = min(SUB_BLOCK, op.count)
    acc_buffer, term_buffer = _array("average-acc", np.float64, size), _array("average-term", np.float64, size)
    out_buffer = _array("average-out", NUMPY[op.dtype], size)
    for start in range(0, op.count, SUB_BLOCK):
        stop = min(op.count, start + SUB_BLOCK)
        acc, term = acc_buffer[:stop - start], term_buffer[:stop - start]
        with np.errstate(all="ignore"):  # Inf - Inf is NaN, a sum overflows to Inf: as torch, silently
            terms.weighted(xs[0].elements(start, stop), weights[0], acc)
            for weight, x in zip(weights[1:], xs[1:]):
                terms.weighted(x.elements(start, stop), weight, term)
                np.add(acc, term, out=acc)
        yield start, cast_float64(acc, op.dtype, out_buffer[:stop - start])


def _in_turn(op: Average, weights: list[np.float64], sources: Sequence[DataFiles]
             ) -> Iterator[tuple[int, np.ndarray]]:
    terms = _Terms(op.dtype)
    acc = _array("average-sum", np.float64, op.count)
    size = min(SUB_BLOCK, op.count)
    term_buffer, out_buffer = _array("average-term", np.float64, size), _array("average-out", NUMPY[op.dtype], size)
    with np.errstate(all="ignore"):
        for number, (weight, files) in enumerate(zip(weights, sources)):
            x = _Source(op, number, files, "average-read")
            for start in range(0, op.count, SUB_BLOCK):
                stop = min(op.count, start + SUB_BLOCK)
                if number == 0:
                    terms.weighted(x.elements(start, stop), weight, acc[start:stop])
                    continue
                term = term_buffer[:stop - start]
                terms.weighted(x.elements(start, stop), weight, term)
                np.add(acc[start:stop], term, out=acc[start:stop])
    for start in range(0, op.count, SUB_BLOCK):
        stop = min(op.count, start + SUB_BLOCK)
        yield start, cast_float64(acc[start:stop], op.dtype, out_buffer[:stop - start])


def check_copied(plan: AveragePlan, sources: Sequence[DataFiles], threads: int, max_memory: int) -> None:
    """Raise InvalidCheckpoint naming the first integer or bool tensor whose values differ
    between the first source and another (before anything is written)."""
    names = plan.sources

    def compare(op: Average) -> Callable[[], int]:
        def run() -> int:
            first = _read(op, 0, sources[0], "average-first")
            for number in range(1, len(sources)):
                other = _read(op, number, sources[number])
                differ = np.flatnonzero(first != other)
                if len(differ):
                    element = op.start + int(differ[0])
                    raise InvalidCheckpoint(
                        f"{names[number]}: {op.key} ({op.dtype}) differs from {names[0]}'s at element {element} "
                        f"({other[differ[0]]} != {first[differ[0]]}); integer and bool tensors are copied, so they "
                        "must be equal in every source; nothing was written", code="different-values")
            return op.output_length
        return run

    copied = [part for op in plan.operations for part in _parts(op) if not part.averaged]
    run_tasks((Task(compare(op), 2 * op.memory) for op in copied), threads, max_memory)


def _parts(op: AverageOperation) -> tuple[Average, ...]:
    return op.parts if isinstance(op, AverageRecord) else (op,)


def _emit_operation(op: AverageOperation, weights: Sequence[float], sources: Sequence[DataFiles], fd: object,
                    emit: Emit) -> int:
    if isinstance(op, Average):
        for at, data in block_pieces(op, weights, sources):
            emit(fd, data, op.dst_offset + at)
        return op.output_length
    layout = record_layout(op.dtype, op.shape)
    emit(fd, layout.head, op.offset)
    crc = 0
    for part in op.parts:
        for at, data in block_pieces(part, weights, sources):
            crc = zlib.crc32(data, crc)
            emit(fd, data, part.dst_offset + at)
    emit(fd, layout.tail(crc), op.offset + layout.data_offset + layout.data_length)
    return op.output_length


def first_offset(op: AverageOperation) -> int:
    """Where `op` starts writing in its output file."""
    return op.offset if isinstance(op, AverageRecord) else op.dst_offset


def run(operations: Iterable[AverageOperation], weights: Sequence[float], sources: Sequence[DataFiles],
        outputs: dict[str, int], *, threads: int, max_memory: int, on_done: Callable[[int], None] | None = None,
        verify: bool = False) -> None:
    """Write (or with `verify`, read back and compare) every operation into `outputs` (name
    -> fd), `threads` blocks at a time, at most `max_memory` bytes of working memory in flight."""
    emit: Emit = _compare if verify else cast(Emit, write_at)
    with io.Writeback(outputs) as writeback:
        def task(op: AverageOperation) -> Task:
            def run_one() -> int:
                written = _emit_operation(op, weights, sources, outputs[op.dst], emit)
                if not verify:
                    writeback.written(op.dst, first_offset(op), first_offset(op) + written)
                return written
            return Task(run_one, op.memory)

        run_tasks((task(op) for op in operations), threads, max_memory, on_done)


def _compare(fd: object, expected: bytes | memoryview, offset: int) -> None:
    if not isinstance(fd, int):
        raise UsageError("--verify reads the output back: write it to a local path")
    expected = bytes(expected)
    actual = os.pread(fd, len(expected), offset)
    if actual != expected:
        at = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), len(actual))
        raise VerificationFailed(f"output byte {offset + at} differs from the average recomputed from the sources; "
                                 "the output was not kept")


def compute_threads(threads: int, sources: Sequence[DataFiles]) -> int:
    """Return how many blocks to average at once: `threads` (--threads), at most the cores this
    process may run on (at least 2) when every source is local, since then each block is CPU
    work on page-cache reads and more threads than cores only add buffers and switches (3x1 GB
    on 2 cores: --threads 4 took 1.06x, --threads 2 0.95x the time of cat + writing the output).
    Remote sources keep --threads: their reads wait on the network."""
    if not all(files.local for files in sources):
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(threads, max(2, cores))


def _share(plan: AveragePlan, sources: Sequence[DataFiles], write: WriteOptions
           ) -> Callable[[list[Operation], dict[str, int]], None]:
    threads = compute_threads(write.threads, sources)

    def run_share(operations: list[Operation], fds: dict[str, int]) -> None:
        ops = cast(list[AverageOperation], operations)
        budget = cast(int, write.max_memory)
        with write.progress("average", sum(op.output_length for op in ops)) as bar:
            run(ops, plan.weights, sources, fds, threads=threads, max_memory=budget, on_done=bar.update)
        if write.verify:
            with write.progress("verify", sum(op.output_length for op in ops)) as bar:
                run(ops, plan.weights, sources, fds, threads=threads, max_memory=budget, on_done=bar.update,
                    verify=True)
    return run_share


def write_state_dict(plan: AveragePlan, sources: Sequence[DataFiles], target: Path, sharded: bool,
                     write: WriteOptions) -> tuple[tuple[Path, ...], tuple[ProcessStats, ...]]:
    """Return the files written at `target` (one .safetensors or .pt file, or a directory of
    Hub shards and their index) and what each process wrote, after writing `plan` atomically."""
    template = plan.consolidated
    assert template is not None  # plan_average lays a state dict out from consolidate's plan
    names = [name for name, _ in plan.files]
    written = tuple(target / name for name in names + ([template.index_name] if template.index_name else [])) \
        if sharded else (target,)

    def prepare(fds: dict[str, int]) -> None:
        for output in template.files:
            execute.reserve(fds[output.name], output.size)
            if output.head:
                write_at(fds[output.name], output.head, 0)

    def finish(directory: Path | None, fds: dict[str, int]) -> None:
        for name, layout in template.zip_layouts.items():  # a .pt: its records carry the data's CRC-32
            crcs = {f"{ptfile.ARCHIVE}/data/{position}": execute.output_crc(fds[name], t.offset, t.nbytes, ())
                    for position, t in enumerate(t for t in template.tensors if t.file == name)}
            for offset, data in ptfile.zip_records(layout, crcs):
                write_at(fds[name], data, offset)
        io.sync_all(fds.values())
        if directory is not None and template.index is not None:
            assert template.index_name is not None  # plan_consolidate names every index it makes
            execute.write_file(directory / template.index_name, template.index)

    streamed = not write.verify and not template.zip_layouts
    return written, _write(plan, sources, target, names, sharded, write, streamed, prepare,
                           lambda temp, fds: finish(temp if sharded else None, fds))


def write_dcp(plan: AveragePlan, sources: Sequence[DataFiles], target: Path, save_id: str,
              write: WriteOptions) -> tuple[tuple[Path, ...], tuple[ProcessStats, ...]]:
    """Return the files written at `target` (a DCP checkpoint: rank files and `.metadata`) and
    what each process wrote, after writing `plan` atomically."""
    writes, resharded = plan.writes, plan.resharded
    assert writes is not None and resharded is not None  # plan_average_dcp lays DCP out from reshard's plan
    names = [name for name, _ in writes.files]

    def prepare(fds: dict[str, int]) -> None:
        for name, size in writes.files:
            execute.reserve(fds[name], size)

    def finish(temp: Path, fds: dict[str, int]) -> None:
        io.sync_all(fds.values())
        execute.write_file(temp / METADATA_FILENAME,
                           metadata_bytes(writes.tensors, writes.objects, resharded.planner_data, target, save_id))

    processes = _write(plan, sources, target, names, True, write, not write.verify, prepare, finish)
    return tuple(target / name for name in [*names, METADATA_FILENAME]), processes


def _write(plan: AveragePlan, sources: Sequence[DataFiles], target: Path, names: list[str], directory: bool,
           write: WriteOptions, streamed: bool, prepare: Callable[[dict[str, int]], None],
           finish: Callable[[Path, dict[str, int]], None]) -> tuple[ProcessStats, ...]:
    """Write `plan` into `names` at `target` (a directory of them, or the one file), atomically;
    under torchrun every process writes a share (`distributed.write`)."""
    started = time.perf_counter()
    operations = sorted(plan.operations, key=lambda op: (op.dst, first_offset(op)))
    run_share = _share(plan, sources, write)
    try:
        if distributed.active() is not None:
            return distributed.write(cast(list[Operation], operations), target, names, directory=directory,
                                     force=write.force, prepare=prepare, run_share=run_share, finish=finish,
                                     streamed=streamed, notify=write.notify)
        if directory:
            with atomic_directory(target, force=write.force, streamed=streamed, notify=write.notify) as output:
                with output.opened(names) as fds:
                    prepare(fds)
                    run_share(cast(list[Operation], operations), fds)
                    finish(output.path, fds)
        else:
            with atomic_output(target, force=write.force, streamed=streamed, notify=write.notify) as handle:
                fds = {names[0]: io.writable(handle)}
                prepare(fds)
                run_share(cast(list[Operation], operations), fds)
                finish(target.parent, fds)
    except OSError as error:
        raise WriteFailed(f"{target}: writing failed ({error.strerror or error}); nothing was left there") from None
    moved = sum(op.output_length for op in operations)
    return (ProcessStats(0, moved, time.perf_counter() - started),)
