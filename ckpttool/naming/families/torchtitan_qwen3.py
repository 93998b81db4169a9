"""torchtitan 0.3.0's qwen3, dense and MoE, as a table: `Qwen3StateDictAdapter.to_hf`
(torchtitan/models/qwen3/state_dict_adapter.py) written as data. q/k norms, no permutation;
grouped experts `w1_EFD`/`w3_EFD` [E, F, D] and `w2_EDF` [E, D, F] split into per-expert
gate/up/down (`_split_experts_weights`, each expert squeezed), the router as `mlp.gate`. Keys
`to_hf` drops (the MoE load-balancing buffers `tokens_per_expert` and `expert_bias_E`, which
transformers' Qwen3-MoE router has no place for; rotary buffers) are `ignored`.
"""

from __future__ import annotations

from ckpttool.naming.engine import EXPERTS, Architecture, Family, Made, Rule
from ckpttool.naming.fused import QWEN2_MOE

FAMILY = Family(
    name="torchtitan qwen3",
    signature=("tok_embeddings.weight", "layers.{L}.attention.q_norm.weight"),
    converts_to=(
        # logits: float32 sums in other orders (rotary, flex vs eager attention): 8.9e-8 seen
        Architecture("Qwen3ForCausalLM", "qwen3", logit_tolerance=1e-6),
        # torchtitan routes with its load-balancing `expert_bias_E`, which to_hf drops (transformers'
        # Qwen3-MoE router has no bias): 4.1e-3 seen, 5.1e-5 with the bias zeroed
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", logit_tolerance=1e-2, fused=QWEN2_MOE),
    ),
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.qkv_linear.wq.weight"),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.qkv_linear.wk.weight"),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.qkv_linear.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.attention.q_norm.weight"),
        Rule("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.attention.k_norm.weight"),
        Rule("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight"),
        Rule("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight"),
        Rule("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight"),
        Rule("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
        Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
             EXPERTS),
        Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
             EXPERTS),
        Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
             EXPERTS),
        Rule("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight"),
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
    ),
    ignored=("layers.{L}.attention.rope.cache", "rope.cache", "layers.{L}.moe.tokens_per_expert",
             "layers.{L}.moe.expert_bias_E"),
    changes_forward=("layers.{L}.moe.expert_bias_E",),  # the router adds it to its scores before choosing experts
    # import: torchtitan's MoE (load_balance_coeff set) holds a load-balancing bias per router,
    # which transformers' Qwen3-MoE has no place for: written as torchtitan initialises it
    made=(Made("layers.{L}.moe.expert_bias_E", "layers.{L}.moe.router.gate.weight", (0,), "float32", 0.0,
               "torchtitan's load-balancing expert bias, zeros at initialisation (moe.py init_weights)"),),
    stores_tied_head=True,  # torchtitan ties by one parameter under both names: its state dict holds both
)
