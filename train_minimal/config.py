"""TrainConfig: every setting of a run, its presets, and the command line that fills it.

This module does not import torch, so the launcher can parse and reject a command line
in a fraction of a second before it spawns any rank.

Example:
    >>> config = parse_args(["--size", "tiny", "--steps", "20", "--nproc", "2"])
    >>> (config.dim, config.layers, config.global_batch, config.nproc)
    (32, 2, 12, 2)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

# Model sizes: (dim, layers, heads, vocab, seq_len). Vocab 256 holds every byte of a
# `--data` file; the synthetic corpus only uses ASCII (< 128), so `tiny` keeps 128.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"dim": 32, "layers": 2, "heads": 2, "vocab": 128, "seq_len": 32},
    "small": {"dim": 256, "layers": 4, "heads": 4, "vocab": 256, "seq_len": 128},
    # 14 blocks of 7.08M parameters + embeddings: 100.0M parameters (GPT-2 small widths).
    "100m": {"dim": 768, "layers": 14, "heads": 12, "vocab": 256, "seq_len": 512},
}
DEFAULT_SIZE = "tiny"
# Divisible by 1, 2, 3, 4 and 6, so the same run can move between those world sizes.
DEFAULT_GLOBAL_BATCH = 12
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
HYBRID_STRATEGIES = ("HYBRID_SHARD",)
# FSDP1 size-based wrapping: wrap a module once it holds this many parameters.
DEFAULT_WRAP_MIN_PARAMS = 100_000
# Fields that decide the shapes of the model: a checkpoint only resumes into the same ones.
ARCHITECTURE_FIELDS = ("dim", "layers", "heads", "vocab", "seq_len", "tie_embeddings")
# Fields that decide which tokens step k sees: resuming with other values would silently
# continue on another data stream.
DATA_FIELDS = ("seed", "data")


class ConfigError(ValueError):
    """A setting or a combination of settings that cannot work; the message says which."""


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run, after presets and defaults are resolved."""

    # model
    size: str = DEFAULT_SIZE
    dim: int = 32
    layers: int = 2
    heads: int = 2
    vocab: int = 128
    seq_len: int = 32
    tie_embeddings: bool = False
    dropout: float = 0.0
    # data
    data: str | None = None
    global_batch: int = DEFAULT_GLOBAL_BATCH
    seed: int = 0
    # schedule and optimizer
    steps: int = 100
    stop_at: int | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # launch
    nproc: int | None = None
    device: str = "auto"
    threads: int | None = None
    # parallelism
    fsdp: int = 2
    reshard_after_forward: bool = True
    replicate: int = 1
    sharding_strategy: str = "FULL_SHARD"
    wrap: str = "transformer"
    wrap_min_params: int = DEFAULT_WRAP_MIN_PARAMS
    backward_prefetch: str = "pre"
    mixed_precision: str = "fp32"
    param_dtype: str = "float32"
    cpu_offload: bool = False
    # checkpointing
    ckpt_dir: str | None = None
    save_every: int | None = None
    keep: int | None = None
    resume: str | None = None
    async_save: bool = False
    init_from: str | None = None
    export: str | None = None
    # logging
    log_file: str | None = None
    quiet: bool = False

    @property
    def last_step(self) -> int:
        """Return the step this invocation ends at: `--stop-at` if given, else `--steps`."""
        return self.steps if self.stop_at is None else min(self.stop_at, self.steps)

    def to_json(self) -> str:
        """Return the config as one JSON object with sorted keys (stored in checkpoints)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def check_world_size(self, world_size: int) -> None:
        """Raise ConfigError when this config cannot run on `world_size` ranks."""
        if self.global_batch % world_size:
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by the world size {world_size}: "
                f"every rank takes global_batch / world_size samples of step k (pick a global batch "
                f"that {world_size} divides, e.g. {world_size * max(1, self.global_batch // world_size)})")
        if world_size % self.replicate:
            raise ConfigError(f"--replicate {self.replicate} does not divide the world size {world_size}")


def incompatible_fields(saved: dict, config: TrainConfig) -> list[str]:
    """Return `name: saved -> now` for each architecture or data field that differs from a
    checkpoint's stored config (empty when the checkpoint can resume under `config`)."""
    differences = []
    for name in ARCHITECTURE_FIELDS + DATA_FIELDS:
        if name in saved and saved[name] != getattr(config, name):
            differences.append(f"{name}: {saved[name]!r} in the checkpoint, {getattr(config, name)!r} now")
    return differences


def build_parser() -> argparse.ArgumentParser:
    """Return the argparse parser of `python -m train_minimal`."""
    parser = argparse.ArgumentParser(
        prog="python -m train_minimal",
        description="Train a small GPT with FSDP and save sharded torch.distributed.checkpoint (DCP) checkpoints.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--size", choices=sorted(PRESETS), default=DEFAULT_SIZE,
                       help="preset for --dim --layers --heads --vocab --seq-len (explicit flags win)")
    model.add_argument("--dim", type=int, help="embedding width (default: from --size)")
    model.add_argument("--layers", type=int, help="number of transformer blocks (default: from --size)")
    model.add_argument("--heads", type=int, help="attention heads; must divide --dim (default: from --size)")
    model.add_argument("--vocab", type=int, help="vocabulary size; tokens are bytes, so --data needs 256 (default: from --size)")
    model.add_argument("--seq-len", type=int, help="tokens per sample (default: from --size)")
    model.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=False,
                       help="compute logits with the token embedding matrix instead of a separate lm_head")
    model.add_argument("--dropout", type=float, default=0.0,
                       help="dropout probability (uses the per-rank RNG that checkpoints store)")

    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="FILE",
                      help="train on this file's bytes instead of the built-in synthetic arithmetic corpus")
    data.add_argument("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH,
                      help="samples per step over all ranks; each rank takes global_batch / world_size")
    data.add_argument("--seed", type=int, default=0, help="seed of the model init, the data stream and the RNGs")

    schedule = parser.add_argument_group("schedule and optimizer (AdamW)")
    schedule.add_argument("--steps", type=int, default=100,
                          help="total steps of the run; defines the LR schedule; a resumed run continues up to it")
    schedule.add_argument("--stop-at", type=int, metavar="STEP",
                          help="end this invocation after STEP steps (and save), as a preempted job would; "
                               "the schedule still follows --steps")
    schedule.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    schedule.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this at --steps")
    schedule.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10%% of --steps, at least 1)")
    schedule.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    schedule.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this; 0 disables")

    launch = parser.add_argument_group("launch")
    launch.add_argument("--nproc", type=int,
                        help="spawn this many local ranks (default 1; not allowed under torchrun, which sets the world)")
    launch.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda (nccl) when available, else cpu (gloo)")
    launch.add_argument("--threads", type=int,
                        help="torch CPU threads per rank (default: CPU cores / local ranks, at least 1)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--fsdp", type=int, choices=(1, 2), default=2,
                          help="2: fully_shard (FSDP2, DTensor); 1: FullyShardedDataParallel (FSDP1)")
    parallel.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                          help="FSDP2: free gathered parameters after forward (ZeRO-3, default) or keep them "
                               "until backward (ZeRO-2)")
    parallel.add_argument("--replicate", type=int, default=1,
                          help="HSDP: R replicas x world/R shards on a 2-D mesh (FSDP1: with HYBRID_SHARD)")
    parallel.add_argument("--sharding-strategy", choices=SHARDING_STRATEGIES,
                          help="FSDP1 sharding strategy (default FULL_SHARD; HYBRID_SHARD when --replicate > 1)")
    parallel.add_argument("--wrap", choices=("transformer", "size"),
                          help="FSDP1 auto-wrap: one unit per block, or by --wrap-min-params (default transformer)")
    parallel.add_argument("--wrap-min-params", type=int,
                          help=f"FSDP1 --wrap size threshold (default {DEFAULT_WRAP_MIN_PARAMS})")
    parallel.add_argument("--backward-prefetch", choices=("pre", "post", "none"),
                          help="FSDP1 BackwardPrefetch: BACKWARD_PRE, BACKWARD_POST or off (default pre)")
    parallel.add_argument("--mixed-precision", choices=("fp32", "bf16"), default="fp32",
                          help="bf16: compute with bf16 parameters, reduce gradients in fp32, keep fp32 "
                               "sharded weights and optimizer state")
    parallel.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                          help="dtype of the stored (sharded) parameters and optimizer state; bfloat16 "
                               "trains fully in bf16 and writes bf16 checkpoints")
    parallel.add_argument("--cpu-offload", action="store_true",
                          help="keep sharded parameters, gradients and optimizer state in CPU memory "
                               "(needs an accelerator; an error on a CPU-only run)")

    checkpoint = parser.add_argument_group("checkpointing")
    checkpoint.add_argument("--ckpt-dir", metavar="DIR", help="save DCP checkpoints to DIR/step-00000010/ ...")
    checkpoint.add_argument("--save-every", type=int, metavar="K",
                            help="save every K steps and at the last step of the invocation "
                                 "(default with --ckpt-dir: only at the last step)")
    checkpoint.add_argument("--keep", type=int, metavar="K", help="keep only the newest K checkpoints (default: all)")
    checkpoint.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                            help="resume from DIR/latest (no value) or from PATH (a step directory, or a "
                                 "checkpoint directory whose latest is used)")
    checkpoint.add_argument("--async-save", action="store_true",
                            help="save with dcp.async_save: stage to CPU, write in a background thread")
    checkpoint.add_argument("--init-from", metavar="FILE.safetensors|HF_FOLDER",
                            help="load full model weights (fresh optimizer and schedule) before training")
    checkpoint.add_argument("--export", metavar="OUT.safetensors",
                            help="write the full model state dict from rank 0 at the end")

    logging = parser.add_argument_group("logging")
    logging.add_argument("--log-file", metavar="run.jsonl",
                         help="append one JSON line per step: loss, lr, tokens/s, per-rank bytes and peak RSS")
    logging.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Return the TrainConfig for a command line; exits with status 2 and a message on a
    usage error, as argparse does."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return resolve(vars(args))
    except ConfigError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def resolve(values: dict) -> TrainConfig:
    """Return a TrainConfig from parsed flag values: apply the preset, per-FSDP defaults and
    every cross-flag check that does not need torch."""
    preset = PRESETS[values["size"]]
    for name, preset_value in preset.items():
        if values.get(name) is None:
            values[name] = preset_value
    _check_positive(values, ("dim", "layers", "heads", "vocab", "seq_len", "global_batch", "steps", "replicate"))
    _check_positive(values, ("nproc", "threads", "save_every", "keep", "stop_at", "wrap_min_params"), optional=True)
    if values["dim"] % values["heads"]:
        raise ConfigError(f"--heads {values['heads']} does not divide --dim {values['dim']}")
    if not 0.0 <= values["dropout"] < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {values['dropout']}")
    if values["warmup_steps"] is None:
        values["warmup_steps"] = max(1, values["steps"] // 10)
    if values["stop_at"] is not None and values["stop_at"] > values["steps"]:
        raise ConfigError(f"--stop-at {values['stop_at']} is beyond --steps {values['steps']}")
    if values["nproc"] is not None and values["global_batch"] % values["nproc"]:
        raise ConfigError(
            f"--global-batch {values['global_batch']} is not divisible by --nproc {values['nproc']}: every rank "
            "takes global_batch / world_size samples of each step")
    if values["nproc"] is not None and values["nproc"] % values["replicate"]:
        raise ConfigError(f"--replicate {values['replicate']} does not divide --nproc {values['nproc']}")
    _resolve_parallelism(values)
    if (values["save_every"] is not None or values["keep"] is not None or values["async_save"]) and not values["ckpt_dir"]:
        raise ConfigError("--save-every, --keep and --async-save need --ckpt-dir")
    if values["resume"] == "latest" and not values["ckpt_dir"]:
        raise ConfigError("--resume without a PATH resumes from --ckpt-dir's latest checkpoint: pass --ckpt-dir")
    if values["resume"] and values["init_from"]:
        raise ConfigError("--resume and --init-from exclude each other: a checkpoint already holds the weights")
    if values["export"] and not values["export"].endswith(".safetensors"):
        raise ConfigError(f"--export writes safetensors: the name must end in .safetensors, got {values['export']}")
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{name: value for name, value in values.items() if name in fields})


def _resolve_parallelism(values: dict) -> None:
    """Fill the per-FSDP-version defaults and reject flags the chosen version does not have."""
    fsdp1_only = ("sharding_strategy", "wrap", "wrap_min_params", "backward_prefetch")
    if values["fsdp"] == 2:
        given = [name for name in fsdp1_only if values[name] is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"{flags}: FSDP1 options, add --fsdp 1 (FSDP2 uses --reshard-after-forward and --replicate)")
        if values["reshard_after_forward"] is None:
            values["reshard_after_forward"] = True
        for name in fsdp1_only:
            values.pop(name)
        return
    if values["reshard_after_forward"] is not None:
        raise ConfigError("--reshard-after-forward is FSDP2's: with --fsdp 1 use --sharding-strategy "
                          "FULL_SHARD (reshard) or SHARD_GRAD_OP (keep until backward)")
    values.pop("reshard_after_forward")
    if values["sharding_strategy"] is None:
        values["sharding_strategy"] = "HYBRID_SHARD" if values["replicate"] > 1 else "FULL_SHARD"
    hybrid = values["sharding_strategy"] in HYBRID_STRATEGIES
    if hybrid and values["replicate"] == 1:
        raise ConfigError(f"--sharding-strategy {values['sharding_strategy']} needs --replicate R > 1 (R replicas)")
    if values["replicate"] > 1 and not hybrid:
        raise ConfigError(f"--replicate with --fsdp 1 needs --sharding-strategy HYBRID_SHARD, "
                          f"not {values['sharding_strategy']}")
    if values["wrap"] is None:
        values["wrap"] = "transformer"
    if values["wrap_min_params"] is None:
        values["wrap_min_params"] = DEFAULT_WRAP_MIN_PARAMS
    elif values["wrap"] != "size":
        raise ConfigError("--wrap-min-params only applies to --wrap size")
    if values["backward_prefetch"] is None:
        values["backward_prefetch"] = "pre"


def _check_positive(values: dict, names: tuple[str, ...], optional: bool = False) -> None:
    for name in names:
        value = values.get(name)
        if value is None and optional:
            continue
        if value is None or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
