"""transformers' fused-expert modules, as data: which checkpoint keys fill which module tensor.

transformers 5 holds an MoE layer's experts fused in its modules (Qwen2/Qwen3-MoE, DeepSeek-V3,
Mixtral: `mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), while
checkpoints (the Hub's, `export`'s, a framework's under transformers' names) store one key per
expert. Its loader joins them by `conversion_mapping.py`: for "qwen2_moe" (which qwen3_moe,
deepseek_v3 and others map to) and "mixtral" a `WeightConverter` with `MergeModulelist(dim=0)`
(the experts stacked on a new dim 0) then `Concatenate(dim=1)` (each expert's gate rows, then
its up rows), and Mixtral's `WeightRenaming(".block_sparse_moe.", ".mlp.")`. Those are the
layouts below (QWEN2_MOE, MIXTRAL), which each family states for the architectures it converts
to (`Architecture.fused`; a family meeting another layout writes its own `FusedLayout`);
`plan_fill` applies every family's to a module's keys and shapes and a checkpoint's, so
`load_into` fills each fused tensor one expert's part at a time, straight into its memory (each
part is a contiguous run of rows of its expert's block). Pure: names and shapes in, a plan out.

Example:
    >>> plan = plan_fill({"m.experts.down_proj": (2, 4, 3)},
    ...                  {"m.experts.0.down_proj.weight": (4, 3), "m.experts.1.down_proj.weight": (4, 3)}, "ckpt")
    >>> [(slot.key, slot.expert, slot.row) for slot in plan.fused["m.experts.down_proj"]]
    [('m.experts.0.down_proj.weight', 0, 0), ('m.experts.1.down_proj.weight', 1, 0)]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from ckpttool.core.errors import UsageError


@dataclass(frozen=True)
class FusedRule:
    """Module tensor `module` [experts, rows, ...] <- for each expert `{E}`, the checkpoint keys
    `parts` concatenated along their dim 0 in this order; `{P}` is the module path before."""

    module: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class FusedLayout:
    """One model type's fused-expert modules: its rules, and the checkpoint text renamed to the
    module's first (`renames`: (checkpoint text, module text) pairs, in order)."""

    rules: tuple[FusedRule, ...]
    renames: tuple[tuple[str, str], ...] = ()

    def __add__(self, other: FusedLayout) -> FusedLayout:
        """Both layouts' rules and renames, this one's first (each once)."""
        return FusedLayout(tuple(dict.fromkeys(self.rules + other.rules)),
                           tuple(dict.fromkeys(self.renames + other.renames)))


# conversion_mapping.py `_build_checkpoint_conversion_mapping`, transformers 5.24.0
QWEN2_MOE = FusedLayout((  # "qwen2_moe", which qwen3_moe, deepseek_v3 and others map to
    FusedRule("{P}.experts.gate_up_proj", ("{P}.experts.{E}.gate_proj.weight", "{P}.experts.{E}.up_proj.weight")),
    FusedRule("{P}.experts.down_proj", ("{P}.experts.{E}.down_proj.weight",)),
))
MIXTRAL = FusedLayout((
    FusedRule("{P}.experts.gate_up_proj", ("{P}.experts.{E}.w1.weight", "{P}.experts.{E}.w3.weight")),
    FusedRule("{P}.experts.down_proj", ("{P}.experts.{E}.w2.weight",)),
), renames=((".block_sparse_moe.", ".mlp."),))  # checkpoint text -> the module's


@dataclass(frozen=True)
class Slot:
    """Checkpoint key `key` fills rows [row, row + rows) of expert `expert` of a fused tensor."""

    key: str
    expert: int
    row: int
    rows: int


@dataclass(frozen=True)
class FillPlan:
    """Which checkpoint key fills each module key: `direct` as it is (the module key -> the
    checkpoint's, equal unless renamed), `fused` by slots; module keys nothing fills, and
    checkpoint keys no module key takes."""

    direct: dict[str, str] = field(default_factory=dict)
    fused: dict[str, tuple[Slot, ...]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{P\}", "(?P<P>.+)"))


def every_layout() -> FusedLayout:
    """Return the fused-expert layouts of every architecture every family converts to, in the
    registry's order (each rule once)."""
    from ckpttool import naming

    layout = FusedLayout(())
    for family in naming.FAMILIES:
        for architecture in family.converts_to:
            if architecture.fused is not None:
                layout += architecture.fused
    return layout


def plan_fill(module: Mapping[str, tuple[int, ...]], checkpoint: Mapping[str, tuple[int, ...]],
              where: str, layout: FusedLayout | None = None) -> FillPlan:
    """Return how the checkpoint's keys -> shapes fill the module's keys -> shapes: a key of
    the same name first, else its renamed checkpoint key (the layout's renames), else a fused
    rule whose parts are all there for every expert (`layout`: default every family's,
    `every_layout`). Raises UsageError naming `where` and the tensor when a fused tensor's parts
    do not add up to its shape (a same-named key's shape is the caller's to check)."""
    layout = every_layout() if layout is None else layout
    names: dict[str, str] = {}  # the module's name for each checkpoint key -> the key
    for name in checkpoint:
        alias = name if name in module else _renamed(name, layout.renames)
        names[name if alias in checkpoint else alias] = name
    plan = FillPlan()
    patterns = [(rule, _regex(rule.module)) for rule in layout.rules]
    used: set[str] = set()
    for key, shape in module.items():
        if key in names:
            plan.direct[key] = names[key]
            used.add(names[key])
            continue
        slots = _fused_slots(key, shape, names, checkpoint, where, patterns)
        if slots is None:
            plan.missing.append(key)
            continue
        plan.fused[key] = slots
        used.update(slot.key for slot in slots)
    plan.unexpected.extend(key for key in checkpoint if key not in used)
    return plan


def _renamed(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        key = key.replace(old, new)
    return key


def _fused_slots(key: str, shape: tuple[int, ...], names: Mapping[str, str], checkpoint: Mapping[str, tuple[int, ...]],
                 where: str, patterns: list[tuple[FusedRule, re.Pattern]]) -> tuple[Slot, ...] | None:
    """Return the slots of the first rule for `key` whose parts are all present (as module-side
    names -> checkpoint keys in `names`), in the tensor's row-major order; None if none is."""
    for rule, regex in patterns:
        found = regex.fullmatch(key)
        if found is None or len(shape) < 2:
            continue
        prefix = found.group("P")
        wanted = [[names.get(part.replace("{P}", prefix).replace("{E}", str(expert))) for part in rule.parts]
                  for expert in range(shape[0])]
        if any(None in parts for parts in wanted):
            continue
        experts = [[name for name in parts if name is not None] for parts in wanted]
        slots = []
        for expert, parts in enumerate(experts):
            row = 0
            for name in parts:
                part = checkpoint[name]
                if tuple(part[1:]) != shape[2:] or len(part) != len(shape) - 1:
                    raise UsageError(f"{where}: {name} has shape {list(part)}, which is not rows of the module's "
                                     f"{key} {list(shape)}")
                slots.append(Slot(name, expert, row, part[0]))
                row += part[0]
            if row != shape[1]:
                raise UsageError(f"{where}: {' + '.join(parts)} give {row} rows, the module's {key} "
                                 f"{list(shape)} has {shape[1]} per expert")
        return tuple(slots)
    return None
