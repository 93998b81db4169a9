"""Read a DCP checkpoint's `.metadata` safely into our own frozen types.

Finds the metadata file (`.metadata`, or the lowest `__N.metadata`; a directory of
checkpoints is named as such), reads it with the size checks below, unpickles it through
`safepickle.unpickle_metadata` (the allowlist and budgets: nothing from the file runs, no
torch is imported) and converts torch's `Metadata` stand-ins into `Checkpoint`, `Tensor`,
`Chunk` and `Blob` once; nothing else looks at torch's classes.

Example:
    >>> ckpt = read_checkpoint("runs/x/step-00000020")
    >>> ckpt.tensors["model.tok_emb.weight"].shape
    (256, 64)
"""

from __future__ import annotations

import functools
import mmap
import operator
import os
import re
import stat
from pathlib import Path
from typing import Any, cast

from ckpttool import dtypes, storage
from ckpttool.readers import columns
from ckpttool.readers.columns import latest, match_storage
from ckpttool.checkpoint import OUR_TRANSFORMS, Blob, Checkpoint, Chunk, Object, Tensor, as_path, paused_gc, refuse_bad_names
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN
from ckpttool.safepaths import file_kind
from ckpttool.errors import CorruptMetadata, NotACheckpoint, clip
from ckpttool.safepickle.allowlist import _CHUNK, _METADATA_INDEX, _STORAGE_INFO
from ckpttool.safepickle.nodes import _ChunkBox, _IndexKey, _InfoBox, _Light, _TensorBox
from ckpttool.safepickle.standins import _DType, _field, _Record, _Shape
from ckpttool.safepickle.unpickler import unpickle_metadata

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
            scanned = scan_columns(raw) if len(raw) >= COLUMNS_FROM_BYTES else None
        if scanned is not None:
            return columns.checkpoint(root, metadata_path, scanned)
        if raw is None:  # mapped, and declined by the C reader: read once for the loader
            raw = read_metadata_bytes(metadata_path)
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
# below this the Python loader takes tens of milliseconds, less than importing numpy for the
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


def _kind(obj: Any) -> str:
    # the class's kind: an instance's own `kind` comes from the file
    return type(obj).kind if isinstance(obj, (_Record, _Light)) else type(obj).__name__


def _require(obj: Any, kind: str, where: str, source: Path) -> _Record:
    if _kind(obj) != kind:
        raise CorruptMetadata(f"{source}: expected {kind} at {where}, found {_kind(obj)}")
    return obj


def _int_tuple(value: Any, where: str, source: Path) -> tuple[int, ...]:
    if type(value) is _Shape:
        return value
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise CorruptMetadata(f"{source}: {where} is not a sequence of integers ({clip(_brief(value), 80)})")
    return tuple(value)


def _brief(value: Any) -> str:
    """Describe a value from the file without walking it (its repr could be huge)."""
    if type(value) is str:
        return repr(value[:60])
    if type(value) is int and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (int, float, type(None))):
        return repr(value)
    if isinstance(value, (tuple, list, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {_kind(value)}"


def _name(value: Any) -> str:
    return value if type(value) is str else _brief(value)


def _stored_blobs(storage: dict, source: Path) -> dict[str, list]:
    """Return the storage table as fqn -> [(offsets or None, blob)] in storage order. Blobs
    are matched to chunks by sorting, not by a dict keyed by offsets: tuples of ints hash
    without a salt, so crafted colliding offsets would make every lookup linear."""
    stored: dict[str, list] = {}
    for index, info in storage.items():
        if type(index) is _IndexKey and type(info) is _InfoBox:
            fqn, offset, blob = index[0], index[1], info[0]
        else:
            if type(index) is _IndexKey:
                fqn, offset = index[0], index[1]
            else:
                if type(index) is not _METADATA_INDEX:
                    _require(index, "MetadataIndex", "a storage_data key", source)
                fields = index.__dict__
                fqn, offset = fields.get("fqn"), fields.get("offset")
                if type(fqn) is not str:
                    raise CorruptMetadata(f"{source}: a storage_data key names {_brief(fqn)}, not a string fqn")
                if offset is not None and type(offset) is not _Shape:
                    offset = _int_tuple(offset, f"{fqn} storage offset", source)
            blob = _blob(info, fqn, source)
        found = stored.get(fqn)
        if found is None:
            stored[fqn] = [(offset, blob)]
        else:
            found.append((offset, blob))
    return stored


def _convert(root: Path, source: Path, record: Any) -> Checkpoint:
    metadata = _require(record, "Metadata", "top level", source)
    entries = _field(metadata, "state_dict_metadata")
    if not isinstance(entries, dict):
        raise CorruptMetadata(f"{source}: Metadata.state_dict_metadata is missing or not a dict")
    storage = _field(metadata, "storage_data") or {}
    if not isinstance(storage, dict):
        raise CorruptMetadata(f"{source}: Metadata.storage_data is not a dict")

    stored = _stored_blobs(storage, source)

    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    notes: list[str] = []
    orphans: list[tuple[str, Blob]] = []
    names = list(entries)
    if not all(type(fqn) is str for fqn in names):
        bad = next(fqn for fqn in names if type(fqn) is not str)
        raise CorruptMetadata(f"{source}: state_dict_metadata key {_brief(bad)} is not a string")
    for fqn in sorted(names):
        entry = entries[fqn]
        unkeyed, keyed = latest(stored.pop(fqn, ()))
        kind = _kind(entry)
        if kind == "BytesStorageMetadata":
            objects[fqn] = Object(fqn, unkeyed)
            orphans.extend((fqn, blob) for _, blob in keyed)
            continue
        if kind != "TensorStorageMetadata":
            raise CorruptMetadata(f"{source}: {fqn}: unknown storage metadata type {kind}")
        if unkeyed is not None:
            orphans.append((fqn, unkeyed))
        tensor, note = _tensor(fqn, entry, keyed, orphans, source)
        tensors[fqn] = tensor
        if note:
            notes.append(note)
    for fqn, blobs in stored.items():
        unkeyed, keyed = latest(blobs)
        if unkeyed is not None:
            orphans.append((fqn, unkeyed))
        orphans.extend((fqn, blob) for _, blob in keyed)

    refuse_bad_names(source, names, {b.file for _, b in orphans}, tensors, objects)
    nesting = _field(metadata, "planner_data")
    storage_meta = _field(metadata, "storage_meta")
    save_id = _field(storage_meta, "save_id") if isinstance(storage_meta, _Record) else None
    version = _field(metadata, "version")
    if type(version) is not str:
        version = None  # torch writes a string or nothing
    return Checkpoint(
        path=root,
        metadata_file=source.name,
        version=version,
        tensors=tensors,
        objects=objects,
        nesting=_nesting(nesting) if isinstance(nesting, dict) else {},
        orphan_blobs=tuple(sorted(orphans, key=str)),
        save_id=save_id if type(save_id) is str else None,
        notes=tuple(notes),
    )


def _nesting(planner_data: dict) -> dict[str, tuple[str | int, ...]]:
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, keys in planner_data.items():
        if type(fqn) is str and isinstance(keys, (tuple, list)):
            if all(type(k) is str or type(k) is int for k in keys):
                out[fqn] = tuple(keys)
    return out


def _blob(info: Any, fqn: str, source: Path) -> Blob:
    # the hot loop of large metadata: no f-strings unless something is wrong
    if type(info) is _InfoBox:
        return info[0]
    if type(info) is not _STORAGE_INFO:
        _require(info, "_StorageInfo", f"storage entry of {fqn}", source)
    state = info.__dict__
    file, offset, length = state.get("relative_path"), state.get("offset"), state.get("length")
    transforms = state.get("transform_descriptors")
    if type(file) is not str:
        raise CorruptMetadata(f"{source}: {fqn}: storage relative_path is not a string")
    if type(offset) is not int or type(length) is not int:
        raise CorruptMetadata(f"{source}: {fqn}: storage offset or length is not an integer")
    if not transforms:
        return Blob(file, offset, length, ())
    if not isinstance(transforms, (list, tuple)) or not all(type(t) is str for t in transforms):
        raise CorruptMetadata(f"{source}: {fqn}: transform_descriptors is not a list of strings")
    if any(t.startswith(OUR_TRANSFORMS) for t in transforms):  # our readers' markers, never torch's
        raise CorruptMetadata(f"{source}: {fqn}: transform_descriptors names {transforms[0][:40]!r}, which torch never writes")
    return Blob(file, offset, length, tuple(transforms))


_first = operator.itemgetter(0)


def _tensor(fqn: str, entry: Any, keyed: list, orphans: list, source: Path) -> tuple[Tensor, str | None]:
    if type(entry) is _TensorBox:
        dtype_name, shape, raw_chunks = entry[0].name, entry[1], entry[2]
    else:
        properties = _field(entry, "properties")
        dtype_name = "unknown"
        if isinstance(properties, _Record):
            state = _field(properties, "_state")
            dtype = state[0] if isinstance(state, tuple) and state else _field(properties, "dtype")
            if isinstance(dtype, _DType):
                dtype_name = dtype.name
        shape = _int_tuple(_field(entry, "size"), f"{fqn} size", source)
        raw_chunks = _field(entry, "chunks")
        if not isinstance(raw_chunks, (list, tuple)):
            raise CorruptMetadata(f"{source}: {fqn}: chunks is not a list")
    note = None if dtype_name in dtypes.ITEMSIZE else f"{fqn}: unknown dtype {dtype_name[:64]!r}"
    if set(map(type, raw_chunks)) <= {_ChunkBox}:  # all from the loader's fast path
        boxes = sorted(raw_chunks, key=_first)
        if len(keyed) == len(boxes) and list(map(_first, keyed)) == list(map(_first, boxes)):
            # every chunk has its storage entry: the usual case, matched without a loop
            chunks = tuple(map(_new_chunk, zip(map(_first, boxes), map(_second, boxes), map(_second, keyed))))
            return Tensor(fqn, dtype_name, shape, chunks), note
    else:
        boxes = _boxes(fqn, raw_chunks, source)
    return Tensor(fqn, dtype_name, shape, match_storage(fqn, boxes, keyed, orphans)), note


_second = operator.itemgetter(1)
_new_chunk = functools.partial(tuple.__new__, Chunk)


def _boxes(fqn: str, raw_chunks: list | tuple, source: Path) -> list:
    """Return a tensor's chunks as (offsets, sizes) sorted by offsets, checking each."""
    boxes: list[tuple[Any, ...]] = []  # _ChunkBox (offsets, sizes, depth, size) or (offsets, sizes)
    for position, raw in enumerate(raw_chunks):
        if type(raw) is _ChunkBox:
            boxes.append(raw)
            continue
        if type(raw) is not _CHUNK:
            _require(raw, "ChunkStorageMetadata", f"{fqn} chunk {position}", source)
        fields = raw.__dict__
        offsets, sizes = fields.get("offsets"), fields.get("sizes")
        if type(offsets) is not _Shape:
            offsets = _int_tuple(offsets, f"{fqn} chunk {position} offsets", source)
        if type(sizes) is not _Shape:
            sizes = _int_tuple(sizes, f"{fqn} chunk {position} sizes", source)
        boxes.append((offsets, sizes))
    boxes.sort(key=_first)
    return boxes
