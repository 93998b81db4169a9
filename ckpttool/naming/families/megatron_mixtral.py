"""Megatron-Core MoE (`torch_dist`) as Mixtral, as a table: megatron_gpt.py's attention, norms
and ends, and the experts as megatron_qwen_moe.py takes them, under Mixtral's names
(`block_sparse_moe.experts.E.w1`/`w3`/`w2`, the router `block_sparse_moe.gate`: the names of
Mixtral's Hub checkpoints, which transformers fuses on load). Megatron-Bridge 0.3.1 has no Mixtral
bridge: its fixture (fixtures/frameworks/megatron_more_families/mixtral_ep2, tests/
test_megatron_more_families.py) is compared with its Qwen3-MoE bridge's mapping of the same
Megatron names, the transformers names then renamed to Mixtral's (w1 gate, w3 up, w2 down).
"""

from __future__ import annotations

from ckpttool.naming.engine import (EXPERTS, EXPERTS_HALVES, SPLIT_HALVES, SPLIT_QKV, VOCAB_ROWS, Architecture, Family,
                                    MegatronArgs, Rule)
from ckpttool.naming.fused import MIXTRAL

_LAYER = "decoder.layers.{L}."
_EXPERTS = "decoder.layers.{L}.mlp.experts."
_GATE_UP = ("model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
            "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight")
_DOWN = "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"

FAMILY = Family(
    name="megatron mixtral",
    signature=("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_qkv.weight"),
    converts_to=(
        # logits: float32 sums in other orders, as megatron_gpt.py's (5.96e-7 seen on its fixture)
        Architecture("MixtralForCausalLM", "mixtral", logit_tolerance=1e-4, fused=MIXTRAL,
                     megatron=MegatronArgs(moe=True, qk_layernorm=False, add_qkv_bias=False,
                                           fields=(("sliding_window", None),),
                                           moe_fields=(("num_local_experts", "experts"), ("num_experts_per_tok", "topk"),
                                                       ("intermediate_size", "width")))),
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
        Rule(_GATE_UP, _EXPERTS + "local_experts.{E}.linear_fc1.weight", SPLIT_HALVES),
        Rule(_DOWN, _EXPERTS + "local_experts.{E}.linear_fc2.weight"),
        Rule(_GATE_UP, _EXPERTS + "linear_fc1.weight{E}", SPLIT_HALVES),
        Rule(_DOWN, _EXPERTS + "linear_fc2.weight{E}"),
        Rule(_GATE_UP, _EXPERTS + "experts.linear_fc1.weight", EXPERTS_HALVES),
        Rule(_DOWN, _EXPERTS + "experts.linear_fc2.weight", EXPERTS),
        Rule("model.layers.{L}.block_sparse_moe.gate.weight", "decoder.layers.{L}.mlp.router.weight"),
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
