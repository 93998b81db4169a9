"""`reshard`: rewrite a DCP checkpoint for a new world size (or HSDP mesh), offline, streaming.

The pipeline: read `.metadata` -> plan (`reshard_plan.plan_reshard`: which rank file holds
which chunk and which source byte runs fill it) -> lay each rank file out (object blobs copied
verbatim, then one torch.save record per chunk, `dcp.writer.record_layout`) -> stream the
runs on a thread pool into the preallocated files of a temporary directory, computing each
record's CRC-32 as the bytes pass -> `.metadata` -> optional `--verify` -> rename into place.
Memory holds only the blocks in flight (`max_memory`); nothing decodes a tensor unless its
source blob is transformed (zstd) or strided.

Example:
    >>> report = reshard("runs/gpt/step-00000200", None, world_size=3)
    >>> report.destination, [r.nbytes for r in report.plan.files]
    (PosixPath('runs/gpt/step-00000200-world3'), [34080, 34080, 33600])
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ckpttool import integrity
from ckpttool.dcp.blobs import DataFiles, RawData, locate, read_chunk
from ckpttool.dcp.metadata import Checkpoint, Tensor, read_checkpoint
from ckpttool.dcp.writer import (
    StoredChunk,
    StoredObject,
    StoredTensor,
    metadata_bytes,
    record_layout,
)
from ckpttool.errors import CorruptBlob, UsageError, VerificationFailed, WriteFailed
from ckpttool.io import DEFAULT_MAX_MEMORY, DEFAULT_THREADS, ProgressFactory, Task, no_progress, atomic_directory, check_destination, copy_range, parse_size, run_tasks, thread_buffer, write_at
from ckpttool.reshard_plan import Mesh, ReshardPlan, TargetChunk, parse_mesh, plan_reshard

STREAM_BLOCK = 8 << 20  # bytes read, checksummed and written per step of a run
METADATA_FILENAME = ".metadata"
_SAVE_ID_NAMESPACE = uuid.UUID("5b1c1e0e-8a4f-4f37-9a55-3b0f9d6f2c11")

@dataclass(frozen=True)
class ReshardReport:
    """What reshard wrote (or, with dry_run, would write)."""

    source: Path
    destination: Path
    plan: ReshardPlan
    seconds: float
    tensor_bytes: int
    file_bytes: int  # total size of the written data files (0 for a dry run)
    dry_run: bool = False
    verified: bool = False

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def throughput(self) -> float:
        """Bytes per second of tensor data written."""
        return self.tensor_bytes / self.seconds if self.seconds > 0 else 0.0


def default_destination(source: Path, mesh: Mesh) -> Path:
    """Return `SRC-world{N}` beside SRC."""
    return source.parent / f"{source.name}-world{mesh.world_size}"


# ---------------------------------------------------------------------------------------------
# Laying out the files


@dataclass(frozen=True)
class _PlacedChunk:
    chunk: TargetChunk
    offset: int  # where its record starts in the rank file


@dataclass(frozen=True)
class _FileLayout:
    name: str
    size: int
    objects: tuple[StoredObject, ...]
    chunks: tuple[_PlacedChunk, ...]


def _lay_out(plan: ReshardPlan) -> list[_FileLayout]:
    layouts = []
    for rank_file in plan.files:
        at = 0
        objects = []
        for obj in rank_file.objects:
            objects.append(StoredObject(obj.fqn, rank_file.name, at, obj.source.length, obj.source.transforms))
            at += obj.source.length
        placed = []
        for chunk in rank_file.chunks:
            placed.append(_PlacedChunk(chunk, at))
            at += record_layout(chunk.dtype, chunk.sizes).length
        layouts.append(_FileLayout(rank_file.name, at, tuple(objects), tuple(placed)))
    return layouts


def _stored_tensors(plan: ReshardPlan, layouts: list[_FileLayout]) -> list[StoredTensor]:
    where: dict[tuple[str, tuple[int, ...]], StoredChunk] = {}
    for layout in layouts:
        for placed in layout.chunks:
            chunk = placed.chunk
            length = record_layout(chunk.dtype, chunk.sizes).length
            where[(chunk.fqn, chunk.offsets)] = StoredChunk(chunk.offsets, chunk.sizes, layout.name, placed.offset, length)
    return [
        StoredTensor(t.fqn, t.dtype, t.shape, tuple(where[(t.fqn, offsets)] for offsets in t.chunks))
        for t in plan.tensors
    ]


# ---------------------------------------------------------------------------------------------
# Reading source runs


class _Sources:
    """Finds each source chunk's raw bytes once (thread-safe); decodes the rare blob that
    cannot be read in place (zstd, strided) and keeps it only while needed."""

    def __init__(self, checkpoint: Checkpoint, files: DataFiles):
        self.checkpoint = checkpoint
        self.files = files
        self._located: dict[tuple[str, int], RawData | None] = {}
        self._lock = threading.Lock()

    def raw(self, tensor: Tensor, index: int) -> RawData | None:
        key = (tensor.fqn, index)
        with self._lock:
            if key in self._located:
                return self._located[key]
        found = locate(self.files, tensor, tensor.chunks[index])
        with self._lock:
            self._located[key] = found
        return found

    def blocks(self, tensor: Tensor, index: int, offset: int, length: int, decoded: dict) -> Iterator[bytes | memoryview]:
        """Yield `length` bytes at `offset` of chunk `index`'s raw bytes, in blocks (each one
        valid only until the next is asked for: they share this thread's buffer)."""
        raw = self.raw(tensor, index)
        if raw is None:
            data = decoded.get(index)
            if data is None:
                data = decoded[index] = read_chunk(self.files, tensor, tensor.chunks[index])
            yield data[offset:offset + length]
            return
        if offset + length > raw.length:
            raise CorruptBlob(f"{self.files.path(raw.file)}: {tensor.fqn} chunk {index} is shorter than its metadata says")
        buffer = memoryview(thread_buffer(STREAM_BLOCK))
        for start in range(offset, offset + length, STREAM_BLOCK):
            block = buffer[:min(STREAM_BLOCK, offset + length - start)]
            self.files.read_into(raw.file, raw.offset + start, block)
            yield block  # valid until the next block: the caller writes it before asking again


def _memory_of(chunk: TargetChunk, checkpoint: Checkpoint) -> int:
    """Bytes a chunk's task holds: one block, or whole source chunks that must be decoded."""
    tensor = checkpoint.tensors[chunk.fqn]
    decoded = sum(
        tensor.chunks[i].numel * tensor.itemsize
        for i in {run.source_chunk for run in chunk.runs}
        if tensor.chunks[i].blob is not None and tensor.chunks[i].blob.transforms
    )
    return max(min(chunk.nbytes, STREAM_BLOCK), decoded)


def _write_chunk(sources: _Sources, fd: int, placed: _PlacedChunk) -> int:
    chunk = placed.chunk
    tensor = sources.checkpoint.tensors[chunk.fqn]
    layout = record_layout(chunk.dtype, chunk.sizes)
    data_start = placed.offset + layout.data_offset
    write_at(fd, layout.head, placed.offset)
    crc = 0
    decoded: dict[int, bytes] = {}
    for run in chunk.runs:
        at = data_start + run.target_offset
        for block in sources.blocks(tensor, run.source_chunk, run.source_offset, run.length, decoded):
            crc = zlib.crc32(block, crc)
            write_at(fd, block, at)
            at += len(block)
    write_at(fd, layout.tail(crc), data_start + layout.data_length)
    return chunk.nbytes


def _copy_object(files: DataFiles, fd: int, obj: StoredObject, source_file: str, source_offset: int) -> int:
    # bounds-checked read of the first byte range, then an in-kernel copy
    if source_offset + obj.length > files.size(source_file):
        raise CorruptBlob(
            f"{files.path(source_file)}: {obj.fqn} lies beyond the end of the file (truncated file?)"
        )
    try:
        copy_range(files.fd(source_file), source_offset, fd, obj.offset, obj.length)
    except EOFError as error:
        raise CorruptBlob(f"{files.path(source_file)}: {obj.fqn}: {error}") from None
    return 0


# ---------------------------------------------------------------------------------------------
# Verification: read the output back through the reader, compare with the source


def _verify(destination: Path, plan: ReshardPlan, sources: _Sources, threads: int, budget: int) -> None:
    """Read the written checkpoint back through the reader and compare every chunk and object
    with the source, on the thread pool; raise VerificationFailed at the first difference."""
    written = read_checkpoint(destination)
    stored_chunks = {(fqn, chunk.offsets): chunk for fqn, tensor in written.tensors.items() for chunk in tensor.chunks}
    with DataFiles(destination) as out:

        def check_chunk(rank_file, chunk: TargetChunk) -> int:
            stored = stored_chunks.get((chunk.fqn, chunk.offsets))
            if stored is None or stored.sizes != chunk.sizes or stored.blob is None or stored.blob.file != rank_file.name:
                raise VerificationFailed(f"{destination}: {chunk.fqn} chunk at {list(chunk.offsets)} is missing from the written metadata")
            raw = locate(out, written.tensors[chunk.fqn], stored)
            source = sources.checkpoint.tensors[chunk.fqn]
            crc = 0
            decoded: dict[int, bytes] = {}
            for run in chunk.runs:
                at = raw.offset + run.target_offset
                for block in sources.blocks(source, run.source_chunk, run.source_offset, run.length, decoded):
                    # bytes against bytes is one memcmp; against a memoryview, element by element
                    if out.read(raw.file, at, len(block)) != bytes(block):
                        raise VerificationFailed(
                            f"{out.path(raw.file)}: {chunk.fqn} chunk at {list(chunk.offsets)} differs "
                            f"from the source at byte {at - raw.offset}"
                        )
                    crc = zlib.crc32(block, crc)
                    at += len(block)
            if raw.crc32 is not None and raw.crc32 != crc:
                raise VerificationFailed(f"{out.path(raw.file)}: {chunk.fqn} chunk at {list(chunk.offsets)}: CRC-32 mismatch")
            return chunk.nbytes

        def check_object(obj) -> int:
            stored = written.objects.get(obj.fqn)
            if stored is None or stored.blob is None:
                raise VerificationFailed(f"{destination}: {obj.fqn} is missing from the written metadata")
            if out.read(stored.blob.file, stored.blob.offset, stored.blob.length) != sources.files.read(
                obj.source.file, obj.source.offset, obj.source.length
            ):
                raise VerificationFailed(f"{destination}: {obj.fqn} differs from the source")
            return 0

        def tasks() -> Iterator[Task]:
            for rank_file in plan.files:
                for chunk in rank_file.chunks:
                    yield Task(lambda rank_file=rank_file, chunk=chunk: check_chunk(rank_file, chunk),
                               2 * _memory_of(chunk, sources.checkpoint))
                for obj in rank_file.objects:
                    yield Task(lambda obj=obj: check_object(obj), 2 * obj.source.length)

        run_tasks(tasks(), threads, budget)


# ---------------------------------------------------------------------------------------------
# The command


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    world_size: int | None = None,
    mesh: str | tuple[int, int] | None = None,
    *,
    max_memory: str | int = DEFAULT_MAX_MEMORY,
    threads: int = DEFAULT_THREADS,
    force: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    progress: ProgressFactory | None = None,
) -> ReshardReport:
    """Return a report after writing `src` resharded for `world_size` ranks (or an HSDP `mesh`
    of R replicas x S shards) as a DCP checkpoint at `dst` (default `SRC-world{N}`).

    Rank r's file holds what FSDP2 `fully_shard` on that layout owns: sharded tensors split
    along dim 0 like torch.chunk, optimizer state like its parameter, replicated tensors and
    objects once. Stock `torch.distributed.checkpoint.load` reads the result; nothing is left
    at `dst` unless the whole write (and `verify`) succeeded.

    Example:
        >>> reshard("ckpt/step-00000100", "ckpt/step-00000100-hsdp", mesh="2,4").plan.world_size
        8
    """
    started = time.perf_counter()
    source = Path(src)
    target_mesh = parse_mesh(world_size, mesh)
    budget = parse_size(max_memory)
    if budget <= 0:
        raise UsageError("--max-memory must be positive")
    if threads < 1:
        raise UsageError("--threads must be at least 1")
    checkpoint = read_checkpoint(source)
    integrity.gate(checkpoint)
    destination = Path(dst) if dst is not None else default_destination(source, target_mesh)
    if destination.resolve() == source.resolve():
        raise UsageError(f"{destination}: the destination is the source checkpoint; choose another directory")
    plan = plan_reshard(checkpoint, target_mesh)
    if dry_run:
        return ReshardReport(source, destination, plan, time.perf_counter() - started, plan.nbytes, 0, dry_run=True)
    check_destination(destination, force)

    layouts = _lay_out(plan)
    stored_objects = [obj for layout in layouts for obj in layout.objects]
    source_blobs = {obj.fqn: obj.source for rank_file in plan.files for obj in rank_file.objects}
    progress = progress or no_progress
    with DataFiles(source) as files, atomic_directory(destination, force=force) as temp:
        sources = _Sources(checkpoint, files)
        fds: list[int] = []
        try:
            for layout in layouts:
                fd = os.open(temp / layout.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                os.ftruncate(fd, layout.size)

            def tasks() -> Iterator[Task]:
                for fd, layout in zip(fds, layouts):
                    for obj in layout.objects:
                        blob = source_blobs[obj.fqn]
                        yield Task(lambda fd=fd, obj=obj, blob=blob: _copy_object(files, fd, obj, blob.file, blob.offset))
                    for placed in layout.chunks:
                        yield Task(lambda fd=fd, placed=placed: _write_chunk(sources, fd, placed),
                                   _memory_of(placed.chunk, checkpoint))

            with progress("reshard", plan.nbytes) as bar:
                run_tasks(tasks(), threads, budget, on_done=bar.update)
            for fd in fds:
                os.fsync(fd)
        except OSError as error:
            raise WriteFailed(f"{destination}: writing failed ({error.strerror or error}); nothing was left there") from None
        finally:
            for fd in fds:
                os.close(fd)
        save_id = str(uuid.uuid5(_SAVE_ID_NAMESPACE, f"{checkpoint.save_id}:{target_mesh}"))
        metadata = metadata_bytes(_stored_tensors(plan, layouts), stored_objects, plan.planner_data, destination, save_id)
        try:
            _write_file(temp / METADATA_FILENAME, metadata)
        except OSError as error:
            raise WriteFailed(f"{destination}: writing .metadata failed ({error.strerror or error})") from None
        if verify:
            _verify(temp, plan, sources, threads, budget)
    file_bytes = sum(layout.size for layout in layouts)
    return ReshardReport(
        source, destination, plan, time.perf_counter() - started, plan.nbytes, file_bytes, verified=verify
    )


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def summary_text(report: ReshardReport) -> str:
    """Return what the CLI prints: the plan for a dry run, else one summary line."""
    if report.dry_run:
        return f"{report.plan.describe()}\n(dry run: nothing written to {report.destination})"
    checked = ", verified" if report.verified else ""
    return (
        f"wrote {report.destination}: {report.world_size} ranks (mesh {report.plan.mesh}), "
        f"{len(report.plan.tensors)} tensors, {report.tensor_bytes} bytes of tensor data in "
        f"{report.seconds:.2f} s{checked}"
    )
