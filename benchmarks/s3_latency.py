"""Object storage at request latency: consolidate and reshard of an `s3://` checkpoint through
a proxy that adds a fixed delay to every request, against torch's own DCP loading through
s3torchconnector's `S3StorageReader`.

    python benchmarks/s3_latency.py [--dir /tmp/s3-latency] [--latency 0.02] [--tensors 40]
                                    [--rows 1024] [--columns 2048] [--before TREE] [--max-memory SIZE]

The checkpoint (world 8, tensors x rows x columns fp32: 320 MiB by default) is written once
into --dir by 8 gloo processes with torch's `dcp.save` (`tests/dcp_world.py`), uploaded to a
moto S3 server on 127.0.0.1 and read through `tests/s3_proxy.py`'s LatencyProxy at 0 ms and
at --latency per request. Each command runs as `python -m ckpttool ... --json` in a fresh
process: GETs counted by the proxy, ckpttool's own `requests` (data files only), its
`seconds`, MB/s of tensor data, peak RSS, and the sha256 of the output, which must equal the
local run's. s3torchconnector: `dcp_to_torch_save`'s loading (`_load_state_dict` with
`_EmptyStateDictLoadPlanner`, no_dist) of the whole checkpoint into memory, timed around the
load. `--before TREE` (a `git archive` of an older commit) runs that tree's ckpttool too.
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from s3_proxy import LatencyProxy  # noqa: E402
from scale import measure  # noqa: E402

BUCKET = "latency"
PREFIX = "w8"

TORCH_LOAD = """
import json, sys, time
from s3torchconnector import S3ClientConfig
from s3torchconnector._s3client import S3Client
from s3torchconnector.dcp import S3StorageReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
endpoint, url = sys.argv[1], sys.argv[2]
started = time.perf_counter()
reader = S3StorageReader("us-east-1", url)
reader.fs._client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
state = {}
_load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
seconds = time.perf_counter() - started
total = sum(t.numel() * t.element_size() for t in state["model"].values())
print(json.dumps({"seconds": seconds, "tensor_bytes": total}))
"""


def build(directory: Path, tensors: int, rows: int, columns: int) -> Path:
    """The world-8 checkpoint under `directory`, written by torch's dcp.save unless already there."""
    from dcp_world import write

    checkpoint = directory / f"w8-{tensors}x{rows}x{columns}"
    if not (checkpoint / ".metadata").exists():
        write(checkpoint, world=8, tensors=tensors, rows=rows, columns=columns)
    return checkpoint


def serve(checkpoint: Path):
    """Start moto on 127.0.0.1 holding the checkpoint at s3://BUCKET/PREFIX; return (server, endpoint)."""
    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]  # in process: no 300 MB of PUTs over HTTP
    for path in sorted(checkpoint.iterdir()):
        backend.put_object(BUCKET, f"{PREFIX}/{path.name}", path.read_bytes())
    return server, endpoint


def digest(path: Path) -> str:
    """sha256 over the files under `path` (or of the file), names included."""
    total = hashlib.sha256()
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file() and (file.name != ".metadata" or not path.is_dir()):  # .metadata names its directory
            total.update(file.name.encode())
            total.update(file.read_bytes())
    return total.hexdigest()


def ckpttool(command: str, source: str, out: Path, env: dict, tree: Path | None, extra: list[str]) -> dict:
    """Run one ckpttool command; return its JSON document plus wall, rss_mb and sha256."""
    args = ["consolidate", source, str(out / "m.safetensors")] if command == "consolidate" else \
        ["reshard", source, str(out / "w3"), "--world", "3"]
    args += extra
    run_env = dict(env, PYTHONPATH=str(tree)) if tree else env
    wall, rss, stdout = measure([sys.executable, "-m", "ckpttool", *args, "--quiet", "--json"], env=run_env)
    document = json.loads(stdout)
    written = out / ("m.safetensors" if command == "consolidate" else "w3")
    document.update(wall=wall, rss_mb=rss, sha256=digest(written))
    subprocess.run(["rm", "-rf", str(written)], check=True)
    return document


def torch_load(endpoint: str, env: dict) -> dict | str:
    """Load the whole checkpoint with torch's DCP loading through s3torchconnector; or why not."""
    result = subprocess.run([sys.executable, "-c", TORCH_LOAD, endpoint, f"s3://{BUCKET}/{PREFIX}"],
                            capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit {result.returncode}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "s3-latency")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added to every request (default 0.02)")
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--before", type=Path, help="an older tree (git archive) to run as well")
    parser.add_argument("--max-memory", help="ckpttool's --max-memory (default: its own, 512MB)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build(args.dir, args.tensors, args.rows, args.columns)
    files = sorted(checkpoint.glob("*.distcp"))
    size = sum(f.stat().st_size for f in files)
    bound = len(files) + size // (8 << 20) + 8
    out = args.dir / "out"
    out.mkdir(exist_ok=True)
    base_env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                    AWS_REGION="us-east-1")
    extra = ["--max-memory", args.max_memory] if args.max_memory else []
    local = {command: ckpttool(command, str(checkpoint), out, base_env, None, extra)
             for command in ("consolidate", "reshard")}
    server, endpoint = serve(checkpoint)
    rows = []
    try:
        trees = [("ckpttool", None)] + ([("ckpttool before", args.before)] if args.before else [])
        for latency in (0.0, args.latency):
            with LatencyProxy(endpoint, latency) as proxy:
                env = dict(base_env, AWS_ENDPOINT_URL=proxy.endpoint)
                for name, tree in trees:
                    for command in ("consolidate", "reshard"):
                        proxy.reset()
                        started = time.perf_counter()
                        document = ckpttool(command, f"s3://{BUCKET}/{PREFIX}", out, env, tree, extra)
                        rows.append((f"{name} {command}", latency, proxy.gets, document.get("requests", "-"),
                                     document["seconds"], document["tensor_bytes"], document["rss_mb"],
                                     document["sha256"] == local[command]["sha256"], time.perf_counter() - started))
                proxy.reset()
                loaded = torch_load(proxy.endpoint, env)
                if isinstance(loaded, dict):
                    rows.append(("s3torchconnector S3StorageReader + torch DCP load", latency, proxy.gets, "-",
                                 loaded["seconds"], loaded["tensor_bytes"], None, None, None))
                else:
                    rows.append((f"s3torchconnector: failed: {loaded}", latency, proxy.gets, "-", None, None, None, None,
                                 None))
    finally:
        server.stop()
    print(f"\nworld-8 checkpoint: {len(files)} files, {size / 1e6:.0f} MB (written by torch's dcp.save); "
          f"moto on 127.0.0.1 behind a proxy adding {args.latency * 1000:.0f} ms per request; "
          f"bound files + bytes / 8 MiB + 8 = {bound} GETs; --max-memory {args.max_memory or 'default'}")
    print("| run | added latency | GETs (proxy) | `requests` | seconds | MB/s | peak RSS MB | same bytes as local |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, latency, gets, requests, seconds, nbytes, rss, same, _ in rows:
        speed = f"{nbytes / seconds / 1e6:.0f}" if seconds else "-"
        print(f"| {name} | {latency * 1000:.0f} ms | {gets} | {requests} | {seconds:.2f} | {speed} | "
              f"{'-' if rss is None else f'{rss:.0f}'} | {'-' if same is None else same} |" if seconds is not None
              else f"| {name} | {latency * 1000:.0f} ms | {gets} | - | - | - | - | - |")
    by_run = {(name, latency): row for row in rows for name, latency in [(row[0], row[1])]}
    for name in dict.fromkeys(row[0] for row in rows):
        fast, slow = by_run.get((name, 0.0)), by_run.get((name, args.latency))
        if fast and slow and fast[4] and slow[4]:
            print(f"{name}: MB/s at {args.latency * 1000:.0f} ms / at 0 ms = {fast[4] / slow[4]:.2f}")


if __name__ == "__main__":
    main()
