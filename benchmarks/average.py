"""Benchmark `ckpttool average` of 3 checkpoints (world 8, 4 and 2) into one .safetensors
against `cat` of the three inputs to /dev/null, in the same run (issue 47: <= 1.2x cat,
<= 300 MB peak RSS, at 4 GB per checkpoint).

The checkpoints are written by torch's own `dcp.save` on gloo ranks (benchmarks/consolidate.py's
`make_checkpoint`: fp32 tensors of ~128 MB sharded on dim 0, the last with an uneven row
count; each rank's values seeded by its rank, so the three differ). Each command runs under
`/usr/bin/time -v`, which gives its wall time and peak RSS. The page cache is warmed by
reading the inputs once; every row then reads from memory alike (when they fit in it), so
the comparison is of the work done on the bytes, not of the disk. The output, though, is
written and fsynced: a floor row adds to `cat` a write of the output's size with fsync, and a
row writing to tmpfs (/dev/shm) shows the work without the disk. CPU seconds (user + sys) are
reported beside the wall: on a machine shared with other work the wall waits for a core.
The tool runs from compiled bytecode (`tool_environment`), cached under the work directory.
With `--dir`, the checkpoints are kept and reused by later runs.

    python benchmarks/average.py                 # 4 GB per checkpoint (12 GB of inputs)
    python benchmarks/average.py --size 1        # 1 GB per checkpoint
    python benchmarks/average.py --size 1 --dir /tmp/bench   # keeps DIR/ckpt-1gb-world*
    python benchmarks/average.py --size 1 --dir /tmp/bench --cold   # every command from a dropped page cache (root)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consolidate import checkpoint_bytes, machine, make_checkpoint  # noqa: E402  (a sibling script)
from numerics import drop_caches, tool_environment  # noqa: E402

WORLDS = (8, 4, 2)


def measure(command: list[str] | str, env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Return (wall seconds, CPU seconds (user + sys), peak RSS bytes) of `command` as
    `/usr/bin/time -v` reports them."""
    argv: list[str] = ["/usr/bin/time", "-v", "sh", "-c", command] if isinstance(command, str) else \
        ["/usr/bin/time", "-v", *command]
    started = time.perf_counter()
    result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {command}\n{result.stderr[-2000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", result.stderr)
    user = re.search(r"User time \(seconds\): ([\d.]+)", result.stderr)
    system = re.search(r"System time \(seconds\): ([\d.]+)", result.stderr)
    assert rss and clock and user and system, result.stderr
    timed = int(clock.group(1) or 0) * 3600 + int(clock.group(2)) * 60 + float(clock.group(3))
    return max(timed, 0.0) or wall, float(user.group(1)) + float(system.group(1)), int(rss.group(1)) * 1024


def run(root: Path, gigabytes: int, repeats: int, cold: bool = False) -> list[tuple[str, float, float, int]]:
    sources = []
    for world in WORLDS:
        source = root / f"ckpt-{gigabytes}gb-world{world}"
        if not (source / ".metadata").exists():  # kept from an earlier run with --dir: the same inputs
            started = time.perf_counter()
            make_checkpoint(source, gigabytes, world)
            print(f"# {gigabytes} GB world {world}: dcp.save took {time.perf_counter() - started:.1f} s", file=sys.stderr)
        sources.append(source)
    data = [str(p) for source in sources for p in sorted(source.glob("*.distcp"))]
    subprocess.run(["cat", *data], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    tool = str(Path(sys.executable).with_name("ckpttool"))
    out = root / "avg.safetensors"
    average = [tool, "average", *map(str, sources), str(out), "--quiet", "--force"]
    env = tool_environment(root)
    measure(average, env)  # compiles the bytecode; the output's size for the write floor
    output_mib = -(-out.stat().st_size // (1 << 20))
    commands: list[tuple[str, list[str] | str]] = [
        ("cat of the 3 inputs > /dev/null", f"cat {' '.join(data)} > /dev/null"),
        # what any tool writing the output pays on top: its bytes written and fsynced
        ("floor: cat of the inputs + dd of the output's size, fsynced",
         f"cat {' '.join(data)} > /dev/null && dd if=/dev/zero of={root / 'floor.bin'} bs=1M count={output_mib} "
         "conv=fsync status=none"),
        ("ckpttool average -> .safetensors", average),
        ("ckpttool average -> .safetensors, --threads 2", [*average, "--threads", "2"]),
    ]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):  # no disk: the work on the bytes alone
        commands.append(("ckpttool average -> .safetensors on tmpfs (/dev/shm)",
                         [tool, "average", *map(str, sources), str(shm / f"ckpttool-bench-{os.getpid()}.safetensors"),
                          "--quiet", "--force"]))
    rows = []
    for _ in range(repeats):
        for name, command in commands:
            if cold and not drop_caches():  # every input read from the disk: the cost of the reads themselves
                raise SystemExit("--cold: cannot write /proc/sys/vm/drop_caches (not root, or a container that forbids it)")
            wall, cpu, rss = measure(command, env)
            rows.append((name, wall, cpu, rss))
            print(f"# {name}: {wall:.2f} s, CPU {cpu:.2f} s, peak RSS {rss / 1e6:.0f} MB", file=sys.stderr)
    print(f"# inputs: {sum(checkpoint_bytes(s) for s in sources) / 1e9:.2f} GB; output {out.stat().st_size / 1e9:.2f} GB",
          file=sys.stderr)
    (shm / f"ckpttool-bench-{os.getpid()}.safetensors").unlink(missing_ok=True)
    (root / "floor.bin").unlink(missing_ok=True)
    return rows


def table(rows: list[tuple[str, float, float, int]], gigabytes: int) -> str:
    """Return the markdown table: per command the median wall and CPU time of its runs, every
    run's wall, the median's ratio to cat's median, and the largest peak RSS."""
    names = list(dict.fromkeys(name for name, *_ in rows))
    runs = {name: [row[1:] for row in rows if row[0] == name] for name in names}
    floor = statistics.median(wall for wall, _, _ in runs[names[0]])
    lines = [f"3 checkpoints of {gigabytes} GB (world {', '.join(map(str, WORLDS))}), fp32 -> one .safetensors",
             "", "| what | median wall (s) | runs (s) | vs cat (medians) | median CPU (s) | peak RSS |",
             "|---|---:|---|---:|---:|---:|"]
    for name in names:
        wall = statistics.median(w for w, _, _ in runs[name])
        cpu = statistics.median(c for _, c, _ in runs[name])
        lines.append(f"| {name} | {wall:.2f} | {', '.join(f'{w:.2f}' for w, _, _ in runs[name])} | "
                     f"{wall / floor:.2f}x | {cpu:.2f} | {max(r for _, _, r in runs[name]) / 1e6:.0f} MB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4, help="GB per checkpoint (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command, interleaved (default 3)")
    parser.add_argument("--dir", help="work directory (default: a temporary directory under /tmp, removed)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before every command (root only): inputs read from the disk")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-average-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = run(root, args.size, args.repeats, args.cold)
        print(f"Machine: {machine()}; page cache {'dropped before every command' if args.cold else 'warm'}\n")
        print(table(rows, args.size))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
