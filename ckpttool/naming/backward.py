"""transformers names -> a framework's names: every family's table (naming/families/*.py) run
backwards, for `ckpttool import --to torchtitan|megatron`.

A rule says `hf <- source by transform`; its transform's `inverse` (engine.TRANSFORMS) names
how the transformers tensors make the framework's tensor again, here in `INVERSES`:

- rename: the tensor as it is;
- unpermute-q / unpermute-k: torchtitan's rotary row order back (its `_reverse_permute`, the
  inverse of `engine.rotary_rows`): framework row (h, b, a) is transformers row (h, a, b), one
  piece per head, its rows a (2, head_dim / 2) grid transposed (`Piece.transposed`);
- join-halves: [gate; up] (Megatron's `linear_fc1`, Megatron-Bridge `GatedMLPMapping`);
- join-qkv: q, k, v interleaved per query group (Megatron-Bridge `QKVMapping`): each group's
  q heads, then its k head, then its v head;
- stack-experts: one tensor per expert stacked on a new dim 0 (torchtitan's grouped
  `w1_EFD`/`w3_EFD`/`w2_EDF`, Megatron's experts axis);
- stack-experts-join-halves: both, [E, 2F, D];
- GPT-OSS's experts (Megatron-Bridge GPTOSSMLPGateUpProjMapping / GPTOSSMLPDownProjMapping run
  megatron-ward): stack-experts-uninterleaved-transposed, transformers' `gate_up_proj` [E, H, 2F]
  (columns gate, up, gate, ...) as Megatron's stacked `linear_fc1` [E, 2F, H] = [gate; up] per
  expert; stack-experts-uninterleaved, its bias [E, 2F] as [gate; up]; stack-experts-transposed,
  `down_proj` [E, F, H] as `linear_fc2` [E, H, F]. Each expert one `rows` piece (Piece.rows:
  expert_columns.row_chunks), decoded one expert's matrix at a time.

Each gives the framework tensor as `Piece`s of transformers tensors, so the bytes move by range
(`engine.converted_checkpoint` turns them into chunks): nothing is read here. When several rules
give one transformers name (Megatron's TE and local names of a norm), the family's `backward`
patterns say which one import writes, else the first. A rule whose transform has no inverse is
refused by name when a tensor needs it (`NoInverse`). Framework tensors no transformers tensor
makes (torchtitan's MoE load-balancing buffers) are the family's `made` entries: written as the
framework initialises them, and listed in the report.

Example:
    >>> targets = backward(family("torchtitan llama3"), shapes, config, "hub/llama")
    >>> targets["layers.0.attention.qkv_linear.wq.weight"].pieces[0].source
    'model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.naming import Pattern
from ckpttool.naming.engine import TIED_EMBEDDING, TRANSFORMS, Family, Piece, Rule, Target, row_box

# the transformers keys no framework stores: rotary tables some old checkpoints saved
HF_BUFFERS = (Pattern("model.layers.{L}.self_attn.rotary_emb.inv_freq"),)


class NoInverse(UsageError):
    """A rule whose transform cannot run backwards (exit 2: the family cannot be imported)."""


@dataclass(frozen=True)
class MadeTensor:
    """A framework tensor no transformers tensor makes, as the framework initialises it."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    fill: float
    why: str


@dataclass(frozen=True)
class Backward:
    """What `backward` found: the framework's tensors as pieces of transformers tensors, the
    ones made as the framework initialises them, and the transformers keys left out (the tied
    head, rotary buffers) with why."""

    targets: dict[str, Target]
    made: dict[str, MadeTensor]
    left_out: dict[str, str]


# (rule, framework key, target index -> {expert or -1: transformers key}, shapes, config, where) -> Target
Inverse = Callable[[Rule, str, Mapping[int, Mapping[int, str]], Mapping[str, tuple[int, ...]], Mapping[str, Any], str],
                   Target]


def _only(parts: Mapping[int, Mapping[int, str]], index: int = 0) -> str:
    return next(iter(parts[index].values()))


def _rename(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
            config: Mapping[str, Any], where: str) -> Target:
    source = _only(parts)
    shape = shapes[source]
    return Target(key, shape, (Piece(source, ((0,) * len(shape), shape)),), rule)


def _unpermuted(heads: int, rule: Rule, key: str, source: str, shape: tuple[int, ...], where: str) -> Target:
    rows = shape[0] if shape else 0
    if len(shape) != 2 or heads <= 0 or rows % heads or (rows // heads) % 2:
        raise InvalidCheckpoint(f"{where}: {source} of shape {list(shape)} does not split into {heads} heads of even "
                                "size (config.json's head counts disagree with the weights)", code="config-mismatch")
    head_dim = rows // heads
    half = head_dim // 2
    # framework row (h, b, a) = transformers row (h, a, b): torchtitan's _reverse_permute, each
    # head's rows as a (2, half) grid transposed
    pieces = tuple(Piece(source, row_box(shape, h * head_dim, head_dim), transposed=(2, half)) for h in range(heads))
    return Target(key, shape, pieces, rule)


def _unpermute_q(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
                 config: Mapping[str, Any], where: str) -> Target:
    source = _only(parts)
    return _unpermuted(int(config["num_attention_heads"]), rule, key, source, shapes[source], where)


def _unpermute_k(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
                 config: Mapping[str, Any], where: str) -> Target:
    source = _only(parts)
    heads = int(config["num_attention_heads"])
    return _unpermuted(int(config.get("num_key_value_heads") or heads), rule, key, source, shapes[source], where)


def _same_shape(rule: Rule, sources: list[str], shapes: Mapping[str, tuple[int, ...]], where: str) -> tuple[int, ...]:
    shape = shapes[sources[0]]
    for source in sources[1:]:
        if shapes[source] != shape:
            raise InvalidCheckpoint(f"{where}: {source} has shape {list(shapes[source])}, {sources[0]} "
                                    f"{list(shape)}: {rule.source} joins tensors of one shape", code="config-mismatch")
    return shape


def _join_halves(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
                 config: Mapping[str, Any], where: str) -> Target:
    sources = [_only(parts, index) for index in range(2)]
    shape = _same_shape(rule, sources, shapes, where)
    if not shape:
        raise InvalidCheckpoint(f"{where}: {sources[0]} is a scalar; {rule.source} joins rows", code="config-mismatch")
    pieces = tuple(Piece(source, ((0,) * len(shape), shape)) for source in sources)
    return Target(key, (2 * shape[0], *shape[1:]), pieces, rule)


def _join_qkv(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
              config: Mapping[str, Any], where: str) -> Target:
    q, k, v = (_only(parts, index) for index in range(3))
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    q_shape, k_shape = shapes[q], shapes[k]
    head_dim = int(config.get("head_dim") or 0) or (q_shape[0] // heads if q_shape and heads else 0)
    if (groups <= 0 or heads % groups or head_dim <= 0 or not q_shape or q_shape[0] != heads * head_dim
            or k_shape != (groups * head_dim, *q_shape[1:]) or shapes[v] != k_shape):
        raise InvalidCheckpoint(f"{where}: {q} {list(q_shape)}, {k} {list(k_shape)} and {v} {list(shapes[v])} are not "
                                f"{heads} query heads and {groups} key/value groups of head_dim {head_dim} (config.json's "
                                "head counts disagree with the weights)", code="config-mismatch")
    per_group = heads // groups
    pieces = []
    for group in range(groups):
        pieces.append(Piece(q, row_box(q_shape, group * per_group * head_dim, per_group * head_dim)))
        pieces.append(Piece(k, row_box(k_shape, group * head_dim, head_dim)))
        pieces.append(Piece(v, row_box(k_shape, group * head_dim, head_dim)))
    return Target(key, ((heads + 2 * groups) * head_dim, *q_shape[1:]), tuple(pieces), rule)


def _experts(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], where: str) -> list[list[str]]:
    """Return, per expert 0..E-1, its transformers keys in the rule's target order."""
    numbers = sorted(parts[0])
    if numbers != list(range(len(numbers))) or any(sorted(parts[index]) != numbers for index in parts):
        raise InvalidCheckpoint(f"{where}: {key} stacks experts 0..E-1, but the checkpoint has experts {numbers} of "
                                f"{rule.targets[0]}", code="config-mismatch")
    return [[parts[index][expert] for index in sorted(parts)] for expert in numbers]


def _stack_experts(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
                   config: Mapping[str, Any], where: str) -> Target:
    experts = [sources[0] for sources in _experts(rule, key, parts, where)]
    shape = _same_shape(rule, experts, shapes, where)
    pieces = tuple(Piece(source, ((0,) * len(shape), shape), at=(expert,) + (0,) * len(shape))
                   for expert, source in enumerate(experts))
    return Target(key, (len(experts), *shape), pieces, rule)


def _stack_experts_join_halves(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]],
                               shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], where: str) -> Target:
    experts = _experts(rule, key, parts, where)
    shape = _same_shape(rule, [source for pair in experts for source in pair], shapes, where)
    if not shape:
        raise InvalidCheckpoint(f"{where}: {experts[0][0]} is a scalar; {rule.source} joins rows", code="config-mismatch")
    rest = (0,) * (len(shape) - 1)
    pieces = tuple(Piece(source, ((0,) * len(shape), shape), at=(expert, part * shape[0], *rest))
                   for expert, pair in enumerate(experts) for part, source in enumerate(pair))
    return Target(key, (len(experts), 2 * shape[0], *shape[1:]), pieces, rule)


def _experts_as_rows(interleaved: bool, matrix: bool) -> Inverse:
    """The inverse of EXPERTS_[INTERLEAVED_]TRANSPOSED (`matrix`) or EXPERTS_INTERLEAVED: the
    transformers experts [E, R, C] as [E, C, R] ([E, C] as [E, C]), each expert a `rows` piece
    whose target row y * X + x is its column x * Y + y: interleaved, (C / 2, 2), the columns
    gate[0], up[0], gate[1], ... as the rows [gate; up]; else (C, 1), a transpose."""

    def inverse(rule: Rule, key: str, parts: Mapping[int, Mapping[int, str]], shapes: Mapping[str, tuple[int, ...]],
                config: Mapping[str, Any], where: str) -> Target:
        source = _only(parts)
        shape = shapes[source]
        experts = config.get("num_local_experts")
        if len(shape) != (3 if matrix else 2) or (interleaved and shape[-1] % 2) or \
                (experts is not None and shape[:1] != (experts,)):
            wanted = "[experts, H, 2F]" if matrix and interleaved else "[experts, F, H]" if matrix else "[experts, 2F]"
            raise InvalidCheckpoint(f"{where}: {source} of shape {list(shape)} is not num_local_experts={experts!r} "
                                    f"grouped experts {wanted} ({rule.source} stacks them)", code="config-mismatch")
        columns = shape[-1]
        grid = (columns // 2, 2) if interleaved else (columns, 1)
        zeros = (0,) * (len(shape) - 1)
        pieces = tuple(Piece(source, ((expert, *zeros), (1, *shape[1:])), at=(expert, *zeros), rows=grid)
                       for expert in range(shape[0]))
        return Target(key, (shape[0], columns, shape[1]) if matrix else shape, pieces, rule)

    return inverse


# transform name (engine.TRANSFORMS[...].inverse) -> how it runs
INVERSES: Mapping[str, Inverse] = {
    "rename": _rename,
    "unpermute-q": _unpermute_q,
    "unpermute-k": _unpermute_k,
    "join-halves": _join_halves,
    "join-qkv": _join_qkv,
    "stack-experts": _stack_experts,
    "stack-experts-join-halves": _stack_experts_join_halves,
    "stack-experts-uninterleaved-transposed": _experts_as_rows(interleaved=True, matrix=True),
    "stack-experts-uninterleaved": _experts_as_rows(interleaved=True, matrix=False),
    "stack-experts-transposed": _experts_as_rows(interleaved=False, matrix=True),
}


def chosen_rules(family: Family) -> list[Rule]:
    """Return the rules import writes, in table order: of several rules giving one transformers
    name, the one whose source is in `family.backward`, else the first."""
    preferred = [rule for rule in family.rules if rule.source in family.backward]
    claimed = {name for rule in preferred for name in rule.targets}
    chosen = []
    for rule in family.rules:
        if rule in preferred:
            chosen.append(rule)
        elif not claimed.intersection(rule.targets):
            chosen.append(rule)
            claimed.update(rule.targets)
    return chosen


def backward(family: Family, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], where: str) -> Backward:
    """Return the framework's tensors of `family` as pieces of the transformers tensors
    `shapes` (key -> shape), with the config.json `config`.

    Raises InvalidCheckpoint (`config-mismatch`) naming a transformers key no rule takes or
    whose shape does not fit, and NoInverse naming a rule that cannot run backwards."""
    main_layers = int(config.get("num_hidden_layers") or 0)
    extra_layers = any("{N}" in name for rule in family.rules for name in rule.targets)
    tied = bool(config.get("tie_word_embeddings", False))
    rules = chosen_rules(family)
    patterns = [(rule, index, Pattern(name)) for rule in rules for index, name in enumerate(rule.targets)]
    ignored = [(Pattern(pattern), why) for pattern, why in family.hf_ignored]
    groups: dict[tuple[int, str], dict[int, dict[int, str]]] = {}
    left_out: dict[str, str] = {}
    for key in shapes:
        found = _match(patterns, key, main_layers if extra_layers else None)
        if found is None:
            if any(pattern.match(key) is not None for pattern in HF_BUFFERS):
                left_out[key] = "a rotary table the framework computes"
                continue
            why = next((why for pattern, why in ignored if pattern.match(key) is not None), None)
            if why is not None:
                left_out[key] = why
                continue
            if tied and key == "lm_head.weight":
                left_out[key] = "tie_word_embeddings: the framework uses the embedding"
                continue
            raise InvalidCheckpoint(f"{where}: {key} (shape {list(shapes[key])}) has no {family.name} name: no rule of its "
                                    "table gives it (a model its table does not describe)", code="config-mismatch")
        rule, index, values = found
        name = _framework_name(rule.source, values, main_layers)
        expert = int(values["E"]) if "E" in values and "{E}" not in rule.source else -1
        groups.setdefault((rules.index(rule), name), {}).setdefault(index, {})[expert] = key
    targets: dict[str, Target] = {}
    for (number, name), parts in groups.items():
        rule = rules[number]
        inverse = TRANSFORMS[rule.transform].inverse
        if inverse is None or inverse not in INVERSES:
            raise NoInverse(f"{where}: {family.name} rule {rule.source} <- {', '.join(rule.targets)} ({rule.transform}) "
                            "cannot run backwards; import cannot write this family")
        missing = [rule.targets[index] for index in range(len(rule.targets)) if index not in parts]
        if missing:
            raise InvalidCheckpoint(f"{where}: {name} is made of {', '.join(rule.targets)}, but "
                                    f"{missing[0]} is missing", code="config-mismatch")
        targets[name] = INVERSES[inverse](rule, name, parts, shapes, config, where)
    if tied and family.stores_tied_head and family.tied_head is not None and family.tied_head not in targets:
        embedding = next((rule.source for rule in rules if rule.targets == (TIED_EMBEDDING,)), None)
        if embedding in targets:
            head = targets[embedding]
            targets[family.tied_head] = Target(family.tied_head, head.shape, head.pieces, head.rule)
    made = _made(family, targets)
    return Backward(dict(sorted(targets.items())), made, left_out)


def _match(patterns: list[tuple[Rule, int, Pattern]], key: str, main_layers: int | None
           ) -> tuple[Rule, int, dict[str, str]] | None:
    for rule, index, pattern in patterns:
        values = pattern.match(key)
        if values is None:
            continue
        if main_layers is not None:  # a model with extra layers (MTP) numbers them after the main ones
            if "L" in values and int(values["L"]) >= main_layers:
                continue
            if "N" in values and int(values["N"]) < main_layers:
                continue
        return rule, index, values
    return None


def _framework_name(source: str, values: Mapping[str, str], main_layers: int) -> str:
    name = source.replace("{L}", values.get("L", ""))
    if "E" in values:
        name = name.replace("{E}", values["E"])
    if "N" in values:
        name = name.replace("{M}", str(int(values["N"]) - main_layers))
    return name


def _made(family: Family, targets: Mapping[str, Target]) -> dict[str, MadeTensor]:
    """Return the framework tensors `family.made` describes, one per tensor its `like` pattern
    finds among `targets` (a per-layer buffer sized by that layer's router)."""
    made: dict[str, MadeTensor] = {}
    for rule in family.made:
        like = Pattern(rule.like)
        for key in sorted(targets):
            values = like.match(key)
            if values is None:
                continue
            name = rule.source.replace("{L}", values.get("L", ""))
            shape = tuple(targets[key].shape[dim] for dim in rule.dims)
            made[name] = MadeTensor(name, shape, rule.dtype, rule.fill, rule.why)
    return dict(sorted(made.items()))


def stack_layers(targets: Mapping[str, Target], prefix: str) -> dict[str, Target]:
    """Return `targets` with each set of per-layer tensors `{prefix}{L}.{rest}` as one tensor
    `{prefix}{rest}` of a layer axis prepended (Megatron-Core's `torch_dist`: TransformerBlock's
    `sharded_state_dict` stacks homogeneous layers, `prepend_axis_num=1`); the others as they are.

    Raises InvalidCheckpoint when the layers of one name are not 0..n-1 or differ in shape."""
    stacked: dict[str, dict[int, Target]] = {}
    kept: dict[str, Target] = {}
    for key, target in targets.items():
        number, _, rest = key[len(prefix):].partition(".") if key.startswith(prefix) else ("", "", "")
        if number.isdecimal() and rest:
            stacked.setdefault(prefix + rest, {})[int(number)] = target
        else:
            kept[key] = target
    for name, layers in stacked.items():
        first = layers[min(layers)]
        if sorted(layers) != list(range(len(layers))) or any(t.shape != first.shape for t in layers.values()):
            shapes = {layer: list(t.shape) for layer, t in sorted(layers.items())}
            raise InvalidCheckpoint(f"{name}: layers {shapes} are not layers 0..n-1 of one shape; Megatron stacks them "
                                    "on one axis", code="config-mismatch")
        pieces: list[Piece] = []
        for layer in range(len(layers)):
            pieces.extend(_placed_in_layer(layers[layer], layer))
        kept[name] = Target(name, (len(layers), *first.shape), tuple(pieces), first.rule)
    return dict(sorted(kept.items()))


def _placed_in_layer(target: Target, layer: int) -> list[Piece]:
    """Return `target`'s pieces placed at layer `layer` of a layer-stacked tensor."""
    placed, row = [], 0
    zeros = (0,) * max(len(target.shape) - 1, 0)
    for piece in target.pieces:
        if piece.at is not None:  # with its `columns` or `rows` grid, if any
            placed.append(replace(piece, at=(layer, *piece.at)))
            continue
        rows = piece.box[1][len(piece.box[1]) - len(target.shape)] if target.shape else 1
        if piece.step != 1 or piece.transposed is not None:
            raise ValueError(f"{target.key}: a strided piece cannot be placed in a stacked layer")
        placed.append(Piece(piece.source, piece.box, at=(layer, row, *zeros) if target.shape else (layer,)))
        row += rows
    return placed
