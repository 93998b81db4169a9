"""The numbers inside a checkpoint's floating tensors: NaN and Inf (and the first of them),
all-zero tensors, subnormals and max |x| (`validate --numerics`, `latest --numerics`).

Every chunk's bytes are read by range and scanned in blocks of SCAN_BLOCK bytes with numpy
(`core.numerics.scan_block`, classified from the bits: no torch import), never a whole tensor
in memory. The chunks are located as `validate --deep` locates them (`dcp.blobs.locate`: the
raw bytes of a torch.save record, a safetensors header's range, a raw range of a `.pt`,
Megatron or DeepSpeed file), one task per data file walking its records in offset order;
their bytes are then scanned in pieces of at most SCAN_PIECE bytes, `threads` at a time, in
file order. Blobs that must be decoded first (zstd, strided records) are decoded whole, one
chunk at a time per thread, as `--deep` does.

Example:
    >>> figures = scan_numbers(readers.open_checkpoint("runs/x/step-00000200"))
    >>> [(n.fqn, n.nan, n.first_bad) for n in figures if n.nan or n.inf]
    [('model.layers.0.attn.wq.weight', 1, 4099)]
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ckpttool.core import numerics
from ckpttool.core.checkpoint import Checkpoint, Chunk, Tensor
from ckpttool.core.errors import CheckpointError, CorruptBlob
from ckpttool.dcp.blobs import DataFiles, RawData, ReadAhead, locate, read_chunk
from ckpttool.store.io import DEFAULT_THREADS, thread_buffer

# bytes read and scanned at a time: a multiple of every itemsize, and small enough that the
# block and its work arrays stay in cache across scan_block's passes (16 MiB ran 2x slower)
SCAN_BLOCK = 4 << 20
SCAN_PIECE = 64 << 20  # bytes of one chunk one task scans: a large chunk is shared among the threads
MAP_AT_LEAST = 1 << 20  # pieces of local files this large are mapped, not read (smaller: a map costs more than a copy)

OnError = Callable[[str, CheckpointError], None]


@dataclass(frozen=True)
class TensorNumbers:
    """The figures of one floating tensor.

    `first_bad` is the flat row-major index, in the whole tensor, of its first NaN or Inf
    (None: none), and `file` the data file holding it. `subnormal` counts non-zero elements
    below `torch.finfo(dtype).tiny` in magnitude; `max_abs` is the largest finite |x| (0.0
    when none); `all_zero` is True when every element is +0 or -0 (False for an empty tensor).
    """

    fqn: str
    dtype: str
    numel: int
    nan: int
    inf: int
    first_bad: int | None
    all_zero: bool
    subnormal: int
    max_abs: float
    file: str | None = None

    @property
    def bad(self) -> bool:
        """True when the tensor holds a NaN or an Inf."""
        return bool(self.nan or self.inf)

    @property
    def subnormal_share(self) -> float:
        """The share of the elements that are subnormal (0.0 for an empty tensor)."""
        return self.subnormal / self.numel if self.numel else 0.0


class Tally:
    """One tensor's figures, added chunk by chunk and block by block (in any order: the first
    bad element is the least global index found). Not thread-safe: one per tensor, fed from
    one thread, or merged with `merge`."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor
        self.nan = self.inf = self.zero = self.subnormal = 0
        self.max_abs = 0.0
        self.first_bad: int | None = None
        self.file: str | None = None
        self.scanned = 0  # elements added

    def add(self, chunk: Chunk, start: int, found: numerics.BlockNumbers) -> None:
        """Add the figures of a block of `chunk` whose first element is the chunk's `start`-th."""
        self.scanned += found.elements
        self.nan += found.nan
        self.inf += found.inf
        self.zero += found.zero
        self.subnormal += found.subnormal
        self.max_abs = max(self.max_abs, found.max_abs)
        if found.first_bad is not None:
            index = global_index(self.tensor.shape, chunk, start + found.first_bad)
            if self.first_bad is None or index < self.first_bad:
                self.first_bad = index
                self.file = chunk.blob.file if chunk.blob is not None else None

    def merge(self, other: Tally) -> None:
        """Add another tally of the same tensor (other chunks, or other pieces of them)."""
        self.scanned += other.scanned
        self.nan, self.inf = self.nan + other.nan, self.inf + other.inf
        self.zero, self.subnormal = self.zero + other.zero, self.subnormal + other.subnormal
        self.max_abs = max(self.max_abs, other.max_abs)
        if other.first_bad is not None and (self.first_bad is None or other.first_bad < self.first_bad):
            self.first_bad, self.file = other.first_bad, other.file

    def result(self) -> TensorNumbers:
        tensor = self.tensor
        numel = tensor.numel
        return TensorNumbers(tensor.fqn, tensor.dtype, numel, self.nan, self.inf, self.first_bad,
                             numel > 0 and self.zero == numel, self.subnormal, self.max_abs, self.file)


def global_index(shape: tuple[int, ...], chunk: Chunk, local: int) -> int:
    """Return the flat row-major index in a tensor of `shape` of the `local`-th element (flat,
    row-major) of `chunk`. Chunk order is global order: the least local index of a chunk's
    bad elements is also their least global index.

    Example:
        >>> global_index((4, 6), Chunk((2, 3), (2, 3), None), 4)   # chunk element [1, 1]
        22
    """
    # unravel `local` over the chunk's sizes, shift by its offsets, ravel over the tensor's shape
    coordinates = []
    for extent in reversed(chunk.sizes):
        local, coordinate = divmod(local, extent) if extent else (local, 0)
        coordinates.append(coordinate)
    coordinates.reverse()
    index = 0
    for size, offset, coordinate in zip(shape, chunk.offsets, coordinates):
        index = index * size + offset + coordinate
    return index


def floating(checkpoint: Checkpoint) -> list[str]:
    """Return the fqns of the checkpoint's tensors `scan_numbers` reads (floating dtypes), sorted."""
    return [fqn for fqn, tensor in checkpoint.tensors.items() if tensor.dtype in numerics.SCANNED]


@dataclass(frozen=True)
class _Piece:
    """Elements `start`..`stop` of one chunk to scan: raw bytes at `raw` (None: decode the blob)."""

    fqn: str
    chunk: int
    start: int
    stop: int
    raw: RawData | None


def scan_numbers(checkpoint: Checkpoint, fqns: Iterable[str] | None = None, *, follow_symlinks: bool = False,
                 threads: int = DEFAULT_THREADS, stop_at_first_bad: bool = False,
                 on_error: OnError | None = None) -> list[TensorNumbers]:
    """Return the figures of the floating tensors `fqns` (None: every floating tensor) in fqn
    order, their bytes streamed by range, `threads` at a time.

    Raises the CheckpointError of the first chunk that cannot be read or disagrees with the
    metadata (in fqn and chunk order), unless `on_error(fqn, error)` is given: then each
    such tensor is reported there (its first error) and left out. An fqn the checkpoint does
    not hold raises KeyError, a tensor whose dtype is not floating ValueError.

    With `stop_at_first_bad`, scanning stops at the first block holding a NaN or Inf: the
    list then holds the tensors scanned whole and the bad ones, whose counts are those of the
    blocks scanned before the stop (at least one bad element; `first_bad` the least index
    found, not necessarily the tensor's first); the other tensors are absent.

    Example:
        >>> bad = [n for n in scan_numbers(checkpoint, stop_at_first_bad=True) if n.bad]
    """
    names = floating(checkpoint) if fqns is None else sorted(set(fqns))
    tensors = [checkpoint.tensors[fqn] for fqn in names]
    for tensor in tensors:
        if tensor.dtype not in numerics.SCANNED:
            raise ValueError(f"{tensor.fqn}: {tensor.dtype} is not a floating dtype scan_numbers reads")
    stop = threading.Event()
    tallies: dict[str, list[Tally]] = defaultdict(list)
    errors: dict[tuple[str, int], CheckpointError] = {}
    lock = threading.Lock()
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        pieces = _locate(files, tensors, threads, errors)
        by_fqn = {tensor.fqn: tensor for tensor in tensors}

        def scan(batch: list[_Piece]) -> None:
            found: dict[str, Tally] = {}
            try:
                for piece in batch:
                    if stop.is_set():
                        return
                    tensor = by_fqn[piece.fqn]
                    tally = found.setdefault(piece.fqn, Tally(tensor))
                    try:
                        _scan_piece(files, tensor, piece, tally, stop if stop_at_first_bad else None)
                    except CheckpointError as error:
                        with lock:
                            errors.setdefault((piece.fqn, piece.chunk), error)
            finally:
                with lock:
                    for fqn, tally in found.items():
                        tallies[fqn].append(tally)

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for future in [pool.submit(scan, batch) for batch in _batches(pieces, threads)]:
                future.result()
    failed = _failures(errors, on_error)
    results = []
    for tensor in tensors:
        if tensor.fqn in failed or (stop.is_set() and tensor.fqn not in tallies):
            continue
        total = Tally(tensor)
        for tally in tallies.get(tensor.fqn, ()):
            total.merge(tally)
        results.append(total.result())
    if stop.is_set():  # tensors started but not finished before the stop: only the bad ones stay
        scanned = {fqn: sum(tally.scanned for tally in found) for fqn, found in tallies.items()}
        results = [r for r in results if r.bad or scanned.get(r.fqn) == r.numel]
    return results


def _failures(errors: dict[tuple[str, int], CheckpointError], on_error: OnError | None) -> set[str]:
    """Raise the first error (fqn, chunk order) or, with `on_error`, report the first of each
    tensor there; return the fqns that failed."""
    failed: dict[str, CheckpointError] = {}
    for (fqn, _), error in sorted(errors.items(), key=lambda item: item[0]):
        failed.setdefault(fqn, error)
    if failed and on_error is None:
        raise next(iter(failed.values()))
    for fqn, error in failed.items():
        assert on_error is not None
        on_error(fqn, error)
    return set(failed)


def _locate(files: DataFiles, tensors: list[Tensor], threads: int,
            errors: dict[tuple[str, int], CheckpointError]) -> list[_Piece]:
    """Return the pieces to scan, in (file, offset) order: each data file's records located
    by one task walking them in offset order through a ReadAhead (header reads only)."""
    by_file: dict[str, list[tuple[int, Tensor, int, Chunk]]] = defaultdict(list)
    for tensor in tensors:
        for index, chunk in enumerate(tensor.chunks):
            if chunk.numel == 0:
                continue
            if chunk.blob is None:
                errors[(tensor.fqn, index)] = CorruptBlob(
                    f"{files.root}: {tensor.fqn} chunk at {list(chunk.offsets)}: the metadata has no storage entry for this chunk")
                continue
            by_file[chunk.blob.file].append((chunk.blob.offset, tensor, index, chunk))

    def walk(name: str) -> list[tuple[int, _Piece]]:
        ahead = ReadAhead(files, name)
        found = []
        for _, tensor, index, chunk in sorted(by_file[name], key=lambda item: (item[0], item[1].fqn, item[2])):
            assert chunk.blob is not None
            ahead.expect(chunk.blob)
            try:
                raw = locate(ahead, tensor, chunk)
            except CheckpointError as error:
                errors[(tensor.fqn, index)] = error
                continue
            if raw is None:
                found.append((chunk.blob.offset, _Piece(tensor.fqn, index, 0, chunk.numel, None)))
                continue
            step = max(1, SCAN_PIECE // tensor.itemsize)
            for start in range(0, chunk.numel, step):
                stop = min(chunk.numel, start + step)
                part = RawData(raw.file, raw.offset + start * tensor.itemsize, (stop - start) * tensor.itemsize)
                found.append((part.offset, _Piece(tensor.fqn, index, start, stop, part)))
        return found

    names = sorted(by_file)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names) or 1))) as pool:
        walked = list(pool.map(walk, names))
    return [piece for found in walked for _, piece in sorted(found, key=lambda item: item[0])]


def _batches(pieces: list[_Piece], threads: int) -> Iterator[list[_Piece]]:
    """Yield the pieces in file order, in consecutive batches of about SCAN_PIECE bytes (many
    small chunks make one task; a task is never more than one large piece)."""
    batch: list[_Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += (piece.stop - piece.start) if piece.raw is None else piece.raw.length
        if size >= SCAN_PIECE:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _scan_piece(files: DataFiles, tensor: Tensor, piece: _Piece, tally: Tally, stop: threading.Event | None) -> None:
    """Add the figures of one piece to `tally`, a block at a time; set `stop` at a bad block."""
    chunk = tensor.chunks[piece.chunk]
    itemsize = tensor.itemsize
    work = thread_buffer(2 * SCAN_BLOCK, "numbers-work")
    start = piece.start
    for block in _blocks(files, tensor, chunk, piece):
        found = numerics.scan_block(block, tensor.dtype, work)
        tally.add(chunk, start, found)
        start += len(block) // itemsize
        if stop is not None and found.first_bad is not None:
            stop.set()
            return
        if stop is not None and stop.is_set():
            return


def _blocks(files: DataFiles, tensor: Tensor, chunk: Chunk, piece: _Piece) -> Iterator[memoryview]:
    """Yield the piece's bytes in blocks of at most SCAN_BLOCK (each valid until the next):
    of a local file, mapped (`_mapped`); else read into this thread's buffer."""
    if piece.raw is None:
        data = memoryview(read_chunk(files, tensor, chunk))
        for begin in range(0, len(data), SCAN_BLOCK):
            yield data[begin:begin + SCAN_BLOCK]
        return
    raw = piece.raw
    if files.local and raw.length >= MAP_AT_LEAST:
        yield from _mapped(files, raw)
        return
    buffer = memoryview(thread_buffer(SCAN_BLOCK, "numbers-read"))[:SCAN_BLOCK]
    yield from files.pieces(raw.file, raw.offset, raw.length, buffer)


def _mapped(files: DataFiles, raw: RawData) -> Iterator[memoryview]:
    """Yield the bytes of `raw` in blocks of at most SCAN_BLOCK, each from a read-only map of
    its own range: the page cache's pages scanned in place, not copied into a buffer (the copy
    cost as much as the scan), and one block mapped at a time per thread (the process's RSS
    stays a few blocks). The range is checked against the file's size first (CorruptBlob). A
    file truncated by another process while mapped faults (SIGBUS), as with any mapped reader."""
    fd = files.fd(raw.file)
    if raw.offset < 0 or raw.offset + raw.length > files.size(raw.file):
        files.read(raw.file, raw.offset, raw.length)  # raises CorruptBlob naming the file
    end = raw.offset + raw.length
    for begin in range(raw.offset, end, SCAN_BLOCK):
        start = begin - begin % mmap.ALLOCATIONGRANULARITY
        stop = min(begin + SCAN_BLOCK, end)
        mapped = mmap.mmap(fd, stop - start, access=mmap.ACCESS_READ, offset=start)
        view = memoryview(mapped)
        try:
            block = view[begin - start:]
            try:
                yield block
            finally:
                block.release()
        finally:
            view.release()
            mapped.close()
