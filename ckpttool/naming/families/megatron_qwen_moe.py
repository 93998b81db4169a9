"""Megatron-Core MoE (`torch_dist`) as Qwen2-MoE / Qwen3-MoE, as a table: Megatron-Bridge's
Qwen MoE mappings written as data. The dense names of megatron_gpt.py (the same attention,
norms, dense layers and ends), and the experts, one transformers key each, `linear_fc1` split
into gate and up:

- SequentialMLP `local_experts.E` (as Megatron-Core names them), and in `torch_dist` the local
  experts stacked on an experts axis (`experts.experts.linear_fc1`: readers/megatron.py);
- TE's grouped `linear_fc1.weightE`;
- the router `mlp.router.weight` as `mlp.gate`; its load-balancing buffers are `ignored`.
"""

from __future__ import annotations

from ckpttool.naming.engine import (EXPERTS, EXPERTS_HALVES, SPLIT_HALVES, SPLIT_QKV, VOCAB_ROWS, Architecture, Family,
                                    MegatronArgs, Rule)
from ckpttool.naming.fused import QWEN2_MOE

_LAYER = "decoder.layers.{L}."
_EXPERTS = "decoder.layers.{L}.mlp.experts."
_GATE_UP = ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight")
_DOWN = "model.layers.{L}.mlp.experts.{E}.down_proj.weight"

FAMILY = Family(
    name="megatron qwen moe",
    signature=("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_qkv.weight"),
    converts_to=(
        Architecture("Qwen2MoeForCausalLM", "qwen2_moe", fused=QWEN2_MOE),
        # logits: float32 sums in other orders, as megatron_gpt.py's
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", logit_tolerance=1e-4, fused=QWEN2_MOE,
                     megatron=MegatronArgs(moe=True, qk_layernorm=True, add_qkv_bias=False,
                                           fields=(("attention_bias", False), ("use_sliding_window", False),
                                                   ("decoder_sparse_step", 1), ("mlp_only_layers", ())),
                                           moe_fields=(("num_experts", "experts"), ("num_experts_per_tok", "topk"),
                                                       ("moe_intermediate_size", "width"),
                                                       ("norm_topk_prob", "renormalize")))),
    ),
    rules=(
        Rule("model.layers.{L}.input_layernorm.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        Rule("model.layers.{L}.input_layernorm.weight", _LAYER + "input_layernorm.weight"),
        Rule(("model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
              "model.layers.{L}.self_attn.v_proj.weight"), _LAYER + "self_attention.linear_qkv.weight", SPLIT_QKV),
        Rule(("model.layers.{L}.self_attn.q_proj.bias", "model.layers.{L}.self_attn.k_proj.bias",
              "model.layers.{L}.self_attn.v_proj.bias"), _LAYER + "self_attention.linear_qkv.bias", SPLIT_QKV),
        Rule("model.layers.{L}.self_attn.o_proj.weight", _LAYER + "self_attention.linear_proj.weight"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", _LAYER + "self_attention.q_layernorm.weight"),
        Rule("model.layers.{L}.self_attn.k_norm.weight", _LAYER + "self_attention.k_layernorm.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", _LAYER + "pre_mlp_layernorm.weight"),
        Rule(("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
             _LAYER + "mlp.linear_fc1.weight", SPLIT_HALVES),
        Rule("model.layers.{L}.mlp.down_proj.weight", _LAYER + "mlp.linear_fc2.weight"),
        Rule(_GATE_UP, _EXPERTS + "local_experts.{E}.linear_fc1.weight", SPLIT_HALVES),
        Rule(_DOWN, _EXPERTS + "local_experts.{E}.linear_fc2.weight"),
        Rule(_GATE_UP, _EXPERTS + "linear_fc1.weight{E}", SPLIT_HALVES),
        Rule(_DOWN, _EXPERTS + "linear_fc2.weight{E}"),
        Rule(_GATE_UP, _EXPERTS + "experts.linear_fc1.weight", EXPERTS_HALVES),
        Rule(_DOWN, _EXPERTS + "experts.linear_fc2.weight", EXPERTS),
        Rule("model.layers.{L}.mlp.gate.weight", "decoder.layers.{L}.mlp.router.weight"),
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", VOCAB_ROWS),
        Rule("model.norm.weight", "decoder.final_layernorm.weight"),
        Rule("lm_head.weight", "output_layer.weight", VOCAB_ROWS),
    ),
    ignored=("decoder.layers.{L}.mlp.router.expert_bias", "decoder.layers.{L}.mlp.router.local_tokens_per_expert"),
    changes_forward=("decoder.layers.{L}.mlp.router.expert_bias",),  # the router adds it to its scores before choosing experts
    tied_head="output_layer.weight",
    # import writes the experts as megatron-core's SequentialMLP saves them in torch_dist: stacked
    backward=(_EXPERTS + "experts.linear_fc1.weight", _EXPERTS + "experts.linear_fc2.weight"),
)
