"""Whole-process timings for the benchmarks: each command in its own subprocess (wall time, its
peak RSS), the commands alternating order run after run, and the table of medians against a
baseline measured in the same run.

    results = alternate({"cat": ["sh", "-c", "cat a > b"], "ours": ["ckpttool", ...]}, runs=3, clean=remove_outputs)
    print(table(results, "cat"))
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Callable, Mapping


def timed(command: list[str]) -> tuple[float, int]:
    """Run `command` (stdout discarded), then `sync`; return (wall seconds, peak RSS bytes of the child)."""
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); subprocess.run('sync'); "
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code, *command], check=True, capture_output=True, text=True).stdout
    seconds, rss = out.split()
    return float(seconds), int(rss)


def alternate(commands: Mapping[str, list[str]], runs: int,
              clean: Callable[[], None]) -> dict[str, list[tuple[float, int]]]:
    """Return name -> (seconds, peak RSS) of each run of each command, the order reversed every
    other run (the second of a pair pays for the first's writeback); `clean` after each."""
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    for run in range(runs):
        for name in (list(commands) if run % 2 == 0 else list(reversed(commands))):
            results[name].append(timed(commands[name]))
            clean()
            subprocess.run("sync", shell=True, check=True)
    return results


def table(results: Mapping[str, list[tuple[float, int]]], baseline: str) -> str:
    """Return the markdown table of median wall, every run, peak RSS, the ratio to `baseline`'s
    median, and the median of the run-by-run ratios (run k against the baseline's run k, which
    ran right beside it: the disk's and the load's drift over the run cancels in each pair)."""
    floor = statistics.median(s for s, _ in results[baseline])
    lines = [f"| what | median wall (s) | runs (s) | peak RSS (MB) | vs {baseline} | paired ratios, median |",
             "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        wall = statistics.median(s for s, _ in runs)
        paired = statistics.median(s / b for (s, _), (b, _) in zip(runs, results[baseline]))
        lines.append(f"| {name} | {wall:.2f} | {', '.join(f'{s:.2f}' for s, _ in runs)} | "
                     f"{max(r for _, r in runs) / 1e6:.0f} | {wall / floor:.2f}x | {paired:.2f}x |")
    return "\n".join(lines)
