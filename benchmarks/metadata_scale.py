"""How `inspect --json` and `validate` scale to checkpoints with 100k+ chunks.

    python benchmarks/metadata_scale.py [--chunks 100000] [--tensors 1000]
    python benchmarks/metadata_scale.py --stages [--chunks 1100000 --tensors 2892 --ranks 512]

Builds a synthetic DCP checkpoint: torch's own metadata classes pickled exactly as
FileSystemWriter.finish does, `tensors` fp32 tensors each split along dim 0 into
`chunks / tensors` chunks over 8 rank files, with data files sized to match (sparse, so no
bytes are written). Then times, in this session, each as a fresh subprocess:

- baseline: `python -c "import torch.distributed.checkpoint"` + torch's own
  FileSystemReader.read_metadata() (what any torch-based tool pays before doing anything)
- ckpttool inspect, ckpttool inspect --json
- ckpttool validate, ckpttool validate --json
and prints a table with ratios to the baseline.

`--stages` measures, in this process, only what comes after reading: the same checkpoint's
`Checkpoint` with each tensor's chunks as a `ChunkTable` (what `with_tables(read_checkpoint(...))`
gives, built here straight from columns so no metadata parser is timed), then each stage
(`integrity.check`, `inspect.build_report`, `render.inspect_text`, `render.inspect_document` +
`emit_json`, `validate_text`) with its wall time and peak RSS (sampled) over the RSS before it.
`--source DIR` puts DIR first on sys.path, to time another checkout's ckpttool in the same run.
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


def build_tables(path: Path, tensors: int, chunks: int, ranks: int):
    """Return the checkpoint `build(path, tensors, chunks, ranks)` describes, as
    `with_tables(read_checkpoint(path))` reads it, built from columns; writes only the sparse
    data files (no .metadata)."""
    import numpy as np

    from ckpttool.core.checkpoint import Checkpoint, ChunkTable, Tensor

    per_tensor = chunks // tensors
    length = ROWS_PER_CHUNK * COLUMNS * 4 + RECORD_OVERHEAD
    ends = np.zeros(ranks, dtype=np.int64)
    index = np.arange(per_tensor, dtype=np.int64)
    rank = (index % ranks).astype(np.int32)
    sizes = np.tile(np.array([ROWS_PER_CHUNK, COLUMNS], dtype=np.int64), (per_tensor, 1))
    files = tuple(f"__{r}_0.distcp" for r in range(min(ranks, per_tensor)))
    result = {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        offsets = np.zeros((per_tensor, 2), dtype=np.int64)
        offsets[:, 0] = index * ROWS_PER_CHUNK
        blob_offset = ends[rank] + (index // ranks) * length
        ends += np.bincount(rank, minlength=ranks) * length
        table = ChunkTable(offsets, sizes.copy(), rank.copy(), blob_offset, np.full(per_tensor, length, dtype=np.int64), files)
        result[fqn] = Tensor(fqn, "float32", (per_tensor * ROWS_PER_CHUNK, COLUMNS), table)
    path.mkdir(parents=True)
    for r, end in enumerate(ends.tolist()):
        with open(path / f"__{r}_0.distcp", "wb") as handle:
            handle.truncate(end)
    nesting = {k: tuple(k.split(".", 1)) for k in result}
    return Checkpoint(path, ".metadata", "1.0.0", result, {}, nesting), per_tensor * tensors


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def staged(name: str, work, results: list):
    """Run `work()`, appending (name, seconds, peak RSS MB above the RSS before it, peak RSS MB)."""
    import threading

    before = peak = rss_mb()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    value = work()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    peak = max(peak, rss_mb())
    results.append((name, seconds, peak - before, peak))
    return value


def stages(args) -> None:
    if args.source:
        sys.path.insert(0, args.source)
    import ckpttool
    from ckpttool.check import integrity
    from ckpttool.commands import inspect as inspect_command
    try:
        from ckpttool.render import inspect as render, text as render_text, validate as render_validate
    except ImportError:  # a --source checkout from before the render package (one render.py)
        from ckpttool import render
        render_text = render_validate = render
    from ckpttool.commands.validate import ValidationReport

    results: list = []
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint, chunks = staged("build tables (not ckpttool)",
                                    lambda: build_tables(Path(scratch) / "synthetic", args.tensors, args.chunks, args.ranks), results)
        found = staged("integrity.check", lambda: integrity.check(checkpoint), results)
        assert not found.errors, found.errors[:3]
        report = staged("inspect.build_report", lambda: inspect_command.build_report(checkpoint), results)
        staged("render.inspect_text", lambda: len(render.inspect_text(report)), results)
        staged("render.inspect_text --chunks --by-file", lambda: len(render.inspect_text(report, chunks=True, by_file=True)), results)
        with open(os.devnull, "w") as sink:  # as to stdout: the document is never held whole
            staged("render.inspect_document + emit_json", lambda: render_text.emit_json(render.inspect_document(report), sink), results)

        def validate_text():
            validation = ValidationReport(checkpoint.path, False, found.problems, tensors=len(checkpoint.tensors),
                                          chunks=sum(len(t.chunks) for t in checkpoint.tensors.values()), files=found.files)
            return render_validate.validate_text(validation)

        staged("render.validate_text", validate_text, results)
    print(f"ckpttool from {Path(ckpttool.__file__).parent}; {args.tensors} tensors, {chunks} chunks in {args.ranks} "
          f"files, {os.cpu_count()} cores")
    print(f"{'stage':44} {'wall s':>8} {'+peak RSS MB':>13} {'peak RSS MB':>12}")
    for name, seconds, extra, peak in results:
        print(f"{name:44} {seconds:8.2f} {extra:13.0f} {peak:12.0f}")


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
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--stages", action="store_true", help="time the stages after reading, in this process")
    parser.add_argument("--source", help="with --stages: a directory holding the ckpttool package to time")
    args = parser.parse_args()
    if args.stages:
        stages(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "synthetic"
        chunks = build(path, args.tensors, args.chunks, args.ranks)
        size = (path / ".metadata").stat().st_size
        python = sys.executable
        baseline_code = (
            "import sys; from torch.distributed.checkpoint import FileSystemReader; "
            "FileSystemReader(sys.argv[1]).read_metadata()"
        )
        rows = [
            ("torch: import + read_metadata (baseline)", [python, "-c", baseline_code, str(path)]),
            ("ckpttool inspect", [python, "-m", "ckpttool", "inspect", str(path)]),
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
