"""NaN/Inf counting from raw element bytes agrees with torch's isnan/isinf for every floating
dtype ckpttool knows: every bit pattern of the 8- and 16-bit formats, special values of the
wider ones."""

from __future__ import annotations

import pytest
import torch

from ckpttool.core import dtypes, numerics


def test_every_floating_dtype_has_a_rule():
    assert dtypes.FLOATING <= numerics.SUPPORTED


def all_values(dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if size == 2:
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    specials = [1.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-310, 3e38]
    return torch.tensor(specials * 3 + [2.5] * 1000, dtype=dtype)


@pytest.mark.parametrize("name", sorted(numerics.SUPPORTED))
def test_counts_equal_torchs_isnan_and_isinf(name):
    values = all_values(getattr(torch, name))
    nan = int(torch.isnan(values).sum())
    try:
        inf = int(torch.isinf(values).sum())
    except NotImplementedError:  # formats without infinity
        inf = 0
    assert nan > 0
    data = values.view(torch.uint8).numpy().tobytes()
    assert numerics.count_non_finite(data, name) == (nan, inf)
    assert numerics.count_non_finite(memoryview(bytearray(data)), name) == (nan, inf)


def test_all_finite_data_is_zero_zero():
    assert numerics.count_non_finite(torch.ones(10).numpy().tobytes(), "float32") == (0, 0)
