"""`import --to torchtitan|megatron`: a Hub model (a Hub folder, or a `.safetensors` file with
`--assets`) as a framework's own checkpoint, by the family tables run backwards.

The pipeline: read the weights' headers -> integrity gate -> config.json (the folder's own, or
--assets) -> the family converting to its architecture (`framework_family`) -> the framework's
tensors as pieces of the Hub tensors (`naming.backward`: pure) -> each piece's raw byte ranges
(`engine.converted_checkpoint`: no byte read) -> the framework's layout (torchtitan: the model's
state dict at the top level, as torchtitan's checkpointer loads a model-only initial checkpoint;
Megatron: formats/megatron_dist.py) -> reshard's plan for N ranks -> `write_dcp` (atomic).
Memory holds only the blocks in flight, as every copy does.

Example:
    >>> report = import_to_framework("hub/llama", "tt/llama", "torchtitan", world_size=2)
    >>> report.family
    'torchtitan llama3'
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ckpttool import readers
from ckpttool.check import integrity
from ckpttool.commands.reshard import ReshardReport, write_dcp
from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Object, Tensor, as_path, raw_range_transforms
from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.dcp.blobs import DataFiles
from ckpttool.formats import megatron_dist
from ckpttool.formats.model_config import HUB_CONFIG, config_beside
from ckpttool.model import quantization
from ckpttool.model.model_view import find_model
from ckpttool.naming import REGISTRY, Family, family as family_named
from ckpttool.naming.backward import MadeTensor, backward, stack_layers
from ckpttool.naming.engine import converted_checkpoint
from ckpttool.options import SourceOptions, WriteOptions
from ckpttool.outputs import check_destination, refuse_overlap
from ckpttool.plan.reshard import EVERY_TENSOR_RULE, parse_mesh, plan_reshard
from ckpttool.readers.detect import DCP_HF, HUB_FOLDER, SAFETENSORS
from ckpttool.run import distributed, locating
from ckpttool.store.safepaths import read_json_object

FRAMEWORKS = ("torchtitan", "megatron")
IMPORTABLE = (SAFETENSORS, HUB_FOLDER, DCP_HF)  # layouts holding a Hub model's tensors under its own names
MADE_FILE = "ckpttool-made-values"  # the name DataFiles reads the made buffers' bytes by
MEGATRON_LAYERS = "decoder.layers."  # TransformerBlock's layers, stacked in torch_dist
_SAVE_ID_NAMESPACE = uuid.UUID("5d0f3b8e-2f4a-4c8e-9a51-7b3c1e6d2f90")


@dataclass(frozen=True)
class FrameworkImportReport(ReshardReport):
    """What `import --to` wrote: reshard's report, the framework, the family table used, the
    tensors made as the framework initialises them, and the Hub keys left out (with why)."""

    framework: str = ""
    family: str = ""
    architecture: str = ""
    made: tuple[MadeTensor, ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()
    layout: str = ""
    extra_files: tuple[str, ...] = ()  # written beside the DCP files (Megatron: in the iteration folder)
    run_files: tuple[str, ...] = ()  # the run folder's own (Megatron's tracker), relative to the destination


def framework_family(framework: str, config: Mapping[str, Any], where: str) -> Family:
    """Return the `framework` family whose table converts to config.json's architecture (the
    newest version's: a family named for an older framework release is not written)."""
    if framework not in FRAMEWORKS:
        raise UsageError(f"--to {framework}: import writes {', '.join(FRAMEWORKS)}")
    architectures = config.get("architectures") or []
    if not architectures:
        raise UsageError(f"{where}: config.json names no `architectures`; import --to {framework} picks its table by it")
    found: list[str] = []
    for entry in REGISTRY:
        if not entry.name.startswith(framework + " ") or " 0." in entry.name:  # "torchtitan 0.2 llama3": read, not written
            continue
        table = family_named(entry.name)
        found.extend(table.architectures)
        if architectures[0] in table.architectures:
            return table
    raise UsageError(f"{where}: config.json's architecture {architectures[0]} has no {framework} table; import --to "
                     f"{framework} writes {', '.join(sorted(set(found)))}")


def import_to_framework(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    framework: str,
    world_size: int | None = None,
    *,
    assets: str | os.PathLike | None = None,
    dtype: str | None = None,
    write: WriteOptions = WriteOptions(),
    source: SourceOptions = SourceOptions(),
) -> FrameworkImportReport:
    """Return a report after writing the Hub model at `src` as a `framework` checkpoint at
    `dst` laid out for `world_size` ranks (torchtitan: FSDP2's dim-0 shards; Megatron reshards
    on load, so any size loads and the default is 1). config.json comes from `assets` or beside
    the weights. An FP8 or MXFP4 Hub model is dequantised to `dtype` on the way (consolidate's
    dequantisation into a scratch folder beside `dst`, removed after). Nothing is left at `dst`
    unless the whole write succeeded.

    Raises UsageError (exit 2) for a framework, architecture or option the tables cannot write,
    InvalidCheckpoint (exit 1) naming the key when config.json disagrees with the weights."""
    started = time.perf_counter()
    origin, destination = source.locate(src), as_path(source.locate(dst))
    if framework == "torchtitan" and world_size is None:
        raise UsageError("import --to torchtitan: --world N (the ranks the checkpoint is laid out for) is required")
    mesh = parse_mesh(world_size or 1, None)
    refuse_overlap(destination, origin)
    detection, checkpoint = readers.read(origin, source.follow_symlinks, layout=source.layout)
    if detection.layout not in IMPORTABLE:
        raise UsageError(f"{origin}: a {detection.layout} checkpoint; import --to {framework} reads a Hub model "
                         "(a Hub folder, or a .safetensors file with --assets)")
    config, config_from = _config(checkpoint.path if detection.layout != SAFETENSORS else None, assets, origin)
    where = str(checkpoint.path)
    table = framework_family(framework, config, where)
    warnings = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    quantized = quantization.find(checkpoint, config)
    if quantized is not None or dtype is not None:
        if quantized is None:
            raise UsageError(f"--dtype {dtype}: {origin} is not quantised; import --to writes the Hub model's own dtype "
                             "(cast it with `ckpttool consolidate --dtype` first if you mean to)")
        if dtype is None:
            raise UsageError(f"{origin}: a {quantized.scheme} Hub model; {framework} trains on dequantised weights: "
                             "pass --dtype bf16 (or fp32) to dequantise on the way")
        return _dequantized_import(checkpoint.path, config, destination, framework, world_size, dtype, write, source,
                                   started)
    model = find_model(checkpoint, source.model_prefix).require()
    shapes = {key: checkpoint.tensors[fqn].shape for fqn, key in model.keys.items() if fqn in checkpoint.tensors}
    found = backward(table, shapes, config, where)
    _check_dtypes(checkpoint, model.keys, found.targets, where)
    with tempfile.TemporaryDirectory(prefix="ckpttool-import-") as scratch:
        made_file = _write_made(Path(scratch), found.made.values())
        made = {MADE_FILE: made_file} if made_file is not None else {}
        if made and not isinstance(checkpoint.path, Path):
            raise UsageError(f"{origin}: {table.name} needs buffers the Hub model has no values for; import them from "
                             "a local copy of the folder (object storage sources carry no scratch file)")
        with DataFiles(checkpoint.path, source.follow_symlinks, made=made) as files:
            located = locating.locate_chunks(files, checkpoint.tensors.values(), write.threads)
            by_model_key = _by_model_key(checkpoint, model.keys, located)
            targets = found.targets if framework != "megatron" else stack_layers(found.targets, MEGATRON_LAYERS)
            converted = converted_checkpoint(by_model_key.checkpoint, targets, by_model_key.located)
            tensors = {**converted.tensors, **_made_tensors(found.made.values())}
            objects, beside = _framework_files(framework, tensors)
            layout = dataclasses.replace(converted, tensors=dict(sorted(tensors.items())), objects=objects,
                                         nesting={key: (key,) for key in sorted({*tensors, *objects})}, model_prefix="")
            plan = plan_reshard(layout, mesh, rule=EVERY_TENSOR_RULE)  # as fully_shard shards every parameter
            report: dict[str, Any] = dict(
                source=checkpoint.path, destination=destination, plan=plan, tensor_bytes=plan.nbytes, problems=warnings,
                framework=framework, family=table.name, architecture=str(config["architectures"][0]),
                made=tuple(found.made.values()), left_out=tuple(sorted(found.left_out.items())),
                layout=f"{detection.describe()}; config.json from {config_from}",
                extra_files=tuple(name for name, _ in beside or ()),
                run_files=(megatron_dist.TRACKER, megatron_dist.ITERATION_FOLDER + "/") if framework == "megatron" else ())
            if write.dry_run:
                return FrameworkImportReport(seconds=time.perf_counter() - started, file_bytes=0, dry_run=True, **report)
            check = functools.partial(check_destination, destination, write.force, write.notify)
            world = distributed.active()
            if framework == "megatron" and world is not None:
                distributed.checked_together(check, destination)  # the run folder is made before the write
            else:
                check()
            save_id = str(uuid.uuid5(_SAVE_ID_NAMESPACE, f"{checkpoint.path}:{framework}:{mesh}"))
            if framework == "megatron":
                writes, processes = _write_megatron_run(layout, plan, files, destination, save_id, write, beside or [])
            else:
                writes, processes = write_dcp(layout, plan, files, destination, save_id=save_id, write=write,
                                              label=f"import --to {framework}", beside=())
    return FrameworkImportReport(seconds=time.perf_counter() - started, file_bytes=writes.file_bytes,
                                 verified=write.verify, processes=processes, **report)


def _write_megatron_run(layout: Checkpoint, plan: Any, files: DataFiles, destination: Path, save_id: str,
                        write: WriteOptions, beside: list[tuple[str, bytes]]) -> tuple[Any, Any]:
    """Write the torch_dist checkpoint as the Megatron-LM run folder `--load` reads: DST/iter_0000000/
    (atomically, as every DCP write), then DST/latest_checkpointed_iteration.txt naming it."""
    from ckpttool.outputs import atomic_output

    # the run folder is created with the iteration folder, as a missing parent of it (removed
    # again if the write fails: outputs.local); under torchrun every process has checked it
    # before (distributed.checked_together), so none finds it made by another
    written = write_dcp(layout, plan, files, destination / megatron_dist.ITERATION_FOLDER, save_id=save_id,
                        write=dataclasses.replace(write, force=True), label="import --to megatron", beside=beside)
    world = distributed.active()
    if world is None or world.rank == 0:
        with atomic_output(destination / megatron_dist.TRACKER, force=True) as tracker:
            tracker.write(megatron_dist.tracker_text())
    return written


def _dequantized_import(path: Path, config: Mapping[str, Any], destination: Path, framework: str,
                        world_size: int | None, dtype: str, write: WriteOptions, source: SourceOptions,
                        started: float) -> FrameworkImportReport:
    """Dequantise the Hub model into a scratch Hub folder beside `destination` (consolidate's
    streamed dequantisation, with config.json as the dequantised model's), import that, and
    remove the scratch folder whatever happens."""
    import json

    from ckpttool.commands.consolidate import consolidate
    from ckpttool.options import ConvertOptions
    from ckpttool.outputs.temps import new_token, remove_tree, temp_name

    convert = ConvertOptions(dtype=dtype)
    if not isinstance(destination, Path):
        raise UsageError(f"{destination}: dequantising on the way needs a local destination (its scratch folder)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    scratch = destination.parent / temp_name(destination.name + "-dequantized", "tmp", new_token())
    try:
        quiet = dataclasses.replace(write, force=False, verify=False)
        consolidate(path, scratch, convert, quiet, source)
        (scratch / HUB_CONFIG).write_text(json.dumps(quantization.dequantized_config(config, convert.cast or dtype),
                                                     indent=2, sort_keys=True))
        report = import_to_framework(scratch, destination, framework, world_size, write=write,
                                     source=dataclasses.replace(source, layout=None))
    finally:
        if scratch.exists():
            remove_tree(scratch)
    return dataclasses.replace(report, source=path, seconds=time.perf_counter() - started,
                               layout=f"{report.layout.split(';')[0]} dequantised to {dtype} on the way")


def _framework_files(framework: str, tensors: Mapping[str, Tensor]
                     ) -> tuple[dict[str, Object], list[tuple[str, bytes]] | None]:
    """Return the byte entries and the files beside the DCP files that `framework` writes
    (Megatron-Core's torch_dist: `_extra_state` objects, metadata.json, common.pt; torchtitan: none)."""
    if framework != "megatron":
        return {}, None
    shapes = {key: tensor.shape for key, tensor in tensors.items()}
    data = megatron_dist.extra_state_bytes()
    objects = {key: Object(key, None, data) for key in megatron_dist.extra_state_keys(tensors, shapes)}
    beside = [(megatron_dist.COMMON_PT, megatron_dist.common_pt(megatron_dist.RUN_COMMON)),
              (megatron_dist.METADATA_JSON, megatron_dist.metadata_json())]
    return objects, beside


def _config(path: Path | None, assets: str | os.PathLike | None, origin: Any) -> tuple[dict[str, Any], str]:
    """Return config.json (from `assets`, else beside the weights in the folder `path`) and where it came from."""
    if assets is not None:
        candidate = Path(assets) / HUB_CONFIG
        if not candidate.is_file():
            raise UsageError(f"--assets {assets}: no {HUB_CONFIG} there (import --to reads the model's config.json)")
        return read_json_object(candidate), str(candidate)
    config = config_beside(path) if path is not None else None  # a lone .safetensors file: --assets says
    if config is None:
        raise UsageError(f"{origin}: no {HUB_CONFIG} beside the weights; pass --assets DIR with the model's config.json")
    return config, f"{path}/{HUB_CONFIG}"


def _check_dtypes(checkpoint: Checkpoint, keys: Mapping[str, str], targets: Mapping[str, Any], where: str) -> None:
    """Refuse a framework tensor made of Hub tensors of several dtypes (q in bf16, k in fp32)."""
    dtype_of = {key: checkpoint.tensors[fqn].dtype for fqn, key in keys.items() if fqn in checkpoint.tensors}
    for name, target in targets.items():
        dtypes = {dtype_of[piece.source] for piece in target.pieces}
        if len(dtypes) > 1:
            raise InvalidCheckpoint(f"{where}: {name} is made of tensors of dtypes {', '.join(sorted(dtypes))} "
                                    f"({', '.join(sorted({piece.source for piece in target.pieces}))}); cast the "
                                    "model to one dtype first", code="config-mismatch")


@dataclass(frozen=True)
class _ByModelKey:
    checkpoint: Checkpoint
    located: Mapping[str, Mapping[int, Any]]


def _by_model_key(checkpoint: Checkpoint, keys: Mapping[str, str], located: locating.Located) -> _ByModelKey:
    """The checkpoint's model tensors under their model keys (what the tables name)."""
    tensors = {key: dataclasses.replace(checkpoint.tensors[fqn], fqn=key) for fqn, key in keys.items()
               if fqn in checkpoint.tensors}
    return _ByModelKey(dataclasses.replace(checkpoint, tensors=tensors),
                       {key: located[fqn] for fqn, key in keys.items() if fqn in checkpoint.tensors})


def _made_bytes(made: MadeTensor) -> bytes:
    import numpy as np

    from ckpttool.core.dtypes import ITEMSIZE

    count = 1
    for size in made.shape:
        count *= size
    if made.fill == 0:
        return bytes(count * ITEMSIZE[made.dtype])  # +0.0 is all-zero bits in every float and int dtype
    kinds = {"float32": "<f4", "float64": "<f8", "float16": "<f2"}
    if made.dtype not in kinds:
        raise UsageError(f"{made.key}: a made {made.dtype} buffer of {made.fill} (only zeros, or float16/32/64)")
    return np.full(count, made.fill, dtype=kinds[made.dtype]).tobytes()


def _write_made(scratch: Path, made: Any) -> Path | None:
    """Write the made tensors' bytes end to end into one scratch file (None: nothing made)."""
    made = list(made)
    if not made:
        return None
    path = scratch / MADE_FILE
    with open(path, "wb") as file:
        for entry in made:
            file.write(_made_bytes(entry))
    return path


def _made_tensors(made: Any) -> dict[str, Tensor]:
    """The made tensors as one chunk each, a raw range of the scratch file (as `_write_made` laid it)."""
    tensors: dict[str, Tensor] = {}
    at = 0
    for entry in made:
        length = len(_made_bytes(entry))
        blob = Blob(MADE_FILE, at, length, raw_range_transforms())
        tensors[entry.key] = Tensor(entry.key, entry.dtype, entry.shape,
                                    (Chunk((0,) * len(entry.shape), entry.shape, blob),))
        at += length
    return tensors
