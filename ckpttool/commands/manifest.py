"""`manifest`: the SHA-256 of every tensor of a checkpoint, and checking one against it.

The pipeline: read the source (any layout) -> integrity gate -> choose the keys as
consolidate does (the model view, or every tensor with `everything`) -> locate the chunks' raw
bytes (record headers only) -> plan each tensor's hashing (`manifest.plan_tensor`, pure) ->
hash the tensors in parallel (`manifest.hash_tensors`) -> the `manifest.Manifest`, written
atomically with `out`. `check` hashes a checkpoint the same way and compares it with a manifest
(`validate --manifest`, `diff SRC FILE.json`).

Example:
    >>> manifest("ckpt/step-00000200", "model.manifest.json").manifest.digest
    'sha256:5e1c...'
    >>> check("hub/gpt", "model.manifest.json").same
    True
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.run import locating
from ckpttool.store import storage
from ckpttool.core.checkpoint import as_path
from ckpttool.commands.consolidate import EMBEDDING_KEY, HEAD_KEY
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CheckpointError, UsageError
from ckpttool.check.integrity import ERROR, Problem
from ckpttool.store.io import Task, run_tasks
from ckpttool.model.keys import KeyRules
from ckpttool.check.manifest import (MAX_MANIFEST_BYTES, Difference, FileEntry, Manifest, TiedKey, compare, hash_file, hash_tensors,
                               parse, plan_tensor)
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.options import SourceOptions, WriteOptions
from ckpttool.outputs import atomic_output, check_destination, refuse_overlap
from ckpttool.plan.consolidate import OutputFormat, select


@dataclass(frozen=True)
class ManifestReport:
    """A checkpoint's manifest and how it was made (`output`: where it was written, or None)."""

    source: Path
    manifest: Manifest
    layout: str  # what readers.detect found, described
    view: ModelView
    bytes_hashed: int  # tensor bytes (and data-file bytes with --files)
    seconds: float
    output: Path | None = None
    problems: tuple[Problem, ...] = ()  # the integrity gate's warnings

    @property
    def throughput(self) -> float:
        return self.bytes_hashed / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ManifestCheck:
    """A checkpoint (or manifest) `source` compared with the manifest `expected_from`."""

    source: Path
    expected_from: Path
    expected: Manifest
    actual: Manifest
    differences: tuple[Difference, ...]  # in key order: the first is the first differing tensor
    ties: tuple[TiedKey, ...]
    bytes_hashed: int
    seconds: float
    problems: tuple[Problem, ...] = ()

    @property
    def same(self) -> bool:
        return not self.differences

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None


def manifest(src: str | os.PathLike, out: str | os.PathLike | None = None, *, everything: bool = False,
             files: bool = False, write: WriteOptions = WriteOptions(), source: SourceOptions = SourceOptions(),
             ) -> ManifestReport:
    """Return the manifest of the checkpoint at `src`, written to `out` when given (atomically;
    an existing file only with `write.force`).

    Per tensor of the model (keys as `model.state_dict()` names them; every tensor entry with
    `everything`) its dtype, shape and the SHA-256 of its row-major bytes as stored; with
    `files` also each data file's SHA-256. Equal for a checkpoint at any world size, its
    reshard, its consolidation and its Hub export.

    Example:
        >>> manifest("fixtures/fsdp2_world3_uneven").manifest.tensors["embed.weight"].shape
        (13, 8)
    """
    started = time.perf_counter()
    target = as_path(source.locate(out)) if out is not None else None
    if target is not None:
        refuse_overlap(target, src)
        if not write.dry_run:
            check_destination(target, write.force, write.notify)
    computed, layout, view, hashed, problems, _ = compute(src, everything=everything, files=files, write=write,
                                                             source=source)
    if target is not None and not write.dry_run:
        with atomic_output(target, force=write.force, notify=write.notify) as handle:
            handle.write(computed.to_json())
    return ManifestReport(as_path(source.locate(src)), computed, layout, view, hashed, time.perf_counter() - started, target,
                          problems)


def compute(src: str | os.PathLike, *, everything: bool = False, files: bool = False,
            write: WriteOptions = WriteOptions(), source: SourceOptions = SourceOptions(),
            ) -> tuple[Manifest, str, ModelView, int, tuple[Problem, ...], Path]:
    """Return (manifest, layout, model view, bytes hashed, gate warnings, path) of `src`:
    read, gated, selected, located, planned and hashed as the module says."""
    detection, checkpoint = readers.read(source.locate(src), source.follow_symlinks, layout=source.layout)
    problems = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    view = find_model(checkpoint, source.model_prefix if checkpoint.model_prefix is None else None)
    selection = select(checkpoint, view, KeyRules(everything=everything), OutputFormat("torch", False, None))
    tensors = {key: checkpoint.tensors[fqn] for key, fqn in selection.tensors.items()}
    if not tensors:
        raise UsageError(f"{checkpoint.path}: no tensors to hash ({len(selection.objects)} python objects only)")
    with DataFiles(checkpoint.path, source.follow_symlinks) as data:
        located = locating.locate_chunks(data, tensors.values(), write.threads)
        budget = cast(int, write.max_memory)  # bytes: WriteOptions parses a size when built
        block = max(1, min(16 << 20, budget // (4 * write.threads)))
        plans = [plan_tensor(key, tensor, located[tensor.fqn], block) for key, tensor in tensors.items()]
        hashed = sum(plan.nbytes for plan in plans)
        with write.progress("manifest", hashed) as bar:
            digests = hash_tensors(plans, data, threads=write.threads, max_memory=budget, on_done=bar.update)
        file_entries = None
        if files:
            names = checkpoint.data_files()
            found: dict[str, FileEntry] = {}

            def file_task(name: str) -> Task:
                def run() -> int:
                    found[name] = FileEntry(data.size(name), hash_file(data, name))
                    return found[name].bytes
                return Task(run, 8 << 20)

            run_tasks((file_task(name) for name in names), write.threads, budget)
            file_entries = found
            hashed += sum(entry.bytes for entry in found.values())
    result = Manifest.of(tensors, digests, "all" if everything else "model", file_entries)
    return result, detection.describe(), view, hashed, problems, checkpoint.path


def read_manifest(path: str | os.PathLike, source: SourceOptions = SourceOptions()) -> Manifest:
    """Return the manifest in the file at `path` (local or a storage URL), checked field by field."""
    where = source.locate(path)
    try:
        if storage.is_remote(where):
            remote = storage.reader(cast(storage.RemotePath, where))  # is_remote: a RemotePath
            data = remote.read(0, min(remote.size, MAX_MANIFEST_BYTES + 1))
        else:
            data = Path(where).read_bytes()
    except OSError as error:
        raise UsageError(f"{where}: cannot read the manifest ({error.strerror or error})") from None
    return parse(data, str(where))


def is_manifest_file(path: str | os.PathLike) -> bool:
    """True for a path `diff` takes as a manifest: a `.json` file, not a checkpoint."""
    return str(path).lower().endswith(".json") and not (not storage.is_remote(path) and os.path.isdir(path))


def tied(absent: str, kept: str) -> bool:
    """True when `absent` may be a tied head of the embedding `kept` (consolidate's names for
    the pair the Hub convention stores once)."""
    return bool(HEAD_KEY.search(absent) and EMBEDDING_KEY.search(kept))


def check(src: str | os.PathLike, expected: str | os.PathLike | Manifest, *, expected_from: str | os.PathLike | None = None,
          write: WriteOptions = WriteOptions(), source: SourceOptions = SourceOptions()) -> ManifestCheck:
    """Return how the checkpoint (or manifest file) at `src` differs from the manifest
    `expected` (a path, or a Manifest read from `expected_from`): missing, extra, other dtype,
    shape or bytes, in key order. The checkpoint is hashed with the manifest's `entries`.

    Example:
        >>> check("hub/gpt", "gpt.manifest.json").first
        Difference(key='layers.0.fc1.weight', kind='sha256', expected='3f2a...', actual='9c41...')
    """
    started = time.perf_counter()
    if not isinstance(expected, Manifest):
        expected_from, expected = expected, read_manifest(expected, source)
    problems: tuple[Problem, ...] = ()
    if is_manifest_file(src):
        actual, hashed = read_manifest(src, source), 0
        root = as_path(source.locate(src))
    else:
        actual, _, _, hashed, problems, _ = compute(src, everything=expected.entries == "all",
                                                    files=False, write=write, source=source)
        root = as_path(source.locate(src))
    differences, ties = compare(expected, actual, tied)
    return ManifestCheck(root, as_path(source.locate(expected_from or "manifest")), expected, actual, differences, ties, hashed,
                         time.perf_counter() - started, problems)


def check_problems(check_report: ManifestCheck) -> list[Problem]:
    """Return validate's problems for a check: one error per difference, naming the tensor."""
    where = check_report.expected_from
    problems = []
    for difference in check_report.differences:
        if difference.kind == "missing":
            message = f"{difference.key}: in the manifest {where} ({difference.expected}) but not in the checkpoint"
        elif difference.kind == "extra":
            message = f"{difference.key}: in the checkpoint ({difference.actual}) but not in the manifest {where}"
        elif difference.kind == "sha256":
            assert difference.actual is not None and difference.expected is not None  # both sides hold the key
            message = (f"{difference.key}: its bytes differ from the manifest {where} (sha256 {difference.actual[:16]}..., "
                       f"expected {difference.expected[:16]}...)")
        else:
            message = f"{difference.key}: {difference.kind} {difference.actual}, the manifest {where} says {difference.expected}"
        problems.append(Problem(ERROR, f"manifest-{difference.kind}" if difference.kind in ("missing", "extra")
                                else "manifest-mismatch", message, None, difference.key))
    return problems


def check_or_error(src: str | os.PathLike, expected: str | os.PathLike, write: WriteOptions,
                   source: SourceOptions) -> tuple[ManifestCheck | None, list[Problem]]:
    """Return the check of `src` against `expected` and its problems; an error reading the
    checkpoint's bytes (a damaged record) is one problem with its code, and no check."""
    try:
        result = check(src, expected, write=write, source=source)
    except UsageError:
        raise
    except CheckpointError as error:
        return None, [Problem(ERROR, error.code, str(error), None, None)]
    return result, check_problems(result)

