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

import operator
from collections import defaultdict
from dataclasses import dataclass, field

from ckpttool import dtypes
from ckpttool.checkpoint import Blob, Checkpoint, Chunk, Tensor, is_raw_range, paused_gc
from ckpttool.dcp.blobs import DataFiles, is_safetensors_blob, safetensors_header
from ckpttool.errors import CheckpointError, InvalidCheckpoint, UnsafeDataFile
from ckpttool.geometry import coverage, find_overlaps, in_bounds
from ckpttool.safepaths import check_data_file, containment_root, safe_relative_path
from ckpttool.formats.dcp import METADATA_FILENAME, RANK_METADATA_PATTERN

ERROR, WARNING, INFO = "error", "warning", "info"
# files a DCP directory holds besides data: torch's metadata, Lightning's meta.pt, Megatron's
# metadata.json and common.pt (never "unreferenced")
FRAMEWORK_FILES = frozenset({METADATA_FILENAME, "meta.pt", "metadata.json", "common.pt"})
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
        fqn = note.split(":", 1)[0]
        report.add(ERROR, "unknown-dtype", f"{checkpoint.metadata_file}: {note}; this build cannot size or read it", fqn=fqn)
    with paused_gc():
        report.sizes = _check_files(checkpoint, report, follow_symlinks)
        _check_blobs(checkpoint, report.sizes, report)
        for tensor in checkpoint.tensors.values():
            _check_geometry(tensor, report)
    return report


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


def _check_files(checkpoint: Checkpoint, report: Integrity, follow_symlinks: bool) -> dict[str, int]:
    """Stat each referenced file once; report unsafe paths, special files, symlinks leaving
    the checkpoint, missing and unreferenced files."""
    inside = None if follow_symlinks else containment_root(checkpoint.path)
    sizes: dict[str, int] = {}
    users: dict[str, str] = {}
    for entry in checkpoint.entries():
        blobs = [c.blob for c in entry.chunks] if isinstance(entry, Tensor) else [entry.blob]
        for blob in blobs:
            if blob is not None:
                users.setdefault(blob.file, entry.fqn)
    referenced: set[str] = set()  # safe relative paths, as the unreferenced-file scan names files
    for name, fqn in sorted(users.items()):
        try:
            relative = safe_relative_path(name)
            referenced.add(str(relative))
            path = checkpoint.path / relative
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


def _check_blobs(checkpoint: Checkpoint, sizes: dict[str, int], report: Integrity) -> None:
    """Every chunk has a blob inside its file, large enough for its elements; no two overlap."""
    # per file: (start, end, what, (tensor, chunk) of an untransformed tensor blob or None)
    by_file: dict[str, list[tuple[int, int, str, tuple[Tensor, Chunk] | None]]] = defaultdict(list)
    shared: set[tuple[str, int, int]] = set()  # raw ranges several tensors may name (tied weights share a storage)
    for tensor in checkpoint.tensors.values():
        itemsize = dtypes.ITEMSIZE.get(tensor.dtype)
        for chunk in tensor.chunks:
            where = f"{tensor.fqn} chunk at {list(chunk.offsets)}"
            if chunk.blob is None:
                report.add(ERROR, "chunk-without-storage", f"{checkpoint.metadata_file}: {where} has no storage entry (no file holds its bytes)", fqn=tensor.fqn)
                continue
            owner = None if chunk.blob.transforms else (tensor, chunk)
            _check_blob_range(chunk.blob, where, tensor.fqn, sizes, report, by_file, owner)
            raw = is_raw_range(chunk.blob)
            if raw:
                shared.add((chunk.blob.file, chunk.blob.offset, chunk.blob.offset + chunk.blob.length))
            if itemsize and (raw or not chunk.blob.transforms) and min(chunk.sizes, default=1) >= 0:
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
        for (start, end, fqn, _), (next_start, next_end, next_fqn, _) in zip(ranges, ranges[1:]):
            if next_start < end and not ((name, start, end) in shared and (name, next_start, next_end) in shared):
                report.add(ERROR, "blob-overlap", f"{name}: bytes {next_start}..{end} are claimed by both {fqn} and {next_fqn}", name, next_fqn)
    for fqn, blob in checkpoint.orphan_blobs:
        report.add(WARNING, "orphan-storage", f"{checkpoint.metadata_file}: storage entry for {fqn} in {blob.file} matches no tensor chunk", blob.file, fqn)


_range_order = operator.itemgetter(0, 1, 2)  # never compare the (tensor, chunk) owners


def _check_blob_range(blob: Blob, where: str, fqn: str, sizes: dict[str, int], report: Integrity,
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
                               report: Integrity) -> list:
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
