"""torchtitan 0.3.0's llama3, as a table: `Llama3StateDictAdapter.to_hf`
(torchtitan/models/llama3/state_dict_adapter.py) written as data, its `from_hf_map` read
backwards with the transform `to_hf` applies to each entry: q and k rows permuted per head into
transformers' rotary layout (`_permute`), everything else renamed. Keys the adapter skips (the
rotary buffers) are `ignored`; any other unknown key is an error.
"""

from __future__ import annotations

from ckpttool.naming.engine import DENSE_BIAS_FROM_CONFIG, PERMUTE_K, PERMUTE_Q, Architecture, Family, Rule

FAMILY = Family(
    name="torchtitan llama3",
    signature=("tok_embeddings.weight", "layers.{L}.attention.qkv_linear.wq.weight"),
    converts_to=(
        # logits: float32 sums in other orders (rotary, flex vs eager attention): 2.4e-7 seen
        Architecture("LlamaForCausalLM", "llama", logit_tolerance=1e-6, dense_biases=DENSE_BIAS_FROM_CONFIG),
    ),
    rules=(
        Rule("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.attention.qkv_linear.wq.weight", PERMUTE_Q),
        Rule("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.attention.qkv_linear.wk.weight", PERMUTE_K),
        Rule("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.attention.qkv_linear.wv.weight"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight"),
        Rule("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.feed_forward.w1.weight"),
        Rule("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.feed_forward.w3.weight"),
        Rule("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.feed_forward.w2.weight"),
        Rule("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight"),
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
    ),
    ignored=("layers.{L}.attention.rope.cache", "freqs_cis", "rope.cache"),
    stores_tied_head=True,  # torchtitan ties by one parameter under both names: its state dict holds both
)
