"""What writing an output did beside the output itself, told to whoever listens (the CLI
prints each on stderr): a killed run's leftovers removed (`temps.StaleTemp`), an existing
file that `--force` replaced (`Replaced`).

Example:
    >>> with reporting(print):
    ...     consolidate("ckpt/step-100", "hub/", force=True)
    replaced hub/config.json, which was there before (--force)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

_listeners: list[Callable[[Any], None]] = []  # the callbacks of the `reporting` blocks this process is in


@dataclass(frozen=True)
class Replaced:
    """Files of a directory output, already there and not ckpttool's weights, index or
    metadata, that `--force` replaced with the files of the same name it writes."""

    directory: str
    names: tuple[str, ...]

    def __str__(self) -> str:
        shown = ", ".join(f"{self.directory.rstrip('/')}/{name}" for name in self.names)
        return f"replaced {shown}, which {'was' if len(self.names) == 1 else 'were'} there before (--force)"


@contextlib.contextmanager
def reporting(callback: Callable[[Any], None]) -> Iterator[None]:
    """Return a context in which every notice (a `StaleTemp` dealt with, a `Replaced`) is
    passed to `callback`."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


def tell(notice: Any) -> None:
    """Pass `notice` to the callback of every `reporting` block this process is in."""
    for listener in _listeners:
        listener(notice)
