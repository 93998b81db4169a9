"""How `inspect --json` and `validate` scale to checkpoints with 100k+ chunks.

    python benchmarks/metadata_scale.py [--chunks 100000] [--tensors 1000]

Builds a synthetic DCP checkpoint: torch's own metadata classes pickled exactly as
FileSystemWriter.finish does, `tensors` fp32 tensors each split along dim 0 into
`chunks / tensors` chunks over 8 rank files, with data files sized to match (sparse, so no
bytes are written). Then times, in this session, each as a fresh subprocess:

- baseline: `python -c "import torch.distributed.checkpoint"` + torch's own
  FileSystemReader.read_metadata() (what any torch-based tool pays before doing anything)
- ckpttool inspect --json
- ckpttool validate
and prints a table with ratios to the baseline.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORD_OVERHEAD = 1600  # bytes a torch.save record adds around a chunk's data
ROWS_PER_CHUNK, COLUMNS = 4, 64


def build(path: Path, tensors: int, chunks: int, ranks: int = 8) -> int:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    per_tensor = chunks // tensors
    state, storage, ends = {}, {}, [0] * ranks
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        entries = []
        for c in range(per_tensor):
            offsets = torch.Size([c * ROWS_PER_CHUNK, 0])
            entries.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS_PER_CHUNK, COLUMNS])))
            rank = c % ranks
            length = ROWS_PER_CHUNK * COLUMNS * 4 + RECORD_OVERHEAD
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(f"__{rank}_0.distcp", ends[rank], length)
            ends[rank] += length
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([per_tensor * ROWS_PER_CHUNK, COLUMNS]), entries
        )
    metadata = Metadata(state_dict_metadata=state, storage_data=storage, version="1.0.0",
                        planner_data={k: tuple(k.split(".", 1)) for k in state})
    path.mkdir(parents=True)
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    for rank, end in enumerate(ends):
        with open(path / f"__{rank}_0.distcp", "wb") as handle:
            handle.truncate(end)
    return per_tensor * tensors


def timed(command: list[str], repeat: int) -> tuple[float, float]:
    """Return (median seconds, peak RSS MB) of running `command` `repeat` times."""
    times, peaks = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        result = subprocess.run(
            ["/usr/bin/time", "-f", "%M", *command], capture_output=True, text=True
        ) if os.path.exists("/usr/bin/time") else subprocess.run(command, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if result.returncode not in (0,):
            raise SystemExit(f"{command} failed: {result.stderr[-2000:]}")
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        peaks.append(int(last) / 1024 if last.isdigit() else float("nan"))
    return statistics.median(times), max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "synthetic"
        chunks = build(path, args.tensors, args.chunks)
        size = (path / ".metadata").stat().st_size
        python = sys.executable
        baseline_code = (
            "import sys; from torch.distributed.checkpoint import FileSystemReader; "
            "FileSystemReader(sys.argv[1]).read_metadata()"
        )
        rows = [
            ("torch: import + read_metadata (baseline)", [python, "-c", baseline_code, str(path)]),
            ("ckpttool inspect --json", [python, "-m", "ckpttool", "inspect", "--json", str(path)]),
            ("ckpttool validate", [python, "-m", "ckpttool", "validate", str(path)]),
            ("ckpttool validate --json", [python, "-m", "ckpttool", "validate", "--json", str(path)]),
        ]
        results = [(name, *timed(command, args.repeat)) for name, command in rows]
    base = results[0][1]
    print(f"synthetic checkpoint: {args.tensors} tensors, {chunks} chunks, .metadata {size / 1e6:.1f} MB, "
          f"{os.cpu_count()} cores, median of {args.repeat} runs")
    print(f"{'command':44} {'wall s':>8} {'x baseline':>11} {'peak RSS MB':>12}")
    for name, seconds, peak in results:
        print(f"{name:44} {seconds:8.2f} {seconds / base:11.2f} {peak:12.0f}")


if __name__ == "__main__":
    main()
