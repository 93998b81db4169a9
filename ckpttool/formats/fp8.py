"""FP8 weights with their scales, in one place: the names the formats give a quantised weight's
scale, the shape a scale must have, and dequantisation and quantisation as the references
compute them.

- **Fine-grained FP8** (`quantization_config.quant_method == "fp8"`; DeepSeek-V3, Qwen3-FP8,
  transformers' `FineGrainedFP8Config`): a float8 `<m>.weight` [rows, cols] with a float32
  `<m>.weight_scale_inv` [ceil(rows / B0), ceil(cols / B1)], one scale per B0 x B1 block, the
  edge blocks partial. DeepSeek-V3 `inference/kernel.py` `weight_dequant_kernel`: each element
  `x.to(float32) * s[block]`, stored once in the output dtype. Its `weight_quant_kernel`:
  `s = amax(|x|) / 448` per block (float32), codes `(x / s).to(float8_e4m3fn)`.
- **compressed-tensors FP8** (`quant_method == "compressed-tensors"`, format
  `float-quantized`, llm-compressor's output): a float8 `<m>.weight` with `<m>.weight_scale`
  per tensor ([] or [1]) or per channel ([rows, 1]); compressed_tensors
  `quantization/lifecycle/forward.py` `_dequantize`: `x.to(scale.dtype) * scale`, then the
  output dtype. `<m>.input_scale` (static activation scales) leaves with the dequantised
  weight.

Leading dimensions (grouped experts [E, rows, cols]) carry over to the scale; blocks tile the
last two. Dequantising a range of rows needs only the scale rows of their blocks, so a weight
streams a block-row at a time.

Example:
    >>> scale_shape((576, 7168), (128, 128))
    (5, 56)
"""

from __future__ import annotations

from typing import Any

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")  # what the FP8 formats store codes as
# every float8 kind torch has: codes that mean nothing without their scales, never cast alone
# (the fnuz kinds are AMD's, e8m0 is the MX formats' scale: no FP8 format here defines their scales)
ALL_FLOAT8 = frozenset({*FLOAT8, "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})
# the dtypes an FP8 weight's scale is stored in: float32 (DeepSeek's weight_scale_inv, llm-compressor's
# weight_scale), or the model's own bfloat16/float16 (compressed-tensors with a 16-bit scale_dtype)
SCALE_DTYPES = frozenset({"float32", "bfloat16", "float16"})
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max; DeepSeek's weight_quant divides amax by it
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size; FineGrainedFP8Config's default
BLOCK_SCALE = "_scale_inv"  # `<m>.weight` -> `<m>.weight_scale_inv`
TENSOR_SCALE = "_scale"  # compressed-tensors: `<m>.weight` -> `<m>.weight_scale`
ACTIVATION_SCALES = (".input_scale", ".activation_scale")  # activation scales beside `<m>.weight`
METHOD = "fp8"  # quant_method of fine-grained FP8
COMPRESSED = "compressed-tensors"  # quant_method of llm-compressor's output
BLOCK, TENSOR, CHANNEL = "fp8-block", "fp8-tensor", "fp8-channel"  # the three scale layouts


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Return the shape of a block-scaled weight's `weight_scale_inv`: leading dims kept, the
    last two counted in blocks (partial edge blocks included)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def layout_of(shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int] | None) -> str | None:
    """Return which layout a scale of shape `scale` gives a weight of `shape` (BLOCK, TENSOR,
    CHANNEL), or None when it fits none of them."""
    if len(shape) < 2:
        return None
    if block is not None and tuple(scale) == scale_shape(shape, block):
        return BLOCK
    if len(scale) <= 1 and all(size == 1 for size in scale):
        return TENSOR
    if tuple(scale) == (*shape[:-1], 1):
        return CHANNEL
    return None


def dequantize_rows(torch: Any, codes: Any, scale: Any, layout: str, block: tuple[int, int], dtype: Any,
                    out: Any, index: Any = None) -> None:
    """Write into `out` (`dtype`, codes' shape) the dequantised `codes` [rows, cols] (whole
    blocks of rows, the last may be partial), with `scale` the scale rows of those blocks.

    BLOCK: DeepSeek's weight_dequant, `codes.float() * s` per block, one rounding to `dtype`.
    TENSOR / CHANNEL: compressed-tensors' `codes.to(scale.dtype) * scale`, then `dtype`.
    `index`: an int32 scratch tensor of at least a block-row's elements (allocated if None)."""
    if layout != BLOCK:
        values = codes.to(scale.dtype)
        values.mul_(scale.reshape(-1, 1) if layout == CHANNEL else scale.reshape(()))
        out.copy_(values)
        return
    # Each block has one scale s, so its elements take one of 256 values: the table of
    # `code.float() * s` rounded to `dtype` (the same product, rounded once, as the reference
    # computes per element); a block-row is then one gather through the tables of its column
    # blocks, twice as fast as torch's float8 -> float32 conversion it replaces.
    rows, cols = codes.shape
    b0, b1 = block
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(codes.dtype).to(torch.float32)
    column_table = (torch.arange(cols, dtype=torch.int32) // b1) * 256  # each column's table in the row's tables
    if index is None:
        index = torch.empty((min(rows, b0), cols), dtype=torch.int32)
    flat_out = out.view(-1)
    for start in range(0, rows, b0):
        stop = min(rows, start + b0)
        tables = (values.view(1, 256) * scale[start // b0].view(-1, 1)).to(dtype).view(-1)
        piece = index[: stop - start]
        piece.copy_(codes[start:stop].view(torch.uint8))
        piece.add_(column_table)
        torch.index_select(tables, 0, piece.view(-1), out=flat_out[start * cols:stop * cols])


def quantize_rows(torch: Any, values: Any, block: tuple[int, int], codes: Any, scale: Any) -> None:
    """Write into `codes` (float8_e4m3fn) and `scale` (float32, the blocks' rows) the
    fine-grained FP8 of `values` [rows, cols], as DeepSeek-V3's weight_quant computes it:
    per block `s = amax(|x|) / 448`, codes `x / s`. A block of zeros (where weight_quant
    would divide 0 by 0) gets s = 0 and zero codes, which dequantise to its zeros."""
    rows, cols = values.shape
    b0, b1 = block
    for start in range(0, rows, b0):
        stop = min(rows, start + b0)
        piece = values[start:stop].to(torch.float32)
        for column in range(0, cols, b1):
            box = piece[:, column:column + b1]
            s = box.abs().amax() / FP8_MAX
            scale[start // b0, column // b1] = s
            if s == 0:
                codes[start:stop, column:column + b1] = 0
            else:
                codes[start:stop, column:column + b1].copy_(box / s)


# ---------------------------------------------------------------------------------------------
# Fine-grained blocks without torch: the same arithmetic in numpy (importing torch costs ~3 s
# and ~200 MB; this path needs neither)

BITS = {"bfloat16": "uint16", "float16": "uint16", "float32": "uint32"}  # output dtype -> its bits in numpy


def code_values(name: str) -> Any:
    """Return the float32 value of each of the 256 codes of float8 dtype `name` (what torch's
    float8 -> float32 conversion gives, NaN with the code's sign and a quiet payload)."""
    import numpy as np

    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    if name == "float8_e4m3fn":
        exponent, mantissa, bias, mantissa_bits = (codes >> 3) & 0xF, codes & 0x7, 7, 3
        nan = (exponent == 0xF) & (mantissa == 0x7)
        inf = np.zeros(256, dtype=bool)
    else:  # float8_e5m2
        exponent, mantissa, bias, mantissa_bits = (codes >> 2) & 0x1F, codes & 0x3, 15, 2
        nan = (exponent == 0x1F) & (mantissa != 0)
        inf = (exponent == 0x1F) & (mantissa == 0)
    scale = float(1 << mantissa_bits)
    normal = (1.0 + mantissa / scale) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = (mantissa / scale) * np.exp2(1.0 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values = np.where(inf, sign * np.inf, values).astype(np.float32)
    bits = values.view(np.uint32)
    # torch's float8 -> float32 NaNs: quiet, the code's mantissa as the payload's top bits
    bits[nan] = (codes[nan] & 0x80) << 24 | 0x7FC00000 | (mantissa[nan] << (23 - mantissa_bits))
    return values


def round_bits(values: Any, dtype: str) -> Any:
    """Return float32 `values` rounded once to `dtype` as torch's `.to(dtype)` rounds them on an
    x86 CPU (nearest even), as that dtype's bits. NaN: torch's vectorised conversions write
    bfloat16 NaN as 0xFFFF and keep float16's sign and payload top bits (F16C), so this does."""
    import numpy as np

    bits = values.view(np.uint32)
    if dtype == "float32":
        return bits.copy()
    nan = np.isnan(values)
    if dtype == "bfloat16":
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        rounded[nan] = 0xFFFF
        return rounded
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch gives
        half = values.astype(np.float16).view(np.uint16)
    half[nan] = (((bits[nan] >> 16) & 0x8000) | 0x7E00 | ((bits[nan] & 0x7FFFFF) >> 13)).astype(np.uint16)
    return half


def dequantize_block_rows(codes: Any, code_dtype: str, scale: Any, block: tuple[int, int], dtype: str, out: Any,
                          index: Any) -> None:
    """`dequantize_rows` of fine-grained blocks in numpy: `codes` uint8 [rows, cols], `scale`
    float32 [block rows, block cols], `out` the output's bits ([rows, cols] of `BITS[dtype]`),
    `index` intp scratch of a block-row. Each block's 256 possible values are
    `round(code_value * s)` (the reference's float32 product, rounded once), gathered by code."""
    import numpy as np

    rows, cols = codes.shape
    b0, b1 = block
    values = code_values(code_dtype)
    column_table = (np.arange(cols, dtype=np.intp) // b1) * 256
    for start in range(0, rows, b0):
        stop = min(rows, start + b0)
        tables = round_bits((values[None, :] * scale[start // b0][:, None]).astype(np.float32), dtype).reshape(-1)
        piece = index[: stop - start]
        np.add(codes[start:stop], column_table, out=piece, dtype=np.intp, casting="unsafe")
        # every index is a code (< 256) in a column block's table: in range by construction, so
        # "clip" (no bounds errors to raise) is the same gather, done in half the time
        np.take(tables, piece, out=out[start:stop], mode="clip")
