"""Readers: one per on-disk layout, all yielding our `Checkpoint` types.

`detect(path)` names the layout (and, for a run directory, the checkpoints inside and the
newest); `open_checkpoint(path)` reads it. torch DCP and the frameworks built on it
(torchtitan, accelerate's model folder, Lightning, Megatron torch_dist) read as DCP (Megatron's
stacked layers taken apart, readers/megatron.py);
torch's HuggingFaceStorageWriter output (`dcp-hf`), single `.safetensors` files and Hub
folders read from their safetensors headers; torch.save files (`torch-pt`) and verl's per-rank
files from their zip directory and checked data.pkl. No torch is imported, and a reader that
detection does not need is imported only when its layout is read (`_read`): `inspect` of a DCP
checkpoint loads no safetensors, torch.save, DeepSpeed or Megatron code.

Example:
    >>> detection, checkpoint = read("runs/x")      # a run directory: its newest checkpoint
    >>> detection.describe()
    'dcp: step-20, newest of 3 checkpoints in runs/x (by latest)'
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ckpttool.store import storage
from ckpttool.core.checkpoint import Blob, Checkpoint, Object, Tensor, as_path
from ckpttool.core.errors import CorruptMetadata, UnsupportedFormat
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.dcp import read_checkpoint
from ckpttool.readers.detect import (ACCELERATE, ACCELERATE_MODEL_DIR, DCP_HF, DCP_LAYOUTS, DEEPSPEED, DEEPSPEED_UNIVERSAL, HUB_FOLDER,
                                     LAYOUTS, LIGHTNING_METADATA, MEGATRON, MEGATRON_DCP, MEGATRON_FSDP, MEGATRON_LEGACY, NEMO2, SAFETENSORS, TORCH_PT, VERL,
                                     Detection, _detect, detect, pipeline_layer_files)


# layouts that hold only the model, its fqns at the top level (model_view.find_model finds the
# model of every other layout from its structure)
TOP_LEVEL_MODEL = frozenset({DCP_HF, HUB_FOLDER, SAFETENSORS, VERL})
LIGHTNING_WRAPPER = "_forward_module."  # lightning/pytorch/overrides/base.py: _LightningModuleWrapperBase._forward_module
LIGHTNING_DEEPSPEED_TAG, LIGHTNING_SUFFIX = "checkpoint", ".ckpt"  # DeepSpeedStrategy's tag, ModelCheckpoint's FILE_EXTENSION


def read(path: str | os.PathLike, follow_symlinks: bool = False, as_saved: bool = False,
         layout: str | None = None) -> tuple[Detection, Checkpoint]:
    """Return what `detect` found at `path` and the checkpoint it names, read as our types.
    `as_saved`: keys exactly as the checkpoint stores them (Megatron's layers left stacked,
    so a reshard stays loadable by Megatron), not the model view consolidate and diff use.
    `layout`: where one step holds checkpoints of two layouts, read this one (`detect`).

    Raises NotACheckpoint (listing what was looked for) when nothing matches, and
    UnsupportedFormat for what this build detects but cannot read.
    """
    detection, found = _detect(as_path(storage.location(path)), layout)
    checkpoint = found if found is not None else _read(detection, follow_symlinks)
    if detection.layout == ACCELERATE:
        checkpoint = _with_accelerate_optimizer(checkpoint)
    if detection.layout in (MEGATRON, NEMO2) and not as_saved:  # layers taken apart, model tensors under `model.`
        from ckpttool.readers.megatron import model_view as megatron_model_view

        checkpoint = megatron_model_view(checkpoint, follow_symlinks)
    if detection.layout in (MEGATRON_FSDP, MEGATRON_DCP) and not as_saved:  # Megatron-FSDP's prefix, SwiGLU halves undone
        from ckpttool.readers.megatron_fsdp import model_view as megatron_fsdp_view

        checkpoint = megatron_fsdp_view(checkpoint)
    if detection.layout in TOP_LEVEL_MODEL:
        checkpoint = dataclasses.replace(checkpoint, model_prefix="")
    return detection, _without_lightning_paths(checkpoint)


def _with_accelerate_optimizer(model: Checkpoint) -> Checkpoint:
    """accelerate's save_state folder as one checkpoint: the model DCP dir and, beside it, the
    optimizer's (`{"model": ...}` and `{"optimizer": ...}`), with blob paths relative to the
    folder. Without an optimizer dir, the model dir alone."""
    folder = model.path.parent
    optimizer_dir = folder / model.path.name.replace(ACCELERATE_MODEL_DIR.rsplit("_", 1)[0], "optimizer", 1)
    if not (optimizer_dir / METADATA_FILENAME).is_file():
        return model
    parts = [(model, model.path.name), (read_checkpoint(optimizer_dir), optimizer_dir.name)]
    tensors: dict[str, Tensor] = {}
    objects: dict[str, Object] = {}
    nesting: dict[str, tuple[str | int, ...]] = {}
    orphans: list[tuple[str, Blob]] = []
    notes: list[str] = []
    for part, sub in parts:
        for fqn, tensor in part.tensors.items():
            chunks = tuple(chunk._replace(blob=_moved(chunk.blob, sub)) for chunk in tensor.chunks)
            tensors[fqn] = dataclasses.replace(tensor, chunks=chunks)
        for fqn, entry in part.objects.items():
            objects[fqn] = dataclasses.replace(entry, blob=_moved(entry.blob, sub))
        nesting.update(part.nesting)
        orphans += [(fqn, blob._replace(file=f"{sub}/{blob.file}")) for fqn, blob in part.orphan_blobs]
        notes += part.notes
    if len(tensors) + len(objects) != sum(len(p.tensors) + len(p.objects) for p, _ in parts):
        raise CorruptMetadata(f"{folder}: {model.path.name} and {optimizer_dir.name} name the same entries")
    return Checkpoint(path=folder, metadata_file=f"{model.path.name}/{model.metadata_file}", version=model.version,
                      tensors=dict(sorted(tensors.items())), objects=dict(sorted(objects.items())), nesting=nesting,
                      orphan_blobs=tuple(orphans), save_id=model.save_id, notes=tuple(notes))


def _moved(blob: Blob | None, sub: str) -> Blob | None:
    """`blob` with its file under the folder's `sub` directory."""
    return blob._replace(file=f"{sub}/{blob.file}") if blob is not None else None


def _read(detection: Detection, follow_symlinks: bool) -> Checkpoint:
    if detection.layout in DCP_LAYOUTS:
        return read_checkpoint(detection.path)
    # every other reader (safetensors headers, torch.save zips): imported for its own layout only
    if detection.layout == DCP_HF:
        from ckpttool.readers.dcp_hf import read_dcp_hf

        return read_dcp_hf(detection.path, follow_symlinks)
    if detection.layout == HUB_FOLDER:
        from ckpttool.readers.hub_folder import read_hub_folder

        return read_hub_folder(detection.path, follow_symlinks)
    if detection.layout == SAFETENSORS:
        from ckpttool.readers.safetensors import read_safetensors

        return read_safetensors(detection.path, follow_symlinks)
    if detection.layout == VERL:
        from ckpttool.readers.verl import read_verl

        return read_verl(detection.path, follow_symlinks)
    if detection.layout in (DEEPSPEED, DEEPSPEED_UNIVERSAL):
        from ckpttool.readers.deepspeed import read_deepspeed
        from ckpttool.readers.deepspeed_universal import read_deepspeed_universal

        if detection.layout == DEEPSPEED:
            return read_deepspeed(detection.path, follow_symlinks)
        return read_deepspeed_universal(detection.path, follow_symlinks)
    if detection.layout == MEGATRON_LEGACY:  # per-rank torch.save files merged into one global model
        from ckpttool.readers.megatron_deepspeed_pipe import read_megatron_deepspeed_pipe
        from ckpttool.readers.megatron_legacy import read_megatron_legacy

        if pipeline_layer_files(detection.path):  # DeepSpeed's pipeline engine's (Megatron-DeepSpeed's GPTModelPipe)
            return read_megatron_deepspeed_pipe(detection.path, follow_symlinks)
        return read_megatron_legacy(detection.path, follow_symlinks)
    if detection.layout == TORCH_PT:
        from ckpttool.readers.torch_pt import read_torch_pt

        return read_torch_pt(detection.path, follow_symlinks)
    raise UnsupportedFormat(f"{detection.path}: a {detection.layout} checkpoint, which this build detects but "
                            "cannot read yet; convert it with the framework's own tool first")


def open_checkpoint(path: str | os.PathLike, follow_symlinks: bool = False, as_saved: bool = False,
                    layout: str | None = None) -> Checkpoint:
    """Return the checkpoint at `path` as our types, whatever its layout (for a run
    directory, its newest checkpoint; `detect` says which; `as_saved` and `layout` as for `read`)."""
    return read(path, follow_symlinks, as_saved, layout)[1]


def _without_lightning_paths(checkpoint: Checkpoint) -> Checkpoint:
    """A LightningModule's checkpoint with the model where the model is: past Lightning's
    wrapper (`_forward_module.`, lightning/pytorch/overrides/base.py `_LightningModuleWrapperBase`,
    what DeepSpeedStrategy hands to `deepspeed.initialize`) and past the LightningModule's one
    attribute that holds every parameter (`self.model = LlamaForCausalLM(...)`: `model.`), so
    that model keys are the model's own `state_dict()` names (`Checkpoint.model_attribute`).
    Left as it is when the LightningModule holds parameters in more than one attribute."""
    lightning = _lightning_saved(checkpoint)
    if not (lightning or any(LIGHTNING_WRAPPER in fqn for fqn in checkpoint.tensors)):
        return checkpoint  # the common case: no model search here (the command makes its own)
    from ckpttool.model.model_view import find_model

    view = find_model(checkpoint)
    keys = [key for fqn, key in view.keys.items() if fqn in checkpoint.tensors]
    if view.prefix is None or not keys:
        return checkpoint
    attribute = []
    if all(key.startswith(LIGHTNING_WRAPPER) for key in keys):
        keys = [key[len(LIGHTNING_WRAPPER):] for key in keys]
        attribute.append(LIGHTNING_WRAPPER[:-1])
    elif not lightning:
        return checkpoint
    tops = {key.split(".", 1)[0] for key in keys}
    if len(tops) == 1 and all("." in key for key in keys) and len({key.split(".", 2)[1] for key in keys}) > 1:
        attribute.append(tops.pop())
    return dataclasses.replace(checkpoint, model_attribute=".".join(attribute)) if attribute else checkpoint


def _lightning_saved(checkpoint: Checkpoint) -> bool:
    """True for Lightning's single-file `.ckpt`, a save of its FSDP strategy (`meta.pt` beside the DCP files) or of its
    DeepSpeed strategy (the ZeRO files under the tag `checkpoint` in a `.ckpt` folder:
    lightning/pytorch/strategies/deepspeed.py `save_checkpoint(filepath, ..., tag="checkpoint")`)."""
    path = checkpoint.path
    if checkpoint.metadata_file.endswith(LIGHTNING_SUFFIX) and checkpoint.model_prefix == "state_dict":
        return True  # Lightning's single-file checkpoint (a torch.save dict whose `state_dict` is the LightningModule's)
    return isinstance(path, Path) and ((path / LIGHTNING_METADATA).is_file() or (
        path.name == LIGHTNING_DEEPSPEED_TAG and path.parent.name.endswith(LIGHTNING_SUFFIX)))


__all__ = ["Detection", "LAYOUTS", "detect", "open_checkpoint", "read"]
