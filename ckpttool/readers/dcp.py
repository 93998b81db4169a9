"""Read a DCP checkpoint's `.metadata` safely into our own frozen types.

Finds the metadata file (`.metadata`, or the lowest `__N.metadata`; a directory of
checkpoints is named as such), reads it with the size checks below and converts torch's
`Metadata` into `Checkpoint`, `Tensor`, `Chunk` and `Blob` once; nothing else looks at torch's
classes. The C reader (`_dcpscan.c`) reads the pickle as torch writes it into columns: chunk
tables for a large file (readers/columns.py), tuples of Chunk for a small one. Anything it
declines is unpickled by `safepickle.unpickle_metadata` (the allowlist and budgets: nothing
from the file runs, no torch is imported) and converted by readers/dcp_records.py, both
imported only then.

Example:
    >>> ckpt = read_checkpoint("runs/x/step-00000020")
    >>> ckpt.tensors["model.tok_emb.weight"].shape
    (256, 64)
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from pathlib import Path
from typing import Any, cast

from ckpttool.core import dtypes
from ckpttool.store import storage
from ckpttool.readers import columns
from ckpttool.core.checkpoint import Checkpoint, as_path, paused_gc
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN
from ckpttool.store.safepaths import file_kind
from ckpttool.core.errors import CorruptMetadata, NotACheckpoint, clip

# a 100k-chunk checkpoint's metadata is ~14 MB; 2 GiB is ~15M chunks
MAX_METADATA_BYTES = 2 << 30
READ_CHUNK_BYTES = 64 << 20


def find_metadata_file(path: Path) -> Path:
    """Return the `.metadata` file of a checkpoint directory (or the lowest `__N.metadata`)."""
    if not path.exists():
        raise NotACheckpoint(f"{path}: no such directory")
    if not path.is_dir():
        raise NotACheckpoint(f"{path}: not a directory (pass the checkpoint directory)")
    main = path / METADATA_FILENAME
    if main.is_file():
        return main
    if os.path.lexists(main):
        raise CorruptMetadata(f"{main}: {file_kind(main)}, not a regular file; torch writes .metadata as a plain file")
    per_rank = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := RANK_METADATA_PATTERN.match(p.name))
    )
    if per_rank:
        return per_rank[0][1]
    inside = _checkpoints_inside(path)
    if inside:
        latest = _latest_pointer(path)
        shown = ", ".join(inside[-MAX_LISTED_CHECKPOINTS:])
        more = f"{len(inside) - MAX_LISTED_CHECKPOINTS} more, " if len(inside) > MAX_LISTED_CHECKPOINTS else ""
        pick = latest if latest in inside else inside[-1]
        raise NotACheckpoint(
            f"{path}: a directory of checkpoints ({more}{shown}"
            f"{f'; latest: {latest}' if latest in inside else ''}), not a checkpoint itself: "
            f"pass one of them, e.g. {path / pick}"
        )
    raise NotACheckpoint(
        f"{path}: no {METADATA_FILENAME} file, so this is not a DCP checkpoint "
        "(or the save did not finish: torch writes .metadata last)"
    )


MAX_LISTED_CHECKPOINTS = 5  # checkpoints named in the "directory of checkpoints" error


def _checkpoints_inside(path: Path) -> list[str]:
    """Return the names of subdirectories that hold a `.metadata`, in natural order."""
    try:
        names = [p.name for p in path.iterdir() if (p / METADATA_FILENAME).is_file()]
    except OSError:
        return []
    return sorted(names, key=lambda name: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)])


def _latest_pointer(path: Path) -> str | None:
    """Return what a `latest` file (train_minimal, many trainers) names, if it is small text."""
    pointer = path / "latest"
    try:
        if pointer.is_file() and pointer.stat().st_size < 4096:
            return Path(pointer.read_text().strip()).name
    except (OSError, UnicodeDecodeError):
        pass
    return None


def read_metadata_bytes(path: Path) -> bytearray:
    """Return the bytes of a `.metadata` file: a regular file of at most MAX_METADATA_BYTES,
    read in pieces of READ_CHUNK_BYTES into one buffer (a FIFO or device is refused without
    blocking on it)."""
    if storage.is_remote(path):
        return _read_remote_metadata(cast(storage.RemotePath, path))  # is_remote: a RemotePath (as_path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise CorruptMetadata(f"{path}: cannot open ({error.strerror or error})") from None
    with open(fd, "rb", buffering=0, closefd=True) as handle:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise CorruptMetadata(f"{path}: {file_kind(path)}, not a regular file; torch writes .metadata as a plain file")
        size = status.st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptMetadata(
                f"{path}: {size} bytes is implausibly large for DCP metadata (at most {MAX_METADATA_BYTES} "
                "are read, ~15M chunks); the file is corrupt or not a .metadata file"
            )
        if size == 0:
            raise CorruptMetadata(f"{path}: empty file (the save was interrupted?)")
        data = bytearray(size)
        view = memoryview(data)
        done = 0
        try:
            while done < size:
                count = handle.readinto(view[done:done + READ_CHUNK_BYTES])
                if not count:
                    break
                done += count
        except OSError as error:
            raise CorruptMetadata(f"{path}: cannot read ({error.strerror or error})") from None
        finally:
            view.release()
        if done != size:
            raise CorruptMetadata(f"{path}: shrank from {size} to {done} bytes while being read")
    return data


def _read_remote_metadata(path: "storage.RemotePath") -> bytearray:
    """`read_metadata_bytes` of an object: the same size checks, ranged GETs of READ_CHUNK_BYTES."""
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptMetadata(f"{path}: {size} bytes is implausibly large for DCP metadata (at most "
                              f"{MAX_METADATA_BYTES} are read); the file is corrupt or not a .metadata file")
    if size == 0:
        raise CorruptMetadata(f"{path}: empty file (the save was interrupted?)")
    objects = storage.reader(path)
    data = bytearray(size)
    for start in range(0, size, READ_CHUNK_BYTES):
        data[start:start + READ_CHUNK_BYTES] = objects.read(start, min(READ_CHUNK_BYTES, size - start))
    return data


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Return the checkpoint's metadata as our types, reading only `.metadata`.

    Raises NotACheckpoint, UnsafeMetadata or CorruptMetadata (one line each, naming the
    file); never runs code from the file, and refuses a pickle over the budgets of
    `scan_pickle` before building anything.
    """
    root = as_path(storage.location(path))
    metadata_path = find_metadata_file(root)
    with paused_gc():
        raw = None
        scanned = _scan_mapped(metadata_path)
        if scanned is _NOT_MAPPED:
            raw = read_metadata_bytes(metadata_path)
            scanned = scan_columns(raw)
            if scanned is not None and len(raw) < COLUMNS_FROM_BYTES:
                return columns.small_checkpoint(root, metadata_path, scanned)
        if scanned is not None:
            return columns.checkpoint(root, metadata_path, scanned)
        if raw is None:  # mapped, and declined by the C reader: read once for the loader
            raw = read_metadata_bytes(metadata_path)
        from ckpttool.safepickle.unpickler import unpickle_metadata  # declined by the C reader: the checking loader

        record = unpickle_metadata(raw, str(metadata_path))
        del raw
        try:
            return _convert(root, metadata_path, record)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as error:
            raise CorruptMetadata(
                f"{metadata_path}: malformed DCP metadata ({type(error).__name__}: {clip(str(error))})"
            ) from None


def scan_columns(raw: bytes | bytearray | mmap.mmap, mapped: bool = False) -> tuple | None:
    """Return what the C reader (`_dcpscan.c`) reads from a `.metadata` as torch writes it,
    or None: the file is something else, or the reader was not built (no compiler at install),
    and the checking Python loader reads it. `mapped`: `raw` maps the file, and the reader
    hands pages back as it goes."""
    try:
        from ckpttool.readers import _dcpscan
    except ImportError:
        return None
    return _dcpscan.scan(raw, KNOWN_DTYPES, False, mapped)


KNOWN_DTYPES = frozenset(dtypes.ITEMSIZE)
# below this, building a tuple of Chunk per tensor takes less than importing numpy for the
# chunk tables costs (~0.1 s, 15 MB): small checkpoints keep tuples of Chunk (2 MB: ~15k chunks)
COLUMNS_FROM_BYTES = 2 << 20
MAP_METADATA_BYTES = 64 << 20  # larger local .metadata files are mapped, not read into memory


_NOT_MAPPED = object()  # what `_scan_mapped` returns for a file it did not map


def _scan_mapped(path: Path) -> Any:
    """`scan_columns` of a large local `.metadata` through a read-only map, so the file is
    never resident whole (None: the C reader declined it); _NOT_MAPPED for a remote, small,
    unusual or unreadable file, which the caller reads into memory with the checks of
    `read_metadata_bytes`."""
    if storage.is_remote(path):
        return _NOT_MAPPED
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return _NOT_MAPPED
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or not MAP_METADATA_BYTES <= status.st_size <= MAX_METADATA_BYTES:
            return _NOT_MAPPED
        with mmap.mmap(fd, status.st_size, access=mmap.ACCESS_READ) as mapped:
            return scan_columns(mapped, mapped=True)
    except (OSError, ValueError):
        return _NOT_MAPPED
    finally:
        os.close(fd)


def _convert(root: Path, source: Path, record: Any) -> Checkpoint:
    """The checkpoint of what the checking loader built from `source` (`dcp_records.convert`,
    imported with the loader's stand-ins only when the C reader declined the file)."""
    from ckpttool.readers.dcp_records import convert

    return convert(root, source, record)
