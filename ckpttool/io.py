"""Executing IO: atomic outputs, byte-range copies between files, sizes.

Every writer in ckpttool goes through `atomic_output` (one file) or `atomic_directory`
(a checkpoint directory): the data is written under a temporary name beside the target,
fsynced, and renamed into place only when complete, so a failure, Ctrl-C or full disk never
leaves a half-written output behind.

Example:
    >>> with atomic_output("out/model.safetensors") as handle:
    ...     handle.write(header)
    ...     copy_range(src_fd, 4096, handle.fileno(), len(header), 1 << 20)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, ContextManager, Iterable, Iterator

from ckpttool.errors import OutputExists, UsageError

TEMP_PREFIX = ".ckpttool-tmp-"
DEFAULT_MAX_MEMORY = "512MB"  # bound on buffers in flight (consolidate, reshard)
DEFAULT_THREADS = 4  # IO-bound: enough to keep a disk busy, few enough for 2 cores

# progress(description, total_bytes) -> a context manager yielding an object with .update(n)
ProgressFactory = Callable[[str, int], ContextManager[Any]]
COPY_BLOCK = 64 << 20  # bytes per copy_file_range / read call

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


def check_destination(path: Path, force: bool) -> None:
    """Raise OutputExists when `path` exists and `force` is off."""
    if path.exists() or path.is_symlink():
        if not force:
            raise OutputExists(f"{path}: already exists; pass --force to replace it")


def _temp_name(path: Path) -> Path:
    return path.parent / f"{TEMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}"


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = True) -> Iterator[BinaryIO]:
    """Yield a file open for writing; on success it is fsynced and renamed to `path`.

    On any exception (including KeyboardInterrupt) the temporary file is removed and `path`
    is left as it was.
    """
    target = Path(path)
    check_destination(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_name(target)
    handle = open(temp, "w+b")
    try:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(temp, target)
        _fsync_directory(target.parent)
    except BaseException:
        handle.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes `path` when the block succeeds.

    Files written inside should be fsynced by their writer; the directory itself is fsynced
    before the rename. An existing `path` is replaced only with `force`.
    """
    target = Path(path)
    check_destination(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_name(target)
    temp.mkdir()
    try:
        yield temp
        _fsync_directory(temp)
        if target.exists() or target.is_symlink():
            old = _temp_name(target)
            os.replace(target, old)
            os.replace(temp, target)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        else:
            os.replace(temp, target)
        _fsync_directory(target.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> None:
    """Copy `length` bytes between two open files at explicit offsets (no shared seek state).

    Uses `os.copy_file_range` (in-kernel, no user-space buffer) where the OS allows it, and
    falls back to pread/pwrite in blocks.
    """
    global _HAS_COPY_FILE_RANGE
    done = 0
    while done < length:
        step = min(COPY_BLOCK, length - done)
        if _HAS_COPY_FILE_RANGE:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, step, src_offset + done, dst_offset + done)
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                _HAS_COPY_FILE_RANGE = False
                continue
            if copied == 0:
                raise EOFError(f"source ended {length - done} bytes early at offset {src_offset + done}")
        else:
            data = os.pread(src_fd, step, src_offset + done)
            if not data:
                raise EOFError(f"source ended {length - done} bytes early at offset {src_offset + done}")
            copied = os.pwrite(dst_fd, data, dst_offset + done)
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


def write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
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


def run_tasks(
    tasks: Iterable[Task],
    threads: int,
    max_memory: int,
    on_done: Callable[[int], None] | None = None,
) -> None:
    """Run `tasks` on `threads` threads, with at most `max_memory` bytes of task buffers in
    flight (a single task larger than that runs alone).

    On the first error, or KeyboardInterrupt in the calling thread, no further task starts;
    running ones finish (so no thread writes to a file the caller is about to remove), then
    the error is raised.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpttool-io")
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

    try:
        for task in tasks:
            drain(2 * max(1, threads), task.memory)
            in_flight[pool.submit(task.run)] = task.memory
            used += task.memory
        drain(1, 0)
    except BaseException:
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
