"""Scaling: consolidate and reshard with 1, 2 and 4 torchrun processes, and from/to S3.

    python benchmarks/scale.py --src /work/bench/ckpt4 [--processes 1 2 4] [--repeat 2]
    python benchmarks/scale.py --src /work/bench/ckpt4 --s3-src /work/bench/ckpt200m

Local part: each case runs as `python -m ckpttool ...` (1 process, no torch) and as
`torchrun --standalone --nproc-per-node P -m ckpttool ...`, alternating P on every repeat;
wall time, aggregate MB/s of tensor data, the largest per-process peak RSS (wait4's
ru_maxrss of the launcher covers its children) and the sha256 of every output file, which
must equal the single-process run's. Output goes to --out (default: beside the source).

S3 part (--s3-src, a smaller checkpoint): a moto S3 server on 127.0.0.1, the checkpoint
uploaded once, then `consolidate` local -> local, s3 -> local, local -> s3 (streamed, and
staged by --verify) and s3 -> s3, alternating: wall and peak RSS, the ratio to the local
run (the issue asks for within 1.5x of the local peak RSS) and the output's sha256. With
`--before TREE` (a `git archive` of an older commit) the s3 rows run that tree too.

Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sha256_tree(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digests = {}
    for file in files:
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            while block := handle.read(16 << 20):
                digest.update(block)
        digests[file.relative_to(path).as_posix() if path.is_dir() else file.name] = digest.hexdigest()
    return digests


def run(argv: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run argv; return (seconds, peak RSS MB of the largest process, stdout)."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = process.communicate()
    _, status, usage = os.wait4(process.pid, 0) if process.returncode is None else (0, 0, None)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(map(str, argv))}\n{err.decode()[-2000:]}")
    import resource

    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # max over every child so far
    return seconds, rss, out.decode()


def measure(argv: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Like `run`, but the peak RSS of this command alone (a fresh measuring parent)."""
    probe = ("import os, subprocess, sys, json, time\n"
             "t = time.perf_counter()\n"
             "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
             "out, err = p.communicate()\n"
             "import resource\n"
             "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "print(json.dumps({'code': p.returncode, 'seconds': time.perf_counter() - t, 'rss_kb': r,"
             " 'out': out.decode()[-20000:], 'err': err.decode()[-2000:]}))\n")
    result = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env,
                            cwd=(env or {}).get("PYTHONPATH"))  # the cwd comes first on sys.path: let PYTHONPATH win
    report = json.loads(result.stdout)
    if report["code"] != 0:
        raise SystemExit(f"failed ({report['code']}): {' '.join(map(str, argv))}\n{report['err']}")
    return report["seconds"], report["rss_kb"] / 1024, report["out"]


def command(processes: int, args: list[str]) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "ckpttool", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "ckpttool", *args]


def local_scaling(src: Path, out: Path, processes: list[int], repeat: int) -> None:
    cases = {
        "consolidate .safetensors": lambda o: ["consolidate", str(src), str(o / "m.safetensors"), "--quiet", "--json"],
        "reshard --world 4": lambda o: ["reshard", str(src), str(o / "w4"), "--world", "4", "--quiet", "--json"],
    }
    print(f"| case | processes | wall s (median of {repeat}) | aggregate MB/s | peak RSS per process MB | "
          "bytes per process | same sha256 as 1 process |")
    print("|---|---|---|---|---|---|---|")
    for name, args in cases.items():
        reference, rows = None, {p: [] for p in processes}
        for _ in range(repeat):
            for count in processes:
                target = out / "run"  # one path for all: reshard's .metadata records its destination
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                seconds, rss, stdout = measure(command(count, args(target)))
                document = json.loads(stdout.strip().splitlines()[-1])
                digests = sha256_tree(target)
                if count == 1:
                    reference = digests
                rows[count].append((seconds, rss, document, digests))
                shutil.rmtree(target)
        for count in processes:
            seconds = statistics.median(r[0] for r in rows[count])
            rss = max(r[1] for r in rows[count])
            document = rows[count][-1][2]
            total = document.get("tensor_bytes", 0)
            split = "/".join(f"{p['bytes'] / 1e6:.0f}M" for p in document.get("processes", []))
            same = all(r[3] == reference for r in rows[count]) if reference is not None else "n/a"
            print(f"| {name} | {count} | {seconds:.2f} | {total / seconds / 1e6:.0f} | {rss:.0f} | {split} | {same} |")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def s3_comparison(src: Path, out: Path, repeat: int, before: Path | None) -> None:
    from moto.server import ThreadedMotoServer
    import boto3

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                   AWS_ENDPOINT_URL=endpoint)
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        for file in sorted(src.iterdir()):
            client.upload_file(str(file), "bench", f"ckpt/{file.name}")
        local_out, s3_out = str(out / "s3bench.safetensors"), "s3://bench/out/model.safetensors"
        runs = {  # name: (source, target, extra args, tree)
            "local -> local": (str(src), local_out, [], None),
            "s3 -> local": ("s3://bench/ckpt", local_out, [], None),
            "local -> s3 (streamed)": (str(src), s3_out, [], None),
            "local -> s3 --verify (staged)": (str(src), s3_out, ["--verify"], None),
            "s3 -> s3 (streamed)": ("s3://bench/ckpt", s3_out, [], None),
        }
        if before is not None:
            runs["s3 -> local (before)"] = ("s3://bench/ckpt", local_out, [], before)
            runs["local -> s3 (before)"] = (str(src), s3_out, [], before)
        results = {name: [] for name in runs}
        for _ in range(repeat):
            for name, (source, target, extra, tree) in runs.items():
                run_env = dict(env, PYTHONPATH=str(tree)) if tree else env
                seconds, rss, _ = measure([sys.executable, "-m", "ckpttool", "consolidate", source, target, "--quiet",
                                           *extra], env=run_env)
                if target.startswith("s3://"):
                    digest = hashlib.sha256()
                    body = client.get_object(Bucket="bench", Key="out/model.safetensors")["Body"]
                    for block in iter(functools.partial(body.read, 8 << 20), b""):
                        digest.update(block)
                    client.delete_object(Bucket="bench", Key="out/model.safetensors")
                    results[name].append((seconds, rss, {"": digest.hexdigest()}))
                else:
                    results[name].append((seconds, rss, {"": sha256_tree(Path(target))[Path(target).name]}))
                    Path(target).unlink()
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"\nconsolidate of a {size / 1e6:.0f} MB checkpoint to .safetensors (moto S3 on 127.0.0.1), median of {repeat}")
        print("| case | wall s | MB/s | peak RSS MB | RSS / local | same sha256 |")
        print("|---|---|---|---|---|---|")
        local_rss = max(r[1] for r in results["local -> local"])
        reference = results["local -> local"][0][2]
        for name, rows in results.items():
            seconds = statistics.median(r[0] for r in rows)
            rss = max(r[1] for r in rows)
            print(f"| {name} | {seconds:.2f} | {size / seconds / 1e6:.0f} | {rss:.0f} | {rss / local_rss:.2f}x | "
                  f"{all(r[2] == reference for r in rows)} |")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, help="checkpoint for the local scaling runs (e.g. 4 GB, world 8)")
    parser.add_argument("--s3-src", type=Path, help="smaller checkpoint for the S3 comparison")
    parser.add_argument("--before", type=Path, help="an older source tree (git archive) to add S3 rows for")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, help="scratch directory (default: beside the source)")
    args = parser.parse_args()
    if args.src:
        out = args.out or args.src.parent / "scale-out"
        local_scaling(args.src, out, sorted(args.processes), args.repeat)
        shutil.rmtree(out, ignore_errors=True)
    if args.s3_src:
        out = args.out or args.s3_src.parent / "scale-out"
        out.mkdir(parents=True, exist_ok=True)
        s3_comparison(args.s3_src, out, args.repeat, args.before)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
