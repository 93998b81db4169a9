"""config.json for a Megatron-LM checkpoint, from the arguments its `common.pt` stores.

Megatron-LM's `save_checkpoint` puts its parsed command line in the checkpoint: `common.pt`
(the non-sharded part of a `torch_dist` save, a torch.save file) holds `args`, an
`argparse.Namespace` (megatron/training/checkpointing.py `generate_state_dict`:
`state_dict['args'] = args`). Its data.pkl is read through the checking loader with stand-ins
that record and never run anything (`_ALLOWED`): the Namespace (BUILD fills its `__dict__`),
the enums its arguments hold (`AttnBackend`, `signal.Signals`: the value recorded) and torch
dtypes (`params_dtype`). Any other global is refused (UnsafeMetadata naming it).

The arguments become the transformers config Megatron-Bridge's `megatron_to_hf_config` writes
for the same model (fixtures/frameworks/megatron_families/*/hf/config.json). Which
architecture: `num_experts` (MoE or dense), then `qk_layernorm` and `add_qkv_bias`:

    dense                     -> LlamaForCausalLM
    dense, add_qkv_bias       -> Qwen2ForCausalLM
    dense, qk_layernorm       -> Qwen3ForCausalLM
    MoE, qk_layernorm         -> Qwen3MoeForCausalLM
    MoE                       -> MixtralForCausalLM
    MoE, multi_latent_attention -> DeepseekV3ForCausalLM (`_mla_config`: MLA, MTP, its router)

each stated by the family converting to it (`Architecture.megatron` in
naming/families/megatron_*.py: those flags, the fields its config.json always has, its MoE
fields), as is its table. A model those architectures cannot represent (another
activation, position embedding or normalization, linear biases, MLA, sliding windows, rope
scaling, shared experts, ...: `_REPRESENTABLE`) is refused in one line naming the argument,
as is a missing argument; --assets with a config.json is then the way.

The vocabulary: `hf_config` states the rows Megatron's model holds (`padded_vocab_size`: what
Megatron-Bridge's config mapping writes, and what a migration resumes); `vocabulary` says how
many of them are the tokenizer's, where the arguments alone state it (`TOKENIZER_VOCAB`), and
saved_config.py gives export that number (the tables write those rows: engine.VOCAB_ROWS).

Example:
    >>> path = common_file("checkpoints")         # the newest iter_* folder's common.pt
    >>> megatron_hf_config(path)["architectures"]
    ['LlamaForCausalLM']
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, overload

from ckpttool.store import storage
from ckpttool.dcp.blobs import DataFiles
from ckpttool.core.errors import CorruptBlob, CorruptMetadata, UnsupportedFormat
from ckpttool.formats.dcp import METADATA_FILENAME
from ckpttool.readers.detect import MEGATRON, MEGATRON_COMMON, MEGATRON_LEGACY, MEGATRON_LEGACY_FILE, detect
from ckpttool.readers.detect import DEEPSPEED_ENGINE_RANK, legacy_rank_files
from ckpttool.readers.detect import MEGATRON_DCP, MEGATRON_FSDP, MEGATRON_ITERATION_FOLDER
from ckpttool.readers.megatron_args import ARGS_ALLOWED, EnumValue, Namespace
from ckpttool.torchsave.record import _TENSOR_PICKLE_ALLOWED
from ckpttool.torchsave.stored import DTypeName, StateDictUnpickler, load_data_pkl
from ckpttool.torchsave.zip import read_directory

if TYPE_CHECKING:
    from ckpttool.naming.engine import Architecture, MegatronArgs

ARGS = "args"  # megatron/training/checkpointing.py generate_state_dict: state_dict['args']
_WAY_OUT = "export with --assets DIR holding the model's config.json"


# ---------------------------------------------------------------------------------------------
# Stand-ins for what common.pt's data.pkl names (nothing here runs code from the file)


_ALLOWED: dict[tuple[str, str], Any] = {
    **_TENSOR_PICKLE_ALLOWED,  # a tensor would be an inert record (Megatron-LM's common.pt holds none)
    **ARGS_ALLOWED,  # the Namespace and its Enum members; torch dtypes (--params-dtype) are StateDictUnpickler's own
}


class _Unpickler(StateDictUnpickler):
    """The checking loader with common.pt's allowlist: a refused name is named in one line."""

    holds = "Megatron-LM's common.pt (its arguments and counters)"


class _ArgsUnpickler(_Unpickler):
    """The same loader for a DCP save's `args` entry (Megatron-LM's Namespace alone)."""

    holds = "Megatron-LM's arguments (its argparse.Namespace)"


def _as_saved(raw: bytes) -> bytes:
    return raw  # the Namespace is filled by BUILD: every BUILD is kept


# ---------------------------------------------------------------------------------------------
# Reading


def common_file(src: str | os.PathLike) -> Path | None:
    """Return the file holding the Megatron-LM arguments of the Megatron checkpoint at `src` (a
    checkpoint folder, or a run directory: its newest, as every reader picks it): a `torch_dist`
    save's `common.pt`, a legacy per-rank save's first `mp_rank_*/model_optim_rng.pt`; None for
    any other source (a remote one too). Looks at file names only unless one of those is there."""
    if storage.is_remote(src) or not os.path.isdir(src):
        return None
    path = Path(src)
    common = (path / MEGATRON_COMMON).is_file() or any(path.glob(f"*/{MEGATRON_COMMON}"))
    legacy = not common and (any(path.glob(f"mp_rank_*/{MEGATRON_LEGACY_FILE}"))
                             or any(path.glob(f"*/mp_rank_*/{MEGATRON_LEGACY_FILE}"))
                             # Megatron-DeepSpeed's DeepSpeed-engine save (readers/detect.py deepspeed_engine_rank_files)
                             or any(path.glob("mp_rank_*_model_states.pt")) or any(path.glob("*/mp_rank_*_model_states.pt")))
    dcp = not common and not legacy and (_dcp_args_folder(path) or any(map(_dcp_args_folder, path.glob("*/"))))
    if not common and not legacy and not dcp:
        return None
    detection = detect(path)
    return args_file_beside(detection.path) if detection.layout in (MEGATRON, MEGATRON_LEGACY, MEGATRON_FSDP,
                                                                    MEGATRON_DCP) else None


def args_file_beside(path: str | os.PathLike) -> Path | None:
    """Return the file holding the Megatron-LM arguments in the checkpoint folder `path` (what a
    reader's Checkpoint.path is): its common.pt, or a legacy save's first rank file; None for any
    other folder (a remote one too). File names only: nothing is read or detected."""
    if storage.is_remote(path):
        return None
    folder = Path(path)
    if (folder / MEGATRON_COMMON).is_file():
        return folder / MEGATRON_COMMON
    ranks = legacy_rank_files(folder)
    if ranks:
        return folder / ranks[0]
    return folder / METADATA_FILENAME if _dcp_args_folder(folder) else None


def _dcp_args_folder(folder: Path) -> bool:
    """True for a torch DCP folder named as Megatron-LM names its iteration folders (`iter_%07d`,
    `release`): where an fsdp_dtensor save keeps its arguments as the DCP entry `args`. File names only."""
    return bool(MEGATRON_ITERATION_FOLDER.match(folder.name)) and (folder / METADATA_FILENAME).is_file()


def read_dcp_args(folder: str | os.PathLike, follow_symlinks: bool = False) -> dict[str, Any] | None:
    """Return the Megatron-LM arguments a torch DCP save by Megatron-LM (`--ckpt-format fsdp_dtensor`, `torch_dcp`)
    keeps as its byte entry `args` (dcp.save's torch.save of the Namespace), read through the same
    checking loader as common.pt's; None when the save has no such entry."""
    from ckpttool.readers.dcp import read_checkpoint  # on use: only a Megatron-named DCP folder reads it

    folder = Path(folder)
    entry = read_checkpoint(folder).objects.get(ARGS)
    if entry is None or entry.blob is None:
        return None
    blob = entry.blob
    where = f"{folder / blob.file}: the entry `{ARGS}` (bytes {blob.offset}..{blob.offset + blob.length})"
    if blob.transforms:
        raise UnsupportedFormat(f"{where}: stored with transforms {list(blob.transforms)}, which this build does not read")
    with DataFiles(folder, follow_symlinks) as files:
        if blob.offset + blob.length > files.size(blob.file):
            raise CorruptMetadata(f"{where}: beyond the end of the file ({files.size(blob.file)} bytes); "
                                  "was the save interrupted?")

        def read(offset: int, length: int) -> bytes:
            return files.read(blob.file, blob.offset + offset, length)

        try:
            entries = read_directory(read, blob.length, where)
        except CorruptBlob as error:
            raise CorruptMetadata(f"{where}: not a whole torch.save record: {str(error).removeprefix(where + ': ')}") from None
        args = load_data_pkl(entries, read, blob.length, where, _ArgsUnpickler, _ALLOWED, _as_saved)
    if not isinstance(args, Namespace):
        raise CorruptMetadata(f"{where}: holds a {type(args).__name__}, not Megatron-LM's argparse.Namespace")
    return dict(vars(args))


def read_args(path: str | os.PathLike, follow_symlinks: bool = False) -> dict[str, Any] | None:
    """Return the Megatron-LM arguments `common.pt` stores (name -> value: numbers, strings,
    `EnumValue`s, `DTypeName`s), or None when it stores none (a save by megatron-core alone).
    Raises UnsafeMetadata naming a global outside the allowlist, CorruptMetadata for a damaged file."""
    path = Path(path)
    where = str(path)
    with DataFiles(path.parent, follow_symlinks) as files:
        size = files.size(path.name)

        def read(offset: int, length: int) -> bytes:
            return files.read(path.name, offset, length)

        try:
            entries = read_directory(read, size, where)
        except CorruptBlob as error:
            raise CorruptMetadata(f"{where}: truncated or damaged torch.save file: "
                                  f"{str(error).removeprefix(where + ': ')}") from None
        state = load_data_pkl(entries, read, size, where, _Unpickler, _ALLOWED, _as_saved)
    if not isinstance(state, dict):
        raise CorruptMetadata(f"{where}: holds a {type(state).__name__}, not Megatron's common state dict")
    args = state.get(ARGS)
    if args is None:
        return None
    if not isinstance(args, Namespace):
        raise CorruptMetadata(f"{where}: `{ARGS}` is a {type(args).__name__}, not Megatron-LM's argparse.Namespace")
    return dict(vars(args))


def saved_args(path: str | os.PathLike, follow_symlinks: bool = False) -> dict[str, Any] | None:
    """Return the Megatron-LM arguments the file `path` holds (common.pt, or a legacy save's
    mp_rank_*/model_optim_rng.pt: its first rank's pickled args), or None when it holds none."""
    if Path(path).name == MEGATRON_LEGACY_FILE:  # a legacy per-rank save: its first rank's pickled args
        from ckpttool.readers.megatron_legacy import read_legacy_args

        return read_legacy_args(Path(path).parent.parent, follow_symlinks)
    if DEEPSPEED_ENGINE_RANK.match(Path(path).name):  # Megatron-DeepSpeed's DeepSpeed-engine save: the same
        from ckpttool.readers.megatron_legacy import read_legacy_args

        return read_legacy_args(Path(path).parent, follow_symlinks)
    if Path(path).name == METADATA_FILENAME:  # a torch DCP save by Megatron-LM: its `args` entry
        return read_dcp_args(Path(path).parent, follow_symlinks)
    return read_args(path, follow_symlinks)


def megatron_hf_config(path: str | os.PathLike, follow_symlinks: bool = False) -> dict[str, Any] | None:
    """Return the transformers config.json (a dict) for the model whose `common.pt` is `path`,
    or None when it stores no Megatron-LM arguments; UnsupportedFormat naming the argument when
    the model is not one transformers' Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral or DeepSeek-V3
    represents.

    Example:
        >>> megatron_hf_config("checkpoints/iter_0000003/common.pt")["num_experts"]
        4
    """
    args = saved_args(path, follow_symlinks)
    return None if args is None else hf_config(args, str(path))


# ---------------------------------------------------------------------------------------------
# The vocabulary: the rows Megatron holds, and the tokenizer's part of them

# Megatron-LM --tokenizer-type -> (the argument holding its vocabulary, tokens it adds, why), for
# the tokenizers whose vocabulary the arguments alone state (megatron/training/tokenizer/
# tokenizer.py of core_v0.16.1, and megatron-core's megatron/core/tokenizers/text/libraries/
# null_tokenizer.py alike). Every other one reads its vocabulary from a file the save does not
# hold (GPT2BPETokenizer: len(encoder) of --vocab-file; SentencePiece, HuggingFace, TikToken:
# --tokenizer-model), so it is not stated: nothing is guessed.
TOKENIZER_VOCAB: Mapping[str, tuple[str, int, str]] = {
    "NullTokenizer": ("vocab_size", 1, "_NullTokenizer.vocab_size: --vocab-size + its EOD token"),
    "NullMultimodalTokenizer": ("vocab_size", 1, "_NullMultimodalTokenizer.vocab_size: --vocab-size + its EOD token"),
}


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary of a Megatron model: `rows`, what its embedding and output layer hold
    (`padded_vocab_size`: the tokenizer's, padded to a multiple of make_vocab_size_divisible_by x
    TP, megatron/training/tokenizer/tokenizer.py `_vocab_size_with_padding`), and `size`, the
    tokenizer's (None when the save does not state it); `stated_by` says which argument states
    it, or why none does."""

    rows: int
    size: int | None
    stated_by: str

    @property
    def padded(self) -> bool:
        """True when the rows hold padding beyond the tokenizer's vocabulary."""
        return self.size is not None and self.size < self.rows


def vocabulary(args: Mapping[str, Any], where: str) -> Vocabulary:
    """Return the vocabulary Megatron-LM's `args` state: the padded rows, and the tokenizer's
    size when the arguments alone give it (`TOKENIZER_VOCAB`).

    Example:
        >>> vocabulary({"padded_vocab_size": 128, "tokenizer_type": "NullTokenizer", "vocab_size": 99}, "args")
        Vocabulary(rows=128, size=100, stated_by='tokenizer_type NullTokenizer, vocab_size 99: ...')
    """
    rows = _int(args, "padded_vocab_size", where)
    kind = args.get("tokenizer_type")
    known = TOKENIZER_VOCAB.get(kind) if isinstance(kind, str) else None
    if known is None:
        return Vocabulary(rows, None, f"the tokenizer ({kind if isinstance(kind, str) else 'none named'}) reads its "
                                      "vocabulary from a file the save does not hold")
    argument, added, why = known
    size = _int(args, argument, where) + added
    if size > rows:
        raise CorruptMetadata(f"{where}: args tokenizer_type {kind} with {argument}={args[argument]} gives {size} tokens, "
                              f"more than padded_vocab_size={rows}")
    return Vocabulary(rows, size, f"tokenizer_type {kind}, {argument} {args[argument]}: {why}")


# ---------------------------------------------------------------------------------------------
# Arguments -> config.json

# Megatron-LM argument -> the values transformers' decoders represent (a missing argument reads
# as None), and what it is. Anything else has no place in a transformers config of these models.
_REPRESENTABLE: tuple[tuple[str, tuple, str], ...] = (
    ("position_embedding_type", ("rope",), "the position embedding (transformers' decoders use rotary)"),
    ("normalization", ("RMSNorm",), "the normalization (transformers' decoders use RMSNorm)"),
    ("swiglu", (True,), "the MLP activation (transformers' decoders use SwiGLU: --swiglu)"),
    ("squared_relu", (False, None), "the MLP activation"),
    ("openai_gelu", (False, None), "the MLP activation"),
    ("quick_geglu", (False, None), "the MLP activation"),
    ("glu_linear_offset", (0.0, None), "the GLU's linear offset"),
    ("activation_func_clamp_value", (None,), "the activation clamp"),
    ("add_bias_linear", (False,), "biases on every linear layer (--disable-bias-linear is what converts)"),
    ("layernorm_zero_centered_gamma", (False, None), "zero-centred norm weights"),
    ("apply_residual_connection_post_layernorm", (False, None), "the residual taken after the norm"),
    ("multi_latent_attention", (False, None), "multi-latent attention"),
    ("experimental_attention_variant", (None,), "the attention variant"),
    ("attention_output_gate", (False, None), "the attention output gate"),
    ("softmax_type", ("vanilla", None), "the attention softmax"),
    ("qk_l2_norm", (False, None), "the q/k L2 norm"),
    ("window_size", (None,), "sliding-window attention"),
    ("rotary_interleaved", (False, None), "interleaved rotary pairs"),
    ("rotary_percent", (1.0, None), "partial rotary"),
    ("use_rope_scaling", (False, None), "rope scaling (Llama 3.1's)"),
    ("rope_type", (None, "rope"), "the rope type"),
    ("rotary_seq_len_interpolation_factor", (None,), "rotary interpolation"),
    ("no_rope_freq", (None,), "layers without rope"),
    ("mtp_num_layers", (None, 0), "multi-token prediction layers"),
    ("heterogeneous_layers_config_path", (None,), "heterogeneous layers"),
    ("heterogeneous_layers_config_encoded_json", (None,), "heterogeneous layers"),
)
_MOE_REPRESENTABLE: tuple[tuple[str, tuple, str], ...] = (
    ("moe_router_score_function", ("softmax",), "the router score function"),
    ("moe_router_enable_expert_bias", (False, None), "the router's expert bias (transformers' routers have none)"),
    ("moe_router_topk_scaling_factor", (None, 1.0), "the top-k scaling factor"),
    ("moe_router_num_groups", (None,), "group-limited routing"),
    ("moe_router_group_topk", (None,), "group-limited routing"),
    ("moe_shared_expert_intermediate_size", (None,), "shared experts"),
    ("moe_latent_size", (None,), "latent MoE"),
    ("moe_layer_freq", (1,), "dense layers between MoE layers"),
)
_PRECISION_FLAGS = (("bf16", "bfloat16"), ("fp16", "float16"))  # Megatron-LM: params_dtype follows these


def hf_config(args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return the transformers config.json (a dict, keys sorted) for Megatron-LM's `args`
    (name -> value, as `read_args` returns them); `where` (common.pt) names them in errors.

    Example:
        >>> hf_config({"num_layers": 2, "hidden_size": 32, ..., "swiglu": True}, "common.pt")["model_type"]
        'llama'
    """
    if _flag(args, "multi_latent_attention", where):
        return _mla_config(args, where)
    if args.get("softmax_type") == "learnable":  # attention sinks: GPT-OSS's
        return _gpt_oss_config(args, where)
    experts = _int(args, "num_experts", where, optional=True) or 0
    _refuse_unrepresentable(args, _REPRESENTABLE + (_MOE_REPRESENTABLE if experts else ()), where)
    qk_norm = _flag(args, "qk_layernorm", where)
    qkv_bias = _flag(args, "add_qkv_bias", where)
    chosen = _megatron_architectures().get((bool(experts), qk_norm, qkv_bias))
    if chosen is None:
        raise UnsupportedFormat(f"{where}: args qk_layernorm={qk_norm}, add_qkv_bias={qkv_bias}"
                                f"{f', num_experts={experts}' if experts else ''}: no transformers architecture "
                                f"ckpttool converts to has this; {_WAY_OUT}")
    found, mapping = chosen
    hidden = _int(args, "hidden_size", where)
    heads = _int(args, "num_attention_heads", where)
    groups = _int(args, "num_query_groups", where) if _flag(args, "group_query_attention", where) else heads
    rope_theta = _number(args, "rotary_base", where)
    config: dict[str, Any] = {
        "architectures": [found.name], "model_type": found.model_type,
        "num_hidden_layers": _int(args, "num_layers", where),
        "hidden_size": hidden,
        "intermediate_size": _int(args, "ffn_hidden_size", where),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _int(args, "kv_channels", where, optional=True) or hidden // heads,
        "vocab_size": _int(args, "padded_vocab_size", where),
        "max_position_embeddings": (_int(args, "max_position_embeddings", where, optional=True)
                                    or _int(args, "seq_length", where)),
        "rms_norm_eps": _number(args, "norm_epsilon" if "norm_epsilon" in args else "layernorm_epsilon", where),
        "rope_theta": rope_theta,  # transformers 4's name; 5 reads rope_parameters
        "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": rope_theta, "rope_type": "default"},
        "tie_word_embeddings": not _flag(args, "untie_embeddings_and_output_weights", where),
        "hidden_act": "silu",  # --swiglu: silu(gate) * up
        "initializer_range": _number(args, "init_method_std", where),
        "attention_dropout": _number(args, "attention_dropout", where),
        "torch_dtype": _dtype(args, where),
    }
    config.update((name, list(value) if isinstance(value, tuple) else value) for name, value in mapping.fields)
    if experts:
        config.update(_moe_fields(args, found.name, mapping, experts, where))
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------
# Multi-latent attention: DeepSeek-V3 (naming/families/megatron_deepseek_v3.py)

# What DeepSeek-V3's config states that the generic tables refuse: MLA, its multi-token
# prediction, and its router (sigmoid scores with an expert bias, group-limited, scaled, shared
# experts, the first layers dense); each is checked or mapped by _mla_config instead.
_MLA_OWN = frozenset({"multi_latent_attention", "mtp_num_layers", "rope_type", "moe_router_score_function",
                      "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_num_groups",
                      "moe_router_group_topk", "moe_shared_expert_intermediate_size", "moe_layer_freq"})
_MLA_REQUIRED: tuple[tuple[str, tuple, str], ...] = (
    ("rope_type", ("rope",), "the rope type (DeepSeek's yarn scaling is not mapped: only --rope-type rope)"),
    ("qk_layernorm", (True,), "the q/kv low-rank norms (DeepSeek-V3 has both: --qk-layernorm)"),
    ("moe_router_score_function", ("sigmoid",), "the router score function (DeepSeek-V3's is sigmoid)"),
    ("moe_router_enable_expert_bias", (True,), "the router's expert bias (DeepSeek-V3's e_score_correction_bias)"),
    ("moe_shared_expert_gate", (False, None), "the shared experts' gate"),
)


def _mla_config(args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """DeepSeek-V3's config.json for Megatron-LM `args` with multi-latent attention: Megatron-Bridge
    0.3.1's DeepSeek config mapping (models/deepseek/common.py `get_common_configs`) read the other
    way. A dense MLA model, or one DeepSeek-V3's config cannot state, is refused naming the argument."""
    from ckpttool import naming

    (architecture,) = naming.family("megatron deepseek_v3").converts_to
    experts = _int(args, "num_experts", where, optional=True) or 0
    if not experts:
        raise UnsupportedFormat(f"{where}: args multi_latent_attention=True without num_experts: DeepSeek-V3 "
                                f"is an MoE model; {_WAY_OUT}")
    generic = tuple(row for row in _REPRESENTABLE + _MOE_REPRESENTABLE if row[0] not in _MLA_OWN)
    _refuse_unrepresentable(args, generic + _MLA_REQUIRED, where)
    layers = _int(args, "num_layers", where)
    width = _int(args, "moe_ffn_hidden_size", where)
    shared = _int(args, "moe_shared_expert_intermediate_size", where, optional=True) or 0
    frequency = args.get("moe_layer_freq", 1)
    pattern = [1] * layers if frequency == 1 else frequency
    dense = pattern.index(1) if isinstance(pattern, list) and 1 in pattern else -1
    if not shared or shared % width or not isinstance(pattern, list) or len(pattern) != layers or dense < 0 or \
            pattern != [0] * dense + [1] * (layers - dense):
        raise UnsupportedFormat(f"{where}: args moe_layer_freq={_shown(frequency)}, "
                                f"moe_shared_expert_intermediate_size={shared}: DeepSeek-V3 states its first dense "
                                f"layers and whole shared experts of the experts' width only; {_WAY_OUT}")
    topk = _int(args, "moe_router_topk", where)
    groups = _int(args, "moe_router_num_groups", where, optional=True) or 1
    group_topk = _int(args, "moe_router_group_topk", where, optional=True) or 1
    if groups > 1 and topk // group_topk != 2:
        # Megatron ranks groups by their top topk/group_topk scores (moe_utils.group_limited_topk),
        # transformers' DeepSeek-V3 router by their top 2
        raise UnsupportedFormat(f"{where}: args moe_router_topk={topk}, moe_router_group_topk={group_topk}: "
                                f"{architecture.name} ranks expert groups by their top 2 scores, Megatron by their top "
                                f"{topk // group_topk}; {_WAY_OUT}")
    heads = _int(args, "num_attention_heads", where)
    rope_theta = _number(args, "rotary_base", where)
    config: dict[str, Any] = {
        "architectures": [architecture.name], "model_type": architecture.model_type,
        "num_hidden_layers": layers, "hidden_size": _int(args, "hidden_size", where),
        "intermediate_size": _int(args, "ffn_hidden_size", where), "moe_intermediate_size": width,
        "num_attention_heads": heads, "num_key_value_heads": heads,  # MLA: every head its own k and v
        "q_lora_rank": _int(args, "q_lora_rank", where, optional=True),
        "kv_lora_rank": _int(args, "kv_lora_rank", where),
        "qk_nope_head_dim": _int(args, "qk_head_dim", where),
        "qk_rope_head_dim": _int(args, "qk_pos_emb_head_dim", where),
        "head_dim": _int(args, "qk_pos_emb_head_dim", where),  # transformers' DeepseekV3Config: the rope part
        "v_head_dim": _int(args, "v_head_dim", where),
        "n_routed_experts": experts, "n_shared_experts": shared // width,
        "num_experts_per_tok": topk, "n_group": groups, "topk_group": group_topk,
        "routed_scaling_factor": (_number(args, "moe_router_topk_scaling_factor", where)
                                  if args.get("moe_router_topk_scaling_factor") is not None else 1.0),
        # Megatron's sigmoid router divides the top-k scores by their sum (moe_router_pre_softmax
        # is a softmax setting: unused with sigmoid scores)
        "norm_topk_prob": True,
        "first_k_dense_replace": dense,
        "num_nextn_predict_layers": _int(args, "mtp_num_layers", where, optional=True) or 0,
        "vocab_size": _int(args, "padded_vocab_size", where),
        "max_position_embeddings": (_int(args, "max_position_embeddings", where, optional=True)
                                    or _int(args, "seq_length", where)),
        "rms_norm_eps": _number(args, "norm_epsilon" if "norm_epsilon" in args else "layernorm_epsilon", where),
        "rope_theta": rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_interleave": True,  # Megatron's MLA rotary takes the even, then the odd channels (rotary_interleaved False)
        "attention_bias": False,
        "tie_word_embeddings": not _flag(args, "untie_embeddings_and_output_weights", where),
        "hidden_act": "silu", "initializer_range": _number(args, "init_method_std", where),
        "attention_dropout": _number(args, "attention_dropout", where), "torch_dtype": _dtype(args, where),
    }
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------
# Learnable softmax offsets (attention sinks): GPT-OSS (naming/families/megatron_gpt_oss.py)

# What GPT-OSS's config states that the generic tables refuse, each checked or mapped by
# _gpt_oss_config instead (Megatron-Bridge 0.3.1's GPTOSSProvider: its settings)
_GPT_OSS_OWN = frozenset({"position_embedding_type", "swiglu", "quick_geglu", "glu_linear_offset",
                          "activation_func_clamp_value", "add_bias_linear", "softmax_type", "window_size"})
_GPT_OSS_REQUIRED: tuple[tuple[str, tuple, str], ...] = (
    ("softmax_type", ("learnable",), "the attention softmax (GPT-OSS's sinks)"),
    ("quick_geglu", (True,), "the experts' activation (GPT-OSS's: gate * sigmoid(1.702 gate), --quick-geglu)"),
    ("swiglu", (False, None), "the MLP activation (GPT-OSS's is --quick-geglu)"),
    ("glu_linear_offset", (1.0,), "the GLU's linear offset (GPT-OSS's (up + 1))"),
    ("add_bias_linear", (True,), "biases on every linear layer (GPT-OSS has them)"),
    ("position_embedding_type", ("rope", "yarn"), "the position embedding"),
    ("qk_layernorm", (False, None), "q/k norms (GPT-OSS has none)"),
    ("moe_router_pre_softmax", (False, None), "the router (GPT-OSS's: a softmax over the top-k logits)"),
)
# Megatron's YaRN fields (GPTOSSProvider's, megatron-core's YarnRotaryEmbedding arguments) ->
# transformers' rope_parameters; mscale / mscale_all_dim must be unset (both frameworks then
# scale cos/sin by 0.1 ln(factor) + 1)
_YARN = (("yarn_rotary_scaling_factor", "factor"), ("yarn_original_max_position_embeddings", "original_max_position_embeddings"),
         ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"))


def _gpt_oss_config(args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """GPT-OSS's config.json for Megatron-LM `args` with learnable softmax offsets (Megatron-Bridge
    0.3.1's GPTOSSProvider settings read the other way). Megatron's sliding window (W, 0) lets a
    token see the W tokens before it and itself, transformers' `sliding_window` S the S - 1 before
    it and itself: S is W + 1 (fixtures/frameworks/generate_megatron_gpt_oss.py checks both)."""
    from ckpttool import naming

    (architecture,) = naming.family("megatron gpt_oss").converts_to
    experts = _int(args, "num_experts", where, optional=True) or 0
    if not experts:
        raise UnsupportedFormat(f"{where}: args softmax_type='learnable' without num_experts: GPT-OSS is an MoE "
                                f"model; {_WAY_OUT}")
    generic = tuple(row for row in _REPRESENTABLE + _MOE_REPRESENTABLE if row[0] not in _GPT_OSS_OWN)
    _refuse_unrepresentable(args, generic + _GPT_OSS_REQUIRED, where)
    limit = args.get("activation_func_clamp_value")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise UnsupportedFormat(f"{where}: args activation_func_clamp_value={_shown(limit)}: GPT-OSS clamps its "
                                f"experts' gate and up (swiglu_limit); {_WAY_OUT}")
    layers = _int(args, "num_layers", where)
    window, layer_types = _gpt_oss_windows(args, layers, where)
    rope_theta = _number(args, "rotary_base", where)
    rope: dict[str, Any] = {"rope_theta": rope_theta, "rope_type": "default"}
    if args.get("position_embedding_type") == "yarn":
        if args.get("yarn_mscale") is not None or args.get("yarn_mscale_all_dim") is not None:
            raise UnsupportedFormat(f"{where}: args yarn_mscale={_shown(args.get('yarn_mscale'))}, yarn_mscale_all_dim="
                                    f"{_shown(args.get('yarn_mscale_all_dim'))}: only YaRN's default attention "
                                    f"scaling is mapped; {_WAY_OUT}")
        rope = {"rope_theta": rope_theta, "rope_type": "yarn",
                **{name: _number(args, field, where) for field, name in _YARN},
                "truncate": _flag(args, "yarn_correction_range_round_to_int", where)}
    heads = _int(args, "num_attention_heads", where)
    hidden = _int(args, "hidden_size", where)
    config: dict[str, Any] = {
        "architectures": [architecture.name], "model_type": architecture.model_type,
        "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": _int(args, "moe_ffn_hidden_size", where, optional=True) or _int(args, "ffn_hidden_size", where),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(args, "num_query_groups", where) if _flag(args, "group_query_attention", where) else heads,
        "head_dim": _int(args, "kv_channels", where, optional=True) or hidden // heads,
        "num_local_experts": experts, "num_experts_per_tok": _int(args, "moe_router_topk", where),
        "sliding_window": window, "layer_types": layer_types,
        "vocab_size": _int(args, "padded_vocab_size", where),
        "max_position_embeddings": (_int(args, "max_position_embeddings", where, optional=True)
                                    or _int(args, "seq_length", where)),
        "rms_norm_eps": _number(args, "norm_epsilon" if "norm_epsilon" in args else "layernorm_epsilon", where),
        "rope_parameters": rope, "swiglu_limit": float(limit), "attention_bias": True,
        "tie_word_embeddings": not _flag(args, "untie_embeddings_and_output_weights", where),
        "initializer_range": _number(args, "init_method_std", where),
        "attention_dropout": _number(args, "attention_dropout", where), "torch_dtype": _dtype(args, where),
    }
    if rope["rope_type"] == "yarn":  # the context YaRN stretches to, as GPT-OSS's config states it (4096 x 32)
        config["max_position_embeddings"] = int(rope["original_max_position_embeddings"] * rope["factor"])
    return dict(sorted(config.items()))


def _gpt_oss_windows(args: Mapping[str, Any], layers: int, where: str) -> tuple[int | None, list[str]]:
    """Return transformers' (sliding_window, layer_types) for Megatron's window_size and
    window_attn_skip_freq (megatron-core transformer/utils.py `is_layer_window_attention`: layer
    n, from 1, is windowed unless n % freq == 0; a list: 1 windowed)."""
    size = args.get("window_size")
    if size is None:
        return None, ["full_attention"] * layers
    if not isinstance(size, (tuple, list)) or len(size) != 2 or any(type(v) is not int for v in size) \
            or size[0] <= 0 or size[1] != 0:
        raise UnsupportedFormat(f"{where}: args window_size={_shown(size)}: only a causal window (W, 0) has a "
                                f"place in GPT-OSS's config; {_WAY_OUT}")
    frequency = args.get("window_attn_skip_freq")
    if frequency is None:
        windowed = [True] * layers
    elif type(frequency) is int and frequency > 0:
        windowed = [number % frequency != 0 for number in range(1, layers + 1)]
    elif isinstance(frequency, list) and len(frequency) == layers and all(v in (0, 1) for v in frequency):
        windowed = [bool(v) for v in frequency]
    else:
        raise UnsupportedFormat(f"{where}: args window_attn_skip_freq={_shown(frequency)} does not say which of "
                                f"{layers} layers are windowed; {_WAY_OUT}")
    return size[0] + 1, ["sliding_attention" if flag else "full_attention" for flag in windowed]


def _megatron_architectures() -> dict[tuple[bool, bool, bool], tuple[Architecture, MegatronArgs]]:
    """Return (MoE, qk_layernorm, add_qkv_bias) -> the architecture those Megatron-LM arguments
    mean and what the family converting to it states (`Architecture.megatron`)."""
    from ckpttool import naming

    return {(args.moe, args.qk_layernorm, args.add_qkv_bias): (architecture, args) for family in naming.FAMILIES
            for architecture in family.converts_to if (args := architecture.megatron) is not None}


def _moe_fields(args: Mapping[str, Any], architecture: str, mapping: MegatronArgs, experts: int,
                where: str) -> dict[str, Any]:
    """The family's `moe_fields`, filled. Megatron's router takes the top k logits and a softmax
    over those (moe_router_pre_softmax False: renormalised top-k probabilities), or a softmax over
    all experts, then the top k; an architecture with no field saying which always renormalises."""
    topk = _int(args, "moe_router_topk", where)
    width = _int(args, "moe_ffn_hidden_size", where, optional=True) or _int(args, "ffn_hidden_size", where)
    pre_softmax = _flag(args, "moe_router_pre_softmax", where)
    fields = dict(mapping.moe_fields)
    if pre_softmax and "renormalize" not in fields.values():
        raise UnsupportedFormat(f"{where}: args moe_router_pre_softmax=True: {architecture} renormalises the "
                                f"top-k probabilities; {_WAY_OUT}")
    values = {"experts": experts, "topk": topk, "width": width, "renormalize": not pre_softmax}
    return {name: values[value] for name, value in fields.items()}


def _refuse_unrepresentable(args: Mapping[str, Any], table: tuple, where: str) -> None:
    for name, allowed, what in table:
        if name not in args and None not in allowed:
            raise UnsupportedFormat(f"{where}: args has no {name} ({what}); {_WAY_OUT}")
        value = args.get(name)
        if name == "moe_layer_freq" and isinstance(value, list) and value and all(v == 1 for v in value):
            continue  # a pattern of MoE layers only
        if not any(_same(value, option) for option in allowed):
            raise UnsupportedFormat(f"{where}: args {name}={_shown(value)}: {what} has no place in a transformers "
                                    f"config ckpttool writes; {_WAY_OUT}")


def _same(value: Any, option: Any) -> bool:
    if option is None or isinstance(option, bool):
        return value is option
    return not isinstance(value, bool) and type(value) in (int, float, str) and value == option


def _shown(value: Any) -> str:
    if isinstance(value, EnumValue):
        return f"{value.enum}({value.value!r})"
    return f"{value!r:.80}"


def _flag(args: Mapping[str, Any], name: str, where: str) -> bool:
    value = args.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CorruptMetadata(f"{where}: args {name}={_shown(value)} is not a boolean")
    return value


@overload
def _int(args: Mapping[str, Any], name: str, where: str, optional: Literal[False] = False) -> int: ...
@overload
def _int(args: Mapping[str, Any], name: str, where: str, optional: bool) -> int | None: ...
def _int(args: Mapping[str, Any], name: str, where: str, optional: bool = False) -> int | None:
    value = args.get(name)
    if value is None and optional:
        return None
    if value is None:
        raise UnsupportedFormat(f"{where}: args has no {name}; {_WAY_OUT}")
    if type(value) is not int or value < 0:
        raise CorruptMetadata(f"{where}: args {name}={_shown(value)} is not a non-negative integer")
    return value


def _number(args: Mapping[str, Any], name: str, where: str) -> int | float:
    value = args.get(name)
    if value is None:
        raise UnsupportedFormat(f"{where}: args has no {name}; {_WAY_OUT}")
    if type(value) not in (int, float):
        raise CorruptMetadata(f"{where}: args {name}={_shown(value)} is not a number")
    return value


def _dtype(args: Mapping[str, Any], where: str) -> str:
    """The dtype the model was trained in: --bf16 / --fp16, else params_dtype (float32)."""
    for flag, dtype in _PRECISION_FLAGS:
        if _flag(args, flag, where):
            return dtype
    value = args.get("params_dtype")
    return value.name if isinstance(value, DTypeName) else "float32"
