"""`validate`: is a checkpoint whole and consistent? Collects every problem, not just the first.

Without `deep`, only `.metadata` and file sizes are read, so it runs in seconds on checkpoints
of any size. With `deep`, every blob is decoded and its checksum, dtype and shape checked.
With `numerics`, every floating tensor's elements are scanned (`check.numbers`): a NaN or Inf
is an error naming the tensor and its first bad element; all-zero tensors, subnormals and
max |x| are reported. With both, the bytes are read once.

Example:
    >>> report = validate("runs/x/step-00000020", deep=True)
    >>> report.valid, [p.message for p in report.errors]
    (True, [])
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Blob, Checkpoint, Tensor, as_path
from ckpttool.core.errors import CheckpointError, NotACheckpoint
from ckpttool.check.integrity import ERROR, INFO, WARNING, Problem
from ckpttool.source_options import SourceOptions
from ckpttool.formats.dcp import METADATA_FILENAME

if TYPE_CHECKING:
    from ckpttool.check.numbers import TensorNumbers
    from ckpttool.dcp.blobs import DataFiles

DEEP_BLOCK = 16 << 20  # bytes --deep reads, checksums and scans at a time (a multiple of every itemsize)


@dataclass(frozen=True)
class Numerics:
    """NaN/Inf counts of one floating tensor, found by `--deep`."""

    fqn: str
    nan: int
    inf: int


@dataclass
class ValidationReport:
    """Every problem `validate` found, what it counted, and (--deep) the NaN/Inf counts."""

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
    manifest: Any = None  # --manifest: the commands.manifest.ManifestCheck, when the check ran
    numbers: list[TensorNumbers] | None = None  # --numerics: each floating tensor's figures, fqn order

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


def validate(src: str | os.PathLike, deep: bool = False, source: SourceOptions = SourceOptions(),
             manifest: str | os.PathLike | None = None, numerics: bool = False,
             threads: int | None = None) -> ValidationReport:
    """Return every problem found in the checkpoint at `src` (never raises for a bad one).
    Data files that are symlinks leaving the checkpoint are a problem unless `source.follow_symlinks`.
    With `manifest` (a `ckpttool manifest` file), a valid checkpoint's tensors are hashed and
    each one missing, extra or differing from it is an error naming the tensor. With
    `numerics`, each floating tensor holding NaN or Inf is an error (`non-finite`) naming its
    first bad element, and `report.numbers` holds every floating tensor's figures (scanned
    `threads` at a time, None: `store.io.DEFAULT_THREADS`; one pass with `deep`).

    Raises NotACheckpoint only when `src` does not exist (a usage error).
    """
    started = time.perf_counter()
    root = as_path(source.locate(src))
    follow_symlinks = source.follow_symlinks
    if not root.exists():
        raise NotACheckpoint(f"{root}: no such file or directory")
    report = ValidationReport(path=root, deep=deep)
    try:
        checkpoint = readers.open_checkpoint(root, follow_symlinks)
    except CheckpointError as error:
        report.add(ERROR, error.code, str(error), file=METADATA_FILENAME)
        report.seconds = time.perf_counter() - started
        return report
    report.tensors, report.objects = len(checkpoint.tensors), len(checkpoint.objects)
    report.chunks = sum(len(t.chunks) for t in checkpoint.tensors.values())
    found = integrity.check(checkpoint, follow_symlinks)
    report.problems.extend(found.problems)
    report.files = found.files
    _check_quantization(checkpoint, report)
    if deep:
        _check_bytes(checkpoint, found.sizes, report, follow_symlinks, numerics)
    elif numerics:
        _check_numbers(checkpoint, found.sizes, report, follow_symlinks, threads)
    if numerics:
        _report_numbers(checkpoint, report)
    if manifest is not None:  # manifest (issue 34)
        _check_manifest(src, manifest, source, report)
    report.seconds = time.perf_counter() - started
    return report


def _check_manifest(src: str | os.PathLike, manifest: str | os.PathLike, source: SourceOptions,
                    report: ValidationReport) -> None:
    """Hash the checkpoint and compare it with `manifest` (commands.manifest.check), unless
    it is invalid already (its bytes cannot be trusted to be where the metadata says)."""
    from ckpttool.commands.manifest import check_or_error
    from ckpttool.options import WriteOptions

    if not report.valid:
        report.add(INFO, "manifest-skipped", f"{report.path}: not checked against {manifest}: the checkpoint is invalid")
        return
    report.manifest, problems = check_or_error(src, manifest, WriteOptions(), source)
    report.problems.extend(problems)
    if report.manifest is not None:
        report.bytes_read += report.manifest.bytes_hashed


def _check_quantization(checkpoint: Checkpoint, report: ValidationReport) -> None:
    """Report quantised weights whose scale is missing or does not fit them (`quantization.find`):
    errors when the config names a quantisation or other weights are quantised, else warnings
    (a float8 tensor alone may be a plain float8 tensor)."""
    if not may_be_quantized(checkpoint):
        return  # the common case, checked without importing the quantisation code
    from ckpttool.model import quantization

    try:
        config = quantization.config_beside(checkpoint.path)
        found = quantization.find(checkpoint, config)
    except CheckpointError as error:
        report.add(ERROR, error.code, str(error), file=quantization.CONFIG_FILENAME)
        return
    if found is None:
        return
    severity = ERROR if found.config is not None or found.weights else WARNING
    for fqn, message in found.problems:
        report.add(severity, "quantization", f"{checkpoint.path}: {message}", fqn=fqn)


def may_be_quantized(checkpoint: Checkpoint) -> bool:
    """Return False only when `quantization.find` would find nothing: no config.json beside a
    local checkpoint (`quantization.config_beside`), no float8 tensor and no tensor named as a
    quantised weight's part (MXFP4's blocks and scales, FP8's block scale)."""
    from ckpttool.formats import fp8, mxfp4
    from ckpttool.formats.model_config import HUB_CONFIG

    if isinstance(checkpoint.path, Path) and os.path.isfile(checkpoint.path / HUB_CONFIG):
        return True
    parts = (mxfp4.BLOCKS, mxfp4.SCALES, fp8.BLOCK_SCALE)
    return any(tensor.dtype in fp8.ALL_FLOAT8 or fqn.endswith(parts) for fqn, tensor in checkpoint.tensors.items())


def _check_record_entries(files: DataFiles, blob: Blob, where: str, fqn: str, report: ValidationReport,
                          skip_largest: bool) -> None:
    """Report every entry of a torch.save record (data.pkl, byteorder, ...) whose CRC-32 is
    off, and damage to the record's zip structure that torch's reader would refuse.

    Not for zstd-transformed blobs or safetensors blobs (no zip record to check)."""
    from ckpttool.dcp.blobs import is_safetensors_blob, record_problems

    try:
        if blob.transforms or is_safetensors_blob(files, blob):
            return
        problems = record_problems(files, blob, where, skip_largest)
    except CheckpointError as error:
        report.add(ERROR, "corrupt-blob", str(error), blob.file, fqn)
        return
    for kind, message in problems:
        report.add(ERROR, "checksum" if kind == "checksum" else "corrupt-blob", message, blob.file, fqn)


def _readable(tensor: Tensor, sizes: dict[str, int], broken_files: set[str]) -> bool:
    """True when every chunk of `tensor` has a blob in a data file the gate found sound."""
    return all(chunk.blob is not None and chunk.blob.file in sizes and chunk.blob.file not in broken_files
               for chunk in tensor.chunks)


def _check_numbers(checkpoint: Checkpoint, sizes: dict[str, int], report: ValidationReport, follow_symlinks: bool,
                   threads: int | None) -> None:
    """Scan the floating tensors whose chunks are all in sound files (`check.numbers`); a
    chunk that cannot be read is an error naming its tensor, which then has no figures."""
    from ckpttool.check.numbers import floating, scan_numbers
    from ckpttool.store.io import DEFAULT_THREADS

    broken_files: set[str] = {p.file for p in report.errors if p.file}
    fqns = [fqn for fqn in floating(checkpoint) if _readable(checkpoint.tensors[fqn], sizes, broken_files)]

    def failed(fqn: str, error: CheckpointError) -> None:
        report.add(ERROR, error.code, str(error), fqn=fqn)

    report.numbers = scan_numbers(checkpoint, fqns, follow_symlinks=follow_symlinks, threads=threads or DEFAULT_THREADS, on_error=failed)
    report.bytes_read += sum(checkpoint.tensors[n.fqn].nbytes for n in report.numbers)


def _report_numbers(checkpoint: Checkpoint, report: ValidationReport) -> None:
    """Add a `non-finite` error, on one line, for each tensor holding NaN or Inf."""
    for found in report.numbers or ():
        if not found.bad:
            continue
        shape = list(checkpoint.tensors[found.fqn].shape)
        where = f"{found.file}: " if found.file else ""
        report.numerics.append(Numerics(found.fqn, found.nan, found.inf))
        report.add(ERROR, "non-finite", f"{where}{found.fqn}: {found.nan} NaN and {found.inf} Inf of {found.numel} "
                   f"elements, the first at element {found.first_bad} (flat row-major index, shape {shape})",
                   found.file, found.fqn)


def _check_bytes(checkpoint: Checkpoint, sizes: dict[str, int], report: ValidationReport, follow_symlinks: bool,
                 numbers: bool = False) -> None:
    """Decode every blob: record structure, dtype/shape, CRC-32, NaN/Inf counts; with
    `numbers`, every figure of `--numerics` too, from the same blocks (`report.numbers`).

    Needs no torch for torch_save and safetensors blobs of plain objects and tensors; torch
    is imported only to decode what must be decoded (zstd, strided records, torch objects).
    """
    from ckpttool.core import numerics  # numpy: only --deep pays for its import
    from ckpttool.check.numbers import Tally
    from ckpttool.dcp.blobs import DataFiles, blob_bytes, decode_object, iter_blocks, locate, read_chunk  # and the blob reader

    broken_files: set[str] = {p.file for p in report.errors if p.file}
    view = memoryview(bytearray(DEEP_BLOCK))  # one block buffer, refilled in place
    work = bytearray(2 * DEEP_BLOCK) if numbers else None  # numerics.scan_block's arrays
    if numbers:
        report.numbers = []
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        for tensor in checkpoint.tensors.values():
            if tensor.dtype not in dtypes.ITEMSIZE:
                continue
            nan = inf = 0
            tally = Tally(tensor) if numbers and tensor.dtype in numerics.SCANNED else None
            if tally is not None and not _readable(tensor, sizes, broken_files):
                tally = None  # its figures cannot be whole
            for chunk in tensor.chunks:
                if chunk.blob is None or chunk.blob.file not in sizes or chunk.blob.file in broken_files:
                    continue
                where = f"{chunk.blob.file}: {tensor.fqn} chunk at {list(chunk.offsets)}"
                _check_record_entries(files, chunk.blob, where, tensor.fqn, report, skip_largest=True)
                try:
                    raw = locate(files, tensor, chunk)
                    blocks = iter_blocks(files, raw, DEEP_BLOCK, view) if raw else [read_chunk(files, tensor, chunk)]
                    crc = start = 0
                    for block in blocks:
                        crc = zlib.crc32(block, crc)
                        report.bytes_read += len(block)
                        if tally is not None:
                            found = numerics.scan_block(block, tensor.dtype, work)
                            tally.add(chunk, start, found)
                            start += found.elements
                        elif tensor.dtype in numerics.SUPPORTED and block:
                            block_nan, block_inf = numerics.count_non_finite(block, tensor.dtype)
                            nan, inf = nan + block_nan, inf + block_inf
                except CheckpointError as error:
                    report.add(ERROR, "corrupt-blob", str(error), chunk.blob.file, tensor.fqn)
                    tally = None
                    continue
                # torch can be told not to record CRCs; a stored 0 means "not recorded"
                if raw and raw.crc32 and crc != raw.crc32:
                    report.add(ERROR, "checksum", f"{where}: CRC-32 of the data is {crc:08x}, the record says {raw.crc32:08x} (bytes changed on disk)", chunk.blob.file, tensor.fqn)
            if tally is not None and report.numbers is not None:
                report.numbers.append(tally.result())  # its NaN/Inf: an error (_report_numbers)
            elif nan or inf:
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
