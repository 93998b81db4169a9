"""Where bytes land: every output ckpttool writes appears only when complete.

One file (`atomic_output`) or a directory (`atomic_directory`), on a local filesystem
(`local`) or object storage (`remote`): this module is the one place that chooses between
them, and imports the one it chooses when it chooses it (a command that writes nothing, or
only imports `notices` or `signals`, loads neither). Beside them: signals that stop a run cleanly (`signals`), temporary names and what
killed runs left (`temps`), multipart uploads (`multipart`), and the notices a run gives on
the way (`notices`).

Example:
    >>> with interruptible(), atomic_directory("ckpt/step-100-world8", force=True) as output:
    ...     with output.opened(["__0_0.distcp"]) as fds:
    ...         write_at(fds["__0_0.distcp"], data, 0)
    ...     (output.path / ".metadata").write_bytes(metadata)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ckpttool.store import storage
from ckpttool.core.errors import UsageError
from ckpttool.outputs.notices import Notify, ignore

if TYPE_CHECKING:
    from ckpttool.outputs.local import OutputDirectory


def _remote(path: str | os.PathLike) -> storage.RemotePath:
    """`path`, which `storage.is_remote` calls remote, as its RemotePath."""
    located = storage.location(path)
    assert isinstance(located, storage.RemotePath)  # location makes a RemotePath of every URL is_remote matches
    return located


def check_destination(path: str | os.PathLike, force: bool, notify: Notify = ignore) -> None:
    """Raise OutputExists when `path` exists and `force` is off (and for object storage,
    StorageError when its bucket does not exist).

    First removes what killed runs left beside `path` (`temps.remove_stale_temps`, each told
    to `notify`): a run about to write `path` calls this.
    """
    if storage.is_remote(path):
        from ckpttool.outputs import remote

        remote.check(_remote(path), force, notify)
    else:
        from ckpttool.outputs import local

        local.check(Path(path), force, notify)


def refuse_overlap(output: str | os.PathLike, source: str | os.PathLike) -> None:
    """Raise UsageError (exit 2) when `output` is `source`, lies inside it or contains it
    (symlinks resolved): writing there, with `--force` above all, would destroy the source.

    Example:
        >>> refuse_overlap("ckpt/model.safetensors", "ckpt")
        UsageError: ckpt/model.safetensors: lies inside the source checkpoint ckpt; ...
    """
    if storage.is_remote(output) or storage.is_remote(source):
        where = storage.overlaps(output, source)
    else:
        out, src = Path(os.path.realpath(output)), Path(os.path.realpath(source))
        where = "is" if out == src else "lies inside" if src in out.parents else "contains" if out in src.parents else None
    if where:
        raise UsageError(f"{output}: {where} the source checkpoint {source}; write the output elsewhere "
                         "(nothing was touched)")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, force: bool = True, unnamed: bool = True,
                  streamed: bool = False, notify: Notify = ignore) -> Iterator[Any]:
    """Yield a file open for writing (`.write`, `.flush`, `.fileno()`); when the block
    succeeds it is fsynced and renamed to `path`.

    The file has no name while it is written (`O_TMPFILE`, so even SIGKILL leaves nothing),
    or where the filesystem cannot do that (or `unnamed` is off: other processes must open
    it, as under torchrun), `.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside `path`, which is then
    `handle.name`. On any exception (including `Interrupted`) it is removed and `path` is
    left as it was. An existing `path` is replaced only with `force`. A storage URL
    (`s3://...`) is written in a local temporary directory and uploaded when complete, or
    with `streamed` (for writers that write every byte once and never read back) uploaded
    while it is written; then what is yielded is a `multipart.MultipartSink`, to be passed
    where an fd goes (`io.writable`) (`remote.remote_output`).
    """
    if storage.is_remote(path):
        from ckpttool.outputs import remote

        with remote.remote_output(_remote(path), force, directory=False, streamed=streamed,
                                  notify=notify) as written:
            yield written
    else:
        from ckpttool.outputs import local

        with local.atomic_file(Path(path), force, unnamed) as handle:
            yield handle


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, force: bool = False, streamed: bool = False,
                     notify: Notify = ignore) -> Iterator[OutputDirectory]:
    """Yield an `OutputDirectory` whose `path`, a fresh temporary directory
    (`.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside `path`), becomes `path` when the block succeeds.

    Files written inside should be fsynced by their writer; the directory itself is fsynced
    before the rename. An existing `path` is replaced only with `force`, so that `path` is
    always either the old or the complete new directory. On any exception (including
    `Interrupted`) before the rename, the temporary directory is removed.

    Example:
        >>> with atomic_directory("ckpt/step-00000100-world8", force=True) as output:
        ...     (output.path / ".metadata").write_bytes(metadata)

    A storage URL (`s3://...`) is built in a local temporary directory and uploaded when
    complete, or with `streamed` its data files (opened by `OutputDirectory.opened`) are
    uploaded while they are written (`remote.remote_output`).
    """
    if storage.is_remote(path):
        from ckpttool.outputs import remote

        with remote.remote_output(_remote(path), force, directory=True, streamed=streamed,
                                  notify=notify) as output:
            yield output
    else:
        from ckpttool.outputs import local

        with local.atomic_directory(Path(path), force, notify) as output:
            yield output
