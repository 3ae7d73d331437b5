"""Keyed dropout masks: the same mask for the same call, in whatever order calls run.

Dropout draws its mask from torch's global generator, so a mask depends on how many
random numbers were drawn before it.  A pipeline runs the layers of micro-batch 3
before those of micro-batch 0 of a later stage, and tensor parallelism runs
attention per head group: the draws come in another order than on one device.

Inside ``with keyed(seed)``, a dropout call numbered ``k`` (``with site(k)``) draws
its mask from its own generator seeded by (seed, k), always for the *whole* batch,
and keeps the rows it holds (``with rows(offset, total)``: a pipeline micro-batch);
the SPMD dropout rule then keeps each rank's slice.  So every layout draws one
device's mask for its slice (Megatron-LM keeps per-region seeds for the same reason:
its "model-parallel RNG tracker").  :func:`context` / :func:`restore` carry the keys
into recomputation during backward.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["keyed", "site", "rows", "context", "restore", "is_keyed", "draw_mask"]

_KEY = contextvars.ContextVar("wb_dropout_key", default=None)     # the step's seed
_SITE = contextvars.ContextVar("wb_dropout_site", default=None)   # which dropout call
_ROWS = contextvars.ContextVar("wb_dropout_rows", default=None)   # (offset, total) rows


@contextlib.contextmanager
def _set(var, value):
    tok = var.set(value)
    try:
        yield
    finally:
        var.reset(tok)


def keyed(seed: int):
    """Draw every mask inside from (seed, site) instead of the global generator."""
    return _set(_KEY, int(seed))


def site(k: int):
    """The dropout call(s) inside are call number ``k`` of the model."""
    return _set(_SITE, int(k))


def rows(offset: int, total: int):
    """The batch inside holds rows [offset, offset + B) of a batch of ``total`` rows."""
    return _set(_ROWS, (int(offset), int(total)))


def context() -> tuple:
    """The current (key, site, rows): give it to :func:`restore` when recomputing."""
    return _KEY.get(), _SITE.get(), _ROWS.get()


@contextlib.contextmanager
def restore(ctx: tuple):
    with _set(_KEY, ctx[0]), _set(_SITE, ctx[1]), _set(_ROWS, ctx[2]):
        yield


def is_keyed() -> bool:
    return _KEY.get() is not None


def draw_mask(shape, p: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """The mask ATen's CPU dropout draws for a tensor of ``shape`` (scaled by 1/(1-p));
    keyed (see :func:`keyed`): the rows of the whole batch's mask this call holds.
    On the meta device (a dry run) only its shape."""
    if p >= 1:
        return torch.zeros(shape, dtype=dtype, device=device)
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    key = _KEY.get()
    if key is None:
        return torch.empty(shape, dtype=dtype).bernoulli_(1 - p).div_(1 - p)
    k = _SITE.get()
    if k is None:
        raise RuntimeError("a keyed dropout call outside `with site(k)`: every call needs "
                           "its own site number")
    offset, total = _ROWS.get() or (0, shape[0])
    g = torch.Generator().manual_seed((key * 1_000_003 + k) % 2**63)
    full = torch.empty((total,) + tuple(shape[1:]), dtype=dtype)
    full.bernoulli_(1 - p, generator=g).div_(1 - p)
    return full[offset:offset + shape[0]]
