"""`import`: full model weights (a `.safetensors` file, a Hub folder, a torch.save `.pt`) as
a DCP checkpoint for N FSDP2 ranks, every key nested under a prefix (`model.`).

The pipeline: read the weights' headers (`readers`) -> integrity gate -> locate every
tensor's raw bytes (headers only) -> nest the keys under the prefix (`nest_under`: pure; each
chunk now names its raw byte range, so nothing looks it up by its old name again) -> reshard's
plan for the target mesh (`plan_reshard`, `plan_writes`) -> `execute.run` into a temporary
directory -> `.metadata` -> rename into place. torch is never imported; memory holds only the
blocks in flight. Stock `dcp.load({"model": model_state_dict})` reads the result, as does
FSDP2's `set_model_state_dict` after it (train_minimal's `--resume`).

Example:
    >>> report = import_checkpoint("hub/llama", "ckpt/llama-world3", world_size=3)
    >>> [f.name for f in report.plan.files]
    ['__0_0.distcp', '__1_0.distcp', '__2_0.distcp']
"""

from __future__ import annotations

from typing import Any, Mapping

import dataclasses
import os
import time
import uuid
from dataclasses import dataclass

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.run import locating
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Object, Tensor, as_path, raw_range_transforms
from ckpttool.commands.reshard import ReshardReport, write_dcp
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import UsageError
from ckpttool.options import SourceOptions, WriteOptions
from ckpttool.model.model_view import find_model
from ckpttool.outputs import check_destination, refuse_overlap
from ckpttool.plan.reshard import parse_mesh, plan_reshard
from ckpttool.readers.detect import DCP_HF, HUB_FOLDER, SAFETENSORS, TORCH_PT

DEFAULT_PREFIX = "model."  # train_minimal and `{"model": get_model_state_dict(model)}` saves
IMPORTABLE = (SAFETENSORS, HUB_FOLDER, DCP_HF, TORCH_PT)  # layouts whose keys are the model's own
_SAVE_ID_NAMESPACE = uuid.UUID("0b6f7f3e-4f1c-4a55-8f0e-6a1d2c3b4e5f")


@dataclass(frozen=True)
class ImportReport(ReshardReport):
    """What import wrote (or would write): reshard's report plus the source layout and prefix."""

    layout: str = ""
    prefix: str = DEFAULT_PREFIX


def nest_under(checkpoint: Checkpoint, prefix: str, located: locating.Located,
               keys: Mapping[str, str] | None = None) -> Checkpoint:
    """Return `checkpoint` with every entry of `keys` (fqn -> model key; default every entry
    under its fqn) renamed `prefix + key` and nested under the prefix's parts in the state dict
    (`model.` -> `{"model": {key: ...}}`); each located chunk's blob becomes its raw byte range,
    so the renamed entry needs no header lookup by name.

    Example:
        >>> nest_under(checkpoint, "model.", located).nesting["model.lm_head.weight"]
        ('model', 'lm_head.weight')
    """
    parts = tuple(part for part in prefix.split(".") if part)

    def chunk(tensor: Tensor, index: int) -> Chunk:
        raw, old = located[tensor.fqn].get(index), tensor.chunks[index]
        if raw is None:
            return old
        return Chunk(old.offsets, old.sizes, Blob(raw.file, raw.offset, raw.length, raw_range_transforms(raw.crc32)))

    keys = keys if keys is not None else {fqn: fqn for fqn in (*checkpoint.tensors, *checkpoint.objects)}
    tensors = {
        prefix + key: Tensor(prefix + key, t.dtype, t.shape, tuple(chunk(t, i) for i in range(len(t.chunks))))
        for fqn, key in keys.items() if (t := checkpoint.tensors.get(fqn)) is not None
    }
    objects = {prefix + key: Object(prefix + key, checkpoint.objects[fqn].blob)
               for fqn, key in keys.items() if fqn in checkpoint.objects}
    nesting: dict[str, tuple[str | int, ...]] = {prefix + key: (*parts, key) for key in sorted(keys.values())}
    return dataclasses.replace(checkpoint, tensors=tensors, objects=objects, nesting=nesting,
                               model_prefix=".".join(parts))


def import_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    world_size: int | None = None,
    mesh: str | tuple[int, int] | None = None,
    *,
    prefix: str = DEFAULT_PREFIX,
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
) -> ImportReport:
    """Return a report after writing the full weights at `src` as a DCP checkpoint at `dst`
    laid out for `world_size` FSDP2 ranks (or an HSDP `mesh`), keys under `prefix`.

    Every tensor of one or more dimensions is split along dim 0 like torch.chunk, as
    `fully_shard` shards parameters (the reshard plan's `every-tensor` rule). Only the model's
    entries are imported, under their model keys (`model_view.find_model`, or
    `source.model_prefix`): a `.pt` holding an optimizer beside the model brings the model.
    Nothing is left at `dst` unless the whole write (and `verify`) succeeded.

    Example:
        >>> import_checkpoint("model.safetensors", "ckpt/imported", world_size=2).plan.rule
        'every-tensor'
    """
    started = time.perf_counter()
    origin, destination = source.locate(src), as_path(source.locate(dst))  # a URL carries the storage options
    target_mesh = parse_mesh(world_size, mesh)
    if prefix and (not prefix.endswith(".") or any(not part for part in prefix[:-1].split("."))):
        raise UsageError(f"--prefix {prefix!r}: dotted names ending in a dot, e.g. 'model.' (or '' for none)")
    refuse_overlap(destination, origin)
    detection, checkpoint = readers.read(origin, source.follow_symlinks, layout=source.layout)
    if detection.layout not in IMPORTABLE:
        raise UsageError(f"{origin}: a {detection.layout} checkpoint; import reads full weights (.safetensors, a Hub "
                         "folder, a .pt); rewrite a DCP checkpoint with `ckpttool reshard`")
    warnings = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    with DataFiles(checkpoint.path, source.follow_symlinks) as files:
        located = locating.locate_chunks(files, checkpoint.tensors.values(), write.threads)
        nested = nest_under(checkpoint, prefix, located, find_model(checkpoint, source.model_prefix).require().keys)
        plan = plan_reshard(nested, target_mesh)
        report: dict[str, Any] = dict(source=checkpoint.path, destination=destination, plan=plan, tensor_bytes=plan.nbytes,
                                      problems=warnings, layout=detection.describe(), prefix=prefix)
        if write.dry_run:
            return ImportReport(seconds=time.perf_counter() - started, file_bytes=0, dry_run=True, **report)
        check_destination(destination, write.force, write.notify)
        save_id = str(uuid.uuid5(_SAVE_ID_NAMESPACE, f"{checkpoint.path}:{target_mesh}:{prefix}"))
        writes, processes = write_dcp(nested, plan, files, destination, save_id=save_id, write=write, label="import")
    return ImportReport(seconds=time.perf_counter() - started, file_bytes=writes.file_bytes, verified=write.verify,
                        processes=processes, **report)
