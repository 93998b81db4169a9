"""Temporary names beside an output, and recovering what killed runs left under them.

While NAME is written it exists as `.ckpttool-tmp-NAME.HOST.PID.TOKEN` beside it (a directory,
a file where no unnamed file could be used, or for object storage a temporary key or an empty
marker key); while the NAME it replaced is removed, as `.ckpttool-old-NAME.HOST.PID.TOKEN`;
while an object-storage directory is committed key by key, its commit record
`.ckpttool-commit-NAME.HOST.PID.TOKEN` lists them (`remote.undo_commit`).
A run that was killed (SIGKILL, power loss) leaves them; the next run writing the same NAME on
the same host removes those whose process is gone (`remove_stale_temps`).

Example:
    >>> temp_name("step-100", "tmp", new_token())
    '.ckpttool-tmp-step-100.node7.4121.1f0c9a2e'
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Iterable, NamedTuple

TEMP_PREFIX = ".ckpttool-"  # every entry ckpttool puts beside an output starts with this
WRITING_PREFIX = TEMP_PREFIX + "tmp-"
OLD_PREFIX = TEMP_PREFIX + "old-"

HOST = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:32]
_ENTRY = re.compile(  # host, pid and token hold no dot, so the name may
    re.escape(TEMP_PREFIX)
    + r"(?P<kind>tmp|old|commit)-(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]*)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]{8})"
)
_tokens: set[str] = set()  # tokens of the entries this process created (to tell its own from a dead run's)


def new_token() -> str:
    """Return a fresh token for this process's next temporary entry."""
    token = uuid.uuid4().hex[:8]
    _tokens.add(token)
    return token


def temp_name(name: str, kind: str, token: str) -> str:
    """Return the name of this process's `kind` ("tmp", "old" or "commit") entry for output `name`."""
    return f"{TEMP_PREFIX}{kind}-{name}.{HOST}.{os.getpid()}.{token}"


class Entry(NamedTuple):
    """A temporary entry beside an output, by its name's parts."""

    name: str
    kind: str
    pid: int
    token: str


def dead_entries(names: Iterable[str], target: str, kinds: tuple[str, ...] = ("tmp", "old")) -> tuple[list[Entry], int]:
    """Return the entries among `names` (sorted) that belong to output `target` and whose run,
    on this host, is gone; and how many such entries there are in all, live ones included."""
    found = []
    for name in sorted(set(names)):
        match = _ENTRY.fullmatch(name)
        if match and match["kind"] in kinds and match["name"] == target:
            found.append((Entry(name, match["kind"], int(match["pid"]), match["token"]), match["host"]))
    return [entry for entry, host in found if _is_dead(host, entry.pid, entry.token)], len(found)


def _is_dead(host: str, pid: int, token: str) -> bool:
    if host != HOST or pid <= 0:
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


@dataclass(frozen=True)
class StaleTemp:
    """An entry a killed run left beside `target`, now dealt with: removed, or (`restored`) a
    previous output that the run had moved aside just before it died, put back; for a commit
    record, with the `keys` of `target` it listed, which the run had made visible, removed."""

    path: PurePath  # a local Path, or an object store's RemotePath
    target: PurePath
    pid: int
    restored: bool = False
    keys: int = 0

    def __str__(self) -> str:
        if self.restored:
            return f"restored {self.target} from {self.path}, moved aside by a killed run (pid {self.pid})"
        if self.keys:
            return (f"removed the {self.keys} keys of {self.target} a killed run (pid {self.pid}) had committed "
                    f"before it died, listed in {self.path}")
        return f"removed stale temp {self.path} left by a killed run (pid {self.pid})"


def remove_stale_temps(target: str | os.PathLike) -> list[StaleTemp]:
    """Return what runs that were killed (SIGKILL, power loss) left beside the local `target`,
    after removing it: `.ckpttool-tmp-*` and `.ckpttool-old-*` entries for the same name whose
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
        names = os.listdir(target.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found, _ = dead_entries(names, target.name)
    unrenamed = {entry.token for entry in found if entry.kind == "tmp"}
    removed = []
    for entry in found:
        path = target.parent / entry.name
        if entry.kind == "old" and entry.token in unrenamed and not (target.exists() or target.is_symlink()):
            os.rename(path, target)
            removed.append(StaleTemp(path, target, entry.pid, restored=True))
            continue
        remove_tree(path)
        if not (path.exists() or path.is_symlink()):
            removed.append(StaleTemp(path, target, entry.pid))
    return removed


def remove_tree(path: Path) -> None:
    """Remove a file, a symlink or a whole directory; what is already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
