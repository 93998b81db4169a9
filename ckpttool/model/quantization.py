"""The quantised weights of a checkpoint, found from its tensors and its `quantization_config`:
which tensors hold codes, which their scales, how they dequantise, and what is wrong with them.

Recognition is by structure, in every layout (Hub folder, one `.safetensors`, DCP), with the
config's word where there is one (`config.json` beside the checkpoint, or --assets):

- FP8 (formats.fp8): a float8 `<m>.weight` with `<m>.weight_scale_inv` (fine-grained blocks,
  `weight_block_size` from the config, else 128 x 128) or `<m>.weight_scale` (compressed-tensors,
  per tensor or per channel); the scale may sit in another shard.
- MXFP4 (formats.mxfp4): uint8 `<name>_blocks` with `<name>_scales`; `<name>` is what they
  dequantise to.

A float8 tensor without a scale, or packed blocks without theirs, is never cast: `problems`
names them, and dequantising refuses them. Pure: the config is given, nothing is read here.

Example:
    >>> found = find(checkpoint, config)
    >>> found.scheme, found.block, len(found.weights)
    ('fp8', (128, 128), 14)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ckpttool.core import dtypes
from ckpttool.core.checkpoint import Checkpoint, Tensor
from ckpttool.core.errors import InvalidCheckpoint
from ckpttool.formats import fp8, mxfp4
from ckpttool.formats.model_config import config_beside as config_beside  # where the config naming a quantisation is read

CONFIG_FILENAME = "config.json"  # transformers.utils.CONFIG_NAME
CONFIG_KEY = "quantization_config"


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantised weight: its codes and scale entries and what they dequantise to."""

    name: str  # the dequantised tensor's fqn (FP8: the weight's own; MXFP4: `_blocks` dropped)
    layout: str  # fp8.BLOCK | fp8.TENSOR | fp8.CHANNEL | mxfp4.METHOD
    codes: str  # fqn of the codes (float8 weight, uint8 `_blocks`)
    scale: str  # fqn of the scale (`weight_scale_inv`, `weight_scale`, `_scales`)
    block: tuple[int, int]  # FP8 blocks' (rows, cols); MXFP4: (1, 32)
    shape: tuple[int, ...]  # the dequantised shape
    dropped: tuple[str, ...] = ()  # other fqns that leave with dequantisation (activation scales)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Quantization:
    """What `find` found: the scheme (`fp8`, `compressed-tensors`, `mxfp4`), FP8's block, the
    quantised weights by codes fqn, their packed and scale bytes, and problems (fqn, message)."""

    scheme: str
    block: tuple[int, int] | None
    weights: dict[str, QuantizedWeight]
    packed_bytes: int  # codes and scales as stored
    scale_bytes: int
    config: Mapping[str, Any] | None = None  # quantization_config, when there is one
    problems: tuple[tuple[str, str], ...] = ()
    unscaled: tuple[str, ...] = field(default=())  # float8 or packed tensors with no scale

    @property
    def entries(self) -> set[str]:
        """Every fqn the quantised weights are stored in (codes, scales, activation scales)."""
        return {fqn for w in self.weights.values() for fqn in (w.codes, w.scale, *w.dropped)}

    def dequantized_parameters(self, tensors: Mapping[str, Tensor], fqns: set[str] | None = None) -> int:
        """Return the elements of `fqns` (default all tensors) with each quantised weight counted
        as its dequantised tensor and its scales left out."""
        entries = self.entries
        fqns = set(tensors) if fqns is None else fqns
        total = sum(tensors[f].numel for f in fqns if f not in entries and f in tensors)
        return total + sum(w.numel for w in self.weights.values() if w.codes in fqns)


def find(checkpoint: Checkpoint, config: Mapping[str, Any] | None = None) -> Quantization | None:
    """Return the checkpoint's quantised weights (None when it holds none and its config names
    no quantisation). `config` is the model's config.json (its `quantization_config` names the
    method and FP8's `weight_block_size`)."""
    tensors = checkpoint.tensors
    settings = (config or {}).get(CONFIG_KEY)
    settings = settings if isinstance(settings, dict) else None
    method = str(settings.get("quant_method")) if settings else None
    block = _block(settings, checkpoint.path)
    weights: dict[str, QuantizedWeight] = {}
    problems: list[tuple[str, str]] = []
    unscaled: list[str] = []
    for fqn, tensor in tensors.items():
        if tensor.dtype in fp8.FLOAT8:
            _fp8_weight(fqn, tensor, tensors, block, weights, problems, unscaled)
        elif tensor.dtype in fp8.ALL_FLOAT8:  # codes of a kind no format here defines scales for: never cast
            unscaled.append(fqn)
            problems.append((fqn, f"{fqn}: {tensor.dtype} codes, which no FP8 format ckpttool reads defines scales "
                                  f"for ({' or '.join(fp8.FLOAT8)} with a float32 scale); they are not the weight alone"))
        elif fqn.endswith(mxfp4.BLOCKS) and tensor.dtype == "uint8":
            _mxfp4_weight(fqn, tensor, tensors, weights, problems, unscaled)
        elif fqn.endswith(fp8.BLOCK_SCALE) and fqn[: -len(fp8.BLOCK_SCALE)] not in tensors:
            problems.append((fqn, f"{fqn}: a scale whose weight {fqn[: -len(fp8.BLOCK_SCALE)]} is not in the checkpoint"))
        elif fqn.endswith(mxfp4.SCALES) and fqn[: -len(mxfp4.SCALES)] + mxfp4.BLOCKS not in tensors \
                and tensor.dtype == "uint8":
            problems.append((fqn, f"{fqn}: MXFP4 scales whose {fqn[: -len(mxfp4.SCALES)] + mxfp4.BLOCKS} is not "
                                  "in the checkpoint"))
    if not weights and not problems and not unscaled and method is None:
        return None
    layouts = {w.layout for w in weights.values()}
    scheme = method or ("mxfp4" if mxfp4.METHOD in layouts else "fp8" if fp8.BLOCK in layouts
                        else fp8.COMPRESSED if layouts else "unknown")
    packed = sum(tensors[f].nbytes for w in weights.values() for f in (w.codes, w.scale, *w.dropped))
    scales = sum(tensors[f].nbytes for w in weights.values() for f in (w.scale, *w.dropped))
    return Quantization(scheme, block if fp8.BLOCK in layouts else None, dict(sorted(weights.items())), packed, scales,
                        settings, tuple(problems), tuple(unscaled))


def _block(settings: Mapping[str, Any] | None, where: Any) -> tuple[int, int]:
    value = (settings or {}).get("weight_block_size")
    if value is None:
        return fp8.DEFAULT_BLOCK
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise InvalidCheckpoint(f"{where}: {CONFIG_FILENAME}: quantization_config.weight_block_size is {value!r}, "
                                "expected two positive integers", code="config-mismatch")
    return (value[0], value[1])


def _fp8_weight(fqn: str, tensor: Tensor, tensors: Mapping[str, Tensor], block: tuple[int, int],
                weights: dict[str, QuantizedWeight], problems: list, unscaled: list) -> None:
    scale_fqn = next((fqn + s for s in (fp8.BLOCK_SCALE, fp8.TENSOR_SCALE) if fqn + s in tensors), None)
    if scale_fqn is None:
        unscaled.append(fqn)
        problems.append((fqn, f"{fqn}: a {tensor.dtype} tensor without its scale ({fqn}{fp8.BLOCK_SCALE} or "
                              f"{fqn}{fp8.TENSOR_SCALE}); its codes alone are not the weight"))
        return
    scale = tensors[scale_fqn]
    blocked = scale_fqn.endswith(fp8.BLOCK_SCALE)
    layout = fp8.layout_of(tensor.shape, scale.shape, block if blocked else None)
    if layout is None or scale.dtype not in fp8.SCALE_DTYPES:
        expected = list(fp8.scale_shape(tensor.shape, block)) if blocked and len(tensor.shape) >= 2 else \
            f"[] or {list((*tensor.shape[:-1], 1))}"
        problems.append((scale_fqn, f"{scale_fqn}: shape {list(scale.shape)} ({scale.dtype}) does not scale "
                                    f"{fqn} {list(tensor.shape)} (expected {expected}"
                                    f"{f' for {block[0]}x{block[1]} blocks' if blocked else ''})"))
        return
    base = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    dropped = tuple(base + s for s in fp8.ACTIVATION_SCALES if base and base + s in tensors)
    weights[fqn] = QuantizedWeight(fqn, layout, fqn, scale_fqn, block, tensor.shape, dropped)


def _mxfp4_weight(fqn: str, tensor: Tensor, tensors: Mapping[str, Tensor], weights: dict[str, QuantizedWeight],
                  problems: list, unscaled: list) -> None:
    name = fqn[: -len(mxfp4.BLOCKS)]
    scale = tensors.get(name + mxfp4.SCALES)
    if scale is None:
        unscaled.append(fqn)
        problems.append((fqn, f"{fqn}: MXFP4 blocks without their scales ({name}{mxfp4.SCALES})"))
        return
    if scale.dtype != "uint8" or not mxfp4.fits(tensor.shape, scale.shape):
        problems.append((scale.fqn, f"{scale.fqn}: shape {list(scale.shape)} ({scale.dtype}) does not scale {fqn} "
                                    f"{list(tensor.shape)} (expected uint8 {list(tensor.shape[:-1])}, blocks of "
                                    f"[experts, rows, groups, {mxfp4.BLOCK_BYTES}])"))
        return
    weights[fqn] = QuantizedWeight(name, mxfp4.METHOD, fqn, scale.fqn, (1, mxfp4.GROUP),
                                   mxfp4.dequantized_shape(tensor.shape))


def require_dequantizable(found: Quantization, where: Any) -> None:
    """Raise InvalidCheckpoint naming the first tensor that cannot be dequantised (a missing
    or misshapen scale): a cast must never write codes without their scales."""
    if found.problems:
        fqn, message = found.problems[0]
        more = f" ({len(found.problems)} such problems; `ckpttool validate` lists them)" if len(found.problems) > 1 else ""
        raise InvalidCheckpoint(f"{where}: {message}; refusing to cast{more}", code="quantization",
                                problems=found.problems)


def dequantized_config(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """Return config.json for the dequantised weights: `quantization_config` gone, `torch_dtype`
    (and transformers 5's `dtype`) the dtype written."""
    config = {key: value for key, value in config.items() if key != CONFIG_KEY}
    return {**config, "torch_dtype": dtype, "dtype": dtype}


def dequantized_names(names: Mapping[str, str], found: Quantization) -> tuple[dict[str, str], dict[str, QuantizedWeight]]:
    """Return key -> fqn `names` as the dequantised model's keys (each quantised weight under
    its dequantised name, MXFP4's `_blocks` dropped, in its codes' place; scales and activation
    scales left out), and key -> quantised weight for the keys written dequantised."""
    leaving = {fqn for w in found.weights.values() for fqn in (w.scale, *w.dropped)}
    renamed: dict[str, str] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for key, fqn in names.items():
        if fqn in leaving:
            continue
        weight = found.weights.get(fqn)
        if weight is not None:
            suffix = fqn[len(weight.name):]  # "" for FP8, "_blocks" for MXFP4
            key = key[: -len(suffix)] if suffix and key.endswith(suffix) else key
            quantized[key] = weight
        renamed[key] = fqn
    return renamed, quantized


def dequantized_selection(selection: Any, found: Quantization) -> tuple[Any, dict[str, QuantizedWeight]]:
    """Return `selection` (plan.consolidate.Selection) with `dequantized_names` applied to its
    tensors (a nested .pt path's last part renamed as its key is), and key -> quantised weight."""
    tensors, quantized = dequantized_names(selection.tensors, found)
    old_keys = {fqn: key for key, fqn in selection.tensors.items()}
    paths: dict[str, tuple] = {}
    for key, fqn in tensors.items():
        old = old_keys[fqn]
        path = selection.paths.get(old, (old,))
        if key != old:
            suffix = old[len(key):]
            last = path[-1]
            path = (*path[:-1], last[: -len(suffix)] if isinstance(last, str) and last.endswith(suffix) else key)
        paths[key] = path
    paths.update({key: selection.paths[key] for key in selection.objects if key in selection.paths})
    return type(selection)(tensors, dict(selection.objects), paths), quantized


def dequantized_keys(weight_map: Mapping[str, str], found: Quantization) -> dict[str, str]:
    """Return a quantised folder's weight map (key -> file) as the dequantised model's keys:
    scales gone, MXFP4's `_blocks` dropped."""
    renamed, _ = dequantized_names({key: key for key in weight_map}, found)
    return {key: weight_map[fqn] for key, fqn in renamed.items()}


def config_dtype(config: Mapping[str, Any] | None) -> str:
    """Return the dtype a quantised model computes in (config.json's torch_dtype or dtype),
    else bfloat16 (what DeepSeek's fp8_cast_bf16 and transformers' MXFP4 dequantisation write)."""
    for field_name in ("torch_dtype", "dtype"):
        value = (config or {}).get(field_name)
        if isinstance(value, str):
            try:
                name = dtypes.canonical(value)
            except KeyError:
                continue
            if name in ("bfloat16", "float16", "float32"):
                return name
    return "bfloat16"


def fp8_config(block: tuple[int, int], not_converted: list[str]) -> dict[str, Any]:
    """Return the `quantization_config` of weights `--quantize fp8` wrote: fine-grained FP8 as
    DeepSeek-V3 and transformers' FineGrainedFP8Config spell it."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": fp8.METHOD,
            "weight_block_size": list(block), "modules_to_not_convert": not_converted}


def dequantized_shapes(tensors: Any, found: Quantization) -> dict[str, tuple[int, ...]]:
    """Return key -> shape of planned output tensors (plan.consolidate.OutputTensor: key, fqn,
    shape) as the dequantised model has them: scales left out, codes under their dequantised
    name and shape (what a config's model holds)."""
    renamed, quantized = dequantized_names({tensor.key: tensor.fqn for tensor in tensors}, found)
    shapes = {tensor.key: tuple(tensor.shape) for tensor in tensors}
    return {key: quantized[key].shape if key in quantized else shapes[key] for key in renamed}
