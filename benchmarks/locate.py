"""Locating many small chunks: a DCP checkpoint of many real torch.save records, for timing
`consolidate` and `reshard` (where locating record headers dominates) on two trees.

    python benchmarks/locate.py --make /tmp/locate-ckpt [--tensors 800] [--world 64]
    python benchmarks/revisions.py --before /tmp/old --after . --path src=/tmp/locate-ckpt \\
        --case "consolidate=consolidate --quiet {src} {out}/m.safetensors" \\
        --case "reshard=reshard --quiet {src} {out}/w32 --world 32"
    PYTHONPATH=TREE python benchmarks/locate.py --time /tmp/locate-ckpt   # locate_chunks alone

`--make` writes `tensors` fp32 tensors of shape (2 * world, 64), each split along dim 0 over
`world` rank files (one 512-byte chunk per rank), as `ckpttool reshard` writes records
(`torchsave.record`, `dcp.writer.metadata_bytes`): tensors * world chunks, each a real
torch.save record torch's own loader reads. Data are seeded, so the checkpoint is the same
every time. `--time` prints the median seconds of `locating.locate_chunks` over all chunks in
this process (import from PYTHONPATH to pick the tree). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

ROWS_PER_CHUNK, COLUMNS = 2, 64


def make(path: Path, tensors: int, world_size: int) -> int:
    """Write the checkpoint under `path`; return its number of chunks."""
    from ckpttool.dcp.writer import StoredChunk, StoredTensor, data_file_name, metadata_bytes
    from ckpttool.torchsave.record import record_bytes

    rng = random.Random(0)
    files = [bytearray() for _ in range(world_size)]
    stored = []
    chunk_shape = (ROWS_PER_CHUNK, COLUMNS)
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = []
        for rank in range(world_size):
            record = record_bytes("float32", chunk_shape, rng.randbytes(ROWS_PER_CHUNK * COLUMNS * 4))
            name = data_file_name(rank)
            chunks.append(StoredChunk((rank * ROWS_PER_CHUNK, 0), chunk_shape, name, len(files[rank]), len(record)))
            files[rank] += record
        stored.append(StoredTensor(fqn, "float32", (world_size * ROWS_PER_CHUNK, COLUMNS), tuple(chunks)))
    path.mkdir(parents=True)
    for rank, data in enumerate(files):
        (path / data_file_name(rank)).write_bytes(data)
    planner_data = {tensor.fqn: (tensor.fqn,) for tensor in stored}
    (path / ".metadata").write_bytes(metadata_bytes(stored, [], planner_data, path, "locate-benchmark"))
    return tensors * world_size


def time_locate(path: Path, repeat: int) -> float:
    """Return the median seconds of locating every chunk of the checkpoint at `path`."""
    from ckpttool.dcp.blobs import DataFiles
    try:
        from ckpttool.run.locating import locate_chunks
    except ImportError:  # a tree from before locating had its own module
        from ckpttool.run.execute import locate_chunks
    from ckpttool.readers.dcp import read_checkpoint

    checkpoint = read_checkpoint(path)
    times = []
    for _ in range(repeat):
        with DataFiles(checkpoint.path) as files:
            started = time.perf_counter()
            locate_chunks(files, checkpoint.tensors.values(), threads=4)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", type=Path, metavar="DIR", help="write the checkpoint here")
    parser.add_argument("--time", type=Path, metavar="DIR", help="time locate_chunks on this checkpoint")
    parser.add_argument("--tensors", type=int, default=800)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.make:
        print(f"{make(args.make, args.tensors, args.world)} chunks in {args.world} files under {args.make}")
    if args.time:
        print(f"locate_chunks: {time_locate(args.time, args.repeat):.2f} s")


if __name__ == "__main__":
    main()
