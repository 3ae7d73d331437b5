"""The one dispatch table: ``(op, backend) -> implementation``.

Backends:

* ``"reference"`` - the algorithm written for reading (FlashAttention-2's tiled
  online softmax, RMSNorm's formula, ...), with a hand-written backward;
* ``"unfused"``   - the textbook composition of plain torch ops, differentiated
  by autograd: every intermediate goes to memory (what fusion saves);
* ``"native"``    - PyTorch's fused kernels for the tensor's device (CPU, CUDA); where
  PyTorch has none (RMSNorm on a CPU or meta tensor), the reference, which keeps
  what the fused kernel keeps;
* ``"npu"``       - torch_npu's fused kernels on Ascend.

By default the backend is chosen per call: ``"npu"`` when an input lives on an
NPU (torch_npu is then necessarily loaded), else ``"native"``.  Override it,
for one block or as a setting::

    with wb.ops.use("reference"):
        y = wb.ops.rms_norm(x, w)        # the readable version
    wb.ops.use("unfused")                # from now on (a process-wide setting)
    wb.ops.use("auto")                   # back to automatic

The setting is a plain module global, not a ContextVar, on purpose: notebook
kernels may run each cell in a fresh context, which would silently drop a
ContextVar set in an earlier cell.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["BACKENDS", "register", "register_cost", "dispatch", "use", "current_backend",
           "backends", "op_names", "implementation"]

BACKENDS = ("reference", "unfused", "native", "npu")
_CHOICES = ("auto", *BACKENDS)

_TABLE: dict[tuple[str, str], Callable] = {}   # (op, backend) -> implementation
_COSTS: dict[str, Callable] = {}               # op -> its FLOP/byte counter (see cost.py)
_setting = "auto"


def register(op: str, *backends: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` implements ``op`` on each of ``backends``."""
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"register({op!r}, {b!r}): unknown backend; use one of {BACKENDS}")

    def deco(fn: Callable) -> Callable:
        for b in backends:
            if (op, b) in _TABLE:
                raise ValueError(f"register({op!r}, {b!r}): already registered as "
                                 f"{_TABLE[(op, b)].__qualname__}")
            _TABLE[(op, b)] = fn
        return fn
    return deco


def register_cost(op: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn(*op_args, **op_kwargs) -> OpCost`` counts ``op``'s work."""
    def deco(fn: Callable) -> Callable:
        _COSTS[op] = fn
        return fn
    return deco


def op_names() -> tuple[str, ...]:
    """Every op with at least one implementation, sorted."""
    return tuple(sorted({op for op, _ in _TABLE}))


def backends(op: str) -> tuple[str, ...]:
    """The backends ``op`` is implemented on, in :data:`BACKENDS` order."""
    return tuple(b for b in BACKENDS if (op, b) in _TABLE)


def implementation(op: str, backend: str) -> Callable:
    """The function registered for ``(op, backend)``; a clear KeyError if none."""
    try:
        return _TABLE[(op, backend)]
    except KeyError:
        if op not in op_names():
            raise KeyError(f"unknown op {op!r}; known ops: {', '.join(op_names())}") from None
        raise KeyError(f"op {op!r} has no {backend!r} implementation; it has "
                       f"{backends(op)}. Fix: wb.ops.use(one of those) or 'auto'") from None


def current_backend() -> str:
    """The setting: ``"auto"`` or a backend name forced with :class:`use`."""
    return _setting


def dispatch(op: str, tensors: Iterable[torch.Tensor]) -> Callable:
    """The implementation to run ``op`` on these input tensors."""
    backend = _setting
    if backend == "auto":
        backend = "npu" if any(t.device.type == "npu" for t in tensors) else "native"
    return implementation(op, backend)


class use:
    """Force a backend: as a setting (plain call) or for a ``with`` block.

    ``use(name)`` takes effect immediately; leaving a ``with use(name):`` block
    restores whatever was set before it.  ``name`` is ``"auto"`` or one of
    :data:`BACKENDS`.
    """

    def __init__(self, backend: str = "auto"):
        global _setting
        if backend not in _CHOICES:
            raise ValueError(f"wb.ops.use({backend!r}): unknown backend; use one of {_CHOICES}")
        self.backend, self._previous = backend, _setting
        _setting = backend

    def __enter__(self) -> "use":
        return self

    def __exit__(self, *exc) -> None:
        global _setting
        _setting = self._previous

    def __repr__(self) -> str:
        return f"use({self.backend!r})"
