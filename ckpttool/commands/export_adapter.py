"""`export --adapter`: a LoRA checkpoint's adapter as the folder `PeftModel.from_pretrained` loads.

The pipeline: read the source once -> integrity gate -> find the model (`model_view`) -> find
its LoRA adapters from keys and shapes (`lora.find_lora`) -> choose one -> read what the
weights cannot tell from an `adapter_config.json` (in the checkpoint directory, as the bundled
trainer writes it, then in `--assets`) and the flags, checking rank and targets against the
weights (`formats.peft.build_config`) -> plan the adapter's tensors under PEFT's file keys with
consolidate's planner (a byte-exact copy, no decoding) -> in one temporary directory write
`adapter_model.safetensors` and `adapter_config.json` -> rename into place. A refused check
writes nothing.

Example:
    >>> report = export_adapter("runs/lora/step-00000200", "hub/lora", AdapterOptions(lora_alpha=16))
    >>> report.adapter, report.files[0][0]
    ('default', 'adapter_model.safetensors')
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ckpttool.run import execute, locating
from ckpttool.run.adapter import adapter_config, find_adapter
from ckpttool.core.checkpoint import as_path
from ckpttool.commands.consolidate import Planned, write_output
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import UsageError, WriteFailed
from ckpttool.formats import peft
from ckpttool.model.keys import KeyRules
from ckpttool.options import AdapterOptions, SourceOptions, WriteOptions
from ckpttool.outputs import atomic_directory, check_destination, refuse_overlap
from ckpttool.plan.consolidate import OutputFormat, Selection, plan_consolidate

_SINGLE_FILE = OutputFormat("safetensors", False, None)


@dataclass(frozen=True)
class AdapterReport:
    """What `export --adapter` wrote (or, with dry_run, would write)."""

    source: Path
    output: Path
    adapter: str
    files: tuple[tuple[str, int], ...]  # (name, bytes)
    tensors: int
    parameters: int  # trainable: the adapter's elements
    frozen: int  # the base model's elements
    targets: tuple[str, ...]
    ranks: tuple[int, ...]
    config_from: str  # where adapter_config.json's fields came from
    dry_run: bool = False
    seconds: float = 0.0


def export_adapter(src: str | os.PathLike, outdir: str | os.PathLike, assets: str | os.PathLike | None = None,
                   options: AdapterOptions = AdapterOptions(), write: WriteOptions = WriteOptions(),
                   source: SourceOptions = SourceOptions()) -> AdapterReport:
    """Return a report after writing the LoRA adapter of `src` as a PEFT adapter folder at `outdir`:
    `adapter_model.safetensors` (PEFT's keys, the checkpoint's bytes) and `adapter_config.json`.

    Raises InvalidCheckpoint (`adapter-invalid`, `config-mismatch`) naming the module, and
    writes nothing, when the weights are incomplete or disagree with a given config.
    """
    started = time.perf_counter()
    target = as_path(source.locate(outdir))
    if assets is not None and not Path(assets).is_dir():
        raise UsageError(f"--assets {assets}: not a directory")
    refuse_overlap(target, src)
    if not write.dry_run:
        check_destination(target, write.force, write.notify)
    found = find_adapter(src, options.name, source)
    config, config_from = adapter_config(found, assets, options)
    adapter = found.adapter
    keys = {peft.adapter_file_key(key, adapter.name, found.lora.wrapped): found.fqns[key] for key in adapter.keys}
    selection = Selection(dict(sorted(keys.items())), {}, {key: (key,) for key in keys})
    with DataFiles(found.checkpoint.path, source.follow_symlinks) as files:
        tensors = [found.checkpoint.tensors[fqn] for fqn in keys.values()]
        located = locating.locate_chunks(files, tensors, write.threads)
    plan = plan_consolidate(found.checkpoint, selection, located, name=peft.WEIGHTS_NAME, kind=_SINGLE_FILE)
    document = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    files_out = ((peft.WEIGHTS_NAME, plan.files[0].size), (peft.CONFIG_NAME, len(document)))
    if not write.dry_run:
        planned = Planned(found.checkpoint, found.layout_name, found.view, KeyRules(), _SINGLE_FILE, plan, found.problems)
        try:
            with atomic_directory(target, force=write.force, notify=write.notify) as output:
                write_output(planned, output.path / peft.WEIGHTS_NAME, replace(write, force=False), source)
                execute.write_file(output.path / peft.CONFIG_NAME, document)
        except OSError as error:
            raise WriteFailed(f"{target}: writing failed ({error.strerror or error}); nothing was left there") from None
    return AdapterReport(
        source=found.checkpoint.path, output=target, adapter=adapter.name, files=files_out, tensors=len(keys),
        parameters=found.lora.trainable(adapter), frozen=found.lora.frozen, targets=adapter.targets,
        ranks=adapter.ranks, config_from=config_from, dry_run=write.dry_run, seconds=time.perf_counter() - started,
    )


