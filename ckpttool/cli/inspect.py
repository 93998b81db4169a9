"""`ckpttool inspect`: what is in a checkpoint, from its metadata alone."""

from __future__ import annotations

import click

from ckpttool.cli.flags import (checkpoint_dir, json_option, model_prefix_option, reads_source, storage_option,
                                with_html_options)
from ckpttool.cli.running import reports_errors, show, write_shard_map


@click.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@json_option("ckpttool.inspect/1")
@click.option("--filter", "filters", multiple=True, metavar="GLOB", help="Only entries whose fqn matches (repeatable), e.g. 'model.layers.0.*'.")
@click.option("--chunks", is_flag=True, help="List every chunk: offsets, sizes, file, byte offset and length.")
@click.option("--by-file", is_flag=True, help="Bytes per data file (rank), split into model/optimizer/other.")
@with_html_options
@model_prefix_option
@storage_option
@reads_source
@reports_errors
def inspect(src: str, as_json: bool, filters: tuple[str, ...], chunks: bool, by_file: bool, html: str | None,
            force: bool, source) -> None:
    """Show what is in a checkpoint, reading only its metadata (no tensor bytes). SRC defaults
    to the current directory."""
    from ckpttool.commands.inspect import inspect as inspect_checkpoint
    from ckpttool.render.inspect import inspect_document, inspect_text

    if html is not None:
        from ckpttool.outputs import check_destination

        check_destination(html, force)
    report = inspect_checkpoint(src, filters, source)
    if html is not None:
        write_shard_map(html, force, report)
    if as_json:
        show(inspect_document(report), None)
    else:
        show(None, inspect_text(report, chunks=chunks, by_file=by_file))
