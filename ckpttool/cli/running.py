"""How every command runs and prints: a CheckpointError, or SIGINT, SIGTERM or SIGHUP, as one
line on stderr and its exit code; progress bars and notices on stderr; the text or `--json`
document on stdout (formatted by `render`); the shard-map page of `--html`."""

from __future__ import annotations

import contextlib
import sys
from functools import wraps
from typing import Sequence

import click

from ckpttool.core.errors import CheckpointError


def _shown(text) -> str:  # render.text.shown, imported only when there is something to show
    from ckpttool.render.text import shown

    return shown(text)


def print_notice(notice) -> None:
    """The CLI's `WriteOptions.notify`: each notice (a replaced file, a killed run's leftovers
    removed) as one line on stderr."""
    click.echo(_shown(notice), err=True)


@contextlib.contextmanager
def errors_reported():
    """Turn a CheckpointError into one line on stderr and its exit code (no traceback), and
    SIGINT, SIGTERM or SIGHUP into one line and 128 + the signal number (130, 143, 129)."""
    from ckpttool.outputs import signals

    try:
        yield
    except CheckpointError as error:
        click.echo(f"error: [{error.code}] {_shown(error)}", err=True)
        sys.exit(error.exit_code)
    except KeyboardInterrupt as interrupt:  # signals.Interrupted for each of the three signals
        interrupt = interrupt if isinstance(interrupt, signals.Interrupted) else signals.Interrupted()
        click.echo(f"{interrupt}; nothing was left half-written", err=True)
        sys.exit(interrupt.exit_code)


def reports_errors(command):
    """Run the command with `errors_reported`, signals turned into `Interrupted`."""

    @wraps(command)
    def run(*args, **kwargs):
        from ckpttool.outputs import signals  # when the command runs: `--help` never needs it

        with errors_reported(), signals.interruptible():
            return command(*args, **kwargs)

    return run


def byte_progress(quiet: bool):
    """Return a factory of tqdm bars counting bytes on stderr: only when stderr is a terminal
    (tqdm's own check, so logs get no bar fragments), never with --quiet."""

    def start(description: str, total: int):
        from tqdm import tqdm

        return tqdm(desc=description, total=total, unit="B", unit_scale=True, file=sys.stderr,
                    disable=True if quiet else None, leave=False, dynamic_ncols=True)

    return start


def show(document: dict | None, text: str | None, notes: Sequence[str] = ()) -> None:
    """Print `document` as JSON (when given) or `text`; `notes` go to stderr either way."""
    from ckpttool.render.text import emit_json, shown, terminal_text

    for line in notes:
        click.echo(shown(line), err=True)
    if document is not None:
        emit_json(document)
    elif text:
        click.echo(terminal_text(text))


def write_shard_map(html: str, force: bool, report, problems=(), validated: bool = False, path=None) -> None:
    """Write the shard-map page of an inspect report (None: metadata unreadable) and validate's
    problems to `html`, atomically; say so on stderr."""
    from ckpttool.render import shard_map
    from ckpttool.render.html import write_page, written_line

    built = shard_map.build(report, problems, path=path, validated=validated)
    size = write_page(built, html, force)
    click.echo(_shown(written_line(built, html, size)), err=True)
