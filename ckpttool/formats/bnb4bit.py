"""bitsandbytes' 4-bit weights (QLoRA's `Params4bit`), in one place: the state-dict entries a
quantised weight saves, its packed quant state, and dequantisation as bitsandbytes computes it.

`Linear4bit._save_to_state_dict` saves the weight `W` packed (two 4-bit codes a byte, high
nibble first, flattened to (bytes / itemsize, 1) in its quant_storage dtype) and beside it
(`QuantState.as_dict(packed=True)`): `W.absmax` (float32 per block, or uint8 with double
quantisation: `W.nested_absmax`, `W.nested_quant_map`), `W.quant_map` (the 16 code values) and
`W.quant_state.bitsandbytes__<nf4|fp4>`, a uint8 tensor holding JSON (quant_type, blocksize,
dtype, shape, nested_blocksize, nested_dtype, nested_offset). `dequantize` computes what
`bitsandbytes.functional.dequantize_4bit` does in its reference implementation
(backends/default/ops.py `_dequantize_4bit_compute`, `_dequantize_blockwise_compute`): the
saved quant_map's value for each code times its block's absmax, one float32 multiply, then a
cast to the original dtype; the same on every CPU. bitsandbytes 0.50.2's CPU kernel (csrc/cpu_ops.cpp
`dequantizeBlockwise4bitCpu`, what `dequantize_4bit` runs on CPU) does the same multiply from
its own table, and agrees bit for bit when a row holds whole blocks (as in real models), with
one exception of its own: fp4's code 8 (the sign bit alone, 0.0 in the quant_map) is +0.0 in the
table of its AVX-512 path (a CPU with AVX-512F, rows a multiple of 16) and -0.0 in its scalar
path's (other CPUs, other rows) and on CUDA. We follow the quant_map (+0.0): one answer on
every machine, equal in value to each of theirs. For rows shorter than a block (e.g. 32 values
with blocksize 64) the AVX-512 path gives other values, about 3x further from the original
weights than the reference implementation and this one.

Example:
    >>> quantised_weights(["fc.weight", "fc.weight.absmax", "fc.weight.quant_map",
    ...                    "fc.weight.quant_state.bitsandbytes__nf4"])
    {'fc.weight': ('fc.weight.absmax', 'fc.weight.quant_map', 'fc.weight.quant_state.bitsandbytes__nf4')}
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping

from ckpttool.core.errors import CorruptBlob

STATE_SUFFIXES = (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")  # QuantState.valid_qs_type_keys
SIBLINGS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
DTYPES = ("float32", "float16", "bfloat16")  # what dequantize_4bit restores
MAX_STATE_BYTES = 1 << 16


def quantised_weights(keys: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Return {weight key: its quant-state keys present} for each 4-bit weight among `keys`."""
    keys = set(keys)
    found = {}
    for key in sorted(keys):
        for suffix in STATE_SUFFIXES:
            if key.endswith(suffix):
                weight = key[: -len(suffix)]
                if weight in keys:
                    found[weight] = tuple(weight + s for s in SIBLINGS if weight + s in keys) + (key,)
    return found


def read_state(data: bytes, where: str) -> dict[str, Any]:
    """Return the packed quant state's JSON fields, checked; CorruptBlob naming `where` otherwise."""
    try:
        if len(data) > MAX_STATE_BYTES:
            raise ValueError("too long")
        state = json.loads(data.decode("utf-8"))
        shape = tuple(int(size) for size in state["shape"])
        blocksize = int(state["blocksize"])
        if state["quant_type"] not in ("nf4", "fp4") or state["dtype"] not in DTYPES or blocksize <= 0:
            raise ValueError("unknown quant_type, dtype or blocksize")
        if "nested_blocksize" in state and (int(state["nested_blocksize"]) <= 0 or state.get("nested_dtype") not in DTYPES):
            raise ValueError("bad nested state")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as error:
        raise CorruptBlob(f"{where}: not a bitsandbytes quant state ({type(error).__name__}: {error})") from None
    return {**state, "shape": shape, "blocksize": blocksize}


def dequantize(torch: Any, packed: Any, tensors: Mapping[str, Any], state: Mapping[str, Any], dtype: str,
               where: str) -> Any:
    """Return the weight `packed` holds, in `dtype`, as bitsandbytes' reference dequantize_4bit computes it.

    `tensors` holds the sibling entries by suffix (`absmax`, `quant_map`, `nested_absmax`,
    `nested_quant_map`)."""
    shape, blocksize = state["shape"], state["blocksize"]
    count = math.prod(shape)
    codes = packed.reshape(-1).view(torch.uint8)
    blocks = -(-count // blocksize)
    absmax = tensors.get("absmax")
    code = tensors.get("quant_map")
    if absmax is None or code is None or code.numel() != 16 or codes.numel() * 2 < count or absmax.numel() < blocks:
        raise CorruptBlob(f"{where}: the packed weight, absmax and quant_map do not fit shape {list(shape)}")
    if "nested_blocksize" in state:  # double quantisation: absmax itself blockwise-quantised to uint8
        nested, nested_code = tensors.get("nested_absmax"), tensors.get("nested_quant_map")
        if nested is None or nested_code is None or absmax.dtype != torch.uint8 or nested_code.numel() != 256:
            raise CorruptBlob(f"{where}: double-quantised absmax without nested_absmax/nested_quant_map")
        absmax = _blockwise(torch, absmax, nested, nested_code, int(state["nested_blocksize"]))
        absmax += torch.tensor(float(state["nested_offset"]))
    absmax = absmax.float()
    values = torch.empty(codes.numel() * 2, dtype=torch.int32)
    values[1::2] = codes & 0xF
    values[::2] = codes >> 4
    values = code.float()[values][:count]  # the checkpoint's own table, fp4's code 8 included (see the docstring)
    return _scale(torch, values, absmax, blocksize).reshape(shape).to(getattr(torch, dtype))


def _blockwise(torch: Any, quantised: Any, absmax: Any, code: Any, blocksize: int) -> Any:
    """bitsandbytes' dequantize_blockwise: code[q] * absmax[block], in float32."""
    values = code.float()[quantised.reshape(-1).to(torch.int64)]
    if absmax.numel() < -(-values.numel() // blocksize):
        raise CorruptBlob("nested_absmax has fewer blocks than absmax needs")
    return _scale(torch, values, absmax.float(), blocksize)


def _scale(torch: Any, values: Any, absmax: Any, blocksize: int) -> Any:
    count = values.numel()
    full = count - count % blocksize
    out = torch.empty(count, dtype=torch.float32)
    out[:full] = (values[:full].view(-1, blocksize) * absmax[: full // blocksize].view(-1, 1)).reshape(full)
    if full < count:
        out[full:] = values[full:] * absmax[full // blocksize]
    return out
