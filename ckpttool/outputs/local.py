"""Atomic outputs on a local (or NFS, Lustre) filesystem: a file or a directory that appears
only when complete.

A file is written with no name at all (`O_TMPFILE`) where the filesystem allows it, else as
`.ckpttool-tmp-NAME...` beside the target (`temps`); a directory is built as such a temporary
directory. Either is fsynced and renamed into place only when complete; any exception
(`Interrupted` included) removes it and leaves the target as it was. A directory replacing a
directory first gets hard links to the old one's files that are not ckpttool's
(`replacing`: the user's config, tokenizer, notes), then is swapped in with two renames (old
aside, new in), and the old one is removed.

Example:
    >>> with atomic_file(Path("out/model.safetensors"), force=False) as handle:
    ...     handle.write(header)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from ckpttool.core import testpoints
from ckpttool.core.errors import OutputExists
from ckpttool.store.io import Output
from ckpttool.outputs.notices import Notify, Replaced, ignore
from ckpttool.outputs.replacing import replacement
from ckpttool.outputs.signals import deferred
from ckpttool.outputs.temps import OLD_PREFIX, WRITING_PREFIX, new_token, remove_stale_temps, remove_tree, temp_name


@dataclass(frozen=True)
class OutputDirectory:
    """A directory output while it is built: `path` is a local directory that becomes the
    output (or, for object storage, holds its small files until the commit uploads them);
    `sink`, for a streamed upload, makes each data file a `MultipartSink` instead of a file."""

    path: Path
    sink: Callable[[str], Output] | None = None

    @contextlib.contextmanager
    def opened(self, names: Iterable[str]) -> Iterator[dict[str, Output]]:
        """Yield name -> fd of new files `names` in the directory, open for writing, closed on
        exit; or name -> upload, for a streamed remote output (`io.write_at` takes either)."""
        if self.sink is not None:
            yield {name: self.sink(name) for name in names}
            return
        fds: dict[str, int] = {}
        try:
            for name in names:
                fds[name] = os.open(self.path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)


def check(path: Path, force: bool, notify: Notify = ignore) -> None:
    """Raise OutputExists when `path` exists and `force` is off, after removing what killed
    runs left beside it (each told to `notify`)."""
    for stale in remove_stale_temps(path):
        notify(stale)
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputExists(f"{path}: already exists; pass --force to replace it")


def _prepare(target: Path, force: bool) -> list[Path]:
    """Check the destination and create its missing parents; return those, deepest first, so
    a failed run can remove them again (`_remove_created`)."""
    check(target, force)
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
def atomic_file(target: Path, force: bool, unnamed: bool = True) -> Iterator[BinaryIO]:
    """Yield a file open for writing that becomes `target` when the block succeeds (fsynced,
    then renamed): unnamed while written where it can be, else `.ckpttool-tmp-NAME...` beside
    `target` (then `handle.name`; `unnamed` off asks for that: other processes must open it,
    as under torchrun). On any exception it is removed and `target` is left as it was."""
    created = _prepare(target, force)
    named = target.parent / temp_name(target.name, "tmp", new_token())
    with deferred():
        handle = _open_unnamed(target.parent, named) if unnamed else None
        unnamed = handle is not None
        handle = handle or open(named, "x+b")
    committed = False
    try:
        testpoints.pause("start")
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        testpoints.pause("commit")
        with deferred():
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
def atomic_directory(target: Path, force: bool, notify: Notify = ignore) -> Iterator[OutputDirectory]:
    """Yield a fresh temporary directory beside `target` that becomes `target` when the block
    succeeds (fsynced, then renamed; files inside are fsynced by their writer). An existing
    `target` is replaced only with `force`: what it holds besides ckpttool's files and the
    files written now is linked into the new directory (`_keep`), the old one renamed aside
    to `.ckpttool-old-NAME...`, the new one renamed into place, the old one removed, so
    `target` is always either the old or the complete new directory. On any exception before
    the rename, the temporary directory is removed."""
    created = _prepare(target, force)
    temp = target.parent / temp_name(target.name, "tmp", new_token())
    with deferred():
        temp.mkdir()
    committed = False
    try:
        testpoints.pause("start")
        yield OutputDirectory(temp)
        replaced = _keep(target, temp) if force else ()
        _fsync_directory(temp)
        testpoints.pause("commit")
        with deferred():
            old = _put_in_place(temp, target)
            committed = True
        _fsync_directory(target.parent)
        if replaced:
            notify(Replaced(str(target), replaced))
        if old is not None:
            _remove_old(old)
    except BaseException:
        if not committed:
            remove_tree(temp)
            _remove_created(created)
        raise


def _keep(target: Path, temp: Path) -> tuple[str, ...]:
    """Link into `temp` the entries of the existing directory `target` that the new output
    keeps (`replacing.replacement`); return the names of those it replaces that were not
    ckpttool's. The old directory is left as it was: until the rename, it is the output."""
    if not target.is_dir() or target.is_symlink():
        return ()  # a file, or a link to somewhere else: replaced whole, as before
    plan = replacement([entry.name for entry in target.iterdir()], [entry.name for entry in temp.iterdir()])
    for name in plan.keep:
        _link_tree(target / name, temp / name)
    return plan.replaced


def _link_tree(source: Path, destination: Path) -> None:
    """Give `destination` the same content as `source` without copying bytes: a hard link of
    a file (or of a symlink itself), directories made anew and filled the same way; a copy
    where the filesystem refuses the link (another device below, a file of another user
    under `fs.protected_hardlinks`)."""
    if source.is_dir() and not source.is_symlink():
        destination.mkdir()
        for entry in sorted(source.iterdir()):
            _link_tree(entry, destination / entry.name)
        shutil.copystat(source, destination)
        return
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
            raise
        shutil.copy2(source, destination, follow_symlinks=False)


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
                remove_tree(entry)
                testpoints.pause("remove-old")
        remove_tree(old)
    except BaseException:
        remove_tree(old)
        raise
