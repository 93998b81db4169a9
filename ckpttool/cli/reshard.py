"""`ckpttool reshard`: a DCP checkpoint rewritten for another world size."""

from __future__ import annotations

import click

from ckpttool.cli.flags import checkpoint_dir, json_option, model_prefix_option, reads_source, write_options
from ckpttool.cli.running import reports_errors, show


@click.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@click.argument("dst", required=False, type=click.Path(file_okay=False, dir_okay=True))
@click.option("--world", "world_size", type=click.IntRange(1, 1 << 20), metavar="N", help="Target world size (FSDP2 ranks).  [required unless --mesh]")
@click.option("--mesh", metavar="R,S", help="HSDP target: R replicas x S shards (N = R*S); shards along dim 0 over S.")
@click.option("--keep-whole", multiple=True, metavar="GLOB", help="Leave tensors whose fqn matches in one piece (repeatable), e.g. 'model.*.rope.freqs'.")
@click.option("--to", type=click.Choice(["transformers"]), default=None,
              help="A Megatron-Core torch_dist save as transformers' model and AdamW state, for set_state_dict into "
                   "a fully_shard model.  [default: keys as saved]")
@model_prefix_option
@write_options
@json_option("ckpttool.reshard/1")
@reads_source
@reports_errors
def reshard(src: str, dst: str | None, world_size: int | None, mesh: str | None, keep_whole: tuple[str, ...],
            to: str | None, as_json: bool, write, source) -> None:
    """Rewrite a DCP checkpoint for another world size: rank r's file holds what FSDP2 on N
    ranks owns. SRC defaults to the current directory, DST to SRC-world{N} beside SRC."""
    from ckpttool.commands.reshard import reshard as reshard_checkpoint
    from ckpttool.render.convert import default_destination_line, reshard_document, reshard_text
    from ckpttool.render.text import problem_lines

    report = reshard_checkpoint(src, dst, world_size, mesh, keep_whole=keep_whole, to=to, write=write,
                                source=source)
    notes = problem_lines(report.problems)
    if dst is None:
        notes.append(default_destination_line(report))
    show(reshard_document(report) if as_json else None, reshard_text(report), notes)
