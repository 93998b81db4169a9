"""Dtype names as torch spells them, their item sizes, and their names in other formats.

Kept free of torch so that metadata-only commands never import it.
"""

from __future__ import annotations

# torch dtype name -> bytes per element
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

FLOATING = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
     "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
)

# Aliases torch accepts for the same dtype (torch.float is float32, ...)
ALIASES: dict[str, str] = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64",
    "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
    "chalf": "complex32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
    "fp64": "float64",
}

# Legacy typed-storage class names that torch.save writes (torch/storage.py
# `_dtype_to_storage_type_map`); newer dtypes are saved as UntypedStorage + dtype.
STORAGE_CLASS_DTYPE: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}

# safetensors dtype codes (safetensors format spec)
SAFETENSORS_NAME: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
FROM_SAFETENSORS_NAME: dict[str, str] = {v: k for k, v in SAFETENSORS_NAME.items()}


def canonical(name: str) -> str:
    """Return the torch spelling of a dtype name (`bf16` -> `bfloat16`), or raise KeyError."""
    name = name.removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise KeyError(name)
    return name
