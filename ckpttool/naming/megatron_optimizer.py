"""A Megatron-Core `torch_dist` save with its optimizer state, as the transformers model and the
AdamW state FSDP2 loads (`reshard --to transformers`): the migration DeepSpeed saves get from
readers/deepspeed.py, for Megatron.

What Megatron-LM's save holds (megatron/core/optimizer/optimizer.py `FP32Optimizer` /
`MixedPrecisionOptimizer.sharded_state_dict` over torch's AdamW, megatron-core 0.16.1;
fixtures/frameworks/generate_megatron_families.py):

- `optimizer.state.<kind>.<model key>` sharded tensors beside the model (`<kind>` exp_avg,
  exp_avg_sq: dist_checkpointing/optimizer.py `optim_state_to_sharding_state`), laid out like
  the model's tensor: layer-stacked (`decoder.layers.<rest>`), experts on their own axis;
- in common.pt, `optimizer`: torch's `param_groups` (without `params`: Megatron rebuilds the
  membership from the model, `_get_param_groups`) and `state.common_step`, the one Adam step
  every parameter shares (its per-parameter `step` is left out of the sharded state); a model with
  experts chains two optimizers (dense, experts) and saves `{0: ..., 1: ...}`.

So each moment tensor is taken apart per layer exactly as the model's (readers/megatron.py
`unstack`) and converted by the same family table (`engine.convert` on the model keys, the
`optimizer.state.<kind>.` prefix put back on each piece's source): q/k/v split per query group,
gate/up split, one key per expert, as the weights are. Nothing is decoded; every chunk is a raw
byte range of the source (`step` the range of common_step's storage in common.pt).

The result is laid out as `get_state_dict(model, AdamW)` gives it for the transformers model:
`model.<name>`, `optim.state.<name>.{exp_avg, exp_avg_sq, step}`, and `optim.param_groups.<n>.*`
with `params` naming transformers keys. Each parameter's group is found as Megatron built it
(`get_standard_config_overrides`: weight decay off, `wd_mult` 0, for 1-D parameters and biases, q/k
layer norms excepted with --apply-wd-to-qk-layernorm; experts in the expert-parallel groups) and
matched to the saved group carrying that `wd_mult` and `is_expert_parallel`. Megatron's own
bookkeeping keys (`MEGATRON_GROUP_KEYS`: its scheduler's multipliers and bounds, the expert flag)
are left out, and groups equal in what is left (AdamW's settings: lr, betas, eps, weight_decay,
...) are one group: the decay and no-decay groups a transformers training script builds.

Megatron's distributed optimizer in Megatron-LM 0.16's default torch_dist sharding, `dp_reshardable`
(`optimizer.distributed.*...bucket_idx_*` tensors: each model-parallel rank's grad buffer state
per bucket), is read per parameter by readers/megatron_bucket_space.py and converted as a legacy
save's is (below). Refused by name (a save whose optimizer this does not read): the distributed
optimizer's other shardings (flat per-data-parallel-rank buffers; a `param_state_sharding_type`
in common.pt beside model-space state whose step lives in the groups), any
other optimizer state kind, a --decoupled-lr run (its embedding/output group is told apart by a
module attribute the save does not keep), and tied embeddings.

A legacy per-rank save (`--ckpt-format torch`: `mp_rank_TT_PPP/model_optim_rng.pt`) is read by
readers/megatron_legacy_optimizer.py `read_legacy_optimizer`: each rank's torch optimizer state dict (Megatron's
non-distributed FP32Optimizer), its integer ids mapped to the parameters in the order Megatron-LM
built its param groups, the moments merged over tensor-parallel ranks and renumbered over pipeline
stages as the weights are; its config from the pickled `args`. Then the same table converts it,
every chunk (the per-parameter `step` too, tensor-parallel rank 0's) a raw byte range of a rank
file; each parameter goes to the saved group its id is in. With Megatron's distributed optimizer
the moments are byte ranges of each rank's distrib_optim.pt, and the step, kept only as a number
in the param groups, is the one value written anew: the torch.save of a 0-d float32 tensor, a
byte entry that dcp.load puts in the step's place. Refused there by name: the mixed-precision and
chained optimizers' state, a save without optimizer state, other optimizers than Adam/AdamW and
non-standard param groups.

Example:
    >>> migration = plan_migration(MEGATRON, read_checkpoint("checkpoints/iter_0000002"))
    >>> sorted(migration.targets)[:2]
    ['model.lm_head.weight', 'model.model.embed_tokens.weight']
"""

from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Object, Tensor
from ckpttool.core.errors import CorruptMetadata, UnsupportedFormat, UsageError
from ckpttool.dcp.blobs import DataFiles
from ckpttool.naming import engine, megatron_config
from ckpttool.naming.fused import FusedLayout
from ckpttool.readers.detect import MEGATRON, MEGATRON_COMMON, MEGATRON_DCP, MEGATRON_FSDP, MEGATRON_LEGACY
from ckpttool.readers.megatron import MODEL_SUBTREE, model_view, stacked_split, unstack
from ckpttool.readers.megatron_bucket_space import read_bucket_optimizer
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.megatron_fsdp import read_fsdp_optimizer
from ckpttool.readers.megatron_legacy_optimizer import LegacyOptimizer, read_legacy_optimizer
from ckpttool.torchsave.archive import saved_value
from ckpttool.torchsave.pickle import dumps
from ckpttool.torchsave.record import _Rebuilt, record_bytes
from ckpttool.torchsave.stored import file_entries, load_data_pkl, raw_blob, stored_dtype

TRANSFORMERS = "transformers"  # reshard --to transformers
OPTIMIZER_STATE = "optimizer.state."  # Megatron: f'optimizer.state.{state_key}.{model key}'
DISTRIBUTED = "optimizer.distributed."  # DistributedOptimizer: f'optimizer.distributed.dp_group_idx_{i}.{k}'
# distrib_optimizer.py sharded_param_state_dp_reshardable (Megatron-LM 0.16's default sharding for torch_dist):
# f'{DISTRIBUTED}dp_group_idx_{i}.gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{b}.{param,exp_avg,exp_avg_sq}'
BUCKET_SPACE = ".bucket_idx_"
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch's Adam/AdamW per-parameter state (its `step` comes from common.pt)
OPTIMIZER, COMMON_STEP, SHARDING_TYPE = "optimizer", "common_step", "param_state_sharding_type"
WD_MULT, EXPERT_PARALLEL = "wd_mult", "is_expert_parallel"
# what megatron/core/optimizer/__init__.py `_get_param_groups` adds to torch's group settings (its
# scheduler's multipliers and bounds, the group's origin): FSDP2's AdamW has no use for them
MEGATRON_GROUP_KEYS = frozenset({WD_MULT, "lr_mult", EXPERT_PARALLEL, "is_decoupled_lr", "default_config",
                                 "max_lr", "min_lr"})
EXPERTS = ".mlp.experts."  # MoE experts' parameters: `allreduce = False`, the expert-parallel groups
QK_NORMS = ("q_layernorm.", "k_layernorm.")
# get_state_dict(model, optimizer) as the bundled trainer saves it (train_minimal/checkpoint.py)
MODEL, OPTIM_STATE, OPTIM_GROUPS = "model", ("optim", "state"), ("optim", "param_groups")
STEP = "step"


@dataclass(frozen=True)
class Group:
    """One AdamW param group of the output: its settings (as Megatron saved them, its own keys
    left out) and its members (transformers names, in the model's order)."""

    settings: tuple[tuple[str, Any], ...]
    members: tuple[str, ...]


@dataclass(frozen=True)
class Migration:
    """What the output holds, before any byte is located: `targets` (output fqn -> the table's
    Target, its pieces naming fqns of `view`), each trained parameter's `step` (a 0-d tensor's
    bytes in common.pt), and the param groups."""

    family: str
    view: Checkpoint  # the save with its model and moments one tensor per layer
    targets: dict[str, engine.Target]
    steps: dict[str, tuple[str, Blob]]  # transformers name -> (dtype, common_step's bytes)
    groups: tuple[Group, ...]
    parameters: tuple[str, ...]  # transformers names of the model, in its order
    # a legacy distributed-optimizer save keeps the step only as a number in its param groups: it is
    # written as the torch.save of a 0-d float32 tensor (a byte entry dcp.load puts in the step's place)
    step_values: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def sources(self) -> list[Tensor]:
        """Return the tensors of `view` whose bytes the output copies (to locate)."""
        names = sorted({piece.source for target in self.targets.values() for piece in target.pieces})
        return [self.view.tensors[fqn] for fqn in names]

    def checkpoint(self, located: Mapping[str, Any]) -> Checkpoint:
        """Return the output as a Checkpoint laid out as get_state_dict nests it, every chunk a
        raw byte range of the save (`located`: where each source chunk's bytes are)."""
        converted = engine.converted_checkpoint(self.view, self.targets, located)
        tensors = dict(converted.tensors)
        nesting: dict[str, tuple[str | int, ...]] = {}
        for name in self.parameters:
            nesting[f"{MODEL}.{name}"] = (MODEL, name)
        for name in self.parameters:
            for kind in MOMENTS:
                if f"{_state(name)}.{kind}" in tensors:
                    nesting[f"{_state(name)}.{kind}"] = (*OPTIM_STATE, name, kind)
            if name in self.steps:
                dtype, blob = self.steps[name]
                fqn = f"{_state(name)}.{STEP}"
                tensors[fqn] = Tensor(fqn, dtype, (), (Chunk((), (), blob),))
                nesting[fqn] = (*OPTIM_STATE, name, STEP)
        objects: dict[str, Object] = {}
        for name in self.parameters:
            if name in self.step_values:
                fqn = f"{_state(name)}.{STEP}"
                objects[fqn], nesting[fqn] = Object(fqn, None, record_bytes("float32", (), struct.pack("<f", self.step_values[name]))), (*OPTIM_STATE, name, STEP)
        for number, group in enumerate(self.groups):
            for key, value in sorted({**dict(group.settings), "params": list(group.members)}.items()):
                path = (*OPTIM_GROUPS, number, key)
                fqn = ".".join(map(str, path))
                objects[fqn], nesting[fqn] = Object(fqn, None, saved_value(dumps(value))), path
        return dataclasses.replace(converted, tensors=dict(sorted(tensors.items())), objects=dict(sorted(objects.items())),
                                   nesting=nesting, model_prefix=MODEL,
                                   parameters=frozenset(f"{MODEL}.{name}" for name in self.parameters))


def _state(name: str) -> str:
    return ".".join((*OPTIM_STATE, name))


def plan_migration(layout: str, checkpoint: Checkpoint, follow_symlinks: bool = False) -> Migration:
    """Return the Migration of `checkpoint` (read as saved, of `layout`) to transformers names.

    Raises UsageError (exit 2) for a checkpoint that is not a Megatron save, UnsupportedFormat
    (exit 1) naming what this cannot read (module doc), InvalidCheckpoint (config-mismatch) for a
    key the family's table does not take.
    """
    where = str(checkpoint.path)
    if layout == MEGATRON_LEGACY:
        return _legacy_migration(checkpoint, follow_symlinks)
    if layout == MEGATRON_DCP:
        saved = any(fqn.startswith(f"{OPTIMIZER}.") for fqn in (*checkpoint.tensors, *checkpoint.objects))
        raise UnsupportedFormat(f"{where}: a Megatron-LM --ckpt-format torch_dcp save; " + (
            "its optimizer state (torch's, keyed by integer parameter ids) is not read yet" if saved else
            "it holds no optimizer state") + f"; reshard --to {TRANSFORMERS} reads torch_dist, fsdp_dtensor and legacy "
            "saves, `ckpttool export` writes this model")
    if layout == MEGATRON_FSDP:  # readers/megatron_fsdp.py: the moments per parameter, their steps and groups
        args = megatron_config.read_dcp_args(checkpoint.path, follow_symlinks)
        if args is None:
            raise UnsupportedFormat(f"{where}: holds no Megatron-LM arguments (`{megatron_config.ARGS}`), from which "
                                    "the transformers config is made")
        return _migration_of(read_fsdp_optimizer(checkpoint, args, follow_symlinks),
                             f"{where}/{METADATA_FILENAME}: {megatron_config.ARGS}")
    if layout != MEGATRON:
        raise UsageError(f"{where}: a {layout} checkpoint; reshard --to {TRANSFORMERS} converts a Megatron-Core "
                         "torch_dist save or a legacy per-rank Megatron-LM save (a DCP checkpoint of transformers' "
                         "model reshards as it is)")
    distributed = sorted(fqn for fqn in (*checkpoint.tensors, *checkpoint.objects) if fqn.startswith(DISTRIBUTED))
    common = checkpoint.path / MEGATRON_COMMON
    if distributed and any(BUCKET_SPACE in fqn for fqn in distributed):
        # sharding 'dp_reshardable', Megatron-LM's default: readers/megatron_bucket_space.py
        args = megatron_config.read_args(common, follow_symlinks)
        if args is None:
            raise UnsupportedFormat(f"{common}: holds no Megatron-LM arguments (`args`), from which the transformers "
                                    "config and the distributed optimizer's bucket layout are made")
        return _migration_of(read_bucket_optimizer(checkpoint, args, follow_symlinks), f"{common}: args")
    if distributed:
        raise UnsupportedFormat(f"{where}: {distributed[0]}: Megatron's distributed optimizer (--use-distributed-optimizer)"
                                " saves flat per-data-parallel-rank buffers (a deprecated sharding), which are not read; "
                                f"reshard --to {TRANSFORMERS} reads its default dp_reshardable and fully_reshardable "
                                "shardings, and a legacy (--ckpt-format torch) save's distrib_optim.pt")
    config = megatron_config.megatron_hf_config(common, follow_symlinks)
    if config is None:
        raise UnsupportedFormat(f"{common}: holds no Megatron-LM arguments (`args`), from which the transformers "
                                "config is made; a save by megatron-core alone is not migrated yet")
    args = megatron_config.read_args(common, follow_symlinks) or {}
    _refuse_unmigrated(args, config, str(common))
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        optimizers = _saved_optimizers(common, files)
        view = _with_moments_per_layer(model_view(checkpoint, follow_symlinks), files)
    converted = _convert(view, config, where)
    groups, steps = _groups(converted.model, converted.moments, converted.names, optimizers,
                            bool(args.get("apply_wd_to_qk_layernorm")), str(common))
    return Migration(converted.family, view, converted.targets, steps, groups, converted.parameters)


def _refuse_unmigrated(args: Mapping[str, Any], config: Mapping[str, Any], where: str) -> None:
    if args.get("decoupled_lr") is not None or config.get("tie_word_embeddings"):
        what = "--decoupled-lr" if args.get("decoupled_lr") is not None else "tied embeddings"
        raise UnsupportedFormat(f"{where}: a run with {what}, which reshard --to {TRANSFORMERS} does not migrate yet")


@dataclass(frozen=True)
class _Converted:
    """A view's model and moments under the family table: the output's targets, and each
    Megatron key's transformers names."""

    family: str
    model: dict[str, tuple[int, ...]]  # Megatron key -> shape, in the model's order
    moments: dict[str, dict[str, tuple[int, ...]]]  # kind -> Megatron key -> shape
    targets: dict[str, engine.Target]
    names: dict[str, dict[str, None]]  # Megatron key -> its transformers names, in order
    parameters: tuple[str, ...]  # transformers names of the model, in its order


def _convert(view: Checkpoint, config: Mapping[str, Any], where: str) -> _Converted:
    """Convert `view` (the model under `model.`, moments under `optimizer.state.<kind>.`, one
    tensor per layer) by the family table its names and `config` pick."""
    model = {str(path[1]): view.tensors[fqn].shape for fqn, path in view.nesting.items()  # in the model's order
             if path[0] == MODEL_SUBTREE and fqn in view.tensors}
    moments = _moments(view, model, where)
    family = engine.find_family(model, _families(), config, where)
    if family is None:
        raise UnsupportedFormat(f"{where}: the model's names are no Megatron family's this build converts")
    refused = [key for key, reason in family.left_out(model, False).items() if reason.changes_forward]
    if refused:
        raise UnsupportedFormat(f"{where}: {MODEL_SUBTREE}.{refused[0]} has no transformers name and may change the "
                                "model's outputs (`ckpttool export` checks its value); it is not migrated")
    settings = {**config, **engine.required_settings(family, config, where)}
    architecture = family.architecture(str((config.get("architectures") or [""])[0]))
    fused = architecture.fused if architecture is not None else None

    def converted(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, engine.Target]:
        return _as_modules(engine.convert(family, shapes, settings, where), fused, where)

    hf = converted(model)
    targets = _renamed(hf, MODEL + ".", MODEL_SUBTREE + ".")
    names: dict[str, dict[str, None]] = {key: {} for key in model}
    for name, target in hf.items():
        for piece in target.pieces:
            names[piece.source][name] = None
    for kind, shapes in moments.items():
        targets.update(_renamed(converted(shapes), "", f"{OPTIMIZER_STATE}{kind}.", kind))
    return _Converted(family.name, model, moments, targets, names, tuple(hf))


def _legacy_migration(checkpoint: Checkpoint, follow_symlinks: bool) -> Migration:
    """The Migration of a legacy per-rank save (readers/megatron_legacy_optimizer.py `read_legacy_optimizer`:
    the model and each parameter's moments merged over the ranks, its saved group and step)."""
    saved = read_legacy_optimizer(checkpoint.path, follow_symlinks)
    return _migration_of(saved, f"{saved.checkpoint.path}/{saved.checkpoint.metadata_file}")


def _migration_of(saved: LegacyOptimizer, args_file: str) -> Migration:
    """The Migration of a save read per parameter (a legacy save's, an fsdp_dtensor save's): its model
    and moments converted by the family table, each parameter in its saved group, with its step."""
    where = str(saved.checkpoint.path)
    config = megatron_config.hf_config(saved.args, args_file)
    _refuse_unmigrated(saved.args, config, args_file)
    converted = _convert(saved.checkpoint, config, where)
    trained = [key for key in converted.model if key in next(iter(converted.moments.values()), {})]
    merged: dict[tuple[tuple[str, Any], ...], list[str]] = {}  # in the saved groups' order
    for group in saved.groups:
        merged.setdefault(_settings(group), [])
    steps: dict[str, tuple[str, Blob]] = {}
    values: dict[str, float] = {}
    for key in trained:
        merged[_settings(saved.groups[saved.group_of[key]])].extend(converted.names[key])
        step = saved.steps[key]
        for name in converted.names[key]:
            if isinstance(step, float):
                values[name] = step
            else:
                steps[name] = (step.dtype, step.blob)
    groups = tuple(Group(settings, tuple(members)) for settings, members in merged.items() if members)
    return Migration(converted.family, saved.checkpoint, converted.targets, steps, groups, converted.parameters, values)


def _families() -> tuple[engine.Family, ...]:
    from ckpttool import naming

    return naming.FAMILIES


def _as_modules(targets: dict[str, engine.Target], layout: FusedLayout | None, where: str) -> dict[str, engine.Target]:
    """`targets` (checkpoint names: one key per expert) as the transformers module names them,
    which is what get_state_dict gives: its fused experts (`layout`, naming/fused.py: e.g.
    `mlp.experts.gate_up_proj` [E, 2F, D], each expert's gate rows then its up rows) one target
    each, every expert's pieces placed at its rows; the layout's renames applied to every name."""
    if layout is None:
        return targets
    named = {_module_name(name, layout): target for name, target in targets.items()}
    parts: dict[str, dict[int, list[str | None]]] = {}  # fused module key -> expert -> its parts' names
    fused_as: dict[str, str] = {}  # a part's name -> its module key
    for rule in layout.rules:
        for index, part in enumerate(rule.parts):
            pattern = re.compile(re.escape(_module_name(part, layout)).replace(r"\{P\}", "(?P<P>.+)")
                                 .replace(r"\{E\}", r"(?P<E>\d+)"))
            for name in named:
                found = pattern.fullmatch(name)
                if found is not None and name not in fused_as:
                    module = _module_name(rule.module.replace("{P}", found["P"]), layout)
                    parts.setdefault(module, {}).setdefault(int(found["E"]), [None] * len(rule.parts))[index] = name
                    fused_as[name] = module
    result: dict[str, engine.Target] = {}
    for name, target in named.items():
        owner = fused_as.get(name)
        if owner is None:
            result[name] = target
        elif owner not in result:
            result[owner] = _fused_target(owner, parts[owner], named, where)
    return result


def _fused_target(module: str, experts: Mapping[int, list[str | None]], named: Mapping[str, engine.Target],
                  where: str) -> engine.Target:
    """The fused module tensor [experts, rows, ...] made of each expert's parts, in order."""
    if sorted(experts) != list(range(len(experts))) or any(None in names for names in experts.values()):
        raise UnsupportedFormat(f"{where}: {module}: transformers fuses the experts' tensors, but not every expert's "
                                "parts are in the save")
    first = named[str(experts[0][0])]
    rows = sum(named[str(name)].shape[0] for name in experts[0])
    shape = (len(experts), rows, *first.shape[1:])
    pieces = []
    for expert in range(len(experts)):
        row = 0
        for name in experts[expert]:
            target = named[str(name)]
            if target.shape[1:] != first.shape[1:] or any(p.at is not None or p.step != 1 for p in target.pieces):
                raise UnsupportedFormat(f"{where}: {name} (shape {list(target.shape)}) is not rows of {module}")
            for piece in target.pieces:
                pieces.append(dataclasses.replace(piece, at=(expert, row, *(0,) * (len(shape) - 2))))
                row += piece.box[1][len(piece.box[1]) - len(target.shape)]
        if row != rows:
            raise UnsupportedFormat(f"{where}: expert {expert}'s parts of {module} hold {row} rows, expert 0's {rows}")
    return engine.Target(module, shape, tuple(pieces), first.rule)


def _module_name(name: str, layout: FusedLayout) -> str:
    """`name` with the layout's renames (checkpoint text -> the module's)."""
    for old, new in layout.renames:
        name = name.replace(old, new)
    return name


def _renamed(targets: dict[str, engine.Target], prefix: str, source: str, kind: str | None = None
             ) -> dict[str, engine.Target]:
    """`targets` keyed by the output's fqn (`prefix` + name, or the optimizer state's of `kind`),
    each piece naming the view's fqn (`source` + key)."""
    renamed = {}
    for name, target in targets.items():
        fqn = f"{_state(name)}.{kind}" if kind is not None else prefix + name
        pieces = tuple(dataclasses.replace(piece, source=source + piece.source) for piece in target.pieces)
        renamed[fqn] = dataclasses.replace(target, key=fqn, pieces=pieces)
    return renamed


def _with_moments_per_layer(view: Checkpoint, files: DataFiles) -> Checkpoint:
    """`view` (readers/megatron.py's model view) with each layer-stacked moment tensor taken
    apart per layer as the model's are (CorruptMetadata naming one that cannot be)."""
    tensors = {}
    for fqn, tensor in view.tensors.items():
        split = stacked_split(fqn) if fqn.startswith(OPTIMIZER_STATE) else None
        if split is None:
            tensors[fqn] = tensor
            continue
        parts = unstack(tensor, *split, files)
        if parts is None:
            raise CorruptMetadata(f"{view.path}: {fqn}: its chunks are not one layer each, as Megatron saves a "
                                  "layer-stacked tensor (run `ckpttool validate` for what is wrong)")
        tensors.update((part.fqn, part) for part in parts)
    return dataclasses.replace(view, tensors=dict(sorted(tensors.items())))


def _moments(view: Checkpoint, model: Mapping[str, tuple[int, ...]], where: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """Return kind -> model key -> shape of the saved optimizer state, in the model's order;
    refuse a kind Adam does not keep, and a moment of no model tensor or of another shape."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for fqn, tensor in view.tensors.items():
        if not fqn.startswith(OPTIMIZER_STATE):
            continue
        kind, _, key = fqn.removeprefix(OPTIMIZER_STATE).partition(".")
        if kind not in MOMENTS:
            raise UnsupportedFormat(f"{where}: {fqn}: optimizer state `{kind}` is not Adam's ({', '.join(MOMENTS)}); "
                                    f"reshard --to {TRANSFORMERS} migrates Adam/AdamW state only")
        if model.get(key) != tensor.shape:
            raise CorruptMetadata(f"{where}: {fqn} (shape {list(tensor.shape)}) is the state of no model tensor of "
                                  "that shape")
        found.setdefault(kind, {})[key] = tensor.shape
    if found and any(set(shapes) != set(found[MOMENTS[0]]) for shapes in found.values()):
        raise CorruptMetadata(f"{where}: the saved exp_avg and exp_avg_sq are not of the same parameters")
    return {kind: {key: model[key] for key in model if key in shapes} for kind, shapes in sorted(found.items())}


@dataclass(frozen=True)
class _Saved:
    """One saved (sub-)optimizer: its param groups and the bytes of its common step."""

    groups: tuple[dict[str, Any], ...]
    step: tuple[str, Blob] | None


def _saved_optimizers(common: Path, files: DataFiles) -> tuple[_Saved, ...]:
    """Return common.pt's optimizers (one, or a chained optimizer's in order), read through the
    checking loader; refuse the distributed optimizer's state by its sharding type."""
    where = str(common)
    size = files.size(common.name)

    def read(offset: int, length: int) -> bytes:
        return files.read(common.name, offset, length)

    entries = file_entries(read, size, where)
    state = load_data_pkl(entries, read, size, where, megatron_config._Unpickler, megatron_config._ALLOWED,
                          megatron_config._as_saved)
    saved = state.get(OPTIMIZER) if isinstance(state, dict) else None
    if saved is None:
        return ()
    chained = isinstance(saved, dict) and all(type(key) is int for key in saved) and saved
    parts = [saved[key] for key in sorted(saved)] if chained else [saved]
    starts: dict[str, int] = {}
    found = []
    for number, part in enumerate(parts):
        here = f"{where}: {OPTIMIZER}" + (f"[{number}]" if chained else "")
        if not isinstance(part, dict) or not isinstance(part.get("param_groups"), list):
            raise CorruptMetadata(f"{here}: no param_groups")
        if SHARDING_TYPE in part:
            raise UnsupportedFormat(f"{here}: {SHARDING_TYPE} {str(part[SHARDING_TYPE])[:40]!r}: Megatron's distributed "
                                    "optimizer state, which is not read yet; reshard --to "
                                    f"{TRANSFORMERS} reads the optimizer state of a run without it")
        if not all(isinstance(group, dict) for group in part["param_groups"]):
            raise CorruptMetadata(f"{here}: a param group is not a dict")
        step = (part.get("state") or {}).get(COMMON_STEP) if isinstance(part.get("state"), dict) else None
        blob = None
        if isinstance(step, _Rebuilt) and step.shape == ():
            dtype = stored_dtype(step, f"{here}: {COMMON_STEP}")
            blob = (dtype, raw_blob(entries, starts, read, size, f"{here}: {COMMON_STEP}", common.name, step, dtype))
        found.append(_Saved(tuple(part["param_groups"]), blob))
    return tuple(found)


def _groups(model: Mapping[str, tuple[int, ...]], moments: Mapping[str, Mapping[str, tuple[int, ...]]],
            names: Mapping[str, Mapping[str, None]], optimizers: tuple[_Saved, ...], qk_decay: bool, where: str,
            ) -> tuple[tuple[Group, ...], dict[str, tuple[str, Blob]]]:
    """Return the output's param groups and each trained parameter's step: every Megatron
    parameter with state goes to the saved group of its `wd_mult` and expert-parallel flag (as
    `_get_param_groups` built them), its transformers names with it."""
    trained = [key for key in model if key in next(iter(moments.values()), {})]
    if not trained:
        return (), {}
    saved = [(optimizer, group) for optimizer in optimizers for group in optimizer.groups]
    merged: dict[tuple[tuple[str, Any], ...], list[str]] = {}  # in the saved groups' order
    for _, group in saved:
        merged.setdefault(_settings(group), [])
    steps: dict[str, tuple[str, Blob]] = {}
    for key in trained:
        no_decay = (len(model[key]) == 1 or key.endswith(".bias")) and not (qk_decay and any(n in key for n in QK_NORMS))
        wanted = (0.0 if no_decay else 1.0, EXPERTS in f".{key}")
        matching = [(optimizer, group) for optimizer, group in saved
                    if (group.get(WD_MULT), bool(group.get(EXPERT_PARALLEL, False))) == wanted]
        if len(matching) != 1:
            raise UnsupportedFormat(f"{where}: {len(matching)} of the saved param groups have wd_mult {wanted[0]} and "
                                    f"is_expert_parallel {wanted[1]}, the group of {MODEL_SUBTREE}.{key}; its group "
                                    "cannot be told (a run with other param group overrides)")
        optimizer, group = matching[0]
        if optimizer.step is None:
            raise UnsupportedFormat(f"{where}: the optimizer of {MODEL_SUBTREE}.{key} saves no {COMMON_STEP} (apex or "
                                    "Transformer Engine's fused Adam keep the step in the param groups), not read yet")
        merged[_settings(group)].extend(names[key])
        steps.update((name, optimizer.step) for name in names[key])
    return tuple(Group(settings, tuple(members)) for settings, members in merged.items() if members), steps


def _settings(group: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A saved group's settings without Megatron's own keys (and `params`, which it leaves out)."""
    return tuple(sorted((str(k), v) for k, v in group.items() if k not in MEGATRON_GROUP_KEYS and k != "params"))


__all__ = ["Group", "Migration", "TRANSFORMERS", "plan_migration"]
