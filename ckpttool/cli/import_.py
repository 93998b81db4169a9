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
@click.option("--to", "framework", type=click.Choice(["torchtitan", "megatron"]), default=None,
              help="Write the framework's own checkpoint of a Hub model (its names, by the family tables run backwards) "
                   "instead of the bundled trainer's layout.")
@click.option("--assets", type=click.Path(exists=True, file_okay=False), default=None, metavar="DIR",
              help="With --to: the folder holding the model's config.json (default: beside the weights).")
@click.option("--dtype", default=None, metavar="DTYPE",
              help="With --to: dequantise an FP8 or MXFP4 Hub model to this dtype on the way (bf16, fp32).")
@click.option("--prefix", default="model.", metavar="PREFIX", help="Nest every key under this prefix, as `dcp.save({'model': get_model_state_dict(model)})` does ('' for none).")
@write_options
@json_option("ckpttool.import/1")
@reads_source
@reports_errors
def import_(src: str, dst: str, world_size: int | None, mesh: str | None, framework: str | None,
            assets: str | None, dtype: str | None, prefix: str, as_json: bool, write, source) -> None:
    """Write full model weights (a .safetensors file, a Hub folder, a .pt) as a DCP checkpoint
    laid out for N FSDP2 ranks that dcp.load and `train_minimal --resume` read."""
    from ckpttool.render.hub import import_document, import_text
    from ckpttool.render.text import problem_lines

    if framework is not None:
        from ckpttool.commands.import_framework import import_to_framework
        from ckpttool.render.hub import framework_import_document, framework_import_text

        if mesh is not None:
            raise click.UsageError("--mesh is for the bundled trainer's layout; with --to give --world N")
        found = import_to_framework(src, dst, framework, world_size, assets=assets, dtype=dtype, write=write,
                                    source=source)
        show(framework_import_document(found) if as_json else None, framework_import_text(found),
             problem_lines(found.problems))
        return
    if assets is not None or dtype is not None:
        raise click.UsageError("--assets and --dtype go with --to torchtitan|megatron")
    from ckpttool.commands.import_ import import_checkpoint

    report = import_checkpoint(src, dst, world_size, mesh, prefix=prefix, write=write, source=source)
    show(import_document(report) if as_json else None, import_text(report), problem_lines(report.problems))
