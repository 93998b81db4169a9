"""Megatron-LM's `--ckpt-format fsdp_dtensor` saves (Megatron-FSDP) as the GPTModel's own tensors.

Megatron-LM's `save_checkpoint` (megatron/training/checkpointing.py, core_v0.16.1, the fsdp_dtensor
branch) writes `generate_state_dict`'s dict with torch's own `dcp.save` into `iter_%07d/`, after
`preprocess_fsdp_dtensor_state_dict` (and no common.pt: `args`, `checkpoint_version`,
`iteration`, `rng_state` are DCP byte entries). What that leaves on disk, and what this view
undoes (metadata only: every chunk keeps its stored bytes):

- the model is `MegatronFSDP.state_dict()`: each GPTModel key behind Megatron-FSDP's `module.`
  (one more per wrapper inside it, Float16Module's under bf16): `model.module.decoder.layers.0...`.
  Here: `model.decoder.layers.0...` (the `model` subtree, as readers/megatron.py puts a
  `torch_dist` save's), so consolidate writes the GPTModel's names and the Megatron family
  tables name the model as for `torch_dist`;
- a SwiGLU `linear_fc1.weight` (or `.bias`, an expert's `weightN`) is saved as two tensors,
  `<key>_w` (the gate rows) and `<key>_v` (the up rows), each over all tensor-parallel ranks
  (megatron/core/transformer/fsdp_dtensor_checkpoint.py `handle_swiglu_in_state_dict`). Here they
  are one tensor again, gate rows then up rows: the `_v` chunks moved down by the `_w` rows. That
  is the GPTModel's own fc1 at tensor parallel 1, and `torch_dist`'s global fc1 at any;
- `_extra_state` entries are dropped by the save; expert keys carry global expert numbers
  (`handle_experts_in_state_dict`), as the tables expect.

The optimizer state (distrib_optimizer.py `sharded_param_state_fsdp_dtensor`: torch AdamW's state
keyed by each parameter's name in the Megatron-FSDP adapter, `module.module.<key>`, SwiGLU halves
split as the weights' are) is `optimizer.state.<module.>*<key>.{exp_avg, exp_avg_sq, step}` and
`optimizer.param_to_group_meta.<module.>*<key>.<setting>` (each a byte entry; the fused fc1's
group under its fused name). Here the moments are `optimizer.state.<kind>.<key>`, fused as the
weights are (the layout readers/megatron.py reads a `torch_dist` save's in); `read_fsdp_optimizer`
gives each parameter's step and group, for `reshard --to transformers`.

Example:
    >>> view = model_view(read_checkpoint("checkpoints/iter_0000002"))
    >>> view.tensors["model.decoder.layers.0.mlp.linear_fc1.weight"].shape
    (128, 32)
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

from ckpttool.core.checkpoint import Checkpoint, Chunk, Tensor
from ckpttool.core.errors import CorruptMetadata, UnsupportedFormat
from ckpttool.dcp.blobs import DataFiles, object_bytes
from ckpttool.readers.megatron import MODEL_SUBTREE, _natural
from ckpttool.readers.megatron_legacy import Stored
from ckpttool.readers.megatron_legacy_optimizer import LegacyOptimizer
from ckpttool.torchsave.record import read_plain_object

WRAPPER = "module."  # MegatronFSDP's (and Float16Module's) attribute holding the model
GATE, UP = "_w", "_v"  # handle_swiglu_in_state_dict: f"{key}_w", f"{key}_v"
STATE, GROUP_META = "optimizer.state.", "optimizer.param_to_group_meta."  # sharded_param_state_fsdp_dtensor
MOMENTS, STEP = ("exp_avg", "exp_avg_sq"), "step"  # torch AdamW's per-parameter state
EXTRA_STATE = "._extra_state"  # a module's non-tensor state (TransformerEngine's FP8 metadata; None here)


def model_view(checkpoint: Checkpoint) -> Checkpoint:
    """Return `checkpoint` with its model tensors under the `model` subtree by the GPTModel's
    names, SwiGLU halves fused; everything else as saved.

    Raises CorruptMetadata when a SwiGLU half has no partner of the same dtype and row width, or
    two saved names give one model name.
    """
    model: dict[str, Tensor] = {}
    moments: dict[str, dict[str, Tensor]] = {kind: {} for kind in MOMENTS}
    others: dict[str, Tensor] = {}
    for fqn, tensor in checkpoint.tensors.items():
        key, kind = _model_key(fqn), None
        if key is None and fqn.startswith(STATE + WRAPPER) and fqn.rsplit(".", 1)[-1] in MOMENTS:
            key, kind = _unwrapped(fqn[len(STATE):].rsplit(".", 1)[0]), fqn.rsplit(".", 1)[-1]
        named = model if kind is None else moments[kind]
        if key is None:
            others[fqn] = tensor
        elif key in named:
            raise CorruptMetadata(f"{checkpoint.path}: {fqn} and another entry both give the model's {key}")
        else:
            named[key] = tensor
    fused = _fused(checkpoint, model)
    tensors = dict(others)
    for kind, saved in moments.items():
        for key, tensor in _fused(checkpoint, saved).items():
            name = f"{STATE}{kind}.{key}"
            if name in others:
                raise CorruptMetadata(f"{checkpoint.path}: {name} is saved under that name and as Megatron-FSDP state")
            tensors[name] = dataclasses.replace(tensor, fqn=name)
    nesting: dict[str, tuple[str | int, ...]] = {}
    for key in sorted(fused, key=_natural):
        name = f"{MODEL_SUBTREE}.{key}"
        if name in others:
            raise CorruptMetadata(f"{checkpoint.path}: {name} is saved under that name and as a Megatron-FSDP model key")
        tensors[name] = dataclasses.replace(fused[key], fqn=name)
        nesting[name] = (MODEL_SUBTREE, key)
    objects = {fqn: entry for fqn, entry in checkpoint.objects.items()  # torch_dcp: the model's byte entries
               if not (fqn.startswith(f"{MODEL_SUBTREE}.") and fqn.endswith(EXTRA_STATE))}
    return dataclasses.replace(checkpoint, tensors=dict(sorted(tensors.items())), objects=objects, nesting=nesting,
                               model_prefix=MODEL_SUBTREE)


def _model_key(fqn: str) -> str | None:
    """The GPTModel key of a saved model tensor (`model.module.decoder...`, torch_dcp's `model.decoder...`
    -> `decoder...`), or None."""
    head = f"{MODEL_SUBTREE}."
    return _unwrapped(fqn[len(head):]) if fqn.startswith(head) else None


def _unwrapped(name: str) -> str:
    """`name` without its wrappers' `module.` levels."""
    while name.startswith(WRAPPER):
        name = name[len(WRAPPER):]
    return name


def _fused(checkpoint: Checkpoint, model: dict[str, Tensor]) -> dict[str, Tensor]:
    """`model` with each `<key>_w` / `<key>_v` pair one tensor `<key>`: the gate rows, then the up rows."""
    out: dict[str, Tensor] = {}
    for key, tensor in model.items():
        if not _is_swiglu_half(key):
            out[key] = tensor
            continue
        whole, gate = key[:-len(GATE)], key.endswith(GATE)
        partner = whole + (UP if gate else GATE)
        if partner not in model:
            half, other = ("gate", "up") if gate else ("up", "gate")
            raise CorruptMetadata(f"{checkpoint.path}: {key} (SwiGLU {half} rows) is saved without its {other} rows "
                                  f"{partner}; the save is incomplete")
        if gate:  # the up half goes with it
            out[whole] = _stacked(checkpoint, whole, tensor, model[partner])
    return out


def _is_swiglu_half(key: str) -> bool:
    """True for the names handle_swiglu_in_state_dict writes: fc1's weight or bias (an expert's `weightN`) + `_w`/`_v`."""
    if not key.endswith((GATE, UP)):
        return False
    stem = key[:-2].rsplit(".", 2)
    return len(stem) == 3 and stem[1] == "linear_fc1" and stem[2].rstrip("0123456789") in ("weight", "bias")


def _stacked(checkpoint: Checkpoint, whole: str, gate: Tensor, up: Tensor) -> Tensor:
    """One tensor of `gate`'s rows, then `up`'s (their chunks, `up`'s moved down by `gate`'s rows)."""
    if gate.dtype != up.dtype or gate.shape[1:] != up.shape[1:] or not gate.shape:
        raise CorruptMetadata(f"{checkpoint.path}: {gate.fqn} ({gate.dtype} {list(gate.shape)}) and {up.fqn} "
                              f"({up.dtype} {list(up.shape)}) are not two row blocks of one SwiGLU {whole}")
    rows = gate.shape[0]
    chunks = [*gate.chunks, *(Chunk((chunk.offsets[0] + rows, *chunk.offsets[1:]), chunk.sizes, chunk.blob)
                              for chunk in up.chunks)]
    return Tensor(whole, gate.dtype, (rows + up.shape[0], *gate.shape[1:]), tuple(sorted(chunks)))


def read_fsdp_optimizer(checkpoint: Checkpoint, args: dict[str, Any], follow_symlinks: bool = False) -> LegacyOptimizer:
    """Return the model and AdamW state of an fsdp_dtensor save (`checkpoint` read as saved; `args`
    its Megatron-LM arguments) as a legacy save's reader gives them: the view (`model_view`: the
    model, the moments as `optimizer.state.<kind>.<key>`), the param groups (each parameter's
    `param_to_group_meta` settings, equal settings one group, in the model's order) and each
    parameter's step (its saved 0-d tensor; a fused fc1's, its gate half's).

    Raises UnsupportedFormat for a save without optimizer state, CorruptMetadata for a parameter
    whose moments, step or group settings are missing or unreadable.
    """
    view = model_view(checkpoint)
    where = str(checkpoint.path)
    keys = [str(path[1]) for path in view.nesting.values() if path[0] == MODEL_SUBTREE]
    trained = [key for key in keys if f"{STATE}{MOMENTS[0]}.{key}" in view.tensors]
    if not trained:
        raise UnsupportedFormat(f"{where}: a Megatron-FSDP (--ckpt-format fsdp_dtensor) save without optimizer "
                                "state (saved with --no-save-optim); `ckpttool export` writes its model")
    saved_names = _saved_names(checkpoint)
    groups: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    steps: dict[str, Stored | float] = {}
    with DataFiles(checkpoint.path, follow_symlinks) as files:
        for key in trained:
            if f"{STATE}{MOMENTS[1]}.{key}" not in view.tensors:
                raise CorruptMetadata(f"{where}: {key} has a saved exp_avg but no exp_avg_sq")
            saved = saved_names.get(key)
            step = checkpoint.tensors.get(f"{STATE}{saved}.{STEP}") if saved is not None else None
            if step is None:  # a fused fc1: its gate half's step (both halves hold the parameter's one step)
                gate = saved_names.get(key + GATE)
                step = checkpoint.tensors.get(f"{STATE}{gate}.{STEP}") if gate is not None else None
            if step is None or step.shape != () or len(step.chunks) != 1 or step.chunks[0].blob is None:
                raise CorruptMetadata(f"{where}: {key}: no saved 0-d AdamW step ({STATE}...{key}.{STEP})")
            steps[key] = Stored(step.chunks[0].blob, step.dtype, ())
            settings = _group_settings(checkpoint, files, saved, key, where)
            if settings not in groups:
                groups.append(settings)
            group_of[key] = groups.index(settings)
    # the steps travel as their blobs (`steps`); the view keeps the model and the moments, as a legacy save's
    kept = {fqn: tensor for fqn, tensor in view.tensors.items() if not fqn.startswith(STATE + WRAPPER)}
    return LegacyOptimizer(dataclasses.replace(view, tensors=kept), args, tuple(groups), group_of, steps)


def _saved_names(checkpoint: Checkpoint) -> dict[str, str]:
    """GPTModel key -> the name Megatron-FSDP's optimizer saved it under (`module.module.<key>`),
    from the group metadata and the state entries."""
    names: dict[str, str] = {}
    for fqn in (*checkpoint.tensors, *checkpoint.objects):
        for head in (STATE, GROUP_META):
            if fqn.startswith(head + WRAPPER):
                saved = fqn[len(head):].rsplit(".", 1)[0]
                names.setdefault(_unwrapped(saved), saved)
    return names


def _group_settings(checkpoint: Checkpoint, files: DataFiles, saved: str | None, key: str, where: str) -> dict[str, Any]:
    """The settings of `key`'s param group: its `param_to_group_meta` byte entries, decoded as plain data."""
    head = f"{GROUP_META}{saved}."
    entries = sorted(fqn for fqn in checkpoint.objects if saved is not None and fqn.startswith(head)
                     and "." not in fqn[len(head):])
    if not entries:
        raise CorruptMetadata(f"{where}: {key}: no param group settings ({GROUP_META}...{key}.*)")
    settings: dict[str, Any] = {}
    for fqn in entries:
        entry = checkpoint.objects[fqn]
        try:
            value = read_plain_object(object_bytes(files, entry), f"{where}: {fqn}")
        except (pickle.UnpicklingError, ValueError, EOFError, KeyError, TypeError, AttributeError, IndexError,
                OverflowError) as error:  # a damaged pickle: named, never a traceback
            raise CorruptMetadata(f"{where}: {fqn}: not a readable torch.save of plain data ({error})") from None
        settings[fqn[len(head):]] = value
    return settings
