"""How fast `ckpttool latest` finds the newest whole step of a run of hundreds of big steps.

    python benchmarks/latest.py [--steps 200] [--chunks 100000] [--tensors 1000] [--truncated 10] [--repeat 3]

Builds run folders of `steps` steps, each a synthetic DCP checkpoint of `chunks` chunks
(`metadata_scale.build`: torch's own metadata classes pickled as FileSystemWriter.finish does,
sparse data files of the right sizes). One `.metadata` is built and hard-linked into every
step (13.7 MB at 100k chunks: 200 distinct copies would be 2.7 GB of disk for the same bytes
read); each step has data files of its own. Three runs:

- `newest whole`: every step whole (the common case: the newest is read, no other);
- `killed saves`: every step but the oldest has data files and no `.metadata` (each save
  killed before torch wrote it): every step is looked at, by its folder listing;
- `truncated`: the newest `truncated` steps have their metadata but a data file one byte
  short, the next one whole: each of those has its metadata read and checked (the worst case:
  it scales linearly, so the table gives the cost per step, and 199 of them extrapolated).

Each is timed as a fresh `ckpttool latest` process (what a resume script pays), median of
`repeat`, beside baselines measured in the same run: `ckpttool validate` of one step, and
`ls -R` of the run folder. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metadata_scale import build  # noqa: E402  (the synthetic 100k-chunk checkpoint, built once)

BINARY = str(Path(sys.executable).parent / "ckpttool")


def step_name(index: int) -> str:
    return f"step-{index * 10}"  # unpadded: name order is not step order (step-100 < step-20)


def make_run(run: Path, template: Path, steps: int, without_metadata: int = 0, truncated: int = 0) -> None:
    """Write `steps` steps from `template` (its `.metadata` hard-linked, its data files made anew
    as sparse files of the same sizes); the newest `without_metadata` have no `.metadata`, the
    next newest `truncated` have one data file a byte short."""
    sizes = {path.name: path.stat().st_size for path in template.glob("*.distcp")}
    last = sorted(sizes)[-1]
    for index in range(1, steps + 1):
        step = run / step_name(index)
        step.mkdir(parents=True)
        newest_rank = steps - index  # 0: the newest step
        short = without_metadata <= newest_rank < without_metadata + truncated
        for name, size in sizes.items():
            with open(step / name, "wb") as handle:
                handle.truncate(size - 1 if short and name == last else size)
        if newest_rank >= without_metadata:
            os.link(template / ".metadata", step / ".metadata")


def timed(command: list[str], repeat: int, expect: tuple[int, ...] = (0,)) -> tuple[float, str]:
    """Return (median wall seconds, stdout of the last run) of `command` run `repeat` times."""
    times = []
    output = ""
    for _ in range(repeat):
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if result.returncode not in expect:
            raise SystemExit(f"{command} exited {result.returncode}: {result.stderr[-2000:]}")
        output = result.stdout
    return statistics.median(times), output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--truncated", type=int, default=10, help="steps with a short data file before the whole one")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="latest-bench-") as scratch:
        root = Path(scratch)
        chunks = build(root / "template", args.tensors, args.chunks, args.ranks)
        metadata_mb = (root / "template" / ".metadata").stat().st_size / 1e6
        make_run(root / "whole", root / "template", args.steps)
        make_run(root / "killed", root / "template", args.steps, without_metadata=args.steps - 1)
        make_run(root / "truncated", root / "template", args.steps, truncated=args.truncated)
        newest = root / "whole" / step_name(args.steps)

        seconds, _ = timed([BINARY, "validate", str(newest)], args.repeat)
        rows.append(("baseline: ckpttool validate (one step)", seconds, "1 metadata read"))
        seconds, _ = timed(["ls", "-R", str(root / "whole")], args.repeat)
        rows.append((f"baseline: ls -R (the run, {args.steps} steps)", seconds, "listing only"))
        for name, run, expected in (("newest whole", "whole", args.steps),
                                    ("killed saves", "killed", 1),
                                    ("truncated", "truncated", args.steps - args.truncated)):
            seconds, output = timed([BINARY, "latest", "--json", str(root / run)], args.repeat)
            document = json.loads(output)
            assert document["chosen"] == str(root / run / step_name(expected)), document["chosen"]
            looked = len(document["steps"])
            read = sum(1 for step in document["steps"] if step["verdict"] != "no-metadata")
            rows.append((f"ckpttool latest: {name}", seconds,
                         f"{looked} steps looked at, {read} metadata read; in-process {document['seconds']:.2f} s"))
        per_step = (rows[-1][1] - rows[2][1]) / max(1, args.truncated)
        worst = rows[2][1] + per_step * (args.steps - 1)
    print(f"{args.steps} steps of {chunks} chunks each ({args.tensors} tensors, {args.ranks} rank files, "
          f"{metadata_mb:.1f} MB .metadata); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"median of {args.repeat}, each a fresh process")
    print()
    print(f"| {'command':48} | {'wall s':>7} | {'x validate':>10} | what it read |")
    print(f"|{'-' * 50}|{'-' * 9}:|{'-' * 11}:|---|")
    for name, seconds, note in rows:
        print(f"| {name:48} | {seconds:7.3f} | {seconds / rows[0][1]:10.2f} | {note} |")
    print()
    print(f"each truncated step costs {per_step:.3f} s (its metadata read and checked); "
          f"{args.steps - 1} of them before the whole one: about {worst:.0f} s")


if __name__ == "__main__":
    main()
