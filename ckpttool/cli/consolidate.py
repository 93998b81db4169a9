"""`ckpttool consolidate`: a sharded checkpoint as one full state dict."""

from __future__ import annotations

import click

from ckpttool.cli.flags import (MERGE_HELP, adapter_name, adapter_options, checkpoint_dir, json_option,
                                lora_options, model_prefix_option, reads_source, write_options)
from ckpttool.cli.running import reports_errors, show


@click.command()
@click.argument("src", type=checkpoint_dir)
@click.argument("out", type=click.Path(dir_okay=True, file_okay=True))
@click.option("--all", "everything", is_flag=True, help="Export every entry (optimizer state, scheduler, step, ...) under its full name, nested as saved; python objects need a .pt OUT.")
@click.option("--filter", "filters", multiple=True, metavar="GLOB", help="Only entries whose checkpoint fqn or output key matches (repeatable), e.g. 'layers.0.*'.")
@click.option("--keep-keys", is_flag=True, help="Keep keys as saved: do not strip _fsdp_wrapped_module., _orig_mod., _checkpoint_wrapped_module. and a leading module.")
@click.option("--rename", "renames", multiple=True, metavar="REGEX=REPL", help="Rewrite output keys with re.sub (repeatable, in order); two keys becoming one is an error.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Cast floating tensors to this dtype (integer and bool tensors are never cast).  [default: keep]")
@click.option("--dtype-map", multiple=True, metavar="GLOB=DTYPE", help="Per-key dtype, first match wins over --dtype (repeatable), e.g. '*norm*=fp32'.")
@click.option("--drop-tied", is_flag=True, help="Write one copy of tied weights (e.g. lm_head.weight == embed.weight), as the Hub expects.")
@click.option("--max-shard-size", metavar="SIZE", help="Largest shard of a sharded (directory) output, decimal like huggingface_hub.  [default: 5GB]")
@click.option("--merge-adapter", "merge_adapter", is_flag=False, flag_value="", default=None, metavar="[NAME]", callback=adapter_name, help=MERGE_HELP)
@lora_options
@model_prefix_option
@write_options
@json_option("ckpttool.consolidate/1")
@reads_source
@reports_errors
def consolidate(src: str, out: str, everything: bool, filters: tuple[str, ...], keep_keys: bool,
                renames: tuple[str, ...], dtype: str | None, dtype_map: tuple[str, ...], drop_tied: bool,
                max_shard_size: str | None, merge_adapter: str | None, lora_alpha, use_rslora, fan_in_fan_out,
                lora_dropout, base_model_name_or_path, as_json: bool, write, source) -> None:
    """Write a sharded checkpoint as one full state dict: OUT.safetensors, OUT.pt/.bin, or a
    directory of Hub-style safetensors shards with model.safetensors.index.json."""
    from ckpttool.commands.consolidate import consolidate as consolidate_checkpoint
    from ckpttool.render.convert import consolidate_document, consolidate_notes, consolidate_text
    from ckpttool.options import ConvertOptions

    convert = ConvertOptions(everything=everything, filters=filters, keep_keys=keep_keys, renames=renames, dtype=dtype,
                             dtype_map=dtype_map, drop_tied=drop_tied, max_shard_size=max_shard_size)
    merge = None if merge_adapter is None else adapter_options(merge_adapter, lora_alpha, use_rslora, fan_in_fan_out,
                                                               lora_dropout, base_model_name_or_path)
    report = consolidate_checkpoint(src, out, convert, write, source, merge)
    show(consolidate_document(report) if as_json else None, consolidate_text(report), consolidate_notes(report))
