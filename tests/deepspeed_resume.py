"""Resume DeepSpeed runs as FSDP2: `world` gloo processes, for each (case, migrated DCP dir),
build the fixture's model (the generator's own `build_model`), `fully_shard` it, make torch's
AdamW with the run's param groups, `dcp.load` the migrated checkpoint into
`get_state_dict(model, optimizer)`, `set_state_dict`, and take the training step DeepSpeed took
from the same save (step_reference.*). Rank 0 writes, per case, the loss and per tensor the
largest difference from DeepSpeed's step, as JSON. `_trainer_rank`: the bundled trainer's own
resume of such a migration, recording what it loaded.

    python tests/deepspeed_resume.py WORLD OUT.json CASE MIGRATED_DCP_DIR [CASE DIR ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "fixtures" / "frameworks"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(FIXTURE))


def _rank(rank: int, world: int, port: int, jobs: list[tuple[str, str]], out: str) -> None:
    import torch.distributed as dist

    from fsdp_loads import exit_spawned_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {case: _resume(case, source) for case, source in jobs}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def _resume(case: str, source: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import generate_deepspeed as generator

    model = generator.build_model(seed=1)  # other weights than the save's: loading must replace them all
    fully_shard(model)
    groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in generator.param_groups(model)]
    optimizer = torch.optim.AdamW(groups, lr=generator.LR, betas=generator.BETAS, eps=generator.EPS)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    reference = json.loads((FIXTURE / "deepspeed" / case / "step_reference.json").read_text())
    ids = torch.tensor(reference["input_ids"])
    loss = generator.loss_of(model(ids), ids)
    loss.backward()
    # DeepSpeed clips the gradient norm to its config's gradient_clipping, 1.0 unless set
    # (deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT): as torch does, by max / (norm + 1e-6)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    after = load_file(FIXTURE / "deepspeed" / case / "step_reference.safetensors")
    full = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
            for name, value in model.state_dict().items()}
    differences = {}
    for key, expected in after.items():
        kind, _, name = key.partition(".")
        if kind == "param":
            ours = full[name]
        elif kind in ("exp_avg", "exp_avg_sq"):
            parameter = model.get_parameter(name)
            ours = optimizer.state[parameter][kind]
            ours = ours.full_tensor() if hasattr(ours, "full_tensor") else ours
        else:
            continue
        differences[key] = float((ours.float() - expected.float()).abs().max())
    steps = {float(s["step"]) for s in optimizer.state.values()}
    return {"loss": repr(float(loss.detach())), "differences": differences, "steps": sorted(steps)}


def _trainer_rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """The bundled trainer's own `train` on this rank, its command line `argv` (`--resume` of a
    migrated DeepSpeed save): its `load_checkpoint` is wrapped to record, as soon as it returns,
    the SHA-256 of every full parameter and of its AdamW exp_avg and exp_avg_sq (and the steps);
    then the run goes on as the trainer's does. Rank 0 writes what was loaded as JSON."""
    import torch.distributed as dist

    import train_minimal.train as trainer
    from fsdp_loads import exit_spawned_rank
    from train_minimal.config import parse_args

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    loaded: dict = {}
    load_checkpoint = trainer.load_checkpoint

    def recording(app, checkpoint) -> None:
        load_checkpoint(app, checkpoint)
        loaded.update(_loaded_state(app.model, app.optimizer))

    trainer.load_checkpoint = recording
    trainer.train(parse_args(argv))
    if rank == 0:
        Path(out).write_text(json.dumps(loaded))
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def _loaded_state(model, optimizer) -> dict:
    """{"tensors": {"<fqn>.fp32" | "<fqn>.exp_avg" | "<fqn>.exp_avg_sq": sha256 of the full
    tensor's bytes}, "steps": [...]}, named as optimizer.json names DeepSpeed's; collective."""
    import hashlib

    import torch

    def full(tensor):
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    tensors, steps = {}, set()
    for name, parameter in sorted(model.named_parameters()):
        tensors[f"{name}.fp32"] = full(parameter)
        state = optimizer.state[parameter]
        for kind in ("exp_avg", "exp_avg_sq"):
            tensors[f"{name}.{kind}"] = full(state[kind])
        steps.add(float(state["step"]))
    return {"tensors": tensors, "steps": sorted(steps)}


def main() -> None:
    import torch.multiprocessing as mp

    world, out, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    jobs = list(zip(rest[::2], rest[1::2]))
    from ports import free_port

    mp.start_processes(_rank, args=(world, free_port(), jobs, out), nprocs=world, start_method="fork")
    os._exit(0)


if __name__ == "__main__":
    main()
