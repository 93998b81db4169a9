"""Megatron-Core GPT (`torch_dist`), dense, as a table: Megatron-Bridge's Llama / Qwen mappings
(megatron/bridge/models/*/..._bridge.py `mapping_registry`) written as data, over the model view
readers/megatron.py gives (layers taken apart: `decoder.layers.N.*`).

- the fused `linear_qkv` (TE spec: with its input norm as `layer_norm_weight`) un-interleaved per
  query group into q, k, v (Megatron-Bridge `QKVMapping`), its bias too (Qwen2);
- `linear_fc1` [gate; up] split in two (`GatedMLPMapping`);
- the pre-MLP norm: `mlp.linear_fc1.layer_norm_weight` (fused, TE spec) or `pre_mlp_layernorm`;
- `output_layer` -> `lm_head`;
- both, and the embedding, cut to the config's `vocab_size` rows (`VOCAB_ROWS`: Megatron pads them to
  a multiple of make_vocab_size_divisible_by x TP; NeMo's exporter `prune_padding` cuts them alike).

Megatron's three families share these names (megatron_qwen_moe.py and megatron_mixtral.py add
experts): the config's `architectures` picks the table. Without --assets, the Megatron-LM
arguments in common.pt choose the architecture (`megatron` below; naming/megatron_config.py).
"""

from __future__ import annotations

from ckpttool.naming.engine import (DENSE_BIAS_FROM_CONFIG, SPLIT_HALVES, SPLIT_QKV, VOCAB_ROWS, Architecture, Family,
                                    MegatronArgs, Rule)

_LAYER = "decoder.layers.{L}."

FAMILY = Family(
    name="megatron gpt",
    signature=("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_qkv.weight"),
    converts_to=(
        # logits: Megatron's forward (tensor-parallel partial sums gathered, its own rotary and
        # softmax) and transformers' eager one add float32 in other orders
        Architecture("LlamaForCausalLM", "llama", logit_tolerance=1e-4, dense_biases=DENSE_BIAS_FROM_CONFIG,
                     megatron=MegatronArgs(moe=False, qk_layernorm=False, add_qkv_bias=False,
                                           fields=(("attention_bias", False), ("mlp_bias", False)))),
        Architecture("MistralForCausalLM", "mistral", dense_biases=(False, False)),
        Architecture("Qwen2ForCausalLM", "qwen2", logit_tolerance=1e-4, dense_biases=(True, False),
                     megatron=MegatronArgs(moe=False, qk_layernorm=False, add_qkv_bias=True,
                                           fields=(("use_sliding_window", False),))),
        Architecture("Qwen3ForCausalLM", "qwen3",
                     megatron=MegatronArgs(moe=False, qk_layernorm=True, add_qkv_bias=False,
                                           fields=(("attention_bias", False), ("use_sliding_window", False)))),
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
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", VOCAB_ROWS),
        Rule("model.norm.weight", "decoder.final_layernorm.weight"),
        Rule("lm_head.weight", "output_layer.weight", VOCAB_ROWS),
    ),
    tied_head="output_layer.weight",
)
