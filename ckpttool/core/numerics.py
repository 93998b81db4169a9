"""Floating elements from their raw little-endian bytes, with numpy (no torch import): NaN/Inf
counts (`count_non_finite`, for validate --deep), exact values (`as_float64`, for diff), and
every figure of `validate --numerics` in one call per block (`scan_block`: NaN/Inf and the
first of them, zeros, subnormals, max |x|).

`validate --deep` scans every floating chunk; importing torch for that alone would cost
~2 s and ~225 MB. IEEE formats numpy has (float16/32/64) use `np.isfinite`; the others are
classified from their bits, as torch defines them:

| dtype | non-finite bit patterns (sign bit ignored) |
|---|---|
| bfloat16 | exponent 0xFF: Inf when the mantissa is 0, else NaN |
| float8_e5m2 | exponent 0x1F: Inf when the mantissa is 0, else NaN |
| float8_e4m3fn | 0x7F is NaN; no Inf |
| float8_e4m3fnuz, float8_e5m2fnuz | 0x80 (negative zero's pattern) is NaN; no Inf |
| float8_e8m0fnu | 0xFF is NaN; no Inf |

Example:
    >>> count_non_finite(struct.pack("<3f", 1.0, float("nan"), float("inf")), "float32")
    (1, 1)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

_IEEE = {"float16": "<f2", "float32": "<f4", "float64": "<f8"}
# dtype -> (unsigned view, exponent mask, mantissa mask): all-ones exponent is Inf/NaN
_EXPONENT_CODED = {
    "bfloat16": ("<u2", 0x7F80, 0x007F),
    "float8_e5m2": ("u1", 0x7C, 0x03),
}
# dtype -> (mask applied before comparing, the NaN pattern); these have no Inf
_NAN_PATTERN = {
    "float8_e4m3fn": (0x7F, 0x7F),
    "float8_e4m3fnuz": (0xFF, 0x80),
    "float8_e5m2fnuz": (0xFF, 0x80),
    "float8_e8m0fnu": (0xFF, 0xFF),
}
SUPPORTED = frozenset(_IEEE) | frozenset(_EXPONENT_CODED) | frozenset(_NAN_PATTERN)
# float8 formats: (exponent bits, mantissa bits, bias, kind) as torch defines them
# (c10/util/Float8_*.h): `fn` has no Inf and NaN at S.1111.111, `fnuz` has NaN at 0x80 only.
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}
DECODED = frozenset(_IEEE) | {"bfloat16", "float8_e8m0fnu"} | frozenset(_FLOAT8)  # what `as_float64` reads


def count_non_finite(data: bytes | bytearray | memoryview, dtype: str) -> tuple[int, int]:
    """Return (NaN count, Inf count) of the `dtype` elements in `data` (whole elements only).

    One pass over the data when every value is finite, the common case.
    """
    if dtype in _IEEE:
        values = np.frombuffer(data, dtype=_IEEE[dtype])
        finite = int(np.count_nonzero(np.isfinite(values)))
        if finite == values.size:
            return 0, 0
        nan = int(np.count_nonzero(np.isnan(values)))
        return nan, values.size - finite - nan
    if dtype in _EXPONENT_CODED:
        view, exponent, mantissa = _EXPONENT_CODED[dtype]
        bits = np.frombuffer(data, dtype=view)
        special = (bits & exponent) == exponent
        if not special.any():
            return 0, 0
        nan = int(np.count_nonzero(special & ((bits & mantissa) != 0)))
        return nan, int(np.count_nonzero(special)) - nan
    if dtype in _NAN_PATTERN:
        mask, pattern = _NAN_PATTERN[dtype]
        bits = np.frombuffer(data, dtype="u1")
        return int(np.count_nonzero((bits & mask) == pattern)), 0
    raise KeyError(f"no NaN/Inf rule for dtype {dtype!r}")


def as_float64(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Return the values of floating elements given as their unsigned bit patterns (exact:
    every format here fits in float64)."""
    if dtype in _IEEE:
        return bits.view(_IEEE[dtype]).astype(np.float64)
    if dtype == "bfloat16":  # the top half of a float32
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return float8_table(dtype)[bits]


_TABLES: dict[str, np.ndarray] = {}  # dtype -> float8_table


def float8_table(dtype: str) -> np.ndarray:
    """Return the 256 float64 values of a float8 format, indexed by bit pattern."""
    if dtype not in _TABLES:
        values = np.empty(256, np.float64)
        for bits in range(256):
            if dtype == "float8_e8m0fnu":  # exponent only, bias 127, 0xFF is NaN
                values[bits] = math.nan if bits == 0xFF else 2.0 ** (bits - 127)
                continue
            exponent_bits, mantissa_bits, bias, kind = _FLOAT8[dtype]
            sign = -1.0 if bits & 0x80 else 1.0
            exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
            mantissa = bits & ((1 << mantissa_bits) - 1)
            top = (1 << exponent_bits) - 1
            if (kind == "fnuz" and bits == 0x80) or (kind == "fn" and bits & 0x7F == 0x7F):
                values[bits] = math.nan
            elif kind == "ieee" and exponent == top:
                values[bits] = sign * math.inf if mantissa == 0 else math.nan
            elif exponent == 0:
                values[bits] = sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
            else:
                values[bits] = sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)
        _TABLES[dtype] = values
    return _TABLES[dtype]


# bit patterns of each element size, compared as unsigned integers
_UNSIGNED = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def element_bits(data: memoryview | bytes, itemsize: int) -> np.ndarray:
    """Return the elements of `data` as unsigned integers of their size (16-byte elements as
    rows of two 8-byte words), so two buffers compare bit for bit.

    Example:
        >>> element_bits(b"\\x00\\x00\\x80\\x3f", 4).tolist()   # 1.0 as float32
        [1065353216]
    """
    if itemsize in _UNSIGNED:
        return np.frombuffer(data, _UNSIGNED[itemsize])
    return np.frombuffer(data, "<u8").reshape(-1, itemsize // 8)


# ---------------------------------------------------------------------------------------------
# Every figure `validate --numerics` reports, from the bits, in few passes over a block


class BlockNumbers(NamedTuple):
    """What `scan_block` finds in a block of `elements` elements: NaN and Inf counts, the block
    index of the first NaN or Inf (None: none), counts of zeros (±0) and subnormals (non-zero,
    below `torch.finfo(dtype).tiny` in magnitude), and the largest finite |x| (0.0 when none)."""

    elements: int
    nan: int
    inf: int
    first_bad: int | None
    zero: int
    subnormal: int
    max_abs: float


# dtype -> (unsigned view, magnitude mask (all but the sign bit), the least magnitude that is
# NaN or Inf (None: none is, by magnitude), Inf's magnitude (None: no Inf), the least normal
# magnitude (exponent field 1, mantissa 0: torch.finfo(dtype).tiny)). In every format here a
# larger magnitude pattern is a larger |x|, and the NaN/Inf patterns are the largest ones.
_MAGNITUDE: dict[str, tuple[str, int, int | None, int | None, int]] = {
    "float64": ("<u8", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000, 1 << 52),
    "float32": ("<u4", 0x7FFF_FFFF, 0x7F80_0000, 0x7F80_0000, 1 << 23),
    "float16": ("<u2", 0x7FFF, 0x7C00, 0x7C00, 1 << 10),
    "bfloat16": ("<u2", 0x7FFF, 0x7F80, 0x7F80, 1 << 7),
    "float8_e5m2": ("u1", 0x7F, 0x7C, 0x7C, 1 << 2),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F, None, 1 << 3),
    "float8_e4m3fnuz": ("u1", 0x7F, None, None, 1 << 3),  # NaN is 0x80 alone (magnitude 0): _FNUZ_NAN
    "float8_e5m2fnuz": ("u1", 0x7F, None, None, 1 << 2),
    "float8_e8m0fnu": ("u1", 0xFF, 0xFF, None, 0),  # 2**(bits - 127): no zero, no subnormal
}
_FNUZ_NAN = 0x80
SCANNED = frozenset(_MAGNITUDE)  # the dtypes `scan_block` reads


def scan_block(data: bytes | bytearray | memoryview, dtype: str, work: bytearray | memoryview | None = None) -> BlockNumbers:
    """Return the `BlockNumbers` of the `dtype` elements in `data` (whole elements only).

    `work`, when given (at least twice `len(data)` bytes), holds the intermediate arrays, so a
    thread scanning block after block allocates nothing. Clean blocks (no NaN/Inf, no zero or
    subnormal) cost four reductions and no write (`_magnitude_range`); the others a few more
    vector passes.

    Example:
        >>> scan_block(struct.pack("<4f", 1.0, float("nan"), 0.0, -2.5), "float32")
        BlockNumbers(elements=4, nan=1, inf=0, first_bad=1, zero=1, subnormal=0, max_abs=2.5)
    """
    view, mask, special, infinity, normal = _MAGNITUDE[dtype]
    bits = np.frombuffer(data, dtype=view)
    count = bits.size
    if not count:
        return BlockNumbers(0, 0, 0, None, 0, 0, 0.0)
    low, top = _magnitude_range(bits, mask)
    if (special is None or top < special) and low >= normal:  # fnuz NaN (0x80): magnitude 0, below normal
        # the common block: no NaN/Inf, zero or subnormal, found by four reductions
        return BlockNumbers(count, 0, 0, None, 0, 0, float(as_float64(np.array([top], dtype=view), dtype)[0]))
    if work is None:
        magnitude, flags = np.empty(count, dtype=view), np.empty(count, dtype=bool)
    else:
        magnitude = np.frombuffer(work, dtype=view, count=count)
        flags = np.frombuffer(work, dtype=bool, count=count, offset=magnitude.nbytes)
    np.bitwise_and(bits, mask, out=magnitude)
    top = int(magnitude.max())
    nan = inf = 0
    first_bad = None
    if special is not None and top >= special:
        np.greater_equal(magnitude, special, out=flags)
        bad = int(np.count_nonzero(flags))
        first_bad = int(np.argmax(flags))
        inf = int(np.count_nonzero(magnitude == infinity)) if infinity is not None else 0
        nan = bad - inf
        finite = magnitude[~flags]
        top = int(finite.max()) if finite.size else 0
    elif special is None:  # fnuz: NaN is the negative zero pattern
        np.equal(bits, _FNUZ_NAN, out=flags)
        nan = int(np.count_nonzero(flags))
        first_bad = int(np.argmax(flags)) if nan else None
    np.less(magnitude, normal, out=flags)
    small = int(np.count_nonzero(flags))  # zeros and subnormals (and fnuz NaNs)
    zero = subnormal = 0
    if small:
        zero_patterns = int(np.count_nonzero(magnitude == 0))
        subnormal = small - zero_patterns
        zero = zero_patterns - (nan if special is None else 0)
    largest = float(as_float64(np.array([top], dtype=view), dtype)[0]) if count > nan + inf else 0.0
    return BlockNumbers(count, nan, inf, first_bad, zero, subnormal, largest)


def _magnitude_range(bits: np.ndarray, mask: int) -> tuple[int, int]:
    """Return the least and the largest magnitude (bits & mask) of the elements, from the
    min and max of their bits read as unsigned and as signed integers, without writing a
    magnitude array: unsigned, the non-negative elements are the low half, their magnitudes
    as they are; signed, the negative ones are below zero, their magnitude their value plus
    the sign bit's weight.

    Example:
        >>> _magnitude_range(np.array([0x3F80, 0xC000, 0x0001], dtype="<u2"), 0x7FFF)   # 1.0, -2.0, 1 ulp
        (1, 16384)
    """
    unsigned_max, unsigned_min = int(bits.max()), int(bits.min())
    sign = mask + 1
    if sign > unsigned_max:  # no sign bit set (or a format without one: float8_e8m0fnu)
        return unsigned_min, unsigned_max
    signed = bits.view(bits.dtype.str.replace("u", "i"))
    negative_low, negative_top = int(signed.min()) + sign, unsigned_max - sign
    if unsigned_min >= sign:  # every element negative
        return negative_low, negative_top
    return min(unsigned_min, negative_low), max(int(signed.max()), negative_top)
