"""Process group, device mesh and FSDP wrapping (FSDP2 `fully_shard` or FSDP1
`FullyShardedDataParallel`), mixed precision and CPU offload.

Example (inside an initialised process group):
    >>> runtime = start_runtime(config)
    >>> model = shard_model(build_model(config), config, runtime)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train_minimal.config import ConfigError, TrainConfig
from train_minimal.model import BLOCK_TYPES, LlamaTrunk


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: its rank, the world, the device and the mesh."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        """Return True on rank 0, the rank that logs, renames checkpoints and exports."""
        return self.rank == 0


def start_runtime(config: TrainConfig) -> Runtime:
    """Return the Runtime after joining the process group the launcher (our spawner or
    torchrun) described in RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    config.check_world_size(world_size)
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device on this machine")
    if config.cpu_offload and not use_cuda:
        raise ConfigError("--cpu-offload moves sharded state from an accelerator to CPU memory, but this run "
                          "is on the CPU already (no CUDA device, or --device cpu): drop --cpu-offload")
    threads = config.threads or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=device if use_cuda else None)
    mesh = build_mesh(device.type, world_size, config.replicate)
    return Runtime(rank, world_size, local_rank, local_world_size, device, mesh)


def build_mesh(device_type: str, world_size: int, replicate: int) -> DeviceMesh:
    """Return a 1-D ("shard",) mesh, or a 2-D ("replicate", "shard") mesh for HSDP."""
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, config: TrainConfig, runtime: Runtime) -> nn.Module:
    """Return the model sharded as `config` asks: FSDP2 wraps in place, FSDP1 returns the
    FullyShardedDataParallel root."""
    if config.param_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    if config.fsdp == 2:
        return _fully_shard(model, config, runtime)
    return _fsdp1(model, config, runtime)


def _fully_shard(model: nn.Module, config: TrainConfig, runtime: Runtime) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mesh": runtime.mesh,
        "reshard_after_forward": config.reshard_after_forward,
        "mp_policy": (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if config.mixed_precision == "bf16" else MixedPrecisionPolicy()),
        "offload_policy": CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    }
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def _fsdp1(model: nn.Module, config: TrainConfig, runtime: Runtime) -> nn.Module:
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if config.wrap == "transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(BLOCK_TYPES))
    else:
        # Embeddings stay in the root unit: with tied embeddings the root reads their weight
        # (so does Llama's trunk, which holds embed_tokens: it is never a unit of its own).
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=config.wrap_min_params,
                                   exclude_wrap_modules={nn.ModuleList, nn.ModuleDict, nn.Embedding, LlamaTrunk})
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}
    on_accelerator = runtime.device.type != "cpu"
    if not on_accelerator:
        # FSDP1 refuses sync_module_states for CPU tensors; broadcast rank 0's weights
        # ourselves so every rank starts from the same model either way.
        broadcast_module_states(model)
    mixed_precision = None
    if config.mixed_precision == "bf16":
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         buffer_dtype=torch.bfloat16)
    return FSDP(
        model,
        device_mesh=runtime.mesh,
        sharding_strategy=ShardingStrategy[config.sharding_strategy],
        auto_wrap_policy=policy,
        backward_prefetch=prefetch[config.backward_prefetch],
        mixed_precision=mixed_precision,
        cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None,
        device_id=runtime.device,
        use_orig_params=True,
        sync_module_states=on_accelerator,
    )


def broadcast_module_states(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank, in place."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all shards and ranks) to `max_norm`; return it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def local_bytes(tensors) -> int:
    """Return the bytes this rank holds for `tensors` (the local shard of a DTensor)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total
