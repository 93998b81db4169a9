"""Benchmark how long the first command takes: `ckpttool --help`, `ckpttool export --help` (the
command with the most options: its module is imported only when it is named), `inspect`,
`validate` and `inspect --json` of the bundled example (fixtures/fsdp2_world3_uneven), each a
fresh process.

Against floors measured in the same run: `python -c pass` (the interpreter and site, with the
venv's .pth files), `python -c "import click"` (what any click CLI pays), `python -c "import
click, dataclasses, pathlib, ..."` (click and the standard library modules `inspect` of the example
imports: the floor of any command that keeps them, before a line of ckpttool runs) and `python -c
"import click, numpy"` (what a command that touches numpy pays: the integrity gate of a checkpoint
read as chunk tables, and --deep; a small checkpoint's validate does not). An editable install
(`pip install -e`, this venv's) adds a finder that site imports from a .pth in every process
(pathlib, importlib.util, re, urllib.parse...), which a regular install does not have: the
`python -S` rows run without site, with PYTHONPATH set to the venv's site-packages (and the
tree, for the commands), as a regular install would find them, so the floors and `inspect` and
`validate` are stated both ways. One more row runs inspect of the example through the library
without click (`python -S`: `ckpttool.inspect` and the text renderer, printed), against the floor
of the standard library modules it imports (`python -S -c "import dataclasses, pathlib, ..."`),
so the floor is stated without click too. With
`--base DIR` (a tree made by `git archive`) the same commands run from that tree too, so a
change is measured against what it replaces on the same machine in the same minutes:

    git -C /work/main archive HEAD | tar -x -C /tmp/startup-base
    cp ckpttool/readers/_dcpscan*.so /tmp/startup-base/ckpttool/readers/   # built, not tracked
    python benchmarks/startup.py --base /tmp/startup-base

Every command runs as the console script does (`from ckpttool.cli import main; main()`) with
PYTHONPATH set to its tree and the working directory outside both trees, the commands taking
turns run after run (the order reversed every other run); each row is the median wall time of
`--runs` runs, and the median CPU time (user + system) of the same runs, which a loaded machine
inflates less than wall time. Bytecode is cached as an installed package's is: in a temporary
PYTHONPYCACHEPREFIX, written by one untimed run of each row (PYTHONDONTWRITEBYTECODE, if set,
is dropped: without caches every module is compiled on every run). The load average is printed
with the table: on a shared machine the ratios are what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "fixtures" / "fsdp2_world3_uneven"
LAUNCH = "import sys; from ckpttool.cli import main; sys.argv[0] = 'ckpttool'; sys.exit(main())"  # the console script
TARGET_SECONDS = 0.1  # docs/performance.md: inspect and validate of the example
# click and what `inspect` of the example imports from the standard library (dataclasses brings
# inspect, ast, dis, tokenize; click datetime, uuid, platform, gettext; click's help texts locale;
# pathlib fnmatch, urllib.parse): `inspect --json` adds json, `validate` zlib
STDLIB = "click, dataclasses, pathlib, signal, mmap, heapq, bisect, locale, gc"
# what the library's inspect of the example imports from the standard library, without click
# (no signal or locale: the CLI's); the floor of the library row
LIBRARY_STDLIB = "dataclasses, pathlib, typing, threading, mmap, heapq, bisect, math, gc"
NO_SITE = "-S"  # the rows run as a regular install would: no site, no editable finder
NO_SITE_ROWS = ("ckpttool inspect EXAMPLE", "ckpttool validate EXAMPLE")  # also measured with python -S
# inspect of the example through the library, no click: `ckpttool.inspect` and the text renderer
# (render.py before render/ was split per command), printed as a library caller would
LIBRARY = ("import sys, ckpttool\n"
           "try:\n"
           "    from ckpttool.render.inspect import inspect_text\n"
           "except ImportError:\n"
           "    from ckpttool.render import inspect_text\n"
           "print(inspect_text(ckpttool.inspect(sys.argv[1])))")
LIBRARY_ROW = "ckpttool.inspect(EXAMPLE) + inspect_text, no click (python -S)"


def commands(example: Path) -> dict[str, list[str]]:
    """Return the measured command lines (after `python -c LAUNCH`), by row name; the rows of
    NO_SITE_ROWS again as `python -S` (name suffixed " (python -S)"), and LIBRARY_ROW (`-c`
    first: its own code instead of LAUNCH)."""
    rows = {
        "ckpttool --help": ["--help"],
        "ckpttool export --help": ["export", "--help"],  # one command's options, built when it is named
        "ckpttool inspect EXAMPLE": ["inspect", str(example)],
        "ckpttool validate EXAMPLE": ["validate", str(example)],
        "ckpttool inspect --json EXAMPLE": ["inspect", "--json", str(example)],
    }
    return {**rows, **{f"{row} (python -S)": [NO_SITE, *rows[row]] for row in NO_SITE_ROWS},
            LIBRARY_ROW: [NO_SITE, "-c", LIBRARY, str(example)]}


def site_packages() -> str:
    """The venv's site-packages (click, numpy): what a regular install puts on sys.path."""
    return sysconfig.get_paths()["purelib"]


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """Return (wall seconds, CPU seconds: user + system) of one run of `argv` (stdout
    discarded; it must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rows: dict[str, tuple[list[str], dict[str, str]]], runs: int,
            cwd: str) -> dict[str, list[tuple[float, float]]]:
    """Return row -> its (wall, CPU) times, the rows taking turns (order reversed every other
    run); one untimed run of each first warms the page cache and writes the bytecode caches."""
    for argv, env in rows.values():
        timed(argv, env, cwd)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for run in range(runs):
        for name in (list(rows) if run % 2 == 0 else list(reversed(rows))):
            times[name].append(timed(*rows[name], cwd))
    return times


def environment(tree: Path | None, pycache: str, no_site: bool = False) -> dict[str, str]:
    """The environment of a run: PYTHONPATH = `tree` (None: the interpreter's own paths; with
    `no_site`, for `python -S`, the site-packages after it), bytecode cached under `pycache`."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPYCACHEPREFIX"] = pycache
    paths = ([str(tree)] if tree is not None else []) + ([site_packages()] if no_site else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def floor_rows(pycache: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The floors by row name: each `python -c CODE` with site, then without (`python -S`,
    site-packages on PYTHONPATH: a regular install's paths, no editable finder)."""
    codes = {"python -c pass": "pass", 'python -c "import click"': "import click",
             f'python -c "import {STDLIB}"': f"import {STDLIB}", 'python -c "import click, numpy"': "import click, numpy"}
    rows = {name: ([sys.executable, "-c", code], environment(None, pycache)) for name, code in codes.items()}
    for name, code in list(codes.items())[:3]:
        rows[name.replace("python -c", "python -S -c")] = ([sys.executable, NO_SITE, "-c", code],
                                                           environment(None, pycache, no_site=True))
    rows[f'python -S -c "import {LIBRARY_STDLIB}"'] = ([sys.executable, NO_SITE, "-c", f"import {LIBRARY_STDLIB}"],
                                                       environment(None, pycache, no_site=True))
    return rows


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def table(times: dict[str, list[tuple[float, float]]], trees: list[str], floors: tuple[str, ...]) -> str:
    """Return the markdown table: each row's median wall and CPU time per tree, the ratios of
    this tree to the base, and this tree's wall time less the `python -c pass` floor."""
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in times.items()}
    based = "base" in trees
    headers = [f"{tree} wall (s) | {tree} CPU (s)" for tree in trees]
    headers += ["this / base wall | this / base CPU"] if based else []
    lines = ["| row | " + " | ".join(headers) + " | this wall - `python -c pass` (s) |",
             "|---" * (2 * len(trees) + (4 if based else 2)) + "|"]
    names = {floor: {tree: floor for tree in trees} for floor in floors}
    names.update({row: {tree: f"{row} [{tree}]" for tree in trees} for row in commands(EXAMPLE)})
    for row, by_tree in names.items():
        cells = [f"{wall[by_tree[tree]]:.3f} | {cpu[by_tree[tree]]:.3f}" for tree in trees]
        if based:
            this, base = by_tree["this"], by_tree["base"]
            cells.append(f"{wall[this] / wall[base]:.2f}x | {cpu[this] / cpu[base]:.2f}x")
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {wall[by_tree['this']] - wall[floors[0]]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a tree (git archive) to measure the same commands from, in the same run")
    parser.add_argument("--runs", type=int, default=21, help="runs of each row (median; at least 15)")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the checkpoint inspected and validated")
    args = parser.parse_args()
    if args.runs < 15:
        parser.error("--runs: at least 15")
    trees = {"this": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as pycache:
        # cwd outside both trees: `-c` puts the working directory first on sys.path
        rows = floor_rows(pycache)
        floors = tuple(rows)
        for tree_name, tree in trees.items():
            for row, argv in commands(args.example.resolve()).items():
                options, argv = ([NO_SITE], argv[1:]) if argv[:1] == [NO_SITE] else ([], argv)
                code, argv = (argv[1], argv[2:]) if argv[:1] == ["-c"] else (LAUNCH, argv)
                rows[f"{row} [{tree_name}]"] = ([sys.executable, *options, "-c", code, *argv],
                                                environment(tree, pycache, no_site=bool(options)))
        before = load_average()
        times = measure(rows, args.runs, cwd)
    print(f"{sys.executable} (Python {sys.version.split()[0]}), {args.runs} runs per row, "
          f"{os.cpu_count()} CPUs, load average {before} before, {load_average()} after")
    print(table(times, list(trees), floors))
    slow = [row for row in ("ckpttool inspect EXAMPLE", "ckpttool validate EXAMPLE")
            if statistics.median(w for w, _ in times[f"{row} [this]"]) > TARGET_SECONDS]
    print(f"target: inspect and validate of the example <= {TARGET_SECONDS} s wall: "
          + (f"missed by {', '.join(slow)} (on this machine, at this load)" if slow else "met"))


if __name__ == "__main__":
    main()
