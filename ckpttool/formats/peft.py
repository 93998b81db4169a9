"""PEFT's adapter folder, in one place: file names, the adapter file's key names, the
`adapter_config.json` fields export writes and checks, and LoRA's scaling rule.

`PeftModel.save_pretrained` writes `adapter_model.safetensors` with the keys
`get_peft_model_state_dict` returns: the model's keys (with `base_model.model.`) of the
adapter's tensors, the adapter name removed (`peft/tuners/tuners_utils.py`
`_remove_adapter_name_from_state_dict_key`), DoRA's `lora_magnitude_vector.<adapter>.weight`
saved as `lora_magnitude_vector` (`LoraModel._get_adapter_state_dict`), and a
`modules_to_save.<adapter>.<rest>` copy saved under the wrapper's own name `<module>.<rest>`
(`ModulesToSaveWrapper.adapter_state_dict`). `adapter_config.json` is `LoraConfig`'s fields.

Example:
    >>> adapter_file_key("base_model.model.fc.lora_A.default.weight", "default", wrapped=True)
    'base_model.model.fc.lora_A.weight'
    >>> adapter_file_key("fc.lora_embedding_B.default", "default", wrapped=False)
    'base_model.model.fc.lora_embedding_B'
    >>> scaling(16, 8, use_rslora=True)
    5.65685424949238
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ckpttool.core.errors import InvalidCheckpoint, UsageError
from ckpttool.store.safepaths import MAX_JSON_BYTES, read_json_object

WEIGHTS_NAME = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
CONFIG_NAME = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME
WRAPPER_PREFIX = "base_model.model."
_MAGNITUDE_SUFFIX = "lora_magnitude_vector.{adapter}.weight"
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")

# What LoraConfig.save_pretrained writes when the weights and flags say nothing else
# (peft/tuners/lora/config.py LoraConfig defaults, peft 0.21).
CONFIG_DEFAULTS: Mapping[str, Any] = {
    "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "revision": None,
    "inference_mode": True, "r": 8, "target_modules": None, "lora_alpha": 8, "lora_dropout": 0.0,
    "fan_in_fan_out": False, "bias": "none", "use_rslora": False, "use_dora": False, "lora_bias": False,
    "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
    "rank_pattern": {}, "alpha_pattern": {}, "exclude_modules": None,
}


def adapter_file_key(key: str, adapter: str, wrapped: bool) -> str:
    """Return the key PEFT's save_pretrained gives the model key `key` of adapter `adapter`."""
    if key.endswith("." + _MAGNITUDE_SUFFIX.format(adapter=adapter)):
        key = key[: -len(".weight")]
    if match := _SAVED.match(key):
        key = f"{match['module']}.{match['rest']}"
    elif key.endswith(f".{adapter}"):  # a Parameter (lora_embedding_A/B, old DoRA): the name is last
        key = key.removesuffix(f".{adapter}")
    else:  # a module's parameter: the name is second to last
        head, _, suffix = key.rpartition(".")
        key = f"{re.sub(re.escape('.' + adapter) + '$', '', head)}.{suffix}"
    return key if wrapped else WRAPPER_PREFIX + key


def scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """Return LoRA's scale for one module, as `LoraLayer.update_layer` computes it."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def pattern_value(patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    """Return the value of the first rank_pattern/alpha_pattern key matching module `path`
    (peft.utils.other.get_pattern_key: `(.*\\.)?(<key>)$`), else `default`."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def targets_module(target_modules: str | Sequence[str] | None, path: str) -> bool:
    """Return whether `target_modules` selects module `path`
    (peft.tuners.tuners_utils.check_target_module_exists)."""
    if target_modules is None:
        return False
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path) is not None
    return path in target_modules or any(path.endswith(f".{target}") for target in target_modules)


def build_config(given: Mapping[str, Any] | None, modules: Sequence[tuple[str, int]], flags: Mapping[str, Any],
                 where: str) -> dict[str, Any]:
    """Return adapter_config.json for LoRA `modules` ((path, rank) pairs, from the weights):
    the `given` config's fields (else PEFT's defaults), `flags` over them, rank and targets
    from the weights. A given config whose rank or targets disagree with the weights raises
    InvalidCheckpoint (`config-mismatch`) naming the module."""
    config = dict(CONFIG_DEFAULTS) if given is None else dict(given)
    config.update({k: v for k, v in flags.items() if v is not None})
    ranks = sorted({rank for _, rank in modules})
    if given is not None:
        _check_given(config, modules, where)
    elif ranks:
        common = max(ranks, key=lambda r: (sum(1 for _, rank in modules if rank == r), -r))
        config["r"] = common
        config["target_modules"] = sorted({path.rsplit(".", 1)[-1] for path, _ in modules})
        config["rank_pattern"] = {path: rank for path, rank in modules if rank != common}
        if flags.get("lora_alpha") is None:  # the weights cannot tell it, and a guess would change the model
            raise UsageError(f"{where}: no {CONFIG_NAME} beside the checkpoint (or in export's --assets) and no "
                             "--lora-alpha; lora_alpha sets the adapter's scale (alpha / r): give one of them")
    return dict(sorted(config.items()))


def _check_given(config: Mapping[str, Any], modules: Sequence[tuple[str, int]], where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidCheckpoint(f"{where}: peft_type {config.get('peft_type')!r}; the weights are LoRA",
                                code="config-mismatch")
    targets = config.get("target_modules")
    for path, rank in modules:
        if not targets_module(targets, path):
            raise InvalidCheckpoint(f"{where}: target_modules {targets!r} does not select {path}, which holds LoRA "
                                    "weights", code="config-mismatch")
        expected = pattern_value(config.get("rank_pattern") or {}, path, config.get("r"))
        if expected != rank:
            raise InvalidCheckpoint(f"{where}: {path} has rank {rank} in the weights, the config says r={expected}",
                                    code="config-mismatch")
    if isinstance(targets, list):
        names = {path for path, _ in modules}
        for target in targets:
            if not any(path == target or path.endswith(f".{target}") for path in names):
                raise InvalidCheckpoint(f"{where}: target_modules names {target!r}, but no {target} module holds "
                                        "LoRA weights", code="config-mismatch")


def module_scaling(config: Mapping[str, Any], path: str, rank: int) -> float:
    """Return the scale PEFT applies to module `path` of rank `rank` under `config`."""
    alpha = pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", 8))
    return scaling(alpha, rank, bool(config.get("use_rslora")))


MAX_CONFIG_BYTES = MAX_JSON_BYTES


def read_config(path: Path) -> dict[str, Any]:
    """Return an adapter_config.json's object; CorruptMetadata naming the file when it is not one."""
    return read_json_object(path, MAX_CONFIG_BYTES)
