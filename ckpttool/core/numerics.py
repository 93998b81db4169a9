"""Floating elements from their raw little-endian bytes, with numpy (no torch import): NaN/Inf
counts (`count_non_finite`, for validate --deep) and exact values (`as_float64`, for diff).

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
