"""Read verl's FSDP actor checkpoints (`model_world_size_W_rank_R.pt`) without torch.

verl's `FSDPCheckpointManager.save_checkpoint` (verl/utils/checkpoint/fsdp_checkpoint_manager.py)
has every rank `torch.save` its `model.state_dict()`: an OrderedDict of HF fqn -> DTensor (FSDP2)
whose `_local_tensor` is that rank's shard. Beside them, `optim_world_size_W_rank_R.pt` and
`extra_state_world_size_W_rank_R.pt` hold optimizer state, lr scheduler and RNG state: not read.

Each model file is a torch.save zip (`torchsave/zip.py`); its `data.pkl` is checked by the
budgeted loader (`safepickle.scan_pickle`) and built only from stand-ins of our own for exactly
the globals a DTensor state dict names (see `_ALLOWED`), which record numbers and never run
anything. From each DTensor: the global shape and dtype (`_rebuild_wrapper_subclass`'s args),
the placements (`Shard(dim)`, `Replicate`) and the mesh (axis sizes, this rank's coordinate),
which place the rank's chunk as DTensor's `Shard` does (`torch.chunk` split, ceil division,
one mesh dim after the other), and the local tensor's storage (`data/<key>`), storage offset and
stride. A contiguous local tensor's bytes are a plain byte range of the .pt file, kept as a
raw-range blob (`checkpoint.RAW_RANGE_TRANSFORM`) that `locate` returns as it is. Fqns are the
state dict's keys, as verl's own merger names them (verl/model_merger/fsdp_model_merger.py):
no prefix to strip; every tensor is a model tensor (`model_prefix=""`).

Example:
    >>> checkpoint = read_verl("checkpoints/global_step_2/actor")
    >>> [c.offsets for c in checkpoint.tensors["lm_head.weight"].chunks]
    [(0, 0), (16, 0)]
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Checkpoint, Chunk, Tensor, refuse_bad_names
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CorruptMetadata, MissingFile, NotACheckpoint, UnsupportedFormat
from ckpttool.core.geometry import split_dim0
from ckpttool.readers.detect import VERL_MODEL_PATTERN, VERL_SUBDIRS, verl_files
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED, _Rebuilt
from ckpttool.torchsave.stored import (DTypeName, StateDictUnpickler, closing_build_as_pop, device, ints, load_data_pkl,
                                      raw_blob, stored_dtype)
from ckpttool.torchsave.zip import Entry, read_directory

FSDP_CONFIG = "fsdp_config.json"  # fsdp_checkpoint_manager.py: {"FSDP_version": 2, "world_size": W}
MAX_CONFIG_BYTES = 1 << 20
MODEL_FILE = "model_world_size_{world_size}_rank_{rank}.pt"
MODEL_FILES_GLOB = "model_world_size_{world_size}_rank_*.pt"  # shown as the metadata file


# ---------------------------------------------------------------------------------------------
# Stand-ins: what each admitted global becomes. Classes are built by NEWOBJ + BUILD (their
# fields land in `__dict__`, read back with `_fields`); nothing here runs code from the file.


class _Stub:
    """An admitted torch class (DTensorSpec, DeviceMesh, Shard, ...): BUILD fills its `__dict__`;
    arguments (NEWOBJ of a NamedTuple such as TensorMeta) are dropped."""

    def __init__(self, *args: Any) -> None:
        pass


def _stub(name: str) -> type:
    return type(name, (_Stub,), {})


class _Marker:
    """A global that is only passed around, never called (DTensor, _rebuild_wrapper_subclass):
    not callable, so a pickle that REDUCEs it is refused by the scan."""

    def __init__(self, name: str) -> None:
        self.name = name


@dataclass(frozen=True)
class _Subclass:
    """`torch._tensor._rebuild_from_type_v2(func, new_type, args, state)`, recorded."""

    func: Any
    new_type: Any
    args: Any
    state: Any


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> _Subclass:
    return _Subclass(func, new_type, args, state)


def _layout_name(name: Any) -> str:
    return name if type(name) is str else "?"


_DTENSOR = _Marker("DTensor")
_WRAPPER_SUBCLASS = _Marker("_rebuild_wrapper_subclass")
_SPEC, _MESH, _MESH_LAYOUT, _FLAT_LAYOUT = _stub("DTensorSpec"), _stub("DeviceMesh"), _stub("_MeshLayout"), _stub("_FlatLayout")
_TENSOR_META, _SHARD_ORDER = _stub("TensorMeta"), _stub("ShardOrderEntry")
_SHARD, _REPLICATE, _PARTIAL, _STRIDED_SHARD = _stub("Shard"), _stub("Replicate"), _stub("Partial"), _stub("_StridedShard")

_TENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed.tensor._api", "torch.distributed._tensor",
                   "torch.distributed._tensor.api")
_SPEC_MODULES = ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types")
_PLACEMENT_MODULES = ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types")
_ALLOWED: dict[tuple[str, str], Any] = {
    **_TENSOR_PICKLE_ALLOWED,  # _rebuild_tensor_v2/v3, typed storages, OrderedDict, torch.Size
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _WRAPPER_SUBCLASS,
    ("torch", "device"): device,
    ("torch.serialization", "_get_layout"): _layout_name,
    ("torch.distributed.device_mesh", "DeviceMesh"): _MESH,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _MESH_LAYOUT,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _FLAT_LAYOUT,
    **{(module, "DTensor"): _DTENSOR for module in _TENSOR_MODULES},
    **{(module, name): cls for module in _SPEC_MODULES
       for name, cls in (("DTensorSpec", _SPEC), ("TensorMeta", _TENSOR_META), ("ShardOrderEntry", _SHARD_ORDER))},
    **{(module, name): cls for module in _PLACEMENT_MODULES
       for name, cls in (("Shard", _SHARD), ("Replicate", _REPLICATE), ("Partial", _PARTIAL),
                         ("_StridedShard", _STRIDED_SHARD))},
}


class _Unpickler(StateDictUnpickler):
    """The checking loader with verl's allowlist: a refused name is named in one line."""

    holds = "a verl model state dict"

    def refuse(self, module: str, name: str) -> None:
        if module.startswith("torch.distributed._shard"):
            raise UnsupportedFormat(f"{self._source}: holds FSDP1 ShardedTensors (`{module:.100}.{name:.100}`), "
                                    "which this build does not read; only FSDP2 DTensor state dicts")


# ---------------------------------------------------------------------------------------------
# Reading


def model_folder(path: Path) -> Path:
    """Return the folder holding verl's model files: `path` or its `actor/`."""
    for sub in VERL_SUBDIRS:
        if verl_files(path / sub):
            return path / sub
    raise NotACheckpoint(f"{path}: no {MODEL_FILE.format(world_size='W', rank='R')} files here or in actor/")


def read_verl(path: str | os.PathLike, follow_symlinks: bool = False) -> Checkpoint:
    """Return the model tensors of verl's per-rank model files in `path` (or `path/actor`) as
    a Checkpoint rooted at their folder: one chunk per rank and tensor, each a raw byte range
    of that rank's .pt file.

    Raises UnsafeMetadata for a pickle naming anything outside the allowlist, CorruptMetadata
    or CorruptBlob for damaged files, MissingFile for a missing rank, UnsupportedFormat for
    what this build cannot place (non-contiguous shards, Partial or strided placements).
    """
    root = model_folder(Path(path))
    world_size, names = _rank_files(root)
    found: dict[str, list] = {}  # fqn -> [dtype, shape, chunks]
    first_keys: list[str] | None = None
    with DataFiles(root, follow_symlinks) as files:
        for rank, name in enumerate(names):
            pieces = _read_rank(files, name, rank, world_size)
            keys = [fqn for fqn, _, _, _ in pieces]
            if first_keys is None:
                first_keys = keys
            elif set(keys) != set(first_keys):
                odd = sorted(set(keys) ^ set(first_keys))[0]
                raise CorruptMetadata(f"{root / name}: {odd} is in {'this file' if odd in keys else names[0]} "
                                      f"but not in {names[0] if odd in keys else 'this file'}; the ranks disagree")
            for fqn, dtype, shape, chunk in pieces:
                entry = found.setdefault(fqn, [dtype, shape, []])
                if (entry[0], entry[1]) != (dtype, shape):
                    raise CorruptMetadata(f"{root / name}: {fqn}: {dtype} of shape {list(shape)}, but "
                                          f"{names[0]} says {entry[0]} of shape {list(entry[1])}")
                if chunk is not None:
                    entry[2].append(chunk)
    tensors, notes = {}, []
    for fqn in sorted(found):
        dtype, shape, chunks = found[fqn]
        chunks.sort(key=lambda c: c.offsets)
        tensors[fqn] = Tensor(fqn, dtype, shape, tuple(chunks))
        if dtype not in dtypes.ITEMSIZE:
            notes.append(f"{fqn}: unknown dtype {dtype[:64]!r}")
    metadata_file = MODEL_FILES_GLOB.format(world_size=world_size)
    refuse_bad_names(root / metadata_file, list(tensors), set(), tensors, {})
    return Checkpoint(path=root, metadata_file=metadata_file, version=None, tensors=tensors, objects={},
                      notes=tuple(notes), model_prefix="")


def _rank_files(root: Path) -> tuple[int, list[str]]:
    """Return the world size and its model files, rank by rank (MissingFile for a gap)."""
    ranks: dict[int, set[int]] = {}
    for name in verl_files(root):
        match = VERL_MODEL_PATTERN.match(name)
        assert match is not None  # verl_files keeps only the names it matches
        world_size, rank = map(int, match.groups())
        ranks.setdefault(world_size, set()).add(rank)
    if len(ranks) > 1:
        configured = _configured_world_size(root)
        if configured is None or configured not in ranks:
            raise CorruptMetadata(f"{root}: model files of several world sizes ({', '.join(map(str, sorted(ranks)))}) "
                                  f"and no {FSDP_CONFIG} naming one of them; remove the stale ones")
        world_size = configured
    else:
        (world_size,) = ranks
    for rank in range(world_size):
        if rank not in ranks[world_size]:
            raise MissingFile(f"{root / MODEL_FILE.format(world_size=world_size, rank=rank)}: missing, but the other "
                              f"{world_size - 1} ranks' files are here (was the copy partial?)")
    return world_size, [MODEL_FILE.format(world_size=world_size, rank=rank) for rank in range(world_size)]


def _configured_world_size(root: Path) -> int | None:
    config = root / FSDP_CONFIG
    try:
        if not config.is_file() or config.stat().st_size > MAX_CONFIG_BYTES:
            return None
        document = json.loads(config.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    world_size = document.get("world_size") if isinstance(document, dict) else None
    return world_size if type(world_size) is int else None


def _read_rank(files: DataFiles, name: str, rank: int, world_size: int) -> list[tuple[str, str, tuple, Chunk | None]]:
    """Return (fqn, dtype, global shape, this rank's chunk or None) for each entry of one file,
    in the file's order; None when another rank holds the same replicated bytes."""
    where = str(files.path(name))
    size = files.size(name)

    def read(offset: int, length: int) -> bytes:
        return files.read(name, offset, length)

    entries = read_directory(read, size, where)
    state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED, closing_build_as_pop)
    if not isinstance(state, dict):
        raise CorruptMetadata(f"{where}: holds a {type(state).__name__}, not a state dict")
    starts: dict[str, int] = {}  # storage key -> where its bytes start in the file
    pieces = []
    try:
        for fqn, value in state.items():
            if type(fqn) is not str:
                raise CorruptMetadata(f"{where}: a state dict key is a {type(fqn).__name__}, not a string")
            pieces.append(_piece(entries, starts, read, size, where, name, rank, fqn, value))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as error:
        raise CorruptMetadata(f"{where}: malformed DTensor state dict ({type(error).__name__}: {str(error)[:200]})") from None
    return pieces


def _fields(obj: Any) -> dict:
    return obj.__dict__ if isinstance(obj, _Stub) else {}


def _piece(entries: dict[str, Entry], starts: dict[str, int], read: Any, size: int, where: str, name: str,
           rank: int, fqn: str, value: Any) -> tuple[str, str, tuple, Chunk | None]:
    here = f"{where}: {fqn}"
    if isinstance(value, _Rebuilt):  # a plain tensor: the same on every rank, taken from rank 0
        dtype = stored_dtype(value, here)
        shape = ints(value.shape, f"{here}: shape")
        chunk = Chunk((0,) * len(shape), shape, raw_blob(entries, starts, read, size, here, name, value, dtype))
        return fqn, dtype, shape, chunk if rank == 0 else None
    if not (isinstance(value, _Subclass) and value.func is _WRAPPER_SUBCLASS and value.new_type is _DTENSOR):
        raise UnsupportedFormat(f"{here}: a {type(value).__name__}, not a tensor or DTensor; this build reads "
                                "verl model state dicts of tensors only")
    args = value.args
    if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[1], DTypeName)):
        raise CorruptMetadata(f"{here}: malformed DTensor arguments")
    dtype, shape = args[1].name, ints(args[2], f"{here}: DTensor shape")
    slots: dict = {}
    for part in value.state if isinstance(value.state, tuple) else (value.state,):
        if isinstance(part, dict):
            slots.update(part)
    local, spec = slots.get("_local_tensor"), _fields(slots.get("_spec"))
    if not isinstance(local, _Rebuilt) or not isinstance(slots.get("_spec"), _SPEC):
        raise CorruptMetadata(f"{here}: DTensor without a local tensor and spec")
    if stored_dtype(local, here) != dtype:
        raise CorruptMetadata(f"{here}: local tensor holds {stored_dtype(local, here)}, the DTensor says {dtype}")
    offsets, sizes, primary = _place(here, shape, spec, rank)
    if tuple(local.shape) != sizes:
        raise CorruptMetadata(f"{here}: holds a local shard of shape {list(local.shape)}, but its placements "
                              f"give rank {rank} {list(sizes)} of {list(shape)}")
    chunk = Chunk(offsets, sizes, raw_blob(entries, starts, read, size, here, name, local, dtype))
    return fqn, dtype, shape, chunk if primary else None


def _place(here: str, shape: tuple[int, ...], spec: dict, rank: int) -> tuple[tuple, tuple, bool]:
    """Return this rank's chunk (offsets, sizes) from the placements and mesh, as DTensor's
    Shard places it (torch.chunk split, mesh dims in order), and whether this rank is the one
    that contributes it (coordinate 0 on every Replicate mesh dim)."""
    mesh = _fields(spec.get("mesh"))
    placements = spec.get("placements")
    if not mesh or not isinstance(placements, tuple):
        raise CorruptMetadata(f"{here}: DTensor spec without a mesh or placements")
    mesh_shape = _mesh_shape(here, mesh)
    coordinate = mesh.get("_coordinate_on_dim")
    if coordinate is None:
        raise CorruptMetadata(f"{here}: the saving rank is not in the DTensor's device mesh")
    coordinate = ints(coordinate, f"{here}: mesh coordinate")
    if type(mesh.get("_rank")) is int and mesh["_rank"] != rank:
        raise CorruptMetadata(f"{here}: saved by rank {mesh['_rank']}, but the file is named for rank {rank} "
                              "(renamed files?)")
    if not len(placements) == len(mesh_shape) == len(coordinate) or not all(
            c < n for c, n in zip(coordinate, mesh_shape)):
        raise CorruptMetadata(f"{here}: placements {len(placements)}, mesh {list(mesh_shape)} and coordinate "
                              f"{list(coordinate)} do not agree")
    offsets, sizes = [0] * len(shape), list(shape)
    sharded, primary = set(), True
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is _REPLICATE:
            primary = primary and coordinate[mesh_dim] == 0
            continue
        if type(placement) is not _SHARD:
            raise UnsupportedFormat(f"{here}: placement {type(placement).__name__} on mesh dim {mesh_dim}; this build places "
                                    "Shard and Replicate only")
        dim = _fields(placement).get("dim")
        if type(dim) is not int or not -len(shape) <= dim < len(shape):
            raise CorruptMetadata(f"{here}: Shard dim {dim!r:.40} does not fit shape {list(shape)}")
        dim %= len(shape)
        if dim in sharded:  # the order then depends on DTensorSpec.shard_order
            raise UnsupportedFormat(f"{here}: dim {dim} is sharded over several mesh dims; this build does not place that")
        sharded.add(dim)
        start, length = split_dim0(sizes[dim], mesh_shape[mesh_dim])[coordinate[mesh_dim]]
        offsets[dim] += start
        sizes[dim] = length
    return tuple(offsets), tuple(sizes), primary


def _mesh_shape(here: str, mesh: dict) -> tuple[int, ...]:
    """The mesh's size along each dim: from its `_layout` (torch >= 2.9) or `mesh` tensor."""
    layout = _fields(mesh.get("_layout"))
    if layout:
        axes = layout.get("axes")
        if not isinstance(axes, tuple) or not all(isinstance(a, _FLAT_LAYOUT) for a in axes):
            raise CorruptMetadata(f"{here}: malformed device mesh layout")
        return tuple(math.prod(ints(_fields(a).get("shape"), f"{here}: mesh axis shape")) for a in axes)
    tensor = mesh.get("mesh")
    if isinstance(tensor, _Rebuilt):
        return ints(tensor.shape, f"{here}: mesh shape")
    raise CorruptMetadata(f"{here}: device mesh without a layout or mesh tensor")


