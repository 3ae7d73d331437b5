"""Dtype names the modeled clock prices: canonical keys for torch dtypes and strings."""
from __future__ import annotations

__all__ = ["dtype_name", "is_integer_dtype", "INTEGER_DTYPES"]

# Spellings accepted for a dtype; torch dtypes arrive as "torch.float16" etc.
_DTYPE_ALIASES = {
    "float64": "float64", "double": "float64", "fp64": "float64", "f64": "float64",
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
    # FP8 (either format: the H100 runs E4M3 and E5M2 at one tensor-core rate)
    "float8": "float8", "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "short": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}
INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")


def dtype_name(dtype) -> str:
    """Canonical dtype key ("float64", "float32", "tf32", "bfloat16", "float16", "float8",
    "int64", "int32", "int16", "int8", "uint8", "bool") for a torch dtype or a
    string such as "bf16" / "torch.half"."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype={dtype!r} is not a dtype the clock can price; use one of "
                         f"{sorted(set(_DTYPE_ALIASES.values()))} "
                         f"(or a torch dtype such as torch.bfloat16)")
    return _DTYPE_ALIASES[key]


def is_integer_dtype(dtype) -> bool:
    """True for integer and bool dtypes (priced on the float32 vector rate)."""
    return dtype_name(dtype) in INTEGER_DTYPES
