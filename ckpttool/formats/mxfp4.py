"""MXFP4 weights (OCP microscaling FP4, gpt-oss), in one place: their names, shapes and
dequantisation as transformers computes it.

A quantised `<name>` (gpt-oss: each layer's `mlp.experts.gate_up_proj` and `down_proj`) is saved
as `<name>_blocks`, uint8 [..., rows, G, 16] (32 E2M1 codes per group, two a byte, the low
nibble first) and `<name>_scales`, uint8 [..., rows, G] (E8M0: the group's power of two, biased
by 127). transformers `integrations/mxfp4.py` `convert_moe_packed_tensors` (what
`Mxfp4Config(dequantize=True)` loads): codes looked up in `FP4_VALUES` (in the output dtype),
`torch.ldexp` by the exponent minus 127, and the last two dims of [E, rows, G * 32] swapped:
`<name>` is [E, G * 32, rows] (the model's [experts, in, out]). Each expert is independent, so a
weight streams a few experts at a time.

Example:
    >>> dequantized_shape((32, 5760, 90, 16))
    (32, 2880, 5760)
"""

from __future__ import annotations

from typing import Any

METHOD = "mxfp4"  # quantization_config.quant_method
BLOCKS = "_blocks"
SCALES = "_scales"
GROUP = 32  # values per scale (OCP MX block size)
BLOCK_BYTES = 16  # bytes of a group's codes
SCALE_BIAS = 127  # E8M0's exponent bias
# the E2M1 code points, sign in the high bit (transformers' FP4_VALUES): -0.0 is code 8
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantized_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Return the shape of `<name>` for `<name>_blocks` of shape `blocks` [E, rows, G, 16]."""
    *lead, rows, groups, _ = blocks
    return (*lead, groups * 2 * BLOCK_BYTES, rows)


def fits(blocks: tuple[int, ...], scales: tuple[int, ...]) -> bool:
    """True when `_blocks` and `_scales` of these shapes form one MXFP4 weight that
    convert_moe_packed_tensors takes (3+ dims of codes, one scale per group)."""
    return len(blocks) == 4 and blocks[-1] == BLOCK_BYTES and tuple(scales) == tuple(blocks[:-1])


def dequantize_experts(torch: Any, blocks: Any, scales: Any, dtype: Any) -> Any:
    """Return experts `blocks` [e, rows, G, 16] with `scales` [e, rows, G] dequantised to
    [e, G * 32, rows] in `dtype`, by the same operations in the same dtypes as
    convert_moe_packed_tensors (so the bits are the same)."""
    experts, rows, groups, width = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    flat = blocks.reshape(-1, width)
    exponents = (scales.to(torch.int32) - SCALE_BIAS).reshape(-1, 1)
    out = torch.empty(flat.shape[0], width * 2, dtype=dtype)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    return out.view(experts, rows, groups * width * 2).transpose(1, 2).contiguous()
