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
    `optimizer_state_dict` is torch's optimizer state dict over those sub-groups.

So each parameter is a flat element range of one or more ranks' partitions. Every partition is
a storage inside a torch.save zip, so each piece of a parameter is a byte range of an optim
file: a partial row, whole rows and a partial row (`geometry.flat_boxes`), kept as raw-range
blobs. Nothing but the pickles is read; no tensor is decoded.

The checkpoint is given as `get_state_dict(model, AdamW)` lays out an FSDP2 model
(train_minimal/checkpoint.py): `model.<name>` the fp32 master weights, frozen parameters (from
`frozen_param_fragments`, or at stage 1, which does not save them, from `module`) and
persistent buffers as stored, tied names as their source's chunks; and
`optim.state.<name>.<key>` (`exp_avg`, `exp_avg_sq`, `step`, ...) per trained parameter.

The pickles name DeepSpeed classes (`LossScaler`, `ZeroStageEnum`, `fragment_address`, ...):
the checking loader builds inert stand-ins for exactly those (`_ALLOWED`), never importing
DeepSpeed and never running anything from the file.

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
from typing import Any

from ckpttool.core import dtypes
from ckpttool.store import storage
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Object, Tensor, as_path, raw_range_transforms, refuse_bad_names
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CorruptMetadata, MissingFile, NotACheckpoint, UnsupportedFormat
from ckpttool.core.geometry import flat_boxes
from ckpttool.readers.detect import DEEPSPEED_MODEL_PATTERN, DEEPSPEED_OPTIM_PATTERN, DEEPSPEED_UNIVERSAL_DIR as UNIVERSAL_DIR
from ckpttool.torchsave.archive import saved_value
from ckpttool.torchsave.pickle import dumps
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED, _Rebuilt
from ckpttool.torchsave.stored import StateDictUnpickler, device, file_entries, ints, load_data_pkl, raw_blob, stored_dtype

MODEL_STATES, OPTIM_STATES = DEEPSPEED_MODEL_PATTERN, DEEPSPEED_OPTIM_PATTERN
PIPELINE_LAYER = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
# get_state_dict(model, optimizer) saved as {"model": ..., "optim": ...} (train_minimal/checkpoint.py)
MODEL_PREFIX, OPTIM_STATE, OPTIM_GROUPS = "model", ("optim", "state"), ("optim", "param_groups")


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
# Files


@dataclass(frozen=True)
class _Files:
    model: str  # the model states file holding param_shapes (rank 0's at stage 3)
    model_per_rank: dict[int, str]  # stage 3: rank -> its model states file
    optim: dict[int, str]  # data-parallel rank -> its optim states file


def _files(folder: Path) -> _Files:
    names = sorted(entry.name for entry in folder.iterdir()) if storage.is_remote(folder) else sorted(os.listdir(folder))
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
    per_rank = {int(m.group(1)): name for name, m in models.items() if m.group(1) is not None}
    plain = [name for name, m in models.items() if m.group(1) is None]
    model = plain[0] if plain else per_rank.get(0)
    if model is None:
        raise MissingFile(f"{folder}: no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt "
                          "(it holds the parameter names and shapes; was the save interrupted?)")
    return _Files(model, per_rank, optim)


class _Reader:
    """One ZeRO folder's pickles, each checked and built from stand-ins, with byte ranges."""

    def __init__(self, files: DataFiles, folder: Path) -> None:
        self.files, self.folder = files, folder
        self.entries: dict[str, Any] = {}
        self.starts: dict[str, dict[str, int]] = {}
        self.states: dict[str, dict] = {}

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
        self.entries[name] = (entries, read, size)
        self.starts[name] = {}
        self.states[name] = state
        return state

    def blob(self, name: str, value: Any, here: str) -> tuple[Blob, str, int]:
        """Return (byte range, dtype, element count) of a stored tensor of file `name`."""
        if not isinstance(value, _Rebuilt):
            raise CorruptMetadata(f"{here}: expected a tensor, found a {type(value).__name__}")
        dtype = stored_dtype(value, here)
        entries, read, size = self.entries[name]
        blob = raw_blob(entries, self.starts[name], read, size, here, name, value, dtype)
        return blob, dtype, math.prod(ints(value.shape, f"{here}: shape"))


# ---------------------------------------------------------------------------------------------
# Flat partitions -> chunks


@dataclass
class _Flat:
    """One rank's flat vector (a partition or a sub-group): where its elements sit."""

    blob: Blob
    dtype: str
    numel: int


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    group: int  # optimizer param group
    # (rank, flat index, element offset in that flat, element range [start, stop) of the param)
    pieces: list[tuple[int, int, int, int, int]] = field(default_factory=list)


def _chunks(param: _Param, flats: dict[int, list[_Flat]], where: str, what: str) -> tuple[str, tuple[Chunk, ...]]:
    """Return (dtype, chunks) of `param` read from `flats` (rank -> flat vectors)."""
    chunks, dtype = [], None
    for rank, index, at, start, stop in param.pieces:
        flat = flats[rank][index]
        if at + (stop - start) > flat.numel:
            raise CorruptMetadata(f"{where}: rank {rank}: {param.name}: {what} elements [{at}, {at + stop - start}) run "
                                  f"past its {flat.numel}-element flat partition")
        if dtype is not None and flat.dtype != dtype:
            raise CorruptMetadata(f"{where}: {param.name}: {what} partitions of dtypes {dtype} and {flat.dtype}")
        dtype = flat.dtype
        itemsize = dtypes.ITEMSIZE[dtype]
        for offsets, sizes, first in flat_boxes(param.shape, start, stop):
            offset = flat.blob.offset + (at + first - start) * itemsize
            chunks.append(Chunk(offsets, sizes, Blob(flat.blob.file, offset, math.prod(sizes) * itemsize,
                                                      raw_range_transforms())))
    return dtype or "float32", tuple(sorted(chunks))


def _stage12_pieces(params: list[_Param], sizes: list[int], paddings: list[int], alignment: list[int] | None,
                    world: int, group: int, where: str) -> None:
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
        for rank in range(offset // part if part else 0, world):
            lo, hi = max(offset, rank * part), min(stop, rank * part + sizes[rank])
            if rank * part >= stop:
                break
            if hi > lo:
                param.pieces.append((rank, group, lo - rank * part, lo - offset, hi - offset))
        if sum(p[4] - p[3] for p in param.pieces) != numel:
            raise CorruptMetadata(f"{where}: {param.name}: elements [{offset}, {stop}) of param group {group} are not all "
                                  f"saved (the ranks hold {sum(sizes)} of its {world * part} elements)")
        offset = stop + (alignment[i] if alignment is not None else 0)
    if offset > world * part:
        raise CorruptMetadata(f"{where}: param group {group}: its parameters need {offset} elements, the partitions "
                              f"hold {world * part}")


def _stage3_pieces(params: list[_Param], flat_sizes: list[list[int]], world: int, where: str) -> None:
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
        part = -(-numel // world)
        for rank in range(world):
            start, stop = min(rank * part, numel), min((rank + 1) * part, numel)
            at = offset
            while start < stop:  # a part may run over a sub-group's end (DeepSpeed keeps them whole)
                index = next((i for i in range(len(bounds) - 1) if bounds[i] <= at < bounds[i + 1]), None)
                if index is None:
                    raise CorruptMetadata(f"{where}: {param.name}: its part on rank {rank} starts at element {at}, past "
                                          f"the {bounds[-1]} elements of the fp32 sub-groups")
                take = min(stop - start, bounds[index + 1] - at)
                param.pieces.append((rank, index, at - bounds[index], start, start + take))
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
    parallel saves.
    """
    folder = as_path(storage.location(path))
    found = _files(folder)
    with DataFiles(folder, follow_symlinks) as files:
        reader = _Reader(files, folder)
        model_state = reader.load(found.model)
        first = reader.load(found.optim[min(found.optim)])
        zero = _optimizer_dict(first, str(folder / found.optim[min(found.optim)]))
        stage, world = _stage_and_world(zero, str(folder / found.optim[min(found.optim)]))
        missing = [rank for rank in range(world) if rank not in found.optim]
        if missing or len(found.optim) != world:
            name = f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt" if missing else found.optim[max(found.optim)]
            raise MissingFile(f"{folder / name}: {'missing' if missing else 'beyond the partition count'}: the save "
                              f"has {world} data-parallel ranks and {len(found.optim)} optim states files (was the save "
                              "interrupted, or is an older save's file left over?)")
        states = {min(found.optim): zero}
        for rank in range(world):
            if rank not in states:
                where = str(folder / found.optim[rank])
                states[rank] = _optimizer_dict(reader.load(found.optim[rank]), where)
                other = _stage_and_world(states[rank], where)
                if other != (stage, world):
                    raise CorruptMetadata(f"{where}: ZeRO stage {other[0]} over {other[1]} ranks, rank 0's file says "
                                          f"stage {stage} over {world}")
        layout = _flats(reader, found, states, stage, world, folder)
        _place(layout, _shapes(model_state, "param_shapes", str(folder / found.model)), states, stage, world, found, folder)
        tensors = _Tensors(str(folder / found.model))
        _trained(tensors, layout, str(folder / found.optim[0]))
        _untrained(tensors, reader, found, model_state, stage, world, {p.name for p in layout.params}, folder)
    objects, nesting = _param_groups(layout)
    refuse_bad_names(folder, list(tensors), set(), dict(tensors), {})
    version = model_state.get("ds_version")
    return Checkpoint(path=folder, metadata_file=found.model, version=f"deepspeed {version}" if isinstance(version, str) else None,
                      tensors=dict(sorted(tensors.items())), objects=objects, nesting={**tensors.nesting, **nesting},
                      model_prefix=MODEL_PREFIX, parameters=frozenset(tensors.parameters))


def _optimizer_dict(state: dict, where: str) -> dict:
    zero = state.get("optimizer_state_dict")
    if not isinstance(zero, dict) or "zero_stage" not in zero:
        raise CorruptMetadata(f"{where}: no ZeRO optimizer_state_dict (a DeepSpeed optim states file holds one)")
    return zero


def _stage_and_world(zero: dict, where: str) -> tuple[int, int]:
    stage, world = zero.get("zero_stage"), zero.get("partition_count")
    if isinstance(world, list) and world and all(type(w) is int for w in world):
        if len(set(world)) != 1:
            raise UnsupportedFormat(f"{where}: param groups partitioned over different rank counts {world[:4]} "
                                    "(MoE expert groups); this build reads ZeRO saves with one data-parallel group")
        world = world[0]
    if type(stage) is not int or stage not in (1, 2, 3) or type(world) is not int or world < 1:
        raise CorruptMetadata(f"{where}: zero_stage {stage!r:.20} / partition_count {world!r:.40} are not a ZeRO "
                              "stage 1-3 and a rank count")
    return stage, world


def _shapes(model_state: dict, key: str, where: str) -> list[dict[str, tuple[int, ...]]]:
    groups = model_state.get(key)
    if key == "frozen_param_shapes":
        groups = [groups] if isinstance(groups, dict) else [] if groups is None else groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CorruptMetadata(f"{where}: {key} is not a list of name -> shape maps")
    return [{str(name): ints(shape, f"{where}: {key}: {name}") for name, shape in group.items()} for group in groups]


@dataclass
class _Layout:
    """What the optim files say, per rank: the flat vectors and where each parameter sits."""

    masters: dict[int, list[_Flat]]  # rank -> fp32 master flat vectors
    optimizer: dict[str, dict[int, list[_Flat]]]  # state key -> rank -> flat vectors over the same layout
    scalars: dict[str, list[tuple[Blob, str] | None]]  # state key -> per flat vector: rank 0's value
    groups: list[dict]  # the optimizer's param groups (rank 0's), `params` as flat indices
    params: list[_Param]


def _flats(reader: _Reader, found: _Files, states: dict[int, dict], stage: int, world: int, folder: Path) -> _Layout:
    """Read every rank's flat vectors: master weights, and each optimizer state key."""
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    layout = _Layout({}, {}, {}, [], [])
    for rank in range(world):
        name = found.optim[rank]
        where = str(folder / name)
        vectors = states[rank].get(flat_key)
        if not isinstance(vectors, list) or not vectors:
            raise CorruptMetadata(f"{where}: {flat_key} is missing or empty")
        layout.masters[rank] = [_Flat(*reader.blob(name, v, f"{where}: {flat_key}[{i}]")) for i, v in enumerate(vectors)]
        base = states[rank].get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
        per_flat, groups = _base_state(base, len(vectors), where)
        if rank == 0:
            layout.groups = groups
        for index, state in enumerate(per_flat):
            for key, value in state.items():
                here = f"{where}: optimizer state {index}.{key}"
                if isinstance(value, _Rebuilt) and value.shape:
                    layout.optimizer.setdefault(key, {}).setdefault(rank, []).append(_Flat(*reader.blob(name, value, here)))
                elif isinstance(value, _Rebuilt) and rank == 0:
                    blob, dtype, _ = reader.blob(name, value, here)
                    layout.scalars.setdefault(key, [None] * len(vectors))[index] = (blob, dtype)
    for key, per_rank in layout.optimizer.items():
        if any(len(per_rank.get(rank, [])) != len(layout.masters[rank]) for rank in range(world)):
            raise CorruptMetadata(f"{folder / found.optim[0]}: optimizer state {key} is not kept for every flat group "
                                  "on every rank")
    return layout


def _place(layout: _Layout, param_groups: list[dict[str, tuple[int, ...]]], states: dict[int, dict], stage: int,
           world: int, found: _Files, folder: Path) -> None:
    """Find each trained parameter's pieces in the ranks' flat vectors."""
    optim_where = str(folder / found.optim[0])
    group_of = {index: number for number, group in enumerate(layout.groups) for index in group["params"]}
    if stage == 3:
        for index, group in enumerate(param_groups):
            layout.params += [_Param(name, shape, group_of.get(index, 0)) for name, shape in group.items()]
        _stage3_pieces(layout.params, [[flat.numel for flat in layout.masters[rank]] for rank in range(world)], world,
                       optim_where)
        return
    if len(param_groups) != len(layout.masters[0]):
        raise CorruptMetadata(f"{folder / found.model}: param_shapes has {len(param_groups)} groups, {optim_where} "
                              f"{len(layout.masters[0])} flat partitions")
    alignment = states[0].get("param_alignment_paddings")
    for index, group in enumerate(param_groups):
        members = [_Param(name, shape, group_of.get(index, index)) for name, shape in group.items()]
        paddings = [_padding(states[rank], index, str(folder / found.optim[rank])) for rank in range(world)]
        aligned = alignment[index] if isinstance(alignment, list) and index < len(alignment) else None
        _stage12_pieces(members, [layout.masters[rank][index].numel for rank in range(world)], paddings, aligned, world,
                        index, optim_where)
        layout.params += members


class _Tensors(dict):
    """fqn -> Tensor, refusing a name given twice; `nesting` as get_state_dict nests them."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.nesting: dict[str, tuple[str | int, ...]] = {}
        self.parameters: set[str] = set()  # model parameters, trained or frozen (not buffers)

    def add(self, path: tuple[str | int, ...], dtype: str, shape: tuple[int, ...], chunks: tuple[Chunk, ...]) -> None:
        fqn = ".".join(map(str, path))
        if fqn in self:
            raise CorruptMetadata(f"{self.where}: {fqn} is named twice (param_shapes, frozen parameters, buffers)")
        self[fqn] = Tensor(fqn, dtype, shape, chunks)
        self.nesting[fqn] = path


def _trained(tensors: _Tensors, layout: _Layout, where: str) -> None:
    """The fp32 master weights and the optimizer state of every trained parameter."""
    for param in layout.params:
        dtype, chunks = _chunks(param, layout.masters, where, "fp32 master")
        tensors.add((MODEL_PREFIX, param.name), dtype, param.shape, chunks)
        tensors.parameters.add(f"{MODEL_PREFIX}.{param.name}")
        for key, per_rank in layout.optimizer.items():  # stage 1/2's padded state has the master's layout
            dtype, chunks = _chunks(param, per_rank, where, key)
            tensors.add((*OPTIM_STATE, param.name, key), dtype, param.shape, chunks)
        for key, per_flat in layout.scalars.items():
            value = per_flat[param.pieces[0][1]] if param.pieces else None
            if value is not None:
                tensors.add((*OPTIM_STATE, param.name, key), value[1], (), (Chunk((), (), value[0]),))


def _untrained(tensors: _Tensors, reader: _Reader, found: _Files, model_state: dict, stage: int, world: int,
               trained: set[str], folder: Path) -> None:
    """Frozen parameters (stage 2/3 save them; stage 1, and a save that excluded them, only
    in `module`), persistent buffers and tied names."""
    where = str(folder / found.model)
    frozen = _shapes(model_state, "frozen_param_shapes", where)
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
        if stage == 3:
            dtype, chunks = _frozen_stage3(reader, found, folder, name, shape, world)
        else:
            blob, dtype, numel = reader.blob(found.model, fragments.get(name), f"{where}: frozen_param_fragments: {name}")
            if numel != math.prod(shape):
                raise CorruptMetadata(f"{where}: frozen_param_fragments: {name} holds {numel} elements, its shape "
                                      f"{list(shape)} {math.prod(shape)}")
            chunks = (Chunk((0,) * len(shape), shape, blob),)
        tensors.add((MODEL_PREFIX, name), dtype, shape, chunks)
        tensors.parameters.add(f"{MODEL_PREFIX}.{name}")
    aliases = {str(k): str(v) for k, v in shared.items()}
    buffers = set(map(str, buffer_names))
    for name, value in module.items():
        name = str(name)
        if name in trained or name in frozen_shapes or name in aliases or not isinstance(value, _Rebuilt):
            continue
        if name not in buffers and stage == 3:
            continue  # stage 3's module holds empty placeholders for partitioned parameters
        here = f"{where}: module: {name}"
        blob, dtype, _ = reader.blob(found.model, value, here)
        shape = ints(value.shape, f"{here}: shape")
        tensors.add((MODEL_PREFIX, name), dtype, shape, (Chunk((0,) * len(shape), shape, blob),))
        if name not in buffers:  # a frozen parameter that stage 1 (or a save excluding them) keeps only here
            tensors.parameters.add(f"{MODEL_PREFIX}.{name}")
    for alias, source in sorted(aliases.items()):
        held = tensors.get(f"{MODEL_PREFIX}.{source}")
        if held is None:
            raise CorruptMetadata(f"{where}: shared_params: {alias} shares {source}, which the save does not hold")
        tensors.add((MODEL_PREFIX, alias), held.dtype, held.shape, held.chunks)
        tensors.parameters.add(f"{MODEL_PREFIX}.{alias}")


def _param_groups(layout: _Layout) -> tuple[dict[str, Object], dict[str, tuple[str | int, ...]]]:
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


def _frozen_stage3(reader: _Reader, found: _Files, folder: Path, name: str, shape: tuple[int, ...],
                   world: int) -> tuple[str, tuple[Chunk, ...]]:
    """A frozen parameter of a stage-3 save: each rank's model states file holds its
    ceil(numel / world) elements."""
    numel = math.prod(shape)
    part = -(-numel // world)
    chunks, dtype = [], None
    for rank in range(world):
        file = found.model_per_rank.get(rank)
        if file is None:
            raise MissingFile(f"{folder / f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt'}: missing; it holds rank "
                              f"{rank}'s part of the frozen parameter {name}")
        fragments = reader.load(file).get("frozen_param_fragments")
        where = str(folder / file)
        fragment = fragments.get(name) if isinstance(fragments, dict) else None
        blob, kind, count = reader.blob(file, fragment, f"{where}: frozen_param_fragments: {name}")
        start, stop = min(rank * part, numel), min((rank + 1) * part, numel)
        if count < stop - start:
            raise CorruptMetadata(f"{where}: frozen_param_fragments: {name} holds {count} elements, rank {rank}'s part is "
                                  f"{stop - start}")
        itemsize = dtypes.ITEMSIZE[kind]
        dtype = dtype or kind
        for offsets, sizes, first in flat_boxes(shape, start, stop):
            chunks.append(Chunk(offsets, sizes, Blob(file, blob.offset + (first - start) * itemsize,
                                                     math.prod(sizes) * itemsize, raw_range_transforms())))
    return dtype or "float32", tuple(sorted(chunks))


# ---------------------------------------------------------------------------------------------
# Universal checkpoints (deepspeed/checkpoint/ds_to_universal.py): one folder per parameter
# under `zero/`, each state a whole tensor of its own (`{"param": t, "cat_dim": 0}` from stage
# 1/2, the bare flat tensor from stage 3), `zero/optimizer_state.pt` with the param groups
# (and, from stage 3, rank 0's optimizer state, where the step is), beside copies of the
# model states files.


def read_deepspeed_universal(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return a universal checkpoint's tag folder as `read_deepspeed` gives a ZeRO save: the
    same names, each state one chunk (the whole tensor's bytes in its own file)."""
    folder = as_path(storage.location(path))
    names = sorted(entry.name for entry in folder.iterdir()) if storage.is_remote(folder) else sorted(os.listdir(folder))
    per_rank = {int(m.group(1)): name for name in names if (m := MODEL_STATES.match(name)) and m.group(1) is not None}
    plain = [name for name in names if (m := MODEL_STATES.match(name)) and m.group(1) is None]
    model = plain[0] if plain else per_rank.get(0)
    if model is None:
        raise MissingFile(f"{folder}: no mp_rank_00_model_states.pt beside {UNIVERSAL_DIR}/ (ds_to_universal copies it)")
    found = _Files(model, per_rank, {})
    with DataFiles(folder, follow_symlinks) as files:
        reader = _Reader(files, folder)
        model_state = reader.load(model)
        where = str(folder / UNIVERSAL_OPTIMIZER)
        optimizer = reader.load(UNIVERSAL_OPTIMIZER)
        stage, world = _stage_and_world(optimizer, where)
        groups = optimizer.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            raise CorruptMetadata(f"{where}: param_groups is missing or malformed")
        group_of = {index: number for number, group in enumerate(groups) for index in group["params"]}
        steps = _universal_steps(reader, optimizer, where)
        layout = _Layout({}, {}, {}, groups, [])
        tensors = _Tensors(str(folder / model))
        for index, group in enumerate(_shapes(model_state, "param_shapes", str(folder / model))):
            for name, shape in group.items():
                layout.params.append(_Param(name, shape, group_of.get(index, 0)))
                _universal_param(tensors, reader, folder, name, shape, steps.get(index))
        _untrained(tensors, reader, found, model_state, stage, world, {p.name for p in layout.params}, folder)
    objects, nesting = _param_groups(layout)
    refuse_bad_names(folder, list(tensors), set(), dict(tensors), {})
    version = model_state.get("ds_version")
    return Checkpoint(path=folder, metadata_file=model, version=f"deepspeed {version}" if isinstance(version, str) else None,
                      tensors=dict(sorted(tensors.items())), objects=objects, nesting={**tensors.nesting, **nesting},
                      model_prefix=MODEL_PREFIX, parameters=frozenset(tensors.parameters))


UNIVERSAL_OPTIMIZER = f"{UNIVERSAL_DIR}/optimizer_state.pt"
UNIVERSAL_STATES = ("exp_avg", "exp_avg_sq")  # beside fp32.pt, as ds_to_universal writes them for AdamW


def _universal_steps(reader: _Reader, optimizer: dict, where: str) -> dict[int, tuple[Blob, str]]:
    """Flat group -> its `step` (stage 3 keeps rank 0's optimizer state in optimizer_state.pt)."""
    base = optimizer.get("optimizer_state_dict")
    state = base.get("state") if isinstance(base, dict) else None
    steps = {}
    for index, entry in (state.items() if isinstance(state, dict) else ()):
        value = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(value, _Rebuilt) and not value.shape:
            blob, dtype, _ = reader.blob(UNIVERSAL_OPTIMIZER, value, f"{where}: optimizer state {index}.step")
            steps[index] = (blob, dtype)
    return steps


def _universal_param(tensors: _Tensors, reader: _Reader, folder: Path, name: str, shape: tuple[int, ...],
                     step: tuple[Blob, str] | None) -> None:
    """A trained parameter's fp32 weight and optimizer state, each its own file."""
    for key in ("fp32", *UNIVERSAL_STATES, "step"):
        file = f"{UNIVERSAL_DIR}/{name}/{key}.pt"
        try:
            reader.files.size(file)
        except MissingFile:
            if key == "fp32":
                raise MissingFile(f"{folder / file}: missing (the universal checkpoint names {name} in param_shapes)") from None
            if key == "step" and step is not None:
                tensors.add((*OPTIM_STATE, name, key), step[1], (), (Chunk((), (), step[0]),))
            continue
        value = reader.load(file, whole=False)
        value = value.get("param") if isinstance(value, dict) else value
        here = f"{folder / file}: {name}"
        blob, dtype, numel = reader.blob(file, value, here)
        wanted = shape if key != "step" else ()
        if numel != math.prod(wanted):
            raise CorruptMetadata(f"{here}: holds {numel} elements, its shape {list(wanted)} has {math.prod(wanted)}")
        path = (MODEL_PREFIX, name) if key == "fp32" else (*OPTIM_STATE, name, key)
        tensors.add(path, dtype, wanted, (Chunk((0,) * len(wanted), wanted, blob),))
        if key == "fp32":
            tensors.parameters.add(f"{MODEL_PREFIX}.{name}")
