"""The model card (`README.md`) of an exported folder, as huggingface_hub's `ModelCard` writes it.

The card is YAML metadata (`ModelCardData`: library, tags) and a markdown body: parameter
count, dtype, the source checkpoint and its step, how the folder was produced, and the
tensors summarised with layer indices folded (`model.layers.*.mlp.up_proj.weight x 32`).
Nothing in it depends on the time or the machine, so the same export writes the same card.

Example:
    >>> text = model_card(CardFacts(source="runs/x/step-00000100", step=100, ...))
    >>> text.splitlines()[0]
    '---'
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

CARD_FILENAME = "README.md"  # huggingface_hub.constants.REPOCARD_NAME
LIBRARY_NAME = re.compile(r"[a-z][a-z0-9_-]*")  # transformers, peft, ...: YAML writes them bare
_LAYER_INDEX = re.compile(r"\.\d+\.")


@dataclass(frozen=True)
class CardTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class CardFacts:
    """What the card states about an export."""

    source: str
    layout: str
    step: int | None
    dtype: str
    parameters: int
    tensors: tuple[CardTensor, ...]
    files: tuple[tuple[str, int], ...]  # weight files: (name, bytes)
    command: str  # how it was produced, as a command line
    version: str  # ckpttool's
    architecture: str | None = None  # config.json's `architectures[0]`, when there is a config
    library: str | None = None  # "transformers" when config.json names a transformers architecture
    merged: str | None = None  # what --merge-adapter merged into the weights


def folded(tensors: tuple[CardTensor, ...]) -> list[tuple[str, str, str, int]]:
    """Return (key pattern, dtype, shape, count) rows: keys that differ only in a layer index
    (`.3.`) become one `.*.` row, in first-seen order."""
    counts: Counter = Counter()
    for tensor in tensors:
        shape = "x".join(map(str, tensor.shape)) or "scalar"
        counts[(_LAYER_INDEX.sub(".*.", tensor.key), tensor.dtype, shape)] += 1
    return [(pattern, dtype, shape, count) for (pattern, dtype, shape), count in counts.items()]


def model_card(facts: CardFacts) -> str:
    """Return the card's text: YAML front matter as `ModelCardData(library_name=...,
    tags=["ckpttool"]).to_yaml()` writes it (spelled out: importing huggingface_hub costs an
    export 0.4 s; tests check the two agree and that `ModelCard` parses it), then the body."""
    if facts.library is not None and not LIBRARY_NAME.fullmatch(facts.library):
        raise ValueError(f"library name {facts.library!r} is not a plain YAML scalar")
    front = (f"library_name: {facts.library}\n" if facts.library else "") + "tags:\n- ckpttool"
    step = f"step {facts.step}" if facts.step is not None else "step unknown"
    by_dtype: Counter = Counter()
    for tensor in facts.tensors:
        by_dtype[tensor.dtype] += tensor.nbytes
    lines = [
        f"# {facts.architecture or 'Model'} exported with ckpttool",
        "",
        f"- Parameters: {facts.parameters:,}",
        f"- Dtype: {facts.dtype} (" + ", ".join(f"{d}: {n:,} bytes" for d, n in sorted(by_dtype.items())) + ")",
        f"- Source checkpoint: `{facts.source}` ({facts.layout}), {step}",
        f"- Produced by: `{facts.command}` (ckpttool {facts.version}), a byte-exact streaming copy of the "
        "checkpoint's model weights (cast only where a dtype was asked for)"
        + (f"; then {facts.merged}, as PEFT's merge_and_unload computes it" if facts.merged else ""),
        "",
        "## Files",
        "",
        "| file | bytes |",
        "|---|---:|",
        *(f"| {name} | {size:,} |" for name, size in facts.files),
        "",
        f"## Tensors ({len(facts.tensors)}; layer indices folded as `*`)",
        "",
        "| key | dtype | shape | count |",
        "|---|---|---|---:|",
        *(f"| `{pattern}` | {dtype} | {shape} | {count} |" for pattern, dtype, shape, count in folded(facts.tensors)),
        "",
    ]
    return f"---\n{front}\n---\n\n" + "\n".join(lines)
