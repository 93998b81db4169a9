"""Path safety, in one place: a data file named by a checkpoint stays inside it.

Checkpoints name their data files (DCP's storage table, a Hub index, a safetensors header's
file list); those names come from bytes on disk, so each is checked before it is joined to
the checkpoint's path (`safe_relative_path`: no absolute, `..` or drive paths), and each file
opened must be a regular file that, symlinks resolved, lies inside the checkpoint
(`containment_root`, `check_data_file`) unless the user passed `--follow-symlinks`.

Example:
    >>> safe_relative_path("__0_0.distcp")
    PurePosixPath('__0_0.distcp')
    >>> safe_relative_path("../../etc/passwd")
    Traceback (most recent call last):
    ckpttool.core.errors.CorruptMetadata: data file path '../../etc/passwd' is absolute or leaves the checkpoint directory; refusing to read it
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ckpttool.store import storage
from ckpttool.core.errors import CorruptMetadata, UnsafeDataFile


def is_safe_relative_path(relative: str) -> bool:
    """True when `relative` names a path inside the checkpoint (see `safe_relative_path`)."""
    try:
        safe_relative_path(relative)
    except CorruptMetadata:
        return False
    return True


def safe_relative_path(relative: str, source: str = "") -> PurePosixPath:
    """Return `relative` as a path inside the checkpoint, or raise if it escapes it."""
    path = PurePosixPath(relative.replace("\\", "/"))
    if not relative or path.is_absolute() or ".." in path.parts or relative.startswith(("/", "\\")):
        raise CorruptMetadata(
            f"{source}data file path {relative!r} is absolute or leaves the checkpoint "
            "directory; refusing to read it"
        )
    if len(relative) > 1 and relative[1] == ":":
        raise CorruptMetadata(f"{source}data file path {relative!r} is a drive path; refusing it")
    return path


def file_kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a dangling link"
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "a special file"


def containment_root(root: str | os.PathLike) -> Path | None:
    """The directory a checkpoint's data files must stay inside once symlinks are resolved:
    the checkpoint itself or, for a Hub cache snapshot (`models--x/snapshots/REV/`, whose files
    link to `../../blobs/`), the cached repository."""
    if storage.is_remote(root):
        return None  # object storage has no symlinks
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def check_data_file(path: Path, mode: int, inside: Path | None, real: str | None = None) -> None:
    """Raise UnsafeDataFile unless `path` (of st_mode `mode`) is a regular file that, once
    symlinks are resolved (`real`, default realpath), lies inside `inside` (None: anywhere)."""
    if inside is not None:
        real = real or os.path.realpath(path)
        if not Path(real).is_relative_to(inside):
            raise UnsafeDataFile(f"{path}: a symlink to {real}, outside the checkpoint directory; refusing "
                                 "it (pass --follow-symlinks to read it)", "symlink-escapes")
    if not stat.S_ISREG(mode):
        raise UnsafeDataFile(f"{path}: {file_kind(path)}, not a regular file; refusing to read it",
                             "not-regular-file")


MAX_JSON_BYTES = 16 << 20  # a config.json or adapter_config.json is a few kB


def read_json_object(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """Return the JSON object in the small file at `path` (config.json, adapter_config.json);
    CorruptMetadata naming the file when it is not a regular file of at most `max_bytes`
    bytes holding a JSON object."""
    import json

    try:
        if not stat.S_ISREG(os.stat(path).st_mode) or os.stat(path).st_size > max_bytes:
            raise CorruptMetadata(f"{path}: not a regular file of at most {max_bytes} bytes")
        document = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CorruptMetadata(f"{path}: unreadable JSON ({type(error).__name__})") from None
    if not isinstance(document, dict):
        raise CorruptMetadata(f"{path}: not a JSON object")
    return document
