"""`reshard`: rewrite a DCP checkpoint for a new world size (or HSDP mesh), offline, streaming.

The pipeline: read `.metadata` -> integrity gate -> plan (`plan.reshard.plan_reshard`: which
rank file holds which chunk, from which source byte runs; pure) -> locate the source chunks'
raw bytes (record headers only) -> lay the rank files out (`plan_writes`: objects copied
verbatim, then one torch.save record per chunk; pure) -> `execute.run` into the
preallocated files of a temporary directory (a large record's data copied in the kernel, its
CRC-32 combined from those torch.save stored for the source records; a small one's summed as
its bytes pass; each rank file fsynced as soon as its last record is written, while the
copies into the next files run) -> `.metadata` -> optional `--verify` -> rename into place.
Memory holds only the blocks in flight (`max_memory`); nothing decodes a tensor unless its
source blob is transformed (zstd) or strided.

Example:
    >>> report = reshard("runs/gpt/step-00000200", None, world_size=3)
    >>> report.destination, [r.nbytes for r in report.plan.files]
    (PosixPath('runs/gpt/step-00000200-world3'), [34080, 34080, 33600])
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, cast

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.run import distributed, execute, locating
from ckpttool.store import io
from ckpttool.core.checkpoint import Checkpoint, as_path
from ckpttool.dcp.blobs import DataFiles
from ckpttool.dcp.writer import metadata_bytes
from ckpttool.run.distributed import ProcessStats
from ckpttool.core.errors import CheckpointError, UsageError, VerificationFailed, WriteFailed
from ckpttool.check.integrity import Problem
from ckpttool.outputs import atomic_directory, check_destination, refuse_overlap
from ckpttool.plan.operations import Record
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.options import SourceOptions, WriteOptions
from ckpttool.plan.rank_files import ReshardWrites, plan_writes
from ckpttool.plan.reshard import EVERY_TENSOR_RULE, Mesh, ReshardPlan, parse_mesh, plan_reshard
from ckpttool.formats import peft
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.readers.detect import MEGATRON_COMMON, MEGATRON_CONFIG

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
    problems: tuple[Problem, ...] = ()  # the integrity gate's warnings
    processes: tuple[ProcessStats, ...] = ()  # what each process wrote (several under torchrun)
    model_view: ModelView | None = None  # the model the sharding rule took parameters from
    requests: int = 0  # ranged GETs of the source's data files (object storage; 0 for local files)

    @property
    def world_size(self) -> int:
        return self.plan.world_size


def default_destination(source: Path, mesh: Mesh) -> Path:
    """Return `SRC-world{N}` beside SRC (`../NAME-world{N}` for `.`, the directory one is in)."""
    if source.name in ("", ".", ".."):
        source = source.resolve()
    return source.parent / f"{source.name}-world{mesh.world_size}"


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    world_size: int | None = None,
    mesh: str | tuple[int, int] | None = None,
    *,
    keep_whole: Sequence[str] = (),
    to: str | None = None,
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
) -> ReshardReport:
    """Return a report after writing `src` resharded for `world_size` ranks (or an HSDP `mesh`
    of R replicas x S shards) as a DCP checkpoint at `dst` (default `SRC-world{N}`).

    Rank r's file holds what FSDP2 `fully_shard` on that layout owns: sharded tensors split
    along dim 0 like torch.chunk, optimizer state like its parameter, replicated tensors and
    objects once (`plan.reshard` says which rule decides what is sharded; `keep_whole` globs
    name tensors to leave in one piece). Stock `torch.distributed.checkpoint.load` reads the
    result; nothing is left at `dst` unless the whole write (and `write.verify`) succeeded.
    `to="transformers"`: a Megatron-Core torch_dist save written as the transformers model and
    AdamW state `get_state_dict` / `set_state_dict` give a `fully_shard` model
    (naming/megatron_optimizer.py); by default keys stay as saved (Megatron loads its reshard).

    Example:
        >>> reshard("ckpt/step-00000100", "ckpt/step-00000100-hsdp", mesh="2,4").plan.world_size
        8
    """
    started = time.perf_counter()
    origin = as_path(source.locate(src))
    target_mesh = parse_mesh(world_size, mesh)
    destination = as_path(source.locate(dst)) if dst is not None else default_destination(origin, target_mesh)
    refuse_overlap(destination, origin)
    detection, checkpoint = readers.read(origin, source.follow_symlinks, as_saved=True, layout=source.layout)  # DCP keys kept as the framework saved them
    warnings = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    rule = None
    if to is not None:  # the framework's save as transformers' model + AdamW state (every tensor a byte range of it)
        checkpoint, rule = _migrated(detection.layout, checkpoint, to, source, write.threads)
    view = find_model(checkpoint, source.model_prefix if to is None else None)
    plan = plan_reshard(checkpoint, target_mesh, keep_whole, view, rule)
    if write.dry_run:
        return ReshardReport(origin, destination, plan, time.perf_counter() - started, plan.nbytes, 0,
                             dry_run=True, problems=warnings, model_view=view)
    check_destination(destination, write.force, write.notify)
    save_id = str(uuid.uuid5(_SAVE_ID_NAMESPACE, f"{checkpoint.save_id}:{target_mesh}"))
    budget = cast(int, write.max_memory) // 2  # half of --max-memory for coalesced reads from object storage
    with DataFiles(checkpoint.path, source.follow_symlinks, budget, distributed.active() is None) as files:
        writes, processes = write_dcp(checkpoint, plan, files, destination, save_id=save_id, write=write,
                                      beside=() if to is not None else None)  # a migration is no Megatron save
        requests = files.requests
    return ReshardReport(origin, destination, plan, time.perf_counter() - started, plan.nbytes, writes.file_bytes,
                         verified=write.verify, problems=warnings, processes=processes, model_view=view,
                         requests=requests)


def _migrated(layout: str, checkpoint: Checkpoint, to: str, source: SourceOptions, threads: int
              ) -> tuple[Checkpoint, str]:
    """Return `checkpoint` (of `layout`, as saved) as `get_state_dict` lays out transformers'
    model and its AdamW state, and the sharding rule for it: fully_shard's, every parameter and
    its state along dim 0 (the chunks are the table's pieces, not a sharding)."""
    from ckpttool.naming import megatron_optimizer  # the naming engine and tables: imported by a migration only

    if to != megatron_optimizer.TRANSFORMERS:
        raise UsageError(f"--to {to}: reshard writes `{megatron_optimizer.TRANSFORMERS}` (a Megatron save as "
                         "transformers' model and AdamW state for FSDP2)")
    migration = megatron_optimizer.plan_migration(layout, checkpoint, source.follow_symlinks)
    with DataFiles(checkpoint.path, source.follow_symlinks) as files:
        located = locating.locate_chunks(files, migration.sources(), threads)
    return migration.checkpoint(located), EVERY_TENSOR_RULE


def write_dcp(checkpoint: Checkpoint, plan: ReshardPlan, files: DataFiles, destination: Path, *, save_id: str,
              write: WriteOptions, label: str = "reshard", beside: Sequence[tuple[str, bytes]] | None = None
              ) -> tuple[ReshardWrites, tuple[ProcessStats, ...]]:
    """Write `plan` of `checkpoint` as a DCP checkpoint at `destination`, atomically: rank
    files preallocated, filled (under torchrun, each process its share), verified if asked,
    fsynced, then `.metadata` (encoded meanwhile). `beside`: (name, bytes) of the files written
    next to them (default: the CARRIED_FILES beside the source). Returns what was written and
    the work of each process."""
    force, verify, threads = write.force, write.verify, write.threads
    budget = cast(int, write.max_memory)  # bytes: WriteOptions parses a size when built
    writes = plan_writes(plan, checkpoint, locating.locate_chunks(files, checkpoint.tensors.values(), threads))

    def prepare(fds: dict[str, int]) -> None:
        for name, size in writes.files:
            execute.reserve(fds[name], size)

    def run_share(operations, fds: dict[str, int], syncs: _Syncs | None = None) -> None:
        with write.progress(label, sum(op.output_length for op in operations)) as bar, io.Writeback(fds) as writeback:
            execute.run(operations, files, fds, threads=threads, max_memory=budget, on_done=bar.update,
                        on_file_done=syncs.start if syncs is not None else None, on_written=writeback.written)
        if verify:
            _verify(operations, files, fds, threads, budget)

    carried = carried_files(checkpoint) if beside is None else list(beside)

    def finish(temp: Path, fds: dict[str, int], syncs: _Syncs | None = None) -> None:
        # `.metadata` is encoded while the data files are flushed: one waits on the disk, the
        # other on the interpreter (each ~0.4 s at 300k chunks)
        with ThreadPoolExecutor(1) as pool:
            synced = pool.submit(syncs.wait if syncs is not None else _Syncs.all, fds)
            metadata = metadata_bytes(writes.tensors, writes.objects, plan.planner_data, destination, save_id)
            synced.result()
        for name, data in carried:
            execute.write_file(temp / name, data)
        execute.write_file(temp / METADATA_FILENAME, metadata)
        if verify:
            _verify_metadata(temp)

    names = [name for name, _ in writes.files]
    try:
        if distributed.active() is not None:  # under torchrun: every process writes a share
            processes = distributed.write(writes.operations, destination, names, directory=True, force=force,
                                          prepare=prepare, run_share=run_share, finish=finish, streamed=not verify,
                                          notify=write.notify)
        else:
            written = time.perf_counter()
            with atomic_directory(destination, force=force, streamed=not verify, notify=write.notify) as output:
                with output.opened(names) as fds, _Syncs(fds) as syncs:
                    prepare(fds)
                    run_share(writes.operations, fds, syncs)
                    finish(output.path, fds, syncs)
            processes = (ProcessStats(0, sum(op.output_length for op in writes.operations),
                                      time.perf_counter() - written),)
    except OSError as error:
        raise WriteFailed(f"{destination}: writing failed ({error.strerror or error}); nothing was left there") from None
    return writes, processes


class _Syncs:
    """The rank files' fsyncs, each started on a background thread as soon as the file is
    written through (`start`, `execute.run`'s `on_file_done`): the disk flushes a finished
    file while the copies into the next ones run, rather than all of them after the last copy
    (rank files are written one after another, in file order), up to `io.SYNC_THREADS` at once.
    `wait` returns once every file is on disk; leaving the context waits for any fsync still
    running (before the fds close)."""

    def __init__(self, fds: dict[str, int]):
        self.fds = fds
        self.pool = ThreadPoolExecutor(io.SYNC_THREADS, thread_name_prefix="ckpttool-fsync")
        self.started: dict[str, Future] = {}

    def start(self, name: str) -> None:
        self.started[name] = self.pool.submit(io.sync, self.fds[name])

    def wait(self, fds: dict[str, int]) -> None:
        for name in fds:
            if name not in self.started:  # never reported done (a run that wrote nothing into it)
                self.start(name)
        for name in fds:
            self.started[name].result()

    @staticmethod
    def all(fds: dict[str, int]) -> None:
        io.sync_all(fds.values())

    def __enter__(self) -> _Syncs:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# files beside the data that describe the checkpoint and go with it to its new layout: PEFT's
# adapter_config.json (the LoRA settings the bundled trainer saves; `export --adapter` reads it),
# Megatron-Core's common.pt (args, optimizer param groups, scheduler) and metadata.json (which
# tells Megatron's dist_checkpointing.load, and ckpttool, that the folder is its torch_dist save)
CARRIED_FILES = (peft.CONFIG_NAME, MEGATRON_COMMON, MEGATRON_CONFIG)
MAX_CARRIED_BYTES = 64 << 20  # common.pt is tens of kB; a larger file is not one of these


def carried_files(checkpoint: Checkpoint) -> list[tuple[str, bytes]]:
    """Return (name, bytes) of the CARRIED_FILES beside `checkpoint` (regular files, not
    symlinks, up to MAX_CARRIED_BYTES), read before anything is written."""
    carried = []
    for name in CARRIED_FILES:
        path = checkpoint.path / name
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_CARRIED_BYTES:
                continue
            carried.append((name, path.read_bytes()))
        except OSError:
            continue  # unreadable: the resharded checkpoint is whole without it
    return carried


def _verify(operations, files: DataFiles, fds: dict[str, int], threads: int, budget: int) -> None:
    def describe(op) -> str:
        if isinstance(op, Record):
            return f"{op.dst}: {op.fqn} chunk at {list(op.chunk_offsets)}"
        return f"{op.dst}: an object at byte {op.dst_offset}"

    execute.verify(operations, files, fds, threads=threads, max_memory=budget, describe=describe)


def _verify_metadata(directory: Path) -> None:
    """Raise VerificationFailed unless the written checkpoint passes the integrity gate."""
    try:
        integrity.gate(read_checkpoint(directory))
    except CheckpointError as error:
        raise VerificationFailed(f"{directory}: the written checkpoint is inconsistent ({error})") from None
