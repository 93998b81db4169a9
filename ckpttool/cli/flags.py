"""The options several commands share, each declared once: the checkpoint argument's type,
--storage-option, --follow-symlinks, --model-prefix with --layout, --json, the writing commands'
options (`write_options`, given to the command as one `options.WriteOptions`), `--html`, and the
LoRA options of export and consolidate; `reads_source` builds the `SourceOptions` of the source
flags a command declares."""

from __future__ import annotations

import os
from functools import wraps

import click

from ckpttool.cli.running import byte_progress, errors_reported, print_notice


class CheckpointLocation(click.Path):
    """click.Path(exists=True) for local paths (`file://` URLs too); object-storage URLs
    (s3://, gs://, az://) pass as they are: reading them says what is missing."""

    def convert(self, value, param, ctx):
        from ckpttool.store import storage

        if isinstance(value, str) and storage.is_remote(value):
            return value
        return super().convert(str(storage.location(value)), param, ctx)


checkpoint_dir = CheckpointLocation(file_okay=True, dir_okay=True, exists=True)  # a directory, one file, or a URL


storage_option = click.option(
    "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option for s3://, gs://, az:// paths (repeatable), e.g. endpoint_url=http://host:9000; "
         "credentials also come from the backend's usual configuration (AWS_* variables).")


def json_option(schema: str):
    """The `--json` flag, naming the document it prints."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print the {schema} JSON document (see README).")


def model_prefix_option(command):
    """--model-prefix (where the model sits inside a checkpoint) and --layout (which checkpoint,
    where SRC holds two of one step)."""
    command = click.option(
        "--layout", metavar="LAYOUT", default=None,
        help="Where one step holds checkpoints of two layouts (a Hub model a trainer wrote beside its ZeRO save), "
             "read the one of this layout, e.g. hub-folder.  [default: the training save]")(command)
    return click.option(
        "--model-prefix", metavar="PREFIX", default=None,
        help="Where the model's state dict sits in the checkpoint, dotted (e.g. app.model; '' for the top level).  "
             "[default: found from the structure: the subtree the optimizer state names, else the one module tree]")(command)


follow_symlinks_option = click.option(
    "--follow-symlinks", is_flag=True, help="Read data files that are symlinks to places outside the checkpoint directory.")


def reads_source(command):
    """Give the command `source`, the `SourceOptions` of whichever of --follow-symlinks,
    --storage-option and --model-prefix it declares, built (and checked) once."""

    @wraps(command)
    def run(*args, **kwargs):
        from ckpttool.store import storage
        from ckpttool.source_options import SourceOptions  # not options.py: inspect and validate need no other

        with errors_reported():
            source = SourceOptions(
                follow_symlinks=kwargs.pop("follow_symlinks", False),
                storage_options=dict(storage.parse_option(value) for value in kwargs.pop("storage_options", ())),
                model_prefix=kwargs.pop("model_prefix", None),
                layout=kwargs.pop("layout", None),
            )
        return command(*args, source=source, **kwargs)

    return run


def write_options(command):
    """Options every writing command shares: --force --dry-run --verify --threads --max-memory
    --quiet (given to the command as `write`, one `WriteOptions`), --follow-symlinks and
    --storage-option (for `reads_source`)."""

    @wraps(command)
    def run(*args, max_memory, threads, force, dry_run, verify, quiet, **kwargs):
        from ckpttool.options import WriteOptions

        with errors_reported():
            write = WriteOptions(force=force, dry_run=dry_run, verify=verify, threads=threads, max_memory=max_memory,
                                 progress=byte_progress(quiet), notify=print_notice)
        return command(*args, write=write, **kwargs)

    for option in reversed((
        click.option("--max-memory", default="512MB", metavar="SIZE", help="Bound on read/convert buffers in flight."),
        click.option("--threads", default=4, type=click.IntRange(1, 64), help="Parallel reads/writes."),
        click.option("--force", is_flag=True, help="Replace the output if it exists."),
        click.option("--dry-run", is_flag=True, help="Show what would be written; write nothing."),
        click.option("--verify", is_flag=True, help="Read the output back and compare it with the source before keeping it."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
        follow_symlinks_option,
        storage_option,
    )):
        run = option(run)
    return run


# --- the shard-map page (issue 34): `--html FILE` on inspect and validate ----------------------
html_options = (
    click.option("--html", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Also write the shard map: one self-contained HTML page (bytes by group, module and file; "
                      "the boxes each rank and file holds, per tensor)."),
    click.option("--force", is_flag=True, help="Replace the --html file if it exists."),
)


def with_html_options(command):
    for option in reversed(html_options):
        command = option(command)
    return command


def lora_options(function):
    """--lora-alpha, --rslora, --fan-in-fan-out, --lora-dropout, --base-model: the
    adapter_config.json fields the weights cannot tell (over a config beside the checkpoint or in --assets)."""
    options = [
        click.option("--lora-alpha", type=float, metavar="ALPHA", help="LoRA's alpha (scale = alpha / r).  [default: from adapter_config.json]"),
        click.option("--rslora/--no-rslora", "use_rslora", default=None, help="Rank-stabilised LoRA: scale = alpha / sqrt(r).  [default: from adapter_config.json, else off]"),
        click.option("--fan-in-fan-out", is_flag=True, default=None, help="Base weights stored (in, out), as GPT-2's Conv1D.  [default: from adapter_config.json, else from the shapes]"),
        click.option("--lora-dropout", type=float, metavar="P", help="lora_dropout written to adapter_config.json (no effect on weights).  [default: from adapter_config.json, else 0.0]"),
        click.option("--base-model", "base_model_name_or_path", metavar="ID", help="base_model_name_or_path written to adapter_config.json (a Hub id or path).  [default: from adapter_config.json]"),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def adapter_options(name: str | None, lora_alpha, use_rslora, fan_in_fan_out, lora_dropout, base_model_name_or_path):
    from ckpttool.options import AdapterOptions

    return AdapterOptions(name or None, lora_alpha, use_rslora, fan_in_fan_out or None, lora_dropout,
                          base_model_name_or_path)


def adapter_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--adapter/--merge-adapter take an optional NAME, so before SRC they would take SRC as the
    name: say so, instead of a puzzling error about the arguments that follow."""
    if value and (os.sep in value or os.path.isdir(value)):
        raise click.BadParameter(f"{value!r} looks like a path, not an adapter name: write the option after SRC "
                                 f"and OUT (e.g. `ckpttool {ctx.info_name} SRC OUT {param.opts[0]}`)")
    return value


MERGE_HELP = ("Write the base model with the LoRA adapter NAME (default: the only one) merged in, as PEFT's "
              "merge_and_unload: W + scale * (B @ A).")
