"""Benchmark `reshard` on a ~1 GB FSDP2 checkpoint: world 4 -> 3, against the copy floor.

    python benchmarks/reshard.py [--gib 1.0] [--world 4] [--to 3] [--dir /tmp/reshard-bench]

1. Writes a real checkpoint with torch's `dcp.save` from `fully_shard` on `--world` gloo ranks
   (a stack of square Linear layers, ~`--gib` GiB of fp32 weights).
2. Copy floor, measured in the same run: read every `.distcp` byte and write it to a new file
   (pread/pwrite in 8 MiB blocks, fsync), with the page cache dropped of the source first
   where possible (`posix_fadvise(DONTNEED)`).
3. `ckpttool reshard` in a subprocess (time, and peak RSS from `getrusage(RUSAGE_CHILDREN)`).
4. Load time at `--to` ranks: stock `dcp.load` into a `fully_shard`ed model, of the resharded
   checkpoint vs the original (DCP resharding at load time), and the bytes each rank reads.

Prints a markdown table. Timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

BLOCK = 8 << 20
DIM = 4096


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(layers: int, world_size: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(DIM, DIM, bias=True) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def worker(rank: int, world_size: int, port: int, job: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = build(job["layers"], world_size)
        state = {"model": model.state_dict()}
        if job["kind"] == "save":
            dcp.save(state, checkpoint_id=job["path"])
            return
        read: dict[str, int] = {}

        class CountingReader(FileSystemReader):
            def read_data(self, plan, planner):
                for item in plan.items:
                    info = self.storage_data[item.storage_index]
                    read[info.relative_path] = read.get(info.relative_path, 0) + info.length
                return super().read_data(plan, planner)

        dist.barrier()
        started = time.perf_counter()
        dcp.load(state, storage_reader=CountingReader(job["path"]))
        dist.barrier()
        seconds = time.perf_counter() - started
        Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"seconds": seconds, "read": read}))
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, job: dict) -> None:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world_size, free_port(), job), nprocs=world_size)


def drop_cache(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def copy_floor(source: Path, target: Path) -> float:
    """Seconds to read every data file of `source` and write it to `target` (read+write)."""
    target.mkdir()
    started = time.perf_counter()
    for path in sorted(source.glob("*.distcp")):
        src = os.open(path, os.O_RDONLY)
        dst = os.open(target / path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        offset = 0
        while data := os.pread(src, BLOCK, offset):
            os.pwrite(dst, data, offset)
            offset += len(data)
        os.fsync(dst)
        os.close(src)
        os.close(dst)
    return time.perf_counter() - started


def load_time(path: Path, layers: int, world_size: int, out: Path) -> tuple[float, list[dict]]:
    out.mkdir()
    spawn(world_size, {"kind": "load", "layers": layers, "path": str(path), "out": str(out)})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    return max(r["seconds"] for r in ranks), ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--to", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/reshard-bench"))
    args = parser.parse_args()
    layers = max(1, round(args.gib * (1 << 30) / ((DIM * DIM + DIM) * 4)))
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    source = args.dir / "source"
    spawn(args.world, {"kind": "save", "layers": layers, "path": str(source)})
    size = sum(p.stat().st_size for p in source.iterdir())

    drop_cache(source)
    floor = copy_floor(source, args.dir / "copy")
    drop_cache(source)
    # the CLI in a fresh process that reports its own peak RSS: VmHWM of its own address space
    # (RUSAGE_CHILDREN would include the ranks that wrote the checkpoint, and on Linux even
    # RUSAGE_SELF keeps the high-water mark of the forked copy of this torch-importing parent
    # from before exec)
    measure = ("import resource, sys\nfrom ckpttool.cli import main\ntry:\n    main()\nfinally:\n"
               "    try:\n"
               "        hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
               "    except OSError:\n"
               "        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
               "    print(hwm, file=sys.stderr)")
    command = [sys.executable, "-c", measure, "reshard", str(source), str(args.dir / "resharded"),
               "--world", str(args.to), "--quiet"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(result.stderr)
    peak_rss = int(result.stderr.split()[-1]) * 1024

    drop_cache(source)
    drop_cache(args.dir / "resharded")
    original_load, original_ranks = load_time(source, layers, args.to, args.dir / "load-original")
    drop_cache(source)
    drop_cache(args.dir / "resharded")
    resharded_load, resharded_ranks = load_time(args.dir / "resharded", layers, args.to, args.dir / "load-resharded")

    def files_read(ranks: list[dict]) -> str:
        return " / ".join(str(len(r["read"])) for r in ranks)

    gb = size / 1e9
    print(f"checkpoint: {gb:.2f} GB, world {args.world} -> {args.to}, {layers} x Linear({DIM}, {DIM}), {os.cpu_count()} cores\n")
    print("| measure | seconds | GB/s | note |")
    print("|---|---|---|---|")
    print(f"| copy floor (read + write every byte, same run) | {floor:.2f} | {gb / floor:.2f} | |")
    print(f"| `ckpttool reshard --world {args.to}` (whole process) | {seconds:.2f} | {gb / seconds:.2f} | "
          f"{seconds / floor:.2f}x floor, peak RSS {peak_rss / 2**20:.0f} MiB |")
    print(f"| `dcp.load` at {args.to} ranks, original world-{args.world} | {original_load:.2f} | {gb / original_load:.2f} | "
          f"files read per rank: {files_read(original_ranks)} |")
    print(f"| `dcp.load` at {args.to} ranks, resharded | {resharded_load:.2f} | {gb / resharded_load:.2f} | "
          f"files read per rank: {files_read(resharded_ranks)} |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
