"""`locating.locate_chunks` on a large checkpoint read as ChunkTables, two revisions in one run:
every tensor, and a subset by fqn prefix (the model's tensors, as `consolidate` picks them).

    python benchmarks/locate_columns.py --path /work/frontier/70b-w128 --before main --after .

`--before`/`--after` are source trees or git refs of this repository (a ref is exported with
`git archive` to a scratch directory). A tree without the built C reader of `.metadata`
(`ckpttool/readers/_dcpscan*.so`, which gives the ChunkTables) gets the one of the other tree
when their `_dcpscan.c` are the same. Each measurement is a fresh subprocess importing its
tree (PYTHONPATH, run from a scratch directory so no tree in the cwd wins), the trees
alternating (A B A B ...); each prints the median of `--repeat` calls. Timings are never
asserted; on a machine shared with other jobs, run it twice.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNER = Path("ckpttool/readers")

CHILD = r"""
import statistics, sys, time
from ckpttool.core.checkpoint import ChunkTable
from ckpttool.dcp.blobs import DataFiles
try:
    from ckpttool.run.locating import locate_chunks
except ImportError:  # a tree from before locating had its own module
    from ckpttool.run.execute import locate_chunks
from ckpttool.readers.dcp import read_checkpoint

path, prefix, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])
checkpoint = read_checkpoint(path)
tensors = [tensor for tensor in checkpoint.tensors.values() if tensor.fqn.startswith(prefix)]
tables = sum(isinstance(tensor.chunks, ChunkTable) for tensor in tensors)
times = []
for _ in range(repeat):
    with DataFiles(checkpoint.path) as files:
        started = time.perf_counter()
        located = locate_chunks(files, tensors, threads=4)
        times.append(time.perf_counter() - started)
print(statistics.median(times), sum(len(found) for found in located.values()), tables, len(tensors))
"""


def tree(source: str, scratch: Path) -> Path:
    """Return the source tree `source` names: a directory, or a git ref exported under `scratch`."""
    if Path(source).is_dir():
        return Path(source).resolve()
    target = scratch / source.replace("/", "_")
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", source], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def scanner(tree: Path) -> Path | None:
    return next(iter(sorted((tree / SCANNER).glob("_dcpscan*.so"))), None)


def share_scanner(trees: list[Path]) -> None:
    """Give a tree without the built C reader the other's, when their sources are the same."""
    for missing, other in ((trees[0], trees[1]), (trees[1], trees[0])):
        built = scanner(other)
        if scanner(missing) is None and built is not None:
            if not filecmp.cmp(missing / SCANNER / "_dcpscan.c", other / SCANNER / "_dcpscan.c", shallow=False):
                sys.exit(f"{missing} has no built C reader and its _dcpscan.c differs from {other}'s: build it first")
            shutil.copy2(built, missing / SCANNER / built.name)


def measure(tree: Path, path: Path, prefix: str, repeat: int, cwd: Path) -> tuple[float, int, int, int]:
    environment = dict(os.environ, PYTHONPATH=str(tree))
    output = subprocess.run([sys.executable, "-c", CHILD, str(path), prefix, str(repeat)], env=environment, cwd=cwd,
                            check=True, capture_output=True, text=True).stdout.split()
    return float(output[0]), int(output[1]), int(output[2]), int(output[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", type=Path, required=True, help="a DCP checkpoint (large: read as ChunkTables)")
    parser.add_argument("--before", required=True, help="source tree or git ref")
    parser.add_argument("--after", default=".", help="source tree or git ref")
    parser.add_argument("--prefix", action="append", help="fqn prefixes to time besides all tensors (default: model.)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="locate-columns-") as scratch:
        trees = [tree(args.before, Path(scratch)), tree(args.after, Path(scratch))]
        share_scanner(trees)
        selections = ["", *(args.prefix or ["model."])]
        results: dict[tuple[str, int], list[float]] = {}
        counts: dict[str, tuple[int, int, int]] = {}
        for _ in range(args.rounds):
            for selection in selections:
                for side, source in enumerate(trees):
                    seconds, chunks, tables, tensors = measure(source, args.path.resolve(), selection, args.repeat, Path(scratch))
                    results.setdefault((selection, side), []).append(seconds)
                    counts[selection] = (chunks, tables, tensors)
    print(f"locate_chunks on {args.path} (before {args.before}, after {args.after}; medians of {args.rounds} runs)")
    print(f"{'tensors':<12} {'chunks':>9} {'tables':>11} {'before s':>9} {'after s':>8} {'after/before':>13}")
    for selection in selections:
        before, after = (statistics.median(results[(selection, side)]) for side in (0, 1))
        chunks, tables, tensors = counts[selection]
        print(f"{(selection or 'all') + ('*' if selection else ''):<12} {chunks:>9} {f'{tables}/{tensors}':>11} "
              f"{before:>9.3f} {after:>8.3f} {after / before:>13.2f}")


if __name__ == "__main__":
    main()
