"""Reference FP8 and MXFP4 (de)quantization the quantized-checkpoint tests compare against.

Written independently of ckpttool's own code, after the published originals:

- `deepseek_weight_quant` / `deepseek_weight_dequant`: CPU ports of `weight_quant_kernel` and
  `weight_dequant_kernel` in DeepSeek-V3 `inference/kernel.py`, as literal loops over the
  (pid_m, pid_n) grid the Triton kernels launch, edge blocks included.
- `mxfp4_dequant`: transformers' own `convert_moe_packed_tensors` (gpt-oss).
- `reference_dequantized_state_dict`: what DeepSeek's `inference/fp8_cast_bf16.py` and
  transformers' `dequantize=True` do to a whole Hub folder, with one difference spelled out
  there: every unquantized floating tensor is cast to the requested dtype.

The fixture generator (fixtures/quantized/generate_quantized.py) quantizes with
`deepseek_weight_quant` from this module, so fixtures and tests share one rule.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

# DeepSeek-V3 inference/kernel.py: `s = max_val / 448.0`, 448 being float8_e4m3fn's largest finite value
FP8_E4M3_MAX = 448.0
DEFAULT_FP8_BLOCK = (128, 128)
SCALE_INV_SUFFIX = "_scale_inv"  # DeepSeek-V3 names a weight's block scales `<name>.weight_scale_inv`
MXFP4_BLOCKS_SUFFIX = "_blocks"  # gpt-oss names packed experts `<name>_blocks` + `<name>_scales`
MXFP4_SCALES_SUFFIX = "_scales"
INDEX_NAME = "model.safetensors.index.json"


def _grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Return the launch grid of DeepSeek's kernels: `(cdiv(M, block), cdiv(N, block))`."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def deepseek_weight_quant(x: torch.Tensor,
                          block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(y, s)`: `x` as float8_e4m3fn and its float32 per-block scales (`weight_scale_inv`).

    A port of DeepSeek-V3 `weight_quant_kernel`: per block, `x.float()`, `s = amax(|x|) / 448.0`,
    `y = (x / s).to(float8_e4m3fn)`; partial edge blocks are their own blocks.

    Example:
        >>> y, s = deepseek_weight_quant(torch.randn(129, 136, dtype=torch.bfloat16))
        >>> y.dtype, tuple(s.shape)
        (torch.float8_e4m3fn, (2, 2))
    """
    if x.dim() != 2:
        raise ValueError(f"weight_quant takes a 2-D weight, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    grid_m, grid_n = _grid((rows, cols), block)
    y = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(grid_m, grid_n, dtype=torch.float32)
    for pid_m in range(grid_m):
        for pid_n in range(grid_n):
            r = slice(pid_m * block[0], min((pid_m + 1) * block[0], rows))
            c = slice(pid_n * block[1], min((pid_n + 1) * block[1], cols))
            x_block = x[r, c].to(torch.float32)
            scale = x_block.abs().max() / FP8_E4M3_MAX
            y[r, c] = (x_block / scale).to(torch.float8_e4m3fn)
            s[pid_m, pid_n] = scale
    return y, s


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Return `x` (float8) times its block scales `s`, as `dtype`.

    A port of DeepSeek-V3 `weight_dequant_kernel`: per (pid_m, pid_n) block,
    `x_block.to(float32) * s[pid_m, pid_n]`, rounded once into `dtype` (round to nearest even, as
    the kernel's store into a bf16 buffer and torch's `.to` both do).

    Example:
        >>> y, s = deepseek_weight_quant(torch.randn(129, 136))
        >>> deepseek_weight_dequant(y, s).shape
        torch.Size([129, 136])
    """
    if x.dim() != 2 or s.dim() != 2:
        raise ValueError(f"weight_dequant takes 2-D tensors, got {tuple(x.shape)} and {tuple(s.shape)}")
    rows, cols = x.shape
    grid_m, grid_n = _grid((rows, cols), block)
    if tuple(s.shape) != (grid_m, grid_n):
        raise ValueError(f"scale shape {tuple(s.shape)} is not the {block} block grid {(grid_m, grid_n)} "
                         f"of a weight of shape {(rows, cols)}")
    y = torch.empty(rows, cols, dtype=dtype)
    for pid_m in range(grid_m):
        for pid_n in range(grid_n):
            r = slice(pid_m * block[0], min((pid_m + 1) * block[0], rows))
            c = slice(pid_n * block[1], min((pid_n + 1) * block[1], cols))
            y[r, c] = (x[r, c].to(torch.float32) * s[pid_m, pid_n].to(torch.float32)).to(dtype)
    return y


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return gpt-oss expert weights `[E, in, out]` from MXFP4 `blocks` `[E, out, in/32, 16]` and
    E8M0 `scales` `[E, out, in/32]`, by transformers' own `convert_moe_packed_tensors`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def read_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Return every tensor of a Hub folder's safetensors files, by name (via the index when present)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"{folder / name}: tensor {key} is also in another shard")
                tensors[key] = f.get_tensor(key)
    return tensors


def reference_dequantized_state_dict(folder: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Return the state dict a reference conversion of a quantized Hub folder writes, sorted by name.

    The scheme comes from config.json's `quantization_config`:

    - `fp8` (DeepSeek-V3): each float8 `X.weight` with `X.weight_scale_inv` becomes
      `deepseek_weight_dequant(weight, scale_inv, weight_block_size, dtype)`; the scales are dropped.
    - `mxfp4` (gpt-oss): each `X_blocks` + `X_scales` pair becomes `X = mxfp4_dequant(...)`.

    Every other floating tensor is `.to(dtype)` (DeepSeek's fp8_cast_bf16.py instead keeps them as
    stored, e.g. the float32 `e_score_correction_bias`); non-floating tensors are kept.

    Example:
        >>> sd = reference_dequantized_state_dict(Path("fixtures/quantized/deepseek_v3_fp8"))
        >>> sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype
        torch.bfloat16
    """
    folder = Path(folder)
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    method = quantization["quant_method"]
    if method not in ("fp8", "mxfp4"):
        raise ValueError(f"{folder}: quant_method {method!r} is neither fp8 nor mxfp4")
    tensors = read_folder_tensors(folder)
    block = tuple(quantization.get("weight_block_size", DEFAULT_FP8_BLOCK))
    if method == "fp8":
        consumed = {name + SCALE_INV_SUFFIX for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    else:
        consumed = {name.removesuffix(MXFP4_BLOCKS_SUFFIX) + MXFP4_SCALES_SUFFIX
                    for name in tensors if name.endswith(MXFP4_BLOCKS_SUFFIX)}
    missing = sorted(consumed - tensors.keys())
    if missing:
        raise KeyError(f"{folder}: quantized tensors without their scales: {missing}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors.keys() - consumed):
        tensor = tensors[name]
        if method == "fp8" and tensor.dtype == torch.float8_e4m3fn:
            out[name] = deepseek_weight_dequant(tensor, tensors[name + SCALE_INV_SUFFIX], block, dtype)
        elif method == "mxfp4" and name.endswith(MXFP4_BLOCKS_SUFFIX):
            base = name.removesuffix(MXFP4_BLOCKS_SUFFIX)
            out[base] = mxfp4_dequant(tensor, tensors[base + MXFP4_SCALES_SUFFIX], dtype)
        elif tensor.is_floating_point():
            out[name] = tensor.to(dtype)
        else:
            out[name] = tensor
    return dict(sorted(out.items()))


def sha256_of(tensor: torch.Tensor) -> str:
    """Return the hex sha256 of a tensor's dtype, shape and raw row-major bytes.

    Example:
        >>> sha256_of(torch.zeros(2, dtype=torch.bfloat16)) == sha256_of(torch.zeros(2, dtype=torch.float16))
        False
    """
    digest = hashlib.sha256()
    digest.update(f"{tensor.dtype}|{list(tensor.shape)}|".encode())
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
