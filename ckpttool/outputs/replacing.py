"""What `--force` replaces in an existing directory output: ckpttool's own files, never the
user's.

A Hub folder, an export or a DCP checkpoint is often a directory the user keeps other files
in (config.json, tokenizer files, a README, notes). Writing over it with `--force` replaces
the files ckpttool writes now, removes ckpttool's own files of an earlier run (weights,
their index, a DCP checkpoint's `.metadata` and `*.distcp`: e.g. the shards of a larger run)
and keeps everything else. A file that is not one of those but has the name of a file being
written (export's config.json or README.md) is replaced, and named (`notices.Replaced`).

Example:
    >>> replacement(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ...              "model.safetensors.index.json", "config.json", "notes.txt"],
    ...             ["model.safetensors", "config.json", "README.md"])
    Replacement(keep=('notes.txt',), replaced=('config.json',))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ckpttool.formats.hub import FILENAME_PATTERN, INDEX_SUFFIX
from ckpttool.formats.dcp import DATA_FILE_SUFFIX, METADATA_FILENAME

# model.safetensors and huggingface_hub's shards, model-00001-of-00003.safetensors
_WEIGHT_FILE = re.compile(re.escape(FILENAME_PATTERN).replace(re.escape("{suffix}"), r"(-\d+-of-\d+)?"))
_INDEX_FILENAME = FILENAME_PATTERN.format(suffix="") + INDEX_SUFFIX


def is_ours(name: str) -> bool:
    """True for a name (relative to the output directory) that ckpttool's directory outputs
    write: weights, their index, `.metadata`, `*.distcp`; such a file left from an earlier run
    is removed by `--force`.

    Example:
        >>> [is_ours(n) for n in ("model-00002-of-00003.safetensors", ".metadata", "config.json")]
        [True, True, False]
    """
    return "/" not in name and bool(
        _WEIGHT_FILE.fullmatch(name) or name in (_INDEX_FILENAME, METADATA_FILENAME) or name.endswith(DATA_FILE_SUFFIX)
    )


@dataclass(frozen=True)
class Replacement:
    """Of an existing output's entries: those the new output keeps (`keep`: not ckpttool's,
    not written again) and those it writes again that were not ckpttool's (`replaced`).
    Every other old entry goes."""

    keep: tuple[str, ...]
    replaced: tuple[str, ...]


def replacement(old: Iterable[str], new: Iterable[str]) -> Replacement:
    """Return what happens to the entries `old` (names relative to the output directory) of
    an existing output when the new output writing `new` replaces it with `--force`."""
    written = set(new)
    old = sorted(set(old))
    return Replacement(
        keep=tuple(name for name in old if name not in written and not is_ours(name)),
        replaced=tuple(name for name in old if name in written and not is_ours(name)),
    )
