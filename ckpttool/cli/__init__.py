"""The `ckpttool` command line: each command parses, calls the library, renders.

Exit codes: 0 ok, 1 invalid or corrupt checkpoint (or a failed operation on one), 2 usage.
`main` is a click group whose commands are built on demand (click's "Lazily Loading
Subcommands"): each command is a module of this package, declaring its options, imported only
when the command runs or shows its `--help`. `COMMANDS` names each one's module and one-line
help, so `ckpttool --help` lists every command and imports none of them. A command imports its
`ckpttool.commands` module and its module of `render` (the only place that formats output)
inside its body: `--help` and `inspect` import nothing they do not use
(tests/test_startup_imports.py). Options several commands share are declared once, in `flags`
(`write_options` makes one `options.WriteOptions`, `reads_source` the `SourceOptions` of the
source flags); `running` turns errors and signals into one line and an exit code, and prints.
"""

from __future__ import annotations

import importlib
from gettext import gettext as _  # click's own: the section title reads as click's would

import click

from ckpttool import __version__

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100, "show_default": True}

# command -> (its module in this package, which defines it under the module's name; its one-line
# help in `ckpttool --help`: the first sentence of its docstring, which tests/test_startup_imports.py checks)
COMMANDS = {
    "average": ("average", "Write the weighted average of the model tensors of checkpoints of one model, any layouts and "
                           "world sizes: OUT.safetensors, OUT.pt, a directory of Hub shards, or with --world N a DCP "
                           "checkpoint."),
    "consolidate": ("consolidate", "Write a sharded checkpoint as one full state dict: OUT.safetensors, OUT.pt/.bin, or a "
                                   "directory of Hub-style safetensors shards with model.safetensors.index.json."),
    "diff": ("diff", "Compare two checkpoints of any layouts and shardings, entry by entry and byte for byte."),
    "export": ("export", "Write a checkpoint as a folder transformers and the Hugging Face Hub load: safetensors shards "
                         "(or model.safetensors), config.json, tokenizer files and a README.md model card; with --adapter, "
                         "a LoRA checkpoint's adapter as the folder PEFT loads."),
    "import": ("import_", "Write full model weights (a .safetensors file, a Hub folder, a .pt) as a DCP checkpoint laid "
                          "out for N FSDP2 ranks that dcp.load and `train_minimal --resume` read."),
    "inspect": ("inspect", "Show what is in a checkpoint, reading only its metadata (no tensor bytes)."),
    "latest": ("latest", "Print the path of the newest step of a run folder that is whole; exit 0 found, 1 none."),
    "manifest": ("manifest", "Write the SHA-256 of every tensor's bytes (row-major, as stored), its dtype and shape: the "
                             "same for a checkpoint at any world size, its reshard, consolidation and Hub export."),
    "push": ("push", "Upload a checkpoint to a Hugging Face Hub model repository (created if missing): a Hub-style "
                     "folder as it is, any other checkpoint exported to a temporary folder first."),
    "reshard": ("reshard", "Rewrite a DCP checkpoint for another world size: rank r's file holds what FSDP2 on N ranks "
                           "owns."),
    "validate": ("validate", "Check that a checkpoint is whole and consistent; exit 0 valid, 1 invalid."),
}


class LazyGroup(click.Group):
    """A click group of the commands in `COMMANDS`: a command's module is imported when the
    command is looked up (to run it, show its help or complete its options), and `--help` lists
    them all without importing any."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name = COMMANDS[cmd_name][0]
        command = getattr(importlib.import_module(f"{__name__}.{module_name}"), module_name)
        assert isinstance(command, click.Command), command
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        """click's, with its "Did you mean 'inspect'?" drawn from every command (click looks
        among the loaded ones: none, here)."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as error:
            no_such_command = getattr(click.exceptions, "NoSuchCommand", None)  # click >= 8.2: the one that suggests
            if no_such_command is None or not isinstance(error, no_such_command):
                raise
            raise no_such_command(error.command_name, possibilities=COMMANDS, ctx=ctx) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section of `--help`, as click writes it for loaded commands: each one-line
        help shortened (by click.Command's own rule) to the width the longest name leaves."""
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [(name, click.Command(name, help=summary).get_short_help_str(limit))
                for name, (_module, summary) in sorted(COMMANDS.items())]
        with formatter.section(_("Commands")):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="ckpttool")
def main() -> None:
    """See inside, validate, reshard and consolidate PyTorch Distributed Checkpoints."""
