"""Megatron-Core GPT (`torch_dist`) families, as tables: Megatron-Bridge's Llama / Qwen / Mixtral
mappings (megatron/bridge/models/*/..._bridge.py `mapping_registry`) written as data, over the
model view readers/megatron.py gives (layers taken apart: `decoder.layers.N.*`).

- the fused `linear_qkv` (TE spec: with its input norm as `layer_norm_weight`) un-interleaved per
  query group into q, k, v (Megatron-Bridge `QKVMapping`);
- `linear_fc1` [gate; up] split in two (`GatedMLPMapping`);
- the pre-MLP norm: `mlp.linear_fc1.layer_norm_weight` (fused, TE spec) or `pre_mlp_layernorm`;
- experts: `local_experts.N` (SequentialMLP; in `torch_dist` stacked on an experts axis,
  `experts.experts.linear_fc1`) and TE's grouped `weightN`, one key per expert, `linear_fc1`
  split into gate and up; the router `mlp.router.weight`;
- `output_layer` -> `lm_head`.

Which table applies is the config's `architectures` (the three share Megatron's names).

Example:
    >>> find_family(keys, FAMILIES, {"architectures": ["MixtralForCausalLM"]}).name
    'megatron mixtral'
"""

from __future__ import annotations

from ckpttool.naming import SIGNATURES
from ckpttool.naming.engine import EXPERTS, EXPERTS_HALVES, SPLIT_HALVES, SPLIT_QKV, Family, Rule

_SETTINGS = ("num_attention_heads",)
_LAYER = "decoder.layers.{L}."
_ATTENTION = (
    Rule("model.layers.{L}.input_layernorm.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
    Rule("model.layers.{L}.input_layernorm.weight", _LAYER + "input_layernorm.weight"),
    Rule("model.layers.{L}.self_attn.q_proj.weight|model.layers.{L}.self_attn.k_proj.weight|"
         "model.layers.{L}.self_attn.v_proj.weight", _LAYER + "self_attention.linear_qkv.weight", SPLIT_QKV),
    Rule("model.layers.{L}.self_attn.q_proj.bias|model.layers.{L}.self_attn.k_proj.bias|"
         "model.layers.{L}.self_attn.v_proj.bias", _LAYER + "self_attention.linear_qkv.bias", SPLIT_QKV),
    Rule("model.layers.{L}.self_attn.o_proj.weight", _LAYER + "self_attention.linear_proj.weight"),
    Rule("model.layers.{L}.self_attn.q_norm.weight", _LAYER + "self_attention.q_layernorm.weight"),
    Rule("model.layers.{L}.self_attn.k_norm.weight", _LAYER + "self_attention.k_layernorm.weight"),
    Rule("model.layers.{L}.post_attention_layernorm.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
    Rule("model.layers.{L}.post_attention_layernorm.weight", _LAYER + "pre_mlp_layernorm.weight"),
)
_DENSE_MLP = (
    Rule("model.layers.{L}.mlp.gate_proj.weight|model.layers.{L}.mlp.up_proj.weight", _LAYER + "mlp.linear_fc1.weight",
         SPLIT_HALVES),
    Rule("model.layers.{L}.mlp.down_proj.weight", _LAYER + "mlp.linear_fc2.weight"),
)
_ENDS = (
    Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rule("model.norm.weight", "decoder.final_layernorm.weight"),
    Rule("lm_head.weight", "output_layer.weight"),
)


def _experts(prefix: str, gate: str, up: str, down: str, router: str) -> tuple[Rule, ...]:
    """The MoE rules of one transformers naming: `prefix` the experts' module, `router` the gate."""
    experts = "decoder.layers.{L}.mlp.experts."
    return (
        Rule(f"{prefix}.{{E}}.{gate}.weight|{prefix}.{{E}}.{up}.weight", experts + "local_experts.{E}.linear_fc1.weight",
             SPLIT_HALVES),
        Rule(f"{prefix}.{{E}}.{down}.weight", experts + "local_experts.{E}.linear_fc2.weight"),
        Rule(f"{prefix}.{{E}}.{gate}.weight|{prefix}.{{E}}.{up}.weight", experts + "linear_fc1.weight{E}", SPLIT_HALVES),
        Rule(f"{prefix}.{{E}}.{down}.weight", experts + "linear_fc2.weight{E}"),
        # SequentialMLP in torch_dist: the local experts stacked on an experts axis (readers/megatron.py)
        Rule(f"{prefix}.{{E}}.{gate}.weight|{prefix}.{{E}}.{up}.weight", experts + "experts.linear_fc1.weight",
             EXPERTS_HALVES),
        Rule(f"{prefix}.{{E}}.{down}.weight", experts + "experts.linear_fc2.weight", EXPERTS),
        Rule(router, "decoder.layers.{L}.mlp.router.weight"),
    )


LLAMA = Family(
    name="megatron gpt",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    signature=SIGNATURES["megatron gpt"],
    rules=(*_ATTENTION, *_DENSE_MLP, *_ENDS),
    tied_head="output_layer.weight",
    settings=_SETTINGS,
)

QWEN_MOE = Family(
    name="megatron qwen moe",
    architectures=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    signature=SIGNATURES["megatron qwen moe"],
    rules=(*_ATTENTION, *_DENSE_MLP,
           *_experts("model.layers.{L}.mlp.experts", "gate_proj", "up_proj", "down_proj", "model.layers.{L}.mlp.gate.weight"),
           *_ENDS),
    ignored=("decoder.layers.{L}.mlp.router.expert_bias", "decoder.layers.{L}.mlp.router.local_tokens_per_expert"),
    tied_head="output_layer.weight",
    settings=_SETTINGS,
)

MIXTRAL = Family(
    name="megatron mixtral",
    architectures=("MixtralForCausalLM",),
    signature=SIGNATURES["megatron mixtral"],
    rules=(*_ATTENTION,
           *_experts("model.layers.{L}.block_sparse_moe.experts", "w1", "w3", "w2",
                     "model.layers.{L}.block_sparse_moe.gate.weight"),
           *_ENDS),
    ignored=("decoder.layers.{L}.mlp.router.expert_bias", "decoder.layers.{L}.mlp.router.local_tokens_per_expert"),
    tied_head="output_layer.weight",
    settings=_SETTINGS,
)

FAMILIES = (LLAMA, QWEN_MOE, MIXTRAL)
