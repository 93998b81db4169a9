"""Megatron-Core DeepSeek-V3 (`torch_dist`), as a table: Megatron-Bridge 0.3.1's DeepSeekV3Bridge
(megatron/bridge/models/deepseek/common.py `get_common_mapping_list` plus the router's
`expert_bias`) written as data, over the model view readers/megatron.py gives.

- multi-latent attention, each projection renamed: `linear_q_down_proj` / `linear_q_up_proj` as
  `q_a_proj` / `q_b_proj` (or `linear_q_proj` as `q_proj` without a q low rank),
  `linear_kv_down_proj` / `linear_kv_up_proj` as `kv_a_proj_with_mqa` / `kv_b_proj`, the q and kv
  norms (`q_layernorm` / `kv_layernorm`, or TE's fused `linear_q_up_proj.layer_norm_weight` /
  `linear_kv_up_proj.layer_norm_weight`) as `q_a_layernorm` / `kv_a_layernorm`;
- the first dense layers' `linear_fc1` [gate; up] split in two, as megatron_gpt.py's;
- MoE layers: routed experts as megatron_qwen_moe.py takes them, the shared experts'
  `linear_fc1` split in two, the router as `mlp.gate` and its expert bias as
  `mlp.gate.e_score_correction_bias` (DeepSeek-V3's router adds it before choosing experts, as
  Megatron's does: it is written, not left out);
- multi-token prediction: Megatron's `mtp.layers.M` (its `transformer_layer` a decoder layer, and
  its own `enorm`, `hnorm`, `eh_proj`, `final_layernorm`) is transformers' layer
  `num_hidden_layers + M` (`{N}`: numbered after the main layers, as DeepSeek-V3's Hub checkpoint
  and torchtitan_deepseek_v3.py number it), `final_layernorm` as `shared_head.norm`. Megatron's
  MTP shares the main embedding and output layer, so `embed_tokens` and `shared_head.head` of
  that layer are not written (transformers builds no MTP layer and reads neither). Megatron-Bridge
  0.3.1 maps no MTP layer ("TODO: mtp layers"); its fixture's reference maps each as the decoder
  layer it is (fixtures/frameworks/generate_megatron_more_families.py).
"""

from __future__ import annotations

from ckpttool.naming.engine import (EXPERTS, EXPERTS_HALVES, RENAME, SPLIT_HALVES, VOCAB_ROWS, Architecture, Family,
                                    Rule)
from ckpttool.naming.fused import QWEN2_MOE

_ATTENTION = "self_attention."
_EXPERTS = "mlp.experts."
# transformers' name after "model.layers.{L}." <- Megatron's after "decoder.layers.{L}." (its transform)
_LAYER: tuple[tuple[str | tuple[str, ...], str, str], ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", RENAME),
    ("self_attn.q_a_proj.weight", _ATTENTION + "linear_q_down_proj.weight", RENAME),
    ("self_attn.q_b_proj.weight", _ATTENTION + "linear_q_up_proj.weight", RENAME),
    ("self_attn.q_a_layernorm.weight", _ATTENTION + "q_layernorm.weight", RENAME),
    ("self_attn.q_a_layernorm.weight", _ATTENTION + "linear_q_up_proj.layer_norm_weight", RENAME),
    ("self_attn.q_proj.weight", _ATTENTION + "linear_q_proj.weight", RENAME),
    ("self_attn.kv_a_proj_with_mqa.weight", _ATTENTION + "linear_kv_down_proj.weight", RENAME),
    ("self_attn.kv_b_proj.weight", _ATTENTION + "linear_kv_up_proj.weight", RENAME),
    ("self_attn.kv_a_layernorm.weight", _ATTENTION + "kv_layernorm.weight", RENAME),
    ("self_attn.kv_a_layernorm.weight", _ATTENTION + "linear_kv_up_proj.layer_norm_weight", RENAME),
    ("self_attn.o_proj.weight", _ATTENTION + "linear_proj.weight", RENAME),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", RENAME),
    ("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", RENAME),
    (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight", SPLIT_HALVES),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight", RENAME),
    (("mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"),
     _EXPERTS + "local_experts.{E}.linear_fc1.weight", SPLIT_HALVES),
    ("mlp.experts.{E}.down_proj.weight", _EXPERTS + "local_experts.{E}.linear_fc2.weight", RENAME),
    (("mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"), _EXPERTS + "linear_fc1.weight{E}",
     SPLIT_HALVES),
    ("mlp.experts.{E}.down_proj.weight", _EXPERTS + "linear_fc2.weight{E}", RENAME),
    (("mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"), _EXPERTS + "experts.linear_fc1.weight",
     EXPERTS_HALVES),
    ("mlp.experts.{E}.down_proj.weight", _EXPERTS + "experts.linear_fc2.weight", EXPERTS),
    (("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
     "mlp.shared_experts.linear_fc1.weight", SPLIT_HALVES),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", RENAME),
    ("mlp.gate.weight", "mlp.router.weight", RENAME),
    ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", RENAME),
)


def _rules(hf_prefix: str, source_prefix: str) -> tuple[Rule, ...]:
    def named(hf: str | tuple[str, ...]) -> str | tuple[str, ...]:
        return hf_prefix + hf if isinstance(hf, str) else tuple(hf_prefix + name for name in hf)

    return tuple(Rule(named(hf), source_prefix + source, transform) for hf, source, transform in _LAYER)


_MTP = "mtp.layers.{M}."

FAMILY = Family(
    name="megatron deepseek_v3",
    signature=("embedding.word_embeddings.weight", "decoder.layers.{L}.self_attention.linear_kv_down_proj.weight"),
    converts_to=(
        # logits: MLA, sigmoid routing and rotary in float32 in other orders (3.6e-5 seen)
        Architecture("DeepseekV3ForCausalLM", "deepseek_v3", logit_tolerance=1e-4, fused=QWEN2_MOE),
    ),
    rules=(
        *_rules("model.layers.{L}.", "decoder.layers.{L}."),
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", VOCAB_ROWS),
        Rule("model.norm.weight", "decoder.final_layernorm.weight"),
        Rule("lm_head.weight", "output_layer.weight", VOCAB_ROWS),
        # multi-token prediction: layer M after the main ones
        *_rules("model.layers.{N}.", _MTP + "transformer_layer."),
        Rule("model.layers.{N}.enorm.weight", _MTP + "enorm.weight"),
        Rule("model.layers.{N}.hnorm.weight", _MTP + "hnorm.weight"),
        Rule("model.layers.{N}.eh_proj.weight", _MTP + "eh_proj.weight"),
        Rule("model.layers.{N}.shared_head.norm.weight", _MTP + "final_layernorm.weight"),
    ),
    ignored=("decoder.layers.{L}.mlp.router.local_tokens_per_expert",
             _MTP + "transformer_layer.mlp.router.local_tokens_per_expert"),
    tied_head="output_layer.weight",
    backward=("decoder.layers.{L}.mlp.experts.experts.linear_fc1.weight",
              "decoder.layers.{L}.mlp.experts.experts.linear_fc2.weight",
              _MTP + "transformer_layer.mlp.experts.experts.linear_fc1.weight",
              _MTP + "transformer_layer.mlp.experts.experts.linear_fc2.weight"),
    hf_ignored=(("model.layers.{N}.embed_tokens.weight", "Megatron's MTP layer shares the main embedding"),
                ("model.layers.{N}.shared_head.head.weight", "Megatron's MTP layer shares the main output layer")),
)
