"""Signals: SIGTERM and SIGHUP stop a run the way Ctrl-C does.

Under `interruptible()` (the CLI runs every command so) SIGINT, SIGTERM and SIGHUP raise
`Interrupted` in the main thread, so every atomic output being written removes its
temporary files on the way out; `deferred()` holds them over the few steps that must not
stop half-way (two renames, a remote commit).

Example:
    >>> with interruptible(), atomic_output("out/model.safetensors") as handle:
    ...     handle.write(header)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

INTERRUPT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)  # Ctrl-C; Slurm, Kubernetes and `timeout`; a closed terminal


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the run; raised in the main thread under
    `interruptible()`. `exit_code` is the shell's 128 + signal number.

    A KeyboardInterrupt, so that code which already cleans up after Ctrl-C does so for every
    signal, and no `except Exception` swallows it.
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


class _SignalState:
    """What the handlers know (a plain class: every command builds one at startup, and a
    dataclass's generated methods cost more to make than this whole module)."""

    __slots__ = ("installed", "raised", "deferring", "pending")

    def __init__(self, installed: bool = False) -> None:
        self.installed = installed
        self.raised = False  # an Interrupted is unwinding: later signals must not cut its cleanup short
        self.deferring = 0  # depth of `deferred` blocks
        self.pending = 0  # a signal that arrived while deferred


_signals = _SignalState()  # the process's signal handlers are global: so is what they know


def _on_signal(signum: int, frame: Any) -> None:
    if _signals.raised or _signals.deferring:
        _signals.pending = _signals.pending or signum
        return
    _signals.raised = True
    raise Interrupted(signum)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Return a context in which SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main
    thread, so every `atomic_*` block being written removes its temporary output.

    Only the first signal is raised; later ones are ignored while it unwinds, so the cleanup
    finishes (SIGKILL still stops the process: the next run removes what it left). Signals
    that are ignored (`nohup`) or have a handler of someone else's are left alone, and
    outside the main thread (where Python cannot handle signals) this does nothing. Handlers
    are restored on exit.
    """
    global _signals
    if _signals.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in INTERRUPT_SIGNALS:
        handler = signal.getsignal(signum)
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = handler
            signal.signal(signum, _on_signal)
    _signals = _SignalState(installed=True)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _signals = _SignalState()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold signals during a few steps that must not stop half-way (creating a temporary and
    noting it, two renames, a remote commit); a signal that arrived meanwhile is raised at
    the end."""
    _signals.deferring += 1
    try:
        yield
    finally:
        _signals.deferring -= 1
        if not _signals.deferring and _signals.pending and not _signals.raised:
            _signals.raised = True
            raise Interrupted(_signals.pending)
