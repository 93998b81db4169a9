"""What writing an output did beside the output itself, passed to the `notify` callback the
writer was given (`WriteOptions.notify`; the CLI's prints each on stderr): a killed run's
leftovers removed (`temps.StaleTemp`), an existing file that `--force` replaced (`Replaced`).

Example:
    >>> consolidate("ckpt/step-100", "hub/", write=WriteOptions(force=True, notify=print))
    replaced hub/config.json, which was there before (--force)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Notify = Callable[[Any], None]  # told each notice (a `StaleTemp`, a `Replaced`)


@dataclass(frozen=True)
class Replaced:
    """Files of a directory output, already there and not ckpttool's weights, index or
    metadata, that `--force` replaced with the files of the same name it writes."""

    directory: str
    names: tuple[str, ...]

    def __str__(self) -> str:
        shown = ", ".join(f"{self.directory.rstrip('/')}/{name}" for name in self.names)
        return f"replaced {shown}, which {'was' if len(self.names) == 1 else 'were'} there before (--force)"


def ignore(notice: Any) -> None:
    """The default `notify`: the notice goes untold (a library caller passes its own)."""
