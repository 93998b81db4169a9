"""Benchmark `ckpttool manifest` against the floors of reading and of hashing the same bytes.

On the 4 GB world-8 fp32 checkpoint `benchmarks/consolidate.py` builds (real `dcp.save`, each
tensor sharded on dim 0), measured one after another in this run, warm page cache, each its
own subprocess (`paired.alternate`: the order alternates run after run):

- read floor: `cat` of every data file to /dev/null;
- hash floor: `sha256sum` of every data file, one process (one core), and one per core
  (`xargs -P`); and `hashlib.file_digest` in one thread (OpenSSL's SHA-256, the one
  ckpttool uses: coreutils' may not use the CPU's SHA extensions);
- ckpttool: `ckpttool manifest SRC -o FILE` (the model's tensors: the same bytes less the
  records' headers), with its default 4 threads.

    python benchmarks/manifest.py                    # builds the checkpoint in a temporary directory
    python benchmarks/manifest.py --dir /tmp/bench   # keeps (and reuses) DIR/ckpt-4gb
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consolidate import checkpoint_bytes, machine, make_checkpoint  # noqa: E402
from paired import alternate  # noqa: E402

GIGABYTES, WORLD_SIZE = 4, 8  # the 4 GB case of benchmarks/consolidate.py
RUNS = 3
HASHLIB = "import hashlib, sys\nfor name in sys.argv[1:]:\n    hashlib.file_digest(open(name, 'rb'), 'sha256')"


def commands(source: Path, out: Path) -> dict[str, list[str]]:
    files = " ".join(str(p) for p in sorted(source.glob("*.distcp")))
    ckpttool = str(Path(sys.executable).parent / "ckpttool")
    return {
        "cat > /dev/null (read floor)": ["sh", "-c", f"cat {files} > /dev/null"],
        "sha256sum (1 process)": ["sh", "-c", f"sha256sum {files} > /dev/null"],
        f"sha256sum ({os.cpu_count()} processes)": ["sh", "-c", f"printf '%s\\n' {files} | xargs -P {os.cpu_count()} -n 1 sha256sum > /dev/null"],
        # coreutils' sha256sum may not use the CPU's SHA extensions; hashlib (OpenSSL) does, as ckpttool
        "hashlib.file_digest (1 thread)": [sys.executable, "-c", HASHLIB, *map(str, sorted(source.glob("*.distcp")))],
        "ckpttool manifest": [ckpttool, "manifest", str(source), "-o", str(out), "--force", "--quiet"],
    }


def table(results: dict[str, list[tuple[float, int]]], data_bytes: int, floors: tuple[str, str]) -> str:
    """Return the markdown table: median wall, runs, GB/s of the data files' bytes, peak RSS,
    and the ratio of each median to the read floor's and to the one-process hash floor's."""
    medians = {name: statistics.median(s for s, _ in runs) for name, runs in results.items()}
    lines = [f"| what | median wall (s) | runs (s) | GB/s | peak RSS (MB) | vs {floors[0]} | vs {floors[1]} |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        wall = medians[name]
        lines.append(f"| {name} | {wall:.2f} | {', '.join(f'{s:.2f}' for s, _ in runs)} | {data_bytes / wall / 1e9:.2f} | "
                     f"{max(r for _, r in runs) / 1e6:.0f} | {wall / medians[floors[0]]:.2f}x | "
                     f"{wall / medians[floors[1]]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="work directory; DIR/ckpt-4gb is reused when present (default: a temporary one)")
    parser.add_argument("--runs", type=int, default=RUNS)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        source = root / f"ckpt-{GIGABYTES}gb"
        if not (source / ".metadata").exists():
            make_checkpoint(source, GIGABYTES, WORLD_SIZE)
        subprocess.run(["sh", "-c", f"cat {source}/* > /dev/null"], check=True)  # warm the page cache
        out = root / "manifest.json"
        named = commands(source, out)
        results = alternate(named, args.runs, clean=lambda: None)
        print(f"Machine: {machine()}\n")
        print(f"{checkpoint_bytes(source) / 1e9:.2f} GB in {len(list(source.glob('*.distcp')))} data files "
              f"(world {WORLD_SIZE}), warm page cache, {args.runs} runs each\n")
        print(table(results, checkpoint_bytes(source), ("cat > /dev/null (read floor)", "sha256sum (1 process)")))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
