"""`ckpttool import`: full model weights written as a DCP checkpoint for N FSDP2 ranks."""

from __future__ import annotations

import click

from ckpttool.cli.flags import checkpoint_dir, json_option, reads_source, write_options
from ckpttool.cli.running import reports_errors, show


@click.command(name="import")
@click.argument("src", type=checkpoint_dir)
@click.argument("dst", type=click.Path(file_okay=False, dir_okay=True))
@click.option("--world", "world_size", type=click.IntRange(1, 1 << 20), metavar="N", help="Target world size (FSDP2 ranks).  [required unless --mesh]")
@click.option("--mesh", metavar="R,S", help="HSDP target: R replicas x S shards (N = R*S); shards along dim 0 over S.")
@click.option("--prefix", default="model.", metavar="PREFIX", help="Nest every key under this prefix, as `dcp.save({'model': get_model_state_dict(model)})` does ('' for none).")
@write_options
@json_option("ckpttool.import/1")
@reads_source
@reports_errors
def import_(src: str, dst: str, world_size: int | None, mesh: str | None, prefix: str, as_json: bool, write,
            source) -> None:
    """Write full model weights (a .safetensors file, a Hub folder, a .pt) as a DCP checkpoint
    laid out for N FSDP2 ranks that dcp.load and `train_minimal --resume` read."""
    from ckpttool.commands.import_ import import_checkpoint
    from ckpttool.render.hub import import_document, import_text
    from ckpttool.render.text import problem_lines

    report = import_checkpoint(src, dst, world_size, mesh, prefix=prefix, write=write, source=source)
    show(import_document(report) if as_json else None, import_text(report), problem_lines(report.problems))
