"""Benchmark `ckpttool average` of 3 checkpoints (world 8, 4 and 2) into one .safetensors
against `cat` of the three inputs to /dev/null, in the same run (issue 47: <= 1.2x cat,
<= 300 MB peak RSS, at 4 GB per checkpoint).

The checkpoints are written by torch's own `dcp.save` on gloo ranks (benchmarks/consolidate.py's
`make_checkpoint`: fp32 tensors of ~128 MB sharded on dim 0, the last with an uneven row
count; each rank's values seeded by its rank, so the three differ). Each command runs under
`/usr/bin/time -v`, which gives its wall time and peak RSS. The page cache is warmed by
reading the inputs once; every row then reads from memory alike (when they fit in it), so
the comparison is of the work done on the bytes, not of the disk.

    python benchmarks/average.py                 # 4 GB per checkpoint (12 GB of inputs)
    python benchmarks/average.py --size 1        # 1 GB per checkpoint
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consolidate import checkpoint_bytes, machine, make_checkpoint  # noqa: E402  (a sibling script)

WORLDS = (8, 4, 2)


def measure(command: list[str] | str) -> tuple[float, int]:
    """Return (wall seconds, peak RSS bytes) of `command` as `/usr/bin/time -v` reports them."""
    shell = isinstance(command, str)
    argv = ["/usr/bin/time", "-v", "sh", "-c", command] if shell else ["/usr/bin/time", "-v", *command]
    started = time.perf_counter()
    result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {command}\n{result.stderr[-2000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", result.stderr)
    assert rss and clock, result.stderr
    timed = int(clock.group(1) or 0) * 3600 + int(clock.group(2)) * 60 + float(clock.group(3))
    return max(timed, 0.0) or wall, int(rss.group(1)) * 1024


def run(root: Path, gigabytes: int, repeats: int) -> list[tuple[str, float, int]]:
    sources = []
    for world in WORLDS:
        source = root / f"ckpt-world{world}"
        started = time.perf_counter()
        make_checkpoint(source, gigabytes, world)
        print(f"# {gigabytes} GB world {world}: dcp.save took {time.perf_counter() - started:.1f} s", file=sys.stderr)
        sources.append(source)
    data = [str(p) for source in sources for p in sorted(source.glob("*.distcp"))]
    subprocess.run(["cat", *data], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    tool = str(Path(sys.executable).with_name("ckpttool"))
    out = root / "avg.safetensors"
    commands = [
        ("cat of the 3 inputs > /dev/null", f"cat {' '.join(data)} > /dev/null"),
        ("ckpttool average -> .safetensors", [tool, "average", *map(str, sources), str(out), "--quiet", "--force"]),
        ("ckpttool average -> .safetensors, --threads 2",
         [tool, "average", *map(str, sources), str(out), "--quiet", "--force", "--threads", "2"]),
    ]
    rows = []
    for _ in range(repeats):
        for name, command in commands:
            wall, rss = measure(command)
            rows.append((name, wall, rss))
            print(f"# {name}: {wall:.2f} s, peak RSS {rss / 1e6:.0f} MB", file=sys.stderr)
    print(f"# inputs: {sum(checkpoint_bytes(s) for s in sources) / 1e9:.2f} GB; output {out.stat().st_size / 1e9:.2f} GB",
          file=sys.stderr)
    return rows


def table(rows: list[tuple[str, float, int]], gigabytes: int) -> str:
    floor = min(wall for name, wall, _ in rows if name.startswith("cat"))
    lines = [f"3 checkpoints of {gigabytes} GB (world {', '.join(map(str, WORLDS))}), fp32 -> one .safetensors",
             "", "| what | wall (s) | vs cat (best) | peak RSS |", "|---|---:|---:|---:|"]
    for name, wall, rss in rows:
        lines.append(f"| {name} | {wall:.2f} | {wall / floor:.2f}x | {rss / 1e6:.0f} MB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4, help="GB per checkpoint (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each command, interleaved (default 2)")
    parser.add_argument("--dir", help="work directory (default: a temporary directory under /tmp, removed)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-average-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(root, args.size, args.repeats)
        print(f"Machine: {machine()}\n")
        print(table(rows, args.size))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
