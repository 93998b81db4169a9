"""LoRA adapters found by structure in a model's keys and shapes (PEFT's names, any layout).

PEFT's `LoraLayer` keeps the wrapped weight as `<module>.base_layer.weight` and the adapter
beside it: `<module>.lora_A.<adapter>.weight` (r x in) and `<module>.lora_B.<adapter>.weight`
(out x r) for a Linear, `<module>.lora_embedding_A.<adapter>` (r x num_embeddings) and
`<module>.lora_embedding_B.<adapter>` (dim x r) for an Embedding, DoRA's
`<module>.lora_magnitude_vector.<adapter>.weight`; `modules_to_save` keeps a trained copy as
`<module>.modules_to_save.<adapter>.*` next to `<module>.original_module.*`. A `PeftModel`
prefixes it all with `base_model.model.`; `inject_adapter_in_model` (and the bundled trainer)
does not. `find_lora` reads a model's {key: shape} (no tensor data) and returns a `LoraLayout`:
each adapter's modules, ranks, targets and trainable count, and the base model's key of every
entry. An A without its B, or shapes that disagree, raise InvalidCheckpoint (`adapter-invalid`)
naming the module.

Example:
    >>> layout = find_lora({"base_model.model.fc.base_layer.weight": (8, 4),
    ...                     "base_model.model.fc.lora_A.default.weight": (2, 4),
    ...                     "base_model.model.fc.lora_B.default.weight": (8, 2)})
    >>> layout.adapters[0].name, layout.adapters[0].modules[0].rank, layout.base_keys["base_model.model.fc.base_layer.weight"]
    ('default', 2, 'fc.weight')
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from ckpttool.core.checkpoint import Checkpoint
from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.model.keys import normalise
from ckpttool.model.model_view import ModelView

WRAPPER_PREFIX = "base_model.model."  # peft.PeftModel -> LoraModel -> the base model
BASE_LAYER = "base_layer"  # peft.tuners.tuners_utils.BaseTunerLayer wraps the original module here
# peft/tuners/lora/layer.py LoraLayer.adapter_layer_names and other_param_names
# an adapter file (save_pretrained) drops the adapter name: `<module>.lora_A.weight`; PEFT loads it as "default"
_LINEAR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<side>[AB])(?:\.(?P<adapter>[^.]+))?$")
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<adapter>(?!weight$)[^.]+))?(?:\.weight)?$")
FILE_ADAPTER = "default"  # peft.PeftModel.from_pretrained(adapter_name="default")
# peft/utils/other.py ModulesToSaveWrapper: the trained copy and the original
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")


@dataclass(frozen=True)
class LoraModule:
    """One module's LoRA pair for one adapter: keys as the model's state dict names them."""

    path: str  # the module in the base model, e.g. model.layers.0.self_attn.q_proj
    adapter: str
    kind: str  # "linear" | "embedding"
    rank: int
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    base_key: str | None  # <module>.base_layer.weight (None: the base weight is not in the checkpoint)
    base_shape: tuple[int, ...] | None = None
    bias_key: str | None = None  # lora_B bias (LoraConfig lora_bias)
    magnitude_key: str | None = None  # DoRA
    quantized: bool = False  # the base weight is packed 4-bit (bitsandbytes Params4bit, QLoRA)

    @property
    def name(self) -> str:
        """The module's own name (`q_proj`): what target_modules lists."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def transposed(self) -> bool:
        """The base weight is stored (in, out), as GPT-2's Conv1D (PEFT's fan_in_fan_out)."""
        out, inner = self.b_shape[0], self.a_shape[1]
        return self.kind == "linear" and self.base_shape == (inner, out) and (inner, out) != (out, inner)


@dataclass(frozen=True)
class Adapter:
    """One named adapter: its LoRA modules and its modules_to_save entries (key -> base key)."""

    name: str
    modules: tuple[LoraModule, ...]
    saved: Mapping[str, str]  # modules_to_save.<adapter> key -> the base model key it replaces

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({m.name for m in self.modules}))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({m.rank for m in self.modules}))

    @property
    def keys(self) -> tuple[str, ...]:
        """Every model key that belongs to this adapter (what PEFT saves for it)."""
        keys = [k for m in self.modules for k in (m.a_key, m.b_key, m.bias_key, m.magnitude_key) if k]
        return tuple(sorted(keys + list(self.saved)))


@dataclass(frozen=True)
class LoraLayout:
    """The adapters of a model and the base model's key of each entry."""

    wrapped: bool  # keys carry PeftModel's `base_model.model.`
    adapters: tuple[Adapter, ...]
    base_keys: Mapping[str, str]  # model key -> base model key, for every entry not part of an adapter
    shapes: Mapping[str, tuple[int, ...]]

    def adapter(self, name: str | None) -> Adapter:
        """Return the adapter called `name` (None: the only one); UsageError naming the choices."""
        names = [a.name for a in self.adapters]
        if name is None and len(names) == 1:
            return self.adapters[0]
        for adapter in self.adapters:
            if adapter.name == name:
                return adapter
        raise UsageError(f"adapter {name!r}: the checkpoint holds {', '.join(names)}; name one with --adapter NAME"
                         if name is not None else f"the checkpoint holds {len(names)} adapters ({', '.join(names)}); "
                         "name one with --adapter NAME")

    def trainable(self, adapter: Adapter) -> int:
        return sum(math.prod(self.shapes[key]) for key in adapter.keys)

    @property
    def frozen(self) -> int:
        return sum(math.prod(self.shapes[key]) for key in self.base_keys)


def find_lora(shapes: Mapping[str, tuple[int, ...]]) -> LoraLayout | None:
    """Return the LoRA layout of a model's {key: shape}, or None when no key is a LoRA key.

    Raises InvalidCheckpoint (`adapter-invalid`) naming the module when an A has no B (or the
    reverse) or their shapes disagree with each other or with the base weight.
    """
    sides: dict[tuple[str, str, str], dict[str, str]] = defaultdict(dict)  # (module, adapter, kind) -> side -> key
    extras: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)  # (module, adapter) -> bias/magnitude -> key
    saved: dict[str, dict[str, str]] = defaultdict(dict)
    adapter_keys = set()
    for key in shapes:
        if match := _LINEAR.match(key):
            module, adapter = match["module"], match["adapter"] or FILE_ADAPTER
            if match["param"] == "bias":
                if match["side"] == "B":
                    extras[(module, adapter)]["bias"] = key
                    adapter_keys.add(key)
                continue
            sides[(module, adapter, "linear")][match["side"]] = key
        elif match := _EMBEDDING.match(key):
            sides[(match["module"], match["adapter"] or FILE_ADAPTER, "embedding")][match["side"]] = key
        elif match := _MAGNITUDE.match(key):
            extras[(match["module"], match["adapter"] or FILE_ADAPTER)]["magnitude"] = key
        elif match := _SAVED.match(key):
            saved[match["adapter"]][key] = f"{match['module']}.{match['rest']}"
        else:
            continue
        adapter_keys.add(key)
    if not sides and not saved:
        return None
    wrapped = all(key.startswith(WRAPPER_PREFIX) for key in shapes)
    modules: dict[str, list[LoraModule]] = defaultdict(list)
    for (module, adapter, kind), pair in sorted(sides.items()):
        modules[adapter].append(_module(module, adapter, kind, pair, extras.get((module, adapter), {}), shapes, wrapped))
    names = sorted(set(modules) | set(saved))
    adapters = tuple(Adapter(name, tuple(modules.get(name, ())),
                             {k: _base_key(v, wrapped) for k, v in sorted(saved.get(name, {}).items())})
                     for name in names)
    base_keys = {key: _base_key(key, wrapped) for key in shapes if key not in adapter_keys}
    return LoraLayout(wrapped, adapters, base_keys, dict(shapes))


def _module(module: str, adapter: str, kind: str, pair: Mapping[str, str], extra: Mapping[str, str],
            shapes: Mapping[str, tuple[int, ...]], wrapped: bool) -> LoraModule:
    """Return one module's LoRA pair, its shapes checked (A: r x in, B: out x r)."""
    path = module.removeprefix(WRAPPER_PREFIX) if wrapped else module
    missing = "B" if "A" in pair else "A"
    if len(pair) != 2:
        present = pair.get("A") or pair.get("B")
        raise InvalidCheckpoint(f"{path}: adapter {adapter!r} has {present} but no lora_{missing} "
                                "(a LoRA module needs both; the checkpoint is incomplete)", code="adapter-invalid")
    a_shape, b_shape = tuple(shapes[pair["A"]]), tuple(shapes[pair["B"]])
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] < 1:
        raise InvalidCheckpoint(f"{path}: adapter {adapter!r} has lora_A {list(a_shape)} and lora_B {list(b_shape)}; "
                                "A must be r x in and B out x r with the same r", code="adapter-invalid")
    base_key = next((k for k in (f"{module}.{BASE_LAYER}.weight",) if k in shapes), None)
    base_shape = tuple(shapes[base_key]) if base_key else None
    if kind == "linear":
        fits = base_shape in (None, (b_shape[0], a_shape[1]), (a_shape[1], b_shape[0]))
    else:
        fits = base_shape in (None, (a_shape[1], b_shape[0]))
    quantized = not fits and _packed(base_shape, b_shape[0] * a_shape[1])
    if not fits and not quantized:
        assert base_shape is not None  # any shape fits when there is no base weight
        raise InvalidCheckpoint(f"{path}: adapter {adapter!r} lora_A {list(a_shape)} and lora_B {list(b_shape)} do not "
                                f"fit the base weight {list(base_shape)}", code="adapter-invalid")
    return LoraModule(path, adapter, kind, a_shape[0], pair["A"], pair["B"], a_shape, b_shape, base_key, base_shape,
                      extra.get("bias"), extra.get("magnitude"), quantized)


def _packed(shape: tuple[int, ...] | None, numel: int) -> bool:
    """bitsandbytes' Params4bit: two 4-bit values a byte, flattened to (bytes / itemsize, 1) in its
    quant_storage dtype (uint8, or bf16/fp16/fp32 so FSDP can shard it)."""
    return (shape is not None and len(shape) == 2 and shape[1] == 1 and shape[0] > 0
            and numel % shape[0] == 0 and numel // shape[0] in (2, 4, 8))


def _base_key(key: str, wrapped: bool) -> str:
    """Return the base model's key of a PEFT model key: no `base_model.model.`, no `base_layer.`
    or `original_module.` component."""
    key = key.removeprefix(WRAPPER_PREFIX) if wrapped else key
    key = key.replace(f".{BASE_LAYER}.", ".")
    if match := _ORIGINAL.match(key):
        key = f"{match['module']}.{match['rest']}"
    return key


def model_shapes(checkpoint: Checkpoint, view: ModelView) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Return ({model key: shape}, {model key: fqn}) of the model's tensors, keys as
    consolidate names them (wrapper components normalised away)."""
    shapes, fqns = {}, {}
    for fqn, key in view.keys.items():
        tensor = checkpoint.tensors.get(fqn)
        if tensor is not None:
            key = normalise(key)
            shapes[key], fqns[key] = tuple(tensor.shape), fqn
    return shapes, fqns
