"""`inspect`: what a checkpoint holds, from its metadata alone (no tensor bytes are read).

Example:
    >>> report = inspect("runs/x/step-00000020")
    >>> report.summary.parameters, report.tensors[0].sharding.kind
    (1234567, 'dim0')
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from ckpttool import readers
from ckpttool.checkpoint import Checkpoint, Tensor, paused_gc
from ckpttool.geometry import Sharding, classify
from ckpttool.model_view import ModelView, find_model
from ckpttool.options import SourceOptions
from ckpttool.formats.dcp import DATA_FILE_PATTERN
from ckpttool.safepaths import is_safe_relative_path

GROUPS = ("model", "optimizer", "other")


class ChunkInfo(NamedTuple):
    """One chunk as inspect reports it (a NamedTuple: there may be 100k+ of them)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    offset: int | None  # byte offset of the blob in its file
    length: int | None  # blob length in bytes (torch.save record, with its small header)
    nbytes: int  # element bytes of the chunk


@dataclass(frozen=True)
class TensorInfo:
    fqn: str
    group: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    sharding: Sharding
    chunks: tuple[ChunkInfo, ...]


@dataclass(frozen=True)
class ObjectInfo:
    fqn: str
    group: str
    file: str | None
    length: int | None


@dataclass(frozen=True)
class FileInfo:
    """One data file: which rank wrote it and how many bytes each group has in it."""

    file: str
    rank: int | None
    size: int | None  # on disk; None when missing
    referenced_bytes: int  # blob bytes the metadata points into this file
    tensor_bytes: dict[str, int]  # group -> element bytes of chunks in this file


@dataclass(frozen=True)
class GroupInfo:
    tensors: int
    objects: int
    numel: int
    nbytes: int


@dataclass(frozen=True)
class Summary:
    dcp_version: str | None
    metadata_file: str
    tensors: int
    objects: int
    chunks: int
    tensor_bytes: int
    file_bytes: int
    files: int
    ranks: tuple[int, ...]
    parameters: int  # elements of the model's tensors (model_view.find_model)


@dataclass(frozen=True)
class InspectReport:
    path: Path
    summary: Summary
    groups: dict[str, GroupInfo]
    tensors: tuple[TensorInfo, ...]
    objects: tuple[ObjectInfo, ...]
    files: tuple[FileInfo, ...]
    filters: tuple[str, ...] = ()
    layout: str = "dcp"  # readers.detect's name for the on-disk layout
    model_view: ModelView | None = None  # where the model was found, and why


def matches(fqn: str, patterns: Sequence[str]) -> bool:
    """True when no patterns are given or the fqn matches one of the globs."""
    return not patterns or any(fnmatch.fnmatchcase(fqn, p) for p in patterns)


def _tensor_info(tensor: Tensor, group: str) -> TensorInfo:
    chunks = tuple(
        ChunkInfo(c.offsets, c.sizes, c.blob.file, c.blob.offset, c.blob.length, c.numel * tensor.itemsize)
        if c.blob else ChunkInfo(c.offsets, c.sizes, None, None, None, c.numel * tensor.itemsize)
        for c in tensor.chunks
    )
    sharding = classify([(c.offsets, c.sizes) for c in tensor.chunks], tensor.shape)
    return TensorInfo(tensor.fqn, group, tensor.dtype, tensor.shape, tensor.numel,
                      tensor.nbytes, sharding, chunks)


# data files named for the rank that wrote them: torch HF writer's shard-{rank + 1}-model-...,
# verl's model_world_size_{W}_rank_{rank}.pt
_HF_SHARD = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")
_VERL_RANK = re.compile(r"^model_world_size_\d+_rank_(\d+)\.pt$")


def rank_of(file: str) -> int | None:
    """Return the rank that wrote `__{rank}_{n}.distcp` (and the HF writer's and verl's
    per-rank files), or None for other names."""
    name = os.path.basename(file)
    if match := DATA_FILE_PATTERN.match(name) or _VERL_RANK.match(name):
        return int(match.group(1))
    match = _HF_SHARD.match(name)
    return int(match.group(1)) - 1 if match else None


def inspect(src: str | os.PathLike, filters: Sequence[str] = (), source: SourceOptions = SourceOptions()) -> InspectReport:
    """Return what the checkpoint at `src` holds, reading only its `.metadata`.

    `filters` are fqn globs (`model.layers.*`); summary, groups and files count all entries,
    `tensors` and `objects` list only the matching ones. The model group is found from the
    structure (`model_view.find_model`) unless `source.model_prefix` names it.
    """
    detection, checkpoint = readers.read(source.locate(src))
    with paused_gc():
        return build_report(checkpoint, tuple(filters), detection.layout, source.model_prefix)


def build_report(checkpoint: Checkpoint, filters: tuple[str, ...] = (), layout: str = "dcp",
                 model_prefix: str | None = None) -> InspectReport:
    """Return the inspect report of already-read metadata."""
    view = find_model(checkpoint, model_prefix)
    tensors = [_tensor_info(t, view.group(t.fqn)) for t in checkpoint.tensors.values()]
    objects = [
        ObjectInfo(o.fqn, view.group(o.fqn), o.blob.file if o.blob else None, o.blob.length if o.blob else None)
        for o in checkpoint.objects.values()
    ]

    referenced: Counter[str] = Counter()
    per_file_group: dict[str, Counter[str]] = defaultdict(Counter)
    for info in tensors:
        for chunk in info.chunks:
            if chunk.file is not None:
                referenced[chunk.file] += chunk.length or 0
                per_file_group[chunk.file][info.group] += chunk.nbytes
    for obj in objects:
        if obj.file is not None:
            referenced[obj.file] += obj.length or 0
    files = []
    for name in sorted(referenced, key=lambda f: (rank_of(f) is None, rank_of(f) or 0, f)):
        path = checkpoint.path / name
        try:
            size = path.stat().st_size if is_safe_relative_path(name) else None
        except OSError:
            size = None
        files.append(FileInfo(name, rank_of(name), size, referenced[name], dict(per_file_group[name])))

    groups = {}
    for group in GROUPS:
        members = [t for t in tensors if t.group == group]
        groups[group] = GroupInfo(
            tensors=len(members), objects=sum(1 for o in objects if o.group == group),
            numel=sum(t.numel for t in members), nbytes=sum(t.nbytes for t in members),
        )
    summary = Summary(
        dcp_version=checkpoint.version, metadata_file=checkpoint.metadata_file,
        tensors=len(tensors), objects=len(objects), chunks=sum(len(t.chunks) for t in tensors),
        tensor_bytes=sum(t.nbytes for t in tensors), file_bytes=sum(f.size or 0 for f in files), files=len(files),
        ranks=tuple(sorted({f.rank for f in files if f.rank is not None})), parameters=groups["model"].numel,
    )
    return InspectReport(
        checkpoint.path, summary, groups, tensors=tuple(t for t in tensors if matches(t.fqn, filters)),
        objects=tuple(o for o in objects if matches(o.fqn, filters)), files=tuple(files), filters=filters,
        layout=layout, model_view=view,
    )
