"""torchtitan 0.3.0's model families, as tables: each is `StateDictAdapter.to_hf` of
torchtitan/models/<family>/state_dict_adapter.py written as data (its `from_hf_map`, read
backwards, with the transform `to_hf` applies to each entry).

- llama3 (`Llama3StateDictAdapter`): q/k rows permuted into transformers' rotary layout.
- qwen3 (`Qwen3StateDictAdapter`, dense and MoE): q/k norms, no permutation; grouped experts
  `w1_EFD`/`w3_EFD` [E, F, D] and `w2_EDF` [E, D, F] split into per-expert gate/up/down
  (`_split_experts_weights`, each expert squeezed), the router as `mlp.gate`.
- deepseek_v3 (`DeepSeekV3StateDictAdapter`): MLA names, shared experts,
  `expert_bias_E` -> `e_score_correction_bias`.

Keys an adapter skips (`to_hf` drops what its map lacks: the MoE load-balancing buffer
`tokens_per_expert`, rotary buffers) are `ignored`; any other unknown key is an error.

Example:
    >>> find_family(keys, FAMILIES).name
    'torchtitan llama3'
"""

from __future__ import annotations

from ckpttool.naming import SIGNATURES
from ckpttool.naming.engine import EXPERTS, PERMUTE_K, PERMUTE_Q, Family, Rule

_ATTENTION_NORMS = (
    Rule("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight"),
    Rule("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
)
_DENSE_MLP = (
    Rule("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight"),
    Rule("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight"),
    Rule("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight"),
)
_ENDS = (
    Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
    Rule("model.norm.weight", "norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
)
_GROUPED_EXPERTS = (
    Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
         EXPERTS),
    Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
         EXPERTS),
    Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
         EXPERTS),
    Rule("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight"),
)
_MOE_BUFFERS = ("layers.{L}.moe.tokens_per_expert", "layers.{L}.moe.expert_bias_E")

LLAMA3 = Family(
    name="torchtitan llama3",
    architectures=("LlamaForCausalLM",),
    signature=SIGNATURES["torchtitan llama3"],
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.qkv_linear.wq.weight", PERMUTE_Q),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.qkv_linear.wk.weight", PERMUTE_K),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.qkv_linear.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        *_DENSE_MLP, *_ATTENTION_NORMS, *_ENDS,
    ),
    ignored=("layers.{L}.attention.rope.cache", "freqs_cis", "rope.cache"),
    settings=("num_attention_heads",),
)

QWEN3 = Family(
    name="torchtitan qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    signature=SIGNATURES["torchtitan qwen3"],
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.qkv_linear.wq.weight"),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.qkv_linear.wk.weight"),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.qkv_linear.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.attention.q_norm.weight"),
        Rule("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.attention.k_norm.weight"),
        *_DENSE_MLP, *_ATTENTION_NORMS, *_GROUPED_EXPERTS, *_ENDS,
    ),
    ignored=("layers.{L}.attention.rope.cache", "rope.cache", *_MOE_BUFFERS),
)

DEEPSEEK_V3 = Family(
    name="torchtitan deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    signature=SIGNATURES["torchtitan deepseek_v3"],
    rules=(
        Rule("model.layers.{L}.self_attn.q_a_proj.weight", "layers.{L}.attention.wq_a.weight"),
        Rule("model.layers.{L}.self_attn.q_a_layernorm.weight", "layers.{L}.attention.q_norm.weight"),
        Rule("model.layers.{L}.self_attn.q_b_proj.weight", "layers.{L}.attention.wq_b.weight"),
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight"),
        Rule("model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight", "layers.{L}.attention.wkv_a.weight"),
        Rule("model.layers.{L}.self_attn.kv_a_layernorm.weight", "layers.{L}.attention.kv_norm.weight"),
        Rule("model.layers.{L}.self_attn.kv_b_proj.weight", "layers.{L}.attention.wkv_b.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        *_DENSE_MLP, *_ATTENTION_NORMS, *_GROUPED_EXPERTS,
        Rule("model.layers.{L}.mlp.shared_experts.gate_proj.weight", "layers.{L}.moe.shared_experts.w1.weight"),
        Rule("model.layers.{L}.mlp.shared_experts.up_proj.weight", "layers.{L}.moe.shared_experts.w3.weight"),
        Rule("model.layers.{L}.mlp.shared_experts.down_proj.weight", "layers.{L}.moe.shared_experts.w2.weight"),
        Rule("model.layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.expert_bias_E"),
        *_ENDS,
    ),
    ignored=("layers.{L}.attention.rope.cache", "rope.cache", "layers.{L}.moe.tokens_per_expert"),
)

def _extra_layers(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """DeepSeek's multi-token-prediction layers (`mtp_layers.M.`): a decoder layer's rules, and
    its own norms and projection, numbered after the main layers (`to_hf`: `model.layers.{M + n}`)."""
    layer = tuple(Rule(rule.hf.replace("model.layers.{L}.", "model.layers.{N}."),
                       rule.source.replace("layers.{L}.", "mtp_layers.{M}."), rule.transform)
                  for rule in rules if rule.source.startswith("layers.{L}."))
    return layer + (
        Rule("model.layers.{N}.enorm.weight", "mtp_layers.{M}.enorm.weight"),
        Rule("model.layers.{N}.hnorm.weight", "mtp_layers.{M}.hnorm.weight"),
        Rule("model.layers.{N}.eh_proj.weight", "mtp_layers.{M}.eh_proj.weight"),
        Rule("model.layers.{N}.shared_head.norm.weight", "mtp_layers.{M}.mtp_norm.weight"),
    )


DEEPSEEK_V3 = Family(
    name=DEEPSEEK_V3.name, architectures=DEEPSEEK_V3.architectures, signature=DEEPSEEK_V3.signature,
    rules=DEEPSEEK_V3.rules + _extra_layers(DEEPSEEK_V3.rules),
    ignored=DEEPSEEK_V3.ignored + ("mtp_layers.{M}.moe.tokens_per_expert",),
)

FAMILIES = (DEEPSEEK_V3, QWEN3, LLAMA3)  # most specific signature first
