"""Dropout whose sharded result equals one device's, bit for bit.

Dropout (Srivastava et al. 2014) multiplies by a random mask scaled by 1/(1-p).
ATen's CPU kernel draws the mask for the whole tensor from the global generator:

    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)      # then x * noise

(``torch.manual_seed(s); F.dropout(x, p)`` equals this bitwise; tests check it).
So the sharded op draws the mask for the GLOBAL shape in the same way, once,
and each rank keeps the slice of it that matches its shard: the mask enters the
op as one more replicated input that the rule slices like ``x`` (a local slice,
no traffic).  The generator advances exactly as on one device, so the random
numbers of later ops match too.  (On real devices each rank would draw the
global mask from the same seed and keep its slice, as Megatron's "tensor-model-
parallel RNG tracker" does for the parts it wants identical across ranks.)

Per mesh dim (x, mask -> y), with the mask fixed, dropout is x * mask:

    R,      R    -> R        every rank draws and applies the same mask
    S(d),   S(d) -> S(d)     elementwise: each shard meets its slice of the mask
    P(sum), R    -> P(sum)   linear in x for a fixed mask:
                             sum_i(x_i) * m = sum_i(x_i * m)     (and the same for avg)
    P(max), R    -> not valid, reduced first: m >= 0 keeps the order, but a rank that
                             holds max's identity -inf gives -inf * 0 = nan where dropped

Known, not matched (inplace15): a dropped element of a P(sum) value is the sum of its
parts times 0, +0 where the parts' signs differ, where one device's is v * 0, -0 for
v < 0 (signbit differs there; == holds).  Matching it needs the sum before the mask (an
all-reduce DTensor would need too: its native_dropout refuses a Partial input,
torch/distributed/tensor/_ops/_random_ops.py ``random_op_strategy``); the partial passes
instead (tests/test_inplace15.py pins where the signs may differ).  The same holds of any
Partial(sum) whose value is -0 (parts that cancel: r + (-r) is +0).

Keyed masks (:func:`workbench.sim_mesh.rng.keyed`): inside ``with keyed(seed)`` and ``with site(k)``, a
call draws its mask from its own generator, seeded by (seed, k), for the *whole*
batch, and keeps the rows it holds (``with rows(offset, total)``: a pipeline
micro-batch).  So a mask no longer depends on the order in which the calls run:
a pipeline that runs micro-batch 3 of layer 5 before micro-batch 0 of layer 1
draws the same masks as one device running the whole batch layer by layer
(what Megatron's model-parallel RNG tracker does with per-region seeds).
:func:`~workbench.sim_mesh.rng.context` captures the keys so that recomputation in backward redraws them.

``training=False`` or ``p == 0`` is the identity: every placement passes
unchanged and no random number is drawn (as in ATen).  ``p == 1`` gives
``x * 0`` without drawing (as in ATen).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...sim_mesh.rng import draw_mask
from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import align as _align
from .strategy import combine
from .table import add_funcs, register

R = Replicate()


def dropout_rule(x, mask=None, **_):
    """dropout: the mask (drawn for the global shape) is sliced like x; P(sum) passes."""
    if mask is None:                                   # identity: every placement passes
        return combine(x.mesh.ndim, [[((p, None), (p,), "identity (no dropout)")]
                                     for p in x.placements], 2)
    opts = [((R, R), (R,), "replicated: the same mask everywhere")]
    for d in range(x.ndim):
        if x.shape[d] > 1:
            opts.append(((Shard(d), Shard(d)), (Shard(d),),
                         f"elementwise: dim {d} sharded, each shard keeps its slice of the mask"))
    for op in ("sum", "avg"):
        opts.append(((Partial(op), R), (Partial(op),),
                     f"linear in x for a fixed mask: P({op}) passes"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 2)


class _KeepMask(torch.autograd.Function):
    """x * mask, keeping for backward only which elements were kept: a one-byte bool
    tensor, as ATen's ``native_dropout`` (and Megatron, Korthikanti et al. 2022 Table 2's
    "dropout mask, sbh") keep, not the scaled mask in x's dtype.  The gradient is
    grad * mask, bit for bit: the kept value is 1 / (1 - p) rounded like the mask's."""

    @staticmethod
    def forward(ctx, x, mask, p):
        ctx.save_for_backward(mask != 0)
        ctx.scale = torch.ones((), dtype=mask.dtype).div_(1 - p)    # as draw_mask rounds it
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        scale = ctx.scale.to(keep.device)
        return torch.where(keep, scale, torch.zeros((), dtype=scale.dtype,
                                                   device=keep.device)) * grad, None, None


def _dropout_local(nd, ctx, x, mask=None, p=None):
    if mask is None:
        return x
    x, mask = _align(nd, x, mask)
    if p is None or p >= 1 or not torch.is_grad_enabled() or not x.requires_grad:
        return x * mask
    return _KeepMask.apply(x, mask, p)


def _parse(x, p=0.5, training=True, inplace=False):
    if inplace:
        raise NotImplementedError("dropout(inplace=True) on a DistTensor: DistTensors are "
                                  "not modified in place; use inplace=False")
    if not 0 <= p <= 1:
        raise ValueError(f"dropout: p={p}; it must be in [0, 1]")
    if not training or p == 0 or x.numel() == 0:
        return (x, None), {}
    # drawn here, once per call, for the global shape (never per rank)
    meta = x.device.type == "meta"                    # a dry run: shapes, no data
    return (x, draw_mask(tuple(x.shape), float(p), x.dtype, "meta" if meta else None)), \
        {"p": float(p)}


_MASKED = costs.elementwise(1)


def _cost(ins, outs, **attrs):
    """x * mask: 1 FLOP an element; no mask (``p == 0``, ``training=False`` or an empty x)
    is the identity, which runs no kernel: ATen's ``dropout`` returns its input there
    (aten/src/ATen/native/Dropout.cpp, ``_dropout_impl``: ``if (p == 0 || !train ||
    input.sym_numel() == 0) return input;``, and the fused path only for 0 < p < 1)."""
    if "p" not in attrs:
        return costs.view(ins, outs)
    return _MASKED(ins, outs, **attrs)


def _torch_dropout_parse(x, p, train):
    return _parse(x, p, train)


# dropout = x * mask, the mask drawn once for the global shape (an input): 1 FLOP per element
register("dropout", [F.dropout], parse=_parse, rule=dropout_rule, local=_dropout_local,
         cost=_cost, op_class="elementwise",
         sample="random (the validator compares deterministic ops)")
add_funcs("dropout", [torch.dropout], _torch_dropout_parse)
