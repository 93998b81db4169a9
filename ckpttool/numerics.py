"""Count NaN and Inf values in raw little-endian element bytes, with numpy (no torch import).

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
