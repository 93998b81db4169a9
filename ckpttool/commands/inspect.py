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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence, overload

from ckpttool import readers
from ckpttool.core.checkpoint import Checkpoint, ChunkTable, Tensor, paused_gc
from ckpttool.core.geometry import COLUMN_LIMIT, Sharding, classify, classify_columns, column_volumes
from ckpttool.core.errors import CheckpointError, InvalidCheckpoint
from ckpttool.model.model_view import ModelView, find_model, normalise
from ckpttool.source_options import SourceOptions
from ckpttool.formats.dcp import DATA_FILE_PATTERN
from ckpttool.formats.fp8 import ALL_FLOAT8
from ckpttool.formats.mxfp4 import BLOCKS
from ckpttool.formats.model_config import config_beside
from ckpttool.store.safepaths import is_safe_relative_path

if TYPE_CHECKING:
    import numpy as np

    from ckpttool.naming import Family

GROUPS = ("model", "optimizer", "other")


class ChunkInfo(NamedTuple):
    """One chunk as inspect reports it (a NamedTuple: there may be 100k+ of them)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    offset: int | None  # byte offset of the blob in its file
    length: int | None  # blob length in bytes (torch.save record, with its small header)
    nbytes: int  # element bytes of the chunk


class ChunkInfos(Sequence[ChunkInfo]):
    """The chunks of a tensor read as a `ChunkTable`, as inspect reports them: the table's
    columns and `nbytes` (int64 element bytes per row). A sequence of `ChunkInfo` (each built
    when asked for); render reads the columns.
    """

    __slots__ = ("table", "nbytes")

    def __init__(self, table: ChunkTable, nbytes: "np.ndarray"):
        self.table, self.nbytes = table, nbytes

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, index: int) -> ChunkInfo: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ChunkInfo, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        chunk = self.table[index]
        blob, nbytes = chunk.blob, int(self.nbytes[index])
        if blob is None:
            return ChunkInfo(chunk.offsets, chunk.sizes, None, None, None, nbytes)
        return ChunkInfo(chunk.offsets, chunk.sizes, blob.file, blob.offset, blob.length, nbytes)

    def __iter__(self) -> Iterator[ChunkInfo]:
        for chunk, nbytes in zip(self.table, self.nbytes.tolist()):
            blob = chunk.blob
            if blob is None:
                yield ChunkInfo(chunk.offsets, chunk.sizes, None, None, None, nbytes)
            else:
                yield ChunkInfo(chunk.offsets, chunk.sizes, blob.file, blob.offset, blob.length, nbytes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ChunkInfos, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkInfos({self.table!r})"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry: its group, dtype, shape, sizes, how it is sharded, and its chunks."""

    fqn: str
    group: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    sharding: Sharding
    chunks: tuple[ChunkInfo, ...] | ChunkInfos  # ChunkInfos when the checkpoint holds a ChunkTable


@dataclass(frozen=True)
class ObjectInfo:
    """One non-tensor entry (a pickled python object) and the file and bytes that hold it."""

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
    """What one group (model, optimizer, other) holds: entries, elements, element bytes."""

    tensors: int
    objects: int
    numel: int
    nbytes: int


@dataclass(frozen=True)
class Summary:
    """The whole checkpoint's counts, as the first lines of `ckpttool inspect` show them."""

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
class AdapterInfo:
    """One LoRA adapter of the model: what `export --adapter` would write."""

    name: str
    modules: tuple[tuple[str, int], ...]  # (module path, rank)
    targets: tuple[str, ...]
    ranks: tuple[int, ...]
    trainable: int  # the adapter's elements
    frozen: int  # the base model's elements
    dora: bool
    saved: tuple[str, ...]  # modules_to_save keys


@dataclass(frozen=True)
class InspectReport:
    """What `inspect` returns: the summary, groups, entries (filtered), files and what the
    model is (its view, LoRA adapters, quantisation, naming family)."""

    path: Path
    summary: Summary
    groups: dict[str, GroupInfo]
    tensors: tuple[TensorInfo, ...]
    objects: tuple[ObjectInfo, ...]
    files: tuple[FileInfo, ...]
    filters: tuple[str, ...] = ()
    layout: str = "dcp"  # readers.detect's name for the on-disk layout
    model_view: ModelView | None = None  # where the model was found, and why
    adapters: tuple[AdapterInfo, ...] = ()  # LoRA adapters found in the model (lora.find_lora)
    adapter_problem: str | None = None  # why the model's LoRA keys do not form adapters
    quantization: QuantizationInfo | None = None  # the model's quantised weights (FP8, MXFP4)
    family: str | None = None  # the framework family whose names the model uses (naming tables)
    architectures: tuple[str, ...] = ()  # the transformers architectures that family converts to
    hf_names: dict[str, tuple[str, ...]] | None = None  # fqn -> its transformers names, when a family is found
    named_by: tuple[str, str] | None = None  # (architecture, config source) that chose among families sharing the names
    found: str | None = None  # where SRC is not itself the checkpoint: which one was read and what else is there
    notes: tuple[str, ...] = ()  # what the reader says of the save (DeepSpeed: frozen parameters not saved)


@dataclass(frozen=True)
class QuantizationInfo:
    """The model's quantised weights as inspect reports them (`quantization.find`)."""

    scheme: str  # fp8 | compressed-tensors | mxfp4 (the config's quant_method where it names one)
    layouts: tuple[str, ...]  # fp8-block, fp8-tensor, fp8-channel, mxfp4
    block: tuple[int, int] | None  # FP8 blocks; MXFP4's groups are 32 values
    weights: int  # quantised weights
    packed_bytes: int  # their codes and scales as stored
    scale_bytes: int
    parameters: int  # the model's elements with each quantised weight counted dequantised
    problems: tuple[str, ...]  # missing or misshapen scales (validate fails on them)


def matches(fqn: str, patterns: Sequence[str]) -> bool:
    """True when no patterns are given or the fqn matches one of the globs."""
    return not patterns or any(fnmatch.fnmatchcase(fqn, p) for p in patterns)


def _tensor_info(tensor: Tensor, group: str) -> TensorInfo:
    if isinstance(tensor.chunks, ChunkTable) and (info := _table_info(tensor, group)) is not None:
        return info
    chunks = tuple(
        ChunkInfo(c.offsets, c.sizes, c.blob.file, c.blob.offset, c.blob.length, c.numel * tensor.itemsize)
        if c.blob else ChunkInfo(c.offsets, c.sizes, None, None, None, c.numel * tensor.itemsize)
        for c in tensor.chunks
    )
    sharding = classify([(c.offsets, c.sizes) for c in tensor.chunks], tensor.shape)
    return TensorInfo(tensor.fqn, group, tensor.dtype, tensor.shape, tensor.numel,
                      tensor.nbytes, sharding, chunks)


def _table_info(tensor: Tensor, group: str) -> TensorInfo | None:
    """`_tensor_info` from a table's columns, or None when its sizes are too large for them."""
    table = tensor.chunks
    assert isinstance(table, ChunkTable)  # _tensor_info asks for tables only
    volumes = column_volumes(table.sizes)
    sharding = classify_columns(table.sizes, tensor.shape, volumes)
    if volumes is None or sharding is None or (len(table) and int(volumes.max()) >= COLUMN_LIMIT // max(tensor.itemsize, 1)):
        return None
    return TensorInfo(tensor.fqn, group, tensor.dtype, tensor.shape, tensor.numel, tensor.nbytes, sharding,
                      ChunkInfos(table, volumes * tensor.itemsize))


def _add_file_bytes(tensors: list[TensorInfo], referenced: Counter[str], per_file_group: dict[str, Counter[str]]) -> None:
    """Add each chunk's blob length to its file in `referenced`, and its element bytes to its
    file and group in `per_file_group`: per chunk for tuples, at once for all ChunkInfos."""
    tables: list[tuple[int, ChunkInfos]] = []
    for info in tensors:
        if isinstance(info.chunks, ChunkInfos):
            tables.append((GROUPS.index(info.group), info.chunks))
            continue
        for chunk in info.chunks:
            if chunk.file is not None:
                referenced[chunk.file] += chunk.length or 0
                per_file_group[chunk.file][info.group] += chunk.nbytes
    if tables and not _add_table_file_bytes(tables, referenced, per_file_group):
        for group, chunks in tables:
            for chunk in chunks:
                if chunk.file is not None:
                    referenced[chunk.file] += chunk.length or 0
                    per_file_group[chunk.file][GROUPS[group]] += chunk.nbytes


def _add_table_file_bytes(tables: list[tuple[int, ChunkInfos]], referenced: Counter[str],
                          per_file_group: dict[str, Counter[str]]) -> bool:
    """`_add_file_bytes` for tables: each table's rows added into int64 totals per file and
    group where they lie, by the C reader's `file_sums` (no array made per table); False, with
    nothing added, when the C reader is not built or a sum would pass int64."""
    try:
        from ckpttool.readers._dcpscan import file_sums
    except ImportError:  # not built: no .metadata is read into tables either
        return False
    import numpy as np

    names: dict[str, int] = {}
    bins: dict[int, tuple[tuple[str, ...], Any]] = {}  # id of a table's files -> (them, their first bins)
    for _, chunks in tables:
        files = chunks.table.files
        # by the tuple's id (the tuple kept beside its bins): hashing 10k names a table costs
        if (found := bins.get(id(files))) is None or found[0] is not files:
            numbers = [names.setdefault(name, len(names)) for name in files]
            bins[id(files)] = (files, np.array(numbers, dtype=np.int64) * len(GROUPS))
    counts, length_totals, byte_totals = (np.zeros(len(names) * len(GROUPS), dtype=np.int64) for _ in range(3))
    for group_number, chunks in tables:
        table = chunks.table
        if not file_sums(len(table), table.file, table.blob_length, chunks.nbytes, bins[id(table.files)][1],
                         group_number, counts, length_totals, byte_totals):
            return False
    used = np.flatnonzero(counts)
    file_names = list(names)
    for bin_number, length_sum, byte_sum in zip(used.tolist(), length_totals[used].tolist(), byte_totals[used].tolist()):
        name = file_names[bin_number // len(GROUPS)]
        referenced[name] += length_sum
        per_file_group[name][GROUPS[bin_number % len(GROUPS)]] += byte_sum
    return True


# data files named for the rank that wrote them: torch HF writer's shard-{rank + 1}-model-...,
# verl's model_world_size_{W}_rank_{rank}.pt
# patterns compiled when first matched (re's cache): a DCP checkpoint's files never need them
_HF_SHARD = r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$"
_VERL_RANK = r"^model_world_size_\d+_rank_(\d+)\.pt$"


def rank_of(file: str) -> int | None:
    """Return the rank that wrote `__{rank}_{n}.distcp` (and the HF writer's and verl's
    per-rank files), or None for other names."""
    name = os.path.basename(file)
    if match := DATA_FILE_PATTERN.match(name) or re.match(_VERL_RANK, name):
        return int(match.group(1))
    match = re.match(_HF_SHARD, name)
    return int(match.group(1)) - 1 if match else None


def inspect(src: str | os.PathLike, filters: Sequence[str] = (), source: SourceOptions = SourceOptions()) -> InspectReport:
    """Return what the checkpoint at `src` holds, reading only its `.metadata`.

    `filters` are fqn globs (`model.layers.*`); summary, groups and files count all entries,
    `tensors` and `objects` list only the matching ones. The model group is found from the
    structure (`model_view.find_model`) unless `source.model_prefix` names it.
    """
    detection, checkpoint = readers.read(source.locate(src), layout=source.layout)
    config = config_beside(checkpoint.path)
    with paused_gc():
        report = build_report(checkpoint, tuple(filters), detection.layout, source.model_prefix, config)
    return replace(report, found=detection.describe()) if detection.found_below else report


def build_report(checkpoint: Checkpoint, filters: tuple[str, ...] = (), layout: str = "dcp",
                 model_prefix: str | None = None, config: dict | None = None) -> InspectReport:
    """Return the inspect report of already-read metadata (`config`: the model's config.json,
    which names its quantisation)."""
    view = find_model(checkpoint, model_prefix)
    tensors = [_tensor_info(t, view.group(t.fqn)) for t in checkpoint.tensors.values()]
    objects = [
        ObjectInfo(o.fqn, view.group(o.fqn), o.blob.file if o.blob else None, o.blob.length if o.blob else None)
        for o in checkpoint.objects.values()
    ]

    referenced: Counter[str] = Counter()
    per_file_group: dict[str, Counter[str]] = defaultdict(Counter)
    _add_file_bytes(tensors, referenced, per_file_group)
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
    adapters, adapter_problem = _adapters(checkpoint, view)
    quantized = _quantization(checkpoint, config, {t.fqn for t in tensors if t.group == "model"})
    family, names, named_by = _family(checkpoint, view, config)
    if quantized is not None:
        summary = replace(summary, parameters=quantized.parameters)
    return InspectReport(
        checkpoint.path, summary, groups, tensors=tuple(t for t in tensors if matches(t.fqn, filters)),
        objects=tuple(o for o in objects if matches(o.fqn, filters)), files=tuple(files), filters=filters,
        layout=layout, model_view=view, adapters=adapters, adapter_problem=adapter_problem, quantization=quantized,
        family=family.name if family else None, architectures=family.architectures if family else (), hf_names=names,
        named_by=named_by, notes=checkpoint.notes,
    )


def _family(checkpoint: Checkpoint, view: ModelView, config: dict | None = None
            ) -> tuple[Family | None, dict[str, tuple[str, ...]] | None, tuple[str, str] | None]:
    """Return the framework family the model's names belong to, fqn -> transformers names, and
    the (architecture, config source) that chose the family when several share the names
    (Megatron's GPT, Qwen-MoE and Mixtral tables): config.json beside the checkpoint, else the
    Megatron-LM arguments in common.pt, as export reads them; without either, the first family
    whose rules take every key. Megatron-LM's arguments name the architecture for one family too
    (export needs no --assets then)."""
    if view.prefix is None:
        return None, None, None
    from ckpttool import naming  # the signatures: only when there is a model to name

    keys = {normalise(key): fqn for fqn, key in view.keys.items() if fqn in checkpoint.tensors}  # DDP's module. too
    found = naming.candidates(keys)
    if not found:
        return None, None, None  # no framework's names: neither the engine nor the tables are imported
    source = "config.json" if config is not None else None
    if config is None and (saved := _saved_config(checkpoint.path)) is not None:
        config, source = saved  # what export reads without --assets
    architectures = (config or {}).get("architectures") or []
    named_by = (architectures[0], source) if architectures and source and \
        (len(found) > 1 or source != "config.json") else None
    try:
        family = naming.find_family(keys, naming.FAMILIES, config if named_by else None, str(checkpoint.path))
    except InvalidCheckpoint:  # a config.json of another model beside it: inspect names what the keys say
        family, named_by = naming.find_family(keys, naming.FAMILIES), None
    if family is None:
        return None, None, None
    main_layers = naming.main_layer_count(keys)
    return family, {fqn: naming.hf_names(family, key, checkpoint.tensors[fqn].shape, main_layers)
                    for key, fqn in keys.items()}, named_by


def _saved_config(path: Path | str) -> tuple[dict, str] | None:
    """The config.json the save itself states (what export reads without --assets) and which of
    its files states it (naming/saved_config.py); None for any other source, or one no
    transformers config represents (export says which)."""
    from ckpttool.naming import saved_config

    try:
        saved = saved_config.beside(path)
    except CheckpointError:
        return None
    return (saved.config, saved.label) if saved is not None else None


def _quantization(checkpoint: Checkpoint, config: dict | None, model: set[str]) -> QuantizationInfo | None:
    """Return the model's quantised weights, counted (None when it has none)."""
    if config is None and not any(t.dtype in ALL_FLOAT8 or t.fqn.endswith(BLOCKS) for t in checkpoint.tensors.values()):
        return None  # the common case, checked cheaply (and without importing the quantisation code)
    from ckpttool.model import quantization

    found = quantization.find(checkpoint, config)
    if found is None:
        return None
    return QuantizationInfo(
        found.scheme, tuple(sorted({w.layout for w in found.weights.values()})), found.block, len(found.weights),
        found.packed_bytes, found.scale_bytes, found.dequantized_parameters(checkpoint.tensors, model),
        tuple(message for _, message in found.problems))


def _adapters(checkpoint: Checkpoint, view: ModelView) -> tuple[tuple[AdapterInfo, ...], str | None]:
    """Return the model's LoRA adapters, or why its LoRA keys do not form any."""
    if view.prefix is None or not any("lora_" in key or ".modules_to_save." in key for key in view.keys):
        return (), None  # the common case, checked cheaply: a million-tensor model pays one scan of its names
    from ckpttool.model.lora import find_lora, model_shapes  # only for a model with LoRA keys

    try:
        layout = find_lora(model_shapes(checkpoint, view)[0])
    except InvalidCheckpoint as error:
        return (), str(error)
    if layout is None:
        return (), None
    return tuple(
        AdapterInfo(a.name, tuple((m.path, m.rank) for m in a.modules), a.targets, a.ranks, layout.trainable(a),
                    layout.frozen, any(m.magnitude_key for m in a.modules), tuple(a.saved))
        for a in layout.adapters
    ), None
