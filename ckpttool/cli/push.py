"""`ckpttool push`: a checkpoint uploaded to a Hugging Face Hub model repository."""

from __future__ import annotations

import click

from ckpttool.cli.flags import checkpoint_dir, follow_symlinks_option, json_option, reads_source
from ckpttool.cli.running import byte_progress, reports_errors, show


@click.command()
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
