"""`ckpttool diff`: two checkpoints compared entry by entry, or one against a manifest
(exit 0 same, 1 different, 2 could not compare)."""

from __future__ import annotations

import sys
from functools import wraps

import click

from ckpttool.cli.flags import (CheckpointLocation, follow_symlinks_option, json_option, model_prefix_option,
                                reads_source, storage_option)
from ckpttool.cli.running import byte_progress, reports_errors, show
from ckpttool.core.errors import CheckpointError


EXIT_DIFFERENT = 1  # cmp and diff: 0 same, 1 different, 2 could not compare
EXIT_COULD_NOT_COMPARE = 2


def cannot_compare_exits_2(command):
    """cmp/diff exit codes: 1 means "different", so anything that stops the comparison (any
    CheckpointError, whatever its usual exit code, or a bug) exits 2. Applied inside
    `reports_errors`, which still prints the error's one line with its own problem code."""

    @wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CheckpointError as error:
            error.exit_code = EXIT_COULD_NOT_COMPARE  # on this instance only
            raise
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception:  # a bug: its traceback, but never the exit code of "different"
            import traceback

            traceback.print_exc()
            sys.exit(EXIT_COULD_NOT_COMPARE)

    return run


@click.command()
@click.argument("a", type=CheckpointLocation(exists=True))
@click.argument("b", type=CheckpointLocation(exists=True))
@storage_option
@click.option("--normalize", is_flag=True, help="Match entries by model key, as consolidate names them: the model. subtree and wrapper names (_orig_mod., _fsdp_wrapped_module., module.) stripped on both sides.")
@click.option("--only", type=click.Choice(["model", "optimizer", "other"]), multiple=True, help="Compare only this group of entries (repeatable); a bare weights file is all model.  [default: all]")
@click.option("--filter", "filters", multiple=True, metavar="GLOB", help="Only entries whose fqn or key, on either side, matches (repeatable), e.g. '*.layers.0.*'.")
@click.option("--rename", "renames", multiple=True, metavar="REGEX=REPL", help="Rewrite the keys of both sides with re.sub (repeatable, in order).")
@click.option("--rename-a", "renames_a", multiple=True, metavar="REGEX=REPL", help="Rewrite A's keys only (after --rename).")
@click.option("--rename-b", "renames_b", multiple=True, metavar="REGEX=REPL", help="Rewrite B's keys only (after --rename).")
@click.option("--atol", type=float, help="Accept floating elements with |a - b| <= atol + rtol * |b|.  [default: bytes must match]")
@click.option("--rtol", type=float, help="Relative tolerance, with --atol (0 when only one is given).  [default: bytes must match]")
@click.option("--exact-names", is_flag=True, help="Match entries by their full names only, never by model view (a checkpoint against its consolidation is then all 'only in A/B').")
@click.option("--assets", type=click.Path(exists=True, file_okay=False), metavar="DIR", help="Folder with the model's config.json: a side that uses a framework's names (torchtitan, Megatron-Core) is compared as export converts it to transformers' names.")
@model_prefix_option
@click.option("--limit", default=20, type=click.IntRange(0), help="Differing entries listed in the text output (0: all).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@follow_symlinks_option
@json_option("ckpttool.diff/1")
@reads_source
@reports_errors
@cannot_compare_exits_2
def diff(a: str, b: str, normalize: bool, only: tuple[str, ...], filters: tuple[str, ...], renames: tuple[str, ...],
         renames_a: tuple[str, ...], renames_b: tuple[str, ...], atol: float | None, rtol: float | None,
         exact_names: bool, assets: str | None, as_json: bool, limit: int, quiet: bool, source) -> None:
    """Compare two checkpoints of any layouts and shardings, entry by entry and byte for byte.

    Exit 0 identical (or within --atol/--rtol), 1 different, 2 could not compare."""
    from ckpttool.commands.diff import diff as diff_checkpoints
    from ckpttool.commands.manifest import is_manifest_file
    from ckpttool.render.diff import diff_document, diff_notes, diff_text

    if is_manifest_file(a) or is_manifest_file(b):  # manifest (issue 34): `diff SRC FILE.json`
        compare_with_manifest(a, b, as_json, limit, quiet, source)
    report = diff_checkpoints(a, b, normalize=normalize, only=only, filters=filters, renames=renames,
                              renames_a=renames_a, renames_b=renames_b, atol=atol, rtol=rtol, exact_names=exact_names,
                              progress=byte_progress(quiet), source=source, assets=assets)
    show(diff_document(report) if as_json else None, diff_text(report, limit=limit), diff_notes(report))
    sys.exit(0 if report.same else EXIT_DIFFERENT)


def compare_with_manifest(a: str, b: str, as_json: bool, limit: int, quiet: bool, source) -> None:
    """`diff A B` where A or B is a manifest: hash the other side (a checkpoint) and compare, or
    compare two manifests; exit 0 same, 1 different (naming the first differing tensor)."""
    from ckpttool.commands.manifest import check, is_manifest_file
    from ckpttool.options import WriteOptions
    from ckpttool.render.manifest import manifest_check_document, manifest_check_text
    from ckpttool.render.text import problem_lines

    src, expected = (b, a) if is_manifest_file(a) and not is_manifest_file(b) else (a, b)
    result = check(src, expected, write=WriteOptions(progress=byte_progress(quiet)), source=source)
    show(manifest_check_document(result) if as_json else None, manifest_check_text(result, limit),
         problem_lines(result.problems))
    sys.exit(0 if result.same else EXIT_DIFFERENT)
