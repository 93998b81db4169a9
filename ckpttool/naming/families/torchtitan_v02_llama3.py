"""torchtitan 0.2's llama3 (before 0.3 renamed its modules), as a table: 0.2.2's
`Llama3StateDictAdapter.to_hf` (torchtitan/models/llama3/model/state_dict_adapter.py) written
as data, its `from_hf_map` read backwards: q and k rows permuted per head into transformers'
rotary layout (`_permute`), everything else renamed. 0.2 names the attention projections
`attention.wq` (0.3: `attention.qkv_linear.wq`) and the head `output` (0.3: `lm_head`). The
rotary buffer is never saved (non-persistent) and is `ignored` should it appear.
"""

from __future__ import annotations

from ckpttool.naming.engine import DENSE_BIAS_FROM_CONFIG, PERMUTE_K, PERMUTE_Q, Architecture, Family, Rule

FAMILY = Family(
    name="torchtitan 0.2 llama3",
    signature=("tok_embeddings.weight", "layers.{L}.attention.wq.weight"),
    converts_to=(
        # logits: what fixtures/frameworks/generate_torchtitan_v02.py checks against torchtitan's forward
        Architecture("LlamaForCausalLM", "llama", logit_tolerance=1e-4, dense_biases=DENSE_BIAS_FROM_CONFIG),
    ),
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.wq.weight", PERMUTE_Q),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.wk.weight", PERMUTE_K),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        Rule("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight"),
        Rule("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight"),
        Rule("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight"),
        Rule("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "output.weight"),
    ),
    ignored=("freqs_cis",),
    tied_head="output.weight",
)
