"""Compare two source trees of ckpttool on the same commands, alternating runs (A B A B ...).

    python benchmarks/revisions.py --before /tmp/old --after . --repeat 3 \
        --case "consolidate 4 GB=consolidate --quiet {ckpt4} {out}/m.safetensors" \
        --case "reshard 1 GB=reshard --quiet {ckpt1} {out}/w3 --world 3"

Each run is a fresh `python -m ckpttool ...` subprocess with PYTHONPATH set to the tree, so
both trees run on the same interpreter, packages, checkpoint and page cache; the output
directory is emptied between runs. Wall time and the child's own peak RSS (`os.wait4`'s
`ru_maxrss`) are reported as medians, with after/before ratios. `{name}` placeholders are
filled from `--path name=PATH`; `{out}` is a scratch directory. Timings are never asserted.

To make the checkpoints: `python benchmarks/consolidate.py --make DIR GB WORLD` (dcp.save on
gloo) or `python benchmarks/reshard.py --dir DIR` (which keeps its source under DIR/source).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from locate_columns import share_scanner  # benchmarks/ is on sys.path when run as a script


def measure(tree: Path, arguments: list[str]) -> tuple[float, int]:
    """Return (wall seconds, peak RSS bytes) of `python -m ckpttool ARGUMENTS` from `tree`."""
    # PYTHONSAFEPATH: `-m` would otherwise put the working directory first on sys.path, so run
    # from inside a tree (as above: `--after .`) both sides would import that tree
    environment = dict(os.environ, PYTHONPATH=str(tree.resolve()), PYTHONSAFEPATH="1")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "ckpttool", *arguments], env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    error = process.stderr.read().decode()
    process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{tree}: ckpttool {' '.join(arguments)} failed: {error.strip()}")
    return seconds, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the baseline")
    parser.add_argument("--after", type=Path, required=True, help="source tree under test")
    parser.add_argument("--case", action="append", required=True, metavar="NAME=ARGS", help="ckpttool arguments")
    parser.add_argument("--path", action="append", default=[], metavar="NAME=PATH", help="placeholder values")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    values = dict(item.split("=", 1) for item in args.path)
    # a tree without the built C reader would read large .metadata as tuples, not tables, and
    # time another path: it gets the other tree's when their sources are the same
    share_scanner([args.before.resolve(), args.after.resolve()])
    rows = []
    for case in args.case:
        name, _, command = case.partition("=")
        results: dict[str, list[tuple[float, int]]] = {"before": [], "after": []}
        trees = [("before", args.before), ("after", args.after)]
        for repeat in range(args.repeat):
            # the order alternates and the disk is flushed between runs: a run that follows
            # another one's 4 GB of writes pays for their writeback (a 1.1-1.2x bias otherwise)
            for label, tree in trees if repeat % 2 == 0 else trees[::-1]:
                out = Path(tempfile.mkdtemp(prefix="ckpttool-revisions-", dir=values.get("scratch")))
                try:
                    arguments = shlex.split(command.format(out=out, **values))
                    results[label].append(measure(tree, arguments))
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
        wall = {label: statistics.median(s for s, _ in runs) for label, runs in results.items()}
        rss = {label: statistics.median(r for _, r in runs) for label, runs in results.items()}
        rows.append((name, wall["before"], wall["after"], rss["before"], rss["after"]))
    print("| case | wall before s | wall after s | after/before | RSS before MB | RSS after MB | after/before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, wall_before, wall_after, rss_before, rss_after in rows:
        print(f"| {name} | {wall_before:.2f} | {wall_after:.2f} | {wall_after / wall_before:.2f}x | "
              f"{rss_before / 1e6:.0f} | {rss_after / 1e6:.0f} | {rss_after / rss_before:.2f}x |")


if __name__ == "__main__":
    main()
