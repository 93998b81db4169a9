"""torchtitan 0.2's qwen3, dense and MoE (before 0.3 renamed its modules), as a table: 0.2.2's
`Qwen3StateDictAdapter.to_hf` (torchtitan/models/qwen3/model/state_dict_adapter.py) written as
data. q/k norms, no permutation; grouped experts `moe.experts.w1`/`w3` [E, F, D] and `w2`
[E, D, F] (0.3: `moe.routed_experts.inner_experts.w1_EFD`, ...: the same layout, renamed) split
into per-expert gate/up/down (`_split_experts_weights`: `torch.split` on dim 0, squeezed), the
router as `mlp.gate`; the head is `output` (0.3: `lm_head`), left out when tied. `to_hf` drops
the MoE `expert_bias` buffer (zeros: 0.2.2's qwen3 has no load-balancing hook); it and the
non-persistent buffers (never saved) are `ignored`.
"""

from __future__ import annotations

from ckpttool.naming.engine import EXPERTS, Architecture, Family, Rule
from ckpttool.naming.fused import QWEN2_MOE

FAMILY = Family(
    name="torchtitan 0.2 qwen3",
    signature=("tok_embeddings.weight", "layers.{L}.attention.q_norm.weight", "layers.{L}.attention.wq.weight"),
    converts_to=(
        # logits: what fixtures/frameworks/generate_torchtitan_v02.py checks against torchtitan's forward
        Architecture("Qwen3ForCausalLM", "qwen3", logit_tolerance=1e-4),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", logit_tolerance=1e-4, fused=QWEN2_MOE),
    ),
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight"),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.wk.weight"),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.attention.q_norm.weight"),
        Rule("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.attention.k_norm.weight"),
        Rule("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight"),
        Rule("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight"),
        Rule("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight"),
        Rule("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
        Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.experts.w1", EXPERTS),
        Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.experts.w3", EXPERTS),
        Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.experts.w2", EXPERTS),
        Rule("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight"),
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "output.weight"),
    ),
    ignored=("rope_cache", "layers.{L}.moe.expert_bias", "layers.{L}.moe.tokens_per_expert"),
    changes_forward=("layers.{L}.moe.expert_bias",),  # the router adds it to its scores before choosing experts
    tied_head="output.weight",
)
