"""TrainConfig: every setting of a run, its presets, and the command line that fills it.

Each setting is declared once, as a TrainConfig field: its default, its help line and any
flag detail (choices, metavar, action) sit in the field, and `build_parser` makes one flag
per field (`seq_len` is `--seq-len`, its type comes from the annotation).

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
import typing
from dataclasses import dataclass
from typing import Any

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
ARCHITECTURES = ("gpt", "llama")
# Settings only the Llama-shaped model has (None in a GPT run's config).
LLAMA_FIELDS = ("kv_heads", "intermediate_size", "norm_eps", "rope_theta")
# transformers' LlamaConfig defaults (models/llama/configuration_llama.py): rms_norm_eps 1e-6,
# rope_theta 10000.0; written to config.json by `ckpttool export` as rms_norm_eps, rope_theta.
DEFAULT_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0
# The Llama MLP width when not given: 8/3 x dim (the parameter count of a 4x GELU MLP in
# three matrices, as Llama chose) rounded up to a multiple of this.
INTERMEDIATE_MULTIPLE = 16
# LoRA (--arch llama only): the Linear modules an adapter may target (PEFT's target_modules
# names them by their last component) and PEFT's LoraConfig defaults.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_LORA_TARGETS = "q_proj,v_proj"  # what PEFT picks for Llama when target_modules is not given
DEFAULT_LORA_ALPHA = 8.0
# The LoRA settings: None (or False) in a run without LoRA. They decide the adapter's shapes and
# function, so a checkpoint resumes only with the same ones; a checkpoint written before they
# existed has none of them and counts as a run without LoRA.
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "rslora")
# Fields that decide the shapes of the model: a checkpoint only resumes into the same ones.
ARCHITECTURE_FIELDS = ("arch", "dim", "layers", "heads", "vocab", "seq_len", "tie_embeddings") + LLAMA_FIELDS
# Fields that decide which tokens step k sees: resuming with other values would silently
# continue on another data stream.
DATA_FIELDS = ("seed", "data")


class ConfigError(ValueError):
    """A setting or a combination of settings that cannot work; the message says which."""


def setting(default: Any, help: str, *, section: str | None = None, flag_default: Any = dataclasses.MISSING,
            **flag_options: Any) -> Any:
    """Return a TrainConfig field that also declares its command-line flag.

    `help` is the flag's help line (--help appends the flag's default). `section` opens a
    --help section of that title, holding this setting and the ones after it. The flag's
    default is `default` unless `flag_default` says otherwise: None lets resolve() tell an
    omitted flag from a given one, then derive the value (from --size, --steps, --replicate)
    or leave `default` in place. `flag_options` go to add_argument as they are (choices,
    metavar, action, nargs, const); a bool setting is a store_true flag unless it names an action.

    Example:
        lr: float = setting(3e-3, "peak learning rate")  # --lr LR, a float, default 0.003
        stop_at: int | None = setting(None, "end after STEP steps", metavar="STEP")  # --stop-at STEP, an int
    """
    if flag_default is not dataclasses.MISSING:
        flag_options["default"] = flag_default
    return dataclasses.field(default=default, metadata={"help": help, "section": section, "flag": flag_options})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run, after presets and defaults are resolved; each field is also a
    flag of `python -m train_minimal` (see `setting`)."""

    arch: str = setting("gpt", "gpt: learned positions, LayerNorm, GELU MLP; llama: transformers' LlamaForCausalLM "
                               "(names and weight layout; RMSNorm, rotary attention, SwiGLU MLP), which "
                               "`ckpttool export` writes with a LlamaConfig config.json",
                        section="model", choices=ARCHITECTURES)
    size: str = setting(DEFAULT_SIZE, "preset for --dim --layers --heads --vocab --seq-len (explicit flags win)",
                        choices=sorted(PRESETS))
    dim: int = setting(32, "embedding width (default: from --size)", flag_default=None)
    layers: int = setting(2, "number of transformer blocks (default: from --size)", flag_default=None)
    heads: int = setting(2, "attention heads; must divide --dim (default: from --size)", flag_default=None)
    vocab: int = setting(128, "vocabulary size; tokens are bytes, so --data needs 256 (default: from --size)",
                         flag_default=None)
    seq_len: int = setting(32, "tokens per sample (default: from --size)", flag_default=None)
    tie_embeddings: bool = setting(False, "compute logits with the token embedding matrix "
                                          "instead of a separate lm_head", action=argparse.BooleanOptionalAction)
    kv_heads: int | None = setting(None, "llama: key/value heads (grouped-query attention); must divide --heads "
                                         "(default: --heads)")
    intermediate_size: int | None = setting(None, "llama: SwiGLU MLP width (default: 8/3 x --dim, rounded up to a "
                                                  f"multiple of {INTERMEDIATE_MULTIPLE})")
    norm_eps: float | None = setting(None, f"llama: RMSNorm epsilon, config.json's rms_norm_eps "
                                           f"(default {DEFAULT_NORM_EPS})")
    rope_theta: float | None = setting(None, f"llama: rotary base, config.json's rope_theta "
                                             f"(default {DEFAULT_ROPE_THETA})")
    dropout: float = setting(0.0, "dropout probability (uses the per-rank RNG that checkpoints store); "
                                  "llama: on the attention weights only, as LlamaConfig's attention_dropout")

    lora_rank: int | None = setting(None, "llama: train a LoRA adapter of rank R on the --lora-targets and freeze "
                                          "every base weight (PEFT's layer names and init; the checkpoint also "
                                          "holds PEFT's adapter_config.json)", section="LoRA", metavar="R")
    lora_alpha: float | None = setting(None, f"LoRA scaling numerator: the update is scaled by alpha / R "
                                             f"(alpha / sqrt(R) with --rslora) (default {DEFAULT_LORA_ALPHA:g}, "
                                             f"PEFT's)", metavar="A")
    lora_targets: str | None = setting(None, "comma-separated module names that get an adapter, from "
                                             f"{','.join(LORA_TARGETS)} (default {DEFAULT_LORA_TARGETS})",
                                       metavar="NAMES")
    lora_dropout: float | None = setting(None, "dropout on the adapter's input (default 0.0)", metavar="P")
    rslora: bool = setting(False, "rank-stabilised LoRA: scale by alpha / sqrt(R) instead of alpha / R")

    data: str | None = setting(None, "train on this file's bytes instead of the built-in synthetic arithmetic corpus",
                               section="data", metavar="FILE")
    global_batch: int = setting(DEFAULT_GLOBAL_BATCH,
                                "samples per step over all ranks; each rank takes global_batch / world_size")
    seed: int = setting(0, "seed of the model init, the data stream and the RNGs")

    steps: int = setting(100, "total steps of the run; defines the LR schedule; a resumed run continues up to it",
                         section="schedule and optimizer (AdamW)")
    stop_at: int | None = setting(None, "end this invocation after STEP steps (and save), as a preempted job would; "
                                        "the schedule still follows --steps", metavar="STEP")
    lr: float = setting(3e-3, "peak learning rate")
    min_lr_ratio: float = setting(0.1, "cosine decays to lr * this at --steps")
    warmup_steps: int = setting(10, "linear warmup steps (default: 10%% of --steps, at least 1)", flag_default=None)
    weight_decay: float = setting(0.1, "AdamW weight decay")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 disables")

    nproc: int | None = setting(None, "spawn this many local ranks "
                                      "(default 1; not allowed under torchrun, which sets the world)", section="launch")
    device: str = setting("auto", "auto: cuda (nccl) when available, else cpu (gloo)", choices=("auto", "cpu", "cuda"))
    threads: int | None = setting(None, "torch CPU threads per rank (default: CPU cores / local ranks, at least 1)")

    fsdp: int = setting(2, "2: fully_shard (FSDP2, DTensor); 1: FullyShardedDataParallel (FSDP1)",
                        section="parallelism", choices=(1, 2))
    reshard_after_forward: bool = setting(True, "FSDP2: free gathered parameters after forward (ZeRO-3, default) "
                                                "or keep them until backward (ZeRO-2)",
                                          flag_default=None, action=argparse.BooleanOptionalAction)
    replicate: int = setting(1, "HSDP: R replicas x world/R shards on a 2-D mesh (FSDP1: with HYBRID_SHARD)")
    sharding_strategy: str = setting("FULL_SHARD", "FSDP1 sharding strategy "
                                                   "(default FULL_SHARD; HYBRID_SHARD when --replicate > 1)",
                                     flag_default=None, choices=SHARDING_STRATEGIES)
    wrap: str = setting("transformer", "FSDP1 auto-wrap: one unit per block, or by --wrap-min-params "
                                       "(default transformer)", flag_default=None, choices=("transformer", "size"))
    wrap_min_params: int = setting(DEFAULT_WRAP_MIN_PARAMS, f"FSDP1 --wrap size threshold "
                                                            f"(default {DEFAULT_WRAP_MIN_PARAMS})", flag_default=None)
    backward_prefetch: str = setting("pre", "FSDP1 BackwardPrefetch: BACKWARD_PRE, BACKWARD_POST or off (default pre)",
                                     flag_default=None, choices=("pre", "post", "none"))
    mixed_precision: str = setting("fp32", "bf16: compute with bf16 parameters, reduce gradients in fp32, "
                                           "keep fp32 sharded weights and optimizer state", choices=("fp32", "bf16"))
    param_dtype: str = setting("float32", "dtype of the stored (sharded) parameters and optimizer state; "
                                          "bfloat16 trains fully in bf16 and writes bf16 checkpoints",
                               choices=("float32", "bfloat16"))
    cpu_offload: bool = setting(False, "keep sharded parameters, gradients and optimizer state in CPU memory "
                                       "(needs an accelerator; an error on a CPU-only run)")

    ckpt_dir: str | None = setting(None, "save DCP checkpoints to DIR/step-00000010/ ...",
                                   section="checkpointing", metavar="DIR")
    save_every: int | None = setting(None, "save every K steps and at the last step of the invocation "
                                           "(default with --ckpt-dir: only at the last step)", metavar="K")
    keep: int | None = setting(None, "keep only the newest K checkpoints (default: all)", metavar="K")
    resume: str | None = setting(None, "resume from DIR/latest (no value) or from PATH "
                                       "(a step directory, or a checkpoint directory whose latest is used); "
                                       "--resume \"$(ckpttool latest DIR)\" takes DIR's newest whole step "
                                       "(empty when there is none: a fresh start)",
                                 nargs="?", const="latest", metavar="PATH")
    async_save: bool = setting(False, "save with dcp.async_save: stage to CPU, write in a background thread")
    init_from: str | None = setting(None, "load full model weights (fresh optimizer and schedule) before training",
                                    metavar="FILE.safetensors|HF_FOLDER")
    export: str | None = setting(None, "write the full model state dict from rank 0 at the end",
                                 metavar="OUT.safetensors")

    log_file: str | None = setting(None, "append one JSON line per step: loss, lr, tokens/s, per-rank bytes "
                                         "and peak RSS", section="logging", metavar="run.jsonl")
    quiet: bool = setting(False, "no progress bar")

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
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    for name in LORA_FIELDS:
        stored = saved.get(name, defaults[name])
        if stored != getattr(config, name):
            differences.append(f"{name}: {stored!r} in the checkpoint, {getattr(config, name)!r} now")
    return differences


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says each flag's default once: argparse's, unless the help already says where the
    value comes from (`(default: from --size)`) or there is none to say (None, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """Return the argparse parser of `python -m train_minimal`: one flag per TrainConfig field."""
    parser = argparse.ArgumentParser(
        prog="python -m train_minimal",
        description="Train a small GPT (or a Llama-shaped model, --arch llama) with FSDP and save sharded "
                    "torch.distributed.checkpoint (DCP) checkpoints.",
        formatter_class=_HelpFormatter,
    )
    annotations = typing.get_type_hints(TrainConfig)
    section = parser
    for field in dataclasses.fields(TrainConfig):
        if field.metadata["section"]:
            section = parser.add_argument_group(field.metadata["section"])
        options = {"default": field.default, **field.metadata["flag"]}
        if annotations[field.name] is bool:
            options.setdefault("action", "store_true")
        else:
            options["type"] = _value_type(annotations[field.name])
        section.add_argument(_flag(field.name), help=field.metadata["help"], **options)
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
    every cross-flag check that does not need torch. A value still None at the end takes its
    field's default (an omitted --wrap, say, or --reshard-after-forward under FSDP1)."""
    preset = PRESETS[values["size"]]
    for name, preset_value in preset.items():
        if values.get(name) is None:
            values[name] = preset_value
    _check_positive(values, ("dim", "layers", "heads", "vocab", "seq_len", "global_batch", "steps", "replicate"))
    _check_positive(values, ("nproc", "threads", "save_every", "keep", "stop_at", "wrap_min_params"), optional=True)
    if values["dim"] % values["heads"]:
        raise ConfigError(f"--heads {values['heads']} does not divide --dim {values['dim']}")
    _resolve_architecture(values)
    _resolve_lora(values)
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
    return TrainConfig(**{name: value for name, value in values.items() if value is not None})


def _resolve_architecture(values: dict) -> None:
    """Fill in the Llama settings (stored resolved, so `ckpttool export` reads them from the
    checkpoint) or reject them on a GPT run."""
    if values["arch"] != "llama":
        given = [name for name in LLAMA_FIELDS if values.get(name) is not None]
        if given:
            raise ConfigError(f"{', '.join(map(_flag, given))}: settings of the Llama-shaped model, add --arch llama")
        return
    _check_positive(values, ("kv_heads", "intermediate_size"), optional=True)
    if values["kv_heads"] is None:
        values["kv_heads"] = values["heads"]
    if values["heads"] % values["kv_heads"]:
        raise ConfigError(f"--kv-heads {values['kv_heads']} does not divide --heads {values['heads']}")
    if (values["dim"] // values["heads"]) % 2:
        raise ConfigError(f"--dim {values['dim']} / --heads {values['heads']} = {values['dim'] // values['heads']}: "
                          "rotary attention needs an even head width")
    if values["intermediate_size"] is None:
        multiple = INTERMEDIATE_MULTIPLE
        values["intermediate_size"] = -(-8 * values["dim"] // (3 * multiple)) * multiple
    if values["norm_eps"] is None:
        values["norm_eps"] = DEFAULT_NORM_EPS
    if values["rope_theta"] is None:
        values["rope_theta"] = DEFAULT_ROPE_THETA
    if not values["norm_eps"] > 0 or not values["rope_theta"] > 0:
        raise ConfigError("--norm-eps and --rope-theta must be positive")


def _resolve_lora(values: dict) -> None:
    """Fill in the LoRA settings of a `--lora-rank` run (targets sorted and unique, so the
    stored config compares equal however they were listed) or reject them without one."""
    if values.get("lora_rank") is None:
        given = [name for name in LORA_FIELDS[1:] if values.get(name)]
        if given:
            raise ConfigError(f"{', '.join(map(_flag, given))}: LoRA settings, add --lora-rank R")
        return
    if values["arch"] != "llama":
        raise ConfigError("--lora-rank: LoRA layers exist for --arch llama only (PEFT's names on "
                          "LlamaForCausalLM's modules)")
    if values["fsdp"] != 2:
        raise ConfigError("--lora-rank trains with FSDP2 (--fsdp 2): FSDP1 is not supported for LoRA runs")
    _check_positive(values, ("lora_rank",))
    targets = values["lora_targets"] if values["lora_targets"] is not None else DEFAULT_LORA_TARGETS
    names = sorted({name.strip() for name in targets.split(",") if name.strip()})
    unknown = [name for name in names if name not in LORA_TARGETS]
    if unknown or not names:
        raise ConfigError(f"--lora-targets {targets!r}: choose from {','.join(LORA_TARGETS)}"
                          + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
    values["lora_targets"] = ",".join(names)
    if values["lora_alpha"] is None:
        values["lora_alpha"] = DEFAULT_LORA_ALPHA
    if not values["lora_alpha"] > 0:
        raise ConfigError(f"--lora-alpha must be positive, got {values['lora_alpha']}")
    if values["lora_dropout"] is None:
        values["lora_dropout"] = 0.0
    if not 0.0 <= values["lora_dropout"] < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {values['lora_dropout']}")


def _resolve_parallelism(values: dict) -> None:
    """Reject flags the chosen FSDP version does not have and pick FSDP1's strategy for --replicate;
    omitted ones stay None and take their field defaults."""
    fsdp1_only = ("sharding_strategy", "wrap", "wrap_min_params", "backward_prefetch")
    if values["fsdp"] == 2:
        given = [name for name in fsdp1_only if values[name] is not None]
        if given:
            raise ConfigError(f"{', '.join(map(_flag, given))}: FSDP1 options, add --fsdp 1 "
                              "(FSDP2 uses --reshard-after-forward and --replicate)")
        return
    if values["reshard_after_forward"] is not None:
        raise ConfigError("--reshard-after-forward is FSDP2's: with --fsdp 1 use --sharding-strategy "
                          "FULL_SHARD (reshard) or SHARD_GRAD_OP (keep until backward)")
    if values["sharding_strategy"] is None and values["replicate"] > 1:
        values["sharding_strategy"] = "HYBRID_SHARD"
    hybrid = values["sharding_strategy"] in HYBRID_STRATEGIES
    if hybrid and values["replicate"] == 1:
        raise ConfigError(f"--sharding-strategy {values['sharding_strategy']} needs --replicate R > 1 (R replicas)")
    if values["replicate"] > 1 and not hybrid:
        raise ConfigError(f"--replicate with --fsdp 1 needs --sharding-strategy HYBRID_SHARD, "
                          f"not {values['sharding_strategy']}")
    if values["wrap_min_params"] is not None and values["wrap"] != "size":
        raise ConfigError("--wrap-min-params only applies to --wrap size")


def _value_type(annotation: Any) -> type:
    """Return the type a flag's value converts to: int for `int` and for `int | None`."""
    members = [member for member in typing.get_args(annotation) if member is not type(None)]
    return members[0] if members else annotation


def _flag(name: str) -> str:
    """Return the command-line spelling of a TrainConfig field: `--seq-len` for `seq_len`."""
    return "--" + name.replace("_", "-")


def _check_positive(values: dict, names: tuple[str, ...], optional: bool = False) -> None:
    for name in names:
        value = values.get(name)
        if value is None and optional:
            continue
        if value is None or value < 1:
            raise ConfigError(f"{_flag(name)} must be a positive integer, got {value}")
