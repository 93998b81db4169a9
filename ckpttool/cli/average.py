"""`ckpttool average`: the weighted average of the model tensors of k checkpoints."""

from __future__ import annotations

import click

from ckpttool.cli.flags import checkpoint_dir, json_option, model_prefix_option, reads_source, write_options
from ckpttool.cli.running import reports_errors, show


@click.command()
@click.argument("sources", nargs=-1, required=True, type=checkpoint_dir, metavar="SRC1 SRC2 [SRC3 ...]")
@click.argument("out", type=click.Path(dir_okay=True, file_okay=True))
@click.option("--weights", metavar="W1,W2,...", help="One weight per source, in order, read as float64.  [default: 1/k each]")
@click.option("--world", "world_size", type=click.IntRange(1, 1 << 20), metavar="N", help="Write OUT as a DCP checkpoint for N FSDP2 ranks (keys under model.).  [default: a state dict as OUT's name asks]")
@click.option("--max-shard-size", metavar="SIZE", help="Largest shard of a sharded (directory) output, decimal like huggingface_hub.  [default: 5GB]")
@model_prefix_option
@write_options
@json_option("ckpttool.average/1")
@reads_source
@reports_errors
def average(sources: tuple[str, ...], out: str, weights: str | None, world_size: int | None,
            max_shard_size: str | None, as_json: bool, write, source) -> None:
    """Write the weighted average of the model tensors of checkpoints of one model, any layouts and world sizes:
    OUT.safetensors, OUT.pt, a directory of Hub shards, or with --world N a DCP checkpoint. Each floating tensor is
    acc = w1*x1, then acc = acc + wi*xi in order, in float64, cast to its dtype as torch's .to casts; integer and
    bool tensors must be equal and are copied."""
    from ckpttool.commands.average import average as average_checkpoints
    from ckpttool.plan.average import parse_weights
    from ckpttool.render.average import average_document, average_notes, average_text

    given = parse_weights(weights) if weights is not None else None
    report = average_checkpoints(sources, out, given, world_size, max_shard_size, write, source)
    show(average_document(report) if as_json else None, average_text(report), average_notes(report))
