"""`ckpttool validate`: is a checkpoint whole and consistent (exit 0 valid, 1 invalid)."""

from __future__ import annotations

import sys

import click

from ckpttool.cli.flags import (checkpoint_dir, follow_symlinks_option, json_option, reads_source, storage_option,
                                with_html_options)
from ckpttool.cli.running import reports_errors, show, write_shard_map
from ckpttool.core.errors import EXIT_INVALID, CheckpointError


@click.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@click.option("--deep", is_flag=True, help="Also read every byte: decode each blob, check CRC-32, dtype and shape, count NaN/Inf.")
@click.option("--numerics", is_flag=True, help="Also read every floating tensor: exit 1 naming each one that holds NaN or Inf (its first bad element, the counts); report all-zero tensors, subnormals and max |x| (--json: every tensor's figures). With --deep, one pass.")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(1, 64), help="Parallel reads of --numerics (without --deep).")
@click.option("--manifest", "manifest_file", metavar="FILE", help="Also hash every tensor and check it against this manifest (`ckpttool manifest`): exit 1 naming the first differing, missing or extra tensor.")  # manifest (issue 34)
@with_html_options
@follow_symlinks_option
@storage_option
@json_option("ckpttool.validate/1")
@reads_source
@reports_errors
def validate(src: str, deep: bool, numerics: bool, threads: int, manifest_file: str | None, html: str | None, force: bool,
             as_json: bool, source) -> None:
    """Check that a checkpoint is whole and consistent; exit 0 valid, 1 invalid. SRC defaults
    to the current directory."""
    from ckpttool.commands.validate import validate as validate_checkpoint
    from ckpttool.render.validate import validate_document, validate_text

    if html is not None:
        from ckpttool.outputs import check_destination

        check_destination(html, force)
    report = validate_checkpoint(src, deep=deep, source=source, manifest=manifest_file, numerics=numerics, threads=threads)
    if html is not None:  # the page marks the problems on the tensors the metadata holds, if it can be read
        from ckpttool.commands.inspect import inspect as inspect_checkpoint

        try:
            inspected = inspect_checkpoint(src, (), source)
        except CheckpointError:
            inspected = None
        write_shard_map(html, force, inspected, report.problems, validated=True, path=report.path)
    show(validate_document(report) if as_json else None, validate_text(report))
    if not report.valid:
        sys.exit(EXIT_INVALID)
