"""The first command is fast because it imports only what it uses (issue 33): `inspect` and
`validate` load no writer, plan, executor, torchrun code, other command or other renderer, and
`--help` loads no command at all. An eager import re-added anywhere on their path (a renderer
importing a report type at module level, `cli.py` importing a command at the top, a reader
package importing every reader) fails here.

Checked in a fresh interpreter per command, as the `ckpttool` script and `python -m ckpttool`
run it: the CLI's main in-process, then `sys.modules` written to a file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

EXAMPLE = FIXTURES / "fsdp2_world3_uneven"

# argv[1]: where to write the module list; argv[2]: "script" or "module"; the rest: the command
RUN = """
import json, runpy, sys
out, how, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = ["ckpttool", *args]
code = 0
try:
    if how == "script":
        from ckpttool.cli import main
        main()
    else:
        runpy.run_module("ckpttool", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
with open(out, "w") as handle:
    json.dump({"code": code, "modules": sorted(sys.modules)}, handle)
"""

# what neither command may import: prefixes (a module or anything under it)
NEVER = (
    "torch", "huggingface_hub", "tqdm",
    "ckpttool.dcp.writer", "ckpttool.torchsave.ptfile", "ckpttool.record_writes",  # the writers
    "ckpttool.outputs.local", "ckpttool.outputs.remote", "ckpttool.outputs.temps", "ckpttool.outputs.multipart",
    "ckpttool.outputs.replacing",
    "ckpttool.plan.consolidate", "ckpttool.plan.reshard", "ckpttool.plan.operations", "ckpttool.plan.rank_files",
    "ckpttool.plan.merge",  # the plans
    "ckpttool.execute", "ckpttool.locating", "ckpttool.dequantizing", "ckpttool.merge", "ckpttool.distributed",
    "ckpttool.commands.consolidate", "ckpttool.commands.reshard", "ckpttool.commands.export",
    "ckpttool.commands.export_adapter", "ckpttool.commands.import_", "ckpttool.commands.push", "ckpttool.commands.diff",
    "ckpttool.commands.manifest", "ckpttool.manifest", "ckpttool.shard_map",
    "ckpttool.readers.deepspeed", "ckpttool.readers.megatron", "ckpttool.readers.verl", "ckpttool.readers.torch_pt",
)
# inspect reads metadata only: no blob reader either
INSPECT_NEVER = NEVER + ("ckpttool.dcp.blobs", "ckpttool.torchsave", "ckpttool.spans", "ckpttool.integrity")
RENDERERS = {f"ckpttool.render.{path.stem}" for path in (ROOT / "ckpttool" / "render").glob("*.py")} - {"ckpttool.render.__init__"}


def imported(tmp_path: Path, *args: str, how: str = "script") -> set[str]:
    """Return the modules a fresh `ckpttool ARGS` process holds when the command is done."""
    out = tmp_path / "modules.json"
    subprocess.run([sys.executable, "-c", RUN, str(out), how, *args], check=True, timeout=120, cwd=tmp_path,
                   stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert result["code"] in (0, None), result["code"]
    return set(result["modules"])


def forbidden(modules: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)}


@pytest.mark.parametrize("args, how", [
    (("inspect", str(EXAMPLE)), "script"),
    (("inspect", "--json", str(EXAMPLE)), "script"),
    (("inspect", str(EXAMPLE)), "module"),
], ids=["inspect", "inspect-json", "python-m-inspect"])
def test_inspect_imports_neither_writers_plans_other_commands_nor_other_renderers(tmp_path, args, how):
    modules = imported(tmp_path, *args, how=how)
    assert {"ckpttool.commands.inspect", "ckpttool.render.inspect", "ckpttool.readers.dcp"} <= modules  # it ran
    assert forbidden(modules, INSPECT_NEVER) == set()
    assert {m for m in modules if m in RENDERERS} <= {"ckpttool.render.inspect", "ckpttool.render.chunk_tables",
                                                     "ckpttool.render.lora", "ckpttool.render.text"}


def test_validate_imports_neither_writers_plans_other_commands_nor_other_renderers(tmp_path):
    modules = imported(tmp_path, "validate", str(EXAMPLE))
    assert {"ckpttool.commands.validate", "ckpttool.render.validate", "ckpttool.integrity"} <= modules  # it ran
    assert forbidden(modules, NEVER) == set()
    assert {m for m in modules if m in RENDERERS} <= {"ckpttool.render.validate", "ckpttool.render.manifest",
                                                     "ckpttool.render.text"}


def test_help_imports_no_command_reader_or_renderer(tmp_path):
    modules = imported(tmp_path, "--help")
    assert "ckpttool.cli" in modules  # it ran
    assert forbidden(modules, ("ckpttool.commands", "ckpttool.readers", "ckpttool.render", "ckpttool.options",
                               "ckpttool.outputs", "ckpttool.io")) == set()


def test_the_forbidden_lists_name_real_modules():
    """A renamed module would make its entry here pass silently: every prefix is on disk."""
    package = ROOT / "ckpttool"
    for prefix in INSPECT_NEVER:
        if prefix.startswith("ckpttool."):
            path = package.joinpath(*prefix.split(".")[1:])
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), prefix
    assert {"ckpttool.render.inspect", "ckpttool.render.validate", "ckpttool.render.convert"} <= RENDERERS
