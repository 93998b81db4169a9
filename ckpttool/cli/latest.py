"""Print the path of the newest step of a run folder that is whole; exit 0 found, 1 none.

Whole is what `validate` checks without `--deep` (the metadata reads, every chunk lies in a
file of the right size); the steps are taken newest first by the step number in their names,
and older steps are not read. Made for resume scripts:
`python -m train_minimal ... --resume "$(ckpttool latest runs/x)"`.
"""

from __future__ import annotations

import sys

import click

from ckpttool.cli.flags import checkpoint_dir, follow_symlinks_option, json_option, reads_source, storage_option
from ckpttool.cli.running import reports_errors, show
from ckpttool.core.errors import EXIT_INVALID


@click.command()
@click.argument("run", type=checkpoint_dir)
@click.option("--deep", is_flag=True, help="Also read every byte of the steps looked at: decode each blob, check "
                                           "CRC-32, dtype and shape (validate --deep).")
@click.option("--numerics", is_flag=True, help="Also skip steps whose model tensors hold NaN or Inf (reads the "
                                               "model's bytes of the steps that are otherwise whole).")
@click.option("--model-prefix", metavar="PREFIX", default=None,
              help="With --numerics: where the model's state dict sits in the checkpoint, dotted (e.g. app.model; "
                   "'' for the top level).  [default: found from the structure]")
@follow_symlinks_option
@storage_option
@json_option("ckpttool.latest/1")
@reads_source
@reports_errors
def latest(run: str, deep: bool, numerics: bool, as_json: bool, source) -> None:
    """Print the path of the newest step of a run folder that is whole; exit 0 found, 1 none.
    Skipped steps are named on stderr, each with why."""
    from ckpttool.commands.latest import latest as latest_step
    from ckpttool.render.latest import latest_document, latest_failure, latest_notes, latest_text

    report = latest_step(run, deep=deep, numerics=numerics, source=source)
    if report.chosen is None:
        show(latest_document(report) if as_json else None, None, [f"error: [no-whole-step] {latest_failure(report)}"])
        sys.exit(EXIT_INVALID)
    show(latest_document(report) if as_json else None, latest_text(report), latest_notes(report))
