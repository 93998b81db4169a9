"""Benchmark `ckpttool validate --numerics` against `cat` of the same data files to /dev/null.

The checkpoint is written by torch's own `dcp.save` (one process, no_dist) into a temporary
directory and deleted afterwards: half its bytes fp32 tensors, half bf16 (4 GB by default),
with a few NaN, zeros and subnormals so every path of the scan runs. Each command is its
own subprocess, warm page cache (every file read once first), the order alternating run
after run (as `paired.alternate`); the ratios are against `cat`'s medians, and the paired
ratios compare each run with the `cat` run beside it. CPU seconds (user + sys of the process)
are reported beside the wall: on a machine shared with other work the wall times wait for a
core, the CPU times do not. The tool runs from compiled bytecode (`tool_environment`), cached
under the work directory. Cold-cache runs need dropping the page cache
(root, `/proc/sys/vm/drop_caches`): with `--cold` each run starts from a dropped cache.

    python benchmarks/numerics.py                 # 4 GB, 3 runs each
    python benchmarks/numerics.py --gigabytes 1 --runs 5 --dir /tmp/bench   # keeps DIR/ckpt-1gb
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consolidate import checkpoint_bytes, machine  # noqa: E402

RUNS = 3
LAYER_BYTES = 128 << 20  # one tensor: 128 MiB (fp32 4096 x 8192, bf16 4096 x 16384)
CAT = "cat > /dev/null"


def make_checkpoint(directory: Path, gigabytes: float) -> None:
    """Write the checkpoint with torch's dcp.save from a child process (this one never imports
    torch: a forked child would start with its RSS)."""
    subprocess.run([sys.executable, __file__, "--make", str(directory), str(gigabytes)], check=True)


def _make(directory: str, gigabytes: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    layers = max(2, round(gigabytes * 1e9 / LAYER_BYTES))
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for k in range(layers):
        if k % 2:
            state[f"layers.{k}.weight"] = torch.randn(4096, 16384, generator=generator).to(torch.bfloat16)
        else:
            state[f"layers.{k}.weight"] = torch.randn(4096, 8192, generator=generator)
        state[f"layers.{k}.bias"] = torch.zeros(4096)
    state["layers.0.weight"][17, 3] = float("nan")
    state["layers.1.weight"][5, 5] = 1e-40
    dcp.save({"model": state}, checkpoint_id=directory, no_dist=True)


def drop_caches() -> bool:
    """Drop the page cache (needs root and a writable /proc/sys/vm/drop_caches); False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def tool_environment(root: Path) -> dict[str, str]:
    """The environment the tool runs in: as an installed ckpttool runs, from compiled bytecode
    (pip compiles it at install; an editable install under PYTHONDONTWRITEBYTECODE=1, as in
    this project's sessions, compiles ~60 modules from source on every run: ~0.1 s of CPU),
    cached under `root`, not in the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return env


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Return (wall seconds, CPU seconds (user + sys), peak RSS bytes) of one subprocess."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"failed ({status}): {command}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def alternate(named: dict[str, list[str]], runs: int, clean: Callable[[], object],
              env: dict[str, str] | None = None) -> dict[str, list[tuple[float, float, int]]]:
    """Return name -> (wall, CPU, RSS) per run, the order reversed every other run."""
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in named}
    for run in range(runs):
        for name in (list(named) if run % 2 == 0 else list(reversed(named))):
            clean()
            results[name].append(timed(named[name], env))
    return results


def table(results: dict[str, list[tuple[float, float, int]]], baseline: str, size: int) -> str:
    """Return the markdown table: median wall and CPU, every run, GB/s, peak RSS, the ratios
    of the medians to the baseline's and the median of the run-by-run wall ratios."""
    wall0 = statistics.median(w for w, _, _ in results[baseline])
    cpu0 = statistics.median(c for _, c, _ in results[baseline])
    lines = [f"| what | median wall (s) | runs (s) | GB/s | median CPU (s) | peak RSS (MB) | wall vs {baseline} | "
             f"paired wall ratios, median | CPU vs {baseline} |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        wall = statistics.median(w for w, _, _ in runs)
        cpu = statistics.median(c for _, c, _ in runs)
        paired = statistics.median(w / b for (w, _, _), (b, _, _) in zip(runs, results[baseline]))
        lines.append(f"| {name} | {wall:.2f} | {', '.join(f'{w:.2f}' for w, _, _ in runs)} | {size / wall / 1e9:.2f} | "
                     f"{cpu:.2f} | {max(r for _, _, r in runs) / 1e6:.0f} | {wall / wall0:.2f}x | {paired:.2f}x | "
                     f"{cpu / cpu0:.2f}x |")
    return "\n".join(lines)


def commands(source: Path) -> dict[str, list[str]]:
    files = " ".join(str(p) for p in sorted(source.glob("*.distcp")))
    tool = str(Path(sys.executable).with_name("ckpttool"))
    # exit 1 is the verdict on the NaN the checkpoint holds, not a failure of the run
    validate = f"{tool} validate {source} --json"
    return {
        CAT: ["sh", "-c", f"cat {files} > /dev/null"],
        "ckpttool validate --numerics": ["sh", "-c", f"{validate} --numerics > /dev/null; test $? -eq 1"],
        "ckpttool validate --numerics --threads 1": ["sh", "-c", f"{validate} --numerics --threads 1 > /dev/null; test $? -eq 1"],
        "ckpttool validate --deep": ["sh", "-c", f"{validate} --deep > /dev/null"],
        "ckpttool validate --deep --numerics": ["sh", "-c", f"{validate} --deep --numerics > /dev/null; test $? -eq 1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="work directory; DIR/ckpt-<N>gb is reused when present (default: a temporary one)")
    parser.add_argument("--gigabytes", type=float, default=4)
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root only)")
    parser.add_argument("--make", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        _make(args.make[0], float(args.make[1]))
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-numerics-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        source = root / f"ckpt-{args.gigabytes:g}gb"
        if not (source / ".metadata").exists():
            make_checkpoint(source, args.gigabytes)
        size = checkpoint_bytes(source)
        if args.cold and not drop_caches():
            raise SystemExit("--cold: cannot write /proc/sys/vm/drop_caches (not root, or a container that forbids it)")
        subprocess.run(["sh", "-c", f"cat {source}/* > /dev/null"], check=True)  # warm the page cache
        env = tool_environment(root)
        named = commands(source)
        timed(named["ckpttool validate --numerics"], env)  # compiles the bytecode
        results = alternate(named, args.runs, clean=drop_caches if args.cold else (lambda: None), env=env)
        print(f"Machine: {machine()}\n")
        print(f"{size / 1e9:.2f} GB in {len(list(source.glob('*.distcp')))} data file(s) (dcp.save, half fp32, half bf16), "
              f"{'cold' if args.cold else 'warm'} page cache, {args.runs} runs each, load average before: "
              f"{os.getloadavg()[0]:.1f}\n")
        print(table(results, CAT, size))
        medians = {name: statistics.median(w for w, _, _ in runs) for name, runs in results.items()}
        print(f"\nthroughput: cat {size / medians[CAT] / 1e9:.2f} GB/s, validate --numerics "
              f"{size / medians['ckpttool validate --numerics'] / 1e9:.2f} GB/s")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
