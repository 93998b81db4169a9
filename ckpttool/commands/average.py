"""`average`: the weighted average of the model tensors of k checkpoints of one model, streamed.

The pipeline: each source is read, gated and planned as consolidate plans it
(`consolidate.plan_output`: its layout detected, its model found, its chunks located; no
tensor byte read) -> the models are compared (keys, shapes, dtypes: `check_same_model`) ->
the output is laid out once (the first source's consolidate plan for a .safetensors file,
Hub shards or a .pt; reshard's plan of the averaged model for DCP with `world_size`) and cut
into blocks, each naming the byte ranges of every source that hold its elements
(`plan.average`, pure) -> integer and bool tensors are compared across the sources -> the
blocks are computed and written into an atomic output (`run.average`), under torchrun a share
per process. Each source's floating tensors are read once, by range; memory holds the blocks
in flight (`--max-memory`), whatever the number of sources.

Example:
    >>> report = average(["runs/x/step-900", "runs/x/step-1000"], "avg.safetensors")
    >>> report.weights, report.averaged
    ((0.5, 0.5), 12)
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

from ckpttool.check.integrity import Problem
from ckpttool.commands.consolidate import Planned, SourceFiles, output_format, plan_output, selection_text
from ckpttool.core.checkpoint import as_path
from ckpttool.core.errors import UnsupportedFormat, UsageError
from ckpttool.dcp.blobs import DataFiles
from ckpttool.model.model_view import ModelView
from ckpttool.options import ConvertOptions, SourceOptions, WriteOptions
from ckpttool.outputs import check_destination, refuse_overlap
from ckpttool.plan.average import (BLOCK_ELEMENTS, WORKING_BYTES, AveragePlan, OutputTensor, averaged_checkpoint,
                                   averaged_located, check_same_model, plan_average, plan_average_dcp, source_map,
                                   weights_for)
from ckpttool.plan.consolidate import OutputFormat
from ckpttool.plan.rank_files import plan_writes
from ckpttool.plan.reshard import Mesh, plan_reshard
from ckpttool.run import average as averaging
from ckpttool.run.distributed import ProcessStats

_SAVE_ID_NAMESPACE = uuid.UUID("c0a6b1d4-3e5f-4b8a-9d2e-7f1a0c4e6b21")
MIN_BLOCK_ELEMENTS = 4096


@dataclass(frozen=True)
class AverageReport:
    """What average wrote (or, with dry_run, would write)."""

    sources: tuple[str, ...]  # as messages name them: the file given, else the checkpoint folder read
    output: Path
    format: str  # "safetensors" | "torch" | "dcp"
    weights: tuple[float, ...]
    files: tuple[Path, ...]
    plan: AveragePlan
    seconds: float
    layouts: tuple[str, ...]  # what readers.detect found in each source
    selected: tuple[str, ...]  # which entries of each source are its model, and why
    world_size: int | None = None  # DCP output: its ranks
    dry_run: bool = False
    verified: bool = False
    problems: tuple[tuple[str, Problem], ...] = ()  # (source, warning) of each source's integrity gate
    processes: tuple[ProcessStats, ...] = ()
    model_views: tuple[ModelView, ...] = ()

    @property
    def tensors(self) -> int:
        return len(self.plan.tensors)

    @property
    def averaged(self) -> int:
        return self.plan.averaged

    @property
    def copied(self) -> int:
        return self.tensors - self.averaged

    @property
    def tensor_bytes(self) -> int:
        return self.plan.tensor_bytes


def average(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    weights: Sequence[float] | None = None,
    world_size: int | None = None,
    max_shard_size: str | int | None = None,
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
) -> AverageReport:
    """Return a report after writing the weighted average of the model tensors of `sources`
    (checkpoints of one model, any layouts and world sizes) at `out`.

    `out` is written as consolidate writes it (`.safetensors`, `.pt`/`.bin`, any other path a
    directory of Hub shards of at most `max_shard_size`), or with `world_size` as a DCP
    checkpoint for that many FSDP2 ranks, keys under `model.` as `import` writes them.
    `weights` (one per source; default `1.0 / k` each): each floating tensor is
    `acc = w1 * x1`, then `acc = acc + w_i * x_i` in order, in float64, cast to its dtype as
    torch's `.to` casts (docs/average.md); integer and bool tensors must be equal and are
    copied. Different keys, shapes or dtypes raise InvalidCheckpoint before anything is
    written; nothing is left at `out` unless the whole write succeeded.

    Example:
        >>> average(["a", "b", "c"], "avg", weights=[0.5, 0.25, 0.25], world_size=4).files[-1].name
        '.metadata'
    """
    started = time.perf_counter()
    given = weights_for(len(sources), weights)
    target = as_path(source.locate(out))
    kind = _output_kind(target, world_size, max_shard_size)
    for src in sources:
        refuse_overlap(target, source.locate(src))
    if not write.dry_run:
        check_destination(target, write.force, write.notify)
    with contextlib.ExitStack() as stack:
        shared = [stack.enter_context(SourceFiles(source.follow_symlinks, 0)) for _ in sources]
        planned = [plan_output(src, target.name, kind, ConvertOptions(), source, write.threads, files)
                   for src, files in zip(sources, shared)]
        names = tuple(_name(source, src, p) for src, p in zip(sources, planned))
        _refuse_what_is_not_averaged(planned, world_size)
        check_same_model(names, [{t.key: p.checkpoint.tensors[t.fqn] for t in p.plan.tensors} for p in planned])
        plan = _plan(planned, names, given, target, world_size, _block_elements(write))
        report: dict[str, Any] = dict(
            sources=names, output=target, format=plan.format, weights=given,
            plan=plan, layouts=tuple(p.layout for p in planned),
            selected=tuple(selection_text(p.view, p.rules) for p in planned), world_size=world_size,
            problems=tuple((name, problem) for name, p in zip(names, planned) for problem in p.problems),
            model_views=tuple(p.view for p in planned))
        if write.dry_run:
            return AverageReport(files=(), seconds=time.perf_counter() - started, dry_run=True, **report)
        files = [cast(DataFiles, stack.enter_context(s.open(p.checkpoint.path))) for s, p in zip(shared, planned)]
        budget = cast(int, write.max_memory)
        averaging.check_copied(plan, files, write.threads, budget)
        if world_size is not None:
            save_id = str(uuid.uuid5(_SAVE_ID_NAMESPACE, f"{names}:{given}:{world_size}"))
            written, processes = averaging.write_dcp(plan, files, target, save_id, write)
        else:
            written, processes = averaging.write_state_dict(plan, files, target, kind.sharded, write)
    return AverageReport(files=written, seconds=time.perf_counter() - started, verified=write.verify,
                         processes=processes, **report)


def _name(source: SourceOptions, src: str | os.PathLike, planned: Planned) -> str:
    """How messages name a source: the file given (a .safetensors, a .pt), else the checkpoint
    folder read (which may lie below the one given: a run folder's newest step)."""
    given = as_path(source.locate(src))
    return str(given) if given.is_file() else str(planned.checkpoint.path)


def _output_kind(target: Path, world_size: int | None, max_shard_size: str | int | None) -> OutputFormat:
    """What OUT asks for; DCP output is planned from a .pt's kind (python objects allowed, then refused)."""
    if world_size is None:
        return output_format(target, max_shard_size)
    if max_shard_size is not None:
        raise UsageError("--max-shard-size applies to Hub shards; with --world the output is DCP rank files")
    if world_size < 1:
        raise UsageError("--world must be at least 1")
    return OutputFormat("torch", False, None)


def _refuse_what_is_not_averaged(planned: Sequence[Planned], world_size: int | None) -> None:
    """Quantised weights (codes and scales) and python objects in the model are not averaged."""
    for p in planned:
        found = p.quantization
        if found is not None and found.weights:
            raise UnsupportedFormat(f"{p.checkpoint.path}: holds {len(found.weights)} {found.scheme} quantised weights; "
                                    "average computes on bf16, fp16, fp32 and fp64 weights: dequantise them first "
                                    "(`ckpttool consolidate SRC OUT --dtype bf16`); nothing was written")
        if world_size is not None and p.plan.objects:
            raise UsageError(f"{p.checkpoint.path}: the model holds python objects ({p.plan.objects[0].key}, ...), which "
                             "a DCP output of average does not carry; write a .pt instead")


def _plan(planned: Sequence[Planned], names: tuple[str, ...], weights: tuple[float, ...], target: Path,
          world_size: int | None, block_elements: int) -> AveragePlan:
    template = planned[0].plan
    maps = [{t.key: source_map(t.offset, t.operations) for t in p.plan.tensors} for p in planned]
    if world_size is None:
        return plan_average(names, weights, template, maps, block_elements)
    tensors = [OutputTensor(t.key, t.dtype, t.shape) for t in template.tensors]
    sharded = frozenset(t.key for p in planned for t in p.plan.tensors if len(p.checkpoint.tensors[t.fqn].chunks) > 1)
    stand_in = averaged_checkpoint(target, tensors, sharded)
    resharded = plan_reshard(stand_in, Mesh(1, world_size))
    writes = plan_writes(resharded, stand_in, averaged_located(stand_in))
    return plan_average_dcp(names, weights, tensors, resharded, writes, maps, block_elements)


def _block_elements(write: WriteOptions) -> int:
    """Output elements per block: BLOCK_ELEMENTS, fewer when `threads` blocks at once would not
    fit `--max-memory`."""
    budget = cast(int, write.max_memory)
    return max(MIN_BLOCK_ELEMENTS, min(BLOCK_ELEMENTS, budget // (write.threads * WORKING_BYTES)))
