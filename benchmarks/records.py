"""Benchmark the executor on reshard's common case: 340k small records, as one `Record` op per
record (before) and as `Records` ops of a few hundred records each (after).

    python benchmarks/records.py [--dir /tmp/records-bench] [--files 128] [--per-file 2200]
                                 [--records 340000] [--per-op 256] [--threads 4]

1. Writes a synthetic source: `--files` data files of `--per-file` torch.save records each
   (bf16 (32, 32), seeded random data, laid end to end as DCP lays them), once.
2. Plans a 128 -> 256 reshard of it: target rank 2s takes the first half of the rows of
   source file s's records, rank 2s+1 the second half, `--records` records in all; each
   output file is written by Records ops of `--per-op` records, or by their `records()`.
3. Runs each case in a fresh process under `/usr/bin/time -f '%e %M'` (wall, peak RSS):
   the process builds its operations, then times `execute.run` alone, and prints it.
4. Compares the outputs of both cases byte for byte (a digest of every output file).

Prints a markdown table. Timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

DTYPE, SOURCE_SHAPE = "bfloat16", (32, 32)
TARGET_SHAPE = (SOURCE_SHAPE[0] // 2, *SOURCE_SHAPE[1:])  # half the rows of a source record


def make_source(directory: Path, files: int, per_file: int) -> None:
    """Write `files` data files of `per_file` records each, seeded (skipped when present)."""
    from ckpttool.torchsave.record import record_bytes, record_layout

    marker = directory / f"source-{files}x{per_file}.done"
    if marker.exists():
        return
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    data_length = record_layout(DTYPE, SOURCE_SHAPE).data_length
    generator = random.Random(0)
    for index in range(files):
        with open(directory / f"__{index}_0.distcp", "wb") as handle:
            for _ in range(per_file):
                handle.write(record_bytes(DTYPE, SOURCE_SHAPE, generator.randbytes(data_length)))
    marker.touch()


def plan(files: int, per_file: int, records: int, per_op: int) -> list:
    """Return the Records ops of the reshard (see the module docstring), in output order."""
    from ckpttool.plan.operations import Records
    from ckpttool.torchsave.record import record_layout

    source = record_layout(DTYPE, SOURCE_SHAPE)
    half = source.data_length // 2
    outputs = 2 * files
    per_output = records // outputs
    if per_output > per_file:
        raise SystemExit(f"--records {records} needs {per_output} records per source file; it has {per_file}")
    target_length = record_layout(DTYPE, TARGET_SHAPE).length
    operations = []
    for rank in range(outputs):
        source_file, second = f"__{rank // 2}_0.distcp", rank % 2
        for first in range(0, per_output, per_op):
            count = min(per_op, per_output - first)
            numbers = range(first, first + count)
            operations.append(Records(
                f"out_{rank}", first * target_length, ((DTYPE, TARGET_SHAPE),), (0,) * count,
                tuple(f"layers.{n}.weight" for n in numbers), (second * TARGET_SHAPE[0],) * count,
                (source_file,) * count,
                tuple(n * source.length + source.data_offset + second * half for n in numbers)))
    return operations


def run_case(case: str, directory: Path, output: Path, args: argparse.Namespace) -> None:
    """In a fresh process: build the case's operations, run them, print the run's seconds."""
    from ckpttool.run import execute
    from ckpttool.dcp.blobs import DataFiles

    operations = plan(args.files, args.per_file, args.records, args.per_op)
    if case == "before":
        operations = [record for op in operations for record in op.records()]
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    sizes: dict[str, int] = {}
    for op in operations:
        end = op.offset + (op.length if case == "after" else _record_length(op))
        sizes[op.dst] = max(sizes.get(op.dst, 0), end)
    fds = {name: os.open(output / name, os.O_RDWR | os.O_CREAT, 0o644) for name in sorted(sizes)}
    try:
        for name, fd in fds.items():
            execute.reserve(fd, sizes[name])
        with DataFiles(directory) as files:
            started = time.perf_counter()
            execute.run(operations, files, fds, threads=args.threads, max_memory=512 << 20)
            seconds = time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)
    print(json.dumps({"seconds": seconds, "operations": len(operations)}))


def _record_length(op) -> int:
    from ckpttool.torchsave.record import record_layout

    return record_layout(op.dtype, op.shape).length


def digest(output: Path) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for path in sorted(output.iterdir(), key=lambda p: int(p.name.split("_")[1])):
        hasher.update(path.name.encode() + b"\0" + path.read_bytes())
    return hasher.hexdigest()


def measure(case: str, args: argparse.Namespace) -> dict:
    command = ["/usr/bin/time", "-f", "%e %M", sys.executable, __file__, "--case", case,
               *(f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items() if name != "case")]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    wall, rss_kib = result.stderr.strip().splitlines()[-1].split()
    found = json.loads(result.stdout.strip().splitlines()[-1])
    found.update(wall=float(wall), rss=int(rss_kib) << 10, digest=digest(Path(args.dir) / f"out-{case}"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/records-bench")
    parser.add_argument("--files", type=int, default=128)
    parser.add_argument("--per-file", type=int, default=2200)
    parser.add_argument("--records", type=int, default=340_000)
    parser.add_argument("--per-op", type=int, default=256)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--case", choices=("before", "after"))
    args = parser.parse_args()
    root = Path(args.dir)
    if args.case:
        run_case(args.case, root / "source", root / f"out-{args.case}", args)
        return
    make_source(root / "source", args.files, args.per_file)
    subprocess.run(["cat", *map(str, (root / "source").glob("*.distcp"))], stdout=subprocess.DEVNULL, check=True)
    rows = {case: measure(case, args) for case in ("before", "after")}
    if rows["before"]["digest"] != rows["after"]["digest"]:
        raise SystemExit("the outputs differ: Records must write what its records() write")
    before = rows["before"]
    print(f"{args.records} records of {DTYPE} {list(TARGET_SHAPE)} from {args.files} files, "
          f"{args.per_op} a Records op, {args.threads} threads, {os.cpu_count()} CPUs; outputs identical\n")
    print("| case | operations | execute.run s | process wall s | peak RSS MB | run x before |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, row in rows.items():
        print(f"| {case} | {row['operations']} | {row['seconds']:.2f} | {row['wall']:.2f} | {row['rss'] / 1e6:.0f} | "
              f"{row['seconds'] / before['seconds']:.2f}x |")


if __name__ == "__main__":
    main()
