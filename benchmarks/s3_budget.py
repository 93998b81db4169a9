"""GETs, wall and peak RSS of consolidate and reshard from `s3://` at `--max-memory 64MB` against
the default (512MB), both held to the bound files + bytes / 8 MiB + 8 GETs.

    python benchmarks/s3_budget.py [--dir /tmp/s3-latency] [--tensors 40] [--rows 1024] [--columns 2048]
                                   [--pairs 3] [--latency 0] [--before TREE]

The checkpoint (world 8, tensors x rows x columns fp32: 320 MiB by default, so it is ten times
half of 64MB, the span budget) is written once into --dir by 8 gloo processes with torch's
`dcp.save` (`tests/dcp_world.py`, shared with `s3_latency.py`), put into a moto S3 server on
127.0.0.1 and read through `tests/s3_proxy.py`'s LatencyProxy, which counts the GETs. Each run
is `python -m ckpttool ... --json` in a fresh process; the 64MB and default runs alternate
(`--pairs` pairs per command); the table gives medians, the 64MB / default ratios, and the
local run at 64MB (the same command on the directory: its RSS is the interpreter and plan
without any span). Every run's output must hash as the local run's. `--before TREE` (a
`git archive` of an older commit) adds that tree's 64MB runs. Timings are printed, never
asserted; the machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from s3_latency import BUCKET, PREFIX, build, ckpttool, serve  # noqa: E402
from s3_proxy import LatencyProxy  # noqa: E402

SMALL = "64MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "s3-latency")
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=3, help="alternating 64MB/default pairs per command (default 3)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the proxy adds to every request")
    parser.add_argument("--before", type=Path, help="an older tree (git archive) to run at 64MB as well")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build(args.dir, args.tensors, args.rows, args.columns)
    files = sorted(checkpoint.glob("*.distcp"))
    size = sum(f.stat().st_size for f in files)
    bound = len(files) + size // (8 << 20) + 8
    out = args.dir / "out-budget"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
               AWS_REGION="us-east-1")
    commands = ("consolidate", "reshard")
    local = {command: ckpttool(command, str(checkpoint), out, env, None, ["--max-memory", SMALL]) for command in commands}
    runs = [("64MB", None, ["--max-memory", SMALL]), ("default", None, [])]
    if args.before:
        runs.append(("64MB before", args.before, ["--max-memory", SMALL]))
    results: dict[tuple[str, str], list[dict]] = {}
    server, endpoint = serve(checkpoint)
    try:
        with LatencyProxy(endpoint, args.latency) as proxy:
            remote_env = dict(env, AWS_ENDPOINT_URL=proxy.endpoint)
            for _ in range(args.pairs):
                for command in commands:
                    for name, tree, extra in runs:
                        proxy.reset()
                        document = ckpttool(command, f"s3://{BUCKET}/{PREFIX}", out, remote_env, tree, extra)
                        document.update(gets=proxy.gets, load=os.getloadavg()[0],
                                        same=document["sha256"] == local[command]["sha256"])
                        results.setdefault((command, name), []).append(document)
    finally:
        server.stop()
    print(f"\nworld-8 checkpoint: {len(files)} files, {size / 1e6:.0f} MB (torch's dcp.save); moto on 127.0.0.1 behind "
          f"a counting proxy ({args.latency * 1000:.0f} ms added per request); bound files + bytes / 8 MiB + 8 = {bound} "
          f"GETs; medians of {args.pairs} alternating runs")
    print("| command | --max-memory | GETs | within bound | wall s | peak RSS MB | same bytes as local | load avg |")
    print("|---|---|---:|---|---:|---:|---|---:|")
    for command in commands:
        print(f"| {command} local | 64MB | 0 | - | {local[command]['wall']:.2f} | {local[command]['rss_mb']:.0f} | - | - |")
        for name, _, _ in runs:
            found = results[(command, name)]
            gets = max(run["gets"] for run in found)
            print(f"| {command} s3 | {name} | {gets} | {gets <= bound} | "
                  f"{statistics.median(run['wall'] for run in found):.2f} | "
                  f"{statistics.median(run['rss_mb'] for run in found):.0f} | {all(run['same'] for run in found)} | "
                  f"{statistics.median(run['load'] for run in found):.1f} |")
    for command in commands:
        small, default = results[(command, "64MB")], results[(command, "default")]
        wall = statistics.median(a["wall"] / b["wall"] for a, b in zip(small, default))
        rss = statistics.median(a["rss_mb"] / b["rss_mb"] for a, b in zip(small, default))
        print(f"{command}: 64MB / default: wall {wall:.2f}, peak RSS {rss:.2f}; "
              f"64MB RSS above the local run's {statistics.median(a['rss_mb'] for a in small) - local[command]['rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
