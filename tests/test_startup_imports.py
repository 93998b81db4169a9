"""The first command is fast because it imports only what it uses (issue 33): `inspect` and
`validate` load no writer, plan, executor, torchrun code, other command (nor its CLI module) or
other renderer, and `--help` loads no command at all, not even the CLI's modules declaring their
options (the group lists each command's one-line help from `cli.COMMANDS`, checked here against
click's own listing of the loaded commands). An eager import re-added anywhere on their path (a
renderer importing a report type at module level, the CLI's group importing a command's module, a
reader package importing every reader) fails here. Neither imports numpy for a small checkpoint (the
bundled example: its import alone costs more than the whole command): `validate` checks a few
hundred claimed byte ranges in pure Python (`integrity_small`, the same findings as the numpy
path, checked here on damaged copies), and the naming tables compile no regex (a pattern is
split into its literals). Neither imports the checking unpickler for a `.metadata` torch wrote: the C
reader reads a small one into tuples of Chunk (the loader's checkpoint, checked here on every
fixture and on mutants), and `validate` imports the quantisation code only where it could find
something (checked against `quantization.find`). Nor do they import the writing commands'
options (`options.py`, with `io` and its defaults: they take `source_options.SourceOptions`
alone), the quantisation code for a checkpoint with no config.json and no quantised tensor
(`inspect` too), or, printing text, the `json` module (only `--json` encodes, only a config.json
or Megatron's metadata.json decodes). `inspect` of a model no framework names imports neither
the naming engine nor its tables (`naming.candidates` matches the families' signatures, checked
here against `find_family` on every fixture), nor the key rules (`model_view` normalises the
wrapper names itself).

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
from test_chunk_tables import DAMAGE
from test_validate import copy_fixture

from ckpttool.cli import COMMANDS, CONTEXT
from ckpttool.core.checkpoint import ChunkTable
from ckpttool.naming import REGISTRY

EXAMPLE = FIXTURES / "fsdp2_world3_uneven"

# argv[1]: where to write the module list; argv[2]: "script" or "module"; the rest: the command
RUN = """
import runpy, sys
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
modules = sorted(sys.modules)
import json  # after the command: whether it imported json is checked
with open(out, "w") as handle:
    json.dump({"code": code, "modules": modules}, handle)
"""

# what neither command may import: prefixes (a module or anything under it)
NEVER = (
    "torch", "huggingface_hub", "tqdm",
    "ckpttool.dcp.writer", "ckpttool.torchsave.ptfile", "ckpttool.run.record_writes",  # the writers
    "ckpttool.outputs.local", "ckpttool.outputs.remote", "ckpttool.outputs.temps", "ckpttool.outputs.multipart",
    "ckpttool.outputs.replacing",
    "ckpttool.plan.consolidate", "ckpttool.plan.reshard", "ckpttool.plan.operations", "ckpttool.plan.rank_files",
    "ckpttool.plan.merge",  # the plans
    "ckpttool.run.execute", "ckpttool.run.locating", "ckpttool.run.dequantizing", "ckpttool.run.merge", "ckpttool.run.distributed",
    "ckpttool.commands.consolidate", "ckpttool.commands.reshard", "ckpttool.commands.export",
    "ckpttool.commands.export_adapter", "ckpttool.commands.import_", "ckpttool.commands.push", "ckpttool.commands.diff",
    "ckpttool.commands.manifest", "ckpttool.check.manifest", "ckpttool.render.shard_map",
    "ckpttool.readers.deepspeed", "ckpttool.readers.megatron", "ckpttool.readers.verl", "ckpttool.readers.torch_pt",
    "ckpttool.cli.consolidate", "ckpttool.cli.reshard", "ckpttool.cli.export", "ckpttool.cli.import_",
    "ckpttool.cli.push", "ckpttool.cli.diff", "ckpttool.cli.manifest",  # the other commands' options, built on demand
)
# a small checkpoint (the example): no numpy, no LoRA finder for a model without LoRA keys,
# (validate without --deep reads metadata and file sizes) no blob reader or torch.save code, and
# (the C reader reads the .metadata torch wrote, as tuples of Chunk) neither the checking
# unpickler nor the readers of other layouts
SMALL_NEVER = NEVER + ("ckpttool.options", "ckpttool.store.io", "numpy", "ckpttool.plan", "ckpttool.model.lora", "ckpttool.dcp.blobs", "ckpttool.torchsave", "ckpttool.store.spans",
                       "ckpttool.core.numerics", "ckpttool.safepickle", "ckpttool.readers.dcp_records", "ckpttool.readers.dcp_hf",
                       "ckpttool.readers.hub_folder", "ckpttool.readers.safetensors", "ckpttool.formats.safetensors",
                       "ckpttool.formats.hub")
# inspect reads metadata only: no integrity gate either, (no config.json, no float8 or MXFP4
# tensor) no quantisation code, (a model no framework names: `naming.candidates` finds no
# family's signature) neither the naming engine nor its tables, and (model_view normalises the
# wrapper names itself) no key rules
INSPECT_NEVER = SMALL_NEVER + ("ckpttool.cli.validate", "ckpttool.check.integrity", "ckpttool.model.quantization", "ckpttool.naming.engine",
                               "ckpttool.naming.fused", "ckpttool.naming.megatron_config", "ckpttool.naming.families",
                               "ckpttool.model.keys")
# validate of a checkpoint with no quantised weights and no config.json: no quantisation code,
# and no key rules (only a ConvertOptions, which validate never builds, needs them)
VALIDATE_NEVER = SMALL_NEVER + ("ckpttool.cli.inspect", "ckpttool.model.quantization", "ckpttool.model.keys")
# printing text, not --json: no JSON encoder (nor decoder: no config.json is read)
TEXT_NEVER = ("json",)
RENDERERS = {f"ckpttool.render.{path.stem}" for path in (ROOT / "ckpttool" / "render").glob("*.py")} - {"ckpttool.render.__init__"}
# the CLI's modules beside its group: one per command, and the options and running they share
CLI_MODULES = tuple(sorted(f"ckpttool.cli.{path.stem}" for path in (ROOT / "ckpttool" / "cli").glob("*.py")
                           if path.stem != "__init__"))


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
    assert {"ckpttool.cli.inspect", "ckpttool.commands.inspect", "ckpttool.render.inspect",
            "ckpttool.readers.dcp"} <= modules  # it ran
    assert forbidden(modules, INSPECT_NEVER + (() if "--json" in args else TEXT_NEVER)) == set()
    assert {m for m in modules if m in RENDERERS} <= {"ckpttool.render.inspect", "ckpttool.render.chunk_tables",
                                                     "ckpttool.render.lora", "ckpttool.render.text"}


@pytest.mark.parametrize("args", [("validate",), ("validate", "--json")], ids=["validate", "validate-json"])
def test_validate_imports_neither_writers_plans_other_commands_nor_other_renderers(tmp_path, args):
    modules = imported(tmp_path, *args, str(EXAMPLE))
    assert {"ckpttool.cli.validate", "ckpttool.commands.validate", "ckpttool.render.validate", "ckpttool.check.integrity",
            "ckpttool.check.integrity_small"} <= modules  # it ran, the small checkpoint's way
    assert forbidden(modules, VALIDATE_NEVER + (() if "--json" in args else TEXT_NEVER)) == set()
    assert {m for m in modules if m in RENDERERS} <= {"ckpttool.render.validate", "ckpttool.render.manifest",
                                                     "ckpttool.render.text"}


def test_help_imports_no_command_reader_or_renderer(tmp_path):
    modules = imported(tmp_path, "--help")
    assert "ckpttool.cli" in modules  # it ran
    assert len(CLI_MODULES) >= len(COMMANDS) + 2
    assert forbidden(modules, ("ckpttool.commands", "ckpttool.readers", "ckpttool.render", "ckpttool.options",
                               "ckpttool.source_options", "ckpttool.store.storage", "ckpttool.outputs", "ckpttool.store.io",
                               "json", *CLI_MODULES)) == set()


@pytest.mark.parametrize("width", [40, 80, 100, 200])
def test_help_lists_every_command_as_click_lists_them_loaded(width):
    """`ckpttool --help` takes each command's one-line help from `cli.COMMANDS`, importing no
    command: the same page, at any terminal width, as a click group holding every command loaded,
    and each entry is the first sentence of its command's docstring, as click shortens it."""
    import click
    from click.testing import CliRunner

    from ckpttool.cli import main

    loaded = {name: main.get_command(click.Context(main), name) for name in COMMANDS}
    assert all(command is not None and command.name == name for name, command in loaded.items())
    assert {name: summary for name, (_, summary) in COMMANDS.items()} == \
        {name: command.get_short_help_str(limit=1_000_000) for name, command in loaded.items()}
    eager = click.Group("ckpttool", commands=loaded, params=main.params, help=main.help, context_settings=CONTEXT)
    runner = CliRunner()
    lazy_page = runner.invoke(main, ["--help"], prog_name="ckpttool", env={"COLUMNS": str(width)})
    eager_page = runner.invoke(eager, ["--help"], prog_name="ckpttool", env={"COLUMNS": str(width)})
    assert lazy_page.exit_code == eager_page.exit_code == 0
    assert lazy_page.output == eager_page.output
    assert all(f"  {name} " in lazy_page.output for name in COMMANDS)


def test_each_command_shows_its_help_and_a_mistyped_name_gets_a_suggestion():
    import click
    from click.testing import CliRunner

    from ckpttool.cli import main

    runner = CliRunner()
    for name in COMMANDS:
        result = runner.invoke(main, [name, "-h"], prog_name="ckpttool")
        assert result.exit_code == 0 and result.output.startswith(f"Usage: ckpttool {name} [OPTIONS]"), result.output
        assert "--json" in result.output or name == "manifest"
    mistyped = runner.invoke(main, ["inspct"], prog_name="ckpttool")
    assert mistyped.exit_code == 2 and "No such command 'inspct'." in mistyped.output
    if hasattr(click.exceptions, "NoSuchCommand"):  # click >= 8.2 suggests
        assert "Did you mean 'inspect'?" in mistyped.output


def test_the_forbidden_lists_name_real_modules():
    """A renamed module would make its entry here pass silently: every prefix is on disk."""
    package = ROOT / "ckpttool"
    for prefix in INSPECT_NEVER + VALIDATE_NEVER + ("ckpttool.source_options",):
        if prefix.startswith("ckpttool."):
            path = package.joinpath(*prefix.split(".")[1:])
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), prefix
    assert {"ckpttool.render.inspect", "ckpttool.render.validate", "ckpttool.render.convert"} <= RENDERERS


def test_validate_deep_still_imports_the_blob_reader_and_numpy(tmp_path):
    """The small path is for the metadata checks only: --deep decodes blobs (and counts NaN/Inf with numpy)."""
    modules = imported(tmp_path, "validate", "--deep", str(EXAMPLE))
    assert {"ckpttool.dcp.blobs", "ckpttool.core.numerics", "numpy"} <= modules


@pytest.mark.parametrize("name", DAMAGE)
def test_small_claims_give_the_numpy_paths_problems(tmp_path, monkeypatch, name):
    """`integrity_small` (pure Python, a checkpoint of tuples) against the numpy sort of the same
    claims (SMALL_CLAIMS 0), on damaged copies of a real checkpoint: the same problems, in order."""
    from ckpttool import readers
    from ckpttool.check import integrity

    path = copy_fixture(tmp_path)
    DAMAGE[name](path)
    checkpoint = readers.open_checkpoint(path)
    assert not any(isinstance(t.chunks, ChunkTable) for t in checkpoint.tensors.values())  # tuples: the small path
    small = integrity.check(checkpoint).problems
    monkeypatch.setattr(integrity, "SMALL_CLAIMS", 0)
    assert integrity.check(checkpoint).problems == small
    assert small  # each case is damage the gate reports


def test_small_claims_order_ties_and_flag_sweeps_as_the_numpy_sort_does():
    from ckpttool.check.integrity_small import adjacent, file_claims

    claims = [(1, 0, 8, True), (0, 4, 8, False), (0, 4, 8, True), (0, 0, 4, True), (1, 8, 16, True), (0, 6, 9, True)]
    assert file_claims(claims) == [(1, [(0, 8, 0, True), (8, 16, 4, True)]),
                                   (0, [(0, 4, 3, True), (4, 8, 1, False), (4, 8, 2, True), (6, 9, 5, True)])]
    assert adjacent(file_claims(claims)[0][1]) == (False, [])
    assert adjacent(file_claims(claims)[1][1]) == (True, [1, 2])  # equal ranges: swept with the blobs resolved
    assert adjacent([(0, 4, 0, True), (2, 6, 1, False)]) == (False, [0])  # an overlap: one pair
    assert adjacent([(0, 4, 0, True), (0, 6, 1, True)]) == (True, [0])  # two tensor blobs starting together


def test_the_naming_tables_compile_no_regex_when_built_or_matched(tmp_path):
    """Importing the tables (as inspect does where a signature matches) and matching keys
    against their ~150 patterns compiles no regex: a pattern is split into its literals once."""
    code = ("import re, sys\n"
            "from ckpttool import naming\n"
            "from ckpttool.naming import engine\n"  # the engine (and what it imports), then the tables
            "compiled = []\n"
            "original = re._compile\n"
            "re._compile = lambda pattern, flags: compiled.append(pattern) or original(pattern, flags)\n"
            "families = naming.FAMILIES\n"
            "family = naming.family('torchtitan llama3')\n"
            "rule, values = family.match('layers.3.attention.qkv_linear.wq.weight')\n"
            "assert rule.targets == ('model.layers.{L}.self_attn.q_proj.weight',) and values == {'L': '3'}, (rule, values)\n"
            "assert all(f.match('no.such.key') is None for f in families)\n"
            "assert compiled == [], compiled\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tmp_path)


ALL_METADATA = sorted(FIXTURES.glob("**/.metadata"))


def test_a_small_metadata_read_by_the_c_reader_is_the_checkpoint_the_loader_reads():
    """A small `.metadata` is read by the C reader into tuples of Chunk (`columns.small_checkpoint`,
    no numpy) instead of by the checking Python loader: the same checkpoint, field for field and
    type for type, on every fixture the C reader reads, and on 250 seeded mutants of three that
    both read (or both refuse alike)."""
    import random

    from test_metadata_columns import _loader, _mutant, _outcome, _plain

    from ckpttool.core.errors import CheckpointError
    from ckpttool.readers import dcp

    def small(path, raw):
        scanned = dcp.scan_columns(raw)
        return None if scanned is None else dcp.columns.small_checkpoint(path.parent, path, scanned)

    read = 0
    for path in ALL_METADATA:
        raw = path.read_bytes()
        checkpoint = small(path, raw)
        if checkpoint is None:
            continue  # declined: read by the loader, as before
        read += 1
        loaded = _loader(path, raw)
        assert _plain(checkpoint) == _plain(loaded), path
        assert [type(c) for t in checkpoint.tensors.values() for c in t.chunks] == \
            [type(c) for t in loaded.tensors.values() for c in t.chunks]
        assert list(checkpoint.tensors) == list(loaded.tensors) and list(checkpoint.objects) == list(loaded.objects)
    assert read >= 20
    assert isinstance(dcp.read_checkpoint(EXAMPLE).tensors["model.embed.weight"].chunks, tuple)

    rng = random.Random(3)
    sources = [FIXTURES / name / ".metadata" for name in ("fsdp2_world2", "fsdp2_world3_uneven", "llama_world2/checkpoint")]
    outcomes = {"read": 0, "declined": 0, "refused": 0}
    for number in range(250):
        path = rng.choice(sources)
        raw = _mutant(path.read_bytes(), rng)
        try:
            checkpoint = small(path, raw)
        except CheckpointError as error:
            assert _outcome(_loader, path, raw) == ("refused", type(error).__name__), f"mutant {number} of {path}"
            outcomes["refused"] += 1
            continue
        if checkpoint is None:
            outcomes["declined"] += 1
            continue
        outcomes["read"] += 1
        assert ("read", _plain(checkpoint)) == _outcome(_loader, path, raw), f"mutant {number} of {path}"
    assert outcomes["read"] > 20 and outcomes["declined"] > 60, outcomes


def test_validate_skips_the_quantisation_code_only_where_it_would_find_nothing():
    """`may_be_quantized` is False only where `quantization.find` (with the config beside the
    checkpoint) returns None: on every DCP fixture and on the quantised ones."""
    from ckpttool.model import quantization
    from ckpttool.commands.validate import may_be_quantized
    from ckpttool.core.errors import CheckpointError
    from ckpttool.readers import open_checkpoint

    skipped = kept = 0
    for path in ALL_METADATA + sorted((FIXTURES / "quantized").glob("*/")):
        try:
            checkpoint = open_checkpoint(path.parent if path.name == ".metadata" else path)
        except CheckpointError:
            continue
        if may_be_quantized(checkpoint):
            kept += 1
            continue
        skipped += 1
        assert quantization.find(checkpoint, quantization.config_beside(checkpoint.path)) is None, path
    assert skipped >= 15 and kept >= 3, (skipped, kept)


def test_source_options_is_one_class_whichever_module_it_is_imported_from():
    """inspect and validate import `SourceOptions` from its own module; the writing commands and
    library callers from `options` beside the others: the same class, so equal options compare equal."""
    import ckpttool
    from ckpttool import options, source_options
    from ckpttool.model import quantization
    from ckpttool.formats.model_config import config_beside

    assert options.SourceOptions is source_options.SourceOptions is ckpttool.SourceOptions
    assert options.SourceOptions(model_prefix="app.model") == source_options.SourceOptions(model_prefix="app.model")
    assert quantization.config_beside is config_beside  # one reader of the config beside a checkpoint


def test_inspect_of_a_quantised_checkpoint_still_imports_the_quantisation_code_and_finds_it(tmp_path):
    """The quantisation code, imported only where there is something to find (a config.json
    beside the weights here), still finds it."""
    from ckpttool.commands.inspect import inspect

    path = FIXTURES / "quantized" / "deepseek_v3_fp8"
    assert "ckpttool.model.quantization" in imported(tmp_path, "inspect", str(path))
    assert inspect(path).quantization is not None


def test_inspect_of_a_framework_checkpoint_still_imports_the_naming_engine_and_names_its_family(tmp_path):
    """The engine and the tables, imported only where a family's signature matches (a torchtitan
    run here), still name the family and each tensor's transformers names."""
    from ckpttool.commands.inspect import inspect

    path = FIXTURES / "frameworks" / "torchtitan" / "checkpoint" / "step-20"
    modules = imported(tmp_path, "inspect", str(path))
    assert {"ckpttool.naming.engine", "ckpttool.naming.families.torchtitan_llama3"} <= modules
    report = inspect(path)
    assert report.family == "torchtitan llama3" and report.hf_names
    assert report.hf_names["tok_embeddings.weight"] == ("model.embed_tokens.weight",)


def test_the_signatures_inspect_reads_are_the_tables_and_find_the_same_families():
    """The registry's signatures (what `inspect` matches without the engine) are each table's
    own, and `naming.candidates` is empty exactly where `find_family` finds no family, on the
    model keys of every fixture and on each family's own signature filled in."""
    from ckpttool import naming
    from ckpttool.core.errors import CheckpointError
    from ckpttool.model.model_view import find_model
    from ckpttool.naming import engine
    from ckpttool.readers import open_checkpoint

    assert [(family.name, family.signature) for family in naming.FAMILIES] == \
        [(entry.name, entry.signature) for entry in REGISTRY]  # most specific first
    import ast

    body = ast.parse(Path(engine.__file__).read_text()).body  # every public name the engine defines is served
    defined = {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))} | \
        {target.id for node in body if isinstance(node, ast.Assign) for target in ast.walk(node)
         if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store)} | \
        {node.target.id for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert naming.ENGINE_NAMES == {name for name in defined if not name.startswith("_")}
    assert all(getattr(naming, name) is getattr(engine, name) for name in naming.ENGINE_NAMES)
    assert {"Family", "Rule", "Piece", "Target", "convert", "find_family"} <= naming.ENGINE_NAMES

    named = unnamed = 0
    key_sets = [[pattern.replace("{L}", "0").replace("{E}", "1").replace("{M}", "0") for pattern in signature]
                for signature in [entry.signature for entry in REGISTRY]]
    for path in ALL_METADATA + sorted((FIXTURES / "frameworks").glob("*/checkpoint*/*/")):
        try:
            checkpoint = open_checkpoint(path.parent if path.name == ".metadata" else path)
        except CheckpointError:
            continue
        view = find_model(checkpoint)
        key_sets.append([key for fqn, key in view.keys.items() if fqn in checkpoint.tensors])
    for keys in key_sets:
        found = naming.find_family(keys, naming.FAMILIES)
        assert bool(naming.candidates(keys)) == (found is not None), keys[:5]
        named, unnamed = named + (found is not None), unnamed + (found is None)
    assert named >= len(REGISTRY) and unnamed >= 15, (named, unnamed)
