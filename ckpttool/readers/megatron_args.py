"""Stand-ins for what Megatron-LM's pickled arguments name (nothing here runs code from a file).

Megatron-LM saves its parsed command line, an `argparse.Namespace`, in every checkpoint: in
common.pt (`torch_dist`), in each legacy rank file's `model_optim_rng.pt` and in an fsdp_dtensor
save's `args` entry. Its values are numbers, strings, torch dtypes and a few Enum members
(`--attention-backend`, `--exit-signal`, Megatron-DeepSpeed's `model_type`). `ARGS_ALLOWED` is
the part of a checking unpickler's allowlist that reads them as inert records: the Namespace
filled by BUILD, each Enum member as an `EnumValue` (class name and value, or name where the
pickle names it: Python 3.11.0-3.11.4 pickle a global enum's member as `signal.SIGTERM` and any
other's as `getattr(AttnBackend, "auto")`).

Example:
    >>> _ALLOWED = {**_TENSOR_PICKLE_ALLOWED, **ARGS_ALLOWED}   # naming/megatron_config.py's
    >>> ARGS_ALLOWED[("signal", "SIGTERM")]
    EnumValue(enum='Signals', value=15)
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from ckpttool.core.errors import UnsafeMetadata


class Namespace:
    """`argparse.Namespace`: made empty by NEWOBJ, its arguments put in `__dict__` by BUILD."""


@dataclass(frozen=True)
class EnumValue:
    """A member of an Enum an argument holds (`AttnBackend(5)`), recorded by class name and value."""

    enum: str
    value: Any


class _Enum:
    """An admitted Enum class: calling it (REDUCE) records the value, nothing else."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, value: Any) -> EnumValue:
        return EnumValue(self.name, value)


def _by_name(enum: Any, name: Any) -> EnumValue:
    """`getattr(AnEnum, "member")`, as Python 3.11.0-3.11.4 pickle an Enum member: only a member
    of an admitted Enum (`_Enum`), recorded by its name; getattr of anything else is refused."""
    if isinstance(enum, _Enum) and type(name) is str:
        return EnumValue(enum.name, name)
    raise UnsafeMetadata(f"getattr of {type(enum).__name__} {name!r:.40}, not a member of an Enum Megatron-LM's arguments hold")


ARGS_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    # the Enum-valued arguments of Megatron-LM core_v0.16.1 (--attention-backend, --exit-signal)
    ("megatron.core.transformer.enums", "AttnBackend"): _Enum("AttnBackend"),
    ("signal", "Signals"): _Enum("Signals"),
    # Megatron-DeepSpeed's `args.model_type` (megatron/training.py `pretrain` sets it)
    ("megatron.core.enums", "ModelType"): _Enum("ModelType"),
    # the same member pickled by name (`signal.SIGTERM`): Python 3.11.0-3.11.4's global enums reduce so
    **{("signal", member.name): EnumValue("Signals", member.value) for member in signal.Signals},
    # and an Enum's member (`AttnBackend.auto`) as getattr(AttnBackend, "auto"), the same Pythons
    ("builtins", "getattr"): _by_name,
    ("__builtin__", "getattr"): _by_name,
}
