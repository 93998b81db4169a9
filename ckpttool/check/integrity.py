"""The integrity gate: is a checkpoint's metadata whole and consistent, before any tensor
byte is read?

Every command that reads tensor data (consolidate, reshard, and `validate` itself) runs
`check` first; `gate` raises `InvalidCheckpoint` naming the first fault, so a damaged
checkpoint can never be converted into a silently wrong model. What is checked is exactly what
`ckpttool validate` checks without `--deep`: safe paths, files present and regular, every blob
inside its file and large enough for its elements, no two blobs claiming the same bytes, and
each tensor tiled exactly by its chunks (in bounds, no overlaps, no gaps). It reads the
metadata, file sizes and (for SAFETENSORS-format checkpoints) the safetensors headers.

Example:
    >>> checkpoint = read_checkpoint("runs/x/step-00000020")
    >>> gate(checkpoint).sizes["__0_0.distcp"]
    81234
"""

from __future__ import annotations

import bisect
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import EXCLUDED_FROZEN, Blob, Checkpoint, Chunk, ChunkTable, Tensor, is_raw_range, paused_gc
from ckpttool.core.errors import CheckpointError, InvalidCheckpoint, UnsafeDataFile
from ckpttool.core.geometry import (COLUMN_LIMIT, Coverage, column_shape, column_volumes, columns_in_bounds, coverage,
                               dim0_tiling, find_overlaps, in_bounds)
from ckpttool.store.safepaths import check_data_file, containment_root, safe_relative_path
from ckpttool.formats import peft
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN
from ckpttool.check.integrity_small import SMALL_CLAIMS, adjacent, file_claims

if TYPE_CHECKING:
    import numpy as np

ERROR, WARNING, INFO = "error", "warning", "info"
PARAMETERS_ABSENT = "parameters-absent"  # problem code: the save left model parameters out (EXCLUDED_FROZEN)
# files a DCP directory holds besides data: torch's metadata, Lightning's meta.pt, Megatron's
# metadata.json and common.pt, PEFT's adapter_config.json (the LoRA settings the bundled
# trainer saves with a LoRA run) (never "unreferenced")
FRAMEWORK_FILES = frozenset({METADATA_FILENAME, "meta.pt", "metadata.json", "common.pt", peft.CONFIG_NAME})
MAX_PROBLEMS_PER_TENSOR = 20  # overlap pairs listed per tensor before summarising


@dataclass(frozen=True)
class Problem:
    """One finding: `code` is stable for scripts (see README), `message` is for people."""

    severity: str
    code: str
    message: str
    file: str | None = None
    fqn: str | None = None


@dataclass
class Integrity:
    """What the gate found: every problem, and the size of each data file it could stat."""

    checkpoint: Checkpoint
    problems: list[Problem] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # data file -> bytes on disk
    files: int = 0  # data files the metadata references

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    def add(self, severity: str, code: str, message: str, file: str | None = None, fqn: str | None = None) -> None:
        self.problems.append(Problem(severity, code, message, file, fqn))


def check(checkpoint: Checkpoint, follow_symlinks: bool = False) -> Integrity:
    """Return every problem of the checkpoint's metadata against its files (never raises for
    a bad checkpoint). Data files must be regular files inside the checkpoint directory
    (symlinks resolved) unless `follow_symlinks`."""
    report = Integrity(checkpoint)
    for note in checkpoint.notes:
        if note.startswith(EXCLUDED_FROZEN):  # the save is whole as saved; the full model is not in it
            report.add(WARNING, PARAMETERS_ABSENT, f"{checkpoint.metadata_file}: {note}")
            continue
        fqn = note.split(":", 1)[0]
        report.add(ERROR, "unknown-dtype", f"{checkpoint.metadata_file}: {note}; this build cannot size or read it", fqn=fqn)
    with paused_gc():
        index = _FileIndex()
        report.sizes = _check_files(checkpoint, report, follow_symlinks, index)
        sound = _sound_tables(checkpoint, report.sizes, index)
        _check_blobs(checkpoint, report.sizes, report, index, sound)
        for tensor in checkpoint.tensors.values():
            if tensor.fqn not in sound.tiled:
                _check_geometry(tensor, report)
    return report


@dataclass(frozen=True)
class _Sound:
    """The tables proven to have nothing to report, all at once: `stored`, every row's blob
    inside its file and large enough (`_check_table_blobs` would report nothing); `tiled`,
    dim-0 slabs in bounds tiling the tensor exactly (`_check_table_geometry` would report
    nothing). A table not proven takes its own checks, which say what is wrong."""

    stored: frozenset[str] = frozenset()
    tiled: frozenset[str] = frozenset()


SOUND_BATCH_ROWS = 1 << 19  # rows of tables `_sound_tables` checks at once (~100 bytes each while checked)


def _sound_tables(checkpoint: Checkpoint, sizes: dict[str, int], index: _FileIndex) -> _Sound:
    """Return the `_Sound` tables of `checkpoint`: the checks of the tables of one rank run
    on their rows joined, in batches of about SOUND_BATCH_ROWS (a few thousand tensors cost a
    few numpy calls per batch, not a few per tensor)."""
    groups: dict[int, list[Tensor]] = defaultdict(list)
    for tensor in checkpoint.tensors.values():
        if isinstance(tensor.chunks, ChunkTable) and len(tensor.chunks) and len(tensor.shape) == tensor.chunks.offsets.shape[1]:
            groups[len(tensor.shape)].append(tensor)
    stored: list[str] = []
    tiled: list[str] = []
    for ndim, tensors in groups.items():
        batch: list[Tensor] = []
        rows = 0
        for position, tensor in enumerate(tensors):
            batch.append(tensor)
            rows += len(tensor.chunks)
            if rows >= SOUND_BATCH_ROWS or position == len(tensors) - 1:
                _sound_batch(batch, ndim, sizes, index, stored, tiled)
                batch, rows = [], 0
    return _Sound(frozenset(stored), frozenset(tiled))


def _sound_batch(tensors: list[Tensor], ndim: int, sizes: dict[str, int], index: _FileIndex, stored: list[str],
                 tiled: list[str]) -> None:
    """Add to `stored` and `tiled` the fqns of these tensors (non-empty tables of `ndim`
    dimensions) that `_Sound` says are so."""
    import numpy as np

    tables = [cast(ChunkTable, tensor.chunks) for tensor in tensors]
    shapes = [column_shape(tensor.shape) for tensor in tensors]
    if any(shape is None for shape in shapes):
        return
    counts = np.array([len(table) for table in tables], dtype=np.int64)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    extents = np.concatenate([table.sizes for table in tables])
    volumes = column_volumes(extents)
    itemsizes = np.array([dtypes.ITEMSIZE.get(tensor.dtype) or 0 for tensor in tensors], dtype=np.int64)
    if volumes is None or int(volumes.max()) >= COLUMN_LIMIT // max(int(itemsizes.max()), 1):
        return  # sizes int64 cannot multiply exactly: each table's own checks decide
    file = np.concatenate([index.of(table.files)[table.file] for table in tables])
    file_sizes = np.array([sizes.get(name, -1) for name in index.names] + [-1], dtype=np.int64)
    start = np.concatenate([table.blob_offset for table in tables])
    length = np.concatenate([table.blob_length for table in tables])
    room = file_sizes[file] - start  # -1 file sizes (missing, unsafe, no blob) fail below
    fine = (file >= 0) & (start >= 0) & (length >= 0) & (room >= 0) & (length <= room)
    fine &= volumes * np.repeat(itemsizes, counts) <= length
    del file, start, length, room, volumes
    stored += [tensor.fqn for tensor, ok in zip(tensors, np.logical_and.reduceat(fine, firsts).tolist()) if ok]
    if not ndim:
        return
    offsets = np.concatenate([table.offsets for table in tables])
    shape = np.repeat(np.array(shapes, dtype=np.int64).reshape(len(tensors), ndim), counts, axis=0)
    slabs = (offsets[:, 1:] == 0).all(axis=1) & (extents[:, 1:] == shape[:, 1:]).all(axis=1)
    rows_start = offsets[:, 0]
    inside = (rows_start >= 0) & (rows_start <= shape[:, 0])
    tiles = slabs & inside & (extents[:, 0] > 0) & (extents[:, 0] <= np.where(inside, shape[:, 0] - rows_start, 0))
    rows_end = np.where(tiles, rows_start + extents[:, 0], -1)  # no sum of rows out of bounds
    after = np.ones(len(tiles), dtype=bool)  # each slab starts where the one before it in its table ends
    after[1:] = rows_start[1:] == rows_end[:-1]
    after[firsts] = rows_start[firsts] == 0
    covered = np.add.reduceat(np.where(tiles, extents[:, 0], 0), firsts) == np.array([t.shape[0] for t in tensors])
    whole = np.logical_and.reduceat(tiles & after, firsts) & covered
    tiled += [tensor.fqn for tensor, ok in zip(tensors, whole.tolist()) if ok]


def gate(checkpoint: Checkpoint, follow_symlinks: bool = False) -> Integrity:
    """Return the integrity findings, or raise InvalidCheckpoint (with the first error's code
    and message) when there is any error; warnings pass.

    Example:
        >>> gate(read_checkpoint("damaged"))
        InvalidCheckpoint: damaged: model.embed.weight: chunks at [3, 0] and [5, 0] overlap (1 more problem: run `ckpttool validate damaged`)
    """
    report = check(checkpoint, follow_symlinks)
    errors = report.errors
    if errors:
        first = errors[0]
        more = f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''}: " if len(errors) > 1 else " ("
        raise InvalidCheckpoint(
            f"{checkpoint.path}: {first.message}{more}run `ckpttool validate {checkpoint.path}`; nothing was written)",
            code=first.code, problems=tuple(errors),
        )
    return report


class _FileIndex:
    """Data file names numbered once per check, and each ChunkTable's `files` as those numbers
    (tables of one checkpoint mostly hold the same files: each tuple is mapped once)."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}
        self.names: list[str] = []
        self.tables: dict[tuple[str, ...], Any] = {}
        self.by_id: dict[int, tuple[tuple[str, ...], Any]] = {}  # the same, by the tuple's id (kept alive here)

    def number(self, name: str) -> int:
        """Return the number of file `name`, numbering it if new (no numpy: a small checkpoint's claims)."""
        if (number := self.numbers.get(name)) is None:
            number = self.numbers[name] = len(self.names)
            self.names.append(name)
        return number

    def of(self, files: tuple[str, ...]) -> "np.ndarray":
        """Return the numbers of `files`, with -1 after them (where a table's -1 rows land)."""
        import numpy as np

        # found by the tuple's id first: hashing a tuple of 10k names on every call cost more
        # than the checks of a 10k-chunk table
        if (found := self.by_id.get(id(files))) is not None and found[0] is files:
            return found[1]
        if (numbers := self.tables.get(files)) is None:
            numbers = self.tables[files] = np.array([self.number(n) for n in files] + [-1], dtype=np.int64)
        self.by_id[id(files)] = (files, numbers)
        return numbers


def _first_users(checkpoint: Checkpoint, index: _FileIndex) -> dict[str, str]:
    """Return each referenced data file -> the first entry (in fqn order) whose blob is in it."""
    users: dict[str, str] = {}
    seen = None  # by number in `index`: files some table already named (numpy only once a table comes)
    for entry in checkpoint.entries():
        if not isinstance(entry, Tensor):
            names = [entry.blob.file] if entry.blob is not None else []
        elif isinstance(entry.chunks, ChunkTable):
            import numpy as np

            if seen is None:
                seen = np.zeros(0, dtype=bool)
            table = entry.chunks
            used = np.flatnonzero(np.bincount(table.file + 1, minlength=len(table.files) + 1)[1:])
            numbers = index.of(table.files)[used]
            if len(seen) < len(index.names):
                seen = np.concatenate((seen, np.zeros(len(index.names) - len(seen), dtype=bool)))
            numbers = numbers[~seen[numbers]]  # only files no table named before can be new
            seen[numbers] = True
            names = [index.names[k] for k in numbers.tolist()]
        else:
            names = [c.blob.file for c in entry.chunks if c.blob is not None]
        for name in names:
            users.setdefault(name, entry.fqn)
    return users


def _check_files(checkpoint: Checkpoint, report: Integrity, follow_symlinks: bool, index: _FileIndex) -> dict[str, int]:
    """Stat each referenced file once; report unsafe paths, special files, symlinks leaving
    the checkpoint, missing and unreferenced files."""
    inside = None if follow_symlinks else containment_root(checkpoint.path)
    sizes: dict[str, int] = {}
    users = _first_users(checkpoint, index)
    referenced: set[str] = set()  # safe relative paths, as the unreferenced-file scan names files
    for name, fqn in sorted(users.items()):
        try:
            safe = safe_relative_path(name)
            referenced.add(str(safe))
            path = checkpoint.path / safe
        except CheckpointError:
            report.add(ERROR, "path-traversal", f"{name}: path of {fqn} leaves the checkpoint directory (absolute or `..`); not read", name, fqn)
            continue
        try:
            status = path.stat()
            check_data_file(path, status.st_mode, inside)
            sizes[name] = status.st_size
        except UnsafeDataFile as error:
            report.add(ERROR, error.code, f"{error} (referenced by {fqn})", name, fqn)
        except FileNotFoundError:
            report.add(ERROR, "missing-file", f"{path}: referenced by {fqn} (and maybe others) but missing; was the save interrupted or the copy partial?", name, fqn)
        except OSError as error:
            report.add(ERROR, "unreadable-file", f"{path}: cannot stat ({error})", name, fqn)
    report.files = len(users)
    if checkpoint.metadata_file != METADATA_FILENAME and not RANK_METADATA_PATTERN.match(checkpoint.metadata_file):
        return sizes  # safetensors layouts: the folder also holds configs, tokenizers, indexes
    for path in sorted(checkpoint.path.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(checkpoint.path).as_posix()
        if relative in FRAMEWORK_FILES or RANK_METADATA_PATTERN.match(relative) or relative in referenced:
            continue
        report.add(WARNING, "unreferenced-file", f"{path}: not referenced by the metadata (left over from another save?)", relative)
    return sizes


def _check_blobs(checkpoint: Checkpoint, sizes: dict[str, int], report: Integrity, index: _FileIndex,
                 sound: _Sound = _Sound()) -> None:
    """Every chunk has a blob inside its file, large enough for its elements; no two overlap."""
    claims = _Claims(index)
    shared: set[tuple[str, int, int]] = set()  # raw ranges several tensors may name (tied weights share a storage)
    for tensor in checkpoint.tensors.values():
        if tensor.fqn in sound.stored:
            claims.add_table(tensor, None)
            continue
        if isinstance(tensor.chunks, ChunkTable) and _check_table_blobs(checkpoint, tensor, sizes, report, claims):
            continue
        itemsize = dtypes.ITEMSIZE.get(tensor.dtype) or 0
        for chunk in tensor.chunks:
            where = f"{tensor.fqn} chunk at {list(chunk.offsets)}"
            blob = chunk.blob
            if _check_chunk_blob(checkpoint, tensor, chunk, where, itemsize, sizes, report):
                assert blob is not None  # a chunk without a blob joins no sweep
                claims.add(blob.file, blob.offset, blob.offset + blob.length, where, None if blob.transforms else (tensor, chunk))
            if blob is not None and is_raw_range(blob):
                shared.add((blob.file, blob.offset, blob.offset + blob.length))
    for obj in checkpoint.objects.values():
        if obj.blob is None and obj.data is None:
            report.add(ERROR, "object-without-storage", f"{checkpoint.metadata_file}: {obj.fqn} has no storage entry", fqn=obj.fqn)
        elif obj.blob is not None and _check_blob_range(obj.blob, obj.fqn, obj.fqn, sizes, report):
            claims.add(obj.blob.file, obj.blob.offset, obj.blob.offset + obj.blob.length, obj.fqn, None)
    _check_claims(checkpoint, claims, sizes, shared, report)
    for fqn, blob in checkpoint.orphan_blobs:
        report.add(WARNING, "orphan-storage", f"{checkpoint.metadata_file}: storage entry for {fqn} in {blob.file} matches no tensor chunk", blob.file, fqn)


def _check_chunk_blob(checkpoint: Checkpoint, tensor: Tensor, chunk: Chunk, where: str, itemsize: int,
                      sizes: dict[str, int], report: Integrity) -> bool:
    """Report what is wrong with one chunk's blob; return whether its byte range joins the
    overlap sweep (it has one, inside a file that could be stat'ed)."""
    blob = chunk.blob
    if blob is None:
        report.add(ERROR, "chunk-without-storage", f"{checkpoint.metadata_file}: {where} has no storage entry (no file holds its bytes)", fqn=tensor.fqn)
        return False
    claimed = _check_blob_range(blob, where, tensor.fqn, sizes, report)
    if itemsize and (not blob.transforms or is_raw_range(blob)) and min(chunk.sizes, default=1) >= 0:
        needed = chunk.numel * itemsize
        if needed > blob.length:
            report.add(ERROR, "size-mismatch", f"{blob.file}: {where} claims {chunk.numel} {tensor.dtype} elements ({needed} bytes) but its blob is only {blob.length} bytes", blob.file, tensor.fqn)
    return claimed


def _check_table_blobs(checkpoint: Checkpoint, tensor: Tensor, sizes: dict[str, int], report: Integrity,
                       claims: "_Claims") -> bool:
    """`_check_chunk_blob` for every row of a ChunkTable at once (only rows with a problem
    become Chunks, for their messages); False, with nothing reported, when its sizes are too
    large for int64 arithmetic."""
    import numpy as np

    table = cast(ChunkTable, tensor.chunks)  # the caller checked
    itemsize = dtypes.ITEMSIZE.get(tensor.dtype) or 0
    volumes = column_volumes(table.sizes)
    if volumes is None or (len(table) and int(volumes.max()) >= COLUMN_LIMIT // max(itemsize, 1)):
        return False
    numbers = claims.index.of(table.files)
    file_sizes = claims.file_sizes(sizes)[numbers][table.file]  # -1: missing or unsafe
    offset, length = table.blob_offset, table.blob_length
    if not len(table) or min(int(table.file.min()), int(offset.min()), int(length.min()), int(file_sizes.min())) >= 0:
        beyond = length > file_sizes - offset  # the usual case: every row stored, in a file of known size
        problems = beyond | (volumes * itemsize > length)
        claiming = None if not beyond.any() else np.flatnonzero(~beyond)
    else:
        stored = table.file >= 0
        bad = stored & ((offset < 0) | (length < 0))
        known = stored & ~bad & (file_sizes >= 0)
        beyond = known & (length > file_sizes - offset)  # offset + length > size, without overflow
        problems = ~stored | bad | beyond | (stored & (volumes * itemsize > length))
        claiming = np.flatnonzero(known & ~beyond)
    for row in np.flatnonzero(problems).tolist():
        chunk = table[row]
        _check_chunk_blob(checkpoint, tensor, chunk, f"{tensor.fqn} chunk at {list(chunk.offsets)}", itemsize, sizes, report)
    claims.add_table(tensor, claiming)
    return True


def _check_blob_range(blob: Blob, where: str, fqn: str, sizes: dict[str, int], report: Integrity) -> bool:
    """Report why the blob's byte range is bad; return whether it joins the overlap sweep."""
    if blob.offset < 0 or blob.length < 0:
        report.add(ERROR, "bad-range", f"{blob.file}: {where} has a negative offset or length", blob.file, fqn)
        return False
    size = sizes.get(blob.file)
    if size is None:
        return False  # missing or unsafe file, already reported
    if blob.offset + blob.length > size:
        report.add(ERROR, "beyond-eof", f"{blob.file}: {where} spans bytes {blob.offset}..{blob.offset + blob.length} but the file has {size} bytes (truncated?)", blob.file, fqn)
        return False
    return True


_range_order = operator.itemgetter(0, 1, 2)  # never compare the (tensor, chunk) owners


class _Claims:
    """The byte ranges entries claim in data files, in the order they were checked: single
    ranges (objects, chunks of tuples) and whole ChunkTables (a tensor and its claiming rows).

    Each claim gets the next id; `columns` returns them as arrays for the sweep, and `label`
    the `where` text and owner of one claim (built only for the claims a message names).
    """

    def __init__(self, index: _FileIndex) -> None:
        self.index = index  # numbers the files in `columns`
        self.parts: list = []  # per run of singles: a list of (file number, start, end, owned); per table: a tuple
        self.singles: dict[int, tuple[str, tuple[Tensor, Chunk] | None]] = {}  # claim id -> (where, owner)
        self.tables: list[tuple[int, Tensor, Any]] = []  # (first claim id, tensor, claiming rows)
        self.sizes: Any = None  # file sizes by number (-1: unknown), built when a table first asks
        self.count = 0

    def file_sizes(self, sizes: dict[str, int]) -> "np.ndarray":
        """Return the size of each file by number (-1 when not stat'ed), -1 last."""
        import numpy as np

        if self.sizes is None or len(self.sizes) <= len(self.index.names):
            self.sizes = np.array([sizes.get(name, -1) for name in self.index.names] + [-1], dtype=np.int64)
        return self.sizes

    def add(self, file: str, start: int, end: int, where: str, owner: tuple[Tensor, Chunk] | None) -> None:
        if not self.parts or not isinstance(self.parts[-1], list):
            self.parts.append([])
        self.parts[-1].append((self.index.number(file), start, end, owner is not None))
        self.singles[self.count] = (where, owner)
        self.count += 1

    def add_table(self, tensor: Tensor, rows: Any) -> None:
        """Add the byte ranges of these rows of a table (None: every row)."""
        self.parts.append((tensor, rows, self.index.of(cast(ChunkTable, tensor.chunks).files)))  # a table's tensor
        self.tables.append((self.count, tensor, rows))
        self.count += len(tensor.chunks) if rows is None else len(rows)

    def columns(self) -> tuple:
        """Return (file number, start, end, owned) arrays of every claim, in claim order (so a
        claim's id is its position)."""
        import numpy as np

        pieces: list = []  # (file number, start, end, owned) arrays per part
        for part in self.parts:
            if isinstance(part, list):
                pieces.append(np.array(part, dtype=np.int64).reshape(len(part), 4).T)
            else:
                tensor, rows, numbers = part
                table = tensor.chunks
                if rows is None:
                    file, start, length = table.file, table.blob_offset, table.blob_length
                else:
                    file, start, length = table.file[rows], table.blob_offset[rows], table.blob_length[rows]
                pieces.append((numbers[file], start, start + length, np.ones(len(start), dtype=bool)))
        if not pieces:
            return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
        return tuple(np.concatenate([piece[k] for piece in pieces]) for k in range(4))

    def disjoint(self, sizes: dict[str, int]) -> bool:
        """True when no two claims share a byte and none is empty: proven from each claim's
        start and end in one byte space (every file's bytes after the previous file's; every
        claim lies inside its file), the starts and the ends each sorted in place. Non-empty
        ranges are disjoint exactly when the k-th end is at most the (k+1)-th start. False
        when that fails or cannot be used: `_check_claims` then sorts the claims themselves."""
        import numpy as np

        file_sizes = self.file_sizes(sizes)[:-1]
        if len(file_sizes) and (int(file_sizes.min()) < -1 or float(np.maximum(file_sizes, 0).sum(dtype=np.float64)) >= COLUMN_LIMIT):
            return False
        base = np.concatenate(([0], np.cumsum(np.maximum(file_sizes, 0))))  # -1 last: a claim never names it
        count = sum(len(part) if isinstance(part, list) else len(part[0].chunks) if part[1] is None else len(part[1])
                    for part in self.parts)
        starts, ends = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        at = 0
        for part in self.parts:
            if isinstance(part, list):
                file, start, end = (np.array([claim[k] for claim in part], dtype=np.int64) for k in range(3))
            else:
                tensor, rows, numbers = part
                table = tensor.chunks
                file, start, length = ((table.file, table.blob_offset, table.blob_length) if rows is None else
                                       (table.file[rows], table.blob_offset[rows], table.blob_length[rows]))
                end = start + length
            if len(start) and not (end > start).all():
                return False  # an empty range: the sweep says which range it lies in
            offset = base[numbers[file]] if not isinstance(part, list) else base[file]
            np.add(start, offset, out=starts[at:at + len(start)])
            np.add(end, offset, out=ends[at:at + len(start)])
            at += len(start)
        starts.sort()
        ends.sort()
        return bool((ends[:-1] <= starts[1:]).all())

    def label(self, claim: int) -> tuple[str, tuple[Tensor, Chunk] | None]:
        """Return the `where` text and the (tensor, chunk) owner of one claim."""
        if claim in self.singles:
            return self.singles[claim]
        first, tensor, rows = self.tables[bisect.bisect_right(self.tables, claim, key=operator.itemgetter(0)) - 1]
        chunk = tensor.chunks[claim - first if rows is None else int(rows[claim - first])]
        return f"{tensor.fqn} chunk at {list(chunk.offsets)}", (tensor, chunk)


def _check_claims(checkpoint: Checkpoint, claims: _Claims, sizes: dict[str, int], shared: set[tuple[str, int, int]],
                  report: Integrity) -> None:
    """Report bytes claimed twice: per file (in the order of their first claim), its ranges
    sorted by (start, end) and each compared with the next, all files in one sort.

    A file where two ranges coincide or two tensor blobs start together takes the path of
    `_sweep_file` (ties ordered by their text; safetensors blobs resolved from the header).
    Claims of tuples alone, up to SMALL_CLAIMS of them, are sorted in pure Python
    (integrity_small: the same findings, without importing numpy)."""
    if not claims.tables and claims.count <= SMALL_CLAIMS:
        for number, rows in file_claims([claim for part in claims.parts for claim in part]):
            name = claims.index.names[number]
            sweep, overlaps = adjacent(rows)
            if sweep:
                _sweep_file(checkpoint, name, [(a, b, *claims.label(c)) for a, b, c, _ in rows], sizes[name], shared, report)
                continue
            for i in overlaps:
                _report_overlap(claims, name, rows[i][:3], rows[i + 1][:3], shared, report)
        return
    import numpy as np

    if claims.disjoint(sizes):
        return  # the usual case, proven without sorting the claims
    file, start, end, owned = claims.columns()
    if not len(file):
        return
    claim = np.lexsort((end, start, file))  # stable: equal ranges stay in claim order
    file, start, end, owned = file[claim], start[claim], end[claim], owned[claim].astype(bool)
    firsts = np.concatenate(([0], np.flatnonzero(file[1:] != file[:-1]) + 1))
    lasts = np.concatenate((firsts[1:], [len(file)]))
    same_start = (file[1:] == file[:-1]) & (start[1:] == start[:-1])
    special = same_start & ((end[1:] == end[:-1]) | (owned[1:] & owned[:-1]))
    overlap = (file[1:] == file[:-1]) & (start[1:] < end[:-1])
    names = claims.index.names
    for group in np.argsort(np.minimum.reduceat(claim, firsts), kind="stable").tolist():
        low, high = int(firsts[group]), int(lasts[group])
        name = names[int(file[low])]
        if special[low:high - 1].any():
            ranges = [(int(start[i]), int(end[i]), *claims.label(int(claim[i]))) for i in range(low, high)]
            _sweep_file(checkpoint, name, ranges, sizes[name], shared, report)
            continue
        for i in (np.flatnonzero(overlap[low:high - 1]) + low).tolist():
            _report_overlap(claims, name, (int(start[i]), int(end[i]), int(claim[i])),
                            (int(start[i + 1]), int(end[i + 1]), int(claim[i + 1])), shared, report)


def _report_overlap(claims: _Claims, name: str, first: tuple[int, int, int], after: tuple[int, int, int],
                    shared: set[tuple[str, int, int]], report: Integrity) -> None:
    """Report claim `after` (start, end, claim id) starting inside claim `first`, both in file
    `name`, unless both are raw ranges several tensors may share."""
    range_a, range_b = (name, first[0], first[1]), (name, after[0], after[1])
    if range_a in shared and range_b in shared:
        return
    where, next_where = claims.label(first[2])[0], claims.label(after[2])[0]
    report.add(ERROR, "blob-overlap", f"{name}: bytes {range_b[1]}..{range_a[2]} are claimed by both {where} and {next_where}", name, next_where)


def _sweep_file(checkpoint: Checkpoint, name: str, ranges: list, size: int, shared: set[tuple[str, int, int]],
                report: Integrity) -> None:
    """Report overlaps among one file's ranges (start, end, where, owner), sorted by their
    text on ties, after resolving blobs of a safetensors-format file."""
    ranges.sort(key=_range_order)
    if any(a[0] == b[0] and a[3] and b[3] for a, b in zip(ranges, ranges[1:])):
        ranges = _resolve_safetensors_blobs(checkpoint, name, ranges, size, report)
    for (start, end, fqn, _), (next_start, next_end, next_fqn, _) in zip(ranges, ranges[1:]):
        if next_start < end and not ((name, start, end) in shared and (name, next_start, next_end) in shared):
            report.add(ERROR, "blob-overlap", f"{name}: bytes {next_start}..{end} are claimed by both {fqn} and {next_fqn}", name, next_fqn)


def _resolve_safetensors_blobs(checkpoint: Checkpoint, name: str, ranges: list, size: int,
                               report: Integrity) -> list:
    """Return `ranges` (sorted) with the tensors of each safetensors blob at their real ranges.

    With `serialization_format=SAFETENSORS` torch records every tensor of a file at the
    blob's start (length = its element bytes); the safetensors header says where each really
    is. Only starts shared by several tensors are looked at, so torch_save checkpoints cost
    no extra reads. Shared starts that are not safetensors blobs stay as they are (the sweep
    reports them as overlaps).
    """
    from ckpttool.dcp.blobs import DataFiles, is_safetensors_blob, safetensors_header  # only here: validate needs no blob reader

    groups: dict[int, list[tuple]] = defaultdict(list)
    for entry in ranges:
        if entry[3] is not None:
            groups[entry[0]].append(entry)
    resolved: list[tuple] = []
    replaced: set[int] = set()
    with DataFiles(checkpoint.path, follow_symlinks=True) as files:  # checked by _check_files
        for offset, members in sorted(groups.items()):
            if len(members) < 2:
                continue
            first_tensor, first_chunk = members[0][3]
            try:
                if not is_safetensors_blob(files, first_chunk.blob):
                    continue
                header, data_start = safetensors_header(files, first_chunk.blob, f"{files.path(name)}")
            except CheckpointError as error:
                report.add(ERROR, "corrupt-blob", str(error), name, first_tensor.fqn)
                continue
            replaced.add(offset)
            for _, _, where, (tensor, chunk) in members:
                info = header.get(tensor.fqn)
                begin, end = info.get("data_offsets", (None, None)) if isinstance(info, dict) else (None, None)
                if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                    report.add(ERROR, "corrupt-blob", f"{name}: {where} is not in the safetensors header at byte {offset}", name, tensor.fqn)
                    continue
                start, stop = data_start + begin, data_start + end
                if stop - start != chunk.blob.length:
                    report.add(ERROR, "size-mismatch", f"{name}: {where} holds {stop - start} bytes in the safetensors header, the metadata says {chunk.blob.length}", name, tensor.fqn)
                elif stop > size:
                    report.add(ERROR, "beyond-eof", f"{name}: {where} spans bytes {start}..{stop} but the file has {size} bytes (truncated?)", name, tensor.fqn)
                else:
                    resolved.append((start, stop, where, None))
    kept = [entry for entry in ranges if entry[3] is None or entry[0] not in replaced]
    return sorted(kept + resolved, key=_range_order)


def _check_geometry(tensor: Tensor, report: Integrity) -> None:
    """Chunks lie inside the tensor, do not overlap, and cover it completely."""
    if isinstance(tensor.chunks, ChunkTable) and _check_table_geometry(tensor, tensor.chunks, report):
        return
    boxes = []
    for chunk in tensor.chunks:
        if not in_bounds(chunk.offsets, chunk.sizes, tensor.shape):
            _out_of_bounds(tensor, chunk, report)
        else:
            boxes.append((chunk.offsets, chunk.sizes))
    pairs = find_overlaps(boxes, limit=MAX_PROBLEMS_PER_TENSOR)
    for i, j in pairs:
        report.add(ERROR, "overlap", f"{tensor.fqn}: chunks at {list(boxes[i][0])} and {list(boxes[j][0])} overlap", fqn=tensor.fqn)
    if pairs or len(boxes) < len(tensor.chunks):
        return
    _check_coverage(tensor, coverage(boxes, tensor.shape), report)


def _check_table_geometry(tensor: Tensor, table: ChunkTable, report: Integrity) -> bool:
    """`_check_geometry` from a table's columns: rows out of bounds found at once, no overlap
    and the coverage proven by `dim0_tiling` in O(n); False, with nothing reported, when that
    proof fails (block sharding, overlaps): the boxes must be compared."""
    import numpy as np

    inside = columns_in_bounds(table.offsets, table.sizes, tensor.shape)
    if inside is None or not len(table) or not tensor.shape:
        return False
    everywhere = bool(inside.all())
    offsets, sizes = (table.offsets, table.sizes) if everywhere else (table.offsets[inside], table.sizes[inside])
    found = dim0_tiling(offsets, sizes, tensor.shape)
    if found is None:
        return False
    for row in np.flatnonzero(~inside).tolist():
        _out_of_bounds(tensor, table[row], report)
    if everywhere:
        _check_coverage(tensor, found, report)
    return True


def _out_of_bounds(tensor: Tensor, chunk: Chunk, report: Integrity) -> None:
    report.add(ERROR, "chunk-out-of-bounds", f"{tensor.fqn}: chunk at {list(chunk.offsets)} size {list(chunk.sizes)} does not fit shape {list(tensor.shape)}", fqn=tensor.fqn)


def _check_coverage(tensor: Tensor, found: Coverage, report: Integrity) -> None:
    if not found.complete:
        detail = ", ".join(f"rows {a}..{b}" for a, b in found.missing_rows[:5]) or "see --json chunks"
        report.add(ERROR, "gap", f"{tensor.fqn}: chunks cover {found.covered} of {found.total} elements ({detail} missing)", fqn=tensor.fqn)
