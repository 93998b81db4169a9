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

Integer and bool tensors are compared across the sources before anything is written
(`check_copied`) and copied from the first.

Example:
    >>> files = [DataFiles(path) for path in sources]
    >>> check_copied(plan, files, threads=4, max_memory=512 << 20)
    >>> write_state_dict(plan, files, Path("avg.safetensors"), sharded=False, write=WriteOptions())
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence, cast

import numpy as np

from ckpttool.core.errors import InvalidCheckpoint, UsageError, VerificationFailed, WriteFailed
from ckpttool.dcp.blobs import DataFiles, RawData, read_chunk
from ckpttool.dcp.writer import metadata_bytes
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.options import WriteOptions
from ckpttool.outputs import atomic_directory, atomic_output
from ckpttool.plan.average import Average, AverageOperation, AveragePlan, AverageRecord
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

Emit = Callable[[object, "bytes | memoryview", int], None]  # (output, bytes, offset): write, or compare


def _array(role: str, dtype, count: int) -> np.ndarray:
    """This thread's reusable buffer `role` as `count` elements of `dtype` (no allocation per block)."""
    size = count * np.dtype(dtype).itemsize
    return np.frombuffer(thread_buffer(max(size, 1), role), dtype=dtype, count=count)


def _read(op: Average, source: int, files: DataFiles, role: str = "average-read") -> np.ndarray:
    """Return the block's elements of source `source` (as stored: bfloat16 as uint16 bits)."""
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


def _weighted(x: np.ndarray, dtype: str, weight: float, out: np.ndarray) -> None:
    """out = weight * float64(x), rounded in float64 (bfloat16 bits widened exactly through float32)."""
    if dtype == "bfloat16":
        bits = _array("average-widened", np.uint32, len(x))
        np.copyto(bits, x)
        np.left_shift(bits, 16, out=bits)
        x = bits.view(np.float32)
    np.multiply(x, np.float64(weight), out=out, dtype=np.float64)


def cast_float64(acc: np.ndarray, dtype: str) -> np.ndarray:
    """Return `acc` converted as torch's `acc_tensor.to(dtype)` converts it on CPU (a thread
    buffer): float32 rounds once; float16 and bfloat16 round to float32, then to 16 bits,
    each to nearest even; a bfloat16 NaN as c10's scalar conversion writes it (module doc)."""
    if dtype == "float64":
        return acc
    single = _array("average-single", np.float32, len(acc))
    with np.errstate(over="ignore", invalid="ignore"):  # to +-inf, as torch
        np.copyto(single, acc, casting="unsafe")
    if dtype == "float32":
        return single
    if dtype == "float16":  # numpy converts as the F16C instruction torch uses: NaN payloads too
        half = _array("average-out", np.float16, len(acc))
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(half, single, casting="unsafe")
        return half
    nan = np.isnan(single)
    wide = single.view(np.uint32)
    rounded = _array("average-widened", np.uint32, len(acc))
    np.right_shift(wide, 16, out=rounded)
    np.bitwise_and(rounded, 1, out=rounded)
    np.add(rounded, 0x7FFF, out=rounded)
    np.add(rounded, wide, out=rounded)  # wraps only for negative NaNs, replaced below
    np.right_shift(rounded, 16, out=rounded)
    out = _array("average-out", np.uint16, len(acc))
    np.copyto(out, rounded, casting="unsafe")
    out[nan] = BFLOAT16_NAN
    return out


def block_bytes(op: Average, weights: Sequence[float], sources: Sequence[DataFiles]) -> memoryview:
    """Return the bytes `op` writes (valid until this thread's next block): the weighted sum
    of the sources in order, cast; an integer or bool block's bytes of the first source."""
    if not op.averaged:
        return _read(op, 0, sources[0]).data.cast("B")
    acc = _array("average-acc", np.float64, op.count)
    term = _array("average-term", np.float64, op.count)
    for number, (weight, files) in enumerate(zip(weights, sources)):
        x = _read(op, number, files)
        if number == 0:
            _weighted(x, op.dtype, weight, acc)
        else:
            _weighted(x, op.dtype, weight, term)
            np.add(acc, term, out=acc)
    return cast_float64(acc, op.dtype).data.cast("B")


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
        emit(fd, block_bytes(op, weights, sources), op.dst_offset)
        return op.output_length
    layout = record_layout(op.dtype, op.shape)
    emit(fd, layout.head, op.offset)
    crc = 0
    for part in op.parts:
        data = block_bytes(part, weights, sources)
        crc = zlib.crc32(data, crc)
        emit(fd, data, part.dst_offset)
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


def _share(plan: AveragePlan, sources: Sequence[DataFiles], write: WriteOptions
           ) -> Callable[[list[Operation], dict[str, int]], None]:
    def run_share(operations: list[Operation], fds: dict[str, int]) -> None:
        ops = cast(list[AverageOperation], operations)
        budget = cast(int, write.max_memory)
        with write.progress("average", sum(op.output_length for op in ops)) as bar:
            run(ops, plan.weights, sources, fds, threads=write.threads, max_memory=budget, on_done=bar.update)
        if write.verify:
            with write.progress("verify", sum(op.output_length for op in ops)) as bar:
                run(ops, plan.weights, sources, fds, threads=write.threads, max_memory=budget, on_done=bar.update,
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
