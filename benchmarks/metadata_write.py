"""How long `dcp.writer.metadata_bytes` takes for reshard's `.metadata` at world 256.

    python benchmarks/metadata_write.py [--repeat 3] [--scale 1.0]

The `.metadata` `reshard --world 256` writes for `frontier.py`'s `70b-w128` checkpoint (70B
Llama, 723 parameters, 2,892 tensors: the model weight, AdamW's `exp_avg` and `exp_avg_sq`,
split along dim 0 by torch.chunk for 256 ranks, and a 0-d `step`): 339,456 chunks of the 2,169
big tensors (128 of a (128, 64) matrix, 256 of an (8192,) norm) and one of each of the 723
steps, in 256 files `__{rank}_0.distcp`, plus the 12 `optim.param_groups.0.*` objects.

Times, in this process and alternating run by run, the same entries given as
- before: each tensor's chunks a tuple of `StoredChunk` (one object per chunk),
- after: each tensor's chunks a `StoredChunks` (numpy columns, as reshard's plan holds them),
checks the two `.metadata` are the same bytes, and prints the median seconds of each and
their ratio. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frontier.py, beside this file

from frontier import LLAMA_70B, PARAM_GROUP, dim0_chunks, entries, planner_key, scaled  # noqa: E402

SOURCE_WORLD_SIZE = 128  # frontier's 70b-w128: shapes scaled to 64 fp32 elements per source rank
WORLD_SIZE = 256


def stored_entries(scale: float):
    """Return (tensors with StoredChunks, objects, planner_data) of the world-256 `.metadata`."""
    import numpy as np

    from ckpttool.dcp.writer import StoredChunks, StoredObject, StoredTensor, data_file_name
    from ckpttool.torchsave.record import record_layout

    files = tuple(data_file_name(rank) for rank in range(WORLD_SIZE))
    ends = [0] * WORLD_SIZE
    objects = []
    for key in (*PARAM_GROUP, "params"):
        objects.append(StoredObject(f"optim.param_groups.0.{key}", files[0], ends[0], 1024))
        ends[0] += 1024
    record_lengths: dict[tuple[int, ...], int] = {}
    tensors, steps = [], 0
    for fqn, shape in entries(scaled(LLAMA_70B, scale), True, SOURCE_WORLD_SIZE):
        if shape is None:  # a 0-d step
            boxes = [(steps % WORLD_SIZE, ((), ()))]
            steps += 1
        else:
            boxes = list(enumerate(dim0_chunks(shape, WORLD_SIZE)))
        ranks, offsets = [], []
        for rank, (_, sizes) in boxes:
            length = record_lengths.get(sizes)
            if length is None:
                length = record_lengths[sizes] = record_layout("float32", sizes).length
            ranks.append(rank)
            offsets.append(ends[rank])
            ends[rank] += length
        ndim = len(shape or ())
        chunks = StoredChunks(
            offsets=np.array([box[0] for _, box in boxes], dtype=np.int64).reshape(len(boxes), ndim),
            sizes=np.array([box[1] for _, box in boxes], dtype=np.int64).reshape(len(boxes), ndim),
            files=files,
            file=np.array(ranks, dtype=np.int64),
            offset=np.array(offsets, dtype=np.int64),
            length=np.array([record_lengths[box[1]] for _, box in boxes], dtype=np.int64),
        )
        tensors.append(StoredTensor(fqn, "float32", shape or (), chunks))
    names = [tensor.fqn for tensor in tensors] + [obj.fqn for obj in objects]
    return tensors, objects, {fqn: planner_key(fqn) for fqn in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (median)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the layers to keep (quick runs)")
    args = parser.parse_args()

    from dataclasses import replace

    from ckpttool.dcp.writer import metadata_bytes

    columns, objects, planner_data = stored_entries(args.scale)
    tuples = [replace(tensor, chunks=tuple(tensor.chunks)) for tensor in columns]
    chunk_count = sum(len(tensor.chunks) for tensor in columns)
    destination = Path("/checkpoints/70b-w256")
    cases = {"before: tuples of StoredChunk": tuples, "after: StoredChunks": columns}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    written: dict[str, bytes] = {}
    for _ in range(args.repeat):
        for name, tensors in cases.items():
            started = time.perf_counter()
            written[name] = metadata_bytes(tensors, objects, planner_data, destination, "benchmark")
            seconds[name].append(time.perf_counter() - started)
    before, after = written.values()
    if before != after:
        raise SystemExit("the two .metadata differ")
    baseline = statistics.median(next(iter(seconds.values())))
    print(f"{len(columns)} tensors, {chunk_count} chunks, {len(after)} bytes of .metadata "
          f"(median of {args.repeat} runs)")
    print("| chunks given as | seconds | x before |")
    print("|---|---:|---:|")
    for name, found in seconds.items():
        median = statistics.median(found)
        print(f"| {name} | {median:.3f} | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
