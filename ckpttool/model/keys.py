"""Output key names: which checkpoint entries are exported, and under what name.

A DCP fqn such as `model.layers.0._fsdp_wrapped_module.fc1.weight` becomes the key
`layers.0.fc1.weight`, the name `model.state_dict()` of the unwrapped model has. Rules, in
order: select (the model's entries by default, as `model_view.find_model` finds them, or
everything with `--all`), normalise wrapper
names away (unless `--keep-keys`), apply each `--rename REGEX=REPL`, then `--filter GLOB`.

Example:
    >>> rules = KeyRules(renames=(Rename.parse(r"^layers\\.(\\d+)=h.\\1"),))
    >>> output_keys(["model.layers.0._orig_mod.fc1.weight"], rules,
    ...             model_keys={"model.layers.0._orig_mod.fc1.weight": "layers.0._orig_mod.fc1.weight"})
    {'h.0.fc1.weight': 'model.layers.0._orig_mod.fc1.weight'}
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from ckpttool.core.errors import KeyCollision, UsageError
# the wrapper names normalised away: model_view's (finding the model needs them; `inspect` imports no key rules)
from ckpttool.model.model_view import DDP_PREFIX as DDP_PREFIX, WRAPPER_COMPONENTS as WRAPPER_COMPONENTS
from ckpttool.model.model_view import normalise as normalise


@dataclass(frozen=True)
class Rename:
    """One `--rename 'REGEX=REPL'` rule (re.sub on the whole key)."""

    pattern: str
    replacement: str

    @classmethod
    def parse(cls, text: str) -> "Rename":
        """Return the rule from `REGEX=REPL`; the first `=` not inside the regex splits it."""
        pattern, separator, replacement = text.partition("=")
        if not separator or not pattern:
            raise UsageError(f"--rename {text!r}: expected 'REGEX=REPLACEMENT'")
        try:
            re.compile(pattern)
        except re.error as error:
            raise UsageError(f"--rename {text!r}: bad regular expression ({error})") from None
        return cls(pattern, replacement)

    def apply(self, key: str) -> str:
        try:
            return re.sub(self.pattern, self.replacement, key)
        except (re.error, IndexError) as error:
            raise UsageError(f"--rename {self.pattern}={self.replacement}: {error}") from None


@dataclass(frozen=True)
class KeyRules:
    """How checkpoint fqns become output keys."""

    everything: bool = False  # --all: every entry under its full fqn; else the model subtree
    normalise: bool = True  # strip wrapper components (--keep-keys turns this off)
    renames: tuple[Rename, ...] = ()
    filters: tuple[str, ...] = ()  # globs; an entry is kept when its fqn or its key matches one


def output_keys(fqns: Iterable[str], rules: KeyRules, model_keys: Mapping[str, str]) -> dict[str, str]:
    """Return {output key: fqn} for the selected entries, sorted by output key: every fqn
    with `rules.everything`, else the model's entries (`model_keys`, fqn -> its key in the
    model's state dict, from `model_view.find_model`).

    Raises KeyCollision naming both fqns when two entries end up with one key.
    """
    chosen: dict[str, str] = {}
    for fqn in sorted(fqns):
        key = fqn if rules.everything else model_keys.get(fqn)
        if key is None:
            continue
        if rules.normalise:
            key = normalise(key)
        for rename in rules.renames:
            key = rename.apply(key)
        if rules.filters and not any(
            fnmatch.fnmatchcase(fqn, glob) or fnmatch.fnmatchcase(key, glob) for glob in rules.filters
        ):
            continue
        if not key:
            raise KeyCollision(f"{fqn}: the key rules leave an empty name; adjust --rename")
        if key in chosen:
            raise KeyCollision(
                f"{chosen[key]} and {fqn} both become {key!r}; adjust --rename, or pass "
                "--keep-keys if the normalisation caused it"
            )
        chosen[key] = fqn
    return dict(sorted(chosen.items()))


def match_dtype(key: str, dtype_map: tuple[tuple[str, str], ...], default: str | None) -> str | None:
    """Return the target dtype of `key`: the first `--dtype-map GLOB=DTYPE` that matches,
    else `default` (None = keep)."""
    for glob, dtype in dtype_map:
        if fnmatch.fnmatchcase(key, glob):
            return dtype
    return default
