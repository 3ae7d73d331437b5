"""Argument checks shared by the ops: each error names the argument, the value, the fix."""
from __future__ import annotations

import numbers

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def floating(op: str, name: str, value) -> torch.Tensor:
    tensor(op, name, value)
    if value.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name}.dtype is {value.dtype}; use one of float16, bfloat16, "
                        f"float32, float64 (e.g. {name}.float())")
    return value


def same_dtype(op: str, **named: torch.Tensor) -> None:
    dtypes = {n: t.dtype for n, t in named.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}.dtype={d}" for n, d in dtypes.items())
        raise TypeError(f"{op}: inputs must share one dtype, got {listed}; cast them, "
                        f"e.g. with .to({next(iter(dtypes))}.dtype)")


def same_device(op: str, **named: torch.Tensor) -> None:
    devices = {n: t.device for n, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: inputs must be on one device, got {listed}; move them with .to()")


def broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """True when a tensor of ``shape`` broadcasts to exactly ``to``."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def scale(op: str, value) -> float:
    """``scale=`` as a float: a real number or a one-element floating tensor (``float()``
    alone would take the string "0.5" and raise "could not convert" on "a")."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
        isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point())
    if not ok:
        raise TypeError(f"{op}: scale={value!r}; give a float (or None for 1/sqrt(head_dim)), "
                        "as scaled_dot_product_attention takes")
    return float(value)
