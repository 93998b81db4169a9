"""config.json for a NeMo 2 checkpoint, from the model config its `context/model.yaml` states.

A NeMo 2 checkpoint folder holds `weights/` (a Megatron-Core `torch_dist` save, read by
readers/megatron.py) beside `context/`, which `TrainerContext.io_dump(..., yaml_attrs=["model"])`
(nemo/lightning/io/mixin.py) writes: `io.json` (fiddle's graph of the arguments the model was
built with: only those passed, not the config class's defaults), `model.yaml` (every field of
the model, its config dataclass and its tokenizer, each object a mapping with its `_target_`)
and pickled artifacts named by uuids. NeMo itself rebuilds the objects (`io.load_context`:
imports every `_target_`, unpickles the artifacts). ckpttool reads model.yaml as data only:
its YAML node tree is checked first (`yaml.compose` builds nodes, no objects) and any tag
outside YAML's plain scalars, lists and mappings (`!!python/object/apply:...`) is refused
naming the field; then `yaml.safe_load`. No `_target_` is imported and the pickles are never
opened. PyYAML is a dependency of huggingface-hub, itself one of ckpttool's.

The config's fields are Megatron-Core's `TransformerConfig` fields, mostly named as Megatron-LM's
arguments are; `megatron_args` renames the rest (`_RENAMED`, `share_embeddings_and_output_weights`,
`gated_linear_unit` with `activation_func`) and `megatron_config.hf_config` writes config.json
from them, refusing what transformers' models cannot represent (an error names the NeMo field).
Which NeMo classes are read: `_FAMILIES` (model class, its config classes, the architectures its
fields may give, the vocabulary its HF exporter cuts the rows to); Llama 3.1+/4 configs, which
rescale rope in `configure_model`, are not in it. Tested on NeMo's own saves, each against NeMo's
exporter: LlamaConfig (fixtures/frameworks/nemo2), Qwen2Config, Qwen3Config, Qwen3MoEConfig and
MixtralConfig (fixtures/frameworks/nemo2_families).

The vocabulary: the config's `vocab_size` when set, else the tokenizer's, padded as NeMo pads
it (nemo/lightning/base.py `get_vocab_size`: up to a multiple of `make_vocab_size_divisible_by`
x `tensor_model_parallel_size`; gpt/model/base.py `GPTConfig.configure_model`). The tokenizer's
vocabulary is read from model.yaml only for tokenizers whose `vocab_size` argument is their
vocabulary (`_VOCAB_TOKENIZERS`); another is refused naming it (--assets is the way). The
weights' embedding is the ground truth: export checks config.json against it (config-mismatch).
`vocabulary` says how many of those rows config.json keeps, as the class's NeMo exporter does:
LlamaModel's and MixtralModel's cut them to the tokenizer's vocabulary where model.yaml states it;
Qwen2Model's and Qwen3Model's keep every row of the config's vocab_size (saved_config.py gives it
to export).

Example:
    >>> megatron_args(read_model_yaml(Path("ckpt/context/model.yaml")), "model.yaml")["padded_vocab_size"]
    256
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from ckpttool.core.errors import CheckpointError, CorruptMetadata, UnsafeMetadata, UnsupportedFormat
from ckpttool.naming import megatron_config
from ckpttool.readers.detect import MEGATRON, NEMO2, NEMO2_CONTEXT, NEMO2_WEIGHTS, detect, is_nemo2
from ckpttool.store import storage
from ckpttool.torchsave.stored import DTypeName, dtype_global

MODEL_YAML = "model.yaml"  # nemo/lightning/io/mixin.py IOMixin.io_dump: f"{attr}.yaml" for yaml_attrs=["model"]
TARGET = "_target_"  # fiddle's / NeMo's yaml: the class or function an object is built by
MAX_MODEL_YAML_BYTES = 4 << 20  # a model.yaml is ~10 kB
_WAY_OUT = "export with --assets DIR holding the model's config.json"

_LLAMA, _QWEN2, _QWEN3, _MIXTRAL = ("nemo.collections.llm.gpt.model." + name for name in
                                    ("llama", "qwen2", "qwen3", "mixtral"))
# What the class's HF exporter cuts the embedding and output rows to (TransformFns.prune_padding cuts
# to the HF config's vocab_size): the tokenizer's vocabulary (HFLlamaExporter.config, HFMixtralExporter
# .config: `vocab_size=self.tokenizer.vocab_size`), or the config's own vocab_size, every row kept
# (HFQwen2Exporter.config, HFQwen3Exporter.config: `getattr(source, 'vocab_size', ...)`, set in every
# Qwen config; with it null, NeMo's exporter would pass vocab_size=None, and the tokenizer's rule applies).
_TOKENIZER, _CONFIG = "tokenizer", "config"
# (model class, its config classes, the architectures its fields may give, the rows its exporter keeps):
# nemo_toolkit 2.7.3 nemo/collections/llm/gpt/model/{llama,qwen2,qwen3,mixtral}.py. Configs whose
# configure_model changes the model beyond its fields (Llama31Config's and Llama32's rope scaling,
# Llama4) are absent.
_FAMILIES: tuple[tuple[str, frozenset[str], tuple[str, ...], str], ...] = (
    (f"{_LLAMA}.LlamaModel", frozenset(f"{_LLAMA}.{name}" for name in (
        "LlamaConfig", "Llama2Config7B", "Llama2Config13B", "Llama2Config70B", "Llama3Config", "Llama3Config8B",
        "Llama3Config70B", "CodeLlamaConfig7B", "CodeLlamaConfig13B", "CodeLlamaConfig34B", "CodeLlamaConfig70B")),
     ("LlamaForCausalLM",), _TOKENIZER),
    (f"{_QWEN2}.Qwen2Model", frozenset(f"{_QWEN2}.{name}" for name in (
        "Qwen2Config", "Qwen2Config500M", "Qwen25Config500M", "Qwen2Config1P5B", "Qwen25Config3B", "Qwen25Config1P5B",
        "Qwen2Config7B", "Qwen25Config7B", "Qwen25Config14B", "Qwen25Config32B", "Qwen2Config72B", "Qwen25Config72B")),
     ("Qwen2ForCausalLM",), _CONFIG),
    (f"{_QWEN3}.Qwen3Model", frozenset(f"{_QWEN3}.{name}" for name in (
        "Qwen3Config", "Qwen3MoEConfig", "Qwen3Config600M", "Qwen3Config1P7B", "Qwen3Config4B", "Qwen3Config8B",
        "Qwen3Config14B", "Qwen3Config32B", "Qwen3Config30B_A3B", "Qwen3Config235B_A22B")),
     ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), _CONFIG),
    (f"{_MIXTRAL}.MixtralModel", frozenset(f"{_MIXTRAL}.{name}" for name in (
        "MixtralConfig", "MixtralConfig8x3B", "MixtralConfig8x7B", "MixtralConfig8x22B")),
     ("MixtralForCausalLM",), _TOKENIZER),
)
# tokenizers whose `vocab_size` argument is their vocabulary (nemo/collections/common/tokenizers/
# bytelevel_tokenizers.py: ByteLevelTokenizer(vocab_size=...) has exactly that many ids)
_VOCAB_TOKENIZERS = frozenset({"nemo.collections.common.tokenizers.bytelevel_tokenizers.ByteLevelTokenizer"})

# TransformerConfig fields Megatron-LM's arguments name alike (megatron/training/arguments.py
# core_transformer_config_from_args copies them across by name)
_SAME = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "max_position_embeddings", "rotary_base", "layernorm_epsilon", "init_method_std",
    "attention_dropout", "position_embedding_type", "normalization", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "layernorm_zero_centered_gamma", "apply_residual_connection_post_layernorm",
    "multi_latent_attention", "experimental_attention_variant", "attention_output_gate", "softmax_type",
    "qk_l2_norm", "window_size", "rotary_interleaved", "rotary_percent", "no_rope_freq", "mtp_num_layers",
    "glu_linear_offset", "activation_func_clamp_value", "bf16", "fp16", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_router_pre_softmax", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_layer_freq",
)
_RENAMED = {"num_moe_experts": "num_experts", "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor"}
SILU = "torch.nn.functional.silu"  # LlamaConfig.activation_func = F.silu, dumped as {_call_: false, _target_: ...}
# fields of a NeMo model that no transformers config ckpttool writes can state: (field, allowed, what)
_NEMO_REPRESENTABLE: tuple[tuple[str, tuple, str], ...] = (
    ("config.gated_linear_unit", (True,), "the MLP's gate (transformers' decoders use SwiGLU)"),
    ("config.is_hybrid_model", (False, None), "a hybrid (Mamba) model"),
    ("config.heterogeneous_block_specs", (False, None), "heterogeneous layers"),
    ("config.fp8_param", (False, None), "fp8 parameters"),
    ("config.fp4_param", (False, None), "fp4 parameters"),
    ("model_transform", (None,), "a model transform (PEFT: the adapter, not the model)"),
)
_SAFE_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float", "str", "seq", "map"))


def context_dir(src: str | os.PathLike) -> Path | None:
    """Return the `context/` folder of the NeMo 2 checkpoint `src` names (its folder, its run
    folder: the newest, or its `weights/`), or None for any other source (a remote one too)."""
    if storage.is_remote(src) or not os.path.isdir(src):
        return None
    path = Path(src)
    if (beside := context_beside(path)) is not None:
        return beside
    if not (path / NEMO2_CONTEXT).is_dir() and not any(path.glob(f"*/{NEMO2_CONTEXT}")) \
            and not any(path.glob(f"*/*/{NEMO2_CONTEXT}")):
        return None
    try:
        detection = detect(path, read_metadata=False)
    except CheckpointError:
        return None
    if detection.layout == NEMO2 or (detection.layout == MEGATRON and is_nemo2(detection.path.parent)):
        return detection.path.parent / NEMO2_CONTEXT
    return None


def context_beside(path: str | os.PathLike) -> Path | None:
    """Return the `context/` folder of the NeMo 2 checkpoint whose `weights/` folder is `path`
    (what a reader's Checkpoint.path is), or None for any other folder (a remote one too)."""
    if storage.is_remote(path) or Path(path).name != NEMO2_WEIGHTS or not is_nemo2(Path(path).parent):
        return None
    return Path(path).parent / NEMO2_CONTEXT


def read_model_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Return `model.yaml` as plain data (dicts, lists, numbers, strings). Raises UnsafeMetadata
    naming the field for any tag that would build an object (`!!python/...`), CorruptMetadata for
    a file that is not YAML, too large, or not a mapping."""
    import yaml  # huggingface-hub's dependency; imported where a NeMo checkpoint is read

    path = Path(path)
    try:
        if path.stat().st_size > MAX_MODEL_YAML_BYTES:
            raise CorruptMetadata(f"{path}: {path.stat().st_size} bytes, over {MAX_MODEL_YAML_BYTES} for a model config")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CorruptMetadata(f"{path}: missing; NeMo's context/ holds the model's config there "
                              f"(or {_WAY_OUT})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CorruptMetadata(f"{path}: unreadable ({error})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: nothing is constructed
        if node is not None:
            _check_tags(node, "", path, set())
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise CorruptMetadata(f"{path}: not YAML ckpttool reads as data: {' '.join(str(error).split())}") from None
    except RecursionError:
        raise CorruptMetadata(f"{path}: nested too deeply") from None
    if not isinstance(document, dict):
        raise CorruptMetadata(f"{path}: holds a {type(document).__name__}, not NeMo's model mapping")
    return document


def _check_tags(node: Any, where: str, path: Path, seen: set[int]) -> None:
    """Refuse any node tagged other than YAML's plain types; each node once (an alias shares its
    anchor's node: a document of aliases of aliases is walked in its size, not its expansion)."""
    import yaml

    if id(node) in seen:
        return
    seen.add(id(node))
    if node.tag not in _SAFE_TAGS:
        raise UnsafeMetadata(f"{path}: {where or 'the document'} carries the tag {node.tag}: ckpttool reads "
                             "model.yaml as data and never builds objects from a checkpoint")
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _check_tags(key, where, path, seen)
            _check_tags(value, f"{where}.{key.value}" if where else str(key.value), path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_tags(item, f"{where}[{index}]", path, seen)


def nemo_hf_config(context: str | os.PathLike) -> dict[str, Any]:
    """Return the transformers config.json (a dict) of the NeMo 2 model whose `context/` folder
    is `context`; UnsupportedFormat naming the field for a model class or setting it cannot state.

    Example:
        >>> nemo_hf_config("ckpt/context")["architectures"]
        ['LlamaForCausalLM']
    """
    path = Path(context) / MODEL_YAML
    return hf_config_of(read_model_yaml(path), path)


def hf_config_of(model: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """`nemo_hf_config` of the model.yaml `model` (read as data) at `path`."""
    args = megatron_args(model, str(path))
    where = str(path)
    try:
        config = megatron_config.hf_config(args, where)
    except (UnsupportedFormat, CorruptMetadata) as error:
        raise type(error)(_in_nemo_names(str(error), where)) from None
    target = model.get(TARGET)
    allowed = next(architectures for model_class, _, architectures, _ in _FAMILIES if model_class == target)
    if config["architectures"][0] not in allowed:
        raise UnsupportedFormat(f"{where}: {TARGET}={target} with qk_layernorm={args.get('qk_layernorm')}, "
                                f"add_qkv_bias={args.get('add_qkv_bias')}, num_moe_experts={args.get('num_experts')}: "
                                f"the fields give {config['architectures'][0]}, not {' or '.join(allowed)}; {_WAY_OUT}")
    return config


def megatron_args(model: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return the Megatron-LM arguments (name -> value, as `megatron_config.read_args` gives them)
    that NeMo's `model` (model.yaml as data) states; `where` names the file in errors."""
    target = model.get(TARGET)
    family = next((row for row in _FAMILIES if row[0] == target), None)
    if family is None:
        raise UnsupportedFormat(f"{where}: {TARGET}={_shown(target)}: a NeMo model class with no table in ckpttool "
                                f"(it reads {', '.join(row[0].rsplit('.', 1)[1] for row in _FAMILIES)}); {_WAY_OUT}")
    config = model.get("config")
    if not isinstance(config, dict):
        raise CorruptMetadata(f"{where}: config is a {type(config).__name__}, not the model's config mapping")
    if config.get(TARGET) not in family[1]:
        raise UnsupportedFormat(f"{where}: config.{TARGET}={_shown(config.get(TARGET))}: not a config class ckpttool "
                                f"reads for {family[0].rsplit('.', 1)[1]} (one whose configure_model adds nothing beyond "
                                f"its fields, e.g. no Llama 3.1 rope scaling); {_WAY_OUT}")
    for field, allowed, what in _NEMO_REPRESENTABLE:
        value = _field(model, field)
        if not any(value is option if option is None or isinstance(option, bool) else value == option
                   for option in allowed):
            raise UnsupportedFormat(f"{where}: {field}={_shown(value)}: {what} has no place in a transformers config "
                                    f"ckpttool writes; {_WAY_OUT}")
    activation = config.get("activation_func")
    if not (isinstance(activation, dict) and activation.get(TARGET) == SILU and activation.get("_call_") is False):
        raise UnsupportedFormat(f"{where}: config.activation_func={_shown(activation)}: the MLP activation "
                                f"(transformers' decoders use SiLU: {SILU}); {_WAY_OUT}")
    args: dict[str, Any] = {name: config[name] for name in _SAME if name in config}
    args.update((megatron, config[nemo]) for nemo, megatron in _RENAMED.items() if nemo in config)
    args["swiglu"] = True
    groups = config.get("num_query_groups")
    args["group_query_attention"] = groups is not None  # TransformerConfig: None means one group per head
    share = config.get("share_embeddings_and_output_weights")
    if not isinstance(share, bool):
        raise CorruptMetadata(f"{where}: config.share_embeddings_and_output_weights={_shown(share)} is not a boolean")
    args["untie_embeddings_and_output_weights"] = not share
    dtype = config.get("params_dtype")
    if isinstance(dtype, dict) and isinstance(dtype.get(TARGET), str):
        module, _, name = dtype[TARGET].rpartition(".")
        found = dtype_global(module, name)
        if found is None:
            raise CorruptMetadata(f"{where}: config.params_dtype={_shown(dtype)} is not a torch dtype")
        args["params_dtype"] = found
    args["padded_vocab_size"] = _padded_vocab(model, config, where)
    return args


def vocabulary(model: Mapping[str, Any], path: Path) -> megatron_config.Vocabulary:
    """Return the vocabulary NeMo's `model` (model.yaml as data) states: the rows its embedding
    and output layer hold (the config's vocab_size, else the tokenizer's padded), and how many of
    them the class's NeMo exporter keeps (`_FAMILIES`, nemo/lightning/io/state.py
    `TransformFns.prune_padding`): every row for a Qwen class with the config's vocab_size set,
    else the tokenizer's vocabulary when model.yaml states it (`_VOCAB_TOKENIZERS`)."""
    where = str(path)
    config = model.get("config")
    if not isinstance(config, dict):
        raise CorruptMetadata(f"{where}: config is a {type(config).__name__}, not the model's config mapping")
    rows = _padded_vocab(model, config, where)
    family = next((row for row in _FAMILIES if row[0] == model.get(TARGET)), None)
    if family is not None and family[3] == _CONFIG and config.get("vocab_size") is not None:
        name = family[0].rsplit(".", 1)[1]
        return megatron_config.Vocabulary(rows, rows, f"{MODEL_YAML} config.vocab_size (NeMo's {name} exporter "
                                                      "keeps every row)")
    size = _tokenizer_vocab(model, where)
    if size is None:
        kind = _field(model, f"tokenizer.{TARGET}")
        return megatron_config.Vocabulary(rows, None, f"the tokenizer ({_shown(kind)}) does not state its vocabulary "
                                                      "in model.yaml")
    if size > rows:
        raise CorruptMetadata(f"{where}: the tokenizer's vocabulary ({size}) is larger than config.vocab_size ({rows})")
    return megatron_config.Vocabulary(rows, size, f"{MODEL_YAML} tokenizer.vocab_size")


def _tokenizer_vocab(model: Mapping[str, Any], where: str) -> int | None:
    """The tokenizer's vocabulary when model.yaml states it (ByteLevelTokenizer: vocab_size, plus
    its special tokens, nemo/collections/common/tokenizers/bytelevel_tokenizers.py), else None."""
    tokenizer = model.get("tokenizer")
    if not isinstance(tokenizer, dict) or tokenizer.get(TARGET) not in _VOCAB_TOKENIZERS:
        return None
    special = tokenizer.get("special_tokens")
    if special is not None and not isinstance(special, (list, dict)):
        raise CorruptMetadata(f"{where}: tokenizer.special_tokens={_shown(special)} is not a list or mapping")
    return _positive(tokenizer.get("vocab_size"), "tokenizer.vocab_size", where) + len(special or ())


def _padded_vocab(model: Mapping[str, Any], config: Mapping[str, Any], where: str) -> int:
    """NeMo's vocabulary size: the config's, else the tokenizer's padded (nemo/lightning/base.py get_vocab_size)."""
    if config.get("vocab_size") is not None:
        return _positive(config["vocab_size"], "config.vocab_size", where)
    vocab = _tokenizer_vocab(model, where)
    if vocab is None:
        kind = _field(model, f"tokenizer.{TARGET}")
        raise UnsupportedFormat(f"{where}: config.vocab_size is null and tokenizer.{TARGET}={_shown(kind)} does not state "
                                f"its vocabulary in model.yaml; {_WAY_OUT}")
    multiple = (_positive(config.get("make_vocab_size_divisible_by"), "config.make_vocab_size_divisible_by", where)
                * _positive(config.get("tensor_model_parallel_size"), "config.tensor_model_parallel_size", where))
    return -(-vocab // multiple) * multiple


def _positive(value: Any, field: str, where: str) -> int:
    if type(value) is not int or value <= 0:
        raise CorruptMetadata(f"{where}: {field}={_shown(value)} is not a positive integer")
    return value


def _field(model: Mapping[str, Any], dotted: str) -> Any:
    value: Any = model
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _in_nemo_names(message: str, where: str) -> str:
    """`megatron_config`'s error about argument X, said of model.yaml's field config.X."""
    back = {megatron: nemo for nemo, megatron in _RENAMED.items()}
    head, _, rest = message.partition(f"{where}: ")
    for prefix in ("args has no ", "args "):
        if rest.startswith(prefix):
            name = rest[len(prefix):].split("=", 1)[0].split(" ", 1)[0]
            nemo = back.get(name, name)
            rest = rest[len(prefix):].replace(name, f"config.{nemo}", 1)
            return f"{head}{where}: {'no ' if prefix == 'args has no ' else ''}{rest}"
    return message


def _shown(value: Any) -> str:
    if isinstance(value, DTypeName):
        return value.name
    return f"{value!r:.80}"
