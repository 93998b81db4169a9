"""Megatron-LM's legacy GPT model (`megatron/model/`, before megatron-core's GPTModel), as
Megatron-DeepSpeed still trains it, as a table: Megatron-DeepSpeed's own converter
(tools/hf2megads_weight_converter.py `refactor.transform_from_megads_to_hf`, microsoft/
Megatron-DeepSpeed f4157bea) written as data, over the model view readers/megatron_legacy.py
gives (the nested `language_model` state dict flattened, layers numbered globally), and
readers/megatron_deepspeed_pipe.py gives the pipeline engine's layer files under the same names.

- `self_attention.query_key_value` un-interleaved per query group into q, k, v (the converter's
  `_qkv_refactor_to_hf`: [kv heads, q heads per group + 2, head_dim, hidden] split [group, 1, 1]);
  multi-head attention is the case of one q head per group ([heads, 3, head_dim]);
- `mlp.dense_h_to_4h` (--swiglu) [gate; up] split in two (`_mlphto4h_dense_refactor_to_hf`, over
  the ranks' parts the reader has put gate parts first, then up parts);
- `self_attention.dense`, `mlp.dense_4h_to_h`, the norms: renamed;
- the embedding and `language_model.output_layer` cut to the config's `vocab_size` rows
  (`_embedding_refactor_to_hf`: `[:hf vocab rows]`).

The saved arguments choose LlamaForCausalLM (naming/megatron_config.py, after the reader has put
Megatron-DeepSpeed's argument names in Megatron-LM's); Megatron-DeepSpeed's converter converts to
Llama only.
"""

from __future__ import annotations

from ckpttool.naming.engine import DENSE_BIAS_FROM_CONFIG, SPLIT_HALVES, SPLIT_QKV, VOCAB_ROWS, Architecture, Family, Rule

_LAYER = "language_model.encoder.layers.{L}."

FAMILY = Family(
    name="megatron-deepspeed gpt",  # not "megatron ...": import --to megatron writes megatron-core names
    signature=("language_model.embedding.word_embeddings.weight",
               "language_model.encoder.layers.{L}.self_attention.query_key_value.weight"),
    converts_to=(
        # logits: Megatron-DeepSpeed's forward (tensor-parallel partial sums gathered, its own
        # rotary and softmax) and transformers' eager one add float32 in other orders
        Architecture("LlamaForCausalLM", "llama", logit_tolerance=1e-4, dense_biases=DENSE_BIAS_FROM_CONFIG),
    ),
    rules=(
        Rule("model.layers.{L}.input_layernorm.weight", _LAYER + "input_layernorm.weight"),
        Rule(("model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
              "model.layers.{L}.self_attn.v_proj.weight"), _LAYER + "self_attention.query_key_value.weight", SPLIT_QKV),
        Rule("model.layers.{L}.self_attn.o_proj.weight", _LAYER + "self_attention.dense.weight"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", _LAYER + "post_attention_layernorm.weight"),
        Rule(("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
             _LAYER + "mlp.dense_h_to_4h.weight", SPLIT_HALVES),
        Rule("model.layers.{L}.mlp.down_proj.weight", _LAYER + "mlp.dense_4h_to_h.weight"),
        Rule("model.embed_tokens.weight", "language_model.embedding.word_embeddings.weight", VOCAB_ROWS),
        Rule("model.norm.weight", "language_model.encoder.final_layernorm.weight"),
        Rule("lm_head.weight", "language_model.output_layer.weight", VOCAB_ROWS),
    ),
    tied_head="language_model.output_layer.weight",
)
