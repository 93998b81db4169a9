"""A DCP checkpoint saved by `world` real gloo processes with torch's own `dcp.save`: seeded
fp32 tensors split along dim 0 over the ranks as FSDP2 shards them (DTensor, Shard(0)), plus a
replicated bias, so each rank file holds one torch.save record per tensor.

    python tests/dcp_world.py DIR [--world 8] [--tensors 12] [--rows 256] [--columns 256]

`write(DIR, ...)` runs that in a subprocess (torch is imported there, once; the ranks are forked
from it), for session fixtures and benchmarks. Sizes: tensors x rows x columns x 4 bytes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from fsdp_loads import exit_spawned_rank, free_port

SEED = 21


def write(path: Path, world: int = 8, tensors: int = 12, rows: int = 256, columns: int = 256) -> Path:
    """Write the checkpoint at `path` (which must not exist) and return `path`."""
    subprocess.run([sys.executable, __file__, str(path), "--world", str(world), "--tensors", str(tensors),
                    "--rows", str(rows), "--columns", str(columns)], check=True, timeout=600)
    return path


def write_forked(path: Path, world: int = 8, tensors: int = 12, rows: int = 256, columns: int = 256) -> Path:
    """`write`, the ranks forked from the test session's forkserver (`rank_forks.py`: torch
    imported once per session, not once per checkpoint); for tests."""
    from rank_forks import run_ranks

    run_ranks(_rank, world, world, str(path), free_port(), tensors, rows, columns, timeout=600)
    return path


def _rank(rank: int, world: int, path: str, port: int, tensors: int, rows: int, columns: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(SEED)
    model = {}
    for index in range(tensors):
        full = torch.randn(rows, columns, generator=generator)
        local = full.chunk(world)[rank] if rank < len(full.chunk(world)) else full[:0]
        model[f"layers.{index}.weight"] = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False,
                                                             shape=full.shape, stride=full.stride())
    model["head.bias"] = DTensor.from_local(torch.arange(columns, dtype=torch.float32), mesh, [Replicate()],
                                            run_check=False)
    dcp.save({"model": model}, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def write_layouts_forked(path: Path) -> Path:
    """Write, on 4 gloo ranks forked from the test session's forkserver, what the trainer does
    not write (`_layouts_rank`: 2-D block sharding uneven both ways, a tied head, int/bool
    buffers, a 0-d bf16 tensor) at `path`; return `path`."""
    from rank_forks import run_ranks

    run_ranks(_layouts_rank, 4, free_port(), str(path), timeout=600)
    return path


def _layouts_rank(rank: int, port: int, directory: str) -> None:
    """World 4 on a 2x2 mesh: a 2-D block-sharded tensor (uneven both ways), HSDP-style
    [Replicate, Shard(0)] weights with the embedding tied to the head, int/bool buffers and a
    0-d tensor. One dcp.save, as a trainer's model state dict would be saved."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    generator = torch.Generator().manual_seed(0)
    embedding = distribute_tensor(torch.randn(11, 6, generator=generator), mesh, [Replicate(), Shard(0)])
    state = {
        "block.weight": distribute_tensor(torch.randn(7, 10, generator=generator), mesh, [Shard(0), Shard(1)]),
        "tok_emb.weight": embedding,
        "lm_head.weight": embedding,  # tied: the same parameter under two names
        "fc.weight": distribute_tensor(torch.randn(5, 6, generator=generator), mesh, [Replicate(), Shard(0)]),
        "norm.weight": distribute_tensor(torch.ones(6), mesh, [Replicate(), Shard(0)]),
        "position_ids": torch.arange(9),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
    }
    dcp.save({"model": state}, checkpoint_id=directory)
    dist.destroy_process_group()
    exit_spawned_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=12)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--columns", type=int, default=256)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(args.world, args.path, free_port(), args.tensors, args.rows, args.columns),
                       nprocs=args.world, start_method="fork")


if __name__ == "__main__":
    main()
