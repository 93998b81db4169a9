"""Reliability soak (issue 32): a thousand seeded fault points, each run classified as identical
(byte-identical to the fault-free output), clean failure (one-line error, nothing at the
destination, the next run succeeds with no clean-up) or dirty.

    python benchmarks/soak.py --points 1000 --seed 1            # the soak; exits 1 on any dirty point
    python benchmarks/soak.py --seed 1 --only 417               # replay one point, with its logs kept
    python benchmarks/soak.py --minutes 30 --points 100000      # as many as fit in 30 minutes

Faults: SIGKILL or SIGTERM at a random time; the disk full at a random byte (tmpfs; needs root);
S3 faults at a random rate and mix through `tests/fault_proxy.py` (503 SlowDown, 500, resets
before and inside a response, bodies cut short, stalls past the read timeout); one torchrun rank
SIGKILLed. Commands: consolidate to .safetensors / Hub shards / .pt, reshard, export, import,
consolidate --merge-adapter, push to the loopback Hub; stores: local, s3 source, s3
destination, both (moto). The core is `tests/soak_harness.py` (tests/test_soak.py runs ~36 points spread over
every command, fault and store, and 12 disk-full ones).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import soak_harness  # noqa: E402


def report(outcome: soak_harness.Outcome, args: argparse.Namespace, work: Path) -> None:
    index = outcome.point.index
    if outcome.verdict == "dirty" or not args.quiet:
        print(f"{outcome.verdict:>13}  {outcome.point.describe()}  exit {outcome.code}, {outcome.seconds:.2f} s, "
              f"{outcome.injected} S3 faults" + (f"\n    replay: python benchmarks/soak.py --seed {args.seed} "
                                                f"--only {index}\n    " + "\n    ".join(outcome.reasons)
                                                if outcome.reasons else ""), flush=True)
    if outcome.verdict != "dirty":
        shutil.rmtree(work / "logs" / f"point-{index}", ignore_errors=True)
        shutil.rmtree(work / "logs" / f"point-{index}-next", ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, action="append", help="run only point N (repeatable)")
    parser.add_argument("--start", type=int, default=0, help="first point index")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting points after this long")
    parser.add_argument("--torchrun-share", type=float, default=0.02, help="share of points that kill a torchrun rank")
    parser.add_argument("--kinds", default="sigkill,sigterm,s3,disk-full",
                        help="faults drawn, comma-separated (tests/test_soak.py draws some only: replay with its kinds)")
    parser.add_argument("--work", type=Path, default=None, help="sources, outputs and logs (default: a temp dir)")
    parser.add_argument("--jobs", type=int, default=2, help="points run at once (one fault proxy each)")
    parser.add_argument("--quiet", action="store_true", help="print only dirty points and the tables")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: unmount the tmpfs, stop the servers
    work = args.work or Path(tempfile.mkdtemp(prefix="ckpttool-soak-"))
    indices = args.only or range(args.start, args.start + args.points)
    print(f"soak seed {args.seed}: {len(indices)} points in {work}; load average {os.getloadavg()[0]:.2f}", flush=True)
    outcomes = []
    start = time.monotonic()
    with soak_harness.Soak(work, args.seed, torchrun_share=args.torchrun_share, jobs=args.jobs,
                           kinds=tuple(args.kinds.split(","))) as soak:
        if not soak.mount_ok:
            print("disk-full points skipped: tmpfs cannot be mounted here (needs root and mount)", flush=True)
        workers: queue.Queue[int] = queue.Queue()
        for worker in range(args.jobs):
            workers.put(worker)

        def run(index: int) -> soak_harness.Outcome | None:
            if args.minutes is not None and time.monotonic() - start > args.minutes * 60:
                return None
            worker = workers.get()
            try:
                return soak.run_point(index, worker)
            finally:
                workers.put(worker)

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for outcome in pool.map(run, indices):
                if outcome is None:
                    continue
                outcomes.append(outcome)
                report(outcome, args, work)
    elapsed = time.monotonic() - start
    dirty = [o for o in outcomes if o.verdict == "dirty"]
    kills = [o for o in outcomes if o.leftovers_after_kill]
    print(f"\n{len(outcomes)} points in {elapsed / 60:.1f} min ({elapsed / max(len(outcomes), 1):.2f} s a point); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    phases: dict[str, float] = {}
    for outcome in outcomes:
        for name, seconds in outcome.phases.items():
            phases[name] = phases.get(name, 0.0) + seconds
    print("harness time per point: " + ", ".join(f"{name} {seconds / max(len(outcomes), 1):.2f} s"
                                                 for name, seconds in phases.items()))
    print(f"S3 faults injected: {sum(o.injected for o in outcomes)}; SIGKILLed runs that left temporaries or uploads "
          f"the next run removed: {len(kills)}\n")
    print(soak_harness.by_fault(outcomes) + "\n")
    print(soak_harness.table(outcomes))
    undone = [o for o in outcomes if o.undone]
    print(f"\nSIGKILLed mid-commit of a multi-file S3 output, the keys made visible listed in the commit record and "
          f"removed by the next run (no --force): {len(undone)}" +
          "".join(f"\n  --seed {args.seed} --only {o.point.index}: {o.point.describe()}, {o.undone} keys"
                  for o in undone))
    print(f"\ndirty: {len(dirty)}" + "".join(f"\n  --seed {args.seed} --only {o.point.index}: {o.point.describe()}"
                                            for o in dirty))
    if not args.work and not dirty:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
