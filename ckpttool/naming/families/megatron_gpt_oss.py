"""Megatron-Core GPT-OSS (`torch_dist`), as a table: Megatron-Bridge 0.3.1's GPTOSSBridge
(megatron/bridge/models/gpt_oss/gpt_oss_bridge.py `mapping_registry`) written as data, over the
model view readers/megatron.py gives.

- attention: `linear_qkv` and its bias un-interleaved per query group (QKVMapping), `linear_proj`
  with its bias, and the learnable softmax offset `core_attention.softmax_offset` as `sinks`;
- the norms: the input norm fused into `linear_qkv` (`layer_norm_weight`, as the local spec
  saves it too) or `input_layernorm`; the pre-MLP norm `pre_mlp_layernorm` or, as torch_dist saves
  it, `mlp.linear_fc1.layer_norm_weight`;
- the router `mlp.router` with its bias, under the same names;
- the experts, one transformers tensor each per layer, from torch_dist's stacked experts
  (`mlp.experts.experts.linear_fc1.weight` [E, 2F, H]: megatron-core saves SequentialMLP's
  `local_experts.N` and TEGroupedMLP's `linear_fc1.weightN` alike, under the sequential key):
  `gate_up_proj` [E, H, 2F] is each expert's [gate; up] rows interleaved (gate, up, gate, ...)
  and transposed (GPTOSSMLPGateUpProjMapping `_uninterleave` then `transpose(0, 1)`), its bias
  [E, 2F] interleaved; `down_proj` [E, F, H] each expert's `linear_fc2` transposed, its bias as
  it is (GPTOSSMLPDownProjMapping). engine.py's EXPERTS_INTERLEAVED_TRANSPOSED,
  EXPERTS_INTERLEAVED and EXPERTS_TRANSPOSED: one expert matrix decoded at a time.

- one tensor per expert, as a state dict names them rather than torch_dist (SequentialMLP's
  `local_experts.N.linear_fc1.weight`, TE's grouped `linear_fc1.weightN`: the legacy
  `--ckpt-format torch`), each expert placed in the stacked tensor, the experts gathered and
  checked against the config's `num_local_experts` (engine.py `Transform.gathers`; tested on
  tables of chunks, no fixture of a legacy GPT-OSS save).

Import (`import --to megatron`, naming/backward.py) runs the table backwards and writes what
megatron-core 0.16.1's torch_dist `sharded_state_dict` of GPT-OSS holds (the fixture's save): the
experts stacked (`mlp.experts.experts.linear_fc1.weight` [E, 2F, H] as [gate; up] per expert, its
bias un-interleaved, `linear_fc2` [E, H, F] transposed back), the pre-MLP norm as
`mlp.linear_fc1.layer_norm_weight` and the input norm as `linear_qkv.layer_norm_weight`
(`backward`).
"""

from __future__ import annotations

from ckpttool.naming.engine import (EXPERTS_INTERLEAVED, EXPERTS_INTERLEAVED_TRANSPOSED, EXPERTS_TRANSPOSED, RENAME,
                                    SPLIT_QKV, STACK_EXPERTS, VOCAB_ROWS, Architecture, Family, Rule)

_LAYER = "decoder.layers.{L}."
_EXPERTS = "decoder.layers.{L}.mlp.experts.experts."  # torch_dist: stacked on an experts axis
_LOCAL = "decoder.layers.{L}.mlp.experts.local_experts.{E}."
_GROUPED = "decoder.layers.{L}.mlp.experts."
_HF = "model.layers.{L}."

FAMILY = Family(
    name="megatron gpt_oss",
    signature=("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.core_attention.softmax_offset"),
    converts_to=(
        # logits: the same bytes, float32 sums in other orders (4.8e-7 seen on its fixture)
        Architecture("GptOssForCausalLM", "gpt_oss", logit_tolerance=1e-4),
    ),
    rules=(
        Rule(_HF + "input_layernorm.weight", _LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        Rule(_HF + "input_layernorm.weight", _LAYER + "input_layernorm.weight"),
        Rule((_HF + "self_attn.q_proj.weight", _HF + "self_attn.k_proj.weight", _HF + "self_attn.v_proj.weight"),
             _LAYER + "self_attention.linear_qkv.weight", SPLIT_QKV),
        Rule((_HF + "self_attn.q_proj.bias", _HF + "self_attn.k_proj.bias", _HF + "self_attn.v_proj.bias"),
             _LAYER + "self_attention.linear_qkv.bias", SPLIT_QKV),
        Rule(_HF + "self_attn.o_proj.weight", _LAYER + "self_attention.linear_proj.weight"),
        Rule(_HF + "self_attn.o_proj.bias", _LAYER + "self_attention.linear_proj.bias"),
        Rule(_HF + "self_attn.sinks", _LAYER + "self_attention.core_attention.softmax_offset"),
        Rule(_HF + "post_attention_layernorm.weight", _LAYER + "pre_mlp_layernorm.weight"),
        Rule(_HF + "post_attention_layernorm.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight"),
        Rule(_HF + "mlp.router.weight", _LAYER + "mlp.router.weight"),
        Rule(_HF + "mlp.router.bias", _LAYER + "mlp.router.bias"),
        Rule(_HF + "mlp.experts.gate_up_proj", _EXPERTS + "linear_fc1.weight", EXPERTS_INTERLEAVED_TRANSPOSED),
        Rule(_HF + "mlp.experts.gate_up_proj_bias", _EXPERTS + "linear_fc1.bias", EXPERTS_INTERLEAVED),
        Rule(_HF + "mlp.experts.down_proj", _EXPERTS + "linear_fc2.weight", EXPERTS_TRANSPOSED),
        Rule(_HF + "mlp.experts.down_proj_bias", _EXPERTS + "linear_fc2.bias", RENAME),
        # one tensor per expert, as a state dict names them (SequentialMLP's, TE's grouped): gathered
        Rule(_HF + "mlp.experts.gate_up_proj", _LOCAL + "linear_fc1.weight", EXPERTS_INTERLEAVED_TRANSPOSED),
        Rule(_HF + "mlp.experts.gate_up_proj_bias", _LOCAL + "linear_fc1.bias", EXPERTS_INTERLEAVED),
        Rule(_HF + "mlp.experts.down_proj", _LOCAL + "linear_fc2.weight", EXPERTS_TRANSPOSED),
        Rule(_HF + "mlp.experts.down_proj_bias", _LOCAL + "linear_fc2.bias", STACK_EXPERTS),
        Rule(_HF + "mlp.experts.gate_up_proj", _GROUPED + "linear_fc1.weight{E}", EXPERTS_INTERLEAVED_TRANSPOSED),
        Rule(_HF + "mlp.experts.gate_up_proj_bias", _GROUPED + "linear_fc1.bias{E}", EXPERTS_INTERLEAVED),
        Rule(_HF + "mlp.experts.down_proj", _GROUPED + "linear_fc2.weight{E}", EXPERTS_TRANSPOSED),
        Rule(_HF + "mlp.experts.down_proj_bias", _GROUPED + "linear_fc2.bias{E}", STACK_EXPERTS),
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", VOCAB_ROWS),
        Rule("model.norm.weight", "decoder.final_layernorm.weight"),
        Rule("lm_head.weight", "output_layer.weight", VOCAB_ROWS),
    ),
    ignored=("decoder.layers.{L}.mlp.router.expert_bias", "decoder.layers.{L}.mlp.router.local_tokens_per_expert"),
    changes_forward=("decoder.layers.{L}.mlp.router.expert_bias",),  # the router adds it to its scores before choosing experts
    tied_head="output_layer.weight",
    # import writes the names megatron-core's torch_dist save holds: the experts stacked, the
    # norms fused into the linear layers that follow them
    backward=(_LAYER + "self_attention.linear_qkv.layer_norm_weight", _LAYER + "mlp.linear_fc1.layer_norm_weight",
              _EXPERTS + "linear_fc1.weight", _EXPERTS + "linear_fc1.bias", _EXPERTS + "linear_fc2.weight",
              _EXPERTS + "linear_fc2.bias"),
)
