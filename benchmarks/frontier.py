"""Frontier scale: Llama-shaped checkpoints saved from hundreds of ranks (issue 21).

    python benchmarks/frontier.py --dir /tmp/frontier                    # everything
    python benchmarks/frontier.py --dir /tmp/frontier --only 70b-w128 --repeat 3 \\
        --tree before=/tmp/before-main --tree after=.                    # A/B, interleaved
    python benchmarks/frontier.py --dir /tmp/frontier-small --scale 0.1  # quick: 8 layers

Four checkpoints, shaped as FSDP2 + `get_state_dict` + `dcp.save({"model": ..., "optim": ...})`
writes them: per parameter the model tensor, AdamW's `exp_avg` and `exp_avg_sq` (sharded
like the parameter, one chunk per rank along dim 0) and a 0-d `step` (one chunk), keyed by
fqn (`optim.state.<fqn>.<key>`), plus `optim.param_groups.0.*` objects:

- `70b-w512`: 70B Llama (80 layers, hidden 8192, intermediate 28672, vocab 128256, GQA with
  8 kv heads of 128: 723 parameters, 2,892 tensors) at world 512: 1,111,251 chunks;
- `405b-w1024`: 405B Llama (126 layers, hidden 16384, intermediate 53248, same vocab and kv
  heads: 1,137 parameters) at world 1,024: 3,493,965 chunks;
- `405b-w2560`: the 405B model at world 2,560 (320 nodes of 8): 7,139,100 chunks (at world
  2,048 it is 6.2M, the 8-kv-head matrices' 1,024 rows capping their chunk count);
  all three SPARSE: torch's own metadata classes pickled as `FileSystemWriter.finish` does (as
  `metadata_scale.py` builds them), records' lengths as `torchsave.record` lays them out for
  the real chunk shapes, data files truncated to size (no byte written). For metadata-only
  commands: `inspect`, `inspect --json`, `validate`.
- `70b-w128`: the 70B model at world 128 with REAL zero-filled torch.save records (written
  as `locate.py --make` writes them: `torchsave.record` + `dcp.writer.metadata_bytes`, objects
  by torch.save): the real chunk count (723 * 3 * 128 + 723 = 278,355 chunks, 92,544 of them
  in the model) with every tensor scaled down to 64 fp32 elements per rank, so each chunk is
  256 bytes: a matrix is (128, 64) (one row per rank), a norm vector (8192,) (64 per rank),
  24 MB of model data, 71 MB of tensors in all. For `consolidate` to .safetensors and
  `reshard --world 256`.

`--scale F` keeps F of the layers (world sizes unchanged) for quick runs. Checkpoints are
cached under `--dir` (a `NAME.complete` marker beside each, holding its chunk count): reruns do
not rebuild them.

Each command runs as a fresh subprocess under `/usr/bin/time` (wall, peak RSS, and CPU
seconds: on a shared machine the steadier measure); the baseline is torch's
`import torch.distributed.checkpoint` + `FileSystemReader.read_metadata` of the same
checkpoint (`--no-torch` skips it: torch holds 7M chunks in ~8 GB). With several `--tree LABEL=PATH` (a ckpttool source tree on
PYTHONPATH, e.g. a worktree of main) the trees alternate run by run; the table has one row
per command and tree, medians of `--repeat` runs, and the ratio to the baseline. Timings are
never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, in its order
PARAM_GROUP = {  # torch.optim.AdamW's defaults, as `get_state_dict` flattens param_groups[0]
    "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
    "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
    "fused": None, "decoupled_weight_decay": True,
}
REAL_ELEMENTS_PER_RANK = 64  # the world-128 checkpoint: 256-byte fp32 chunks


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    intermediate: int
    vocab: int = 128256
    kv_heads: int = 8
    head_dim: int = 128

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """Return (fqn, shape) of every parameter, in torchtitan's Llama order."""
        kv = self.kv_heads * self.head_dim
        found = [("tok_embeddings.weight", (self.vocab, self.hidden))]
        for layer in range(self.layers):
            prefix = f"layers.{layer}."
            found += [
                (prefix + "attention.wq.weight", (self.hidden, self.hidden)),
                (prefix + "attention.wk.weight", (kv, self.hidden)),
                (prefix + "attention.wv.weight", (kv, self.hidden)),
                (prefix + "attention.wo.weight", (self.hidden, self.hidden)),
                (prefix + "feed_forward.w1.weight", (self.intermediate, self.hidden)),
                (prefix + "feed_forward.w2.weight", (self.hidden, self.intermediate)),
                (prefix + "feed_forward.w3.weight", (self.intermediate, self.hidden)),
                (prefix + "attention_norm.weight", (self.hidden,)),
                (prefix + "ffn_norm.weight", (self.hidden,)),
            ]
        return found + [("norm.weight", (self.hidden,)), ("output.weight", (self.vocab, self.hidden))]


LLAMA_70B = Model(80, 8192, 28672)
LLAMA_405B = Model(126, 16384, 53248)


@dataclass(frozen=True)
class Case:
    name: str
    model: Model
    world_size: int
    real: bool  # real zero-filled records (conversions), else sparse (metadata only)


CASES = {case.name: case for case in (
    Case("70b-w512", LLAMA_70B, 512, real=False),
    Case("405b-w1024", LLAMA_405B, 1024, real=False),
    Case("405b-w2560", LLAMA_405B, 2560, real=False),
    Case("70b-w128", LLAMA_70B, 128, real=True),
)}


def scaled(model: Model, scale: float) -> Model:
    return Model(max(1, round(model.layers * scale)), model.hidden, model.intermediate,
                 model.vocab, model.kv_heads, model.head_dim)


def entries(model: Model, real: bool, world_size: int) -> list[tuple[str, tuple[int, ...] | None]]:
    """Return (fqn, shape) of every tensor in state-dict order (shape None: a 0-d step), with
    shapes scaled to REAL_ELEMENTS_PER_RANK per rank when `real`."""
    params = model.parameters()
    if real:
        params = [(fqn, (world_size, REAL_ELEMENTS_PER_RANK) if len(shape) == 2
                   else (world_size * REAL_ELEMENTS_PER_RANK,)) for fqn, shape in params]
    found: list[tuple[str, tuple[int, ...] | None]] = [(f"model.{fqn}", shape) for fqn, shape in params]
    for fqn, shape in params:
        found += [(f"optim.state.{fqn}.{key}", None if key == "step" else shape) for key in ADAMW_STATE]
    return found


def dim0_chunks(shape: tuple[int, ...], world_size: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Return (offsets, sizes) of the non-empty chunks FSDP2 saves (torch.chunk along dim 0)."""
    per_rank = -(-shape[0] // world_size)
    rest = tuple(shape[1:])
    return [((start, *(0 for _ in rest)), (min(per_rank, shape[0] - start), *rest))
            for start in range(0, shape[0], per_rank)]


def planner_key(fqn: str) -> tuple:
    """Return the default planner's key path for a flattened fqn (dcp's `planner_data`)."""
    top, _, rest = fqn.partition(".")
    if top == "model":
        return (top, rest)
    kind, _, rest = rest.partition(".")
    if kind == "param_groups":
        index, _, key = rest.partition(".")
        return (top, kind, int(index), key)
    parameter, _, key = rest.rpartition(".")
    return (top, kind, parameter, key)


def build_sparse(path: Path, model: Model, world_size: int) -> int:
    """Write a sparse checkpoint of torch's own metadata; return its number of chunks."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    from ckpttool.torchsave.record import record_layout

    record_lengths: dict[tuple[int, ...], int] = {}
    state, storage, ends = {}, {}, [0] * world_size
    objects = [f"optim.param_groups.0.{key}" for key in (*PARAM_GROUP, "params")]
    for fqn in objects:  # torch writes a rank's objects first; rank 0 holds them
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", ends[0], 1024)
        ends[0] += 1024
    properties = TensorProperties(dtype=torch.float32)
    steps = 0
    gc.disable()
    for fqn, shape in entries(model, False, world_size):
        if shape is None:
            rank = steps % world_size
            steps += 1
            chunks = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
            length = record_lengths.setdefault((), record_layout("float32", ()).length)
            storage[MetadataIndex(fqn, torch.Size([]), 0)] = _StorageInfo(f"__{rank}_0.distcp", ends[rank], length)
            ends[rank] += length
            state[fqn] = TensorStorageMetadata(properties, torch.Size([]), chunks)
            continue
        chunks = []
        for rank, (offsets, sizes) in enumerate(dim0_chunks(shape, world_size)):
            offsets, sizes = torch.Size(offsets), torch.Size(sizes)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            length = record_lengths.get(sizes)
            if length is None:
                length = record_lengths[sizes] = record_layout("float32", tuple(sizes)).length
            storage[MetadataIndex(fqn, offsets, rank)] = _StorageInfo(f"__{rank}_0.distcp", ends[rank], length)
            ends[rank] += length
        state[fqn] = TensorStorageMetadata(properties, torch.Size(shape), chunks)
    metadata = Metadata(state_dict_metadata=state, storage_data=storage, version="1.0.0",
                        planner_data={fqn: planner_key(fqn) for fqn in state},
                        storage_meta=StorageMeta(checkpoint_id=str(path), save_id="frontier"))
    path.mkdir(parents=True)
    with open(path / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)  # as FileSystemWriter.finish does
    gc.enable()
    for rank, end in enumerate(ends):
        with open(path / f"__{rank}_0.distcp", "wb") as handle:
            handle.truncate(end)
    return sum(len(meta.chunks) for meta in state.values() if isinstance(meta, TensorStorageMetadata))


def build_real(path: Path, model: Model, world_size: int) -> int:
    """Write a checkpoint of real zero-filled torch.save records; return its number of chunks."""
    import io

    import torch

    from ckpttool.dcp.writer import StoredChunk, StoredObject, StoredTensor, data_file_name, metadata_bytes
    from ckpttool.torchsave.record import record_bytes

    files = [bytearray() for _ in range(world_size)]
    objects = []
    for key, value in (*PARAM_GROUP.items(), ("params", [fqn for fqn, _ in model.parameters()])):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        objects.append(StoredObject(f"optim.param_groups.0.{key}", data_file_name(0), len(files[0]),
                                    len(buffer.getvalue())))
        files[0] += buffer.getvalue()
    records: dict[tuple[int, ...], bytes] = {}
    stored, steps = [], 0
    for fqn, shape in entries(model, True, world_size):
        if shape is None:
            boxes = [(steps % world_size, ((), ()))]
            steps += 1
        else:
            boxes = list(enumerate(dim0_chunks(shape, world_size)))
        chunks = []
        for rank, (offsets, sizes) in boxes:
            record = records.get(sizes)
            if record is None:
                count = 1
                for size in sizes:
                    count *= size
                record = records[sizes] = record_bytes("float32", sizes, bytes(4 * count))
            name = data_file_name(rank)
            chunks.append(StoredChunk(offsets, sizes, name, len(files[rank]), len(record)))
            files[rank] += record
        stored.append(StoredTensor(fqn, "float32", shape or (), tuple(chunks)))
    path.mkdir(parents=True)
    for rank, data in enumerate(files):
        (path / data_file_name(rank)).write_bytes(data)
    names = [tensor.fqn for tensor in stored] + [obj.fqn for obj in objects]
    planner_data = {fqn: planner_key(fqn) for fqn in names}
    (path / ".metadata").write_bytes(metadata_bytes(stored, objects, planner_data, path, "frontier"))
    return sum(len(tensor.chunks) for tensor in stored)


def marker(path: Path) -> Path:
    """Return the file that says the checkpoint at `path` is complete (outside it: ckpttool
    warns about files the metadata does not name)."""
    return path.with_name(path.name + ".complete")


def ensure(directory: Path, case: Case, scale: float) -> Path:
    """Return the checkpoint of `case`, building it under `directory` unless already there."""
    suffix = "" if scale == 1 else f"-scale{scale:g}"
    path = directory / (case.name + suffix)
    if marker(path).exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    started = time.perf_counter()
    build = build_real if case.real else build_sparse
    chunks = build(path, scaled(case.model, scale), case.world_size)
    marker(path).write_text(f"{chunks}\n")
    print(f"built {path}: {chunks} chunks in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return path


def timed(command: list[str], environment: dict[str, str]) -> tuple[float, float, float]:
    """Return (wall seconds, peak RSS MB, CPU seconds: user + system) of one run of `command`
    under /usr/bin/time (stdout discarded: inspect --json of 7M chunks is 900 MB of text). On
    a shared machine the CPU time is the steadier measure: wall time waits for the cores."""
    started = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", *command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=environment, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    rss, user, system = result.stderr.strip().splitlines()[-1].split()
    return seconds, int(rss) / 1024, float(user) + float(system)


BASELINE_CODE = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
                 "FileSystemReader(sys.argv[1]).read_metadata()")


def commands(case: Case, path: Path, out: Path) -> list[tuple[str, list[str]]]:
    """Return (name, ckpttool arguments) of what to time on `case`'s checkpoint."""
    if not case.real:
        return [("inspect", ["inspect", str(path)]), ("inspect --json", ["inspect", "--json", str(path)]),
                ("validate", ["validate", str(path)])]
    return [("consolidate .safetensors", ["consolidate", "--quiet", str(path), str(out / "m.safetensors")]),
            ("reshard --world 256", ["reshard", "--quiet", str(path), str(out / "w256"), "--world", "256"])]


def measure(case: Case, path: Path, trees: list[tuple[str, Path | None]], repeat: int,
            scratch: Path, torch_baseline: bool = True) -> list[tuple[str, str, float, float, float]]:
    """Return (command, tree, median wall, peak RSS, median CPU) rows; the baseline first
    (unless not `torch_baseline`: torch holds 7M chunks in ~8 GB)."""
    python = sys.executable
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for _ in range(repeat):
        if torch_baseline:
            runs.setdefault(("torch: import + read_metadata", ""), []).append(
                timed([python, "-c", BASELINE_CODE, str(path)], dict(os.environ)))
        for name, arguments in commands(case, path, scratch / "out"):
            for label, tree in trees:
                environment = dict(os.environ, PYTHONSAFEPATH="1")
                if tree is not None:
                    environment["PYTHONPATH"] = str(tree.resolve())
                shutil.rmtree(scratch / "out", ignore_errors=True)
                (scratch / "out").mkdir()
                runs.setdefault((f"ckpttool {name}", label), []).append(
                    timed([python, "-m", "ckpttool", *arguments], environment))
    shutil.rmtree(scratch / "out", ignore_errors=True)
    return [(name, label, statistics.median(s for s, _, _ in found), max(m for _, m, _ in found),
             statistics.median(c for _, _, c in found)) for (name, label), found in runs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoints are built and cached")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases ({', '.join(CASES)})")
    parser.add_argument("--repeat", type=int, default=3, help="runs per command (median wall, max RSS)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the layers to keep (quick runs)")
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a ckpttool source tree to time (default: the installed one)")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoints, time nothing")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip torch's read_metadata baseline (ratios are then to the first row)")
    args = parser.parse_args()
    trees = [(label, Path(path)) for label, _, path in (t.partition("=") for t in args.tree)] or [("", None)]
    args.dir.mkdir(parents=True, exist_ok=True)
    print("| checkpoint | command | tree | wall s | x torch | peak RSS MB | x torch | CPU s | x first tree (wall, CPU) | load |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.only.split(","):
        case = CASES[name]
        path = ensure(args.dir, case, args.scale)
        if args.build_only:
            continue
        chunks = marker(path).read_text().strip()
        with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
            rows = measure(case, path, trees, args.repeat, Path(scratch), not args.no_torch)
        base_wall, base_rss = rows[0][2], rows[0][3]
        load = os.getloadavg()[1]  # the last 5 minutes: the machine's share of the runs
        first = {}  # each command's row of the first tree: the A/B ratio of the others
        for command, label, wall, rss, cpu in rows:
            first.setdefault(command, (wall, cpu))
            to_first = f"{wall / first[command][0]:.2f}x, {cpu / first[command][1]:.2f}x"
            print(f"| {name} ({chunks} chunks) | {command} | {label} | {wall:.2f} | {wall / base_wall:.2f}x | "
                  f"{rss:.0f} | {rss / base_rss:.2f}x | {cpu:.2f} | {to_first} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
