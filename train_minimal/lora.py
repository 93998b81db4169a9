"""LoRA for the Llama-shaped model (`--lora-rank R --lora-alpha A --lora-targets q_proj,v_proj`):
our own layers with PEFT's module names, initialisation and forward pass, the frozen base,
and the `adapter_config.json` PEFT reads.

Each targeted `nn.Linear` becomes a `LoraLinear` holding the original layer as `base_layer`
and the adapter "default" as `lora_A.default` (in -> r) and `lora_B.default` (r -> out), as
PEFT's `LoraLayer.update_layer` builds them (peft/tuners/lora/layer.py, peft 0.21.2). So the
checkpoint's model keys are PEFT's keys without its `base_model.model.` wrapper:

    model.layers.0.self_attn.q_proj.base_layer.weight      the frozen pretrained weight
    model.layers.0.self_attn.q_proj.lora_A.default.weight  (r, in), kaiming_uniform_(a=sqrt(5))
    model.layers.0.self_attn.q_proj.lora_B.default.weight  (out, r), zeros

and `output = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`, `scaling = alpha / r`
(or `alpha / sqrt(r)` with rsLoRA), the operations of PEFT's `lora.Linear.forward` in the
same order, so a PEFT model holding the same weights gives the same float32 logits bit for bit.

peft is never imported here.

Example (model.build_model calls apply_lora):
    >>> config = parse_args(["--arch", "llama", "--lora-rank", "4", "--lora-targets", "q_proj"])
    >>> llama = build_model(config)
    >>> sorted(key for key in llama.state_dict() if "layers.0.self_attn.q_proj" in key)
    ['model.layers.0.self_attn.q_proj.base_layer.weight', 'model.layers.0.self_attn.q_proj.lora_A.default.weight',
     'model.layers.0.self_attn.q_proj.lora_B.default.weight']
    >>> adapter_config(config)["target_modules"], sum(p.numel() for p in llama.parameters() if p.requires_grad)
    (['q_proj'], 512)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from train_minimal.config import TrainConfig

ADAPTER_NAME = "default"  # PEFT's name for the first (and here only) adapter
ADAPTER_CONFIG_NAME = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME
BASE_LAYER = "base_layer"
LORA_PARAMETERS = ("lora_A", "lora_B")
# The schema of PEFT 0.21.2's LoraConfig.save_pretrained: every field with its default, as
# `LoraConfig(...).save_pretrained` writes them (json.dumps(indent=2, sort_keys=True)). The
# fields a run sets are filled in by `adapter_config`; `peft_version` names the release whose
# schema this is (PEFT fills it with its own version).
PEFT_SCHEMA_VERSION = "0.21.2"
LORA_CONFIG_DEFAULTS: dict = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": False,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": PEFT_SCHEMA_VERSION, "qalora_group_size": 16,
    "r": 8, "rank_pattern": {}, "revision": None, "target_modules": None, "target_parameters": None,
    "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None, "use_dora": False,
    "use_qalora": False, "use_rslora": False, "velora_config": None,
}


class LoraLinear(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update (PEFT's `lora.Linear`, one adapter)."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float, rslora: bool) -> None:
        super().__init__()
        self.base_layer = base_layer
        # ModuleDicts keyed by the adapter name, as PEFT holds them (their keys are in the fqns).
        self.lora_dropout = nn.ModuleDict({ADAPTER_NAME: nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()})
        self.lora_A = nn.ModuleDict({ADAPTER_NAME: nn.Linear(base_layer.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER_NAME: nn.Linear(rank, base_layer.out_features, bias=False)})
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """Draw A as nn.Linear's default init and zero B (PEFT's init_lora_weights=True), so the
        untrained adapter adds exactly nothing."""
        nn.init.kaiming_uniform_(self.lora_A[ADAPTER_NAME].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[ADAPTER_NAME].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        lora_A, lora_B = self.lora_A[ADAPTER_NAME], self.lora_B[ADAPTER_NAME]
        return result + lora_B(lora_A(self.lora_dropout[ADAPTER_NAME](x))) * self.scaling


def lora_targets(config: TrainConfig) -> tuple[str, ...]:
    """Return the module names `--lora-targets` lists (empty without LoRA)."""
    return tuple(config.lora_targets.split(",")) if config.lora_rank else ()


def apply_lora(model: nn.Module, config: TrainConfig) -> nn.Module:
    """Replace every targeted Linear of `model` by a LoraLinear (drawing A from torch's global
    RNG, after the base weights), freeze everything else, and return the model. A no-op
    without `--lora-rank`."""
    if not config.lora_rank:
        return model
    targets = lora_targets(config)
    # Named before replacing: PEFT also walks the modules in named_modules() order.
    chosen = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoraLinear(getattr(parent, child), config.lora_rank, config.lora_alpha, config.lora_dropout,
                           config.rslora)
        setattr(parent, child, layer)
    return model


def is_lora_parameter(fqn: str) -> bool:
    """Return True for an adapter weight (`...q_proj.lora_A.default.weight`)."""
    parts = fqn.split(".")
    return any(part in LORA_PARAMETERS for part in parts)


def base_weight_name(fqn: str) -> str:
    """Return the name a base weight has in a model without LoRA:
    `model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`
    (other names are returned as they are)."""
    return fqn.replace(f".{BASE_LAYER}.", ".")


def adapter_config(config: TrainConfig) -> dict:
    """Return the adapter_config.json document of a LoRA run: what PEFT 0.21.2's
    `LoraConfig(r=R, lora_alpha=A, target_modules=[...], use_rslora=..., lora_dropout=...,
    bias="none", task_type="CAUSAL_LM", base_model_name_or_path=None).save_pretrained` writes
    (target modules sorted; PEFT writes its set in hash order)."""
    alpha = config.lora_alpha
    document = dict(LORA_CONFIG_DEFAULTS)
    document.update({
        "r": config.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": sorted(lora_targets(config)),
        "use_rslora": config.rslora,
        "lora_dropout": config.lora_dropout,
    })
    return document


def write_adapter_config(directory: Path, config: TrainConfig) -> None:
    """Write `directory/adapter_config.json` for a LoRA run (atomically: a temporary name,
    then a rename); nothing without `--lora-rank`."""
    if not config.lora_rank:
        return
    text = json.dumps(adapter_config(config), indent=2, sort_keys=True)
    temporary = directory / (ADAPTER_CONFIG_NAME + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, directory / ADAPTER_CONFIG_NAME)
