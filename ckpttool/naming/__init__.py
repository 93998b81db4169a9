"""Framework names -> transformers names: one file per model family (families/), the one list
of them (`REGISTRY`, here), the engine that applies any family's table (engine.py),
transformers' fused-expert modules (fused.py) and Megatron-LM's saved arguments as a
config.json (megatron_config.py).

This module is what `inspect` imports for every model it finds: the registry (each family's
name, module and signature, as plain data), name patterns, and `candidates`, the families whose
signature a model's keys match. Only a model some family may name imports the engine and the
tables (`Family`, `Rule`, `Piece`, `Target`: what conversion needs), so the common model, named
by no framework, costs neither. The engine's names are served from here on first use
(`naming.convert`, `from ckpttool.naming import Family`); `family(name)` is one family's table
and `FAMILIES` every family's, most specific first.

A name pattern is literal text with placeholders, each a decimal number (`{L}` a layer, `{E}`
an expert, `{M}` an extra layer such as DeepSeek's MTP, `{N}` where the target numbers it). It
is split once into its literals and placeholders (no regex is compiled: a table is built, and a
signature checked, without compiling anything); matching a key is `startswith`/`endswith` and a
run of digits per placeholder, exactly what the regex `re.escape(pattern)` with each placeholder
as `(?P<X>\\d+)` would fullmatch: a placeholder is never followed by a digit or another
placeholder (refused when the pattern is built), so its run of digits, and where the next
literal starts, are forced.

Example:
    >>> candidates(["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight"])
    ['torchtitan llama3']
    >>> candidates(["model.embed.weight", "model.layers.0.fc1.weight"])
    []
    >>> Pattern("layers.{L}.moe.experts.w1").match("layers.12.moe.experts.w1")
    {'L': '12'}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Collection, Iterable

if TYPE_CHECKING:
    from ckpttool.naming.engine import (
        EXPERTS as EXPERTS, EXPERTS_HALVES as EXPERTS_HALVES, PERMUTE_K as PERMUTE_K, PERMUTE_Q as PERMUTE_Q,
        RENAME as RENAME, SPLIT_HALVES as SPLIT_HALVES, SPLIT_QKV as SPLIT_QKV, TRANSFORMS as TRANSFORMS,
        DENSE_BIAS_FROM_CONFIG as DENSE_BIAS_FROM_CONFIG, Apply as Apply, Architecture as Architecture,
        Family as Family, LeftOut as LeftOut, Made as Made, MegatronArgs as MegatronArgs, Piece as Piece, Rule as Rule,
        TIED_EMBEDDING as TIED_EMBEDDING, EXPERTS_TRANSPOSED as EXPERTS_TRANSPOSED,
        EXPERTS_INTERLEAVED_TRANSPOSED as EXPERTS_INTERLEAVED_TRANSPOSED, EXPERTS_INTERLEAVED as EXPERTS_INTERLEAVED,
        STACK_EXPERTS as STACK_EXPERTS,
        Target as Target, Transform as Transform, convert as convert, converted_checkpoint as converted_checkpoint,
        find_family as find_family, hf_names as hf_names, main_layer_count as main_layer_count,
        required_settings as required_settings, rotary_rows as rotary_rows, row_box as row_box,
    )

    FAMILIES: tuple[Family, ...]  # every family's table, served by __getattr__

# the engine's names, served by __getattr__ (the engine imported on first use)
ENGINE_NAMES = frozenset({
    "EXPERTS", "EXPERTS_HALVES", "PERMUTE_K", "PERMUTE_Q", "RENAME", "SPLIT_HALVES", "SPLIT_QKV", "TRANSFORMS",
    "DENSE_BIAS_FROM_CONFIG", "Apply", "Architecture", "Family", "LeftOut", "Made", "MegatronArgs", "Piece", "Rule", "Target",
    "TIED_EMBEDDING", "EXPERTS_TRANSPOSED", "EXPERTS_INTERLEAVED_TRANSPOSED", "EXPERTS_INTERLEAVED", "STACK_EXPERTS",
    "VOCAB_ROWS",
    "Transform", "convert", "converted_checkpoint", "find_family", "hf_names", "main_layer_count",
    "required_settings", "rotary_rows", "row_box",
})

PLACEHOLDERS = ("L", "E", "M", "N")


class Pattern:
    """A name pattern, split into `literals` (one more than `names`) around its placeholders
    when built, and never changed (a plain class: `inspect` builds the signatures' patterns, and
    a dataclass costs a millisecond to define at import)."""

    __slots__ = ("text", "literals", "names")

    def __init__(self, text: str) -> None:
        literals, names = _split(text)
        if any(not literal or literal[0].isdecimal() for literal in literals[1:-1]) or \
                (names and literals[-1][:1].isdecimal()) or len(set(names)) != len(names):
            raise ValueError(f"name pattern {text!r}: a placeholder followed by a digit or another "
                             "placeholder, or one used twice, is ambiguous")
        self.text, self.literals, self.names = text, literals, names

    def __repr__(self) -> str:
        return f"Pattern({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def match(self, key: str) -> dict[str, str] | None:
        """Return each placeholder's digits in `key` (empty: a literal name), or None when it does not match."""
        literals = self.literals
        if not self.names:
            return {} if key == literals[0] else None
        if not key.startswith(literals[0]) or not key.endswith(literals[-1]):
            return None  # most keys a table's other rules meet end here
        at, values = len(literals[0]), {}
        for name, literal in zip(self.names, literals[1:]):
            # the next literal starts where this run of digits ends (it does not start with a
            # digit), so it is its first occurrence: the digits are what lies before it
            end = key.find(literal, at) if literal else len(key)
            digits = key[at:end]
            if end < 0 or not digits.isdecimal():  # isdecimal: the Unicode digits (Nd) that `\d` takes
                return None
            values[name] = digits
            at = end + len(literal)
        return values if at == len(key) else None


def _split(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return the literals and placeholder names of a pattern (`{L}`, ...; other braces are text)."""
    literals: list[str] = []
    names: list[str] = []
    start = search = 0
    while (at := text.find("{", search)) >= 0:
        if text[at + 1:at + 2] in PLACEHOLDERS and text[at + 2:at + 3] == "}":
            literals.append(text[start:at])
            names.append(text[at + 1])
            start = search = at + 3
        else:
            search = at + 1
    literals.append(text[start:])
    return tuple(literals), tuple(names)


class Registered:
    """A family as the registry lists it: its name, its module in naming/families, its signature
    (a plain class: `inspect` imports this for every model, and a NamedTuple or dataclass costs
    more to define than the registry to read)."""

    __slots__ = ("name", "module", "signature")

    def __init__(self, name: str, module: str, signature: tuple[str, ...]) -> None:
        self.name, self.module, self.signature = name, module, signature

    def __repr__(self) -> str:
        return f"Registered({self.name!r}, {self.module!r}, {self.signature!r})"


# The families, most specific signature first: a checkpoint is its first match's, unless a
# config's `architectures` picks another of the matches (Megatron's three share their names).
# Each line states its family's name, its module in families/ and its signature again (the file
# is the family's; this copy lets `inspect` match signatures without importing any table, and
# tests/test_naming.py checks that the two agree).
_MEGATRON = ("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_qkv.weight")

REGISTRY: tuple[Registered, ...] = (
    Registered("torchtitan deepseek_v3", "torchtitan_deepseek_v3",
               ("tok_embeddings.weight", "layers.{L}.attention.wkv_a.weight")),
    # torchtitan before 0.3 (`attention.wq`): 0.2 qwen3 before 0.3 qwen3, whose signature it also meets
    Registered("torchtitan 0.2 qwen3", "torchtitan_v02_qwen3",
               ("tok_embeddings.weight", "layers.{L}.attention.q_norm.weight", "layers.{L}.attention.wq.weight")),
    Registered("torchtitan qwen3", "torchtitan_qwen3",
               ("tok_embeddings.weight", "layers.{L}.attention.q_norm.weight")),
    Registered("torchtitan llama3", "torchtitan_llama3",
               ("tok_embeddings.weight", "layers.{L}.attention.qkv_linear.wq.weight")),
    Registered("torchtitan 0.2 llama3", "torchtitan_v02_llama3",
               ("tok_embeddings.weight", "layers.{L}.attention.wq.weight")),
    Registered("megatron deepseek_v3", "megatron_deepseek_v3",
               ("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_kv_down_proj.weight")),
    Registered("megatron gpt_oss", "megatron_gpt_oss",
               ("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.core_attention.softmax_offset")),
    Registered("megatron gpt", "megatron_gpt", _MEGATRON),  # Megatron's three share the names: the config chooses
    Registered("megatron qwen moe", "megatron_qwen_moe", _MEGATRON),
    Registered("megatron mixtral", "megatron_mixtral", _MEGATRON),
    # Megatron-LM's legacy model as Megatron-DeepSpeed trains it: read, never written by `import --to megatron`
    # (its name does not start with "megatron ")
    Registered("megatron-deepspeed gpt", "megatron_legacy_gpt",
               ("language_model.embedding.word_embeddings.weight",
                "language_model.encoder.layers.{L}.self_attention.query_key_value.weight")),
)


def signature_matches(signature: Iterable[str], keys: Iterable[str], present: Collection[str]) -> bool:
    """True when every pattern of `signature` matches some key (`present`: the keys as a set)."""
    if any("{" not in pattern and pattern not in present for pattern in signature):
        return False  # a literal name missing: a set lookup, not a scan of a million keys
    patterns = [Pattern(pattern) for pattern in signature if "{" in pattern]
    return all(any(pattern.match(key) is not None for key in keys) for pattern in patterns)


def candidates(keys: Iterable[str]) -> list[str]:
    """Return the names of the families whose signature `keys` match, most specific first
    (empty: no framework's names; `find_family` then returns None for any config)."""
    keys = list(keys)
    present = set(keys)
    return [entry.name for entry in REGISTRY if signature_matches(entry.signature, keys, present)]


def family(name: str) -> Family:
    """Return the table of the family `name` (its module imported now); KeyError for an unknown name."""
    entry = next((entry for entry in REGISTRY if entry.name == name), None)
    if entry is None:
        raise KeyError(f"no model family {name!r}; the registry has {', '.join(e.name for e in REGISTRY)}")
    return _load(entry)


def _load(entry: Registered) -> Family:
    return importlib.import_module(f"{__name__}.families.{entry.module}").FAMILY


def dense_attention_biases() -> dict[Any, tuple[bool, bool] | None]:
    """Return model_type -> (q/k/v, o_proj) biases of every dense Llama-shaped architecture a
    family converts to (None: both as its config's `attention_bias` says): the model types
    export checks by its own table of shapes (`Architecture.dense_biases`)."""
    found: dict[Any, tuple[bool, bool] | None] = {}
    for entry in REGISTRY:
        for architecture in _load(entry).converts_to:
            biases = architecture.dense_biases
            if biases is not None:
                found.setdefault(architecture.model_type, None if isinstance(biases, str) else biases)
    return found


def __getattr__(name: str) -> Any:
    if name == "FAMILIES":  # every family's table, most specific first (the tables import the engine)
        return tuple(_load(entry) for entry in REGISTRY)
    if name in ENGINE_NAMES:
        from ckpttool.naming import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
