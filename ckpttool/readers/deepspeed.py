"""Read DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) without DeepSpeed and without torch.

A ZeRO save (deepspeed/runtime/engine.py `save_checkpoint`, tag folder `global_stepN` beside a
`latest` file) holds:

- `mp_rank_00_model_states.pt` (stage 1/2) or `zero_pp_rank_R_mp_rank_00_model_states.pt`
  (stage 3, one per rank): `module` (the module's state dict: 16-bit or fp32 weights at stage
  1/2, empty placeholders at stage 3, and the buffers), `buffer_names`, `param_shapes` (one
  ordered name -> shape map per flat group, in flat order), `frozen_param_shapes` and
  `frozen_param_fragments` (stage >= 2 only), `shared_params` (tied name -> the name holding
  the data), `ds_version`.
- `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, one per data-parallel rank, whose
  `optimizer_state_dict` holds the rank's fp32 master partitions and the base optimizer's
  state over the same flat layout:
  - stage 1/2 (runtime/zero/stage_1_and_2.py `state_dict`): per param group one flat vector
    (the group's params in `param_shapes` order, each followed by its
    `param_alignment_paddings` entry, the whole padded to a multiple of 2 x world and split
    into `partition_count` equal parts); rank R saves part R as
    `single_partition_of_fp32_groups[g]` with its trailing `group_paddings[g]` stripped, and
    `base_optimizer_state` is torch's optimizer state dict over those parts (padded, or
    stripped when DeepSpeed's elastic checkpoint saved a list of states).
  - stage 3 (runtime/zero/stage3.py `_rigid_state_dict`): every parameter is split on its
    own into `ceil(numel / world)` elements per rank (the last rank's zero-padded); a rank's
    parts, in `param_shapes` order, fill its `fp32_flat_groups` (one per sub-group) and
    `optimizer_state_dict` is torch's optimizer state dict over those sub-groups: before
    saving, `_set_fp32_optimizer_param_groups` appends each sub-group's flat vector to its
    param group (`sub_group_to_group_id`), so group g's `params` lists its sub-groups.

So each parameter is a flat element range of one or more ranks' partitions. Every partition is
a storage inside a torch.save zip, so each piece of a parameter is a byte range of an optim
file: a partial row, whole rows and a partial row (`geometry.flat_boxes`), kept as raw-range
blobs. Nothing but the pickles is read; no tensor is decoded.

The checkpoint is given as `get_state_dict(model, AdamW)` lays out an FSDP2 model
(train_minimal/checkpoint.py): `model.<name>` the fp32 master weights, frozen parameters (from
`frozen_param_fragments`, or at stage 1, which does not save them, from `module`) and
persistent buffers as stored, tied names as their source's chunks; and
`optim.state.<name>.<key>` (`exp_avg`, `exp_avg_sq`, `step`, ...) per trained parameter: a
tensor state as its bytes, a plain number (DeepSpeedCPUAdam's and FusedAdam's int `step`) as
the value itself, which torch's Adam/AdamW `load_state_dict` turns into its float32 step.

What a save leaves out is never dropped silently: a trainable parameter no optimizer owns is
kept from `module` at stage 1/2 and refused by name at stage 3 (whose `module` holds only an
empty placeholder for it); a save made with `exclude_frozen_parameters` (HF Trainer with PEFT)
says in `Checkpoint.notes` that its frozen parameters are absent (`EXCLUDED_FROZEN`).

The pickles name DeepSpeed classes (`LossScaler`, `ZeroStageEnum`, `fragment_address`, ...):
the checking loader builds inert stand-ins for exactly those (`_ALLOWED`), never importing
DeepSpeed and never running anything from the file. DeepSpeed's universal checkpoints are read
by readers/deepspeed_universal.py with the pieces below.

Example:
    >>> checkpoint = read_deepspeed("runs/x/global_step2")
    >>> [c.offsets for c in checkpoint.tensors["model.lm_head.weight"].chunks]
    [(0, 0), (18, 0), (18, 5), (19, 0)]
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import (EXCLUDED_FROZEN, Blob, Checkpoint, Chunk, ChunkTable, Object, Tensor, as_path,
                                     raw_range_transforms, refuse_bad_names)
from ckpttool.core.errors import CorruptMetadata, MissingFile, NotACheckpoint, UnsupportedFormat
from ckpttool.core.geometry import flat_boxes
from ckpttool.dcp.blobs import DataFiles
from ckpttool.readers.detect import DEEPSPEED_MODEL_PATTERN, DEEPSPEED_OPTIM_PATTERN
from ckpttool.store import storage
from ckpttool.torchsave.archive import saved_value
from ckpttool.torchsave.pickle import dumps
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED, _Rebuilt
from ckpttool.torchsave.stored import StateDictUnpickler, device, file_entries, ints, load_data_pkl, raw_blob, stored_dtype
from ckpttool.torchsave.zip import Entry

MODEL_STATES, OPTIM_STATES = DEEPSPEED_MODEL_PATTERN, DEEPSPEED_OPTIM_PATTERN
PIPELINE_LAYER = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
# get_state_dict(model, optimizer) saved as {"model": ..., "optim": ...} (train_minimal/checkpoint.py)
MODEL_PREFIX, OPTIM_STATE, OPTIM_GROUPS = "model", ("optim", "state"), ("optim", "param_groups")
# the note a save made with `save_checkpoint(..., exclude_frozen_parameters=True)` carries
# (engine.py `_save_checkpoint`: frozen parameters deleted from `module`, frozen_param_shapes None)
NOTE_NAMES = 3  # names a note lists before "..."


# ---------------------------------------------------------------------------------------------
# Stand-ins: what each admitted DeepSpeed global becomes (nothing here runs code from the file)


class _Record:
    """An admitted DeepSpeed class (LossScaler, DynamicLossScaler, fragment_address, ...):
    NEWOBJ makes an empty one; its BUILD state is dropped (builds_as_pops)."""

    def __init__(self, *args: Any) -> None:
        pass


def _record(name: str) -> type:
    return type(name, (_Record,), {})


def _enum_value(value: Any) -> Any:
    """`ZeroStageEnum(2)` (REDUCE of an Enum class with its value): the value."""
    return value


_TENSOR_CLASS = _record("Tensor")  # `torch.Tensor`, only passed to _rebuild_from_type_v2
_REBUILDS = (_TENSOR_PICKLE_ALLOWED[("torch._utils", "_rebuild_tensor_v2")],
             _TENSOR_PICKLE_ALLOWED[("torch._utils", "_rebuild_tensor_v3")])


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """`torch._tensor._rebuild_from_type_v2`: stage 3 pickles its fp32 partitions, plain
    tensors carrying attributes, so. Only our own tensor stand-in is called, on its args."""
    if func not in _REBUILDS or new_type is not _TENSOR_CLASS or not isinstance(args, tuple):
        raise CorruptMetadata("_rebuild_from_type_v2 of something other than a plain tensor")
    return func(*args)


def _parameter(data: Any, *rest: Any) -> Any:
    """`torch._utils._rebuild_parameter(_with_state)`: an nn.Parameter is its tensor."""
    return data


_DS_RECORDS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **_TENSOR_PICKLE_ALLOWED,  # _rebuild_tensor_v2/v3, typed storages, OrderedDict, torch.Size
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch", "device"): device,
    ("torch", "Tensor"): _TENSOR_CLASS,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _enum_value,
    **{key: _record(key[1]) for key in _DS_RECORDS},
}


class _Unpickler(StateDictUnpickler):
    """The checking loader with DeepSpeed's allowlist: a refused name is named in one line."""

    holds = "a DeepSpeed ZeRO checkpoint"


# ---------------------------------------------------------------------------------------------
# Files and their pickles


@dataclass(frozen=True)
class SaveFiles:
    """The files of one ZeRO tag folder (or the model states files a universal checkpoint copies)."""

    model: str  # the model states file holding param_shapes (rank 0's at stage 3)
    model_per_rank: dict[int, str]  # stage 3: rank -> its model states file
    optim: dict[int, str]  # data-parallel rank -> its optim states file


def listing(folder: Path) -> list[str]:
    """Return the names in `folder`, sorted (local or object storage)."""
    return sorted(entry.name for entry in folder.iterdir()) if storage.is_remote(folder) else sorted(os.listdir(folder))


def model_files(names: list[str]) -> tuple[str | None, dict[int, str]]:
    """Return (the model states file holding param_shapes, or None; stage 3's rank -> file)."""
    matched = {name: m for name in names if (m := MODEL_STATES.match(name))}
    per_rank = {int(m.group(1)): name for name, m in matched.items() if m.group(1) is not None}
    plain = [name for name, m in matched.items() if m.group(1) is None]
    return (plain[0] if plain else per_rank.get(0)), per_rank


def _files(folder: Path) -> SaveFiles:
    names = listing(folder)
    models = {name: m for name in names if (m := MODEL_STATES.match(name))}
    optims = {name: m for name in names if (m := OPTIM_STATES.match(name))}
    if not optims:
        raise NotACheckpoint(f"{folder}: no *_optim_states.pt files; not a DeepSpeed ZeRO save")
    mp_ranks = {int(m.group(2)) for m in (*models.values(), *optims.values())}
    if mp_ranks != {0}:
        raise UnsupportedFormat(f"{folder}: tensor-parallel ranks mp_rank_{max(mp_ranks):02d} present; this build reads "
                                "ZeRO saves with one model-parallel rank; convert with DeepSpeed's ds_to_universal first")
    if any(PIPELINE_LAYER.match(name) for name in names):
        raise UnsupportedFormat(f"{folder}: pipeline-parallel layer_XX-model_states.pt files; this build reads ZeRO "
                                "saves without pipeline parallelism; convert with DeepSpeed's ds_to_universal first")
    optim: dict[int, str] = {}
    for name, match in optims.items():
        rank = int(match.group(1))
        if rank in optim:
            raise CorruptMetadata(f"{folder}: two optim states files for rank {rank}: {optim[rank]} and {name}")
        optim[rank] = name
    model, per_rank = model_files(names)
    if model is None:
        raise MissingFile(f"{folder}: no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt "
                          "(it holds the parameter names and shapes; was the save interrupted?)")
    return SaveFiles(model, per_rank, optim)


class Stored(NamedTuple):
    """A tensor stored in one of the save's files: its bytes, dtype and element count."""

    blob: Blob
    dtype: str
    numel: int


class _Archive(NamedTuple):
    """A torch.save zip: its directory, how to read it, its size."""

    entries: dict[str, Entry]
    read: Callable[[int, int], bytes]
    size: int


class PickleReader:
    """One folder's pickles, each checked and built from stand-ins, with byte ranges."""

    def __init__(self, files: DataFiles, folder: Path) -> None:
        self.files, self.folder = files, folder
        self.archives: dict[str, _Archive] = {}
        self.starts: dict[str, dict[str, int]] = {}
        self.states: dict[str, Any] = {}

    def load(self, name: str, whole: bool = True) -> Any:
        """Return file `name`'s pickle built from stand-ins (read once): a dict, or with
        `whole=False` any value (a universal checkpoint's bare tensor)."""
        if name in self.states:
            return self.states[name]
        where = str(self.folder / name)
        size = self.files.size(name)

        def read(offset: int, length: int) -> bytes:
            return self.files.read(name, offset, length)

        entries = file_entries(read, size, where)
        state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED)
        if whole and not isinstance(state, dict):
            raise CorruptMetadata(f"{where}: holds a {type(state).__name__}, not DeepSpeed's state dict")
        self.archives[name] = _Archive(entries, read, size)
        self.starts[name] = {}
        self.states[name] = state
        return state

    def stored(self, name: str, value: Any, here: str) -> Stored:
        """Return where a tensor of file `name` is stored, its dtype and element count."""
        if not isinstance(value, _Rebuilt):
            raise CorruptMetadata(f"{here}: expected a tensor, found a {type(value).__name__}")
        dtype = stored_dtype(value, here)
        archive = self.archives[name]
        blob = raw_blob(archive.entries, self.starts[name], archive.read, archive.size, here, name, value, dtype)
        return Stored(blob, dtype, math.prod(ints(value.shape, f"{here}: shape")))


# ---------------------------------------------------------------------------------------------
# Flat partitions -> chunks


class Piece(NamedTuple):
    """Elements [start, stop) of a parameter (flattened), which rank `rank` holds in its flat
    vector number `flat_index` from element `flat_offset` on."""

    rank: int
    flat_index: int
    flat_offset: int
    start: int
    stop: int


@dataclass
class Param:
    """A trained parameter: its name, shape, optimizer param group and pieces on the ranks."""

    name: str
    shape: tuple[int, ...]
    group: int
    pieces: list[Piece] = field(default_factory=list)


def _chunks(param: Param, flats: dict[int, list[Stored]], where: str, what: str) -> tuple[str, tuple[Chunk, ...]]:
    """Return (dtype, chunks) of `param` read from `flats` (rank -> flat vectors)."""
    chunks, dtype = [], None
    for piece in param.pieces:
        flat = flats[piece.rank][piece.flat_index]
        length = piece.stop - piece.start
        if piece.flat_offset + length > flat.numel:
            raise CorruptMetadata(f"{where}: rank {piece.rank}: {param.name}: {what} elements [{piece.flat_offset}, "
                                  f"{piece.flat_offset + length}) run past its {flat.numel}-element flat partition")
        if dtype is not None and flat.dtype != dtype:
            raise CorruptMetadata(f"{where}: {param.name}: {what} partitions of dtypes {dtype} and {flat.dtype}")
        dtype = flat.dtype
        itemsize = dtypes.ITEMSIZE[dtype]
        for offsets, sizes, first in flat_boxes(param.shape, piece.start, piece.stop):
            offset = flat.blob.offset + (piece.flat_offset + first - piece.start) * itemsize
            chunks.append(Chunk(offsets, sizes, Blob(flat.blob.file, offset, math.prod(sizes) * itemsize,
                                                      raw_range_transforms())))
    return dtype or "float32", tuple(sorted(chunks))


def _stage12_pieces(params: list[Param], sizes: list[int], paddings: list[int], alignment: list[int] | None,
                    world_size: int, group: int, where: str) -> None:
    """Place each param of flat group `group` on the ranks (stage 1/2): `sizes[r]` the
    elements rank r saved, `paddings[r]` what it stripped; each part is equally long."""
    parts = {size + pad for size, pad in zip(sizes, paddings)}
    if len(parts) != 1:
        raise CorruptMetadata(f"{where}: param group {group}: partition sizes (saved + padding) differ across ranks: "
                              f"{sorted(parts)[:4]}")
    part = parts.pop()
    if alignment is not None and len(alignment) != len(params):
        raise CorruptMetadata(f"{where}: param group {group}: {len(alignment)} alignment paddings for {len(params)} parameters")
    offset = 0
    for i, param in enumerate(params):
        numel = math.prod(param.shape)
        stop = offset + numel
        for rank in range(offset // part if part else 0, world_size):
            lo, hi = max(offset, rank * part), min(stop, rank * part + sizes[rank])
            if rank * part >= stop:
                break
            if hi > lo:
                param.pieces.append(Piece(rank, group, lo - rank * part, lo - offset, hi - offset))
        if sum(piece.stop - piece.start for piece in param.pieces) != numel:
            raise CorruptMetadata(f"{where}: {param.name}: elements [{offset}, {stop}) of param group {group} are not all "
                                  f"saved (the ranks hold {sum(sizes)} of its {world_size * part} elements)")
        offset = stop + (alignment[i] if alignment is not None else 0)
    if offset > world_size * part:
        raise CorruptMetadata(f"{where}: param group {group}: its parameters need {offset} elements, the partitions "
                              f"hold {world_size * part}")


def _stage3_pieces(params: list[Param], flat_sizes: list[list[int]], world_size: int, where: str) -> None:
    """Place every param on the ranks (stage 3): each is split on its own into
    ceil(numel / world) elements per rank, laid one after the other over the sub-groups."""
    bounds = [0]
    for size in flat_sizes[0]:
        bounds.append(bounds[-1] + size)
    for rank, sizes in enumerate(flat_sizes):
        if sizes != flat_sizes[0]:
            raise CorruptMetadata(f"{where}: rank {rank}'s fp32 sub-groups hold {sizes[:4]} elements, rank 0's "
                                  f"{flat_sizes[0][:4]}")
    offset = 0
    for param in params:
        numel = math.prod(param.shape)
        part = -(-numel // world_size)
        for rank in range(world_size):
            start, stop = min(rank * part, numel), min((rank + 1) * part, numel)
            at = offset
            while start < stop:  # a part may run over a sub-group's end (DeepSpeed keeps them whole)
                index = next((i for i in range(len(bounds) - 1) if bounds[i] <= at < bounds[i + 1]), None)
                if index is None:
                    raise CorruptMetadata(f"{where}: {param.name}: its part on rank {rank} starts at element {at}, past "
                                          f"the {bounds[-1]} elements of the fp32 sub-groups")
                take = min(stop - start, bounds[index + 1] - at)
                param.pieces.append(Piece(rank, index, at - bounds[index], start, start + take))
                start, at = start + take, at + take
        offset += part
    if offset != bounds[-1]:
        raise CorruptMetadata(f"{where}: the parameters' parts fill {offset} elements per rank, the fp32 sub-groups "
                              f"hold {bounds[-1]} (param_shapes disagrees with the optimizer partitions)")


# ---------------------------------------------------------------------------------------------
# Reading


def read_deepspeed(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return a ZeRO tag folder (`global_stepN`) as a Checkpoint: the fp32 master weights,
    frozen parameters and buffers under `model.`, the optimizer state per parameter under
    `optim.state.`, every chunk a raw byte range of a rank's file.

    Raises MissingFile for a rank's file that is missing, CorruptMetadata for a truncated file
    or partitions that disagree (naming the file and parameter), UnsafeMetadata for a pickle
    naming anything outside the allowlist, UnsupportedFormat for tensor or pipeline
    parallel saves and for a stage-3 trainable parameter no optimizer owns (not saved).
    """
    folder = as_path(storage.location(path))
    found = _files(folder)
    with DataFiles(folder, follow_symlinks) as files:
        reader = PickleReader(files, folder)
        model_state = reader.load(found.model)
        first_where = str(folder / found.optim[min(found.optim)])
        zero = _optimizer_dict(reader.load(found.optim[min(found.optim)]), first_where)
        partitioning = stage_and_world(zero, first_where)
        states = _rank_states(reader, found, zero, partitioning, folder)
        layout = _flats(reader, found, states, partitioning, folder)
        _place(layout, shapes(model_state, "param_shapes", str(folder / found.model)), states, partitioning, found, folder)
        entries = Entries(str(folder / found.model))
        _trained(entries, layout, str(folder / found.optim[0]))
        notes = untrained(entries, reader, found, model_state, partitioning, {p.name for p in layout.params}, folder)
    return checkpoint_of(folder, found.model, model_state, entries, layout, notes)


def _rank_states(reader: PickleReader, found: SaveFiles, zero: dict, partitioning: Partitioning,
                 folder: Path) -> dict[int, dict]:
    """Return rank -> its ZeRO optimizer state dict, every rank's file present and agreeing
    with the first on the stage and the rank count."""
    world_size = partitioning.world_size
    missing = [rank for rank in range(world_size) if rank not in found.optim]
    if missing or len(found.optim) != world_size:
        name = f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt" if missing else found.optim[max(found.optim)]
        raise MissingFile(f"{folder / name}: {'missing' if missing else 'beyond the partition count'}: the save "
                          f"has {world_size} data-parallel ranks and {len(found.optim)} optim states files (was the save "
                          "interrupted, or is an older save's file left over?)")
    states = {min(found.optim): zero}
    for rank in range(world_size):
        if rank not in states:
            where = str(folder / found.optim[rank])
            states[rank] = _optimizer_dict(reader.load(found.optim[rank]), where)
            other = stage_and_world(states[rank], where)
            if other != partitioning:
                raise CorruptMetadata(f"{where}: ZeRO stage {other.stage} over {other.world_size} ranks, rank 0's file "
                                      f"says stage {partitioning.stage} over {world_size}")
    return states


def checkpoint_of(folder: Path, model_file: str, model_state: dict, entries: Entries, layout: Layout,
                  notes: tuple[str, ...]) -> Checkpoint:
    """Return the Checkpoint of what a reader found: the entries, the param groups' settings."""
    group_objects, group_nesting = param_groups(layout)
    refuse_bad_names(folder, list(entries.tensors), set(), dict(entries.tensors), {})
    version = model_state.get("ds_version")
    objects = {**group_objects, **dict(sorted(entries.objects.items()))}
    return Checkpoint(path=folder, metadata_file=model_file, version=f"deepspeed {version}" if isinstance(version, str) else None,
                      tensors=dict(sorted(entries.tensors.items())), objects=objects,
                      nesting={**entries.nesting, **group_nesting, **entries.object_nesting}, notes=notes,
                      model_prefix=MODEL_PREFIX, parameters=frozenset(entries.parameters))


def _optimizer_dict(state: dict, where: str) -> dict:
    zero = state.get("optimizer_state_dict")
    if not isinstance(zero, dict) or "zero_stage" not in zero:
        raise CorruptMetadata(f"{where}: no ZeRO optimizer_state_dict (a DeepSpeed optim states file holds one)")
    return zero


class Partitioning(NamedTuple):
    """The ZeRO stage (1-3) and the data-parallel world size the state is partitioned over."""

    stage: int
    world_size: int


def stage_and_world(zero: dict, where: str) -> Partitioning:
    """Return the stage and world size a ZeRO optimizer state dict records."""
    stage, world_size = zero.get("zero_stage"), zero.get("partition_count")
    if isinstance(world_size, list) and world_size and all(type(w) is int for w in world_size):
        if len(set(world_size)) != 1:
            raise UnsupportedFormat(f"{where}: param groups partitioned over different rank counts {world_size[:4]} "
                                    "(MoE expert groups); this build reads ZeRO saves with one data-parallel group")
        world_size = world_size[0]
    if type(stage) is not int or stage not in (1, 2, 3) or type(world_size) is not int or world_size < 1:
        raise CorruptMetadata(f"{where}: zero_stage {stage!r:.20} / partition_count {world_size!r:.40} are not a ZeRO "
                              "stage 1-3 and a rank count")
    return Partitioning(stage, world_size)


def shapes(model_state: dict, key: str, where: str) -> list[dict[str, tuple[int, ...]]]:
    """Return a model states file's `param_shapes` or `frozen_param_shapes` as name -> shape maps."""
    groups = model_state.get(key)
    if key == "frozen_param_shapes":
        groups = [groups] if isinstance(groups, dict) else [] if groups is None else groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptMetadata(f"{where}: {key} is not a list of name -> shape maps")
    return [{str(name): ints(shape, f"{where}: {key}: {name}") for name, shape in group.items()} for group in groups]


Number = int | float  # a state value torch's optimizers keep as a plain number (DeepSpeedCPUAdam's `step`)


@dataclass
class Layout:
    """What the optim files say, per rank: the flat vectors and where each parameter sits."""

    masters: dict[int, list[Stored]] = field(default_factory=dict)  # rank -> fp32 master flat vectors
    # state key -> rank -> flat vectors over the same layout
    optimizer: dict[str, dict[int, list[Stored]]] = field(default_factory=dict)
    scalars: dict[str, list[Stored | None]] = field(default_factory=dict)  # state key -> per flat vector: rank 0's 0-d tensor
    numbers: dict[str, list[Number | None]] = field(default_factory=dict)  # state key -> per flat vector: rank 0's number
    groups: list[dict] = field(default_factory=list)  # the optimizer's param groups (rank 0's), `params` as flat indices
    params: list[Param] = field(default_factory=list)


def _flats(reader: PickleReader, found: SaveFiles, states: dict[int, dict], partitioning: Partitioning,
           folder: Path) -> Layout:
    """Read every rank's flat vectors: master weights, and each optimizer state key."""
    flat_key = "fp32_flat_groups" if partitioning.stage == 3 else "single_partition_of_fp32_groups"
    layout = Layout()
    for rank in range(partitioning.world_size):
        name = found.optim[rank]
        where = str(folder / name)
        vectors = states[rank].get(flat_key)
        if not isinstance(vectors, list) or not vectors:
            raise CorruptMetadata(f"{where}: {flat_key} is missing or empty")
        layout.masters[rank] = [reader.stored(name, v, f"{where}: {flat_key}[{i}]") for i, v in enumerate(vectors)]
        base = states[rank].get("optimizer_state_dict" if partitioning.stage == 3 else "base_optimizer_state")
        per_flat, groups = _base_state(base, len(vectors), where)
        if rank == 0:
            layout.groups = groups
        for index, state in enumerate(per_flat):
            for key, value in state.items():
                here = f"{where}: optimizer state {index}.{key}"
                if isinstance(value, _Rebuilt) and value.shape:
                    layout.optimizer.setdefault(key, {}).setdefault(rank, []).append(reader.stored(name, value, here))
                elif isinstance(value, _Rebuilt) and rank == 0:
                    layout.scalars.setdefault(key, [None] * len(vectors))[index] = reader.stored(name, value, here)
                elif type(value) in (int, float) and rank == 0:
                    layout.numbers.setdefault(str(key), [None] * len(vectors))[index] = value
    for key, per_rank in layout.optimizer.items():
        if any(len(per_rank.get(rank, [])) != len(layout.masters[rank]) for rank in range(partitioning.world_size)):
            raise CorruptMetadata(f"{folder / found.optim[0]}: optimizer state {key} is not kept for every flat group "
                                  "on every rank")
    return layout


def group_of_flats(groups: list[dict], flats: int, where: str, what: str) -> Callable[[int, list[str]], int]:
    """Return `group(index, names)`: the optimizer param group whose `params` list flat vector
    `index` (stage 3: sub-group `index`, which `_set_fp32_optimizer_param_groups` appended to its
    group before saving); it raises CorruptMetadata naming the file, the flat vector and its
    first parameters when no group (or more than one) lists it."""
    listed: dict[int, list[int]] = {}
    for number, members in enumerate(groups):
        for index in sorted({index for index in members.get("params", ()) if type(index) is int}):
            listed.setdefault(index, []).append(number)

    def group(index: int, names: list[str]) -> int:
        numbers = listed.get(index, [])
        if len(numbers) == 1:
            return numbers[0]
        shown = ", ".join(names[:NOTE_NAMES]) + (", ..." if len(names) > NOTE_NAMES else "")
        held = f"in param groups {numbers}" if numbers else f"in none of the optimizer's {len(groups)} param groups"
        raise CorruptMetadata(f"{where}: {what} {index} of {flats} ({shown}) is {held}; its hyperparameters are unknown")

    return group


def _place(layout: Layout, param_shapes: list[dict[str, tuple[int, ...]]], states: dict[int, dict],
           partitioning: Partitioning, found: SaveFiles, folder: Path) -> None:
    """Find each trained parameter's pieces in the ranks' flat vectors."""
    optim_where = str(folder / found.optim[0])
    world_size = partitioning.world_size
    flats = len(layout.masters[0])
    if partitioning.stage == 3:
        group = group_of_flats(layout.groups, len(param_shapes), optim_where, "sub-group")
        for index, members in enumerate(param_shapes):
            number = group(index, list(members))
            layout.params += [Param(name, shape, number) for name, shape in members.items()]
        _stage3_pieces(layout.params, [[flat.numel for flat in layout.masters[rank]] for rank in range(world_size)],
                       world_size, optim_where)
        return
    if len(param_shapes) != flats:
        raise CorruptMetadata(f"{folder / found.model}: param_shapes has {len(param_shapes)} groups, {optim_where} "
                              f"{flats} flat partitions")
    group = group_of_flats(layout.groups, flats, optim_where, "flat group")
    alignment = states[0].get("param_alignment_paddings")
    for index, members in enumerate(param_shapes):
        number = group(index, list(members))
        params = [Param(name, shape, number) for name, shape in members.items()]
        paddings = [_padding(states[rank], index, str(folder / found.optim[rank])) for rank in range(world_size)]
        aligned = alignment[index] if isinstance(alignment, list) and index < len(alignment) else None
        _stage12_pieces(params, [layout.masters[rank][index].numel for rank in range(world_size)], paddings, aligned,
                        world_size, index, optim_where)
        layout.params += params


class Entries:
    """What a reader found, as get_state_dict nests it: tensors (fqn -> Tensor) and plain
    values (fqn -> Object), refusing a name given twice."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.tensors: dict[str, Tensor] = {}
        self.objects: dict[str, Object] = {}
        self.nesting: dict[str, tuple[str | int, ...]] = {}  # the tensors'
        self.object_nesting: dict[str, tuple[str | int, ...]] = {}
        self.parameters: set[str] = set()  # model parameters, trained or frozen (not buffers)

    def add(self, path: tuple[str | int, ...], dtype: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...] | ChunkTable) -> None:
        """Add the tensor at `path` (`("model", fqn)`, `("optim", "state", fqn, key)`)."""
        fqn = self._new(path)
        self.tensors[fqn] = Tensor(fqn, dtype, shape, chunks)
        self.nesting[fqn] = path

    def add_value(self, path: tuple[str | int, ...], value: Number) -> None:
        """Add a plain value at `path`, stored as torch.save writes it (what DCP keeps for one)."""
        fqn = self._new(path)
        self.objects[fqn] = Object(fqn, None, saved_value(dumps(value)))
        self.object_nesting[fqn] = path

    def add_parameter(self, name: str, dtype: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...] | ChunkTable) -> None:
        """Add a model parameter `name` (under `model.`)."""
        self.add((MODEL_PREFIX, name), dtype, shape, chunks)
        self.parameters.add(f"{MODEL_PREFIX}.{name}")

    def _new(self, path: tuple[str | int, ...]) -> str:
        fqn = ".".join(map(str, path))
        if fqn in self.tensors or fqn in self.objects:
            raise CorruptMetadata(f"{self.where}: {fqn} is named twice (param_shapes, frozen parameters, buffers)")
        return fqn


def _trained(entries: Entries, layout: Layout, where: str) -> None:
    """The fp32 master weights and the optimizer state of every trained parameter."""
    for param in layout.params:
        dtype, chunks = _chunks(param, layout.masters, where, "fp32 master")
        entries.add_parameter(param.name, dtype, param.shape, chunks)
        for key, per_rank in layout.optimizer.items():  # stage 1/2's padded state has the master's layout
            dtype, chunks = _chunks(param, per_rank, where, key)
            entries.add((*OPTIM_STATE, param.name, key), dtype, param.shape, chunks)
        flat = param.pieces[0].flat_index if param.pieces else None
        for key, scalars in layout.scalars.items():
            scalar = scalars[flat] if flat is not None else None
            if scalar is not None:
                entries.add((*OPTIM_STATE, param.name, key), scalar.dtype, (), (Chunk((), (), scalar.blob),))
        for key, numbers in layout.numbers.items():
            number = numbers[flat] if flat is not None else None
            if number is not None:
                entries.add_value((*OPTIM_STATE, param.name, key), number)


def untrained(entries: Entries, reader: PickleReader, found: SaveFiles, model_state: dict, partitioning: Partitioning,
              trained: set[str], folder: Path) -> tuple[str, ...]:
    """Add frozen parameters (stage 2/3 save them; stage 1 only in `module`), trainable
    parameters no optimizer owns (stage 1/2: from `module`), persistent buffers and tied names;
    return the notes on what the save left out (`EXCLUDED_FROZEN`)."""
    where = str(folder / found.model)
    frozen = shapes(model_state, "frozen_param_shapes", where)
    frozen_shapes = frozen[0] if frozen else {}
    shared: object
    buffer_names: object
    module: object
    shared, buffer_names, module = (model_state.get(key) or default for key, default in
                                    (("shared_params", {}), ("buffer_names", []), ("module", {})))
    if not isinstance(shared, dict) or not isinstance(buffer_names, list) or not isinstance(module, dict):
        raise CorruptMetadata(f"{where}: shared_params, buffer_names or module is malformed")
    fragments = model_state.get("frozen_param_fragments") or {}
    for name, shape in frozen_shapes.items():
        if partitioning.stage == 3:
            dtype, chunks = _frozen_stage3(reader, found, folder, name, shape, partitioning.world_size)
        else:
            stored = reader.stored(found.model, fragments.get(name), f"{where}: frozen_param_fragments: {name}")
            if stored.numel != math.prod(shape):
                raise CorruptMetadata(f"{where}: frozen_param_fragments: {name} holds {stored.numel} elements, its shape "
                                      f"{list(shape)} {math.prod(shape)}")
            dtype, chunks = stored.dtype, (Chunk((0,) * len(shape), shape, stored.blob),)
        entries.add_parameter(name, dtype, shape, chunks)
    aliases = {str(k): str(v) for k, v in shared.items()}
    buffers = set(map(str, buffer_names))
    for name, value in module.items():
        name = str(name)
        if name in trained or name in frozen_shapes or name in aliases or not isinstance(value, _Rebuilt):
            continue
        here = f"{where}: module: {name}"
        if name not in buffers and partitioning.stage == 3:
            # stage 3's module holds empty placeholders; a parameter in neither param_shapes nor
            # frozen_param_shapes is trainable but in no optimizer group: its value is nowhere
            raise UnsupportedFormat(f"{here}: a trainable parameter no optimizer param group holds; ZeRO-3 saves only an "
                                    "empty placeholder for it (neither param_shapes nor frozen_param_fragments), so its "
                                    "trained value is not in the save (DeepSpeed's load_checkpoint leaves it as "
                                    "initialised); add it to the optimizer, or freeze it, and save again")
        stored = reader.stored(found.model, value, here)
        shape = ints(value.shape, f"{here}: shape")
        chunks = (Chunk((0,) * len(shape), shape, stored.blob),)
        if name in buffers:
            entries.add((MODEL_PREFIX, name), stored.dtype, shape, chunks)
        else:  # a frozen parameter stage 1 keeps only here, or (stage 1/2) a trainable one no optimizer owns
            entries.add_parameter(name, stored.dtype, shape, chunks)
    for alias, source in sorted(aliases.items()):
        held = entries.tensors.get(f"{MODEL_PREFIX}.{source}")
        if held is None:
            raise CorruptMetadata(f"{where}: shared_params: {alias} shares {source}, which the save does not hold")
        entries.add_parameter(alias, held.dtype, held.shape, held.chunks)
    return _excluded_frozen(model_state, partitioning, module)


def _excluded_frozen(model_state: dict, partitioning: Partitioning, module: dict) -> tuple[str, ...]:
    """The note of a save made with exclude_frozen_parameters (at stage 2/3 frozen_param_shapes is
    None only then; stage 1 never saves it, so there the exclusion cannot be told), naming the
    frozen parameters the module's own names prove absent: each PEFT LoRA layer's base weight.
    The save lists no other frozen name, so how many there are in all is not known."""
    if partitioning.stage < 2 or "frozen_param_shapes" not in model_state or model_state["frozen_param_shapes"] is not None:
        return ()
    names = set(map(str, module))
    absent = sorted({f"{name.split('.lora_A.', 1)[0]}.base_layer.weight" for name in names if ".lora_A." in name} - names)
    shown = ", ".join(f"{MODEL_PREFIX}.{name}" for name in absent[:NOTE_NAMES]) + (", ..." if len(absent) > NOTE_NAMES else "")
    known = f"; among them the base weights of its {len(absent)} LoRA layers ({shown})" if absent else ""
    return (f"{EXCLUDED_FROZEN}: `module` holds only the trainable parameters and buffers ({len(names)} entries) and "
            f"names no frozen parameter{known}; the full model needs its frozen weights from elsewhere (the base model)",)


def param_groups(layout: Layout) -> tuple[dict[str, Object], dict[str, tuple[str | int, ...]]]:
    """The optimizer's param groups as get_state_dict gives them (`params` by name), each
    setting a DCP object of its own: (objects, nesting). A setting that is not a plain value
    (none of torch's optimizers keeps one) is left out."""
    objects: dict[str, Object] = {}
    nesting: dict[str, tuple[str | int, ...]] = {}
    members: dict[int, list[str]] = {}
    for param in layout.params:
        members.setdefault(param.group, []).append(param.name)
    for number, group in enumerate(layout.groups):
        for key, value in sorted({**group, "params": members.get(number, [])}.items()):
            path = (*OPTIM_GROUPS, number, str(key))
            try:
                data = saved_value(dumps(value))
            except TypeError:
                continue
            fqn = ".".join(map(str, path))
            objects[fqn], nesting[fqn] = Object(fqn, None, data), path
    return objects, nesting


def _padding(zero: dict, index: int, where: str) -> int:
    paddings = zero.get("group_paddings")
    if not isinstance(paddings, list) or index >= len(paddings) or type(paddings[index]) is not int or paddings[index] < 0:
        raise CorruptMetadata(f"{where}: group_paddings has no entry for param group {index}")
    return paddings[index]


def _base_state(base: Any, flats: int, where: str) -> tuple[list[dict], list[dict]]:
    """Return (per flat vector: its optimizer state {key: tensor or value}, the param groups
    with `params` naming flat vectors) from torch's optimizer state dict over the flat
    vectors (or DeepSpeed's elastic list of per-group states, whose settings it does not keep)."""
    if isinstance(base, list):  # stage 1/2 elastic: one stripped state per group
        if len(base) != flats or not all(isinstance(s, dict) for s in base):
            raise CorruptMetadata(f"{where}: base_optimizer_state holds {len(base)} states for {flats} flat groups")
        return base, [{"params": [index]} for index in range(flats)]
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or not isinstance(base.get("param_groups"), list):
        raise CorruptMetadata(f"{where}: the optimizer state dict is missing or malformed (no state / param_groups)")
    for number, group in enumerate(base["param_groups"]):
        members = group.get("params") if isinstance(group, dict) else None
        if not isinstance(members, list) or not all(type(m) is int and 0 <= m < flats for m in members):
            raise CorruptMetadata(f"{where}: optimizer param group {number} names flat groups outside 0..{flats - 1}")
    state = base["state"]
    per_flat = [state.get(index, {}) for index in range(flats)]
    if not all(isinstance(s, dict) for s in per_flat):
        raise CorruptMetadata(f"{where}: optimizer state entries are not dicts")
    return per_flat, base["param_groups"]


def _frozen_stage3(reader: PickleReader, found: SaveFiles, folder: Path, name: str, shape: tuple[int, ...],
                   world_size: int) -> tuple[str, tuple[Chunk, ...]]:
    """A frozen parameter of a stage-3 save: each rank's model states file holds its
    ceil(numel / world) elements."""
    numel = math.prod(shape)
    part = -(-numel // world_size)
    chunks, dtype = [], None
    for rank in range(world_size):
        file = found.model_per_rank.get(rank)
        if file is None:
            raise MissingFile(f"{folder / f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt'}: missing; it holds rank "
                              f"{rank}'s part of the frozen parameter {name}")
        fragments = reader.load(file).get("frozen_param_fragments")
        where = str(folder / file)
        fragment = fragments.get(name) if isinstance(fragments, dict) else None
        stored = reader.stored(file, fragment, f"{where}: frozen_param_fragments: {name}")
        start, stop = min(rank * part, numel), min((rank + 1) * part, numel)
        if stored.numel < stop - start:
            raise CorruptMetadata(f"{where}: frozen_param_fragments: {name} holds {stored.numel} elements, rank {rank}'s "
                                  f"part is {stop - start}")
        itemsize = dtypes.ITEMSIZE[stored.dtype]
        dtype = dtype or stored.dtype
        for offsets, sizes, first in flat_boxes(shape, start, stop):
            chunks.append(Chunk(offsets, sizes, Blob(file, stored.blob.offset + (first - start) * itemsize,
                                                     math.prod(sizes) * itemsize, raw_range_transforms())))
    return dtype or "float32", tuple(sorted(chunks))
