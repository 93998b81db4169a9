"""A DCP `.metadata` as the checking Python loader builds it (`safepickle.unpickle_metadata`:
stand-ins of torch's `Metadata`, `TensorStorageMetadata`, `_StorageInfo` ...) converted to our
types, checking every field. readers/dcp.py imports this only for a file the C reader
(`_dcpscan.c`) declines: then, and only then, the loader and its stand-ins are imported.
"""

from __future__ import annotations

import functools
import operator
from pathlib import Path
from typing import Any

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import OUR_TRANSFORMS, Blob, Checkpoint, Chunk, Object, Tensor, refuse_bad_names
from ckpttool.core.errors import CorruptMetadata, clip
from ckpttool.readers.columns import latest, match_storage
from ckpttool.safepickle.allowlist import _CHUNK, _METADATA_INDEX, _STORAGE_INFO
from ckpttool.safepickle.nodes import _ChunkBox, _IndexKey, _InfoBox, _Light, _TensorBox
from ckpttool.safepickle.standins import _DType, _field, _Record, _Shape


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


def convert(root: Path, source: Path, record: Any) -> Checkpoint:
    """Return the checkpoint of `record` (what the loader built from `source`), or raise
    CorruptMetadata naming `source` and what is wrong."""
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
