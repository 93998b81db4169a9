"""The options of the commands, one frozen dataclass per concern, validated once when built.

`SourceOptions` says how to read the source (symlinks, object-storage options, where the model
sits: `source_options.py`, which `inspect` and `validate` import without this module),
`WriteOptions` how to write (replace, dry run, verify, threads, memory, progress, notices),
`ConvertOptions` what consolidate and export write from the source (which entries, under which
keys, in which dtypes, in what shards). The CLI builds each once per command from its flags; a
library caller builds them the same way. A bad value raises UsageError naming the flag.

Example:
    >>> write = WriteOptions(verify=True, max_memory="1GB")
    >>> write.max_memory, ConvertOptions(dtype="bf16").cast
    (1000000000, 'bfloat16')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ckpttool.core import dtypes
from ckpttool.core.errors import UsageError
from ckpttool.store.io import DEFAULT_MAX_MEMORY, DEFAULT_THREADS, ProgressFactory, no_progress, parse_size
from ckpttool.outputs.notices import Notify, ignore
from ckpttool.source_options import SourceOptions as SourceOptions  # its home; imported from here too

if TYPE_CHECKING:  # keys.py is imported when a ConvertOptions is built: inspect and validate never build one
    from ckpttool.model.keys import KeyRules

DTYPE_CHOICES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_dtype(name: str, option: str = "--dtype") -> str:
    """Return the torch dtype name for `bf16|fp16|fp32` (or a torch spelling of them)."""
    try:
        canonical = dtypes.canonical(name.lower())
    except KeyError:
        canonical = None
    if canonical is None or canonical not in DTYPE_CHOICES.values():
        raise UsageError(f"{option} {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return canonical


def parse_dtype_map(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Return (glob, dtype) pairs from `GLOB=DTYPE` strings."""
    pairs = []
    for item in items:
        glob, separator, name = item.rpartition("=")
        if not separator or not glob:
            raise UsageError(f"--dtype-map {item!r}: expected 'GLOB=DTYPE', e.g. '*norm*=fp32'")
        pairs.append((glob, parse_dtype(name, "--dtype-map")))
    return tuple(pairs)


@dataclass(frozen=True)
class WriteOptions:
    """How a writing command writes: `force` replaces an existing output, `dry_run` writes
    nothing, `verify` reads the output back; `threads` and `max_memory` (bytes, or a size
    like "512MB") bound the IO; `progress` makes byte bars; `notify` hears of files replaced
    and killed runs' leftovers removed (`outputs.notices`)."""

    force: bool = False
    dry_run: bool = False
    verify: bool = False
    threads: int = DEFAULT_THREADS
    max_memory: int | str = DEFAULT_MAX_MEMORY
    progress: ProgressFactory = field(default=no_progress, compare=False)
    notify: Notify = field(default=ignore, compare=False)

    def __post_init__(self) -> None:
        budget = parse_size(self.max_memory)
        if budget <= 0:
            raise UsageError("--max-memory must be positive")
        if self.threads < 1:
            raise UsageError("--threads must be at least 1")
        object.__setattr__(self, "max_memory", budget)


@dataclass(frozen=True)
class ConvertOptions:
    """What consolidate (and export) write from a checkpoint: every entry or the model's
    weights (`everything`), `filters` globs, wrapper names kept (`keep_keys`), `--rename`
    rules, a `dtype` for floating tensors and per-key `dtype_map` (`GLOB=DTYPE`), one copy of
    tied weights (`drop_tied`), the largest shard of a directory output (`max_shard_size`),
    `quantize="fp8"` to write the linear weights as fine-grained FP8 in `block`s, the framework
    tensors a naming table may leave out although they change the outputs (`drops`, globs), and
    the vocabulary export cuts Megatron's padded rows to (`vocab_size`; None: what the save states)."""

    everything: bool = False
    filters: tuple[str, ...] = ()
    keep_keys: bool = False
    renames: tuple[str, ...] = ()
    dtype: str | None = None
    dtype_map: tuple[str, ...] = ()
    drop_tied: bool = False
    max_shard_size: str | int | None = None
    quantize: str | None = None  # "fp8": write fine-grained FP8 (formats.fp8) from a bf16/fp32 source
    block: tuple[int, int] = (128, 128)  # --quantize fp8's block (rows, cols)
    drops: tuple[str, ...] = ()  # --drop: globs of framework tensors export may leave out although they change the outputs
    # --vocab-size: export writes the first N rows of Megatron's padded embedding and output layer, config.json says N
    vocab_size: int | None = None
    # derived, checked when built
    rules: KeyRules = field(init=False, repr=False, compare=False)
    cast: str | None = field(init=False, repr=False, compare=False)  # the torch dtype name of `dtype`
    cast_map: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)
    shard_bytes: int | None = field(init=False, repr=False, compare=False)  # max_shard_size parsed

    def __post_init__(self) -> None:
        from ckpttool.model.keys import KeyRules, Rename

        for name in ("filters", "renames", "dtype_map", "drops"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        rules = KeyRules(self.everything, not self.keep_keys, tuple(Rename.parse(r) for r in self.renames), self.filters)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "cast", parse_dtype(self.dtype) if self.dtype else None)
        object.__setattr__(self, "cast_map", parse_dtype_map(self.dtype_map))
        object.__setattr__(self, "shard_bytes", None if self.max_shard_size is None else parse_size(self.max_shard_size))
        if self.quantize not in (None, "fp8"):
            raise UsageError(f"--quantize {self.quantize!r}: choose fp8")
        block = tuple(self.block)
        if len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
            raise UsageError(f"--block {self.block!r}: two positive integers, e.g. 128x128")
        object.__setattr__(self, "block", block)
        if self.quantize and (self.dtype or self.dtype_map):
            raise UsageError("--quantize fp8 writes float8 weights with float32 scales: --dtype and --dtype-map do not apply")
        if self.vocab_size is not None and (type(self.vocab_size) is not int or self.vocab_size <= 0):
            raise UsageError(f"--vocab-size {self.vocab_size!r}: a positive number of tokens")


@dataclass(frozen=True)
class AdapterOptions:
    """Which LoRA adapter `export --adapter`/`--merge-adapter` takes (`name`; None: the only
    one), and the adapter_config.json fields the weights cannot tell, over a config found beside
    the checkpoint or in --assets: `lora_alpha`, `use_rslora`, `fan_in_fan_out`, `lora_dropout`,
    `base_model_name_or_path` (None: not given)."""

    name: str | None = None
    lora_alpha: float | None = None
    use_rslora: bool | None = None
    fan_in_fan_out: bool | None = None
    lora_dropout: float | None = None
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise UsageError("--lora-alpha must be positive")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise UsageError("--lora-dropout must be in [0, 1)")

    def flags(self) -> dict[str, Any]:
        """Return the config fields the flags set (those not None)."""
        alpha = self.lora_alpha
        if alpha is not None and float(alpha).is_integer():
            alpha = int(alpha)  # LoraConfig.lora_alpha is an int in PEFT's own files
        values = {"lora_alpha": alpha, "use_rslora": self.use_rslora, "fan_in_fan_out": self.fan_in_fan_out,
                  "lora_dropout": self.lora_dropout, "base_model_name_or_path": self.base_model_name_or_path}
        return {key: value for key, value in values.items() if value is not None}
