"""`ckpttool manifest`: the SHA-256, dtype and shape of every tensor (issue 34); `diff`
compares a checkpoint with one."""

from __future__ import annotations

import click

from ckpttool.cli.flags import (checkpoint_dir, follow_symlinks_option, model_prefix_option, reads_source,
                                storage_option)
from ckpttool.cli.running import byte_progress, print_notice, reports_errors, show


@click.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@click.option("-o", "--output", "out", metavar="FILE", help="Write the manifest to FILE (atomically) and print a summary line.  [default: the manifest on stdout]")
@click.option("--all", "everything", is_flag=True, help="Every tensor entry (optimizer state too) under its full name, not only the model's.")
@click.option("--files", is_flag=True, help="Also the SHA-256 and size of each data file (these depend on the layout; the tensors' do not).")
@click.option("--force", is_flag=True, help="Replace FILE if it exists.")
@click.option("--threads", default=4, type=click.IntRange(1, 64), help="Tensors hashed at once.")
@click.option("--max-memory", default="512MB", metavar="SIZE", help="Bound on read/assembly buffers in flight.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@model_prefix_option
@follow_symlinks_option
@storage_option
@reads_source
@reports_errors
def manifest(src: str, out: str | None, everything: bool, files: bool, force: bool, threads: int, max_memory: str,
             quiet: bool, source) -> None:
    """Write the SHA-256 of every tensor's bytes (row-major, as stored), its dtype and shape: the
    same for a checkpoint at any world size, its reshard, consolidation and Hub export."""
    from ckpttool.commands.manifest import manifest as manifest_of
    from ckpttool.options import WriteOptions
    from ckpttool.render.manifest import manifest_text
    from ckpttool.render.text import problem_lines, shown

    write = WriteOptions(force=force, threads=threads, max_memory=max_memory, progress=byte_progress(quiet),
                         notify=print_notice)
    report = manifest_of(src, out, everything=everything, files=files, write=write, source=source)
    if out is None:
        click.echo(report.manifest.to_json().decode("ascii"), nl=False)
        for line in manifest_text(report).splitlines():
            click.echo(shown(line), err=True)
    else:
        show(None, manifest_text(report), problem_lines(report.problems))
