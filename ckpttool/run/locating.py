"""Where each chunk's raw bytes are: torch.save record headers read, one task per data file.

Planners take the result (`Located`: fqn -> chunk index -> `RawData`, or None where a chunk
must be decoded) as input; nothing here writes. A large `.metadata` is read into
`ChunkTable`s, and those tensors are located from their columns a data file at a time
(`_TableJobs`); small checkpoints (chunk tuples) walk chunk by chunk. The results and the
errors (the first in tensor and chunk order) are those of locating each chunk alone.

From object storage (coalesced spans) only the first record of each layout is located here;
the others are predicted from it and located when the copies first read their data, from
the spans that carry it (`_locate_coalesced`, `PredictedRecords`): the same checks and
errors, raised by the copy instead (nothing is kept of an output that failed), and each byte
of a data file fetched about once whatever the budget.

Example:
    >>> with DataFiles(checkpoint.path) as files:
    ...     located = locate_chunks(files, checkpoint.tensors.values())
    >>> located["model.embed.weight"][0]
    RawData(file='__0_0.distcp', offset=1216, length=208, crc32=2931488367)
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Sequence, TypeGuard, TypeVar, cast

from ckpttool.store import spans
from ckpttool.core.checkpoint import Blob, Chunk, ChunkTable, Tensor, paused_gc
from ckpttool.dcp.blobs import DataFiles, RawData, RawDataRows, ReadAhead, locate
from ckpttool.core.errors import CheckpointError, CorruptBlob, UnsupportedFormat
from ckpttool.core.geometry import positions_in_groups
from ckpttool.store.io import thread_buffer
from ckpttool.plan import unique_chunks, unique_table_rows
from ckpttool.torchsave.record import ParsedRecords

T = TypeVar("T")
Located = dict[str, MutableMapping[int, RawData | None]]  # fqn -> chunk index -> raw bytes (None: decode)


def locate_chunks(files: DataFiles, tensors: Iterable[Tensor], threads: int = 4) -> Located:
    """Return where each distinct chunk's raw bytes are (reading only record headers); the
    planners take this as input. Raises CorruptBlob for a record that disagrees with the
    metadata or runs past the end of its file.

    One task per data file walks its records in offset order through a `ReadAhead`, so the
    headers of neighbouring records come from one read; tasks run `threads` at a time. On
    several bad chunks the error raised is the first in (tensor, chunk) order, as if each
    chunk were located alone in that order.
    """
    with paused_gc():  # a few small acyclic objects per chunk (see paused_gc)
        return _locate_chunks(files, list(tensors), threads)


def _locate_chunks(files: DataFiles, tensors: list[Tensor], threads: int) -> Located:
    # ChunkTable tensors are located from their columns (`_TableJobs`), the others chunk by
    # chunk; coalesced spans (remote roots) keep the chunk walk, which tells them its order.
    # Job numbers run over both in (tensor, chunk) order: the error raised is the first's.
    columnar = not files.coalesced
    tables = [tensor for tensor in tensors if columnar and isinstance(tensor.chunks, ChunkTable)]
    table_rows = iter(unique_table_rows([cast(ChunkTable, tensor.chunks) for tensor in tables]))
    jobs: dict[int, tuple[Tensor, int]] = {}
    chunks: dict[int, Chunk] = {}
    table_indices: list = []
    table_first: list[int] = []
    count = 0
    for tensor in tensors:
        if columnar and isinstance(tensor.chunks, ChunkTable):
            indices = next(table_rows)
            table_indices.append(indices)
            table_first.append(count)
            count += len(indices)
            continue
        indices = unique_chunks(tensor)
        if isinstance(tensor.chunks, ChunkTable):
            picked = tensor.chunks.rows(indices)  # one pass over the columns
        else:
            picked = [tensor.chunks[index] for index in indices]
        for index, chunk in zip(indices, picked):
            jobs[count], chunks[count] = (tensor, index), chunk
            count += 1
    found: dict[int, RawData | None] = {}
    columns = _TableJobs(tables, table_indices, table_first) if tables else None
    if files.coalesced:  # most records' headers are read later, with their data (`PredictedRecords`)
        failures = _locate_coalesced(files, jobs, chunks, found, threads)
    else:
        tasks = _chunk_tasks(files, jobs, chunks, found)
        if columns is not None:
            tasks += columns.tasks(files)
            if files.local:  # a file's walk is a read and array work: threads beyond the cores only contend
                threads = min(threads, max(2, os.cpu_count() or 1))
        failures = [failure for failure in run_each(tasks, threads) if failure is not None]
    if failures:
        raise min(failures, key=lambda failure: failure[0])[1]
    located: Located = {tensor.fqn: {} for tensor in tensors}
    for number, (tensor, index) in jobs.items():
        located[tensor.fqn][index] = found[number]
    if columns is not None:
        columns.fill(located)
    return located


def _chunk_tasks(files: DataFiles, jobs: dict[int, tuple[Tensor, int]], chunks: dict[int, Chunk],
                 found: dict[int, RawData | None]) -> list[Callable[[], tuple[int, Exception] | None]]:
    """One task per data file locating the chunks of `jobs` (by job number), walking the file's
    records in offset order; each returns the first error in job order, or None."""
    by_file: dict[str, list[int]] = {}
    for number, chunk in chunks.items():
        by_file.setdefault(chunk.blob.file if chunk.blob is not None else "", []).append(number)
    files.walk_records(chunk.blob for chunk in chunks.values())

    def walk(relative: str, numbers: list[int]) -> tuple[int, Exception] | None:
        ahead = ReadAhead(files, relative)
        errors: list[tuple[int, Exception]] = []  # the first in job order: the one raised (`_after_failure`)

        def locate_alone(number: int) -> None:
            if _after_failure(errors, number):
                return
            tensor, index = jobs[number]
            try:
                found[number] = _locate_one(ahead, tensor, index)
            except Exception as error:
                errors[:] = [(number, error)]

        ordered = sorted(numbers, key=lambda n: blob.offset if (blob := chunks[n].blob) is not None else 0)
        blocks = not files.coalesced  # coalesced spans already serve neighbours from memory
        position = 0
        while position < len(ordered):
            end = _record_block(chunks, ordered, position) if blocks else position + 1
            block = ordered[position:end]
            position = end
            if len(block) == 1:
                locate_alone(block[0])
                continue
            # the block's first record is parsed alone, the others reuse its layout where they
            # can; of those that cannot, the first is parsed alone, and so on while parsing
            # finds new layouts (ParsedRecords keeps a bounded number)
            locate_alone(block[0])
            rest = block[1:]
            while rest:
                missed = []
                for number, raw in zip(rest, _reuse_block(ahead, jobs, chunks, rest)):
                    if raw is None:
                        missed.append(number)
                    else:
                        found[number] = raw
                if not missed:
                    break
                layouts = ahead.records.layouts
                locate_alone(missed[0])
                rest = missed[1:]
                if ahead.records.layouts == layouts:
                    for number in rest:
                        locate_alone(number)
                    break
        return errors[0] if errors else None  # at most one: the first in job order

    return [functools.partial(walk, relative, numbers) for relative, numbers in sorted(by_file.items())]


class _TableJobs:
    """The distinct non-empty chunks of ChunkTable tensors, as columns in job order, located
    a file at a time with array operations: per file, the job list, the sort by offset, the
    blocks, the layout comparisons (`ParsedRecords.match_block`), the dtype and shape checks
    and the data offsets and CRC-32s are arrays; a chunk is touched in Python only to build
    its `RawData`, or when it is located alone (`_locate_one`: any record not reused).
    """

    def __init__(self, tensors: list[Tensor], indices: list, first: list[int]):
        """`tensors`: those whose chunks are ChunkTables (`_locate_chunks` picks them)."""
        import numpy as np

        self.tensors = tensors
        counts = np.array([len(rows) for rows in indices], dtype=np.int64)
        self.index = np.concatenate(indices).astype(np.int64) if indices else np.zeros(0, np.int64)
        self.tensor = np.repeat(np.arange(len(tensors), dtype=np.int64), counts)
        self.number = np.repeat(np.array(first, dtype=np.int64), counts) + positions_in_groups(counts)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # of each tensor's jobs
        names: dict[str, int] = {}
        mapped: dict[int, tuple] = {}  # id of a files tuple -> (the tuple, its global numbers, then -1)
        dtype_codes: dict[str, int] = {}
        ndim = max((cast(ChunkTable, tensor.chunks).offsets.shape[1] for tensor in tensors), default=0)
        rows = len(self.index)
        self.file = np.empty(rows, dtype=np.int64)
        self.offset = np.empty(rows, dtype=np.int64)
        self.length = np.empty(rows, dtype=np.int64)
        self.sizes = np.zeros((rows, ndim), dtype=np.int64)
        self.ndim = np.repeat(np.array([cast(ChunkTable, t.chunks).offsets.shape[1] for t in tensors], dtype=np.int64), counts)
        self.dtype = np.repeat(np.array([dtype_codes.setdefault(t.dtype, len(dtype_codes)) for t in tensors],
                                        dtype=np.int64), counts)
        self.dtype_codes = dtype_codes
        for number, (tensor, picked) in enumerate(zip(tensors, indices)):
            table = cast(ChunkTable, tensor.chunks)
            known = mapped.get(id(table.files))
            if known is None:
                numbers = [names.setdefault(name, len(names)) for name in table.files]
                known = mapped[id(table.files)] = (table.files, np.array(numbers + [-1], dtype=np.int64))
            begin, end = self.starts[number], self.starts[number + 1]
            self.file[begin:end] = known[1][table.file[picked]]
            self.offset[begin:end] = table.blob_offset[picked]
            self.length[begin:end] = table.blob_length[picked]
            self.sizes[begin:end, :table.sizes.shape[1]] = table.sizes[picked]
        self.names = list(names)
        # what was found: raw_* for chunks reused from a layout (`reused`), `alone` for the rest
        self.reused = np.zeros(rows, dtype=bool)
        self.raw_offset = np.zeros(rows, dtype=np.int64)
        self.raw_length = np.zeros(rows, dtype=np.int64)
        self.raw_crc = np.zeros(rows, dtype=np.int64)
        self.alone: dict[int, RawData | None] = {}  # by job position
        self._records: dict[int, ParsedRecords] = {}  # by thread
        self._checks: dict[int, tuple] = {}  # by id of a layout's record: what `_checked` needs of it

    def tasks(self, files: DataFiles) -> list[Callable[[], tuple[int, Exception] | None]]:
        """One task per data file (and one for chunks without a blob), in file name order."""
        import numpy as np

        order = np.argsort(self.file, kind="stable")
        bounds = np.flatnonzero(np.diff(self.file[order])) + 1
        groups = np.split(order, bounds) if len(order) else []
        named = sorted(groups, key=lambda group: self.names[self.file[group[0]]] if self.file[group[0]] >= 0 else "")
        return [functools.partial(self._walk, files, group) for group in named]

    def _walk(self, files: DataFiles, positions) -> tuple[int, Exception] | None:
        """Locate the jobs at `positions` (ascending), all of one data file: blocks of small
        records close together by array comparisons, every other record alone."""
        import numpy as np

        file = int(self.file[positions[0]])
        relative = self.names[file] if file >= 0 else ""
        ahead = ReadAhead(files, relative)
        # a parse is a function of the record's bytes, whatever its file: the layouts parsed
        # by this thread's earlier walks serve this file too (each thread parses each once),
        # until they are as many as ParsedRecords keeps: then this file starts afresh
        records = self._records.get(threading.get_ident())
        if records is None or records.layouts >= ParsedRecords.MAX_LAYOUTS:
            records = self._records[threading.get_ident()] = ParsedRecords()
        ahead.records = records
        errors: list[tuple[int, Exception]] = []
        ordered = positions[np.argsort(self.offset[positions], kind="stable")] if file >= 0 else positions
        offset, length = self.offset[ordered], self.length[ordered]
        ends = offset + length
        # (offsets the metadata gives are any int64: only sane ones are read in blocks, so no sum overflows)
        small = ((length > 0) & (length <= BLOCK_RECORD) & (offset >= 0) & (offset < 1 << 62) if file >= 0
                 else np.zeros(len(ordered), dtype=bool))
        # a record joins the one before it when both are small, it starts at or after that
        # one's end, and at most BLOCK_GAP bytes after it
        joined = small[1:] & small[:-1] & (offset[1:] >= ends[:-1]) & (offset[1:] - ends[:-1] <= BLOCK_GAP)
        runs = np.flatnonzero(~joined) + 1
        for first, end in zip([0, *runs.tolist()], [*runs.tolist(), len(ordered)]):
            if end - first < BLOCK_MIN:
                for position in ordered[first:end].tolist():
                    self._locate_alone(ahead, position, errors)
                continue
            while first < end:  # blocks of at most BLOCK_BYTES
                last = first + max(1, int(np.searchsorted(ends[first:end], offset[first] + BLOCK_BYTES, "right")))
                if not _after_failure(errors, int(self.number[ordered[first:last]].min())):  # else not even read
                    self._block(ahead, ordered[first:last], errors)
                first = last
        return errors[0] if errors else None  # at most one: the first in job order

    def _block(self, ahead: ReadAhead, block, errors: list) -> None:
        """Locate the records of `block` (job positions in offset order, records lying in at
        most BLOCK_BYTES): those whose bytes are a parsed layout's from arrays, the rest alone."""
        import numpy as np

        offset, length = self.offset[block], self.length[block]
        start, end = int(offset[0]), int(offset[-1] + length[-1])
        try:
            size = ahead.size(ahead.relative)
            if end > size:
                raise CorruptBlob("past the end")  # each record alone says which
            # this thread's buffer, reused block after block (fresh pages cost more than the copy)
            buffer = np.frombuffer(thread_buffer(end - start + 8, "locate"), np.uint8)
            # numpy's stubs give ndarray `__buffer__` for Python 3.12+ only; it has the buffer protocol
            ahead.files.read_into(ahead.relative, start, memoryview(cast(Any, buffer))[:end - start])
        except CheckpointError:
            for position in block.tolist():
                self._locate_alone(ahead, position, errors)
            return
        places = offset - start
        pending = np.ones(len(block), dtype=bool)
        compared: dict[int, int] = {}  # by record length: the layouts every pending record was compared with
        refused = []  # whose bytes are a layout's that `locate` would not return as raw data
        while True:
            for record_length in np.unique(length[pending]).tolist():
                group = np.flatnonzero(pending & (length == record_length))
                skip = compared.get(record_length, 0)
                which, crcs, layouts = ahead.records.match_block(buffer, places[group], record_length, skip)
                compared[record_length] = len(layouts)
                for number in range(skip, len(layouts)):
                    record, data_start = layouts[number]
                    matched = which == number
                    hit = group[matched]
                    if not len(hit):
                        continue
                    pending[hit] = False
                    data_at = start + places[hit] + data_start
                    good = self._checked(record, block[hit], size, data_at)
                    refused.append(hit[~good])
                    taken = block[hit[good]]
                    self.reused[taken] = True
                    self.raw_offset[taken] = data_at[good]
                    self.raw_length[taken] = record.data_length
                    self.raw_crc[taken] = crcs[matched][good]
            misses = np.flatnonzero(pending)
            if not len(misses):
                break
            # the first miss is parsed alone (a new layout, if it parses); while parsing finds
            # new layouts the rest are compared with them, else located alone
            known = ahead.records.layouts
            self._locate_alone(ahead, int(block[misses[0]]), errors)
            pending[misses[0]] = False
            if ahead.records.layouts == known:
                refused.append(misses[1:])
                break
        for position in block[np.sort(np.concatenate(refused))].tolist() if refused else ():
            self._locate_alone(ahead, position, errors)

    def _checked(self, record, positions, size: int, data_at):
        """Which of the jobs at `positions`, whose record parses as `record` with its data at
        `data_at`, `locate` would return as plain raw data (the rest: located alone)."""
        import numpy as np

        check = self._checks.get(id(record))
        if check is None or check[0] is not record:
            shape = record.shape
            usable = (record.is_plain and record.dtype in self.dtype_codes and len(shape) <= self.sizes.shape[1]
                      and all(type(n) is int and 0 <= n < (1 << 63) for n in shape))
            check = self._checks[id(record)] = (record, usable, self.dtype_codes.get(record.dtype),
                                                np.array(shape if usable else (), dtype=np.int64))
        _, usable, dtype, shape = check
        if not usable:
            return np.zeros(len(positions), dtype=bool)
        good = (self.dtype[positions] == dtype) & (self.ndim[positions] == len(shape))
        if len(shape):
            good &= (self.sizes[positions, :len(shape)] == shape).all(axis=1)
        return good & (data_at + record.data_length <= size)

    def _locate_alone(self, ahead: ReadAhead, position: int, errors: list) -> None:
        number = int(self.number[position])
        if _after_failure(errors, number):
            return
        tensor = self.tensors[int(self.tensor[position])]
        try:
            self.alone[position] = _locate_one(ahead, tensor, int(self.index[position]))
        except Exception as error:
            errors[:] = [(number, error)]

    def fill(self, located: Located) -> None:
        """Give each tensor its located chunks as columns (`RawDataRows`), with the chunks
        located alone as its overrides."""
        import numpy as np

        files = (*self.names, "")  # a file number of -1: no file
        starts = self.starts.tolist()
        rows = []
        for number, tensor in enumerate(self.tensors):
            begin, end = starts[number], starts[number + 1]
            rows.append(RawDataRows(self.index[begin:end], files, self.file[begin:end], self.raw_offset[begin:end],
                                    self.raw_length[begin:end], self.raw_crc[begin:end]))
            located[tensor.fqn] = rows[-1]
        if self.alone:
            positions = np.array(sorted(self.alone), dtype=np.int64)
            owners = (np.searchsorted(self.starts, positions, side="right") - 1).tolist()
            for position, owner in zip(positions.tolist(), owners):
                rows[owner].overrides[int(self.index[position])] = self.alone[position]


# small records lying close together are checked a block at a time (`ParsedRecords.match_block`):
# one read and a few array comparisons per record length instead of a parse each
BLOCK_RECORD = 64 << 10  # largest record checked in a block
BLOCK_GAP = 64 << 10  # most bytes between two records of a block (read through)
BLOCK_BYTES = 4 << 20  # most bytes read per block
BLOCK_MIN = 8  # fewer records than this are located one by one


def _blockable(blob: Blob | None) -> TypeGuard[Blob]:
    return blob is not None and not blob.transforms and 0 < blob.length <= BLOCK_RECORD


def _record_block(chunks: Mapping[int, Chunk], ordered: list[int], position: int) -> int:
    """Return the end of the block of records starting at `ordered[position]` (or position +
    1): small plain blobs in offset order, none overlapping the one before, with at most
    BLOCK_GAP bytes between two and BLOCK_BYTES from the first's start to the last's end."""
    blob = chunks[ordered[position]].blob
    if not _blockable(blob):
        return position + 1
    start, reached, end = blob.offset, blob.offset + blob.length, position + 1
    while end < len(ordered):
        following = chunks[ordered[end]].blob
        if (not _blockable(following) or following.file != blob.file or following.offset < reached
                or following.offset - reached > BLOCK_GAP or following.offset + following.length - start > BLOCK_BYTES):
            break
        reached, end = following.offset + following.length, end + 1
    return end if end - position >= BLOCK_MIN else position + 1


def _reuse_block(ahead: ReadAhead, jobs: Mapping[int, tuple[Tensor, int]], chunks: Mapping[int, Chunk],
                 numbers: list[int]) -> list[RawData | None]:
    """Return the raw data of each record in `numbers` (a block after its first record, which
    is located first and so parsed) that `locate` would find through a layout parsed before,
    or None where the record must be located alone (any doubt, and every error)."""
    blobs = cast(list[Blob], [chunks[number].blob for number in numbers])  # a block's are `_blockable`
    start, end = blobs[0].offset, blobs[-1].offset + blobs[-1].length
    try:
        if end > ahead.size(blobs[0].file):
            return [None] * len(numbers)
        block = ahead.files.read(blobs[0].file, start, end - start)
    except CheckpointError:
        return [None] * len(numbers)
    import numpy as np

    by_length: dict[int, list[int]] = {}
    for place, blob in enumerate(blobs):
        by_length.setdefault(blob.length, []).append(place)
    buffer = np.frombuffer(block + bytes(8), np.uint8)  # match_block reads whole words past a record's end
    reused: list = [None] * len(numbers)
    for length, places in by_length.items():
        starts = np.array([blobs[place].offset - start for place in places], dtype=np.int64)
        which, crcs, layouts = ahead.records.match_block(buffer, starts, length)
        for place, number, crc, at in zip(places, which.tolist(), crcs.tolist(), starts.tolist()):
            if number >= 0:
                record, data_start = layouts[number]
                reused[place] = (record, at + data_start, crc)
    plain: dict[int, bool] = {}  # by id of a layout's record
    located: list[RawData | None] = []
    for number, blob, found in zip(numbers, blobs, reused):
        if found is None:
            located.append(None)
            continue
        record, data_at, crc = found
        if id(record) not in plain:
            plain[id(record)] = record.is_plain
        if record.dtype != jobs[number][0].dtype or record.shape != chunks[number].sizes or not plain[id(record)]:
            located.append(None)
        else:
            located.append(RawData(blob.file, start + data_at, record.data_length, crc))
    return located


def _after_failure(errors: list[tuple[int, Exception]], number: int) -> bool:
    """True when a walk's `errors` (at most one: the failure of the lowest job number it has
    seen) hold a failure before job `number`: the error raised is the first in job order,
    so locating this job could change nothing. A source whose every record is bad (a sparse
    or zeroed file) fails after about one record per file, holding one exception per walk,
    where keeping every failure held one with its traceback per chunk (10 GB at 3.5M chunks)."""
    return bool(errors) and number > errors[0][0]


def _locate_one(ahead: ReadAhead, tensor: Tensor, index: int) -> RawData | None:
    chunk = tensor.chunks[index]
    if chunk.blob is not None:
        ahead.expect(chunk.blob)
    raw = locate(ahead, tensor, chunk)
    if raw is not None and raw.offset + raw.length > ahead.size(raw.file):
        raise CorruptBlob(
            f"{ahead.path(raw.file)}: {tensor.fqn} chunk at {list(chunk.offsets)} ends at byte "
            f"{raw.offset + raw.length}, past the file's {ahead.size(raw.file)} bytes (truncated file?)"
        )
    return raw


def _locate_coalesced(files: DataFiles, jobs: dict[int, tuple[Tensor, int]], chunks: dict[int, Chunk],
                      found: dict[int, RawData | None], threads: int) -> list[tuple[int, Exception]]:
    """Locate the chunks of `jobs` in a coalesced remote source (filling `found`) from a sample
    of each record layout; return the failures (job number, error).

    The records of one (length, dtype, shape) in a checkpoint torch wrote are one layout
    (`ParsedRecords`): the first of each in file order is located (a walk, as any chunk), and
    the others' data is predicted to lie where the sample's does in its record. A predicted
    record is located for real when a read first reaches its data (`PredictedRecords`), from
    its head and tail fetched in the spans that carry its data: its header costs no GET of
    its own, and no span is fetched twice. Chunks of a class whose sample is not a plain
    record (decoded, a shared safetensors blob, an error) are located as before."""
    classes: dict[tuple, list[int]] = {}
    alone: list[int] = []
    for number, chunk in chunks.items():
        blob = chunk.blob
        if blob is None or blob.transforms or blob.length <= 0:
            alone.append(number)  # located without reading (raw ranges, transforms) or an error
        else:
            classes.setdefault((blob.length, jobs[number][0].dtype, chunk.sizes), []).append(number)

    def extent(number: int) -> tuple[str, int, int]:
        blob = cast(Blob, chunks[number].blob)
        return blob.file, blob.offset, blob.offset + blob.length

    for numbers in classes.values():
        numbers.sort(key=extent)
    # the samples are read from the spans the copies will read them from, fetched and held for
    # them now: the spans of all the records, cut as the copies' are, that hold a sample
    grid = spans.coalesce(extent(number) for numbers in classes.values() for number in numbers)
    held = spans.overlapping(grid, [extent(numbers[0]) for numbers in classes.values()])
    files.expect([(span.file, span.start, span.end) for span, hold in zip(grid, held) if hold])
    failures = _run_jobs(files, jobs, chunks, alone + [numbers[0] for numbers in classes.values()], found, threads)
    later: list[int] = []
    predicted = None
    for numbers in classes.values():
        sample, raw = cast(Blob, chunks[numbers[0]].blob), found.get(numbers[0])
        blobs = [cast(Blob, chunks[number].blob) for number in numbers]
        if (raw is None or raw.file != sample.file or len({(b.file, b.offset) for b in blobs}) < len(blobs)
                or not sample.offset < raw.offset <= sample.offset + sample.length - raw.length):
            later.extend(numbers[1:])
            continue
        predicted = predicted or PredictedRecords.of(files)
        start = raw.offset - sample.offset
        for number, blob in zip(numbers[1:], blobs[1:]):
            if not _inside(files, blob):  # located now: the error names the chunk, as a local run's
                later.append(number)
                continue
            found[number] = RawData(blob.file, blob.offset + start, raw.length, None)
            predicted.add(jobs[number], blob, blob.offset + start, raw.length)
    if predicted is not None:
        predicted.seal()
    return failures + (_run_jobs(files, jobs, chunks, later, found, threads) if later else [])


def _inside(files: DataFiles, blob: Blob) -> bool:
    """True when `blob` lies inside its file (which opens)."""
    try:
        return blob.offset >= 0 and blob.offset + blob.length <= files.size(blob.file)
    except CheckpointError:
        return False


def _run_jobs(files: DataFiles, jobs: dict[int, tuple[Tensor, int]], chunks: dict[int, Chunk], numbers: list[int],
              found: dict[int, RawData | None], threads: int) -> list[tuple[int, Exception]]:
    """Locate the chunks of the jobs `numbers` by walks (`_chunk_tasks`); return the failures."""
    tasks = _chunk_tasks(files, {n: jobs[n] for n in numbers}, {n: chunks[n] for n in numbers}, found)
    return [failure for failure in run_each(tasks, threads) if failure is not None]


WHOLE_RECORD = 64 << 10  # a predicted record with at most this much data is checked from all its bytes


class _Predicted:
    """A record whose data is predicted at `data_at`; `shift` (data's true offset - data_at) once checked."""

    __slots__ = ("tensor", "index", "blob", "data_at", "length", "shift", "number")

    def __init__(self, tensor: Tensor, index: int, blob: Blob, data_at: int, length: int, number: int):
        self.tensor, self.index, self.blob, self.data_at, self.length = tensor, index, blob, data_at, length
        self.shift: int | None = None
        self.number = number

    def edges(self) -> list[tuple[str, int, int]]:
        """What locating the record reads: its head and its tail, or all of it when its data is
        small (a parse's reads of head and tail lie within `SPAN_GAP` and are read as one)."""
        end = self.blob.offset + self.blob.length
        if self.length <= WHOLE_RECORD:
            return [(self.blob.file, self.blob.offset, end)]
        return [(self.blob.file, start, stop) for start, stop in ((self.blob.offset, self.data_at),
                                                                  (self.data_at + self.length, end)) if stop > start]


class PredictedRecords:
    """The records of a remote source whose data `_locate_coalesced` predicted from a sample,
    each located for real (`_locate_one`: the same checks and errors) before the first read
    of its data is served: the DataFiles' `checks`. `ranges` puts each unchecked record's
    head and tail before the first read of its data, so the spans fetched for the copies
    carry them; `offset` checks the record a read falls in (once; reads by other threads
    wait) and moves the read where the record's data truly is. A record that needs decoding
    is refused (UnsupportedFormat): torch's DCP writer never makes one beside plain ones of
    its shape. Thread-safe.

    Example:
        >>> files.checks.offset("__3_0.distcp", 4096, 512)  # the record holding them checked first
        4096
    """

    STRIPES = 64  # locks over the records: a check waits only for one on the same stripe

    def __init__(self, files: DataFiles):
        self.files = files
        self._entries: list[_Predicted] = []
        self._index: dict[str, tuple[list[int], list[_Predicted]]] = {}
        self._locks = [threading.Lock() for _ in range(self.STRIPES)]
        self._local = threading.local()  # `checking`: this thread's reads are a check's own; `records`

    @classmethod
    def of(cls, files: DataFiles) -> "PredictedRecords":
        """The DataFiles' PredictedRecords, made and set as its `checks` when it has none."""
        if not isinstance(files.checks, cls):
            files.checks = cls(files)
        return files.checks

    def add(self, job: tuple[Tensor, int], blob: Blob, data_at: int, length: int) -> None:
        self._entries.append(_Predicted(job[0], job[1], blob, data_at, length, len(self._entries)))

    def seal(self) -> None:
        """Index the records added (call before reads)."""
        by_file: dict[str, list[_Predicted]] = {}
        for entry in sorted(self._entries, key=lambda entry: (entry.blob.file, entry.data_at)):
            by_file.setdefault(entry.blob.file, []).append(entry)
        self._index = {file: ([entry.data_at for entry in entries], entries) for file, entries in by_file.items()}

    def _find(self, relative: str, offset: int, length: int) -> _Predicted | None:
        starts, entries = self._index.get(relative, ([], []))
        position = bisect.bisect_right(starts, offset) - 1
        if position < 0 or length <= 0:
            return None
        entry = entries[position]
        return entry if offset + length <= entry.data_at + entry.length else None

    def ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """Return `ranges` moved where checked records' data is, each unchecked record's head
        and tail before the first range inside its data."""
        out: list[tuple[str, int, int]] = []
        announced: set[int] = set()
        for file, start, end in ranges:
            entry = self._find(file, start, end - start)
            if entry is not None and entry.shift is None and entry.number not in announced:
                announced.add(entry.number)
                out.extend(entry.edges())
            elif entry is not None and entry.shift:
                start, end = start + entry.shift, end + entry.shift
            out.append((file, start, end))
        return out

    def offset(self, relative: str, offset: int, length: int) -> int:
        """Return where to read the `length` bytes at `offset` of `relative`, the record they
        lie in located first (raises what locating it raises)."""
        if getattr(self._local, "checking", False):
            return offset
        entry = self._find(relative, offset, length)
        if entry is None:
            return offset
        if entry.shift is None:
            self._check(entry)
        return offset + cast(int, entry.shift)

    def _check(self, entry: _Predicted) -> None:
        with self._locks[entry.number % self.STRIPES]:
            if entry.shift is not None:
                return
            records = getattr(self._local, "records", None)
            if records is None or records.layouts >= ParsedRecords.MAX_LAYOUTS:
                records = self._local.records = ParsedRecords()
            self._local.checking = True
            try:
                raw = _locate_one(_RecordReader(self.files, entry, records), entry.tensor, entry.index)
            finally:
                self._local.checking = False
            if raw is None or raw.file != entry.blob.file or raw.length != entry.length:
                chunk = entry.tensor.chunks[entry.index]
                raise UnsupportedFormat(
                    f"{self.files.path(entry.blob.file)}: {entry.tensor.fqn} chunk at {list(chunk.offsets)} is "
                    "stored unlike the other records of its shape (it needs decoding); copy the checkpoint "
                    "from object storage to a local directory and read it there")
            entry.shift = raw.offset - entry.data_at


class _RecordReader(ReadAhead):
    """A ReadAhead of one predicted record: its head and tail read whole, once each (the
    ranges `PredictedRecords.ranges` gave the spans, so each is served and freed as
    counted), the parse's reads served from them; any other read goes to the files."""

    def __init__(self, files: DataFiles, entry: _Predicted, records: ParsedRecords):
        super().__init__(files, entry.blob.file)
        self.records = records
        self._parts = [(start, files.read(file, start, end - start)) for file, start, end in entry.edges()]

    def expect(self, blob: Blob) -> None:
        pass  # no walk: nothing to let go

    def read(self, relative: str, offset: int, length: int) -> bytes:
        if relative == self.relative:
            for start, data in self._parts:
                if start <= offset and offset + length <= start + len(data):
                    return data[offset - start:offset - start + length]
        return self.files.read(relative, offset, length)


def run_each(tasks: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """Return the results of `tasks`, run `threads` at a time, in order (the seam tests count
    locate's tasks through)."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(tasks)))) as pool:
        return list(pool.map(lambda task: task(), tasks))


