"""Benchmark `ckpttool.open` + `get_tensor` and `ckpttool.load_into` on the 1 GB checkpoint.

The checkpoint is `benchmarks/consolidate.py`'s (real `dcp.save`, world 4, 8 fp32 tensors of
about 128 MB, each sharded on dim 0 into 4 chunks of 32 MB, one per data file). Measured
one after another in this run, each command its own subprocess (wall time; peak RSS is the
process's `ru_maxrss` from os.wait4), the page cache warmed first so every row reads memory:

- interpreter start: `python -c "import ckpttool, torch"` (what every Python row pays first);
- `cat` of the tensor's bytes: `dd` of each chunk's byte range with cat's 128 KiB reads;
- ckpttool.open + get_tensor of one tensor (also timed inside the process, after imports);
- torch today: `dcp_to_torch_save` to a .pt, then `torch.load` and take the tensor;
- load_into of a module holding the 8 tensors (allocated with `torch.empty`, so its pages are
  touched only when filled), against torch's `dcp.load(..., no_dist=True)` into the same
  module's state dict.

Each timed row runs `--repeat` times, the rows taking turns (median wall, largest RSS).

    python benchmarks/open.py                     # makes the checkpoint in a temp dir
    python benchmarks/open.py --dir /tmp/bench    # makes it there once and keeps it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from consolidate import checkpoint_bytes, machine, make_checkpoint  # noqa: E402

TENSOR = "model.layers.0.weight"
CAT_BLOCK = 128 << 10  # GNU cat's read size (coreutils io_blksize)

# child programs: each prints one JSON line on stdout
PEEK = """
import json, os, resource, sys, time
import ckpttool, torch
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
started, before = time.perf_counter(), rss()
import ckpttool.load  # what `ckpttool.open` imports on first use: the readers, the gate, the planners
imported = time.perf_counter()
with ckpttool.open(sys.argv[1]) as f:
    opened = time.perf_counter()
    rows = int(sys.argv[4])  # 0: the whole tensor; else get_slice(key)[:rows]
    tensor = f.get_slice(sys.argv[2])[:rows] if rows else f.get_tensor(sys.argv[2])
    done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the floor's buffer below
floor = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)  # the same bytes into fresh memory
view, at, floor_started = memoryview(floor.numpy()), 0, time.perf_counter()
for file, offset, length in json.loads(sys.argv[3]):
    fd = os.open(file, os.O_RDONLY)
    os.preadv(fd, [view[at:at + length]], offset)
    os.close(fd)
    at += length
print(json.dumps({"seconds": done - started, "import": imported - started, "open": opened - imported,
                  "get_tensor": done - opened, "floor": time.perf_counter() - floor_started, "rss_before": before, "peak": peak,
                  "nbytes": tensor.numel() * tensor.element_size()}))
"""
TORCH_PEEK = """
import json, sys, time
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
started, before = time.perf_counter(), rss()
dcp_to_torch_save(sys.argv[1], sys.argv[3])
tensor = torch.load(sys.argv[3], weights_only=True)["model"][sys.argv[2].split(".", 1)[1]]
print(json.dumps({"seconds": time.perf_counter() - started, "rss_before": before, "nbytes": tensor.numel() * tensor.element_size()}))
"""
MODULE = """
import json, sys, time
import ckpttool, torch
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096

class Layer(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape), requires_grad=False)

shapes = json.loads(sys.argv[2])
model = torch.nn.Module()
model.layers = torch.nn.ModuleList(Layer(shape) for shape in shapes)
before = rss()
started = time.perf_counter()
if sys.argv[3] == "ckpttool":
    assert ckpttool.load_into(model, sys.argv[1]) == ([], [])
else:
    import torch.distributed.checkpoint as dcp
    dcp.load({"model": model.state_dict()}, checkpoint_id=sys.argv[1], no_dist=True)
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"seconds": time.perf_counter() - started, "rss_before": before, "nbytes": nbytes}))
"""


def measure(command: list[str] | str, shell: bool = False) -> tuple[float, int, dict]:
    """Return (wall seconds, peak RSS bytes, the JSON line it printed or {}) of one subprocess."""
    started = time.perf_counter()
    process = subprocess.Popen(command, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"failed ({status}): {command}")
    lines = output.decode().strip().splitlines()
    return wall, usage.ru_maxrss * 1024, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def interleaved(commands: list[tuple[list[str] | str, bool]], repeat: int) -> list[tuple[float, float, int, dict]]:
    """`measure` each (command, shell) `repeat` times, taking turns (a load that comes and
    goes on a shared machine falls on every row alike): per command the median and the
    fastest wall, the largest RSS, and the median of each timing it printed."""
    runs: list[list] = [[] for _ in commands]
    for _ in range(repeat):
        for index, (command, shell) in enumerate(commands):
            runs[index].append(measure(command, shell))
    results = []
    for found in runs:
        timings = {key: statistics.median(run[2][key] for run in found) for key, value in found[-1][2].items()
                   if isinstance(value, float)}
        results.append((statistics.median(run[0] for run in found), min(run[0] for run in found),
                        max(run[1] for run in found), {**found[-1][2], **timings}))
    return results


def chunk_ranges(source: Path, rows: int | None = None) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of the raw bytes of TENSOR's first `rows` rows (all by default),
    chunk by chunk (no torch: ckpttool's locate)."""
    from ckpttool.run import locating
    from ckpttool.dcp.blobs import DataFiles
    from ckpttool.readers.dcp import read_checkpoint

    tensor = read_checkpoint(source).tensors[TENSOR]
    with DataFiles(source) as files:
        located = locating.locate_chunks(files, [tensor])[TENSOR]
    rows = tensor.shape[0] if rows is None else rows
    row_bytes = tensor.nbytes // tensor.shape[0]
    ranges = []
    for index, raw in sorted(located.items()):
        start, height = tensor.chunks[index].offsets[0], tensor.chunks[index].sizes[0]
        taken = min(height, max(0, rows - start))
        if taken:
            ranges.append((source / raw.file, raw.offset, taken * row_bytes))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where the checkpoint is made (kept); default: a temporary directory")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpttool-open-bench-"))
    source = root / "ckpt-1gb"
    try:
        if not (source / ".metadata").is_file():
            make_checkpoint(source, 1, 4)
        data_files = sorted(str(p) for p in source.glob("*.distcp"))
        subprocess.run(["cat", *data_files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        ranges = chunk_ranges(source)
        tensor_bytes = sum(length for _, _, length in ranges)
        from ckpttool.readers.dcp import read_checkpoint

        checkpoint = read_checkpoint(source)
        shapes = [list(checkpoint.tensors[f"model.layers.{i}.weight"].shape) for i in range(len(checkpoint.tensors))]
        model_bytes = sum(t.nbytes for t in checkpoint.tensors.values())
        python = sys.executable
        half = checkpoint.tensors[TENSOR].shape[0] // 2
        half_ranges = chunk_ranges(source, half)
        half_bytes = sum(length for _, _, length in half_ranges)

        def dd(found: list) -> str:
            return " ; ".join(f"dd if={file} of=/dev/null bs={CAT_BLOCK} iflag=skip_bytes,count_bytes skip={offset} "
                              f"count={length} status=none" for file, offset, length in found)

        def peek_command(found: list, rows: int) -> list[str]:
            return [python, "-c", PEEK, str(source), TENSOR, json.dumps([[str(f), o, n] for f, o, n in found]), str(rows)]

        (start_wall, start_fastest, start_rss, _), (cat_wall, cat_fastest, cat_rss, _), \
            (peek_wall, peek_fastest, _, peek), (half_cat_wall, half_cat_fastest, half_cat_rss, _), \
            (slice_wall, slice_fastest, _, sliced) = interleaved(
                [([python, "-c", "import ckpttool, torch"], False), (dd(ranges), True), (peek_command(ranges, 0), False),
                 (dd(half_ranges), True), (peek_command(half_ranges, half), False)], args.repeat)
        peek_rss, slice_rss = peek["peak"], sliced["peak"]  # the processes' peaks before they measured the floor
        out = root / "torch.pt"
        torch_wall, torch_rss, torch_peek = measure([python, "-c", TORCH_PEEK, str(source), TENSOR, str(out)])
        out.unlink(missing_ok=True)
        (load_wall, _, load_rss, load), (dcp_wall, _, dcp_rss, dcp_load) = interleaved(
            [([python, "-c", MODULE, str(source), json.dumps(shapes), kind], False) for kind in ("ckpttool", "dcp")],
            args.repeat)

        mb = 1e6
        print(f"Machine: {machine()}")
        print(f"Checkpoint: {checkpoint_bytes(source) / 1e9:.2f} GB, world 4; tensor {TENSOR}: "
              f"{tensor_bytes / mb:.0f} MB in {len(ranges)} chunks; model {model_bytes / 1e9:.2f} GB; "
              f"median of {args.repeat} runs\n")
        print("| what | wall (s) | in process, after imports (s) | peak RSS (MB) | RSS above imports (MB) |")
        print("|---|---:|---:|---:|---:|")
        print(f"| interpreter start (`import ckpttool, torch`) | {start_wall:.3f} | | {start_rss / mb:.0f} | |")
        print(f"| `cat` of the tensor's bytes (dd, 128 KiB reads) | {cat_wall:.3f} | | {cat_rss / mb:.0f} | |")
        print(f"| `cat` of its first half's bytes ({half_bytes / mb:.0f} MB) | {half_cat_wall:.3f} | | "
              f"{half_cat_rss / mb:.0f} | |")
        for name, wall, rss, inner in (("ckpttool.open + get_tensor", peek_wall, peek_rss, peek),
                                       (f"ckpttool.open + get_slice(...)[:{half}] ({half_bytes / mb:.0f} MB, "
                                        f"{len(half_ranges)} chunks)", slice_wall, slice_rss, sliced),
                                       ("torch today: dcp_to_torch_save + torch.load", torch_wall, torch_rss, torch_peek),
                                       ("ckpttool.load_into (8 tensors)", load_wall, load_rss, load),
                                       ("torch dcp.load(no_dist=True) into the module", dcp_wall, dcp_rss, dcp_load)):
            print(f"| {name} | {wall:.3f} | {inner['seconds']:.3f} | {rss / mb:.0f} | {(rss - inner['rss_before']) / mb:.0f} |")
        print()
        print(f"- open + get_tensor, whole process / (cat + interpreter start): "
              f"{peek_wall / (cat_wall + start_wall):.2f}x by the medians, "
              f"{peek_fastest / (cat_fastest + start_fastest):.2f}x by the fastest runs (acceptance: <= 1.2x)")
        print(f"- in process: importing ckpttool's loading modules {peek['import']:.3f} s, open {peek['open']:.3f} s, "
              f"get_tensor {peek['get_tensor']:.3f} s = {peek['get_tensor'] / cat_wall:.2f}x cat and "
              f"{peek['get_tensor'] / peek['floor']:.2f}x preadv of the same ranges into fresh memory "
              f"({peek['floor']:.3f} s: cat reuses one small buffer, a tensor's pages are faulted in once)")
        print(f"- open + get_slice of the first half, whole process / (cat of those bytes + interpreter start): "
              f"{slice_wall / (half_cat_wall + start_wall):.2f}x by the medians, "
              f"{slice_fastest / (half_cat_fastest + start_fastest):.2f}x by the fastest; in process "
              f"{sliced['get_tensor']:.3f} s = {sliced['get_tensor'] / sliced['floor']:.2f}x preadv of those bytes into "
              f"fresh memory; {(slice_rss - sliced['rss_before'] - half_bytes) / mb:.0f} MB above the slice")
        print(f"- open + get_tensor memory above the tensor: {(peek_rss - peek['rss_before'] - tensor_bytes) / mb:.0f} MB "
              f"above the interpreter's, {(peek_rss - start_rss - tensor_bytes) / mb:.0f} MB above the bare "
              "interpreter's peak (acceptance: <= 100 MB)")
        print(f"- load_into peak / model size: {(load_rss - load['rss_before']) / model_bytes:.2f}x counting what the "
              f"read added to the process, {load_rss / model_bytes:.2f}x with the interpreter and torch "
              f"(torch's dcp.load: {(dcp_rss - dcp_load['rss_before']) / model_bytes:.2f}x, "
              f"{dcp_rss / model_bytes:.2f}x) (acceptance: <= 1.2x)")
        print(f"- load_into wall / dcp.load wall: {load_wall / dcp_wall:.2f}x; get_tensor vs torch today: "
              f"{peek_wall / torch_wall:.2f}x the time")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
