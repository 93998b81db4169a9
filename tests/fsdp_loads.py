"""Load DCP checkpoints the way a training job does: stock `dcp.load` on N gloo ranks into a
model wrapped with `fully_shard` (FSDP2, or HSDP on a 2-D mesh) + AdamW: the fixtures'
TinyModel, or (`model="gpt"`) the trainer's GPT built from the config the checkpoint stores.

One `load_all(jobs, world_size, out)` call starts the ranks once (forked from the session's
forkserver, which imported torch once: `rank_forks.py`) and runs every job in them.
For each job rank 0 writes `out/<name>.pt` (the loaded state gathered to full tensors:
`{"model", "optim", "extra"}`), every rank writes `out/<name>.reads.<rank>.json` (each chunk it
read: fqn, offsets and file, seen by a counting `FileSystemReader`), and with `save_to` the
loaded state is saved again by torch's own `dcp.save` (torch's layout at this world size, to
compare with ours).

Example:
    >>> load_all([LoadJob("w3", "/tmp/ckpt-world3", optimizer=True)], 3, Path("/tmp/out"))
    >>> torch.load("/tmp/out/w3.pt")["model"]["embed.weight"].shape
    torch.Size([13, 8])
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ports import free_port  # dcp_world and test_deepspeed import it from here

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@dataclass(frozen=True)
class LoadJob:
    name: str
    checkpoint: str
    dtype: str = "float32"
    optimizer: bool = False  # load AdamW state too (the checkpoint holds `optim.*`)
    extra: bool = False  # load the fixtures' `extra` entries (`step`, `note`)
    mesh: tuple[int, int] | None = None  # HSDP (replicas, shards); None: 1-D FSDP over all ranks
    save_to: str | None = None
    model: str = "tiny"  # "tiny": fixtures' TinyModel; "gpt": train_minimal's GPT, blocks sharded


def _make(job: LoadJob, world_size: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _model(job).to(getattr(torch, job.dtype))
    if job.mesh:
        mesh = init_device_mesh("cpu", job.mesh, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model.blocks if job.model == "gpt" else model.layers):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _model(job: LoadJob):
    if job.model == "tiny":
        from generate import TinyModel

        return TinyModel()
    from train_minimal.checkpoint import read_saved_config
    from train_minimal.model import GPT

    config = read_saved_config(Path(job.checkpoint))
    return GPT(config["dim"], config["layers"], config["heads"], config["vocab"], config["seq_len"],
               tie_embeddings=config["tie_embeddings"])


def _counting_reader(path: str, reads: list):
    from torch.distributed.checkpoint import FileSystemReader

    class CountingReader(FileSystemReader):
        """FileSystemReader that records which file each read item comes from."""

        def read_data(self, plan, planner):
            for item in plan.items:
                index = item.storage_index
                info = self.storage_data[index]
                offsets = list(index.offset) if index.offset is not None else None
                reads.append([index.fqn, offsets, info.relative_path, info.offset, info.length])
            return super().read_data(plan, planner)

    return CountingReader(path)


def _worker(rank: int, world_size: int, port: int, jobs: list[LoadJob], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(FIXTURES))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for job in jobs:
            model, optimizer = _make(job, world_size)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state}
            if job.optimizer:
                state["optim"] = optimizer_state
            if job.extra:
                state["extra"] = {"step": 0, "note": ""}
            reads: list = []
            dcp.load(state, storage_reader=_counting_reader(job.checkpoint, reads))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"],
                optim_state_dict=state["optim"] if job.optimizer else optimizer_state,
            )
            full_model, full_optimizer = get_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            Path(out, f"{job.name}.reads.{rank}.json").write_text(json.dumps(reads))
            if rank == 0:
                result = {"model": full_model}
                if job.optimizer:
                    result["optim"] = full_optimizer
                if job.extra:
                    result["extra"] = state["extra"]
                torch.save(result, Path(out, f"{job.name}.pt"))
            if job.save_to:
                dcp.save(state, checkpoint_id=job.save_to)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_spawned_rank()


def exit_spawned_rank() -> None:
    """End a spawned gloo rank that finished its work: through os._exit, as gloo can abort
    ("terminate called without an active exception", SIGABRT) in the interpreter's own exit
    after a clean finish (the pytorch#190489 pattern), which fails the whole spawn."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_all(jobs: list[LoadJob], world_size: int, out: Path) -> Path:
    """Run every job on `world_size` gloo ranks forked from the session's forkserver (which
    imported torch once: `rank_forks.py`); return `out`."""
    from rank_forks import run_ranks

    out.mkdir(parents=True, exist_ok=True)
    run_ranks(_worker, world_size, world_size, free_port(), jobs, str(out), timeout=900)
    return out


def read_reads(out: Path, name: str, rank: int) -> list[tuple[str, tuple | None, str, int, int]]:
    """Return what rank `rank` read for job `name`: (fqn, offsets, file, offset, length)."""
    rows = json.loads(Path(out, f"{name}.reads.{rank}.json").read_text())
    return [(fqn, tuple(offsets) if offsets is not None else None, file, offset, length)
            for fqn, offsets, file, offset, length in rows]
