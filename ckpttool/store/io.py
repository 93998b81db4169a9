"""Moving bytes: byte-range copies and writes at offsets, per-thread buffers, a bounded thread
pool, and the sizes that bound them (`--max-memory`, `--threads`).

Where the bytes land (atomic outputs, uploads, signals) is `outputs/`'s; this module only
moves them, into an fd or anything with `write_at` (a `multipart.MultipartSink`).

Example:
    >>> copy_range(src_fd, 4096, dst_fd, 96, 1 << 20)
    >>> run_tasks([Task(lambda: copy(a)), Task(lambda: copy(b))], threads=4, max_memory=512 << 20)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator

from ckpttool.core import testpoints
from ckpttool.core.errors import UsageError

if TYPE_CHECKING:
    from concurrent.futures import Future

DEFAULT_MAX_MEMORY = "512MB"  # bound on buffers in flight (consolidate, reshard)
DEFAULT_THREADS = 4  # IO-bound: enough to keep a disk busy, few enough for 2 cores

# progress(description, total_bytes) -> a context manager yielding an object with .update(n)
ProgressFactory = Callable[[str, int], ContextManager[Any]]
COPY_BLOCK = 64 << 20  # bytes per copy_file_range / read call
WRITEBACK_STEP = 32 << 20  # bytes written into an output before the kernel is asked to flush them

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,  # decimal, like huggingface_hub
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """Return a byte count from `5GB` (decimal, as huggingface_hub), `512MiB` or `1000`."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise UsageError(f"cannot read size {text!r}: use e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


# ---------------------------------------------------------------------------------------------
# Moving bytes


_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> None:
    """Copy `length` bytes between two open files at explicit offsets (no shared seek state).

    Uses `os.copy_file_range` (in-kernel, no user-space buffer) where the OS allows it, and
    falls back to pread/pwrite in blocks. Inside a `run_tasks` task it stops between blocks
    once the run is failing or interrupted.
    """
    global _HAS_COPY_FILE_RANGE
    done = 0
    while done < length:
        _stop_if_asked()
        step = min(COPY_BLOCK, length - done)
        if _HAS_COPY_FILE_RANGE:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, step, src_offset + done, dst_offset + done)
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                _HAS_COPY_FILE_RANGE = False
                continue
        else:
            data = os.pread(src_fd, step, src_offset + done)
            copied = os.pwrite(dst_fd, data, dst_offset + done) if data else 0
        if copied == 0:
            raise EOFError(f"source ended {length - done} bytes early at offset {src_offset + done}")
        done += copied


_thread_buffers = threading.local()


def thread_buffer(size: int, role: str = "read") -> bytearray:
    """Return this thread's reusable buffer for `role` ("read", "cast"), at least `size` bytes.

    Streaming code fills it in place (`DataFiles.read_into`, `Tensor.copy_`) instead of
    allocating fresh multi-MiB objects per block: freed blocks linger in the allocator's
    per-thread arenas and would make memory grow with threads and blocks, not the budget.
    """
    buffer = getattr(_thread_buffers, role, None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(size)
        setattr(_thread_buffers, role, buffer)
    return buffer


Output = Any  # an fd (int), or an object with `write_at(data, offset)`, `reserve(size)` (multipart.MultipartSink)


def writable(handle: Any) -> Output:
    """What `write_at` takes for a handle `outputs.atomic_output` yielded: its fd, or the sink itself."""
    return handle.fileno() if hasattr(handle, "fileno") else handle


def sync(output: Output) -> None:
    """fsync an fd; a streamed output has nothing to flush before its commit."""
    if isinstance(output, int):
        os.fsync(output)


# fsyncs in flight at once: on ext4 each fsync ends in a journal commit, and fsyncs issued
# together share one (jbd2's group commit); one at a time, 256 small rank files wait for 256
# commits in a row. 648 MB in 256 files, each fsynced as it was written (a bare-write model of
# benchmarks/reshard.py's 278k case): all on disk after 1.61-1.84 s with 1 thread, 1.33-1.45 s with 4
SYNC_THREADS = 4


def sync_all(outputs: Iterable[Output]) -> None:
    """`sync` every output, up to SYNC_THREADS at once; return when all are on disk."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="ckpttool-fsync") as pool:
        for done in [pool.submit(sync, output) for output in outputs]:
            done.result()


class Writeback:
    """Start the disk on an output's bytes as they are written, not once gigabytes are dirty
    (the kernel starts on its own only at vm.dirty_background_ratio, 10% of memory, then the
    final fsyncs wait for all of it): `written(name, start, end)`, `execute.run`'s
    `on_written`, hands every `step` bytes written into an output to one background thread
    that has the kernel start writing them out (`start_writeback`). Leaving the context
    waits for that thread.

    Example:
        >>> with Writeback(fds) as writeback:
        ...     execute.run(operations, files, fds, threads=4, max_memory=1 << 29, on_written=writeback.written)
    """

    def __init__(self, outputs: dict[str, Output], step: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.outputs = outputs
        self.step = WRITEBACK_STEP if step is None else step
        self.pending: dict[str, tuple[int, int]] = {}  # written, not yet handed to the kernel
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-writeback")

    def written(self, name: str, start: int, end: int) -> None:
        with self.lock:
            low, high = self.pending.get(name, (start, end))
            low, high = min(low, start), max(high, end)
            if high - low < self.step:
                self.pending[name] = (low, high)
                return
            self.pending.pop(name, None)
        self.pool.submit(start_writeback, self.outputs[name], low, high)

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=kind is not None)  # failing: flushing no longer matters


def start_writeback(output: Output, start: int, end: int) -> None:
    """Have the kernel start writing bytes `start:end` of an fd to disk, without waiting for
    it (Linux: POSIX_FADV_DONTNEED starts the writeback of dirty pages, and drops only pages
    already clean); elsewhere, and for a streamed output, nothing."""
    if isinstance(output, int) and end > start and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(output, start, end - start, os.POSIX_FADV_DONTNEED)


def write_at(fd: Output, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked). Inside a
    `run_tasks` task it first stops if the run is failing or interrupted."""
    _stop_if_asked()
    if not isinstance(fd, int):
        fd.write_at(data, offset)
        return
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


# ---------------------------------------------------------------------------------------------
# Running many independent IO operations (consolidate's Copy/Convert/Gather) on a thread pool


@dataclass(frozen=True)
class Task:
    """One unit of IO work: `run()` returns the bytes it wrote (for progress); `memory` is
    the buffer bytes it holds while running (0 for in-kernel copies)."""

    run: Callable[[], int]
    memory: int = 0


class _Stopped(Exception):
    """A task gave up between blocks because its run is failing or was interrupted."""


_task_context = threading.local()  # .stop: the Event of the run_tasks call this thread works for


def _stop_if_asked() -> None:
    stop = getattr(_task_context, "stop", None)
    if stop is not None and stop.is_set():
        raise _Stopped()


def _run_task(run: Callable[[], int], stop: threading.Event) -> int:
    _task_context.stop = stop
    try:
        return run()
    finally:
        _task_context.stop = None


def run_tasks(
    tasks: Iterable[Task],
    threads: int,
    max_memory: int,
    on_done: Callable[[int], None] | None = None,
) -> None:
    """Run `tasks` on `threads` threads, with at most `max_memory` bytes of task buffers in
    flight (a single task larger than that runs alone).

    On the first error, or KeyboardInterrupt / `Interrupted` in the calling thread, no
    further task starts; running ones stop at their next block (`copy_range`, `write_at`)
    and are waited for (so no thread writes to a file the caller is about to remove), then
    the error is raised.
    """
    # the pool's module (and logging, which it loads) only for commands that move bytes
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpttool-io")
    stop = threading.Event()
    in_flight: dict[Future, int] = {}
    used = 0

    def drain(until_below: int, needed: int) -> None:
        nonlocal used
        while in_flight and (len(in_flight) >= until_below or used + needed > max_memory):
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                used -= in_flight.pop(future)
                written = future.result()
                if on_done is not None:
                    on_done(written)
                testpoints.pause("copy")

    try:
        for task in tasks:
            drain(2 * max(1, threads), task.memory)
            in_flight[pool.submit(_run_task, task.run, stop)] = task.memory
            used += task.memory
        drain(1, 0)
    except BaseException:
        stop.set()
        for future in in_flight:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


@contextlib.contextmanager
def no_progress(description: str, total: int) -> Iterator[Any]:
    """A ProgressFactory that shows nothing (the library default; the CLI passes tqdm)."""

    class _Silent:
        def update(self, count: int) -> None:
            pass

    yield _Silent()
