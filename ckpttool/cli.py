"""The `ckpttool` command line: each command parses, calls the library, renders.

Exit codes: 0 ok, 1 invalid or corrupt checkpoint (or a failed operation on one), 2 usage.
Human text and `--json` documents come from the `render` package (the only place that formats
output), each command importing its own module of it, and its `ckpttool.commands` module, inside
its body: `--help` and `inspect` import nothing they do not use (tests/test_startup_imports.py);
options shared by the writing commands are declared once, in `write_options`, and become one
`options.WriteOptions` there; `reads_source` makes the `options.SourceOptions` of the source flags.
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import wraps
from typing import Sequence

import click

from ckpttool import __version__
from ckpttool.core.errors import EXIT_INVALID, CheckpointError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100, "show_default": True}


def _shown(text) -> str:  # render.text.shown, imported only when there is something to show
    from ckpttool.render.text import shown

    return shown(text)


def print_notice(notice) -> None:
    """The CLI's `WriteOptions.notify`: each notice (a replaced file, a killed run's leftovers
    removed) as one line on stderr."""
    click.echo(_shown(notice), err=True)


@contextlib.contextmanager
def errors_reported():
    """Turn a CheckpointError into one line on stderr and its exit code (no traceback), and
    SIGINT, SIGTERM or SIGHUP into one line and 128 + the signal number (130, 143, 129)."""
    from ckpttool.outputs import signals

    try:
        yield
    except CheckpointError as error:
        click.echo(f"error: [{error.code}] {_shown(error)}", err=True)
        sys.exit(error.exit_code)
    except KeyboardInterrupt as interrupt:  # signals.Interrupted for each of the three signals
        interrupt = interrupt if isinstance(interrupt, signals.Interrupted) else signals.Interrupted()
        click.echo(f"{interrupt}; nothing was left half-written", err=True)
        sys.exit(interrupt.exit_code)


def reports_errors(command):
    """Run the command with `errors_reported`, signals turned into `Interrupted`."""

    @wraps(command)
    def run(*args, **kwargs):
        from ckpttool.outputs import signals  # when the command runs: `--help` never needs it

        with errors_reported(), signals.interruptible():
            return command(*args, **kwargs)

    return run


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="ckpttool")
def main() -> None:
    """See inside, validate, reshard and consolidate PyTorch Distributed Checkpoints."""


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


def byte_progress(quiet: bool):
    """Return a factory of tqdm bars counting bytes on stderr: only when stderr is a terminal
    (tqdm's own check, so logs get no bar fragments), never with --quiet."""

    def start(description: str, total: int):
        from tqdm import tqdm

        return tqdm(desc=description, total=total, unit="B", unit_scale=True, file=sys.stderr,
                    disable=True if quiet else None, leave=False, dynamic_ncols=True)

    return start


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


def show(document: dict | None, text: str | None, notes: Sequence[str] = ()) -> None:
    """Print `document` as JSON (when given) or `text`; `notes` go to stderr either way."""
    from ckpttool.render.text import emit_json, shown, terminal_text

    for line in notes:
        click.echo(shown(line), err=True)
    if document is not None:
        emit_json(document)
    elif text:
        click.echo(terminal_text(text))


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


def write_shard_map(html: str, force: bool, report, problems=(), validated: bool = False, path=None) -> None:
    """Write the shard-map page of an inspect report (None: metadata unreadable) and validate's
    problems to `html`, atomically; say so on stderr."""
    from ckpttool.render import shard_map
    from ckpttool.render.html import write_page, written_line

    built = shard_map.build(report, problems, path=path, validated=validated)
    size = write_page(built, html, force)
    click.echo(_shown(written_line(built, html, size)), err=True)
# --- end of the shard-map page ----------------------------------------------------------------


@main.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@json_option("ckpttool.inspect/1")
@click.option("--filter", "filters", multiple=True, metavar="GLOB", help="Only entries whose fqn matches (repeatable), e.g. 'model.layers.0.*'.")
@click.option("--chunks", is_flag=True, help="List every chunk: offsets, sizes, file, byte offset and length.")
@click.option("--by-file", is_flag=True, help="Bytes per data file (rank), split into model/optimizer/other.")
@with_html_options
@model_prefix_option
@storage_option
@reads_source
@reports_errors
def inspect(src: str, as_json: bool, filters: tuple[str, ...], chunks: bool, by_file: bool, html: str | None,
            force: bool, source) -> None:
    """Show what is in a checkpoint, reading only its metadata (no tensor bytes). SRC defaults
    to the current directory."""
    from ckpttool.commands.inspect import inspect as inspect_checkpoint
    from ckpttool.render.inspect import inspect_document, inspect_text

    if html is not None:
        from ckpttool.outputs import check_destination

        check_destination(html, force)
    report = inspect_checkpoint(src, filters, source)
    if html is not None:
        write_shard_map(html, force, report)
    if as_json:
        show(inspect_document(report), None)
    else:
        show(None, inspect_text(report, chunks=chunks, by_file=by_file))


@main.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@click.option("--deep", is_flag=True, help="Also read every byte: decode each blob, check CRC-32, dtype and shape, count NaN/Inf.")
@click.option("--manifest", "manifest_file", metavar="FILE", help="Also hash every tensor and check it against this manifest (`ckpttool manifest`): exit 1 naming the first differing, missing or extra tensor.")  # manifest (issue 34)
@with_html_options
@follow_symlinks_option
@storage_option
@json_option("ckpttool.validate/1")
@reads_source
@reports_errors
def validate(src: str, deep: bool, manifest_file: str | None, html: str | None, force: bool, as_json: bool,
             source) -> None:
    """Check that a checkpoint is whole and consistent; exit 0 valid, 1 invalid. SRC defaults
    to the current directory."""
    from ckpttool.commands.validate import validate as validate_checkpoint
    from ckpttool.render.validate import validate_document, validate_text

    if html is not None:
        from ckpttool.outputs import check_destination

        check_destination(html, force)
    report = validate_checkpoint(src, deep=deep, source=source, manifest=manifest_file)
    if html is not None:  # the page marks the problems on the tensors the metadata holds, if it can be read
        from ckpttool.commands.inspect import inspect as inspect_checkpoint

        try:
            inspected = inspect_checkpoint(src, (), source)
        except CheckpointError:
            inspected = None
        write_shard_map(html, force, inspected, report.problems, validated=True, path=report.path)
    show(validate_document(report) if as_json else None, validate_text(report))
    if not report.valid:
        sys.exit(EXIT_INVALID)


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


@main.command()
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


@main.command()
@click.argument("src", type=checkpoint_dir, required=False, default=".")
@click.argument("dst", required=False, type=click.Path(file_okay=False, dir_okay=True))
@click.option("--world", "world_size", type=click.IntRange(1, 1 << 20), metavar="N", help="Target world size (FSDP2 ranks).  [required unless --mesh]")
@click.option("--mesh", metavar="R,S", help="HSDP target: R replicas x S shards (N = R*S); shards along dim 0 over S.")
@click.option("--keep-whole", multiple=True, metavar="GLOB", help="Leave tensors whose fqn matches in one piece (repeatable), e.g. 'model.*.rope.freqs'.")
@model_prefix_option
@write_options
@json_option("ckpttool.reshard/1")
@reads_source
@reports_errors
def reshard(src: str, dst: str | None, world_size: int | None, mesh: str | None, keep_whole: tuple[str, ...],
            as_json: bool, write, source) -> None:
    """Rewrite a DCP checkpoint for another world size: rank r's file holds what FSDP2 on N
    ranks owns. SRC defaults to the current directory, DST to SRC-world{N} beside SRC."""
    from ckpttool.commands.reshard import reshard as reshard_checkpoint
    from ckpttool.render.convert import default_destination_line, reshard_document, reshard_text
    from ckpttool.render.text import problem_lines

    report = reshard_checkpoint(src, dst, world_size, mesh, keep_whole=keep_whole, write=write, source=source)
    notes = problem_lines(report.problems)
    if dst is None:
        notes.append(default_destination_line(report))
    show(reshard_document(report) if as_json else None, reshard_text(report), notes)

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


@main.command()
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


@main.command()
@click.argument("src", type=checkpoint_dir)
@click.argument("repo_id")
@click.option("--revision", metavar="BRANCH", help="Branch to commit to; created from main when missing.  [default: main]")
@click.option("--private", is_flag=True, help="Create the repository private (an existing one keeps its visibility).")
@click.option("--commit-message", metavar="TEXT", help="Commit message.  [default: Upload SRC with ckpttool]")
@click.option("--dry-run", is_flag=True, help="List the files and sizes that would be uploaded; contact no Hub, upload nothing.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@follow_symlinks_option
@json_option("ckpttool.push/1")
@reads_source
@reports_errors
def push(src: str, repo_id: str, revision: str | None, private: bool, commit_message: str | None, dry_run: bool,
         quiet: bool, as_json: bool, source) -> None:
    """Upload a checkpoint to a Hugging Face Hub model repository (created if missing): a
    Hub-style folder as it is, any other checkpoint exported to a temporary folder first.

    Token and endpoint as huggingface_hub reads them: HF_TOKEN or `hf auth login`; HF_ENDPOINT."""
    from ckpttool.commands.push import push as push_checkpoint
    from ckpttool.render.hub import push_document, push_notes, push_text

    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    report = push_checkpoint(src, repo_id, revision=revision, private=private, commit_message=commit_message,
                             dry_run=dry_run, progress=byte_progress(quiet), source=source)
    show(push_document(report) if as_json else None, push_text(report), push_notes(report))


@main.command()
@click.argument("src", type=checkpoint_dir)
@click.argument("outdir", type=click.Path(file_okay=False, dir_okay=True))
@click.option("--assets", type=click.Path(exists=True, file_okay=False), metavar="DIR", help="Folder whose config.json, generation_config.json, tokenizer and chat-template files are copied; the weights are checked against its config (and model.safetensors.index.json).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Cast floating tensors to this dtype; config.json's torch_dtype says what was written.  [default: keep]")
@click.option("--max-shard-size", metavar="SIZE", help="Largest shard, decimal like huggingface_hub, at most 50GB (the Hub's per-file limit).  [default: 5GB]")
@click.option("--drop-tied", is_flag=True, help="Write one copy of tied weights even when no config says tie_word_embeddings (a tied config always does).")
@click.option("--rename", "renames", multiple=True, metavar="REGEX=REPL", help="Rewrite output keys with re.sub (repeatable, in order), before the config check.")
@click.option("--adapter", is_flag=False, flag_value="", default=None, metavar="[NAME]", callback=adapter_name, help="Write the LoRA adapter NAME (default: the only one) as the folder PeftModel.from_pretrained loads: adapter_model.safetensors + adapter_config.json.")
@click.option("--merge-adapter", "merge_adapter", is_flag=False, flag_value="", default=None, metavar="[NAME]", callback=adapter_name, help=MERGE_HELP)
@click.option("--quantize", type=click.Choice(["fp8"]), help="Write the projection weights (*_proj) as fine-grained FP8 with float32 weight_scale_inv (DeepSeek's weight_quant), and the matching quantization_config.  [default: keep]")
@click.option("--block", default="128x128", show_default=True, metavar="RxC", help="--quantize fp8's block size.")
@click.option("--manifest", "with_manifest", is_flag=True, help="Also write manifest.json: the SHA-256 of every tensor written (`ckpttool manifest` of the folder), in the same atomic commit.")  # manifest (issue 34)
@lora_options
@model_prefix_option
@write_options
@json_option("ckpttool.export/1")
@reads_source
@reports_errors
def export(src: str, outdir: str, assets: str | None, dtype: str | None, max_shard_size: str | None, drop_tied: bool,
           renames: tuple[str, ...], adapter: str | None, merge_adapter: str | None, quantize: str | None, block: str,
           with_manifest: bool, lora_alpha, use_rslora, fan_in_fan_out, lora_dropout, base_model_name_or_path, as_json: bool, write,
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
        if dtype or max_shard_size or drop_tied or renames or with_manifest:
            raise click.UsageError("--adapter writes PEFT's own file: --dtype, --max-shard-size, --drop-tied, "
                                   "--rename and --manifest do not apply")
        from ckpttool.commands.export_adapter import export_adapter
        from ckpttool.render.lora import adapter_document, adapter_text

        written = export_adapter(src, outdir, assets, lora, write, source)
        show(adapter_document(written) if as_json else None, adapter_text(written))
        return
    rows, _, cols = block.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        raise click.UsageError(f"--block {block!r}: expected ROWSxCOLS, e.g. 128x128")
    convert = ConvertOptions(renames=renames, dtype=dtype, drop_tied=drop_tied, max_shard_size=max_shard_size,
                             quantize=quantize, block=(int(rows), int(cols)))
    report = export_checkpoint(src, outdir, assets, convert, write, source, lora if merge_adapter is not None else None,
                               manifest=with_manifest)
    show(export_document(report) if as_json else None, export_text(report), export_notes(report))


@main.command(name="import")
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


# --- manifests (issue 34): `ckpttool manifest`, and `diff SRC FILE.json` --------------------------
@main.command()
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
    from ckpttool.render.text import problem_lines

    write = WriteOptions(force=force, threads=threads, max_memory=max_memory, progress=byte_progress(quiet),
                         notify=print_notice)
    report = manifest_of(src, out, everything=everything, files=files, write=write, source=source)
    if out is None:
        click.echo(report.manifest.to_json().decode("ascii"), nl=False)
        for line in manifest_text(report).splitlines():
            click.echo(_shown(line), err=True)
    else:
        show(None, manifest_text(report), problem_lines(report.problems))


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
# --- end of manifests -------------------------------------------------------------------------
