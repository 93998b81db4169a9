"""`ckpttool export`: a checkpoint as the folder transformers and the Hub load (or, with
--adapter, the folder PEFT loads)."""

from __future__ import annotations

import click

from ckpttool.cli.flags import (MERGE_HELP, adapter_name, adapter_options, checkpoint_dir, json_option,
                                lora_options, model_prefix_option, reads_source, write_options)
from ckpttool.cli.running import reports_errors, show


@click.command()
@click.argument("src", type=checkpoint_dir)
@click.argument("outdir", type=click.Path(file_okay=False, dir_okay=True))
@click.option("--assets", type=click.Path(exists=True, file_okay=False), metavar="DIR", help="Folder whose config.json, generation_config.json, tokenizer and chat-template files are copied; the weights are checked against its config (and model.safetensors.index.json).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Cast floating tensors to this dtype; config.json's torch_dtype says what was written.  [default: keep]")
@click.option("--max-shard-size", metavar="SIZE", help="Largest shard, decimal like huggingface_hub, at most 50GB (the Hub's per-file limit).  [default: 5GB]")
@click.option("--drop-tied", is_flag=True, help="Write one copy of tied weights even when no config says tie_word_embeddings (a tied config always does).")
@click.option("--rename", "renames", multiple=True, metavar="REGEX=REPL", help="Rewrite output keys with re.sub (repeatable, in order), before the config check.")
@click.option("--drop", "drops", multiple=True, metavar="GLOB", help="Leave out the framework tensors matching GLOB that transformers has no place for although they change the outputs (a non-zero router expert bias; a tied head unlike the embedding), which export otherwise refuses (repeatable), e.g. '*.expert_bias*'.")
@click.option("--adapter", is_flag=False, flag_value="", default=None, metavar="[NAME]", callback=adapter_name, help="Write the LoRA adapter NAME (default: the only one) as the folder PeftModel.from_pretrained loads: adapter_model.safetensors + adapter_config.json.")
@click.option("--merge-adapter", "merge_adapter", is_flag=False, flag_value="", default=None, metavar="[NAME]", callback=adapter_name, help=MERGE_HELP)
@click.option("--quantize", type=click.Choice(["fp8"]), help="Write the projection weights (*_proj) as fine-grained FP8 with float32 weight_scale_inv (DeepSeek's weight_quant), and the matching quantization_config.  [default: keep]")
@click.option("--block", default="128x128", show_default=True, metavar="RxC", help="--quantize fp8's block size.")
@click.option("--vocab-size", type=click.IntRange(min=1), metavar="N", help="The tokenizer's vocabulary: write the first N rows of a Megatron or NeMo save's padded embedding and output layer, and config.json vocab_size N.  [default: what the save or --assets states; else every row, said in the output]")
@click.option("--manifest", "with_manifest", is_flag=True, help="Also write manifest.json: the SHA-256 of every tensor written (`ckpttool manifest` of the folder), in the same atomic commit.")  # manifest (issue 34)
@lora_options
@model_prefix_option
@write_options
@json_option("ckpttool.export/1")
@reads_source
@reports_errors
def export(src: str, outdir: str, assets: str | None, dtype: str | None, max_shard_size: str | None, drop_tied: bool,
           renames: tuple[str, ...], drops: tuple[str, ...], adapter: str | None, merge_adapter: str | None, quantize: str | None, block: str,
           vocab_size: int | None, with_manifest: bool, lora_alpha, use_rslora, fan_in_fan_out, lora_dropout, base_model_name_or_path, as_json: bool, write,
           source) -> None:
    """Write a checkpoint as a folder transformers and the Hugging Face Hub load: safetensors
    shards (or model.safetensors), config.json, tokenizer files and a README.md model card;
    with --adapter, a LoRA checkpoint's adapter as the folder PEFT loads."""
    from ckpttool.commands.export import export as export_checkpoint
    from ckpttool.options import ConvertOptions
    from ckpttool.render.hub import export_document, export_notes, export_text

    if adapter is not None and merge_adapter is not None:
        raise click.UsageError("--adapter writes the adapter, --merge-adapter the merged model: choose one")
    lora = (adapter_options(adapter if adapter is not None else merge_adapter, lora_alpha, use_rslora, fan_in_fan_out,
                            lora_dropout, base_model_name_or_path))
    if adapter is not None:
        if dtype or max_shard_size or drop_tied or renames or with_manifest or vocab_size is not None:
            raise click.UsageError("--adapter writes PEFT's own file: --dtype, --max-shard-size, --drop-tied, "
                                   "--rename, --vocab-size and --manifest do not apply")
        from ckpttool.commands.export_adapter import export_adapter
        from ckpttool.render.lora import adapter_document, adapter_text

        written = export_adapter(src, outdir, assets, lora, write, source)
        show(adapter_document(written) if as_json else None, adapter_text(written))
        return
    rows, _, cols = block.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        raise click.UsageError(f"--block {block!r}: expected ROWSxCOLS, e.g. 128x128")
    convert = ConvertOptions(renames=renames, dtype=dtype, drop_tied=drop_tied, max_shard_size=max_shard_size,
                             quantize=quantize, block=(int(rows), int(cols)), drops=drops,
                             vocab_size=vocab_size)
    report = export_checkpoint(src, outdir, assets, convert, write, source, lora if merge_adapter is not None else None,
                               manifest=with_manifest)
    show(export_document(report) if as_json else None, export_text(report), export_notes(report))
