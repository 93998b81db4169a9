"""Framework names -> transformers names: the engine that applies a family's table (imported
through `ckpttool.naming`, which serves its names on first use).

A family (naming/families/*.py) is data: `Rule`s mapping transformers name patterns to the
framework's, each by a transform, the name of one entry of `TRANSFORMS`. The engine matches
every source key to one rule (or to the family's `ignored` patterns: buffers transformers has no
place for), and returns each transformers key as `Piece`s: boxes of source tensors laid end to
end in row-major order. Every transform is a function giving such lists of boxes, so the
planner turns a conversion into byte-range copies (plan.consolidate.plan_pieces) and no whole
tensor is ever held:

- RENAME: the source tensor as it is (one box);
- PERMUTE_Q / PERMUTE_K: the rows of each head reordered as transformers' rotary layout
  expects (torchtitan llama3 `_permute`: view(heads, head_dim / 2, 2, cols).transpose(1, 2)),
  two strided pieces per head (its even rows, then its odd ones: `Piece.step` 2), so one
  chunk per row of the view; heads from the config (num_attention_heads / num_key_value_heads);
- EXPERTS: grouped experts [E, ...] split on dim 0 into one key per expert (`{E}`);
- SPLIT_HALVES: rows split in two (Megatron's `linear_fc1` [gate; up] -> gate_proj, up_proj);
- EXPERTS_HALVES: both: grouped experts [E, 2F, D] (Megatron's SequentialMLP `linear_fc1`
  stacked on an experts axis), each expert's rows split into gate and up;
- SPLIT_QKV: rows un-interleaved per query group (Megatron's `linear_qkv`: each group's block
  is its q heads, then its k head, then its v head, `head_dim` rows each) into q, k, v;
- VOCAB_ROWS: the first `vocab_size` rows of Megatron's padded embedding and output layer (one
  row box; the padding Megatron adds up to make_vocab_size_divisible_by x TP left out).

GPT-OSS's experts, each expert's matrix transposed (a `columns` piece each: expert_columns.py):
EXPERTS_TRANSPOSED [E, R, C] -> [E, C, R] (`linear_fc2` -> `down_proj`); EXPERTS_INTERLEAVED_
TRANSPOSED [E, 2F, H] -> [E, H, 2F], [gate; up] rows interleaved (`linear_fc1` -> `gate_up_proj`);
EXPERTS_INTERLEAVED [E, 2F] interleaved (its bias). With STACK_EXPERTS (an expert placed in the
stacked tensor) they also take one source tensor per expert (`{E}` in the source): `convert`
gathers those (`Transform.gathers`), every expert of `num_local_experts` once.

A rule of a split names its targets in order, as a tuple. Each `Transform` states how many
targets it gives, the config fields it needs, and its inverse: the transform that undoes it
(transformers -> the framework: `import --to` runs the same tables backwards with them,
naming/backward.py INVERSES), or None when nothing can (backward.py refuses such a rule by name).

Placeholders: `{L}` a layer number, `{E}` an expert number, `{M}` an extra layer's number in the
source (DeepSeek's MTP layers), which the target numbers `{N}`: after the main layers. Pure:
names and shapes in, pieces out (`converted_checkpoint` then locates the pieces' bytes).

Example:
    >>> family = find_family(["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight", ...], FAMILIES)
    >>> convert(family, shapes, settings)["model.layers.0.self_attn.q_proj.weight"].shape
    (64, 64)
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Final, Iterable, Literal, Mapping, NamedTuple, cast

from ckpttool.core.checkpoint import Blob, Checkpoint, Chunk, Tensor, raw_range_transforms, rows_transposed_transforms
from ckpttool.core.errors import InvalidCheckpoint, UsageError, VocabularyMismatch
from ckpttool.core.geometry import Box, intersect, row_major_runs, slab_rows
from ckpttool.naming import Pattern, signature_matches
from ckpttool.naming.expert_columns import check_gathered, column_chunks
from ckpttool.naming.fused import FusedLayout

RENAME, PERMUTE_Q, PERMUTE_K, EXPERTS = "rename", "permute-q", "permute-k", "experts"
SPLIT_HALVES, SPLIT_QKV = "split-halves", "split-qkv"  # rows split into several targets (a tuple of names)
EXPERTS_HALVES = "experts-split-halves"  # grouped experts [E, 2F, D], each split in two (gate, up)
# the first `vocab_size` rows (config.json's) of an embedding or output layer whose rows Megatron
# pads to a multiple of make_vocab_size_divisible_by x TP: the padding rows are left out
VOCAB_ROWS = "vocab-rows"

# grouped experts whose every matrix transformers stores transposed (GPT-OSS), [gate; up] rows
# interleaved for the fused gate/up projection and its bias
EXPERTS_TRANSPOSED, EXPERTS_INTERLEAVED_TRANSPOSED = "experts-transposed", "experts-interleaved-transposed"
EXPERTS_INTERLEAVED = "experts-interleaved"
STACK_EXPERTS = "stack-experts"  # one expert's tensor (`{E}` in the source) at its index of the stacked target


TIED_EMBEDDING = "model.embed_tokens.weight"  # what transformers reads for a tied lm_head


class LeftOut(NamedTuple):
    """Why a source tensor is not written: the rule, whether a non-zero value changes the
    model's outputs, and for a tied head the source key whose bytes it must equal."""

    rule: str
    changes_forward: bool
    same_as: str | None = None
    glob: str = ""  # the --drop glob that names every tensor this rule leaves out


@dataclass(frozen=True)
class Rule:
    """transformers' name `hf` <- the framework's name `source`, by `transform` (a key of
    TRANSFORMS); a transform giving several tensors names them in order (`hf` a tuple).
    `targets` is `hf` as a tuple, `pattern` the source pattern split for matching."""

    hf: str | tuple[str, ...]
    source: str
    transform: str = RENAME
    targets: tuple[str, ...] = field(init=False, repr=False, compare=False)
    pattern: Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        targets = (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)
        transform = TRANSFORMS.get(self.transform)
        if transform is None or len(targets) != transform.targets:
            raise ValueError(f"rule {targets} <- {self.source}: {self.transform!r} is not a transform giving "
                             f"{len(targets)} tensors ({', '.join(f'{n}: {t.targets}' for n, t in TRANSFORMS.items())})")
        object.__setattr__(self, "targets", targets)  # derived once, when the table is built
        object.__setattr__(self, "pattern", Pattern(self.source))


@dataclass(frozen=True)
class MegatronArgs:
    """When Megatron-LM's saved arguments (common.pt `args`) mean an architecture, and what its
    config.json says beyond the arguments every model maps alike (naming/megatron_config.py):
    `moe` (num_experts set), `qk_layernorm` and `add_qkv_bias` choose it; `fields` are stated as
    they are (a tuple written as a JSON list); `moe_fields` name a config field after the MoE
    value it holds ("experts", "topk", "width": the experts' ffn size, "renormalize": top-k
    probabilities renormalised). An architecture with no "renormalize" field always
    renormalises (args asking otherwise are refused)."""

    moe: bool
    qk_layernorm: bool
    add_qkv_bias: bool
    fields: tuple[tuple[str, Any], ...] = ()
    moe_fields: tuple[tuple[str, str], ...] = ()


DENSE_BIAS_FROM_CONFIG: Final = "config"


@dataclass(frozen=True)
class Architecture:
    """A transformers architecture a family converts to, and what the family states about it.

    `logit_tolerance`: the largest |framework logits - transformers logits| its fixture allows
    (the same bytes, float32 sums in other orders; None: no fixture compares logits);
    `dense_biases`: a dense Llama-shaped decoder export checks by its own table
    (commands/export.expected_shapes), with these (q/k/v, o_proj) biases, or
    DENSE_BIAS_FROM_CONFIG (both as config.json's `attention_bias` says); None: checked against
    the model transformers itself builds; `megatron`: the Megatron-LM arguments that mean it;
    `fused`: transformers' fused-expert modules of it (naming/fused.py, for `load_into`)."""

    name: str
    model_type: str
    logit_tolerance: float | None = None
    dense_biases: tuple[bool, bool] | Literal["config"] | None = None
    megatron: MegatronArgs | None = None
    fused: FusedLayout | None = None


@dataclass(frozen=True)
class Made:
    """A framework tensor no transformers tensor makes, which `import` writes as the framework
    initialises it: `source` (its pattern) for each written tensor `like` matches, of the sizes
    of `like`'s dims `dims`, `dtype`, every element `fill` (torchtitan's MoE load-balancing
    buffers: zeros of [experts], one per router)."""

    source: str
    like: str
    dims: tuple[int, ...]
    dtype: str
    fill: float
    why: str


@dataclass(frozen=True)
class Family:
    """One framework's model family: how to recognise its checkpoints (`signature`: source
    patterns all present), the transformers architectures it converts to, its rules, the source
    patterns left out on purpose, and the source key dropped when embeddings are tied."""

    name: str
    signature: tuple[str, ...]
    converts_to: tuple[Architecture, ...]
    rules: tuple[Rule, ...]
    ignored: tuple[str, ...] = ()
    # ignored patterns whose tensors change the model's outputs unless they are zero (a router's
    # load-balancing expert bias, added to the scores before top-k): export refuses to leave a
    # non-zero one out unless --drop names it
    changes_forward: tuple[str, ...] = ()
    tied_head: str | None = "lm_head.weight"  # the source key left out under tie_word_embeddings
    # import (naming/backward.py): of several rules giving one transformers name, the source
    # patterns it writes (else the first), and the framework tensors it makes from nothing
    backward: tuple[str, ...] = ()
    made: tuple[Made, ...] = ()
    # the framework's state dict holds `tied_head` even when tied (torchtitan: the same
    # parameter under both names), so import writes the embedding's bytes under it too
    stores_tied_head: bool = False
    # transformers keys the framework's own import never reads, with why (DeepSeek's MTP layers
    # repeat the embedding and head, which the framework shares with the main model)
    hf_ignored: tuple[tuple[str, str], ...] = ()
    # (first literal, last literal, rule, pattern) of each rule, then (rule None) of each ignored
    # pattern, in order: derived once, when the table is built
    patterns: tuple[tuple[str, str, Rule | None, Pattern], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pairs = [*((rule, rule.pattern) for rule in self.rules), *((None, Pattern(text)) for text in self.ignored)]
        object.__setattr__(self, "patterns", tuple((pattern.literals[0], pattern.literals[-1], rule, pattern)
                                                   for rule, pattern in pairs))

    @property
    def architectures(self) -> tuple[str, ...]:
        """The names of the architectures it converts to (config.json `architectures`)."""
        return tuple(architecture.name for architecture in self.converts_to)

    @property
    def settings(self) -> tuple[str, ...]:
        """The config.json fields its transforms need."""
        return tuple(dict.fromkeys(name for rule in self.rules for name in TRANSFORMS[rule.transform].settings))

    def architecture(self, name: str) -> Architecture | None:
        """Return the architecture `name` (config.json `architectures`) it converts to, if it does."""
        return next((architecture for architecture in self.converts_to if architecture.name == name), None)

    def left_out(self, keys: Iterable[str], tied: bool) -> dict[str, LeftOut]:
        """Return source key -> why this table does not write it, for the keys of `keys` it
        leaves out: an ignored pattern (a buffer transformers has no place for, or one that
        `changes_forward` unless zero), or the tied head (the embedding stands for it)."""
        embedding = next((rule.source for rule in self.rules if rule.targets == (TIED_EMBEDDING,)), None)
        reasons: dict[str, LeftOut] = {}
        for key in keys:
            if tied and key == self.tied_head:
                reasons[key] = LeftOut("tie_word_embeddings: transformers uses the embedding", False, embedding, key)
                continue
            found = self.match(key)
            if found is not None and found[0] is None:
                pattern = next(text for text in self.ignored if Pattern(text).match(key) is not None)
                glob = pattern.replace("{L}", "*").replace("{E}", "*").replace("{M}", "*")
                reasons[key] = LeftOut(f"{self.name} leaves out {pattern}", pattern in self.changes_forward, None, glob)
        return reasons

    def match(self, key: str) -> tuple[Rule | None, dict[str, str]] | None:
        """Return (rule or None for an ignored key, its placeholders' values), or None: the
        first rule whose pattern matches, else the first ignored pattern."""
        for first, last, rule, pattern in self.patterns:
            if key.startswith(first) and key.endswith(last):  # most rules end here: no call
                values = pattern.match(key)
                if values is not None:
                    return rule, values
        return None


@dataclass(frozen=True)
class Piece:
    """A box of a source tensor, written row-major into its place in a target tensor. With a
    `step` above 1 its rows are every `step`-th row of the source from the box's first one
    (the box's first size counts the rows taken): a rotary head's even or odd rows."""

    source: str
    box: Box
    step: int = 1
    # where the box starts in the target (None: on the target's dim 0 after the pieces before
    # it). A placed box lines its dims up with the target's last ones, as many leading dims of
    # size 1 added or dropped as the target has more or fewer (an expert stacked on an axis)
    at: tuple[int, ...] | None = None
    # (X, Y): the box's rows (X * Y of them, `step` 1) as an X x Y grid of rows, written
    # transposed: target row y * X + x is box row x * Y + y (a rotary head in torchtitan's
    # order, naming.backward). One chunk, not one per row (ROWS_TRANSPOSED_TRANSFORM)
    transposed: tuple[int, int] | None = None
    # (X, Y), with `at`: the box [1, R, *C] (an expert, R = X * Y rows) as the target's [1, *C, R]:
    # target column y * X + x is box row x * Y + y (expert_columns.column_chunks)
    columns: tuple[int, int] | None = None
    # (X, Y), with `at`: its inverse (import): the box [1, R, C] (C = X * Y; [1, C]: R = 1) as the
    # target's [1, C, R]: target row y * X + x is box column x * Y + y (expert_columns.row_chunks)
    rows: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.box[1])


@dataclass(frozen=True)
class Target:
    """A transformers tensor made of `pieces` laid end to end, of `shape`."""

    key: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rule: Rule


# (rule, its target names filled in, source key, its shape, config, where) -> the targets
Apply = Callable[[Rule, tuple[str, ...], str, tuple[int, ...], Mapping[str, Any], str], list[Target]]


@dataclass(frozen=True)
class Transform:
    """How a rule's source tensor becomes transformers tensors: `apply` gives them as pieces of
    the source; `targets` how many names a rule of it has; `inverse` the transform that undoes
    it (None: none can); `per_expert`: one set of targets per expert on dim 0 (`{E}` in the
    names); `settings`: the config.json fields it needs."""

    apply: Apply
    targets: int
    inverse: str | None
    per_expert: bool = False
    settings: tuple[str, ...] = ()
    # a target made of several source tensors (one per expert): convert gathers their pieces
    gathers: bool = False


def _whole(shape: tuple[int, ...]) -> Box:
    return ((0,) * len(shape), shape)


def _rename(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
            where: str) -> list[Target]:
    return [Target(names[0], shape, (Piece(key, _whole(shape)),), rule)]


def _experts(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
             where: str) -> list[Target]:
    if len(shape) < 2:
        raise InvalidCheckpoint(f"{where}: {key}: grouped experts need [experts, ...], not {list(shape)}",
                                code="config-mismatch")
    inner = shape[1:]
    return [Target(names[0].replace("{E}", str(expert)), inner,
                   (Piece(key, ((expert,) + (0,) * len(inner), (1,) + inner)),), rule)
            for expert in range(shape[0])]


def _experts_halves(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...],
                    config: Mapping[str, Any], where: str) -> list[Target]:
    if len(shape) < 2 or shape[1] % 2:
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not grouped experts of two halves",
                                code="config-mismatch")
    half, rest = shape[1] // 2, tuple(shape[2:])
    return [Target(name.replace("{E}", str(expert)), (half, *rest),
                   (Piece(key, ((expert, part * half) + (0,) * len(rest), (1, half, *rest))),), rule)
            for expert in range(shape[0]) for part, name in enumerate(names)]


def _split_halves(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
                  where: str) -> list[Target]:
    rows = shape[0] if shape else 0
    if rows % 2:
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} does not split in two halves",
                                code="config-mismatch")
    half = rows // 2
    return [Target(name, (half, *shape[1:]), (Piece(key, row_box(shape, part * half, half)),), rule)
            for part, name in enumerate(names)]


def _split_qkv(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
               where: str) -> list[Target]:
    """Megatron's fused `linear_qkv` rows -> q, k, v (megatron-bridge QKVMapping): per query
    group, `heads / groups` q heads, then one k head, then one v head, `head_dim` rows each."""
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    rows = shape[0] if shape else 0
    head_dim = int(config.get("head_dim") or 0) or (rows // (heads + 2 * groups) if heads + 2 * groups else 0)
    if groups <= 0 or heads % groups or rows != (heads + 2 * groups) * head_dim or head_dim <= 0:
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not {heads} query heads and {groups} "
                                f"key/value groups of head_dim {head_dim} (the config's head counts disagree with the "
                                "weights)", code="config-mismatch")
    per_group = heads // groups
    block = (per_group + 2) * head_dim
    q = tuple(Piece(key, row_box(shape, g * block, per_group * head_dim)) for g in range(groups))
    k = tuple(Piece(key, row_box(shape, g * block + per_group * head_dim, head_dim)) for g in range(groups))
    v = tuple(Piece(key, row_box(shape, g * block + (per_group + 1) * head_dim, head_dim)) for g in range(groups))
    rest = tuple(shape[1:])
    return [Target(names[0], (heads * head_dim, *rest), q, rule), Target(names[1], (groups * head_dim, *rest), k, rule),
            Target(names[2], (groups * head_dim, *rest), v, rule)]


def _permuted(heads: int, rule: Rule, name: str, key: str, shape: tuple[int, ...], where: str) -> list[Target]:
    rows = shape[0] if shape else 0
    if len(shape) != 2 or heads <= 0 or rows % heads or (rows // heads) % 2:
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} does not split into {heads} heads of "
                                "even size (the config's head counts disagree with the weights)",
                                code="config-mismatch")
    head_dim = rows // heads  # output row (h, a, b) is source row (h, b, a): rotary_rows
    return [Target(name, shape, tuple(Piece(key, ((h * head_dim + a, 0), (head_dim // 2, shape[1])), step=2)
                                      for h in range(heads) for a in range(2)), rule)]


def _permute_q(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
               where: str) -> list[Target]:
    return _permuted(int(config["num_attention_heads"]), rule, names[0], key, shape, where)


def _permute_k(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
               where: str) -> list[Target]:
    heads = int(config["num_attention_heads"])
    return _permuted(int(config.get("num_key_value_heads") or heads), rule, names[0], key, shape, where)


def _vocab_rows(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
                where: str) -> list[Target]:
    """The first `vocab_size` rows (the config's) of a vocabulary-padded tensor, as one row box
    (NeMo's exporter: nemo/lightning/io/state.py `TransformFns.prune_padding`, `embedding[:vocab_size]`);
    all of them when the config states no smaller vocabulary. A vocabulary larger than the rows
    is refused: the weights cannot hold it."""
    rows = shape[0] if shape else 0
    vocab = config.get("vocab_size")
    if vocab is None or vocab == rows:
        return [Target(names[0], shape, (Piece(key, _whole(shape)),), rule)]
    if type(vocab) is not int or not 0 < vocab < rows:
        raise VocabularyMismatch(f"{where}: {names[0]} is made of {key}, which holds {rows} vocabulary rows (shape "
                                 f"{list(shape)}); the config's vocab_size {vocab!r} is not between 1 and {rows}",
                                 names[0], key, rows, vocab)
    return [Target(names[0], (vocab, *shape[1:]), (Piece(key, row_box(shape, 0, vocab)),), rule)]


def _experts_as_columns(interleaved: bool) -> Apply:
    """The apply of EXPERTS_TRANSPOSED (`interleaved` False) or EXPERTS_INTERLEAVED[_TRANSPOSED]:
    grouped experts [E, R, *C] -> [E, *C, R], each expert one `columns` piece; interleaved, the
    rows [first half; second half] become the columns first[0], second[0], first[1], ..."""

    def apply(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
              where: str) -> list[Target]:
        if "{E}" in rule.source:  # one expert's tensor [R, *C]
            return _stacked_expert(rule, names[0], key, shape, config, where, interleaved)
        if len(shape) not in (2, 3) or (interleaved and shape[1] % 2) or (not interleaved and len(shape) != 3):
            wanted = "[experts, 2F] or [experts, 2F, D]" if interleaved else "[experts, R, C]"
            raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not grouped experts {wanted}",
                                    code="config-mismatch")
        experts, rows, rest = shape[0], shape[1], tuple(shape[2:])
        grid = (2, rows // 2) if interleaved else (1, rows)
        pieces = tuple(Piece(key, ((expert, 0, *(0,) * len(rest)), (1, rows, *rest)), at=(expert, 0, *(0,) * len(rest)),
                             columns=grid) for expert in range(experts))
        return [Target(names[0], (experts, *rest, rows), pieces, rule)]

    return apply


def _stacked_expert(rule: Rule, name: str, key: str, shape: tuple[int, ...], config: Mapping[str, Any], where: str,
                    interleaved: bool | None) -> list[Target]:
    """The stacked target [experts, ...] holding the one expert `key` is (its number the rule's
    `{E}`), as a `columns` piece ([R, *C] -> [*C, R]; `interleaved` None: as it is, placed)."""
    values = rule.pattern.match(key) or {}
    rows, experts = shape[0] if shape else 0, config.get("num_local_experts")
    expert = int(values.get("E", -1))
    if type(experts) is not int or not 0 <= expert < experts or (interleaved is not None and (
            len(shape) not in (1, 2) or (interleaved and rows % 2))):
        raise InvalidCheckpoint(f"{where}: {key} of shape {list(shape)} is not one of num_local_experts={experts!r} "
                                "experts of this table", code="config-mismatch")
    if interleaved is None:
        return [Target(name, (experts, *shape), (Piece(key, _whole(shape), at=(expert, *(0,) * len(shape))),), rule)]
    rest = tuple(shape[1:])
    grid = (2, rows // 2) if interleaved else (1, rows)
    piece = Piece(key, _whole(shape), at=(expert, *(0,) * len(shape)), columns=grid)
    return [Target(name, (experts, *rest, rows), (piece,), rule)]


def _stack_experts(rule: Rule, names: tuple[str, ...], key: str, shape: tuple[int, ...], config: Mapping[str, Any],
                   where: str) -> list[Target]:
    return _stacked_expert(rule, names[0], key, shape, config, where, None)


_HEADS = ("num_attention_heads",)
_EXPERT_COUNT = ("num_local_experts",)  # the stacked target's size, when one source tensor is one expert
# every transform a rule may name, and the inverse import runs (naming/backward.py INVERSES)
TRANSFORMS: Mapping[str, Transform] = MappingProxyType({
    RENAME: Transform(_rename, 1, inverse=RENAME),
    PERMUTE_Q: Transform(_permute_q, 1, inverse="unpermute-q", settings=_HEADS),
    PERMUTE_K: Transform(_permute_k, 1, inverse="unpermute-k", settings=_HEADS),
    EXPERTS: Transform(_experts, 1, inverse="stack-experts", per_expert=True),
    SPLIT_HALVES: Transform(_split_halves, 2, inverse="join-halves"),
    EXPERTS_HALVES: Transform(_experts_halves, 2, inverse="stack-experts-join-halves", per_expert=True),
    SPLIT_QKV: Transform(_split_qkv, 3, inverse="join-qkv", settings=_HEADS),
    # GPT-OSS's experts: import writes them stacked, each expert's matrix transposed back (backward.py)
    EXPERTS_TRANSPOSED: Transform(_experts_as_columns(False), 1, inverse="stack-experts-transposed",
                                  settings=_EXPERT_COUNT, gathers=True),
    EXPERTS_INTERLEAVED_TRANSPOSED: Transform(_experts_as_columns(True), 1, inverse="stack-experts-uninterleaved-"
                                              "transposed", settings=_EXPERT_COUNT, gathers=True),
    EXPERTS_INTERLEAVED: Transform(_experts_as_columns(True), 1, inverse="stack-experts-uninterleaved",
                                   settings=_EXPERT_COUNT, gathers=True),
    STACK_EXPERTS: Transform(_stack_experts, 1, inverse=None, settings=_EXPERT_COUNT, gathers=True),
    # import writes transformers' rows as they are (no padding added): rename
    VOCAB_ROWS: Transform(_vocab_rows, 1, inverse=RENAME),
})


_LAYER_NUMBER = re.compile(r"^(?:decoder\.)?layers\.(\d+)\.")  # torchtitan's `layers.N.`, Megatron's `decoder.layers.N.`


def main_layer_count(keys: Iterable[str]) -> int:
    """Return how many main layers the source keys number (`layers.N.`, Megatron's
    `decoder.layers.N.`): where `{N}` (an extra layer such as DeepSeek's MTP, `{M}` in the
    source) starts counting."""
    numbers = [int(found.group(1)) for key in keys if (found := _LAYER_NUMBER.match(key))]
    return max(numbers) + 1 if numbers else 0


def _target_names(rule: Rule, values: Mapping[str, str], main_layers: int) -> tuple[str, ...]:
    """Return the rule's targets with the matched placeholders filled in ({N}: extra layer M after the main ones)."""
    return tuple(_target_name(pattern, values, main_layers) for pattern in rule.targets)


def _target_name(pattern: str, values: Mapping[str, str], main_layers: int) -> str:
    name = pattern.replace("{L}", values.get("L", ""))
    if "E" in values:  # experts stored one by one: the source names the expert
        name = name.replace("{E}", values["E"])
    if "M" in values:
        name = name.replace("{N}", str(int(values["M"]) + main_layers))
    return name


def find_family(keys: Iterable[str], families: Iterable[Family], config: Mapping[str, Any] | None = None,
                where: str = "") -> Family | None:
    """Return the family whose signature patterns all match some key (None: no framework's
    names, the keys are transformers' own), the one converting to the config's architecture
    when several frameworks' families share the names. InvalidCheckpoint (`config-mismatch`)
    when the config names an architecture the checkpoint's family does not convert to."""
    keys = list(keys)
    present = set(keys)
    candidates = [family for family in families if signature_matches(family.signature, keys, present)]
    if not candidates:
        return None
    architectures = (config or {}).get("architectures") or []
    if not architectures:  # families that share names (Megatron's): the first whose rules take every key
        if len(candidates) > 1:
            return next((family for family in candidates if all(family.match(key) for key in keys)), candidates[0])
        return candidates[0]
    for family in candidates:
        if any(name in family.architectures for name in architectures):
            return family
    names = sorted({name for family in candidates for name in family.architectures})
    raise InvalidCheckpoint(f"{where}: the weights are a {candidates[0].name} model, which converts to "
                            f"{' or '.join(names)}; the config names {architectures[0]} (wrong --assets?)",
                            code="config-mismatch")


def required_settings(family: Family, config: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """Return the config fields the family's transforms need; UsageError (exit 2) naming the
    missing ones and --assets when there is no config that has them."""
    config = config or {}
    missing = [name for name in family.settings if name not in config]
    if missing:
        raise UsageError(f"{where}: converting {family.name} to transformers names needs {', '.join(missing)} "
                         "from the model's config.json; pass --assets DIR with the transformers config.json")
    return {name: config[name] for name in family.settings}


def convert(family: Family, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], where: str,
            ) -> dict[str, Target]:
    """Return transformers key -> Target for source keys -> shapes, in source order (experts
    expanded in place). Raises InvalidCheckpoint (`config-mismatch`) naming a source key no rule
    takes, or one whose shape does not fit its transform."""
    tied = bool(config.get("tie_word_embeddings", False))
    main_layers = main_layer_count(shapes)
    targets: dict[str, Target] = {}
    for key, shape in shapes.items():
        found = family.match(key)
        if found is None:
            raise InvalidCheckpoint(f"{where}: {key} (shape {list(shape)}) has no transformers name in the "
                                    f"{family.name} table; export with --rename rules, or keep the framework's "
                                    "names with `ckpttool consolidate`", code="config-mismatch")
        rule, values = found
        if rule is None or (tied and key == family.tied_head):
            continue
        names = _target_names(rule, values, main_layers)
        for target in TRANSFORMS[rule.transform].apply(rule, names, key, tuple(shape), config, where):
            if target.key in targets and TRANSFORMS[rule.transform].gathers and targets[target.key].shape == \
                    target.shape and TRANSFORMS[targets[target.key].rule.transform].gathers:  # one expert of several
                target = replace(target, pieces=targets[target.key].pieces + target.pieces)
            elif target.key in targets:
                raise InvalidCheckpoint(f"{where}: {target.key} is made from both {targets[target.key].pieces[0].source} "
                                        f"and {key}", code="config-mismatch")
            targets[target.key] = target
    for target in targets.values():
        if TRANSFORMS[target.rule.transform].gathers:
            check_gathered(target, where)
    return targets


def row_box(shape: tuple[int, ...], start: int, count: int) -> Box:
    """Return the box of rows [start, start + count) of dim 0 of a tensor of `shape`."""
    return ((start,) + (0,) * (len(shape) - 1), (count, *shape[1:]))


def rotary_rows(rows: int, heads: int) -> list[int]:
    """Return, for each output row, the source row of torchtitan llama3's `_permute`
    (`w.view(heads, rows / heads / 2, 2, cols).transpose(1, 2).reshape(rows, cols)`): output
    row (h, a, b) is source row (h, b, a).

    Example:
        >>> rotary_rows(8, 2)
        [0, 2, 1, 3, 4, 6, 5, 7]
    """
    head_dim = rows // heads
    half = head_dim // 2
    return [h * head_dim + b * 2 + a for h in range(heads) for a in range(2) for b in range(half)]


def hf_names(family: Family, key: str, shape: tuple[int, ...], main_layers: int = 0) -> tuple[str, ...]:
    """Return the transformers names `key` becomes under `family` (none: left out or unknown);
    needs no config (what inspect shows). `main_layers`: `main_layer_count` of the source keys."""
    found = family.match(key)
    if found is None:
        return ()
    rule, values = found
    if rule is None:
        return ()
    names = _target_names(rule, values, main_layers)
    if TRANSFORMS[rule.transform].per_expert:
        return tuple(name.replace("{E}", str(expert)) for expert in range(shape[0] if shape else 0) for name in names)
    return names


def converted_checkpoint(checkpoint: Checkpoint, targets: Mapping[str, Target],
                         located: Mapping[str, Mapping[int, Any]], kept: Mapping[str, str] = MappingProxyType({})
                         ) -> Checkpoint:
    """Return `checkpoint` as transformers names it: a Checkpoint whose tensors are `targets`
    (their pieces naming source fqns), each chunk a raw byte range of a source chunk (no byte is
    read or copied here), plus the `kept` entries (key -> fqn: python objects) as they are. Every
    command reads it like any checkpoint: consolidate copies its ranges, diff compares them,
    `ckpttool.open` reads them. `located`: where each source chunk's raw bytes are
    (locating.locate_chunks); a chunk that must be decoded (zstd) is refused (UsageError)."""
    tensors: dict[str, Tensor] = {}
    sources: dict[str, _Source] = {}
    for key, target in targets.items():
        chunks: list[Chunk] = []
        row = 0
        for piece in target.pieces:
            source = sources.get(piece.source)
            if source is None:
                source = sources[piece.source] = _Source(checkpoint, piece.source, located[piece.source])
            if piece.columns is not None or piece.rows is not None:
                chunks.extend(source.as_columns(piece, key))
                continue
            if piece.at is not None:
                chunks.extend(source.placed(piece, piece.at, key))
                continue
            chunks.extend(source.chunks(piece, row, target.shape, key))
            row += piece.box[1][len(piece.box[1]) - len(target.shape)] if target.shape else 1
        dtype = checkpoint.tensors[target.pieces[0].source].dtype
        tensors[key] = Tensor(key, dtype, target.shape, tuple(sorted(chunks, key=lambda c: c.offsets)))
    objects = {key: replace(checkpoint.objects[fqn], fqn=key) for key, fqn in kept.items() if fqn in checkpoint.objects}
    return replace(checkpoint, tensors=dict(sorted(tensors.items())), objects=dict(sorted(objects.items())),
                   nesting={}, orphan_blobs=(), model_prefix="")


class _Source:
    """A source tensor's distinct chunks and where their raw bytes are, looked up once for all
    the pieces cut from it. When its chunks are dim-0 slabs tiling it (FSDP's), a piece of
    whole rows is found by bisecting the slabs' first rows, one chunk per slab it meets (per
    row of a strided piece), without intersecting boxes."""

    def __init__(self, checkpoint: Checkpoint, fqn: str, located: Mapping[int, Any]):
        from ckpttool.plan import unique_chunks  # converting only: inspect names a family without it

        self.checkpoint, self.fqn, self.located = checkpoint, fqn, located
        self.tensor = tensor = checkpoint.tensors[fqn]
        self.indices = unique_chunks(tensor)
        boxes = [(tensor.chunks[index].offsets, tensor.chunks[index].sizes) for index in self.indices]
        slabs = [slab_rows(tensor.shape, box) for box in boxes]
        self.row_bytes = math.prod(tensor.shape[1:]) * tensor.itemsize if tensor.shape else 0
        self.slabs: list[tuple[int, int, int]] | None = None  # (first row, rows, chunk index), by first row
        whole = [slab for slab in slabs if slab is not None]
        if self.row_bytes and slabs and len(whole) == len(slabs):  # every chunk a dim-0 slab
            ordered = sorted((first, count, index) for (first, count), index in zip(whole, self.indices))
            starts = [first for first, _, _ in ordered]
            if starts == [0] + [first + count for first, count, _ in ordered[:-1]] and \
                    ordered[-1][0] + ordered[-1][1] == tensor.shape[0]:
                self.slabs, self.firsts = ordered, starts

    def chunks(self, piece: Piece, row: int, shape: tuple[int, ...], key: str) -> list[Chunk]:
        """Return the target chunks that hold `piece` (placed from target row `row` of a target of `shape`)."""
        rows = slab_rows(self.tensor.shape, piece.box) if len(piece.box[1]) == len(shape) else None
        if piece.transposed is not None:
            return self._transposed(piece, rows, row, shape, key)
        if self.slabs is None or rows is None:
            if piece.step == 1:
                return self._chunks_of_box(piece.box, row, len(shape), key)
            return [chunk for number, box in enumerate(_strided_rows(piece))
                    for chunk in self._chunks_of_box(box, row + number, len(shape), key)]
        first, count = rows
        rest = self.tensor.shape[1:]
        zeros = (0,) * len(rest)
        row_bytes, step = self.row_bytes, piece.step
        found = []
        if step == 1:
            stop = first + count
            at = first
            while at < stop:
                slab_first, slab_stop, raw = self._slab(at, key)
                take = min(stop, slab_stop) - at
                blob = Blob(raw.file, raw.offset + (at - slab_first) * row_bytes, take * row_bytes, _RAW)
                found.append(Chunk((row + at - first, *zeros), (take, *rest), blob))
                at += take
            return found
        sizes = (1, *rest)
        slab_first = slab_stop = -1
        for number in range(count):
            at = first + number * step
            if not slab_first <= at < slab_stop:
                slab_first, slab_stop, raw = self._slab(at, key)
                file, offset = raw.file, raw.offset - slab_first * row_bytes
            found.append(Chunk((row + number, *zeros), sizes, Blob(file, offset + at * row_bytes, row_bytes, _RAW)))
        return found

    def _transposed(self, piece: Piece, rows: tuple[int, int] | None, row: int, shape: tuple[int, ...],
                    key: str) -> list[Chunk]:
        """Return the target chunks of a `transposed` piece: one, its rows' raw bytes with the
        grid as a transform, when the box is whole rows of one source slab; else one per row."""
        x, y = cast(tuple[int, int], piece.transposed)
        (first, *others), (count, *sizes) = piece.box
        if x * y != count or piece.step != 1:
            raise ValueError(f"{key}: a transposed piece of {count} rows is not a {x} x {y} grid of rows")
        if self.slabs is not None and rows is not None:
            slab_first, slab_stop, raw = self._slab(first, key)
            if first + count <= slab_stop:
                blob = Blob(raw.file, raw.offset + (first - slab_first) * self.row_bytes, count * self.row_bytes,
                            rows_transposed_transforms((x, y)))
                return [Chunk((row, *(0,) * (len(shape) - 1)), (count, *shape[1:]), blob)]
        return [chunk for number in range(count)
                for chunk in self._chunks_of_box(((first + number % x * y + number // x, *others), (1, *sizes)),
                                                 row + number, len(shape), key)]

    def placed(self, piece: Piece, at: tuple[int, ...], key: str) -> list[Chunk]:
        """Return the target chunks that hold the source `piece.box` placed at `at` in the target."""
        tensor, box = self.tensor, piece.box
        extra = len(at) - len(box[0])  # target dims beyond the box's (> 0: leading 1s; < 0: leading dims dropped)
        chunks = []
        for index in self.indices:
            chunk = tensor.chunks[index]
            region = intersect(box, (chunk.offsets, chunk.sizes))
            if region is None or not math.prod(region[1]):
                continue
            raw = self._raw(index, key)
            for start, length, sub in _region_runs((chunk.offsets, chunk.sizes), region, tensor.itemsize):
                relative = [offset - first for offset, first in zip(sub[0], box[0])]
                sizes = list(sub[1])
                if extra >= 0:
                    relative, sizes = [0] * extra + relative, [1] * extra + sizes
                else:
                    relative, sizes = relative[-extra:], sizes[-extra:]
                offsets = tuple(first + offset for first, offset in zip(at, relative))
                chunks.append(Chunk(offsets, tuple(sizes), Blob(raw.file, raw.offset + start, length, _RAW)))
        return chunks

    def as_columns(self, piece: Piece, key: str) -> list[Chunk]:
        """Return the target chunks of a `columns` or `rows` piece (expert_columns.column_chunks)."""
        return column_chunks(self.tensor, self.indices, lambda index: self._raw(index, key), piece,
                             f"{self.checkpoint.path}: {key}")

    def _slab(self, at: int, key: str) -> tuple[int, int, Any]:
        """Return (first row, end row, raw bytes) of the slab holding source row `at`."""
        assert self.slabs is not None  # chunks bisects only a tensor tiled by slabs
        first, count, index = self.slabs[bisect.bisect_right(self.firsts, at) - 1]
        return first, first + count, self._raw(index, key)

    def _raw(self, index: int, key: str) -> Any:
        raw = self.located[index]
        if raw is None:
            chunk = self.tensor.chunks[index]
            raise UsageError(f"{self.checkpoint.path}: {self.fqn} chunk at {list(chunk.offsets)} must be decoded "
                             f"(a compressed blob) to make {key}; consolidate the checkpoint first, then export that")
        return raw

    def _chunks_of_box(self, box: Box, row: int, ndim: int, key: str) -> list[Chunk]:
        """Return the target chunks that hold the source `box` (placed from target row `row`):
        one per run of each source chunk it meets."""
        tensor = self.tensor
        drop = len(box[1]) - ndim  # leading dims of the source box that the target squeezes (an expert's index)
        chunks = []
        for index in self.indices:
            chunk = tensor.chunks[index]
            region = intersect(box, (chunk.offsets, chunk.sizes))
            if region is None or not math.prod(region[1]):
                continue
            raw = self._raw(index, key)
            for start, length, sub in _region_runs((chunk.offsets, chunk.sizes), region, tensor.itemsize):
                offsets = (row + sub[0][drop] - box[0][drop], *sub[0][drop + 1:]) if ndim else ()
                sizes = tuple(sub[1][drop:])
                chunks.append(Chunk(offsets, sizes, Blob(raw.file, raw.offset + start, length, _RAW)))
        return chunks


_RAW = raw_range_transforms()


def _strided_rows(piece: Piece) -> list[Box]:
    """Return the one-row boxes of a strided piece, in its order."""
    (first, *others), (count, *sizes) = piece.box
    return [((first + number * piece.step, *others), (1, *sizes)) for number in range(count)]


def _region_runs(box: Box, region: Box, itemsize: int) -> list[tuple[int, int, Box]]:
    """Return (byte offset in the chunk, length, sub-region) that make up `region` of a chunk:
    the region whole when its bytes are contiguous in the chunk, else one sub-region per run
    (split on its first dimension, recursively)."""
    runs = row_major_runs(box, region, itemsize)
    if len(runs) == 1:
        return [(runs[0][0], runs[0][1], region)]
    offsets, sizes = region
    first = next(d for d, size in enumerate(sizes) if size > 1)
    found = []
    for step in range(sizes[first]):
        sub = ((*offsets[:first], offsets[first] + step, *offsets[first + 1:]), (*sizes[:first], 1, *sizes[first + 1:]))
        found.extend(_region_runs(box, sub, itemsize))
    return found
