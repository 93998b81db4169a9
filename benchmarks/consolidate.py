"""Benchmark `ckpttool consolidate` against torch's `dcp_to_torch_save` and a copy floor.

Creates FSDP-style fp32 checkpoints with real `dcp.save` (gloo, one process per rank, each
tensor a DTensor sharded on dim 0), then measures, one after another in this run, the wall
time and peak RSS of:

- torch: `dcp_to_torch_save(src, out.pt)` (loads everything, then torch.save)
- ckpttool -> .safetensors and ckpttool -> .pt (the installed CLI, `--quiet`)
- copy floor: `cat` of all .distcp files into one file (read + write of the same bytes),
  plus `sync` of that file, since ckpttool fsyncs its output before renaming it

Each command runs as its own subprocess; peak RSS is that process's `ru_maxrss` (os.wait4).
The page cache is warmed by reading the source once, so every row reads from memory alike.

    python benchmarks/consolidate.py                       # 1 GB (world 4) and 4 GB (world 8)
    python benchmarks/consolidate.py --sizes 1 --keep DIR  # one case, keep the files
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLUMNS = 8192  # fp32 columns per tensor row: 32 KiB rows
TENSOR_BYTES = 128 * 10**6  # about 128 MB per tensor; a 1 GB checkpoint has 8 of them
CASES = {1: 4, 4: 8}  # checkpoint GB -> world size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save_rank(rank: int, world_size: int, port: int, directory: str, total_bytes: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    rows = TENSOR_BYTES // (4 * COLUMNS)
    count = max(1, round(total_bytes / (rows * COLUMNS * 4)))
    state = {}
    generator = torch.Generator().manual_seed(rank)
    for index in range(count):
        # the last tensor has a row count that does not divide evenly, like real vocab sizes
        length = rows + (7 if index == count - 1 else 0)
        step = -(-length // world_size)
        start, end = min(rank * step, length), min(rank * step + step, length)
        local = torch.empty(end - start, COLUMNS).uniform_(generator=generator)
        state[f"layers.{index}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(length, COLUMNS), stride=(COLUMNS, 1)
        )
    dcp.save({"model": state}, checkpoint_id=directory)
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(directory: Path, gigabytes: int, world_size: int) -> None:
    """Write the checkpoint from a child process: this process must not import torch, since
    a forked child starts with its parent's RSS as its peak (ru_maxrss survives exec)."""
    subprocess.run([sys.executable, __file__, "--make", str(directory), str(gigabytes), str(world_size)], check=True)


def _make(directory: str, gigabytes: int, world_size: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_save_rank, args=(world_size, _free_port(), directory, gigabytes * 10**9), nprocs=world_size)


def measure(command: list[str] | str, shell: bool = False) -> tuple[float, int]:
    """Return (wall seconds, peak RSS bytes) of one subprocess."""
    started = time.perf_counter()
    process = subprocess.Popen(command, shell=shell, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"failed ({status}): {command}")
    return wall, usage.ru_maxrss * 1024


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def run_case(root: Path, gigabytes: int, world_size: int) -> list[tuple]:
    source = root / f"ckpt-{gigabytes}gb"
    started = time.perf_counter()
    make_checkpoint(source, gigabytes, world_size)
    print(f"# {gigabytes} GB world {world_size}: dcp.save took {time.perf_counter() - started:.1f} s", file=sys.stderr)
    size = checkpoint_bytes(source)
    data_files = sorted(str(p) for p in source.glob("*.distcp"))
    subprocess.run(["cat", *data_files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    out = root / "out"
    tool = str(Path(sys.executable).with_name("ckpttool"))
    runs = [
        ("copy floor: cat", f"cat {' '.join(data_files)} > {out}/copy.bin", True),
        ("copy floor: cat + sync", f"cat {' '.join(data_files)} > {out}/copy.bin && sync {out}/copy.bin", True),
        ("torch dcp_to_torch_save", [sys.executable, "-c",
            "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])", str(source), f"{out}/torch.pt"], False),
        ("ckpttool -> .safetensors", [tool, "consolidate", "--quiet", str(source), f"{out}/model.safetensors"], False),
        ("ckpttool -> .pt", [tool, "consolidate", "--quiet", str(source), f"{out}/model.pt"], False),
    ]
    rows = []
    for name, command, shell in runs:
        out.mkdir(exist_ok=True)
        wall, rss = measure(command, shell=shell)
        rows.append((gigabytes, world_size, size, name, wall, rss))
        print(f"# {name}: {wall:.2f} s, peak RSS {rss / 1e6:.0f} MB", file=sys.stderr)
        shutil.rmtree(out)
    shutil.rmtree(source)
    return rows


def table(rows: list[tuple]) -> str:
    lines = [
        "| checkpoint | what | wall (s) | vs torch | vs copy floor (cat + sync) | peak RSS | RSS / checkpoint |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for gigabytes, world_size, size, name, wall, rss in rows:
        same = [r for r in rows if r[0] == gigabytes]
        torch_wall = next(r[4] for r in same if r[3].startswith("torch"))
        floor = next(r[4] for r in same if r[3] == "copy floor: cat + sync")
        lines.append(
            f"| {size / 1e9:.2f} GB, world {world_size} | {name} | {wall:.2f} | {wall / torch_wall:.2f}x "
            f"| {wall / floor:.2f}x | {rss / 1e6:.0f} MB | {100 * rss / size:.1f}% |"
        )
    return "\n".join(lines)


def machine() -> str:
    from importlib.metadata import version

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.machine())
    return (
        f"{model}, {os.cpu_count()} cores, {memory / 2**30:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {version('torch')}, filesystem of {tempfile.gettempdir()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(CASES), choices=sorted(CASES))
    parser.add_argument("--dir", help="work directory (default: a temporary directory under /tmp)")
    parser.add_argument("--make", nargs=3, metavar=("DIR", "GB", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        _make(args.make[0], int(args.make[1]), int(args.make[2]))
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = []
        for gigabytes in args.sizes:
            rows += run_case(root, gigabytes, CASES[gigabytes])
        print(f"Machine: {machine()}\n")
        print(table(rows))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
