"""The shape of the code (STYLE.md): imports run one way, modules and functions stay readable.

Every module of the package is parsed (never imported); an import counts wherever it is
written, function-local imports included, since a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckpttool"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
# the floors of the house, lowest first: a room (a package, or a module loose in ckpttool/)
# imports only rooms below its own (docs/code-layout.md draws the same map)
FLOORS = ("core", "store", "safepickle", "torchsave", "formats", "model", "outputs", "source_options", "options",
          "dcp", "readers", "plan", "check", "naming", "run", "commands", "load", "render", "cli", "__main__", "")
MAX_LOOSE_MODULES = 8  # beside the packages: the public API, the CLI and what every command is given


def modules() -> dict[str, Path]:
    """Return dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Return the package's modules that module `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            # a module importing its own package's __init__ (or its submodule) is not a loop
            if candidate and candidate != name and not name.startswith(candidate + "."):
                targets.add(candidate)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules_counting_function_local_imports():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_loop_through_a_function_local_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ckpttool.store import io\n")
    assert imported("ckpttool.m", module, {"ckpttool": PACKAGE, "ckpttool.store.io": PACKAGE / "store" / "io.py"}) == {"ckpttool.store.io"}


def test_no_module_over_800_lines_and_no_function_over_100():
    offenders = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            offenders.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert offenders == []


def room(name: str) -> str:
    """Return the floor a module lives on: its package under ckpttool, or its own name when it is
    loose there ("" for ckpttool/__init__.py, the public API)."""
    return name.split(".")[1] if "." in name else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Return `a -> b` for every import of a room on the same floor or above."""
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if room(name) != room(target) and FLOORS.index(room(target)) >= FLOORS.index(room(name)))


def test_every_room_has_a_floor_and_no_package_imports_upward():
    known = modules()
    assert sorted({room(name) for name in known} - set(FLOORS)) == []
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert upward_imports(graph) == []


def test_the_floor_check_finds_an_import_of_a_higher_package():
    graph = {"ckpttool.core.errors": {"ckpttool.store.io"}, "ckpttool.store.io": {"ckpttool.core.errors"},
             "ckpttool.commands.x": {"ckpttool.commands.y", "ckpttool.load"}}
    assert upward_imports(graph) == ["ckpttool.commands.x -> ckpttool.load", "ckpttool.core.errors -> ckpttool.store.io"]


def test_at_most_eight_modules_loose_beside_the_packages():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_old_top_level_module_paths_import_the_moved_modules_in_a_fresh_interpreter():
    """Documented paths from before the packages (`ckpttool.distributed.sharing()`, `from ckpttool
    import storage`) give the very module at its new home, imported on first use."""
    import subprocess
    import sys

    code = ("import sys, ckpttool.distributed as old, ckpttool.run.distributed as new; "
            "from ckpttool import storage; from ckpttool.store import storage as home; "
            "assert old is new and storage is home and old.sharing; "
            "assert 'ckpttool.check.integrity' not in sys.modules; import ckpttool.integrity; "
            "assert sys.modules['ckpttool.integrity'] is sys.modules['ckpttool.check.integrity']")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
