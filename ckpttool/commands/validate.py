"""`validate`: is a checkpoint whole and consistent? Collects every problem, not just the first.

Without `deep`, only `.metadata` and file sizes are read, so it runs in seconds on checkpoints
of any size. With `deep`, every blob is decoded and its checksum, dtype and shape checked.

Example:
    >>> report = validate("runs/x/step-00000020", deep=True)
    >>> report.valid, [p.message for p in report.errors]
    (True, [])
"""

from __future__ import annotations

import operator
import os
import stat
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool import dtypes
from ckpttool.dcp.blobs import (
    DataFiles,
    blob_bytes,
    decode_object,
    is_safetensors_blob,
    iter_blocks,
    locate,
    read_chunk,
    record_problems,
    safe_relative_path,
    safetensors_header,
)
from ckpttool.dcp.metadata import (
    METADATA_FILENAME,
    RANK_METADATA_PATTERN,
    Blob,
    Checkpoint,
    Chunk,
    Tensor,
    paused_gc,
    read_checkpoint,
)
from ckpttool.errors import CheckpointError, NotACheckpoint
from ckpttool.layout import coverage, find_overlaps, in_bounds

ERROR, WARNING, INFO = "error", "warning", "info"
MAX_PROBLEMS_PER_TENSOR = 20  # overlap pairs listed per tensor before summarising
DEEP_BLOCK = 16 << 20  # bytes --deep reads, checksums and scans at a time (a multiple of every itemsize)


@dataclass(frozen=True)
class Problem:
    """One finding: `code` is stable for scripts (see README), `message` is for people."""

    severity: str
    code: str
    message: str
    file: str | None = None
    fqn: str | None = None


@dataclass(frozen=True)
class Numerics:
    """NaN/Inf counts of one floating tensor, found by `--deep`."""

    fqn: str
    nan: int
    inf: int


@dataclass
class ValidationReport:
    path: Path
    deep: bool
    problems: list[Problem] = field(default_factory=list)
    numerics: list[Numerics] = field(default_factory=list)
    tensors: int = 0
    chunks: int = 0
    objects: int = 0
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def valid(self) -> bool:
        return not self.errors

    def add(self, severity: str, code: str, message: str, file: str | None = None, fqn: str | None = None) -> None:
        self.problems.append(Problem(severity, code, message, file, fqn))


def validate(src: str | os.PathLike, deep: bool = False) -> ValidationReport:
    """Return every problem found in the checkpoint at `src` (never raises for a bad one).

    Raises NotACheckpoint only when `src` does not exist or is not a directory (a usage error).
    """
    started = time.perf_counter()
    root = Path(src)
    if not root.is_dir():
        raise NotACheckpoint(f"{root}: no such directory" if not root.exists() else f"{root}: not a directory")
    report = ValidationReport(path=root, deep=deep)
    try:
        checkpoint = read_checkpoint(root)
    except CheckpointError as error:
        code = {"UnsafeMetadata": "metadata-unsafe", "NotACheckpoint": "no-metadata"}.get(
            type(error).__name__, "metadata-unreadable"
        )
        report.add(ERROR, code, str(error), file=METADATA_FILENAME)
        report.seconds = time.perf_counter() - started
        return report
    report.tensors, report.objects = len(checkpoint.tensors), len(checkpoint.objects)
    report.chunks = sum(len(t.chunks) for t in checkpoint.tensors.values())
    for note in checkpoint.notes:
        fqn = note.split(":", 1)[0]
        report.add(ERROR, "unknown-dtype", f"{checkpoint.metadata_file}: {note}; this build cannot size or read it", fqn=fqn)
    with paused_gc():
        sizes = _check_files(checkpoint, report)
        _check_blobs(checkpoint, sizes, report)
        for tensor in checkpoint.tensors.values():
            _check_geometry(tensor, report)
    if deep:
        _check_bytes(checkpoint, sizes, report)
    report.seconds = time.perf_counter() - started
    return report


def _check_files(checkpoint: Checkpoint, report: ValidationReport) -> dict[str, int]:
    """Stat each referenced file once; report unsafe paths, missing and unreferenced files."""
    sizes: dict[str, int] = {}
    users: dict[str, str] = {}
    for entry in checkpoint.entries():
        blobs = [c.blob for c in entry.chunks] if isinstance(entry, Tensor) else [entry.blob]
        for blob in blobs:
            if blob is not None:
                users.setdefault(blob.file, entry.fqn)
    for name, fqn in sorted(users.items()):
        try:
            path = checkpoint.path / safe_relative_path(name)
        except CheckpointError:
            report.add(ERROR, "path-traversal", f"{name}: path of {fqn} leaves the checkpoint directory (absolute or `..`); not read", name, fqn)
            continue
        try:
            status = path.stat()
            if not stat.S_ISREG(status.st_mode):
                report.add(ERROR, "missing-file", f"{path}: referenced by {fqn} but is not a regular file", name, fqn)
                continue
            sizes[name] = status.st_size
        except FileNotFoundError:
            report.add(ERROR, "missing-file", f"{path}: referenced by {fqn} (and maybe others) but missing; was the save interrupted or the copy partial?", name, fqn)
        except OSError as error:
            report.add(ERROR, "unreadable-file", f"{path}: cannot stat ({error})", name, fqn)
    report.files = len(users)
    referenced = {str(safe_relative_path(n)) for n in sizes}
    for path in sorted(checkpoint.path.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(checkpoint.path).as_posix()
        if relative == METADATA_FILENAME or RANK_METADATA_PATTERN.match(relative) or relative in referenced:
            continue
        report.add(WARNING, "unreferenced-file", f"{path}: not referenced by the metadata (left over from another save?)", relative)
    return sizes


def _check_blobs(checkpoint: Checkpoint, sizes: dict[str, int], report: ValidationReport) -> None:
    """Every chunk has a blob inside its file, large enough for its elements; no two overlap."""
    # per file: (start, end, what, (tensor, chunk) of an untransformed tensor blob or None)
    by_file: dict[str, list[tuple[int, int, str, tuple[Tensor, Chunk] | None]]] = defaultdict(list)
    for tensor in checkpoint.tensors.values():
        itemsize = dtypes.ITEMSIZE.get(tensor.dtype)
        for chunk in tensor.chunks:
            where = f"{tensor.fqn} chunk at {list(chunk.offsets)}"
            if chunk.blob is None:
                report.add(ERROR, "chunk-without-storage", f"{checkpoint.metadata_file}: {where} has no storage entry (no file holds its bytes)", fqn=tensor.fqn)
                continue
            owner = None if chunk.blob.transforms else (tensor, chunk)
            _check_blob_range(chunk.blob, where, tensor.fqn, sizes, report, by_file, owner)
            if itemsize and not chunk.blob.transforms and min(chunk.sizes, default=1) >= 0:
                needed = chunk.numel * itemsize
                if needed > chunk.blob.length:
                    report.add(ERROR, "size-mismatch", f"{chunk.blob.file}: {where} claims {chunk.numel} {tensor.dtype} elements ({needed} bytes) but its blob is only {chunk.blob.length} bytes", chunk.blob.file, tensor.fqn)
    for obj in checkpoint.objects.values():
        if obj.blob is None:
            report.add(ERROR, "object-without-storage", f"{checkpoint.metadata_file}: {obj.fqn} has no storage entry", fqn=obj.fqn)
        else:
            _check_blob_range(obj.blob, obj.fqn, obj.fqn, sizes, report, by_file, None)
    for name, ranges in by_file.items():
        ranges.sort(key=_range_order)
        if any(a[0] == b[0] and a[3] and b[3] for a, b in zip(ranges, ranges[1:])):
            ranges = _resolve_safetensors_blobs(checkpoint, name, ranges, sizes[name], report)
        for (start, end, fqn, _), (next_start, _, next_fqn, _) in zip(ranges, ranges[1:]):
            if next_start < end:
                report.add(ERROR, "blob-overlap", f"{name}: bytes {next_start}..{end} are claimed by both {fqn} and {next_fqn}", name, next_fqn)
    for fqn, blob in checkpoint.orphan_blobs:
        report.add(WARNING, "orphan-storage", f"{checkpoint.metadata_file}: storage entry for {fqn} in {blob.file} matches no tensor chunk", blob.file, fqn)


_range_order = operator.itemgetter(0, 1, 2)  # never compare the (tensor, chunk) owners


def _check_blob_range(blob: Blob, where: str, fqn: str, sizes: dict[str, int], report: ValidationReport,
                      by_file: dict, owner: tuple[Tensor, Chunk] | None) -> None:
    """Record the blob's byte range for the overlap sweep, or report why it is bad."""
    if blob.offset < 0 or blob.length < 0:
        report.add(ERROR, "bad-range", f"{blob.file}: {where} has a negative offset or length", blob.file, fqn)
        return
    size = sizes.get(blob.file)
    if size is None:
        return  # missing or unsafe file, already reported
    if blob.offset + blob.length > size:
        report.add(ERROR, "beyond-eof", f"{blob.file}: {where} spans bytes {blob.offset}..{blob.offset + blob.length} but the file has {size} bytes (truncated?)", blob.file, fqn)
        return
    by_file[blob.file].append((blob.offset, blob.offset + blob.length, where, owner))


def _resolve_safetensors_blobs(checkpoint: Checkpoint, name: str, ranges: list, size: int,
                               report: ValidationReport) -> list:
    """Return `ranges` (sorted) with the tensors of each safetensors blob at their real ranges.

    With `serialization_format=SAFETENSORS` torch records every tensor of a file at the
    blob's start (length = its element bytes); the safetensors header says where each really
    is. Only starts shared by several tensors are looked at, so torch_save checkpoints cost
    no extra reads. Shared starts that are not safetensors blobs stay as they are (the sweep
    reports them as overlaps).
    """
    groups: dict[int, list[tuple]] = defaultdict(list)
    for entry in ranges:
        if entry[3] is not None:
            groups[entry[0]].append(entry)
    resolved: list[tuple] = []
    replaced: set[int] = set()
    with DataFiles(checkpoint.path) as files:
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


def _check_geometry(tensor: Tensor, report: ValidationReport) -> None:
    """Chunks lie inside the tensor, do not overlap, and cover it completely."""
    boxes = []
    for chunk in tensor.chunks:
        if not in_bounds(chunk.offsets, chunk.sizes, tensor.shape):
            report.add(ERROR, "chunk-out-of-bounds", f"{tensor.fqn}: chunk at {list(chunk.offsets)} size {list(chunk.sizes)} does not fit shape {list(tensor.shape)}", fqn=tensor.fqn)
        else:
            boxes.append((chunk.offsets, chunk.sizes))
    pairs = find_overlaps(boxes, limit=MAX_PROBLEMS_PER_TENSOR)
    for i, j in pairs:
        report.add(ERROR, "overlap", f"{tensor.fqn}: chunks at {list(boxes[i][0])} and {list(boxes[j][0])} overlap", fqn=tensor.fqn)
    if pairs or len(boxes) < len(tensor.chunks):
        return
    found = coverage(boxes, tensor.shape)
    if not found.complete:
        detail = ", ".join(f"rows {a}..{b}" for a, b in found.missing_rows[:5]) or "see --json chunks"
        report.add(ERROR, "gap", f"{tensor.fqn}: chunks cover {found.covered} of {found.total} elements ({detail} missing)", fqn=tensor.fqn)


def _check_record_entries(files: DataFiles, blob: Blob, where: str, fqn: str, report: ValidationReport,
                          skip_largest: bool) -> None:
    """Report every entry of a torch.save record (data.pkl, byteorder, ...) whose CRC-32 is
    off, and damage to the record's zip structure that torch's reader would refuse.

    Not for zstd-transformed blobs or safetensors blobs (no zip record to check)."""
    try:
        if blob.transforms or is_safetensors_blob(files, blob):
            return
        problems = record_problems(files, blob, where, skip_largest)
    except CheckpointError as error:
        report.add(ERROR, "corrupt-blob", str(error), blob.file, fqn)
        return
    for kind, message in problems:
        report.add(ERROR, "checksum" if kind == "checksum" else "corrupt-blob", message, blob.file, fqn)


def _check_bytes(checkpoint: Checkpoint, sizes: dict[str, int], report: ValidationReport) -> None:
    """Decode every blob: record structure, dtype/shape, CRC-32, NaN/Inf counts.

    Needs no torch for torch_save and safetensors blobs of plain objects and tensors; torch
    is imported only to decode what must be decoded (zstd, strided records, torch objects).
    """
    from ckpttool import numerics  # numpy: only --deep pays for its import

    broken_files = {p.file for p in report.errors if p.file}
    view = memoryview(bytearray(DEEP_BLOCK))  # one block buffer, refilled in place
    with DataFiles(checkpoint.path) as files:
        for tensor in checkpoint.tensors.values():
            if tensor.dtype not in dtypes.ITEMSIZE:
                continue
            nan = inf = 0
            for chunk in tensor.chunks:
                if chunk.blob is None or chunk.blob.file not in sizes or chunk.blob.file in broken_files:
                    continue
                where = f"{chunk.blob.file}: {tensor.fqn} chunk at {list(chunk.offsets)}"
                _check_record_entries(files, chunk.blob, where, tensor.fqn, report, skip_largest=True)
                try:
                    raw = locate(files, tensor, chunk)
                    blocks = iter_blocks(files, raw, DEEP_BLOCK, view) if raw else [read_chunk(files, tensor, chunk)]
                    crc = 0
                    for block in blocks:
                        crc = zlib.crc32(block, crc)
                        report.bytes_read += len(block)
                        if tensor.dtype in numerics.SUPPORTED and block:
                            block_nan, block_inf = numerics.count_non_finite(block, tensor.dtype)
                            nan, inf = nan + block_nan, inf + block_inf
                except CheckpointError as error:
                    report.add(ERROR, "corrupt-blob", str(error), chunk.blob.file, tensor.fqn)
                    continue
                # torch can be told not to record CRCs; a stored 0 means "not recorded"
                if raw and raw.crc32 and crc != raw.crc32:
                    report.add(ERROR, "checksum", f"{where}: CRC-32 of the data is {crc:08x}, the record says {raw.crc32:08x} (bytes changed on disk)", chunk.blob.file, tensor.fqn)
            if nan or inf:
                report.numerics.append(Numerics(tensor.fqn, nan, inf))
                report.add(INFO, "non-finite", f"{tensor.fqn}: {nan} NaN and {inf} Inf values", fqn=tensor.fqn)
        for obj in checkpoint.objects.values():
            if obj.blob is None or obj.blob.file not in sizes or obj.blob.file in broken_files:
                continue
            where = f"{obj.blob.file}: {obj.fqn}"
            _check_record_entries(files, obj.blob, where, obj.fqn, report, skip_largest=False)
            try:
                decode_object(blob_bytes(files, obj.blob, where), where)
                report.bytes_read += obj.blob.length
            except CheckpointError as error:
                report.add(ERROR, "corrupt-blob", str(error), obj.blob.file, obj.fqn)
