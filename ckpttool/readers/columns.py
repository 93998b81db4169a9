"""A checkpoint from the columns the C reader of `.metadata` gives (`_dcpscan.c`, called by
readers/dcp.py): each tensor's chunks as a `ChunkTable`, with no Python object per chunk
(`checkpoint`), or, for a small file, as a tuple of Chunk built without numpy (`small_checkpoint`).

The C reader matches each storage entry with the next chunk of its tensor as torch writes
them (in the same order) and flags a tensor `clean` when every chunk took one entry, in
strictly ascending offsets, and no other entry names it: its table is then views of the
scanned columns. Any other tensor is matched here with its entries by sorting. The matching
rules are the Python loader's, shared here: `latest` keeps the last storage entry of equal
offsets, `match_storage` walks chunks and entries in offsets order and leaves entries no
chunk takes as orphans.
"""

from __future__ import annotations

import functools
import operator
from pathlib import Path
from typing import Any, Iterable

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, ChunkTable, Object, Tensor, refuse_bad_names

_first = operator.itemgetter(0)
_new_chunk = functools.partial(tuple.__new__, Chunk)


def checkpoint(root: Path, source: Path, scanned: tuple) -> Checkpoint:
    """Return the checkpoint of `scanned` (what `_dcpscan.scan` returned for `source`)."""
    import numpy as np

    version, save_id, tensor_rows, object_fqns, planner, fqns, files, coords, chunk_columns, storage = scanned
    coords = np.frombuffer(coords, np.int64)
    files = tuple(files)
    rows = _Storage(*(np.frombuffer(column, np.int64) for column in storage), fqns=fqns, files=files)
    matched = _Matched(*(np.frombuffer(column, dtype) for column, dtype in zip(chunk_columns, _CHUNK_DTYPES)))
    by_fqn = {fqn: number for number, fqn in enumerate(fqns)}
    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    orphans: list[tuple[str, Blob]] = []
    names = [row[0] for row in tensor_rows] + list(object_fqns)
    entries = {row[0]: row for row in tensor_rows}
    entries.update((fqn, None) for fqn in object_fqns)
    for fqn in sorted(entries):
        number = by_fqn.pop(fqn, None)
        row = entries[fqn]
        if row is None:
            unkeyed, keyed = latest(rows.blobs(number))
            objects[fqn] = Object(fqn, unkeyed)
            orphans.extend((fqn, blob) for _, blob in keyed)
        elif row[6]:  # clean: its chunks' columns say all of it
            tensors[fqn] = Tensor(fqn, row[1], row[2], matched.table(row, coords, files))
        else:
            tensors[fqn] = _tensor(row, coords, *matched.merged(row, coords, rows, number), orphans)
    unmatched = ((fqn, rows.blobs(number)) for fqn, number in by_fqn.items())
    return _finish(root, source, (version, save_id, planner), names, tensors, objects, orphans, unmatched)


def _finish(root: Path, source: Path, header: tuple, names: list[str], tensors: dict[str, Tensor],
            objects: dict[str, Object], orphans: list[tuple[str, Blob]], unmatched: Iterable) -> Checkpoint:
    """Return the checkpoint once the storage entries of no state_dict_metadata entry
    (`unmatched`: (fqn, its entries as (offsets or None, blob))) are orphans and every name is
    checked; `header` is the scan's (version, save id, planner nesting)."""
    version, save_id, planner = header
    for fqn, entries in unmatched:
        unkeyed, keyed = latest(entries)
        if unkeyed is not None:
            orphans.append((fqn, unkeyed))
        orphans.extend((fqn, blob) for _, blob in keyed)
    refuse_bad_names(source, names, {blob.file for _, blob in orphans}, tensors, objects)
    return Checkpoint(
        path=root, metadata_file=source.name, version=version, tensors=tensors, objects=objects,
        nesting=planner, orphan_blobs=tuple(sorted(orphans, key=str)), save_id=save_id,
    )


_CHUNK_DTYPES = ("int32", "int64", "int64", "int32")  # the C reader's chunk columns: file, offset, length, row


def small_checkpoint(root: Path, source: Path, scanned: tuple) -> Checkpoint:
    """Return the checkpoint of `scanned` with each tensor's chunks as a tuple of Chunk, in pure
    Python: a small `.metadata` (below dcp.COLUMNS_FROM_BYTES, ~15k chunks), where importing numpy
    for chunk tables costs more than the whole read. Each tensor's chunks take their storage entries by
    the Python loader's rules (`latest`, then `match_storage` in offsets order), so the result
    is the one that loader reads (tests/test_startup_imports.py compares them on every fixture)."""
    version, save_id, tensor_rows, object_fqns, planner, fqns, files, coords, chunk_columns, storage = scanned
    coords = memoryview(coords).cast("q").tolist()
    files = tuple(files)
    file32, offset64, length64, row32 = (memoryview(column) for column in chunk_columns)  # _CHUNK_DTYPES
    chunk_file, chunk_row = file32.cast("i").tolist(), row32.cast("i").tolist()
    chunk_offset, chunk_length = offset64.cast("q").tolist(), length64.cast("q").tolist()
    stored: dict[int, list] = {}  # fqn id -> its entries no chunk took: (storage row, offsets or None, blob)
    fqn, ndim, start, keys, file, offset, length, row = (memoryview(column).cast("q").tolist() for column in storage)
    for k, number in enumerate(fqn):
        key = None if ndim[k] < 0 else tuple(keys[start[k]:start[k] + ndim[k]])
        stored.setdefault(number, []).append((row[k], key, Blob(files[file[k]], offset[k], length[k], ())))
    by_fqn = {name: number for number, name in enumerate(fqns)}
    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    orphans: list[tuple[str, Blob]] = []
    names = [entry[0] for entry in tensor_rows] + list(object_fqns)
    entries: dict[str, tuple | None] = {entry[0]: entry for entry in tensor_rows}
    entries.update((name, None) for name in object_fqns)
    for name in sorted(entries):
        mine = stored.pop(by_fqn.pop(name, -1), [])
        entry = entries[name]
        if entry is None:
            unkeyed, keyed = latest((key, blob) for _, key, blob in mine)
            objects[name] = Object(name, unkeyed)
            orphans.extend((name, blob) for _, blob in keyed)
            continue
        _, dtype, shape, first, count, chunk, _ = entry
        width = len(shape)
        boxes = []
        for k in range(count):
            at, taken = first + 2 * width * k, chunk + k
            box = (tuple(coords[at:at + width]), tuple(coords[at + width:at + 2 * width]))
            boxes.append(box)
            if chunk_row[taken] >= 0:  # the entry the C reader matched with this chunk: its offsets are the chunk's
                blob = Blob(files[chunk_file[taken]], chunk_offset[taken], chunk_length[taken], ())
                mine.append((chunk_row[taken], box[0], blob))
        mine.sort(key=_first)  # storage order, as the loader meets the entries
        unkeyed, keyed = latest((key, blob) for _, key, blob in mine)
        if unkeyed is not None:
            orphans.append((name, unkeyed))
        boxes.sort(key=_first)
        tensors[name] = Tensor(name, dtype, shape, match_storage(name, boxes, keyed, orphans))
    unmatched = ((name, ((key, blob) for _, key, blob in stored.pop(number, []))) for name, number in by_fqn.items())
    return _finish(root, source, (version, save_id, planner), names, tensors, objects, orphans, unmatched)


class _Matched:
    """The storage entry the C reader matched with each chunk, as columns in chunk order: its
    file (-1: none), offset, length and row in the storage table (its place in file order)."""

    def __init__(self, file: Any, offset: Any, length: Any, row: Any):
        self.file, self.offset, self.length, self.row = file, offset, length, row

    def table(self, row: tuple, coords: Any, files: tuple[str, ...]) -> ChunkTable:
        """The table of a clean tensor: views of the columns."""
        _, _, shape, first, count, chunk, _ = row
        ndim = len(shape)
        block = coords[first:first + 2 * ndim * count].reshape(count, 2 * ndim)
        end = chunk + count
        return ChunkTable(block[:, :ndim], block[:, ndim:], self.file[chunk:end], self.offset[chunk:end],
                          self.length[chunk:end], files)

    def merged(self, row: tuple, coords: Any, storage: "_Storage", number: int | None) -> tuple["_Storage", int | None]:
        """The storage rows of a tensor that is not clean, in file order, with `number` for
        them: the entries no chunk took, and those its chunks took (their offsets are the
        chunks')."""
        import numpy as np

        _, _, shape, first, count, chunk, _ = row
        taken = np.flatnonzero(self.row[chunk:chunk + count] >= 0)
        if not len(taken):
            return storage, number
        ndim = len(shape)
        mine = storage.rows(number)
        offsets = coords[first:first + 2 * ndim * count].reshape(count, 2 * ndim)[taken, :ndim]
        keys = [offsets[k] for k in range(len(taken))]
        keys += [storage.coords[start:start + max(size, 0)] for start, size in zip(storage.start[mine].tolist(), storage.ndim[mine].tolist())]
        order = np.argsort(np.concatenate((self.row[chunk + taken], storage.row[mine])), kind="stable")
        ndims = np.concatenate((np.full(len(taken), ndim, dtype=np.int64), storage.ndim[mine]))[order]
        ordered = [keys[k] for k in order.tolist()]
        coords_column = np.concatenate(ordered) if ordered else np.zeros(0, np.int64)
        starts = np.concatenate(([0], np.cumsum(np.maximum(ndims, 0))[:-1])).astype(np.int64)
        columns = [np.concatenate((part[chunk + taken].astype(np.int64), whole[mine]))[order]
                   for part, whole in ((self.file, storage.file), (self.offset, storage.offset),
                                       (self.length, storage.length), (self.row, storage.row))]
        local = _Storage(np.zeros(len(order), np.int64), ndims, starts, coords_column.astype(np.int64), *columns,
                         fqns=[row[0]], files=storage.files)
        return local, 0


class _Storage:
    """The storage table's columns (one row per MetadataIndex -> _StorageInfo, in file order:
    `row` is its place there) and each fqn's rows."""

    def __init__(self, fqn, ndim, start, coords, file, offset, length, row, *, fqns: list, files: tuple[str, ...]):
        import numpy as np

        self.ndim, self.start, self.coords, self.file, self.offset, self.length = ndim, start, coords, file, offset, length
        self.row = row
        self.files = files
        self.order = np.argsort(fqn, kind="stable")
        self.bounds = np.searchsorted(fqn[self.order], np.arange(len(fqns) + 1)).tolist()

    def rows(self, number: int | None) -> Any:
        """The rows of fqn `number` in file order (none for None)."""
        if number is None:
            return self.order[:0]
        return self.order[self.bounds[number]:self.bounds[number + 1]]

    def blobs(self, number: int | None) -> list[tuple[tuple[int, ...] | None, Blob]]:
        """(offsets or None, blob) of fqn `number`'s rows, in file order."""
        out = []
        for row in self.rows(number).tolist():
            ndim, start = int(self.ndim[row]), int(self.start[row])
            offsets = None if ndim < 0 else tuple(self.coords[start:start + ndim].tolist())
            out.append((offsets, Blob(self.files[self.file[row]], int(self.offset[row]), int(self.length[row]), ())))
        return out


def _tensor(row: tuple, coords: Any, storage: _Storage, number: int | None, orphans: list) -> Tensor:
    """The tensor of a scanned row: its chunks as a table when each has exactly one storage
    entry and no entry is left over (views of the scanned columns when, as torch writes them,
    chunks and entries come in offsets order), else matched one by one."""
    import numpy as np

    fqn, dtype, shape, first, count = row[:5]
    ndim = len(shape)
    block = coords[first:first + 2 * ndim * count].reshape(count, 2 * ndim)
    if not _ascending(block[:, :ndim]):
        block = block[np.lexsort(block[:, ndim - 1::-1].T)]
    offsets, sizes = block[:, :ndim], block[:, ndim:]
    mine = storage.rows(number)
    if len(mine) == count and (storage.ndim[mine] == ndim).all():
        keys = storage.coords[storage.start[mine][:, None] + np.arange(ndim)]
        if not _ascending(keys):
            order = np.lexsort(keys[:, ::-1].T)
            keys, mine = keys[order], mine[order]
        if np.array_equal(keys, offsets) and _ascending(keys, strictly=True):
            if count and mine[-1] - mine[0] == count - 1 and _ascending(mine[:, None], strictly=True):
                taken: Any = slice(int(mine[0]), int(mine[-1]) + 1)  # consecutive rows: views, no copies
            else:
                taken = mine
            table = ChunkTable(offsets, sizes, storage.file[taken], storage.offset[taken], storage.length[taken], storage.files)
            return Tensor(fqn, dtype, shape, table)
    boxes = sorted(zip(map(tuple, offsets.tolist()), map(tuple, sizes.tolist())), key=_first)
    unkeyed, keyed_blobs = latest(storage.blobs(number))
    if unkeyed is not None:
        orphans.append((fqn, unkeyed))
    return Tensor(fqn, dtype, shape, match_storage(fqn, boxes, keyed_blobs, orphans))


def _ascending(rows: Any, strictly: bool = False) -> bool:
    """True when `rows` (n, ndim) are in lexicographic order (strictly: no two equal). Tested
    on the first column, where chunks of a dim-0 split differ; otherwise left to a sort."""
    import numpy as np

    if len(rows) < 2:
        return True
    if not rows.shape[1]:
        return not strictly
    steps = np.diff(rows[:, 0])
    return bool((steps > 0).all())


def match_storage(fqn: str, boxes: list, keyed: list, orphans: list) -> tuple[Chunk, ...]:
    """Return the chunks of `boxes` ((offsets, sizes) sorted by offsets) with the blobs of
    `keyed` ((offsets, blob) sorted by offsets, the last of equal offsets kept) whose offsets
    match, walking both in offsets order; blobs no chunk takes go to `orphans`."""
    chunks = []
    at, count, matched = 0, len(keyed), False
    for box in boxes:
        offsets, sizes = box[0], box[1]
        while at < count and keyed[at][0] < offsets:
            if not matched:
                orphans.append((fqn, keyed[at][1]))
            at += 1
            matched = False
        if at < count and keyed[at][0] == offsets:
            chunks.append(_new_chunk((offsets, sizes, keyed[at][1])))
            matched = True
        else:
            chunks.append(_new_chunk((offsets, sizes, None)))
    orphans.extend((fqn, blob) for _, blob in keyed[at + matched:])
    return tuple(chunks)


def latest(blobs: Any) -> tuple[Blob | None, list[tuple[tuple[int, ...], Blob]]]:
    """Return a tensor's or object's storage entries as a dict keyed by offsets would keep
    them (the last written of equal keys): the entry without offsets, and the others sorted
    by offsets."""
    unkeyed, keyed = None, []
    for offset, blob in blobs:
        if offset is None:
            unkeyed = blob
        else:
            keyed.append((offset, blob))
    if len(keyed) > 1:
        keyed.sort(key=_first)  # stable: equal offsets stay in storage order
        last = [item for item, after in zip(keyed, keyed[1:]) if item[0] != after[0]]
        last.append(keyed[-1])
        keyed = last
    return unkeyed, keyed
