"""A checkpoint's LoRA adapter as export and consolidate use it: found by structure in the model
(`lora.find_lora`), its adapter_config.json (beside the checkpoint, in --assets, or flags,
checked against the weights), and `--merge-adapter` inside consolidate's own pipeline
(`AdapterMerge`: re-key the model as the base model, plan the merge, patch the written weights
before they are committed).

Example:
    >>> found = find_adapter("runs/lora/step-00000200", None, SourceOptions())
    >>> found.adapter.targets, found.adapter.ranks
    (('q_proj', 'v_proj'), (4,))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ckpttool import readers
from ckpttool.readers.detect import is_deepspeed
from ckpttool.check import integrity
from ckpttool.core.checkpoint import Checkpoint, Tensor
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.formats import bnb4bit, peft
from ckpttool.model.lora import Adapter, LoraLayout, find_lora, model_shapes
from ckpttool.run.merge import run_merge, tensor_bytes
from ckpttool.model.model_view import ModelView, find_model
from ckpttool.options import AdapterOptions, SourceOptions
from ckpttool.plan.consolidate import ConsolidatePlan
from ckpttool.plan.merge import MergePlan, Quantised, plan_merge


@dataclass(frozen=True)
class FoundAdapter:
    """A checkpoint read and gated, its model view, its LoRA layout, the chosen adapter and the
    model key -> fqn of every model tensor."""

    checkpoint: Checkpoint
    layout_name: str
    view: ModelView
    lora: LoraLayout
    adapter: Adapter
    fqns: Mapping[str, str]
    problems: tuple


def find_adapter(src: str | os.PathLike, name: str | None, source: SourceOptions) -> FoundAdapter:
    """Return the checkpoint at `src` with its LoRA adapter `name` (None: the only one);
    UsageError when the model holds no LoRA weights."""
    detection, checkpoint = readers.read(source.locate(src), source.follow_symlinks, layout=source.layout)
    problems = tuple(integrity.gate(checkpoint, source.follow_symlinks).problems)
    view = find_model(checkpoint, source.model_prefix).require()
    shapes, fqns = model_shapes(checkpoint, view)
    lora = find_lora(shapes)
    if lora is None:
        raise UsageError(f"{checkpoint.path}: the model holds no LoRA weights (no lora_A/lora_B keys); "
                         "export it without --adapter/--merge-adapter")
    return FoundAdapter(checkpoint, detection.describe(), view, lora, lora.adapter(name), fqns, problems)


def adapter_config(found: FoundAdapter, assets: str | os.PathLike | None,
                   options: AdapterOptions) -> tuple[dict[str, Any], str]:
    """Return (adapter_config.json, where its fields came from): the first adapter_config.json
    in the checkpoint directory (for a DeepSpeed tag folder, or the save dir holding it: HF Trainer's
    checkpoint-N/) or `assets`, flags over it, checked against the weights."""
    candidates = [Path(found.checkpoint.path) / peft.CONFIG_NAME] if isinstance(found.checkpoint.path, Path) else []
    if candidates and is_deepspeed(found.checkpoint.path):  # a ZeRO tag folder: PEFT wrote its config in the save dir
        candidates.append(Path(found.checkpoint.path).parent / peft.CONFIG_NAME)
    if assets is not None:
        candidates.append(Path(assets) / peft.CONFIG_NAME)
    path = next((c for c in candidates if c.is_file()), None)
    given = peft.read_config(path) if path is not None else None
    adapter = found.adapter
    flags = options.flags()
    if given is None:
        flags.setdefault("use_dora", any(m.magnitude_key for m in adapter.modules) or None)
        flags.setdefault("lora_bias", any(m.bias_key for m in adapter.modules) or None)
        flags.setdefault("fan_in_fan_out", any(m.transposed for m in adapter.modules) or None)
        saved = sorted({key.rsplit(".", 1)[0].rsplit(".", 1)[-1] for key in adapter.saved.values()})
        flags.setdefault("modules_to_save", saved or None)
    where = str(path) if path is not None else str(found.checkpoint.path)
    config = peft.build_config(given, [(m.path, m.rank) for m in adapter.modules], flags, where)
    _check_layout(config, adapter, where)
    if path is None:
        return config, "the weights and the flags"
    return config, str(path) + (" and the flags" if options.flags() else "")


def _check_layout(config: Mapping[str, Any], adapter: Adapter, where: str) -> None:
    """A config must say what the shapes show: base weights stored (in, out) (fan_in_fan_out)
    and DoRA's magnitude vectors; else PEFT would load or merge the adapter wrongly."""
    for module in adapter.modules:
        shape = module.base_shape
        if module.kind == "linear" and shape and len(shape) == 2 and shape[0] != shape[1] and not module.quantized \
                and module.transposed != bool(config.get("fan_in_fan_out")):
            raise InvalidCheckpoint(f"{where}: fan_in_fan_out is {bool(config.get('fan_in_fan_out'))}, but "
                                    f"{module.path}'s base weight {list(shape)} is stored "
                                    f"{'(in, out)' if module.transposed else '(out, in)'}", code="config-mismatch")
        if bool(module.magnitude_key) != bool(config.get("use_dora")):
            raise InvalidCheckpoint(f"{where}: use_dora is {bool(config.get('use_dora'))}, but {module.path} "
                                    f"{'has' if module.magnitude_key else 'has no'} lora_magnitude_vector",
                                    code="config-mismatch")


class AdapterMerge:
    """`--merge-adapter` for consolidate and export, in their own pipeline: `view` (given to
    `plan_output`) re-keys the model as the base model (adapter tensors left out, a
    modules_to_save copy in place of its original), `plan` then plans the merge over the written
    plan, and `patch` (given to `write_output`) merges each module into the written output
    before it is committed.

    Example:
        >>> merge = AdapterMerge(AdapterOptions(lora_alpha=16), assets=None)
        >>> planned = plan_output(src, name, kind, convert, source, threads, adapt=merge.view)
        >>> merge.plan(planned.plan).steps[0].module
        'model.layers.0.self_attn.q_proj'
    """

    def __init__(self, options: AdapterOptions, assets: str | os.PathLike | None, follow_symlinks: bool = False,
                 verify: bool = False):
        self.options, self.assets, self.follow_symlinks, self.verify = options, assets, follow_symlinks, verify
        self.found: FoundAdapter | None = None
        self.merge: MergePlan | None = None
        self.quantised: dict[str, Quantised] = {}  # model key of a 4-bit weight -> what dequantises it
        self.config_from = ""

    def view(self, checkpoint: Checkpoint, view: ModelView) -> tuple[Checkpoint, ModelView]:
        """Return the checkpoint and `view` as the base model: LoRA tensors out, `base_layer.`
        gone, a 4-bit weight in its dequantised dtype and shape (its quant state left out)."""
        shapes, fqns = model_shapes(checkpoint, view)
        lora = find_lora(shapes)
        if lora is None:
            raise UsageError(f"{checkpoint.path}: the model holds no LoRA weights (no lora_A/lora_B keys); "
                             "nothing to merge: export it without --merge-adapter")
        adapter = lora.adapter(self.options.name)
        self.found = FoundAdapter(checkpoint, "", view, lora, adapter, fqns, ())
        self.quantised = self._quantised(checkpoint, shapes, fqns)
        state_keys = {fqns[key] for q in self.quantised.values() for key in q.siblings.values()} | {
            q.state_fqn for q in self.quantised.values()}
        replaced = set(adapter.saved.values())
        keys = {fqns[key]: base for key, base in lora.base_keys.items()
                if base not in replaced and fqns[key] not in state_keys}
        keys.update({fqns[key]: base for key, base in adapter.saved.items()})
        objects = {fqn: key for fqn, key in view.keys.items() if fqn not in checkpoint.tensors}
        # the planner lays out a 4-bit weight as the dequantised tensor; no bytes are copied for it
        tensors = {q.fqn: Tensor(q.fqn, q.dtype, q.shape, ()) for q in self.quantised.values()}
        if tensors:
            checkpoint = replace(checkpoint, tensors={**checkpoint.tensors, **tensors})
        return checkpoint, replace(view, keys=dict(sorted({**keys, **objects}.items())))

    def _quantised(self, checkpoint: Checkpoint, shapes: Mapping[str, tuple[int, ...]],
                   fqns: Mapping[str, str]) -> dict[str, Quantised]:
        """Return the model's bitsandbytes 4-bit weights, each with its quant state read."""
        found = bnb4bit.quantised_weights(shapes)
        if not found:
            return {}
        quantised = {}
        with DataFiles(checkpoint.path, self.follow_symlinks) as files:
            for key, siblings in found.items():
                state_fqn = fqns[siblings[-1]]
                where = f"{checkpoint.path}: {state_fqn}"
                state = bnb4bit.read_state(tensor_bytes(files, checkpoint.tensors[state_fqn]), where)
                quantised[key] = Quantised(
                    fqns[key], checkpoint.tensors[fqns[key]], state["dtype"], state["shape"],
                    {k.rsplit(".", 1)[-1]: k for k in siblings[:-1]}, state_fqn, state)
        return quantised

    def plan(self, plan: ConsolidatePlan) -> MergePlan:
        """Return the merge of the adapter into what `plan` writes."""
        assert self.found is not None, "view() runs first, inside plan_output"
        config, self.config_from = adapter_config(self.found, self.assets, self.options)
        self.merge = plan_merge(plan, self.found.adapter, config, self.found.fqns,
                                {q.fqn: replace(q, siblings={s: self.found.fqns[k] for s, k in q.siblings.items()})
                                 for q in self.quantised.values()})
        return self.merge

    def patch(self, files: DataFiles, fds: dict[str, int]) -> set[str]:
        """Merge into the written outputs; return the keys of the tensors changed."""
        assert self.found is not None and self.merge is not None
        return run_merge(self.merge, self.found.checkpoint, files, fds, verify=self.verify)

    def note(self) -> str:
        merge = self.merge
        if merge is None:
            return ""
        merged = sum(1 for step in merge.steps if step.a_fqn)
        quantised = f"; {len(self.quantised)} 4-bit base weights dequantised" if self.quantised else ""
        return (f"merged LoRA adapter {merge.adapter!r} into {merged} base weights{quantised} "
                f"(lora_alpha and options from {self.config_from})")


def check_merge_target(target: Any) -> None:
    """--merge-adapter reads written weights back: a local output only."""
    if not isinstance(target, Path):
        raise UsageError(f"{target}: --merge-adapter writes local outputs only; write locally, then `ckpttool push`")
