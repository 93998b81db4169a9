"""The `ckpttool` command line: each command parses, calls the library, renders.

Exit codes: 0 ok, 1 invalid or corrupt checkpoint (or a failed operation on one), 2 usage.
"""

from __future__ import annotations

import sys
from functools import wraps

import click

from ckpttool import __version__
from ckpttool.errors import EXIT_INVALID, CheckpointError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100, "show_default": True}


def reports_errors(command):
    """Turn a CheckpointError into one line on stderr and its exit code (no traceback)."""

    @wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CheckpointError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(error.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was left half-written", err=True)
            sys.exit(130)

    return run


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="ckpttool")
def main() -> None:
    """See inside, validate, reshard and consolidate PyTorch Distributed Checkpoints."""


checkpoint_dir = click.Path(file_okay=False, dir_okay=True, exists=True)

# -- inspect and validate commands --


@main.command()
@click.argument("src", type=checkpoint_dir)
@click.option("--json", "as_json", is_flag=True, help="Print the ckpttool.inspect/1 JSON document.")
@click.option("--filter", "filters", multiple=True, metavar="GLOB", help="Only entries whose fqn matches (repeatable), e.g. 'model.layers.0.*'.")
@click.option("--chunks", is_flag=True, help="List every chunk: offsets, sizes, file, byte offset and length.")
@click.option("--by-file", is_flag=True, help="Bytes per data file (rank), split into model/optimizer/other.")
@reports_errors
def inspect(src: str, as_json: bool, filters: tuple[str, ...], chunks: bool, by_file: bool) -> None:
    """Show what is in a checkpoint, reading only its metadata (no tensor bytes)."""
    from ckpttool import render
    from ckpttool.commands.inspect import inspect as inspect_checkpoint

    report = inspect_checkpoint(src, filters)
    if as_json:
        render.emit_json(render.inspect_document(report))
    else:
        click.echo(render.inspect_text(report, chunks=chunks, by_file=by_file))


@main.command()
@click.argument("src", type=checkpoint_dir)
@click.option("--deep", is_flag=True, help="Also read every byte: decode each blob, check CRC-32, dtype and shape, count NaN/Inf.")
@click.option("--json", "as_json", is_flag=True, help="Print the ckpttool.validate/1 JSON document.")
@reports_errors
def validate(src: str, deep: bool, as_json: bool) -> None:
    """Check that a checkpoint is whole and consistent; exit 0 valid, 1 invalid."""
    from ckpttool import render
    from ckpttool.commands.validate import validate as validate_checkpoint

    report = validate_checkpoint(src, deep=deep)
    if as_json:
        render.emit_json(render.validate_document(report))
    else:
        click.echo(render.validate_text(report))
    if not report.valid:
        sys.exit(EXIT_INVALID)

# -- consolidate command --

# -- reshard command --

# -- hub commands --
