"""`consolidate`: export a sharded checkpoint to one full state dict, streaming.

The pipeline, in two steps that export shares: `plan_output` reads `.metadata` -> integrity
gate -> choose keys (`plan.consolidate.select`) -> locate the chosen chunks' raw bytes, find
tied pairs, decode python objects for a .pt (the only reads before writing: record headers
and, for ties, candidate bytes) -> plan (`plan_consolidate`, pure) = a `Planned` value; then
`write_output` runs it: `execute.run` into atomic outputs -> .pt zip records -> optional
`--verify` -> fsync and rename. Memory holds only the buffers of running operations:
FSDP's dim-0 chunks move with `copy_file_range` and never enter user space.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence, cast

from ckpttool import naming, readers
from ckpttool.check import integrity
from ckpttool.model import quantization
from ckpttool.run import distributed, execute, locating
from ckpttool.run.merge import read_tensor
from ckpttool.store import io
from ckpttool.core.checkpoint import Blob, Checkpoint, Tensor, as_path
from ckpttool.dcp.blobs import DataFiles, blob_bytes, decode_object, iter_blocks, object_bytes, read_chunk
from ckpttool.run.distributed import ProcessStats
from ckpttool.core.errors import CorruptMetadata, InvalidCheckpoint, UsageError, WriteFailed
from ckpttool.formats import hub, safetensors
from ckpttool.check.integrity import Problem
from ckpttool.store.io import parse_size, write_at
from ckpttool.model.keys import KeyRules
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.options import AdapterOptions, ConvertOptions, SourceOptions, WriteOptions
from ckpttool.outputs import atomic_directory, atomic_output, check_destination, refuse_overlap
from ckpttool.naming import Family, saved_config
from ckpttool.model.quantization import Quantization, QuantizedWeight
from ckpttool.plan.consolidate import (ConsolidatePlan, OutputFormat, Selection, Tie, plan_consolidate, quantizable,
                                       select)
from ckpttool.readers.detect import LIGHTNING, LIGHTNING_METADATA
from ckpttool.torchsave import ptfile

# Known tied pairs (embedding <-> output projection): transformers' `_tied_weights_keys`
# names the head side, which the Hub convention drops from the file.
EMBEDDING_KEY = re.compile(r"(^|\.)(embed\w*|wte|tok_emb\w*|word_embeddings|shared)\.weight$")
HEAD_KEY = re.compile(r"(^|\.)(lm_head|head|output|decoder|out_proj)\.weight$")


@dataclass(frozen=True)
class ConsolidateReport:
    """What consolidate wrote (or, with dry_run, would write)."""

    source: Path
    output: Path
    format: str
    files: tuple[Path, ...]
    tensors: int
    objects: int
    tensor_bytes: int
    seconds: float
    plan: ConsolidatePlan
    ties: tuple[Tie, ...] = ()
    dropped: tuple[str, ...] = ()
    dry_run: bool = False
    verified: bool = False
    problems: tuple[Problem, ...] = ()  # the integrity gate's warnings
    layout: str = "dcp"  # what readers.detect found
    selected: str = "everything"  # which entries were exported: see `selection_text`
    model_view: ModelView | None = None  # where the model was found, and why
    processes: tuple[ProcessStats, ...] = ()  # what each process wrote (several under torchrun)
    requests: int = 0  # ranged GETs of the source's data files (object storage; 0 for local files)
    merged: str = ""  # --merge-adapter: what was merged
    quantization: str = ""  # quantised weights dequantised (--dtype) or written (--quantize): what was done
    source_choice: str = ""  # SRC held two checkpoints of one step: which was read, and how to read the other
    left_out: tuple[tuple[str, str], ...] = ()  # (source key, the rule) of each model tensor not written

    @property
    def throughput(self) -> float:
        """Bytes per second of tensor data written."""
        return self.tensor_bytes / self.seconds if self.seconds > 0 else 0.0


def output_format(out: Path, max_shard_size: str | int | None) -> OutputFormat:
    """Return the format OUT asks for: `*.safetensors` one file, `*.pt`/`*.bin` torch.save,
    a directory (anything else) sharded safetensors with an index."""
    suffix = out.suffix.lower()
    if suffix == safetensors.SUFFIX:
        if max_shard_size is not None:
            raise UsageError(f"{out}: --max-shard-size writes shards into a directory; give a directory, not a .safetensors file")
        return OutputFormat("safetensors", False, None)
    if suffix in ptfile.SUFFIXES:
        if max_shard_size is not None:
            raise UsageError(f"{out}: --max-shard-size applies to sharded safetensors output (a directory)")
        return OutputFormat("torch", False, None)
    size = parse_size(max_shard_size if max_shard_size is not None else hub.DEFAULT_MAX_SHARD_SIZE)
    if size <= 0:
        raise UsageError("--max-shard-size must be positive")
    return OutputFormat("safetensors", True, size)


@dataclass(frozen=True)
class Planned:
    """What consolidate's planning step found: the source read once and past the gate, the
    model found, the entries chosen and located, and the plan (no output byte written yet)."""

    checkpoint: Checkpoint
    layout: str  # what readers.detect found, described
    view: ModelView
    rules: KeyRules
    kind: OutputFormat
    plan: ConsolidatePlan
    problems: tuple[Problem, ...]  # the integrity gate's warnings
    quantization: Quantization | None = None  # the source's quantised weights (quantization.find)
    dequantized: bool = False  # written dequantised (a --dtype was asked for), not passed through
    quantized_keys: tuple[str, ...] = ()  # --quantize fp8: the keys written as FP8
    family: Family | None = None  # the naming table that converted a framework's names to transformers'
    source_choice: str = ""  # readers.detect's choice between two checkpoints of one step (Detection.choice)
    left_out: tuple[tuple[str, str], ...] = ()  # (source key, the rule) of each model tensor the naming table does not write


class SourceFiles:
    """The source's data files, opened once for both of consolidate's steps (`plan_output`,
    `write_output`): from object storage, the spans fetched to locate records serve the copies
    (`DataFiles` with a budget of `budget` bytes: the reads are coalesced)."""

    def __init__(self, follow_symlinks: bool, budget: int):
        self.follow_symlinks, self.budget = follow_symlinks, budget
        self.whole_records = distributed.active() is None  # a torchrun process copies a share only
        self._files: DataFiles | None = None

    def __enter__(self) -> "SourceFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._files is not None:
            self._files.close()

    def open(self, path: Path) -> ContextManager[DataFiles]:
        """The DataFiles of `path`, left open when the block ends."""
        if self._files is None or str(self._files.root) != str(path):
            self.__exit__()
            self._files = DataFiles(path, self.follow_symlinks, self.budget, self.whole_records)
        return contextlib.nullcontext(self._files)

    @property
    def requests(self) -> int:
        """The ranged GETs sent for the source's data files so far."""
        return self._files.requests if self._files is not None else 0


def consolidate(
    src: str | os.PathLike,
    out: str | os.PathLike,
    convert: ConvertOptions = ConvertOptions(),
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
    merge_adapter: AdapterOptions | None = None,
) -> ConsolidateReport:
    """Return a report after writing the checkpoint at `src` as one full state dict at `out`.

    `out` ending in `.safetensors` is one file; `.pt`/`.bin` a torch.save nested dict; any
    other path a directory of `model-0000K-of-0000N.safetensors` shards plus
    `model.safetensors.index.json` (huggingface_hub's layout; one shard is `model.safetensors`).
    Model weights only, keys as `model.state_dict()` names them, unless `convert.everything`;
    the model is found from the checkpoint's structure (`model_view.find_model`) unless
    `source.model_prefix` names its subtree (`""`: the top level).
    Nothing is left at `out` unless the whole export (and `write.verify`) succeeded.
    `merge_adapter` writes a LoRA model as its base model with the adapter merged in
    (`adapter.AdapterMerge`: PEFT's merge_and_unload, one module at a time).

    Example:
        >>> consolidate("ckpt/step-00000100", "model.safetensors", ConvertOptions(dtype="bf16")).tensor_bytes
        1048576
    """
    started = time.perf_counter()
    target = as_path(source.locate(out))
    kind = output_format(target, convert.max_shard_size)
    refuse_overlap(target, src)
    if not write.dry_run:
        check_destination(target, write.force, write.notify)
    merge = None
    if merge_adapter is not None:  # LoRA's modules are imported by the commands that merge only
        from ckpttool.run.adapter import AdapterMerge, check_merge_target

        merge = AdapterMerge(merge_adapter, None, source.follow_symlinks, write.verify)
        check_merge_target(target)
    budget = 0 if write.dry_run else _max_memory(write) // 2  # half of --max-memory for coalesced reads
    with SourceFiles(source.follow_symlinks, budget) as files:
        planned = plan_output(src, target.name, kind, convert, source, write.threads, files,
                              merge.view if merge else None)
        if merge is not None:
            merge.plan(planned.plan)
        written, processes = write_output(planned, target, write, source, files, merge.patch if merge else None) \
            if not write.dry_run else ((), ())
        requests = files.requests
    report = report_of(planned, target, written, processes, write.verify and not write.dry_run, write.dry_run,
                       time.perf_counter() - started, requests)
    return replace(report, merged=merge.note()) if merge is not None else report


def plan_output(src: str | os.PathLike, name: str, kind: OutputFormat, convert: ConvertOptions,
                source: SourceOptions, threads: int, shared: SourceFiles | None = None,
                adapt: Callable[[Checkpoint, ModelView], tuple[Checkpoint, ModelView]] | None = None,
                config: Mapping[str, Any] | None = None, families: tuple[Family, ...] = ()) -> Planned:
    """Return consolidate's plan of `src` written as `kind` (`name`: the output's file name):
    read the source once, gate it, choose the entries, locate their bytes, find ties, plan.
    `shared` keeps the source's data files open for `write_output`; `adapt` may re-key the
    model view and stand in tensors (--merge-adapter: the base model's keys, the adapter left
    out, a 4-bit weight as its dequantised shape; the merge writes those). `config` is the
    model's config.json (default: the one beside the source): with a `--dtype`, quantised
    weights (FP8, MXFP4) are written dequantised and their scales left out; a float8 or packed
    tensor whose scale is missing or misshapen is refused, never cast. `families` (naming
    tables) convert a framework's model names to transformers' when the model is one of them."""
    detection, checkpoint = readers.read(source.locate(src), source.follow_symlinks, layout=source.layout)
    warnings = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    absent = next((p for p in warnings if p.code == integrity.PARAMETERS_ABSENT), None)
    if absent is not None and adapt is None:  # a whole model asked of a save that left parameters out
        raise InvalidCheckpoint(f"{checkpoint.path}: {absent.message.split(': ', 1)[-1]}; a full model cannot be written "
                                "from it (`export --adapter` writes the adapter; `--merge-adapter` merges it into its "
                                "base); nothing was written", code=integrity.PARAMETERS_ABSENT)
    view = find_model(checkpoint, source.model_prefix)
    if adapt is not None:
        checkpoint, view = adapt(checkpoint, view.require())
    selection = select(checkpoint, view, convert.rules, kind)
    family = None
    if families and not convert.everything:
        family = naming.find_family(selection.tensors, families, config, str(checkpoint.path))
    opened = shared.open(checkpoint.path) if shared is not None else DataFiles(checkpoint.path, source.follow_symlinks)
    with opened as files:
        left_out: tuple[tuple[str, str], ...] = ()
        if family is not None:  # from here on, the checkpoint as transformers names it
            left_out = check_left_out(checkpoint, selection, family, config, files, convert.drops)
            checkpoint, selection = converted(checkpoint, selection, family, config, files, threads)
        found = quantization.find(checkpoint,
                                  config if config is not None else quantization.config_beside(checkpoint.path))
        dequantize = found is not None and (convert.cast is not None or bool(convert.cast_map))
        quantized: dict[str, QuantizedWeight] = {}
        if dequantize:
            assert found is not None  # dequantize says there is a quantisation
            quantization.require_dequantizable(found, checkpoint.path)
            selection, quantized = quantization.dequantized_selection(selection, found)
        quantize = _to_quantize(checkpoint, selection, convert, found)
        tensors = {key: checkpoint.tensors[fqn] for key, fqn in selection.tensors.items()}
        scales = [checkpoint.tensors[weight.scale] for weight in quantized.values()]
        located = locating.locate_chunks(files, [*tensors.values(), *scales], threads)
        objects = load_objects(checkpoint, files, selection.objects) if kind.kind == "torch" else {}
        if convert.everything and kind.kind == "torch" and detection.layout == LIGHTNING:
            selection, objects = with_lightning_metadata(selection, objects, files, checkpoint.path)
        plain = {key: tensor for key, tensor in tensors.items() if key not in quantized}
        plan = plan_consolidate(
            checkpoint, selection, located, name=name, kind=kind, dtype=convert.cast, dtype_map=convert.cast_map,
            ties=find_ties(files, plain, located), drop_tied=convert.drop_tied, objects=objects, quantized=quantized,
            quantize=quantize,
        )
    return Planned(checkpoint, detection.describe(), view, convert.rules, kind, plan, warnings, found, dequantize,
                   tuple(quantize), family, detection.choice() or "", left_out)


def as_transformers(checkpoint: Checkpoint, config: Mapping[str, Any] | None, follow_symlinks: bool = False,
                    model_prefix: str | None = None) -> Checkpoint | None:
    """Return `checkpoint`'s model as transformers names it (`converted`), or None when its names
    are no framework family's (they are transformers' own already): what `diff --assets` and
    `ckpttool.open(assets=...)` read."""
    view = find_model(checkpoint, model_prefix if checkpoint.model_prefix is None else None)
    if view.prefix is None:
        return None
    selection = select(checkpoint, view, KeyRules(), OutputFormat("torch", False, None))
    if config is None:  # no config.json: a Megatron-LM checkpoint's own arguments, or NeMo 2's context/, make one
        saved = saved_config.beside(checkpoint.path, follow_symlinks)
        config = saved.config if saved is not None else None
    family = naming.find_family(selection.tensors, naming.FAMILIES, config, str(checkpoint.path))
    if family is None:
        return None
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        return converted(checkpoint, selection, family, config, files, model_only=True)[0]


def check_left_out(checkpoint: Checkpoint, selection: Selection, family: Family, config: Mapping[str, Any] | None,
                   files: DataFiles, drops: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Return (source key, rule) of each model tensor `family`'s table does not write. Raise
    InvalidCheckpoint (`dropped-tensor`) naming one whose absence changes the model's outputs (a
    non-zero router expert bias; a tied head whose bytes are not the embedding's) unless a
    `drops` glob names it: export never leaves out what the forward uses without being told."""
    tied = bool((config or {}).get("tie_word_embeddings", False))
    reasons = family.left_out(selection.tensors, tied)
    for key, why in reasons.items():
        tensor = checkpoint.tensors[selection.tensors[key]]
        if any(fnmatch.fnmatchcase(key, glob) for glob in drops):
            continue
        if not why.changes_forward and why.same_as not in selection.tensors:
            continue  # nothing to read: torch (200 MB of a process) is imported only when a tensor decides
        import torch  # reads the few small tensors that decide

        if why.changes_forward and bool((read_tensor(torch, files, tensor) != 0).any()):
            problem = "is not zero, and the router adds it to its expert scores"
        elif why.same_as in selection.tensors and not _same_bytes(
                torch, read_tensor(torch, files, tensor), read_tensor(torch, files, checkpoint.tensors[selection.tensors[why.same_as]])):
            problem = f"differs from {why.same_as}, which transformers uses for it under tie_word_embeddings"
        else:
            continue
        raise InvalidCheckpoint(f"{checkpoint.path}: {key} {problem}: writing the model without it ({why.rule}) changes "
                                f"its outputs; pass --drop '{why.glob}' to leave it out anyway; nothing was written",
                                code="dropped-tensor")
    return tuple((key, why.rule) for key, why in reasons.items())


def _same_bytes(torch: Any, a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def converted(checkpoint: Checkpoint, selection: Selection, family: Family, config: Mapping[str, Any] | None,
              files: DataFiles, threads: int = 4, model_only: bool = False) -> tuple[Checkpoint, Selection]:
    """Return the checkpoint as transformers names it (naming.converted_checkpoint: the
    family's table applied, each tensor's chunks raw byte ranges of the source's) and the
    selection of its model. Its python objects are kept (the trainer's step and config), or with
    `model_only` the model's alone. Reads only record headers (to locate the source chunks)."""
    where = str(checkpoint.path)
    settings = {**(config or {}), **naming.required_settings(family, config, where)}
    shapes = {key: checkpoint.tensors[fqn].shape for key, fqn in selection.tensors.items()}
    fqns = selection.tensors
    targets = {key: replace(target, pieces=tuple(replace(p, source=fqns[p.source]) for p in target.pieces))
               for key, target in naming.convert(family, shapes, settings, where).items()}
    sources = {piece.source for target in targets.values() for piece in target.pieces}
    located = locating.locate_chunks(files, [checkpoint.tensors[fqn] for fqn in sorted(sources)], threads)
    kept = dict(selection.objects) if model_only else {fqn: fqn for fqn in checkpoint.objects}
    view = naming.converted_checkpoint(checkpoint, targets, located, kept)
    paths = {key: (key,) for key in targets}
    paths.update({key: selection.paths.get(key, (key,)) for key in selection.objects})
    return view, Selection({key: key for key in targets}, dict(selection.objects), paths)


def _to_quantize(checkpoint: Checkpoint, selection: Selection, convert: ConvertOptions,
                 found: Quantization | None) -> dict[str, tuple[int, int]]:
    """Return the keys `--quantize fp8` writes as FP8 (key -> block): the projections'
    weights (plan.consolidate.quantizable); UsageError when there are none, or the source is
    quantised already."""
    if convert.quantize is None:
        return {}
    if found is not None:
        raise UsageError(f"{checkpoint.path}: already quantised ({found.scheme}); --quantize takes a bf16, fp16 or "
                         "fp32 source (dequantise it first with --dtype)")
    keys = {key: convert.block for key, fqn in selection.tensors.items()
            if quantizable(key, checkpoint.tensors[fqn])}
    if not keys:
        raise UsageError(f"{checkpoint.path}: --quantize fp8 found no 2-D projection weights (*_proj.weight) to quantise")
    return keys


def write_output(planned: Planned, target: Path, write: WriteOptions, source: SourceOptions,
                 shared: SourceFiles | None = None, patch: Patch | None = None,
                 ) -> tuple[tuple[Path, ...], tuple[ProcessStats, ...]]:
    """Return the files written at `target` by running `planned`'s plan, and what each process
    wrote (`shared`: the source's data files as `plan_output` left them open). `patch` runs on
    the written data before it is committed (--merge-adapter updates base weights in place)."""
    path = planned.checkpoint.path
    with shared.open(path) if shared is not None else DataFiles(path, source.follow_symlinks) as files:
        return _write(planned.plan, files, target, planned.kind, write, patch)


# what may change written outputs before their commit: (source data files, output name -> fd)
# -> the keys of the tensors it changed
Patch = Callable[[DataFiles, dict[str, int]], Iterable[str]]


def report_of(planned: Planned, target: Path, written: tuple[Path, ...], processes: tuple[ProcessStats, ...],
              verified: bool, dry_run: bool, seconds: float, requests: int = 0) -> ConsolidateReport:
    """Return the report of `planned` written (or not, with `dry_run`) at `target`."""
    plan = planned.plan
    return ConsolidateReport(
        source=planned.checkpoint.path, output=target, format=plan.format, files=written, tensors=len(plan.tensors),
        objects=len(plan.objects), tensor_bytes=plan.tensor_bytes, seconds=seconds, plan=plan, ties=plan.ties,
        dropped=plan.dropped, dry_run=dry_run, verified=verified, layout=planned.layout,
        selected=selection_text(planned.view, planned.rules), model_view=planned.view,
        problems=planned.problems, processes=processes, requests=requests, quantization=quantization_note(planned),
        source_choice=planned.source_choice, left_out=planned.left_out,
    )


def quantization_note(planned: Planned) -> str:
    """Say what happened to quantised weights: dequantised, passed through, or written by --quantize."""
    found = planned.quantization
    if planned.quantized_keys:
        return f"quantized {len(planned.quantized_keys)} projection weights to fine-grained FP8"
    if found is None or not found.weights:
        return ""
    block = f" {found.block[0]}x{found.block[1]}" if found.block else ""
    if planned.dequantized:
        return f"dequantized {len(found.weights)} {found.scheme}{block} weights (their scales left out)"
    return (f"{len(found.weights)} {found.scheme}{block} weights written as stored, with their scales "
            "(--dtype bf16 dequantizes them)")


def selection_text(view: ModelView, rules: KeyRules) -> str:
    """Say which entries consolidate exports, e.g. `model weights (the app.model. subtree,
    found by optimizer-state)`."""
    if rules.everything:
        return "every entry (--all), under its full name"
    where = f"the {view.prefix}. subtree" if view.prefix else "the top-level keys besides optimizer and training state"
    return f"model weights ({where}; {view.selected}: {view.reason})"


def with_lightning_metadata(selection: Selection, objects: dict[str, Any], files: DataFiles,
                            source: Path) -> tuple[Selection, dict[str, Any]]:
    """Return the selection and values with `meta.pt`'s top-level entries added beside the
    DCP ones (epoch, global_step, loops, hyper_parameters, ...), as Lightning's own
    `consolidate_checkpoint` merges them into its output."""
    where = f"{files.path(LIGHTNING_METADATA)}"
    meta = decode_object(blob_bytes(files, Blob(LIGHTNING_METADATA, 0, files.size(LIGHTNING_METADATA)), where), where)
    if not isinstance(meta, dict) or not all(isinstance(key, str) for key in meta):
        raise CorruptMetadata(f"{where}: not a dict of named entries (Lightning writes one)")
    clash = sorted(key for key in meta if key in selection.tensors or key in selection.objects
                   or any(path[0] == key for path in selection.paths.values()))
    if clash:
        raise CorruptMetadata(f"{where}: {clash[0]!r} is also an entry of {source}'s DCP state; which to keep is unclear")
    fqns = {key: f"{LIGHTNING_METADATA}:{key}" for key in meta}
    return (Selection(selection.tensors, {**selection.objects, **fqns}, {**selection.paths, **{k: (k,) for k in meta}}),
            {**objects, **meta})


def find_ties(files: DataFiles, tensors: dict[str, Tensor], located: locating.Located) -> tuple[Tie, ...]:
    """Return pairs (embedding-like key, head-like key) that hold the same tensor.

    Names and geometry are compared first; only a matching pair has its bytes compared, block
    by block, stopping at the first difference (an untied pair differs in its first block).
    """
    embeddings = [k for k in tensors if EMBEDDING_KEY.search(k)]
    ties = []
    for head in (k for k in tensors if HEAD_KEY.search(k)):
        for embedding in embeddings:
            a, b = tensors[embedding], tensors[head]
            if embedding == head or a.dtype != b.dtype or a.shape != b.shape:
                continue
            boxes_a = {(a.chunks[i].offsets, a.chunks[i].sizes): i for i in located[a.fqn]}
            boxes_b = {(b.chunks[i].offsets, b.chunks[i].sizes): i for i in located[b.fqn]}
            if boxes_a.keys() == boxes_b.keys() and all(
                _same_chunk(files, a, boxes_a[box], b, boxes_b[box], located) for box in boxes_a
            ):
                ties.append(Tie(embedding, head))
                break
    return tuple(ties)


def _same_chunk(files: DataFiles, a: Tensor, index_a: int, b: Tensor, index_b: int, located: locating.Located) -> bool:
    raw_a, raw_b = located[a.fqn][index_a], located[b.fqn][index_b]
    if raw_a is not None and raw_b is not None:
        if (raw_a.file, raw_a.offset) == (raw_b.file, raw_b.offset):
            return True  # one blob stored for both names
        return all(x == y for x, y in zip(iter_blocks(files, raw_a), iter_blocks(files, raw_b)))
    return read_chunk(files, a, a.chunks[index_a]) == read_chunk(files, b, b.chunks[index_b])


def load_objects(checkpoint: Checkpoint, files: DataFiles, keys: dict[str, str]) -> dict[str, Any]:
    """Return key -> python value of each selected non-tensor entry: plain values through an
    allowlist without torch, anything else with `torch.load(weights_only=True)`."""
    values = {}
    for key, fqn in keys.items():
        entry = checkpoint.objects[fqn]
        where = f"{files.path(entry.blob.file) if entry.blob else checkpoint.path}: {fqn}"
        values[key] = decode_object(object_bytes(files, entry), where)
    return values


def _write(plan: ConsolidatePlan, files: DataFiles, target: Path, kind: OutputFormat,
           write: WriteOptions, patch: Patch | None = None) -> tuple[tuple[Path, ...], tuple[ProcessStats, ...]]:
    started = time.perf_counter()
    names = [f.name for f in plan.files]
    written = tuple(target / name for name in names + ([plan.index_name] if plan.index_name else []))
    streamed = not write.verify and not plan.zip_layouts and patch is None  # written in order, never read back
    try:
        if distributed.active() is not None and patch is not None:
            raise UsageError("--merge-adapter runs in one process; run it without torchrun")
        if distributed.active() is not None:  # under torchrun: every process writes a share
            processes = distributed.write(
                sorted(plan.operations, key=execute.first_offset), target, names, directory=kind.sharded, force=write.force,
                prepare=lambda fds: _prepare_outputs(plan, fds),
                run_share=lambda operations, fds: _run(plan, operations, files, fds, write),
                finish=lambda temp, fds: _finish(plan, fds, temp if kind.sharded else None), streamed=streamed,
                notify=write.notify,
            )
            return (written if kind.sharded else (target,)), processes
        if not kind.sharded:
            with atomic_output(target, force=write.force, streamed=streamed, notify=write.notify) as handle:
                _fill(plan, files, {plan.files[0].name: io.writable(handle)}, write, patch)
        else:
            with atomic_directory(target, force=write.force, streamed=streamed, notify=write.notify) as output:
                with output.opened(names) as fds:
                    _fill(plan, files, fds, write, patch)
                if plan.index is not None:
                    assert plan.index_name is not None  # plan_consolidate names every index it makes
                    execute.write_file(output.path / plan.index_name, plan.index)
        moved = sum(op.output_length for op in plan.operations)
        return (written if kind.sharded else (target,)), (ProcessStats(0, moved, time.perf_counter() - started),)
    except OSError as error:
        raise WriteFailed(f"{target}: writing failed ({error.strerror or error}); nothing was left at the destination") from None


def _max_memory(write: WriteOptions) -> int:
    """--max-memory in bytes: WriteOptions parses a size like "512MB" when it is made."""
    return cast(int, write.max_memory)


def _fill(plan: ConsolidatePlan, files: DataFiles, fds: dict[str, int], write: WriteOptions,
          patch: Patch | None = None) -> None:
    _prepare_outputs(plan, fds)
    _run(plan, sorted(plan.operations, key=execute.first_offset), files, fds, write)
    patched = frozenset(patch(files, fds)) if patch is not None else frozenset()
    _finish(plan, fds, None, patched)


def _prepare_outputs(plan: ConsolidatePlan, fds: dict[str, int]) -> None:
    for output in plan.files:
        execute.reserve(fds[output.name], output.size)
        if output.head:
            write_at(fds[output.name], output.head, 0)


def _run(plan: ConsolidatePlan, operations: list, files: DataFiles, fds: dict[str, int], write: WriteOptions) -> None:
    """Write `operations` (all of the plan's, or this process's share) and optionally verify them."""
    total = sum(op.output_length for op in operations)
    threads, budget = write.threads, _max_memory(write)
    with write.progress("consolidate", total) as bar, io.Writeback(fds) as writeback:
        execute.run(operations, files, fds, threads=threads, max_memory=budget, on_done=bar.update,
                    on_written=writeback.written)
    if write.verify:
        def describe(op) -> str:  # by output position: a process's share holds parts of operations
            at = execute.first_offset(op)
            where = next((t for t in plan.tensors if t.file == op.dst and t.offset <= at < t.offset + max(1, t.nbytes)), None)
            return f"{where.file}: {where.key} (from {where.fqn})" if where else f"{op.dst}: byte {at}"

        with write.progress("verify", total) as bar:
            execute.verify(operations, files, fds, threads=threads, max_memory=budget, describe=describe,
                           on_done=bar.update)


def _finish(plan: ConsolidatePlan, fds: dict[str, int], directory: Path | None,
            patched: frozenset[str] = frozenset()) -> None:
    """Write what depends on all the data (.pt zip records; the index into `directory`), fsync.
    A `patched` tensor's CRC is computed from its written bytes, not from its source's."""
    for name, layout in plan.zip_layouts.items():
        crcs = {
            f"{ptfile.ARCHIVE}/data/{position}": execute.output_crc(
                fds[name], t.offset, t.nbytes, () if t.key in patched else t.operations)
            for position, t in enumerate(t for t in plan.tensors if t.file == name)
        }
        for offset, data in ptfile.zip_records(layout, crcs):
            write_at(fds[name], data, offset)
    for fd in fds.values():
        io.sync(fd)
    if directory is not None and plan.index is not None:
        assert plan.index_name is not None  # plan_consolidate names every index it makes
        execute.write_file(directory / plan.index_name, plan.index)
