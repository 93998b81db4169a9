"""torchtitan 0.3.0's deepseek_v3, as a table: `DeepSeekV3StateDictAdapter.to_hf`
(torchtitan/models/deepseek_v3/state_dict_adapter.py) written as data. MLA names, grouped
experts split per expert as qwen3's, shared experts, the load-balancing `expert_bias_E` as the
router's `e_score_correction_bias`; the multi-token-prediction layers (`mtp_layers.M.`) are a
decoder layer's rules plus their own norms and projection, numbered after the main layers
(`to_hf`: `model.layers.{M + n}`). The load-balancing counter `tokens_per_expert` and rotary
buffers are `ignored`.
"""

from __future__ import annotations

from ckpttool.naming.engine import EXPERTS, Architecture, Family, Rule
from ckpttool.naming.fused import QWEN2_MOE

_LAYER = (
    Rule("model.layers.{L}.self_attn.q_a_proj.weight", "layers.{L}.attention.wq_a.weight"),
    Rule("model.layers.{L}.self_attn.q_a_layernorm.weight", "layers.{L}.attention.q_norm.weight"),
    Rule("model.layers.{L}.self_attn.q_b_proj.weight", "layers.{L}.attention.wq_b.weight"),
    Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight"),
    Rule("model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight", "layers.{L}.attention.wkv_a.weight"),
    Rule("model.layers.{L}.self_attn.kv_a_layernorm.weight", "layers.{L}.attention.kv_norm.weight"),
    Rule("model.layers.{L}.self_attn.kv_b_proj.weight", "layers.{L}.attention.wkv_b.weight"),
    Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
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
    Rule("model.layers.{L}.mlp.shared_experts.gate_proj.weight", "layers.{L}.moe.shared_experts.w1.weight"),
    Rule("model.layers.{L}.mlp.shared_experts.up_proj.weight", "layers.{L}.moe.shared_experts.w3.weight"),
    Rule("model.layers.{L}.mlp.shared_experts.down_proj.weight", "layers.{L}.moe.shared_experts.w2.weight"),
    Rule("model.layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.expert_bias_E"),
)
# a multi-token-prediction layer: a decoder layer (`mtp_layers.{M}.` for `layers.{L}.`, numbered
# {N} after the main layers), with its own norms and projection
_MTP_LAYER = tuple(Rule(tuple(name.replace("model.layers.{L}.", "model.layers.{N}.") for name in rule.targets),
                        rule.source.replace("layers.{L}.", "mtp_layers.{M}."), rule.transform) for rule in _LAYER) + (
    Rule("model.layers.{N}.enorm.weight", "mtp_layers.{M}.enorm.weight"),
    Rule("model.layers.{N}.hnorm.weight", "mtp_layers.{M}.hnorm.weight"),
    Rule("model.layers.{N}.eh_proj.weight", "mtp_layers.{M}.eh_proj.weight"),
    Rule("model.layers.{N}.shared_head.norm.weight", "mtp_layers.{M}.mtp_norm.weight"),
)

FAMILY = Family(
    name="torchtitan deepseek_v3",
    signature=("tok_embeddings.weight", "layers.{L}.attention.wkv_a.weight"),
    converts_to=(
        # logits: MoE and yarn rotary arithmetic in other orders: 3.6e-5 seen
        Architecture("DeepseekV3ForCausalLM", "deepseek_v3", logit_tolerance=1e-4, fused=QWEN2_MOE),
    ),
    rules=(
        *_LAYER,
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *_MTP_LAYER,
    ),
    ignored=("layers.{L}.attention.rope.cache", "rope.cache", "layers.{L}.moe.tokens_per_expert",
             "mtp_layers.{M}.moe.tokens_per_expert"),
    # import: the MTP layer's own copies of the embedding and head (DeepSeek-V3's Hub holds them
    # in layer 61), which torchtitan's MTP shares with the main model: from_hf never reads them
    hf_ignored=(("model.layers.{N}.embed_tokens.weight", "torchtitan's MTP layer shares the main embedding"),
                ("model.layers.{N}.shared_head.head.weight", "torchtitan's MTP layer shares the main output head")),
    stores_tied_head=True,  # torchtitan ties by one parameter under both names: its state dict holds both
)
