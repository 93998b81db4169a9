"""Checkpoints: the application state (`AppState`, a DCP `Stateful`), atomic step
directories, the `latest` pointer, keep-latest-K, resume, and full-weight import/export.

A checkpoint is one torch.distributed.checkpoint (DCP) directory written by `dcp.save`
with the default FileSystemWriter: `.metadata` plus `__{rank}_0.distcp` per rank. Its
top-level keys are:

    model.<fqn>                          get_state_dict(model, optim)[0]: DTensor (FSDP2) or
                                         ShardedTensor (FSDP1) shards, e.g. model.blocks.0.attn.qkv.weight
    optim.state.<fqn>.{exp_avg,exp_avg_sq,step}, optim.param_groups   get_state_dict(...)[1]
    scheduler.*                          LambdaLR state (last_epoch, base_lrs, _last_lr, ...)
    train.step, train.data_position, train.world_size, train.config (TrainConfig JSON)
    rng.rank_<r>.torch (and .cuda)       rank r's RNG state, written by rank r only

A LoRA run (`--lora-rank`) saves its model under the same keys with PEFT's layer names
(`model.model.layers.0.self_attn.q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`,
`...q_proj.lora_B.default.weight`), optimizer state for the adapter weights only, and PEFT's
`adapter_config.json` beside `.metadata` (train_minimal/lora.py).

A checkpoint with `model.*` entries only (what `ckpttool import` writes from Hub weights,
or `dcp.save({"model": get_model_state_dict(model)})`) also resumes: its weights are
loaded and the run starts at step 0 with a fresh optimizer and LR schedule; into a LoRA run,
its plain weights load into the `base_layer`s (so does `--init-from`). One with `model.*` and
`optim.*` but no `scheduler.*`/`train.*` (`ckpttool reshard` of a DeepSpeed ZeRO save) loads
both and starts at step 0 on a fresh LR schedule, its optimizer state kept.

Layout on disk: `DIR/step-00000010/` is written as `DIR/step-00000010.tmp/` and renamed
once every rank has finished and `.metadata` exists; then `DIR/latest` (a one-line text
file naming the step directory) is replaced atomically, and step directories beyond
`--keep` are removed, oldest first.

Example:
    >>> checkpointer = Checkpointer(Path("runs/x"), keep=2, async_save=False, runtime=runtime)
    >>> checkpointer.save(app_state, step=10)        # runs/x/step-00000010, runs/x/latest
    >>> load_checkpoint(app_state, resolve_resume("latest", Path("runs/x")))
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from train_minimal.config import ConfigError, TrainConfig, incompatible_fields
from train_minimal.lora import base_weight_name, is_lora_parameter, write_adapter_config
from train_minimal.parallel import Runtime

STEP_DIRECTORY = re.compile(r"^step-(\d{8})$")
LATEST_POINTER = "latest"
MODEL_PREFIX = "model."  # AppState's top-level entries, as flattened DCP keys
OPTIMIZER_PREFIX = "optim."
CONFIG_KEY = "train.config"
SCHEDULE_GROUPS = ("scheduler", "train")  # AppState's entries that only this trainer writes
TEMPORARY_SUFFIX = ".tmp"
# Mixed into the seed when a rank has no stored RNG state (world size changed on resume).
RNG_RESEED_SALT = 0x5EED


def step_directory_name(step: int) -> str:
    """Return the directory name of the checkpoint after `step` steps: `step-00000010`."""
    return f"step-{step:08d}"


@dataclass
class TrainProgress:
    """How far the run is: optimizer steps taken and samples of the token stream consumed."""

    step: int = 0
    data_position: int = 0


class AppState(Stateful):
    """Everything a resume needs, as one DCP `Stateful`: model, optimizer, LR scheduler,
    progress, this rank's RNG state and the run's config.

    `state_dict()` returns the top-level entries (`model`, `optim`, `scheduler`, `train`,
    `rng`) so that they are the checkpoint's top-level keys, not nested under a name.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, progress: TrainProgress,
                 config: TrainConfig, runtime: Runtime) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.progress = progress
        self.config = config
        self.runtime = runtime
        self.restored_rng = True
        self.restored_schedule = True

    def state_dict(self) -> dict:
        """Return the state to save (tensors stay sharded; nothing is gathered)."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "train": {
                "step": self.progress.step,
                "data_position": self.progress.data_position,
                "world_size": self.runtime.world_size,
                "config": self.config.to_json(),
            },
            "rng": {f"rank_{self.runtime.rank}": rng_state()},
        }

    def load_target(self, checkpoint: Path) -> dict:
        """Return the state dict to pass to `dcp.load` for `checkpoint`: like `state_dict()`,
        but with this rank's RNG entry only when the checkpoint was written at this world
        size (a rank of another world has no state of its own to take), and without the LR
        schedule and progress when the checkpoint has none: a model and optimizer another
        trainer saved (`ckpttool reshard` of a DeepSpeed ZeRO save) continue from step 0 on a
        fresh schedule, with their optimizer state."""
        state = self.state_dict()
        keys = checkpoint_keys(checkpoint)
        for group in SCHEDULE_GROUPS:
            if not any(key.startswith(group + ".") for key in keys):
                del state[group]
        for number, settings in enumerate(state["optim"].get("param_groups", [])):
            for name in [name for name in settings if f"optim.param_groups.{number}.{name}" not in keys]:
                del settings[name]  # `initial_lr`, which this LR schedule adds and another trainer's lacks
        saved_world_size = count_rng_ranks(checkpoint)
        if saved_world_size != self.runtime.world_size:
            del state["rng"]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Apply a loaded state: model and optimizer shards, scheduler, progress, RNG."""
        set_state_dict(self.model, self.optimizer,
                       model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        self.restored_schedule = "scheduler" in state_dict
        if self.restored_schedule:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if "train" in state_dict:
            self.progress.step = int(state_dict["train"]["step"])
            self.progress.data_position = int(state_dict["train"]["data_position"])
        if "rng" in state_dict:
            set_rng_state(state_dict["rng"][f"rank_{self.runtime.rank}"])
            self.restored_rng = True
        else:
            torch.manual_seed(rank_seed(self.config.seed, self.runtime.rank, self.progress.step))
            self.restored_rng = False


def rank_seed(seed: int, rank: int, step: int) -> int:
    """Return the torch seed of `rank` at `step`: used at step 0 and whenever a resume
    changes the world size, so each rank's dropout stream is a function of (seed, step, rank)."""
    return (seed * 1_000_003 + RNG_RESEED_SALT * (step + 1) + rank) % (2 ** 63)


def rng_state() -> dict[str, torch.Tensor]:
    """Return this process's torch RNG state (CPU, and the current CUDA device's)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore an `rng_state()`."""
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def checkpoint_keys(checkpoint: Path) -> list[str]:
    """Return the flattened keys of a DCP checkpoint, read from its `.metadata`."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    return sorted(metadata.state_dict_metadata)


def count_rng_ranks(checkpoint: Path) -> int:
    """Return how many ranks stored an RNG state: the world size the checkpoint was saved at."""
    return sum(1 for key in checkpoint_keys(checkpoint) if re.fullmatch(r"rng\.rank_\d+\.torch", key))


def read_saved_config(checkpoint: Path) -> dict:
    """Return the TrainConfig (as a dict) stored in a checkpoint; collective over all ranks."""
    state = {"train": {"config": ""}}
    dcp.load(state, checkpoint_id=str(checkpoint))
    return json.loads(state["train"]["config"])


def resolve_resume(resume: str, ckpt_dir: Path | None) -> Path | None:
    """Return the step directory to resume from, or None when `--resume` (latest) finds no
    checkpoint yet. `resume` is "latest" or a path: a step directory (holds `.metadata`) or
    a checkpoint directory (holds `latest`)."""
    if resume == "latest":
        return latest_checkpoint(ckpt_dir)
    path = Path(resume)
    if (path / ".metadata").is_file():
        return path
    if (path / LATEST_POINTER).is_file():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise ConfigError(f"--resume {resume}: neither a checkpoint (no .metadata) nor a checkpoint directory "
                      f"with a '{LATEST_POINTER}' pointer")


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """Return the step directory `ckpt_dir/latest` names, or None if there is none yet."""
    pointer = ckpt_dir / LATEST_POINTER
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIRECTORY.match(name) or not (ckpt_dir / name / ".metadata").is_file():
        raise ConfigError(f"{pointer} names '{name}', which is not a complete checkpoint in {ckpt_dir}")
    return ckpt_dir / name


def step_directories(ckpt_dir: Path) -> list[Path]:
    """Return the complete step directories of `ckpt_dir`, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [path for path in ckpt_dir.iterdir() if path.is_dir() and STEP_DIRECTORY.match(path.name)]
    return sorted(found, key=lambda path: path.name)


class Checkpointer:
    """Saves AppState into atomic step directories (optionally asynchronously)."""

    def __init__(self, ckpt_dir: Path, keep: int | None, async_save: bool, runtime: Runtime) -> None:
        self.ckpt_dir = ckpt_dir
        self.keep = keep
        self.runtime = runtime
        # Async saves run their collectives in a background thread: they need a process
        # group of their own (gloo, as the staged state lives in CPU memory).
        self.async_group = dist.new_group(backend="gloo") if async_save else None
        self.pending: tuple[object, int] | None = None
        self.last_saved_step: int | None = None

    def save(self, app: AppState, step: int) -> None:
        """Write the checkpoint of `step`: to a temporary directory, renamed when complete."""
        self.finish()
        temporary = self.ckpt_dir / (step_directory_name(step) + TEMPORARY_SUFFIX)
        if self.runtime.is_main:
            shutil.rmtree(temporary, ignore_errors=True)  # left over by an interrupted save
            temporary.mkdir(parents=True)
            # Beside .metadata, so `ckpttool export --adapter` and PEFT find the LoRA settings.
            write_adapter_config(temporary, app.config)
        dist.barrier()
        state = app.state_dict()
        if self.async_group is None:
            dcp.save(state, checkpoint_id=str(temporary))
            self._publish(step)
        else:
            future = dcp.async_save(state, checkpoint_id=str(temporary), process_group=self.async_group)
            self.pending = (future, step)

    def finish(self) -> None:
        """Wait for an asynchronous save in flight and publish it (a no-op otherwise)."""
        if self.pending is None:
            return
        future, step = self.pending
        self.pending = None
        upload = getattr(future, "upload_completion", future)  # AsyncSaveResponse or Future
        upload.result()
        self._publish(step)

    def _publish(self, step: int) -> None:
        """Rename the finished temporary directory, point `latest` at it, apply `--keep`."""
        dist.barrier()  # every rank's files are written
        name = step_directory_name(step)
        if self.runtime.is_main:
            final = self.ckpt_dir / name
            if final.exists():
                # A resume from an older checkpoint redoes this step: replace what it wrote.
                shutil.rmtree(final)
            os.replace(self.ckpt_dir / (name + TEMPORARY_SUFFIX), final)
            pointer = self.ckpt_dir / (LATEST_POINTER + TEMPORARY_SUFFIX)
            pointer.write_text(name + "\n")
            os.replace(pointer, self.ckpt_dir / LATEST_POINTER)
            if self.keep is not None:
                for old in step_directories(self.ckpt_dir)[:-self.keep]:
                    shutil.rmtree(old)
        self.last_saved_step = step
        dist.barrier()  # nobody reads `latest` before it is there



def load_checkpoint(app: AppState, checkpoint: Path) -> None:
    """Load `checkpoint` into `app`, at any world size: DCP reshards at load time."""
    state = app.load_target(checkpoint)
    dcp.load(state, checkpoint_id=str(checkpoint))
    app.load_state_dict(state)


def has_training_state(checkpoint: Path) -> bool:
    """Return True when `checkpoint` holds optimizer state (a run to continue), False when it
    holds model weights only (e.g. written by `ckpttool import`)."""
    return any(key.startswith(OPTIMIZER_PREFIX) for key in checkpoint_keys(checkpoint))


def check_resumable(checkpoint: Path, config: TrainConfig) -> None:
    """Raise ConfigError when the checkpoint's model or data stream differ from `config`
    (a checkpoint without a stored config is checked key by key when its weights load)."""
    if CONFIG_KEY not in checkpoint_keys(checkpoint):
        return
    differences = incompatible_fields(read_saved_config(checkpoint), config)
    if differences:
        raise ConfigError(f"cannot resume from {checkpoint}: " + "; ".join(differences))


def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Load the `model.*` entries of a DCP checkpoint into the sharded model, at any world
    size, and nothing else (the optimizer and schedule stay fresh, the step 0); collective.
    Raise ConfigError when its keys or shapes differ from the model's."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    stored = {key[len(MODEL_PREFIX):]: entry for key, entry in metadata.items() if key.startswith(MODEL_PREFIX)}
    expected = get_model_state_dict(model)
    names = weights_to_load(f"--resume {checkpoint}", sorted(stored), expected)
    for name, key in names.items():
        shape = tuple(getattr(stored[name], "size", ()))
        if shape != tuple(expected[key].shape):
            raise ConfigError(f"--resume {checkpoint}: {MODEL_PREFIX}{name} has shape {shape}, "
                              f"the model has {tuple(expected[key].shape)}")
    state = {"model": {name: expected[key] for name, key in names.items()}}
    dcp.load(state, checkpoint_id=str(checkpoint))
    loaded = {key: state["model"][name] for name, key in names.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=len(loaded) == len(expected)))


def weights_to_load(where: str, found: list[str], expected: dict) -> dict[str, str]:
    """Return {name in the source: model key} for the weights to load from a source holding
    `found`: every key of the model, or, into a LoRA model from a source without adapters (a
    base model), each base weight under its plain name (`...q_proj.weight` into
    `...q_proj.base_layer.weight`) while the adapters keep their fresh init. Raise ConfigError
    naming missing and unexpected keys otherwise."""
    if set(found) == set(expected) or not any(map(is_lora_parameter, expected)) \
            or any(map(is_lora_parameter, found)):
        _check_keys(where, found, sorted(expected))
        return {key: key for key in sorted(expected)}
    names = {base_weight_name(key): key for key in sorted(expected) if not is_lora_parameter(key)}
    _check_keys(where + " (base weights of a LoRA run)", found, sorted(names))
    return names


def _check_keys(where: str, found: list[str], expected: list[str]) -> None:
    """Raise ConfigError naming the first few missing and unexpected keys, if any."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ConfigError(f"{where}: keys do not match the model (missing: {missing[:5]}"
                          f"{' ...' if len(missing) > 5 else ''}; unexpected: {unexpected[:5]}"
                          f"{' ...' if len(unexpected) > 5 else ''}); check --arch, --size and the model flags")


def load_full_weights(model: nn.Module, source: Path) -> list[str]:
    """Load a full (unsharded) model state dict from a `.safetensors` file or a Hugging Face
    folder (`model.safetensors` or `model.safetensors.index.json` shards) into the sharded
    model; return notes to print (dtype casts). Keys may carry a `model.` prefix."""
    from safetensors.torch import load_file

    files = safetensors_files(source)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    expected = get_model_state_dict(model)
    plain = {base_weight_name(key) for key in expected}
    # Llama's own keys start with `model.` (model.embed_tokens.weight): strip only a prefix
    # the model does not have.
    if set(state) not in (set(expected), plain) and state and all(key.startswith(MODEL_PREFIX) for key in state):
        state = {key[len(MODEL_PREFIX):]: value for key, value in state.items()}
    names = weights_to_load(f"--init-from {source}", sorted(state), expected)
    notes = []
    loaded = {}
    for name, key in names.items():
        value, target = state[name], expected[key]
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(f"--init-from {source}: {name} has shape {tuple(value.shape)}, "
                              f"the model has {tuple(target.shape)}")
        if value.dtype != target.dtype:
            notes.append(f"{name}: cast {value.dtype} -> {target.dtype}")
            value = value.to(target.dtype)
        loaded[key] = value
    if len(loaded) < len(expected):
        notes.append(f"loaded the {len(loaded)} base weights of this LoRA run; its adapters keep their fresh init")
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True,
                                                                  strict=len(loaded) == len(expected)))
    return notes


def safetensors_files(source: Path) -> list[Path]:
    """Return the safetensors files of a file or a Hugging Face folder, in index order."""
    if source.is_file():
        return [source]
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [source / name for name in sorted(set(weight_map.values()))]
    single = source / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"--init-from {source}: not a .safetensors file, and the folder has neither "
                      "model.safetensors nor model.safetensors.index.json")


def export_full_weights(model: nn.Module, out: Path, runtime: Runtime) -> None:
    """Write the full model state dict (keys without the `model.` prefix) to `out` as
    safetensors from rank 0; collective over all ranks."""
    from safetensors.torch import save_file

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # FSDP1's rank0_only + offload_to_cpu path clones freed storage when the parameters
    # already live on the CPU (segfault in torch 2.13): there, every rank gathers instead.
    offload = not (isinstance(model, FSDP) and runtime.device.type == "cpu")
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
    state = get_model_state_dict(model, options=options)
    if runtime.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        temporary = out.with_name(out.name + TEMPORARY_SUFFIX)
        save_file({key: value.contiguous() for key, value in sorted(state.items())}, str(temporary),
                  metadata={"format": "pt"})
        os.chmod(temporary, 0o644)
        os.replace(temporary, out)
        print(f"exported {len(state)} tensors to {out}", file=sys.stderr)
    dist.barrier()
