"""Convolutions: ``F.conv1d`` / ``conv2d`` / ``conv3d`` and ``torch.convolution`` (aten's).

x (N, C_in, *spatial) or unbatched (C_in, *spatial), weight (C_out, C_in / groups, *k),
bias (C_out,). Per mesh dim (x, weight, bias -> y):

    R,     R,     R     -> R        every rank computes the same thing
    S(0),  R,     R     -> S(0)     data parallel: each rank convolves its own samples
                                    (PyTorch DTensor's rule, ``_ops/_conv_ops.py``); the
                                    weight's and bias's gradients are partial sums over
                                    the samples, all-reduced (traced) as they leave
    R,     S(0),  S(0)  -> S(c)     output channels split (groups == 1): each rank's
                                    filters see the whole input
    S(c),  S(1),  P     -> P(sum)   input channels split (groups == 1): y = sum over the
                                    channel blocks of conv(x_blk, w_blk), a partial sum;
                                    the bias is added on one rank only
    S(c),  S(0),  S(0)  -> S(c)     groups > 1, split along whole groups: each rank's
                                    groups read only its own input channels (offered when
                                    the ranks sharding channels divide ``groups``)
    P,     R,     P     -> P        linear in x: conv(a + b) = conv(a) + conv(b); the bias
                                    added once (P(sum), as matmul.py's linear)
    R,     P,     P     -> P        linear in the weight (P(avg) inputs are reduced first,
                                    as matmul's: a product of averaged parts on two mesh
                                    dims loses float32 digits to cancellation)
    S(spatial)                      not offered: a window reads its neighbours' rows (a
                                    halo exchange); the planner gathers the dim first

The backward is autograd's on the local tensors (``aten.convolution_backward``), so the
gradients need no rule: a replicated weight that meets per-rank samples is given per-rank
views whose gradient sum is the traced all-reduce (DTensor's ``Partial`` weight grad).

Cost (per rank, local shapes): 2 FLOPs per multiply-add, ``2 * N * C_out * prod(out) *
(C_in / groups) * prod(k)`` plus one add per output element for the bias (PyTorch's
``torch/utils/flop_counter.py``, ``conv_flop_count``); backward twice the forward's
multiply-adds (the input gradient is a transposed convolution of the same size, the
weight gradient another: ``flop_counter.conv_backward_flop``) plus the bias's sum.  The
clock prices it as a matmul (an implicit GEMM; ``op_class="matmul"``), backward as a
dgrad and a wgrad kernel (``pricing.SplitCost``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

__all__ = ["conv_rule", "conv_local"]

R = Replicate()
P = Partial("sum")


def _dims(x, k: int):
    """(batch dim or None, channel dim) of an input with ``k`` spatial dims."""
    if x.ndim == k + 2:
        return 0, 1
    return None, 0


def conv_rule(x, w, b=None, *, k, groups, **_):
    """conv: batch sharded -> S(0); output channels -> S(c); input channels -> P(sum);
    whole groups -> S(c); linear in x and in w; spatial dims whole."""
    bdim, cdim = _dims(x, k)
    has_b = b is not None
    opts = [((R, R, R), (R,), "replicated")]
    if bdim is not None and x.shape[bdim] > 1:
        opts.append(((Shard(bdim), R, R), (Shard(0),), "batch sharded: each rank its samples"))
    if groups == 1:
        if w.shape[0] > 1:
            opts.append(((R, Shard(0), Shard(0)), (Shard(cdim),),
                         "output channels sharded: each rank its filters"))
        if w.shape[1] > 1:
            opts.append(((Shard(cdim), Shard(1), P), (P,),
                         "input channels sharded: partial sums over channel blocks"))
    elif x.shape[cdim] > 1:
        opts.append(((Shard(cdim), Shard(0), Shard(0)), (Shard(cdim),),
                     "whole groups sharded: each rank its groups"))
    opts += [((P, R, P), (P,), "linear in x: partial stays partial (bias on one rank)"),
             ((R, P, P), (P,), "linear in the weight: partial stays partial")]
    if not has_b:
        opts = [(ins[:2] + (None,), outs, note) for ins, outs, note in opts]
    out = []
    for st in combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3):
        xs = st.inputs[0]
        if groups > 1:      # split along whole groups only: the ranks sharding channels
            n = math.prod(x.mesh.shape[i] for i, p in enumerate(xs) if p.is_shard(cdim))
            if groups % n:
                continue
        out.append(st)
    return out


# ---- the local op on stacked tensors --------------------------------------------------

def _same_on_every_rank(t, nd) -> bool:
    """One tensor for all ranks: every lead dim of size 1 or stride 0 (a replica's views)."""
    return t is None or all(t.shape[i] == 1 or t.stride(i) == 0 for i in range(nd))


def _first(t, nd):
    return None if t is None else t[(0,) * nd]


def conv_local(nd, ctx, x, w, b=None, *, k, stride, padding, dilation, groups):
    """The convolution of every rank's shard: the device axes folded into the batch when
    every rank has the same weight (one call), else the ranks side by side as groups of one
    grouped convolution (each rank's channels meet only its own filters)."""
    conv = (F.conv1d, F.conv2d, F.conv3d)[k - 1]
    batched = x.dim() - nd == k + 2
    lead = tuple(x.shape[:nd])
    if w.shape[nd] == 0:               # an empty block of output channels (uneven split)
        w1 = w.new_zeros(tuple(w.shape[:nd]) + (1,) + tuple(w.shape[nd + 1:]))
        y = conv_local(nd, ctx, x, w1, None, k=k, stride=stride, padding=padding,
                       dilation=dilation, groups=groups)
        keep = w.sum() + (b.sum() if b is not None else 0)     # the empty shards' graph
        return y.narrow(y.dim() - k - 1, 0, 0) + keep.to(y.dtype)
    if not batched:
        x = x.unsqueeze(nd)                                   # (lead, 1, C, *sp)
    if w.shape[nd + 1] == 0:           # an empty block of input channels (uneven split)
        x1 = x.new_zeros(tuple(x.shape[:nd + 1]) + (1,) + tuple(x.shape[nd + 2:]))
        w1 = w.new_zeros(tuple(w.shape[:nd + 1]) + (1,) + tuple(w.shape[nd + 2:]))
        y = conv_local(nd, ctx, x1, w1, b, k=k, stride=stride, padding=padding,
                       dilation=dilation, groups=1)
        # its contribution is zero; the sums of the empty shards keep them in the graph
        return y + (x.sum() + w.sum()).to(y.dtype) if batched else \
            y.squeeze(nd) + (x.sum() + w.sum()).to(y.dtype)
    g = x.shape[nd + 1] // w.shape[nd + 1]                    # this rank's groups
    if _same_on_every_rank(w, nd):
        bias = _first(b, nd) if _same_on_every_rank(b, nd) else None
        xf = x.reshape((math.prod(x.shape[:nd + 1]),) + tuple(x.shape[nd + 1:]))  # (lead*N, C, ..)
        y = conv(xf, _first(w, nd), bias, stride, padding, dilation, g)
        y = y.reshape(lead + (x.shape[nd],) + tuple(y.shape[1:]))        # (lead, N, Co, *sp')
    else:
        L = broadcast_shapes(lead, tuple(w.shape[:nd]),
                                   tuple(b.shape[:nd]) if b is not None else (1,) * nd)
        n = math.prod(L)
        xs = x.expand(L + tuple(x.shape[nd:])).reshape((n,) + tuple(x.shape[nd:]))
        N, C = xs.shape[1], xs.shape[2]
        xg = xs.transpose(0, 1).reshape((N, n * C) + tuple(xs.shape[3:]))  # (N, n*C, *sp)
        ws = w.expand(L + tuple(w.shape[nd:])).reshape((-1,) + tuple(w.shape[nd + 1:]))
        bias = None
        if b is not None and _same_on_every_rank(b, nd):
            bias = _first(b, nd).repeat(n)
        yg = conv(xg, ws, bias, stride, padding, dilation, g * n)            # (N, n*Co, *sp')
        # C_out spelled out: -1 is ambiguous for an empty batch (N = 0, seed 2004087 wide)
        y = yg.reshape((N, n, yg.shape[1] // n) + tuple(yg.shape[2:])).transpose(0, 1)
        y = y.reshape(L + tuple(y.shape[1:]))                               # (L, N, Co, *sp')
    if b is not None and not _same_on_every_rank(b, nd):      # a per-rank (partial) bias
        y = y + b.reshape(tuple(b.shape[:nd]) + (1, b.shape[-1]) + (1,) * k)
    if not batched:
        y = y.squeeze(nd)
    return y


# ---- parsing, cost, registration ----------------------------------------------------------

def _tuple(v, k, name, op):
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * k
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in v):
        return tuple(v) if len(v) == k else (tuple(v) * k if len(v) == 1 else tuple(v))
    raise TypeError(f"{op}: {name}={v!r}; give an int or a tuple of {k} ints")


def _parse_for(k):
    op = f"conv{k}d"

    def parse(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if weight.dim() >= 2 and weight.shape[1] == 0:
            # torch 2.13 returns (N, 0, *spatial) for no input channel (no kernel runs), not
            # (N, C_out, ...) of zeros: the local implementation's shape differed and the
            # dispatcher raised 'op table bug' (AssertionError; sweep15): refused
            raise NotImplementedError(
                f"{op} with no input channel (weight {tuple(weight.shape)}) on DistTensors: "
                "torch gives an output of no channel there, which the rule does not "
                "reproduce; call it on the global tensors (.full())")
        pad = padding if isinstance(padding, str) else _tuple(padding, k, "padding", op)
        return (input, weight, bias), {
            "k": k, "stride": _tuple(stride, k, "stride", op), "padding": pad,
            "dilation": _tuple(dilation, k, "dilation", op), "groups": int(groups)}
    return parse


def _convolution_cpu_check(input, weight, bias, k, stride, padding, dilation, groups):
    """torch.convolution's CPU kernels' dtype checks, on stand-ins of one element per
    group (shapes that always fit, the dilation kept: it picks the kernel): aten's
    convolution has no complex path where F.conv1d/2d/3d has one (torch 2.13 CPU:
    NotImplementedError '"slow_conv2d_cpu" / "slow_conv_dilated<>" / "compute_columns3d"
    not implemented for ComplexDouble'; the local implementation's F.convNd returned a
    result: sweep15 focus seed 5000513), and a complex input by a float64 weight raised
    F.conv1d's RuntimeError instead of torch's NotImplementedError."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or \
            len(dilation) not in (1, k):
        return None               # the meta check names what is wrong
    if input.numel() == 0:
        # torch runs no kernel for an input of no element: no dtype check, and its output
        # takes the weight's dtype where they differ (int64 by float64: float64, where the
        # meta kernel says int64; focus seed 5000970 raised torch's dtype error where
        # torch runs): torch's own call on zeros of no element and an expanded weight
        # (nothing computed) gives its dtype
        try:
            out = torch.convolution(
                torch.zeros(tuple(input.shape), dtype=input.dtype),
                torch.zeros((), dtype=weight.dtype).expand(tuple(weight.shape)),
                None if bias is None else torch.zeros((), dtype=bias.dtype).expand(
                    tuple(bias.shape)), stride, padding, dilation, False, [0] * k, groups)
        except Exception:  # noqa: BLE001 - a shape error: the meta check raises it
            return None
        return out.dtype
    one = (1,) * k

    def z(t, shape):
        return None if t is None else torch.zeros(shape, dtype=t.dtype)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.convolution(z(input, (1, groups) + one), z(weight, (groups, 1) + one),
                          z(bias, (groups,)), [1] * k, [0] * k, dilation * k
                          if len(dilation) == 1 else dilation, False, [0] * k, groups)
    return None


def _convolution_parse(input, weight, bias, stride, padding, dilation, transposed,
                       output_padding, groups):
    """``torch.convolution`` (aten.convolution): a forward convolution only."""
    if transposed:
        raise NotImplementedError(
            "torch.convolution(transposed=True) on DistTensors: transposed convolutions "
            "have no rule yet; gather the input (.full()) or run inside "
            "`with workbench.allow_replicate_fallback():`")
    k = weight.dim() - 2
    if k not in (1, 2, 3):
        raise ValueError(f"torch.convolution: weight of shape {tuple(weight.shape)}; give "
                         "(C_out, C_in / groups, *kernel) with 1 to 3 kernel dims")
    dt = _convolution_cpu_check(input, weight, bias, k, list(stride), list(padding),
                                list(dilation), groups)
    if dt is not None and dt != input.dtype:
        # torch's CPU result and its meta kernel disagree (the dispatcher holds the local
        # implementation to the meta kernel): refused, naming the fix
        raise NotImplementedError(
            f"torch.convolution of an input of no element ({input.dtype}) by a "
            f"{weight.dtype} weight on DistTensors: torch's CPU call gives {dt}, its meta "
            f"kernel {input.dtype}; cast one to the other's dtype first "
            f"(input.to({weight.dtype}))")
    return _parse_for(k)(input, weight, bias, list(stride), list(padding), list(dilation),
                         groups)


def conv_cost(ins, outs, *, k, groups, **_):
    """2 N C_out prod(out) (C_in / groups) prod(kernel) (+ the bias); backward 2 x the
    convolution (dgrad + wgrad) + the bias's sum (module docstring)."""
    x, w, b = ins
    y = outs[0]
    macs = y.numel() * math.prod(w.shape[1:])      # N C_out prod(out) * (C_in/g) prod(k)
    bias = y.numel() if b is not None else 0
    saved = costs.nbytes(x) + costs.nbytes(w)
    fwd = sum(costs.nbytes(t) for t in ins if t is not None) + costs.nbytes(y)
    return costs.Cost(2 * macs + bias, fwd, 4 * macs + bias,
                      costs.backward_bytes(ins, outs, saved))


def _sample(fn, k):
    sp = (7, 6, 5)[:k] if k < 3 else (4, 3, 3)
    kern = (3,) * k if k < 3 else (2,) * 3    # conv3d: 32 products a sum, as conv2d's 36
    # (more lose float32 digits to the validator's deliberately unequal partial parts)

    def make(g):
        return [Sample(fn, (g.rn(5, 4, *sp), g.rn(6, 4, *kern), g.rn(6)),
                       {"padding": 1}),
                Sample(fn, (g.rn(5, 4, *sp), g.rn(4, 2, *(2,) * k)),
                       {"stride": 2, "groups": 2})]
    return make


for _k, _fn in ((1, F.conv1d), (2, F.conv2d), (3, F.conv3d)):
    register(f"conv{_k}d", [_fn], parse=_parse_for(_k), rule=conv_rule, local=conv_local,
             cost=conv_cost, op_class="matmul", sample=_sample(_fn, _k))
register("convolution", [torch.convolution], parse=_convolution_parse, rule=conv_rule,
         local=conv_local, cost=conv_cost, op_class="matmul",
         sample=lambda g: [Sample(torch.convolution,
                                  (g.rn(5, 4, 7, 6), g.rn(6, 4, 3, 3), g.rn(6), [1, 1], [1, 1],
                                   [1, 1], False, [0, 0], 1))])
