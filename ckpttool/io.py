"""Executing IO: atomic outputs that survive signals, byte-range copies, a thread pool, sizes.

Every writer in ckpttool goes through `atomic_output` (one file) or `atomic_directory`
(a checkpoint directory): the data is written under a temporary name beside the target
(or, for one file where the filesystem allows it, with no name at all: `O_TMPFILE`),
fsynced, and renamed into place only when complete. A failure, a full disk, Ctrl-C, SIGTERM
or SIGHUP (under `interruptible()`, as the CLI runs every command) never leaves a
half-written output behind; after a SIGKILL, the next run that writes the same output removes
what the killed run left (`remove_stale_temps`).

Example:
    >>> with interruptible(), atomic_output("out/model.safetensors") as handle:
    ...     handle.write(header)
    ...     copy_range(src_fd, 4096, handle.fileno(), len(header), 1 << 20)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, ContextManager, Iterable, Iterator

from ckpttool.errors import OutputExists, UsageError

# Entries beside an output: .ckpttool-tmp-NAME.HOST.PID.TOKEN while NAME is written,
# .ckpttool-old-NAME.HOST.PID.TOKEN while the NAME it replaced is removed.
TEMP_PREFIX = ".ckpttool-"  # every entry ckpttool puts beside an output starts with this
WRITING_PREFIX = TEMP_PREFIX + "tmp-"
OLD_PREFIX = TEMP_PREFIX + "old-"
DEFAULT_MAX_MEMORY = "512MB"  # bound on buffers in flight (consolidate, reshard)
DEFAULT_THREADS = 4  # IO-bound: enough to keep a disk busy, few enough for 2 cores
INTERRUPT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)  # Ctrl-C; Slurm, Kubernetes and `timeout`; a closed terminal
PAUSE_ENV = "CKPTTOOL_TEST_PAUSE"  # test-only, see `_test_pause`

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


# ---------------------------------------------------------------------------------------------
# Signals: SIGTERM and SIGHUP stop a run the way Ctrl-C does


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the run; raised in the main thread under
    `interruptible()`. `exit_code` is the shell's 128 + signal number.

    A KeyboardInterrupt, so that code which already cleans up after Ctrl-C does so for every
    signal, and no `except Exception` swallows it.
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


@dataclass
class _SignalState:
    installed: bool = False
    raised: bool = False  # an Interrupted is unwinding: later signals must not cut its cleanup short
    deferring: int = 0  # depth of `_signals_deferred` blocks
    pending: int = 0  # a signal that arrived while deferred


_signals = _SignalState()


def _on_signal(signum: int, frame: Any) -> None:
    if _signals.raised or _signals.deferring:
        _signals.pending = _signals.pending or signum
        return
    _signals.raised = True
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Return a context in which SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main
    thread, so every `atomic_*` block being written removes its temporary output.

    Only the first signal is raised; later ones are ignored while it unwinds, so the cleanup
    finishes (SIGKILL still stops the process: the next run removes what it left). Signals
    that are ignored (`nohup`) or have a handler of someone else's are left alone, and
    outside the main thread (where Python cannot handle signals) this does nothing. Handlers
    are restored on exit.
    """
    global _signals
    if _signals.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in INTERRUPT_SIGNALS:
        handler = signal.getsignal(signum)
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = handler
            signal.signal(signum, _on_signal)
    _signals = _SignalState(installed=True)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _signals = _SignalState()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold signals during a few steps that must not stop half-way (creating a temporary and
    noting it, two renames); a signal that arrived meanwhile is raised at the end."""
    _signals.deferring += 1
    try:
        yield
    finally:
        _signals.deferring -= 1
        if not _signals.deferring and _signals.pending and not _signals.raised:
            _signals.raised = True
            raise Interrupted(_signals.pending)


# ---------------------------------------------------------------------------------------------
# Temporary names, and what killed runs left


_HOST = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:32]
_ENTRY = re.compile(  # host, pid and token hold no dot, so the name may
    re.escape(TEMP_PREFIX)
    + r"(?P<kind>tmp|old)-(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]*)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]{8})"
)
_tokens: set[str] = set()  # tokens of the entries this process created
_stale_listeners: list[Callable[["StaleTemp"], None]] = []


def _new_token() -> str:
    token = uuid.uuid4().hex[:8]
    _tokens.add(token)
    return token


def _entry(target: Path, kind: str, token: str) -> Path:
    return target.parent / f"{TEMP_PREFIX}{kind}-{target.name}.{_HOST}.{os.getpid()}.{token}"


@dataclass(frozen=True)
class StaleTemp:
    """An entry a killed run left beside `target`, now dealt with: removed, or (`restored`) a
    previous output that the run had moved aside just before it died, put back."""

    path: Path
    target: Path
    pid: int
    restored: bool = False

    def __str__(self) -> str:
        if self.restored:
            return f"restored {self.target} from {self.path}, moved aside by a killed run (pid {self.pid})"
        return f"removed stale temp {self.path} left by a killed run (pid {self.pid})"


def _is_dead(host: str, pid: int, token: str) -> bool:
    if host != _HOST or pid <= 0:
        return False  # another machine's run (shared filesystem): no way to tell, leave it
    if pid == os.getpid():
        return token not in _tokens  # an earlier process with our pid (containers reuse low pids)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def remove_stale_temps(target: str | os.PathLike) -> list[StaleTemp]:
    """Return what runs that were killed (SIGKILL, power loss) left beside `target`, after
    removing it: `.ckpttool-tmp-*` and `.ckpttool-old-*` entries for the same name whose
    process, on this host, is gone.

    A run killed between its two renames left the previous `target` moved aside and a
    complete new one unrenamed: the previous one is put back (`restored`), as if the run had
    never started. Entries of live processes and of other hosts are left alone.

    Example:
        >>> [str(stale) for stale in remove_stale_temps("ckpt/step-00000100-world8")]
        ['removed stale temp ckpt/.ckpttool-tmp-step-00000100-world8.node7.4121.1f0c9a2e left by a killed run (pid 4121)']
    """
    target = Path(target)
    try:
        names = sorted(os.listdir(target.parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = _ENTRY.fullmatch(name)
        if match and match["name"] == target.name and _is_dead(match["host"], int(match["pid"]), match["token"]):
            found.append((match["kind"], match["token"], int(match["pid"]), target.parent / name))
    unrenamed = {token for kind, token, _, _ in found if kind == "tmp"}
    removed = []
    for kind, token, pid, path in found:
        if kind == "old" and token in unrenamed and not (target.exists() or target.is_symlink()):
            os.rename(path, target)
            removed.append(StaleTemp(path, target, pid, restored=True))
            continue
        _remove_tree(path)
        if not (path.exists() or path.is_symlink()):
            removed.append(StaleTemp(path, target, pid))
    return removed


@contextlib.contextmanager
def reporting_stale_temps(callback: Callable[[StaleTemp], None]) -> Iterator[None]:
    """Return a context in which `check_destination` and `atomic_*` pass each `StaleTemp`
    they deal with to `callback` (the CLI prints it on stderr)."""
    _stale_listeners.append(callback)
    try:
        yield
    finally:
        _stale_listeners.remove(callback)


def check_destination(path: str | os.PathLike, force: bool) -> None:
    """Raise OutputExists when `path` exists and `force` is off.

    First removes what killed runs left beside `path` (`remove_stale_temps`, reported to
    `reporting_stale_temps` callbacks): a run about to write `path` calls this.
    """
    if _remote(path):
        from ckpttool import storage

        from ckpttool import uploads

        return uploads.check_destination(storage.location(path), force)
    path = Path(path)
    for stale in remove_stale_temps(path):
        for listener in _stale_listeners:
            listener(stale)
    if path.exists() or path.is_symlink():
        if not force:
            raise OutputExists(f"{path}: already exists; pass --force to replace it")


def refuse_overlap(output: str | os.PathLike, source: str | os.PathLike) -> None:
    """Raise UsageError (exit 2) when `output` is `source`, lies inside it or contains it
    (symlinks resolved): writing there, with `--force` above all, would destroy the source.

    Example:
        >>> refuse_overlap("ckpt/model.safetensors", "ckpt")
        UsageError: ckpt/model.safetensors: lies inside the source checkpoint ckpt; ...
    """
    if _remote(output) or _remote(source):
        from ckpttool import storage

        where = storage.overlaps(output, source)
    else:
        out, src = Path(os.path.realpath(output)), Path(os.path.realpath(source))
        where = "is" if out == src else "lies inside" if src in out.parents else "contains" if out in src.parents else None
    if where:
        raise UsageError(f"{output}: {where} the source checkpoint {source}; write the output elsewhere "
                         "(nothing was touched)")


def _prepare(target: Path, force: bool) -> list[Path]:
    """Check the destination and create its missing parents; return those, deepest first, so
    a failed run can remove them again (`_remove_created`)."""
    check_destination(target, force)
    created = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    return created


def _remove_created(directories: list[Path]) -> None:
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if still empty


# ---------------------------------------------------------------------------------------------
# Atomic outputs


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_O_TMPFILE = getattr(os, "O_TMPFILE", None)  # Linux 3.11+
_unnamed_files_work: dict[int, bool] = {}  # st_dev -> O_TMPFILE files there can be linked into place


def _open_unnamed(directory: Path, name: Path) -> BinaryIO | None:
    """Return a file with no name in `directory` (it vanishes with the process, even on
    SIGKILL) that `_link_into` can name at the end, or None where the OS or filesystem cannot.

    Whether it can is tried once per filesystem, with an empty file linked to `name` and
    unlinked: a filesystem may refuse O_TMPFILE (EOPNOTSUPP: NFS), a kernel may predate it
    (EISDIR), a sandbox may refuse the link (EXDEV) or have no /proc.
    """
    if _O_TMPFILE is None:
        return None
    device = os.stat(directory).st_dev
    if device not in _unnamed_files_work:
        works = False
        with contextlib.suppress(OSError):
            fd = os.open(directory, _O_TMPFILE | os.O_RDWR, 0o600)
            try:
                _link_into(fd, name)
                os.unlink(name)
                works = True
            finally:
                os.close(fd)
        _unnamed_files_work[device] = works
    if not _unnamed_files_work[device]:
        return None
    return os.fdopen(os.open(directory, _O_TMPFILE | os.O_RDWR, 0o666), "w+b")


def _link_into(fd: int, path: Path) -> None:
    """Give the unnamed file open as `fd` the name `path`: linkat(2) of /proc/self/fd/N with
    AT_SYMLINK_FOLLOW. (os.link calls link(2), which links the /proc symlink itself and
    fails with EXDEV, unless given a directory fd.)"""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = True, unnamed: bool = True,
                  streamed: bool = False) -> Iterator[BinaryIO]:
    """Yield a file open for writing (`.write`, `.flush`, `.fileno()`); when the block
    succeeds it is fsynced and renamed to `path`.

    The file has no name while it is written (`O_TMPFILE`, so even SIGKILL leaves nothing),
    or where the filesystem cannot do that (or `unnamed` is off: other processes must open
    it, as under torchrun), `.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside `path`, which is then
    `handle.name`. On any exception (including `Interrupted`) it is removed and `path` is
    left as it was. An existing `path` is replaced only with `force`. A storage URL
    (`s3://...`) is written in a local temporary directory and uploaded when complete, or
    with `streamed` (for writers that write every byte once and never read back) uploaded
    while it is written; then what is yielded is a `uploads.MultipartSink`, to be passed
    where an fd goes (`writable`) (`uploads.remote_output`).
    """
    if _remote(path):
        yield from _remote_output(path, force, directory=False, streamed=streamed)
        return
    target = Path(path)
    created = _prepare(target, force)
    named = _entry(target, "tmp", _new_token())
    with _signals_deferred():
        handle = _open_unnamed(target.parent, named) if unnamed else None
        unnamed = handle is not None
        handle = handle or open(named, "x+b")
    committed = False
    try:
        _test_pause("start")
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        _test_pause("commit")
        with _signals_deferred():
            if unnamed:
                _link_into(handle.fileno(), named)
            handle.close()
            old = _put_in_place(named, target)
            committed = True
        _fsync_directory(target.parent)
        if old is not None:
            _remove_old(old)
    except BaseException:
        handle.close()
        if not committed:
            named.unlink(missing_ok=True)
            _remove_created(created)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, force: bool = False, streamed: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory (`.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside `path`)
    that becomes `path` when the block succeeds.

    Files written inside should be fsynced by their writer; the directory itself is fsynced
    before the rename. An existing `path` is replaced only with `force`: it is renamed aside
    to `.ckpttool-old-NAME...`, the new one renamed into place, then the old one removed, so
    `path` is always either the old or the complete new directory. On any exception
    (including `Interrupted`) before the rename, the temporary directory is removed.

    Example:
        >>> with atomic_directory("ckpt/step-00000100-world8", force=True) as directory:
        ...     (directory / ".metadata").write_bytes(metadata)

    A storage URL (`s3://...`) is built in a local temporary directory and uploaded when
    complete, or with `streamed` its data files (opened by `execute.opened_outputs`) are
    uploaded while they are written (`uploads.remote_output`).
    """
    if _remote(path):
        yield from _remote_output(path, force, directory=True, streamed=streamed)
        return
    target = Path(path)
    created = _prepare(target, force)
    temp = _entry(target, "tmp", _new_token())
    with _signals_deferred():
        temp.mkdir()
    committed = False
    try:
        _test_pause("start")
        yield temp
        _fsync_directory(temp)
        _test_pause("commit")
        with _signals_deferred():
            old = _put_in_place(temp, target)
            committed = True
        _fsync_directory(target.parent)
        if old is not None:
            _remove_old(old)
    except BaseException:
        if not committed:
            _remove_tree(temp)
            _remove_created(created)
        raise


def _remote(path: str | os.PathLike) -> bool:
    from ckpttool import storage

    return storage.is_remote(path)


def _remote_output(path: str | os.PathLike, force: bool, directory: bool, streamed: bool) -> Iterator[Any]:
    from ckpttool import storage, uploads

    with uploads.remote_output(storage.location(path), force, directory, streamed) as local:
        if directory or not isinstance(local, Path):
            yield local
        else:
            with open(local, "x+b") as handle:
                yield handle
                handle.flush()


def _put_in_place(temp: Path, target: Path) -> Path | None:
    """Rename `temp` to `target`; return where a previous `target` was moved, or None.

    rename(2) replaces a file in one step, but not a directory (nor a file by a directory):
    those are moved aside first, under the same token as `temp` (see `remove_stale_temps`).
    """
    old = None
    replacing_directory = temp.is_dir() or (target.is_dir() and not target.is_symlink())
    if replacing_directory and (target.exists() or target.is_symlink()):
        old = target.parent / temp.name.replace(WRITING_PREFIX, OLD_PREFIX, 1)
        os.rename(target, old)
    try:
        os.replace(temp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    return old


def _remove_old(old: Path) -> None:
    """Remove a replaced output, already renamed aside. Interrupted, it finishes the removal
    before re-raising; killed, the next run's `remove_stale_temps` finishes it."""
    try:
        if old.is_dir() and not old.is_symlink():
            for entry in list(old.iterdir()):
                _remove_tree(entry)
                _test_pause("remove-old")
        _remove_tree(old)
    except BaseException:
        _remove_tree(old)
        raise


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


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


Output = Any  # an fd (int), or an object with `write_at(data, offset)`, `reserve(size)` (uploads.MultipartSink)


def writable(handle: Any) -> Output:
    """What `write_at` takes for a handle `atomic_output` yielded: its fd, or the sink itself."""
    return handle.fileno() if hasattr(handle, "fileno") else handle


def sync(output: Output) -> None:
    """fsync an fd; a streamed output has nothing to flush before its commit."""
    if isinstance(output, int):
        os.fsync(output)


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
                _test_pause("copy")

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


# ---------------------------------------------------------------------------------------------
# Test-only: pausing a run at a known point


_paused: set[str] = set()


def _test_pause(phase: str) -> None:
    """Test-only: with `CKPTTOOL_TEST_PAUSE=<phase>:<seconds>` set, print
    `ckpttool-test: paused at <phase>` on stderr and sleep, the first time `phase` is reached,
    so a test can send a signal at a known point of a run. Phases: `start` (temporary output
    created), `copy` (first IO task done), `commit` (written and fsynced, before the rename),
    `remove-old` (a replaced directory partly removed), `upload` (a remote output's first
    file uploaded to its temporary key, or all parts of a streamed one's first file sent,
    `uploads.remote_output`)."""
    setting = os.environ.get(PAUSE_ENV)
    if not setting or phase in _paused:
        return
    wanted, _, seconds = setting.partition(":")
    if wanted != phase:
        return
    _paused.add(phase)
    print(f"ckpttool-test: paused at {phase}", file=sys.stderr, flush=True)
    time.sleep(float(seconds or 60))
