"""Benchmark `reshard` on a real FSDP2 checkpoint (default 4 GiB, world 8 -> 3) against the copy floor.

    python benchmarks/reshard.py [--gib 4] [--world 8] [--to 3] [--pairs 5] [--dir /tmp/reshard-bench]
                                 [--before /tmp/reshard-base] [--load] [--clean]

1. Writes a real checkpoint with torch's `dcp.save` from `fully_shard` on `--world` gloo ranks
   (a stack of square Linear layers, ~`--gib` GiB of fp32 weights), once: a later run with the
   same `--gib` and `--world` reuses it from `--dir` (`--clean` deletes everything at the end).
2. Copy floor and reshard in alternating pairs (`paired.alternate`: each in its own subprocess,
   the order reversed every other pair, wall time including a final `sync`, peak RSS):
   - cat && sync: `cat SRC/*.distcp > F && sync F` (reads and writes every source byte once)
   - reshard: `ckpttool reshard SRC OUT --world N --quiet`
   - reshard (before): the same from the code at `--before` (e.g. `git archive HEAD` unpacked
     there), on PYTHONPATH; then one run of each into its own folder, every file's SHA-256 compared.
   Page cache: warm for all. The source is read once (`cat > /dev/null`) before the first pair
   and stays cached (it is a few GB on a machine with more RAM); every output is a new file.
3. With `--phases`: one run of each code (after the pairs) with a timestamp at each phase
   boundary (imports, read, gate, plan, locate, lay out, first copy, copies done, each fsync,
   `.metadata`), wall and process CPU, measured by wrapping those functions (`phase_run`).
4. With `--load`: load time at `--to` ranks, stock `dcp.load` into a `fully_shard`ed model, of
   the resharded checkpoint vs the original (DCP resharding at load time), and the files each rank reads.

Prints markdown tables (medians, every run, ratio to cat && sync, the load average before and
after). Timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from paired import alternate, table

DIM = 4096
TOOL = str(Path(sys.executable).with_name("ckpttool"))


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
    """Run `worker` on `world_size` ranks in a child process (this one never imports torch:
    the pairs' peak RSS would otherwise start from a forked copy of it)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import reshard, torch.multiprocessing as mp; "
            "job = json.loads(sys.argv[3]); "
            "mp.spawn(reshard.worker, args=(int(sys.argv[2]), reshard.free_port(), job), nprocs=int(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(world_size), json.dumps(job)],
                   check=True)


def source_checkpoint(root: Path, gib: float, world_size: int) -> tuple[Path, int]:
    """Return the benchmark checkpoint under `root` (written now unless a finished one is
    there) and its number of layers."""
    layers = max(1, round(gib * (1 << 30) / ((DIM * DIM + DIM) * 4)))
    source = root / f"source-{gib:g}gib-world{world_size}"
    if not (source / ".metadata").is_file():
        shutil.rmtree(source, ignore_errors=True)
        started = time.perf_counter()
        spawn(world_size, {"kind": "save", "layers": layers, "path": str(source)})
        print(f"# dcp.save of {source}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return source, layers


def reshard_command(source: Path, out: Path, world_size: int, code: Path | None) -> list[str]:
    """The CLI, from the installed package or (`code`) from a source tree put first on PYTHONPATH."""
    command = [TOOL, "reshard", str(source), str(out), "--world", str(world_size), "--quiet"]
    return ["env", f"PYTHONPATH={code}", *command] if code is not None else command


PHASES = (  # (module, function, label): the boundaries `phase_run` stamps
    ("ckpttool.readers", "open_checkpoint", "read .metadata"),
    ("ckpttool.check.integrity", "gate", "integrity gate"),
    ("ckpttool.commands.reshard", "plan_reshard", "plan"),
    ("ckpttool.run.locating", "locate_chunks", "locate source records"),
    ("ckpttool.commands.reshard", "plan_writes", "lay out rank files"),
    ("ckpttool.run.execute", "run", "copies"),
    ("ckpttool.commands.reshard", "metadata_bytes", "encode .metadata"),
)


def phase_run(arguments: list[str]) -> None:
    """Run `ckpttool ARGUMENTS` in this process with the PHASES (and the first record copy,
    every fsync and the file writes) stamped; print the stamps on stderr: seconds since the
    process started, and process CPU seconds (all threads)."""
    import importlib
    import threading

    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        started = float(uptime.read().split()[0]) - int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    origin = time.perf_counter() - started
    stamps: list[tuple[float, float, str]] = []
    lock = threading.Lock()

    def stamp(label: str) -> None:
        with lock:
            stamps.append((time.perf_counter() - origin, time.process_time(), label))

    stamp("interpreter up")
    from ckpttool import cli
    from ckpttool.run import execute, record_writes
    from ckpttool.store import io

    stamp("imports done")

    def wrapped(function, label: str, once: bool = False):
        seen = []

        def run(*args, **kwargs):
            if not (once and seen):
                stamp(f"{label} start")
            seen.append(1)
            result = function(*args, **kwargs)
            if not once:
                stamp(f"{label} done")
            return result
        return run

    for module, name, label in PHASES:
        owner = importlib.import_module(module)
        setattr(owner, name, wrapped(getattr(owner, name), label))
    for name in ("write_record", "write_records"):
        setattr(record_writes, name, wrapped(getattr(record_writes, name), f"first {name}", once=True))
    sync, synced = io.sync, [0]

    def counted_sync(fd) -> None:
        sync(fd)
        synced[0] += 1
        if synced[0] <= 8:
            stamp(f"fsync {synced[0]} done")
        else:
            stamp("fsync (more) done")

    io.sync = counted_sync
    execute.write_file = wrapped(execute.write_file, "write small file")
    try:
        cli.main(arguments, standalone_mode=False)
    finally:
        stamp("end")
        more = [entry for entry in stamps if entry[2] == "fsync (more) done"]
        shown = [entry for entry in stamps if entry[2] != "fsync (more) done"]
        if more:
            shown.append((*more[-1][:2], f"fsync {synced[0]} (the last) done"))
        for wall, cpu, label in sorted(shown):
            print(f"{wall:8.3f} s  cpu {cpu:6.2f} s  {label}", file=sys.stderr)


def phases(source: Path, out: Path, world_size: int, code: Path | None) -> str:
    """Return the per-phase stamps of one reshard by `code` (None: the installed package)."""
    shutil.rmtree(out / "phases", ignore_errors=True)
    environment = dict(os.environ, **({"PYTHONPATH": str(code)} if code is not None else {}))
    done = subprocess.run([sys.executable, __file__, "--phase-run", "reshard", str(source), str(out / "phases"),
                           "--world", str(world_size), "--quiet"], env=environment, check=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shutil.rmtree(out / "phases", ignore_errors=True)
    return done.stderr


def digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def compare_outputs(source: Path, out: Path, world_size: int, before: Path) -> str:
    """Reshard once with each code into the same folder (torch records the path in `.metadata`);
    return a line saying whether every file's SHA-256 is equal."""
    found = {}
    for code in (before, None):
        folder = out / "check"
        subprocess.run(reshard_command(source, folder, world_size, code), check=True, stdout=subprocess.DEVNULL)
        found[code] = digests(folder)
        shutil.rmtree(folder)
    old, new = found[before], found[None]
    differing = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
    if differing:
        return f"outputs DIFFER from --before's: {', '.join(differing)}"
    return f"outputs byte-identical to --before's: {len(new)} files, SHA-256 each"


def load_time(path: Path, layers: int, world_size: int, out: Path) -> tuple[float, list[dict]]:
    out.mkdir()
    spawn(world_size, {"kind": "load", "layers": layers, "path": str(path), "out": str(out)})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    return max(r["seconds"] for r in ranks), ranks


def load_table(source: Path, out: Path, layers: int, args: argparse.Namespace) -> str:
    resharded = out / "load-source"
    subprocess.run(reshard_command(source, resharded, args.to, None), check=True, stdout=subprocess.DEVNULL)
    rows = ["| `dcp.load` at {0} ranks of | seconds | files read per rank |".format(args.to), "|---|---:|---|"]
    for name, path in ((f"the original world-{args.world}", source), ("the resharded checkpoint", resharded)):
        seconds, ranks = load_time(path, layers, args.to, out / f"load-{len(rows)}")
        rows.append(f"| {name} | {seconds:.2f} | {' / '.join(str(len(r['read'])) for r in ranks)} |")
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--phase-run"]:
        return phase_run(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--to", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/reshard-bench"))
    parser.add_argument("--before", type=Path, help="a source tree of the code to compare with (run on PYTHONPATH)")
    parser.add_argument("--load", action="store_true", help="also time stock dcp.load of both at --to ranks")
    parser.add_argument("--phases", action="store_true", help="also print one run's per-phase timestamps (each code)")
    parser.add_argument("--clean", action="store_true", help="delete --dir at the end (the checkpoint too)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    source, layers = source_checkpoint(args.dir, args.gib, args.world)
    out = args.dir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    size = sum(p.stat().st_size for p in source.glob("*.distcp"))
    data_files = " ".join(str(p) for p in sorted(source.glob("*.distcp")))
    subprocess.run(f"cat {data_files} > /dev/null", shell=True, check=True)  # warm: every row reads from memory

    commands = {"cat && sync": ["sh", "-c", f"cat {data_files} > {out}/copy.bin && sync {out}/copy.bin"],
                "reshard": reshard_command(source, out / "resharded", args.to, None)}
    if args.before is not None:
        commands["reshard (before)"] = reshard_command(source, out / "resharded", args.to, args.before)

    def clean() -> None:
        for path in out.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    load_before = os.getloadavg()
    results = alternate(commands, args.pairs, clean)
    load_after = os.getloadavg()
    print(f"checkpoint: {size / 1e9:.2f} GB of .distcp, world {args.world} -> {args.to}, {layers} x "
          f"Linear({DIM}, {DIM}), {os.cpu_count()} cores; page cache warm (source read once first); "
          f"{args.pairs} alternating runs; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print(table(results, "cat && sync"))
    if args.before is not None:
        print("\n" + compare_outputs(source, out, args.to, args.before))
    if args.phases:
        for name, code in (("reshard", None), ("reshard (before)", args.before)):
            if name == "reshard" or code is not None:
                print(f"\n{name}, per phase (load average {os.getloadavg()[0]:.1f}):\n```\n"
                      f"{phases(source, out, args.to, code)}```")
    if args.load:
        print("\n" + load_table(source, out, layers, args))
    shutil.rmtree(args.dir if args.clean else out, ignore_errors=True)


if __name__ == "__main__":
    main()
