"""`--merge-adapter`'s plan: which written base weights get which LoRA delta (pure data).

consolidate's plan writes the base model (each `base_layer.weight` under its base key, the
adapter's tensors left out); this plan names, for each LoRA module, the output tensor to update
in place and what PEFT's `LoraLayer.merge` adds to it: `scaling * (B @ A)` (transposed for
`fan_in_fan_out` and for embeddings), `scaling * B.bias` to the base bias with lora_bias, and
for DoRA the row rescaling by its magnitude vector.
`merge.run_merge` executes it one module at a time.

Example:
    >>> merge = plan_merge(plan, adapter, config, fqns)
    >>> merge.steps[0].key, round(merge.steps[0].scaling, 3)
    ('model.layers.0.self_attn.q_proj.weight', 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ckpttool.core.checkpoint import Tensor
from ckpttool.core.errors import UnsupportedFormat, UsageError
from ckpttool.formats import peft
from ckpttool.model.lora import Adapter
from ckpttool.plan.consolidate import ConsolidatePlan, OutputTensor

FLOATING = ("float32", "float16", "bfloat16", "float64")  # what LoRA merges into; 4/8-bit bases are refused


@dataclass(frozen=True)
class Target:
    """A written output tensor the merge updates in place."""

    key: str
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Quantised:
    """A bitsandbytes 4-bit weight (formats.bnb4bit): its packed source tensor, the dtype and
    shape it dequantises to, its sibling entries (suffix -> fqn or model key) and quant state."""

    fqn: str
    packed: Tensor
    dtype: str
    shape: tuple[int, ...]
    siblings: Mapping[str, str]
    state_fqn: str
    state: Mapping[str, Any]


@dataclass(frozen=True)
class MergeStep:
    """One LoRA module merged into its base weight (and bias); or, with no A and B, a 4-bit base
    weight only dequantised."""

    module: str  # its path in the base model, for messages
    kind: str  # "linear" | "embedding"
    weight: Target
    a_fqn: str | None
    b_fqn: str | None
    scaling: float
    fan_in_fan_out: bool
    bias: Target | None = None  # the base bias, when the adapter has a lora_B bias
    bias_fqn: str | None = None
    quantised: Quantised | None = None  # the weight is dequantised from this, not read from the output
    magnitude_fqn: str | None = None  # DoRA's magnitude vector: the merged weight is rescaled row by row


@dataclass(frozen=True)
class MergePlan:
    adapter: str
    steps: tuple[MergeStep, ...]


def plan_merge(plan: ConsolidatePlan, adapter: Adapter, config: Mapping[str, Any], fqns: Mapping[str, str],
               quantised: Mapping[str, Quantised] = {}) -> MergePlan:
    """Return the merge of `adapter` into the base weights `plan` writes; `fqns` maps model keys
    to checkpoint fqns, `quantised` (by fqn) the 4-bit weights, each dequantised (and merged
    where it is a LoRA module's base). Raises UnsupportedFormat naming the module for DoRA on
    an embedding or a 4-bit base, and naming the tensor for a base weight that is neither floating point nor a 4-bit weight with
    its quant state, UsageError when a base weight is not written (dropped by --filter or as a
    tied copy)."""
    by_fqn = {t.fqn: t for t in plan.tensors}
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    steps = []
    lora_bases = {fqns[m.base_key] for m in adapter.modules if m.base_key}
    for fqn, state in sorted(quantised.items()):
        if fqn not in lora_bases and fqn in by_fqn:
            steps.append(MergeStep(fqn, "linear", _target(by_fqn[fqn]), None, None, 0.0, False, quantised=state))
    for module in adapter.modules:
        if module.magnitude_key and (module.kind != "linear" or module.quantized):
            raise UnsupportedFormat(f"{module.path}: a DoRA adapter on {'a 4-bit base' if module.quantized else 'an embedding'}"
                                    "; --merge-adapter merges DoRA on linear layers only: export it with --adapter and "
                                    "merge it with PEFT's merge_and_unload")
        base = by_fqn.get(fqns[module.base_key]) if module.base_key else None
        if base is None:
            raise UsageError(f"{module.path}: its base weight {module.base_key or module.path + '.base_layer.weight'} is "
                             "not in the output (left out by --filter, a tied copy, or not saved); cannot merge into it")
        quant = quantised.get(base.fqn)
        if base.dtype not in FLOATING or (module.quantized and quant is None):
            raise UnsupportedFormat(f"{module.base_key}: the base weight is {base.dtype} {list(base.shape)} (a quantised "
                                    "base, e.g. bitsandbytes 4-bit); --merge-adapter merges into floating-point weights "
                                    "only: export the adapter with --adapter")
        bias, bias_fqn = None, None
        if module.bias_key:
            assert module.base_key is not None  # its base weight was found above
            bias_tensor = by_fqn.get(fqns.get(module.base_key.rsplit(".", 1)[0] + ".bias", ""))
            if bias_tensor is None:
                raise UsageError(f"{module.path}: lora_bias needs the base layer's bias, which the output lacks")
            bias, bias_fqn = _target(bias_tensor), fqns[module.bias_key]
        steps.append(MergeStep(module.path, module.kind, _target(base), fqns[module.a_key], fqns[module.b_key],
                               peft.module_scaling(config, module.path, module.rank),
                               fan_in_fan_out and module.kind == "linear", bias, bias_fqn, quant,
                               fqns[module.magnitude_key] if module.magnitude_key else None))
    return MergePlan(adapter.name, tuple(steps))


def _target(tensor: OutputTensor) -> Target:
    return Target(tensor.key, tensor.file, tensor.offset, tensor.dtype, tuple(tensor.shape))
