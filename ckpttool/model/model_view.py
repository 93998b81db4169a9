"""Which entries of a checkpoint are the model, and which the optimizer: found by structure.

People nest the model wherever their trainer puts it: torch's DCP recipe under `app.model`, a
plain `dcp.save(model.state_dict())` at the top level, Composer under `state.model`,
torchtitan at the top level beside `optimizer`, a user under `weights`. `find_model` reads the
checkpoint's structure and returns a `ModelView`: the model subtree's prefix, each model
entry's key (as `model.state_dict()` names it), the optimizer subtrees, and why it chose so.

Evidence, strongest first:

1. the caller's `--model-prefix` (`""`: the top level);
2. a layout reader's own knowledge (`Checkpoint.model_prefix`: Megatron nests the model
   under `model`; verl, safetensors files and Hub folders hold only the model);
3. optimizer state keyed by parameter FQNs (`<opt>.state.<param fqn>.<exp_avg|step|...>`, as
   `get_state_dict` writes it) names the parameters: the model is the subtree where those
   names are tensors;
4. without it, the one module tree among the tensors that are neither an optimizer's (its
   `param_groups` marks one) nor training state (`rng`, `lr_scheduler`, `dataloader`, ...).

Where torch's planner_data says how the state dict was nested (`Checkpoint.nesting`), a
model entry is a direct key of the model's dict, so a key holding dots stays one key. Two
readings equally good (`{"student": ..., "teacher": ...}`, or a model and its EMA copy both
named by the optimizer) give `selected == "ambiguous"`; `ModelView.require()` then raises
AmbiguousModel (exit 2) naming the candidates and `--model-prefix`.

Example:
    >>> view = find_model(read_checkpoint("recipe"))      # dcp.save({"app": AppState(...)})
    >>> view.prefix, view.selected
    ('app.model', 'optimizer-state')
    >>> view.keys["app.model.layers.0.weight"]
    'layers.0.weight'
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ckpttool.core.checkpoint import Checkpoint
from ckpttool.core.errors import UsageError

# Module wrappers that insert a path component into parameter names:
# FSDP1 (torch/distributed/fsdp/_common_utils.py FSDP_WRAPPED_MODULE), torch.compile
# (torch/_dynamo/eval_frame.py OptimizedModule._orig_mod), activation checkpointing
# (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py _CHECKPOINT_WRAPPED_MODULE).
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
DDP_PREFIX = "module."  # DistributedDataParallel / DataParallel wrap the whole model

# Names of an optimizer's subtree (torchtitan `optimizer`, the trainer `optim`, Composer
# `optimizers`, Lightning `optimizer_states`), used where no `param_groups` says so.
OPTIMIZER_KEYS = ("optim", "optimizer", "optimizers", "optimizer_states")
# Beside model fqns at the top level (torchtitan): what is training state, not model.
TRAINING_STATE_KEYS = ("lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state", "extra_state",
                       "rng", "rng_state", "step", "epoch")
# torch.optim's per-parameter state names (torch/optim/*.py `state[p][...]`): Adam/AdamW,
# SGD, Adagrad, RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop; plus `step`.
STATE_KEYS = frozenset({
    "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "grad_avg",
    "acc_delta", "exp_inf", "mu_product", "eta", "mu", "ax", "prev", "step_size",
})
# containers that hold training state, never the model (Composer, Lightning, torchtitan, ...)
STATE_CONTAINERS = frozenset(TRAINING_STATE_KEYS) | {
    "schedulers", "timestamp", "callbacks", "algorithms", "dataset_state", "scaler", "grad_scaler", "loops",
    "rng_states", "integrations", "metadata", "run_name", "train", "trainer_state",
}
# names people give the model's own dict, when structure alone cannot decide
MODEL_NAMES = ("model", "module", "state_dict", "model_state_dict", "model_state", "models", "weights", "params")

OPTION, LAYOUT, OPTIMIZER_STATE, MODULE_TREE, NAME, AMBIGUOUS, NONE = (
    "option", "layout", "optimizer-state", "module-tree", "name", "ambiguous", "none")


def normalise(key: str) -> str:
    """Return `key` without FSDP1/compile/activation-checkpoint wrapper components and a
    leading DDP `module.` (keys.py's normalisation, here because finding the model needs it).

    Example:
        >>> normalise("module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w")
        'layers.0.w'
    """
    for component in WRAPPER_COMPONENTS:
        key = key.replace(component, "")
    return key.removeprefix(DDP_PREFIX)


class AmbiguousModel(UsageError):
    """Two subtrees are equally good readings of the model; `--model-prefix` picks one."""

    code = "ambiguous-model"


@dataclass(frozen=True)
class ModelView:
    """The model subtree of a checkpoint and how it was found (see the module doc)."""

    prefix: str | None  # dotted prefix of the model's dict; "" the top level; None: no model found
    selected: str  # option | layout | optimizer-state | module-tree | name | ambiguous | none
    reason: str  # one line for people: why this prefix
    keys: Mapping[str, str] = field(default_factory=dict)  # model fqn -> key as model.state_dict() names it
    optimizers: tuple[str, ...] = ()  # prefixes of optimizer subtrees
    parameters: frozenset[str] = frozenset()  # model fqns the optimizer state names
    candidates: tuple[str, ...] = ()  # every plausible prefix (more than one when ambiguous)

    def group(self, fqn: str) -> str:
        """Return `model`, `optimizer` or `other`."""
        if fqn in self.keys:
            return "model"
        if any(_under(fqn, prefix) for prefix in self.optimizers):
            return "optimizer"
        top = fqn.split(".", 1)[0]
        return "optimizer" if top in OPTIMIZER_KEYS or (top.startswith("optimizer_") and top[10:].isdigit()) else "other"

    def require(self) -> "ModelView":
        """Return self, or raise AmbiguousModel when two readings tie."""
        if self.selected == AMBIGUOUS:
            raise AmbiguousModel(self.reason)
        return self

    def describe(self) -> str:
        """One line: `app.model (optimizer-state: ...)`."""
        where = "none" if self.prefix is None else (f"{self.prefix}." if self.prefix else "the top level")
        return f"{where} ({self.selected}: {self.reason})"


def find_model(checkpoint: Checkpoint, model_prefix: str | None = None) -> ModelView:
    """Return the checkpoint's model view; `model_prefix` (the user's `--model-prefix`)
    overrides the detection, `""` meaning the top level."""
    entries = list(checkpoint.tensors) + list(checkpoint.objects)
    optimizers, named = _optimizers(entries)
    if model_prefix is not None:
        prefix = model_prefix.strip(".")
        return _view(checkpoint, prefix, OPTION, "--model-prefix", optimizers, named)
    if checkpoint.model_prefix is not None:
        return _view(checkpoint, checkpoint.model_prefix, LAYOUT, "the layout's own place for the model",
                     optimizers, named)
    tensors = [fqn for fqn in checkpoint.tensors if not any(_under(fqn, p) for p in optimizers)]
    splits = {fqn: _splits(checkpoint, fqn) for fqn in tensors}
    by_evidence = _from_optimizer_state(splits, named)
    if by_evidence is not None:
        best, votes, total = by_evidence
        if len(best) > 1:
            return _ambiguous(best, f"the optimizer state names {votes} parameters under each")
        return _view(checkpoint, best[0], OPTIMIZER_STATE,
                     f"the optimizer state names {votes} of its {total} parameters as tensors here",
                     optimizers, named)
    return _from_module_trees(checkpoint, splits, optimizers, named)


def _under(fqn: str, prefix: str) -> bool:
    return not prefix or fqn == prefix or fqn.startswith(prefix + ".")


def _optimizers(entries: Iterable[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """Return the optimizer subtrees' prefixes and the parameter names their state is keyed by.

    `<opt>.param_groups.*` marks `<opt>`; `<opt>.state.<name>.<state key>` names a parameter
    (integer names, as a plain `optimizer.state_dict()` keeps them, name nothing).
    """
    parts = {fqn: fqn.split(".") for fqn in entries}
    prefixes = set()
    for split in parts.values():
        if "param_groups" in split[:-1]:
            prefixes.add(".".join(split[: split.index("param_groups")]))
    named = set()
    for split in parts.values():
        states = [i for i, part in enumerate(split[:-2]) if part == "state"]
        at = next((i for i in states if ".".join(split[:i]) in prefixes), None)
        if at is None and split[-1] in STATE_KEYS:  # no param_groups saved: a known state key
            at = next((i for i in states if i and split[i - 1] in OPTIMIZER_KEYS), None)
        if at is None:
            continue
        prefixes.add(".".join(split[:at]))
        name = ".".join(split[at + 1:-1])
        if not name.isdigit():
            named.add(name)
    return tuple(sorted(prefixes)), frozenset(named)


def _splits(checkpoint: Checkpoint, fqn: str) -> list[tuple[str, str]]:
    """Return the (container, key) readings of `fqn`: one where planner_data says how the state
    dict was nested (the key may hold dots), else one per dot."""
    path = checkpoint.nesting.get(fqn)
    if path:
        return [(".".join(str(part) for part in path[:-1]), str(path[-1]))]
    parts = fqn.split(".")
    return [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts))]


def _from_optimizer_state(splits: Mapping[str, list[tuple[str, str]]],
                          named: frozenset[str]) -> tuple[list[str], int, int] | None:
    """Return (best containers, the parameters each names, all named) when the optimizer
    state names at least half of its parameters as tensors of one container; else None."""
    if not named:
        return None
    votes: Counter[str] = Counter()
    for readings in splits.values():
        for container, key in readings:
            if key in named or normalise(key) in named:
                votes[container] += 1
    if not votes:
        return None
    top = max(votes.values())
    if top * 2 < len(named):
        return None
    return sorted(c for c, v in votes.items() if v == top), top, len(named)


def _from_module_trees(checkpoint: Checkpoint, splits: Mapping[str, list[tuple[str, str]]],
                       optimizers: tuple[str, ...], named: frozenset[str]) -> ModelView:
    """No optimizer names the parameters: the one module tree among the remaining tensors."""
    nested = all(len(readings) == 1 for readings in splits.values()) and bool(checkpoint.nesting)
    trees: dict[str, list[str]] = defaultdict(list)
    for fqn, readings in splits.items():
        if nested:
            container, key = readings[0]
        else:  # no planner_data: a known model name at the top, else the top level
            top = fqn.split(".", 1)[0]
            container, key = (top, fqn[len(top) + 1:]) if top in MODEL_NAMES and "." in fqn else ("", fqn)
        if _is_state_container(container) or (not container and key.split(".", 1)[0] in STATE_CONTAINERS):
            continue
        trees[container].append(key)
    if not trees:
        return ModelView(None, NONE, "no tensors outside optimizer and training state", {}, optimizers)
    modules = [c for c, keys in trees.items() if any("." in key for key in keys)] or list(trees)
    if len(modules) == 1:
        return _view(checkpoint, modules[0], MODULE_TREE, "the one module tree among the tensors",
                     optimizers, named)
    by_name = [c for c in modules if c.rsplit(".", 1)[-1] in MODEL_NAMES]
    if len(by_name) == 1:
        return _view(checkpoint, by_name[0], NAME, f"named like a model, beside {_names(modules, by_name[0])}",
                     optimizers, named)
    return _ambiguous(sorted(modules), "each holds a module tree")


def _is_state_container(container: str) -> bool:
    return any(part in STATE_CONTAINERS for part in container.split(".")) if container else False


def _names(prefixes: Iterable[str], chosen: str) -> str:
    return ", ".join(repr(p) for p in sorted(prefixes) if p != chosen)


def _ambiguous(candidates: list[str], why: str) -> ModelView:
    shown = " and ".join(repr(p) if p else "'' (the top level)" for p in candidates)
    reason = (f"the model could be under {shown} ({why}); pass --model-prefix "
              f"{candidates[0] or repr('')} (or another) to choose")
    return ModelView(None, AMBIGUOUS, reason, {}, (), frozenset(), tuple(candidates))


def _view(checkpoint: Checkpoint, prefix: str, selected: str, reason: str, optimizers: tuple[str, ...],
          named: frozenset[str]) -> ModelView:
    """Return the view whose model is the dict at `prefix`."""
    keys: dict[str, str] = {}
    for fqn in list(checkpoint.tensors) + list(checkpoint.objects):
        key = _key(checkpoint, fqn, prefix, optimizers)
        if key is not None:
            keys[fqn] = key
    attribute = checkpoint.model_attribute
    if attribute and selected != OPTION:  # the model inside a trainer's module (readers: Lightning)
        keys = {fqn: key[len(attribute) + 1:] for fqn, key in keys.items() if key.startswith(attribute + ".")}
        reason = f"{reason}; its {attribute!r} holds every parameter: the model"
    keys = dict(sorted(keys.items()))
    parameters = frozenset(fqn for fqn, key in keys.items()
                           if fqn in checkpoint.tensors and (key in named or normalise(key) in named))
    return ModelView(prefix, selected, reason, keys, optimizers, parameters, (prefix,))


def _key(checkpoint: Checkpoint, fqn: str, prefix: str, optimizers: tuple[str, ...]) -> str | None:
    """Return `fqn`'s key in the model dict at `prefix`, or None when it is not a model entry."""
    if any(_under(fqn, p) for p in optimizers if not (prefix and _under(prefix, p))):
        return None
    path = checkpoint.nesting.get(fqn)
    if path:  # a direct key of the dict at `prefix`
        if ".".join(str(part) for part in path[:-1]) != prefix:
            return None
        key = str(path[-1])
    elif _under(fqn, prefix) and fqn != prefix:
        key = fqn[len(prefix) + 1:] if prefix else fqn
    else:
        return None
    return None if not prefix and key.split(".", 1)[0] in STATE_CONTAINERS else key

