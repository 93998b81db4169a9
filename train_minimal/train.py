"""The training loop, top to bottom: build, shard, (resume), step, log, save, export.

`run_rank(config)` is what every rank runs, whether our launcher spawned it or torchrun did.

Determinism: the model is initialised from `--seed` on every rank before sharding (so the
initial weights do not depend on the world size), the data of step k is a function of the
data position only (data.py), each rank's dropout RNG is seeded from (seed, rank) and
saved per rank, and torch uses a fixed number of threads per rank. With the same config
and world size the per-step losses are bit-identical between runs, and a resumed run
repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from train_minimal.checkpoint import (
    AppState,
    Checkpointer,
    TrainProgress,
    check_resumable,
    export_full_weights,
    has_training_state,
    load_checkpoint,
    load_full_weights,
    load_model_weights,
    rank_seed,
    resolve_resume,
    step_directories,
)
from train_minimal.config import ConfigError, TrainConfig
from train_minimal.data import TokenStream, file_corpus, synthetic_corpus
from train_minimal.model import build_model, parameter_count
from train_minimal.parallel import Runtime, clip_gradients, local_bytes, shard_model, start_runtime


def run_rank(config: TrainConfig) -> int:
    """Run one rank of the training job; return its exit status (2 on a config error, which
    rank 0 prints as one line)."""
    try:
        train(config)
    except ConfigError as error:
        if _environment_rank() == 0:
            print(f"train_minimal: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def train(config: TrainConfig) -> None:
    """Train as `config` says; collective over all ranks of the process group."""
    runtime = start_runtime(config)
    log = (lambda message: print(message, file=sys.stderr)) if runtime.is_main else (lambda message: None)

    checkpoint_to_resume = None
    if config.resume:
        ckpt_dir = Path(config.ckpt_dir) if config.ckpt_dir else None
        checkpoint_to_resume = resolve_resume(config.resume, ckpt_dir)
        if checkpoint_to_resume is None:
            log(f"--resume: no checkpoint in {config.ckpt_dir} yet, starting at step 0")
        else:
            check_resumable(checkpoint_to_resume, config)
    elif config.ckpt_dir and step_directories(Path(config.ckpt_dir)):
        raise ConfigError(f"--ckpt-dir {config.ckpt_dir} already holds checkpoints: pass --resume to "
                          "continue that run, or choose another directory")

    # The same full model on every rank, whatever the world size; FSDP then shards it.
    torch.manual_seed(config.seed)
    model = build_model(config)
    total_parameters = parameter_count(model)
    trainable_parameters = parameter_count(model, trainable_only=True)
    model = shard_model(model, config, runtime)
    # A LoRA run's frozen base has no optimizer state (nor an entry in the checkpoint's optim.*).
    optimizer = torch.optim.AdamW([parameter for parameter in model.parameters() if parameter.requires_grad],
                                  lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda index: lr_factor(index, config))
    progress = TrainProgress()
    app = AppState(model, optimizer, scheduler, progress, config, runtime)
    torch.manual_seed(rank_seed(config.seed, runtime.rank, 0))
    checkpointer = Checkpointer(Path(config.ckpt_dir), config.keep, config.async_save, runtime) if config.ckpt_dir else None

    if config.init_from:
        for note in load_full_weights(model, Path(config.init_from)):
            log(f"--init-from: {note}")
    if checkpoint_to_resume is not None and not has_training_state(checkpoint_to_resume):
        load_model_weights(model, checkpoint_to_resume)
        log(f"resumed from {checkpoint_to_resume}: model weights only, no optimizer state (e.g. written by "
            "`ckpttool import`): fresh optimizer and LR schedule, starting at step 0")
    elif checkpoint_to_resume is not None:
        load_checkpoint(app, checkpoint_to_resume)
        log(f"resumed from {checkpoint_to_resume} at step {progress.step} (data position "
            f"{progress.data_position}{'' if app.restored_rng else ', RNG reseeded: world size changed'})"
            + ("" if app.restored_schedule else "; model and optimizer state only (another trainer's, e.g. `ckpttool reshard` "
               "of a DeepSpeed save): fresh LR schedule"))

    corpus = file_corpus(config.data, config.vocab, config.seq_len) if config.data else synthetic_corpus(config.seed)
    stream = TokenStream(corpus, config.seq_len, config.seed)
    if trainable_parameters != total_parameters:
        log(f"LoRA rank {config.lora_rank} on {config.lora_targets}: {trainable_parameters:,} trainable parameters, "
            f"{total_parameters - trainable_parameters:,} frozen")
    log(f"{total_parameters:,} parameters ({config.arch}), FSDP{config.fsdp}, world size {runtime.world_size}, "
        f"device {runtime.device}, steps {progress.step + 1}..{config.last_step} of {config.steps}")
    log_file = None
    if config.log_file and runtime.is_main:
        Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(config.log_file, "a")
    tokens_per_step = config.global_batch * config.seq_len

    if progress.step >= config.last_step:
        log(f"already at step {progress.step}: nothing to train up to step {config.last_step}")
    model.train()
    bar = tqdm(total=config.last_step, initial=progress.step, disable=not runtime.is_main or config.quiet,
               file=sys.stderr, dynamic_ncols=True)
    while progress.step < config.last_step:
        started = time.perf_counter()
        inputs, targets = stream.batch(progress.data_position, config.global_batch, runtime.rank, runtime.world_size)
        logits = model(inputs.to(runtime.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(runtime.device).flatten())
        loss.backward()
        if config.grad_clip > 0:
            clip_gradients(model, config.grad_clip)
        learning_rate = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.data_position += config.global_batch

        # Equal samples per rank: the mean of the rank means is the global mean.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = (global_loss / runtime.world_size).item()
        if not math.isfinite(global_loss):
            raise RuntimeError(f"step {progress.step}: loss is {global_loss}")
        memory = per_rank_memory(model, optimizer, runtime)
        elapsed = time.perf_counter() - started
        if log_file is not None:
            record = {"step": progress.step, "loss": global_loss, "lr": learning_rate,
                      "tokens_per_s": tokens_per_step / elapsed, "world_size": runtime.world_size, **memory}
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{global_loss:.4f}", lr=f"{learning_rate:.2e}")

        if checkpointer is not None and should_save(progress.step, config):
            checkpointer.save(app, progress.step)
    bar.close()
    if checkpointer is not None:
        checkpointer.finish()
        if checkpointer.last_saved_step is not None:
            log(f"saved {Path(config.ckpt_dir) / 'latest'} -> step {checkpointer.last_saved_step}")
    if log_file is not None:
        log_file.close()
    if config.export:
        export_full_weights(model, Path(config.export), runtime)


def lr_factor(index: int, config: TrainConfig) -> float:
    """Return the LR multiplier of optimizer step `index` (0-based): linear warmup over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `steps`."""
    if index < config.warmup_steps:
        return (index + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (index - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def should_save(step: int, config: TrainConfig) -> bool:
    """Return True when step `step` is saved: every `--save-every` steps and at the last
    step of this invocation."""
    if step == config.last_step:
        return True
    return config.save_every is not None and step % config.save_every == 0


def per_rank_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> dict[str, list[int]]:
    """Return per-rank lists (index = rank) of parameter bytes, optimizer-state bytes and
    peak RSS bytes, gathered from every rank; collective."""
    optimizer_tensors = [value for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor)]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    mine = torch.tensor([local_bytes(model.parameters()), local_bytes(optimizer_tensors), peak_rss],
                        dtype=torch.int64, device=runtime.device)
    everyone = [torch.zeros_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().tolist()
    return {"param_bytes": [row[0] for row in rows], "optimizer_bytes": [row[1] for row in rows],
            "peak_rss_bytes": [row[2] for row in rows]}


def _environment_rank() -> int:
    return int(os.environ.get("RANK", "0"))
