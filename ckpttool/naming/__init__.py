"""Framework names -> transformers names: which framework family names a model (here), the
engine that applies a family's table (engine.py) and one table per framework (torchtitan.py,
megatron.py).

This module is what `inspect` imports for every model it finds: each family's signature (the
source name patterns that all appear in its checkpoints) as plain data, and `candidates`, the
families whose signature a model's keys match. Only a model some family may name imports the
engine and the tables (`Family`, `Rule`, `Piece`, `Target`: what conversion needs), so the
common model, named by no framework, costs neither. The engine's names are served from here
on first use (`naming.convert`, `from ckpttool.naming import Family`), and `FAMILIES` is every
family's table, most specific first.

Example:
    >>> candidates(["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight"])
    ['torchtitan llama3']
    >>> candidates(["model.embed.weight", "model.layers.0.fc1.weight"])
    []
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Collection, Iterable

if TYPE_CHECKING:
    from ckpttool.naming.engine import (
        EXPERTS as EXPERTS, EXPERTS_HALVES as EXPERTS_HALVES, PERMUTE_K as PERMUTE_K, PERMUTE_Q as PERMUTE_Q,
        RENAME as RENAME, SPLIT_HALVES as SPLIT_HALVES, SPLIT_QKV as SPLIT_QKV, Family as Family, Piece as Piece,
        Rule as Rule, Target as Target, convert as convert, converted_checkpoint as converted_checkpoint,
        find_family as find_family, hf_names as hf_names, main_layer_count as main_layer_count,
        required_settings as required_settings, rotary_rows as rotary_rows, row_box as row_box,
    )

# the engine's names, served by __getattr__ (the engine imported on first use)
ENGINE_NAMES = frozenset({
    "EXPERTS", "EXPERTS_HALVES", "PERMUTE_K", "PERMUTE_Q", "RENAME", "SPLIT_HALVES", "SPLIT_QKV", "Family", "Piece",
    "Rule", "Target", "convert", "converted_checkpoint", "find_family", "hf_names", "main_layer_count",
    "required_settings", "rotary_rows", "row_box",
})

_MEGATRON = ("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_qkv.weight")

# family name -> its signature: the tables' `Family.signature` (each table takes its own from here)
SIGNATURES: dict[str, tuple[str, ...]] = {
    "torchtitan deepseek_v3": ("tok_embeddings.weight", "layers.{L}.attention.wkv_a.weight"),
    "torchtitan qwen3": ("tok_embeddings.weight", "layers.{L}.attention.q_norm.weight"),
    "torchtitan llama3": ("tok_embeddings.weight", "layers.{L}.attention.qkv_linear.wq.weight"),
    "megatron gpt": _MEGATRON,  # Megatron's three share the names: the config's architectures choose
    "megatron qwen moe": _MEGATRON,
    "megatron mixtral": _MEGATRON,
}


def pattern_regex(pattern: str) -> re.Pattern:
    """Return the regex of a name pattern: `{L}`, `{E}`, `{M}` each a number (a named group)."""
    text = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(text.replace(r"\{M\}", r"(?P<M>\d+)"))


def signature_matches(signature: Iterable[str], keys: Iterable[str], present: Collection[str]) -> bool:
    """True when every pattern of `signature` matches some key (`present`: the keys as a set)."""
    if any("{" not in pattern and pattern not in present for pattern in signature):
        return False  # a literal name missing: a set lookup, not a scan of a million keys
    regexes = [pattern_regex(pattern) for pattern in signature if "{" in pattern]
    return all(any(regex.fullmatch(key) for key in keys) for regex in regexes)


def candidates(keys: Iterable[str]) -> list[str]:
    """Return the names of the families whose signature `keys` match, most specific first
    (empty: no framework's names; `find_family` then returns None for any config)."""
    keys = list(keys)
    present = set(keys)
    return [name for name, signature in SIGNATURES.items() if signature_matches(signature, keys, present)]


def _families() -> tuple[Family, ...]:
    from ckpttool.naming import megatron, torchtitan

    return torchtitan.FAMILIES + megatron.FAMILIES


def __getattr__(name: str) -> Any:
    if name == "FAMILIES":  # every family's table, most specific first (the tables import the engine)
        return _families()
    if name in ENGINE_NAMES:
        from ckpttool.naming import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
