"""Pooling: ``F.max_pool1d`` / ``max_pool2d``, ``F.avg_pool1d`` / ``avg_pool2d``,
``F.adaptive_avg_pool1d`` / ``adaptive_avg_pool2d``.

x (N, C, *spatial) or unbatched (C, *spatial); every (sample, channel) plane is pooled on
its own. Per mesh dim (x -> y):

    R            -> R
    S(0), S(c)   -> the same      batch or channel sharded: each rank pools its own planes
    P(sum/avg)   -> the same      average pooling is linear: avg(a + b) = avg(a) + avg(b)
    P(max)       -> P(max)        max pooling: max over a window of max_i a_i = max_i of
                                  the windows' maxima
    S(spatial)                    not offered: a window straddles shard edges (a halo), and
                                  an adaptive pool's bins depend on the whole size; the
                                  planner gathers the dim first

The backward is autograd's on the local tensors (``max_pool2d_with_indices_backward``,
``avg_pool2d_backward``): no rule needed.  ``return_indices=True`` is not supported (the
indices would be a second output): it raises, naming the fix.

Cost per rank (a compare or an add counts 1 FLOP, ``costs.py``): max pooling
``out.numel() * prod(kernel)`` compares, average pooling as many adds plus one divide per
output; an adaptive average adds every input element once into its bin (exact when the
output size divides the input's; overlapping bins are not counted twice) and divides per
output.  Forward bytes: the input read, the output written; backward 2 x forward FLOPs
(the convention of ``costs.py``), reading the output gradient (and max pooling's int64
indices, which it saves) and writing the input gradient.
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

__all__ = ["pool_rule"]

R = Replicate()


def pool_rule(x, *, k, kind, **_):
    """Pooling: batch and channel shards pass, spatial dims whole; P(sum/avg) pass average
    pooling (linear), P(max) passes max pooling."""
    lead = x.ndim - k                              # (N, C) or (C,)
    opts = [((R,), (R,), "replicated")]
    for d in range(lead):
        if x.shape[d] > 1:
            what = "channel" if d == lead - 1 else "batch"
            opts.append(((Shard(d),), (Shard(d),), f"{what} dim {d} sharded: planes pass"))
    ops = ("max",) if kind == "max" else ("sum", "avg")
    dt = getattr(x, "dtype", None)
    if kind != "max" and dt is not None and not (dt.is_floating_point or dt.is_complex):
        ops = ()        # an integer average rounds each part: not linear (seed 2006018 wide)
    opts += [((Partial(op),), (Partial(op),), f"P({op}) passes {kind} pooling") for op in ops]
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 1)


def _pool_local(nd, ctx, x, *, k, kind, fn, args):
    """The pool of every rank's planes: device axes folded into the batch (one call)."""
    if nd == 0:
        return fn(x, *args)
    lead = tuple(x.shape[:nd])
    c = x.dim() - k - 1                                                # the channel dim
    if x.numel() == 0:             # an empty shard (uneven split): torch's pools refuse it
        return empty_like_op(x, c, lambda t: fn(t, *args)) if nd else fn(x, *args)
    xf = x.reshape((math.prod(x.shape[:c]),) + tuple(x.shape[c:]))     # (lead * N, C, *sp)
    y = fn(xf, *args)
    return y.reshape(lead + tuple(x.shape[nd:x.dim() - k]) + tuple(y.shape[2:]))


def empty_like_op(x, c, fn):
    """``fn`` of an empty shard (no channels, or no samples): an empty tensor of the shape
    ``fn`` gives (run on no sample of at least one channel: torch's own kernel, so that its
    checks of an empty input are torch's, ``avg_pool`` refusing a bool or integer input
    where ``adaptive_avg_pool`` returns it), in ``x``'s graph and in the dtype ``fn``
    gives (``x.sum()``, an int64 for those, must not promote it)."""
    probe = [max(n, 1) for n in x.shape]
    y = fn(torch.empty((0, *probe[c:]), dtype=x.dtype))
    shape = tuple(x.shape[:c + 1]) + tuple(y.shape[2:])
    return x.new_zeros(shape, dtype=y.dtype) + x.sum().to(y.dtype)


def _tuple(v, k, name, op):
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * k
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in v):
        return tuple(v)
    raise TypeError(f"{op}: {name}={v!r}; give an int or a tuple of {k} ints")


def _max_parse(k):
    op = f"max_pool{k}d"
    fn = (torch.max_pool1d, torch.max_pool2d)[k - 1]

    def parse(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
              return_indices=False):
        if return_indices:
            raise NotImplementedError(
                f"{op}(return_indices=True) on DistTensors: the indices are not supported "
                "(a second output); use return_indices=False, or gather the input (.full())")
        ks = _tuple(kernel_size, k, "kernel_size", op)
        st = _tuple(stride, k, "stride", op)
        args = (ks, st if st else ks, _tuple(padding, k, "padding", op),
                _tuple(dilation, k, "dilation", op), bool(ceil_mode))
        return (input,), {"k": k, "kind": "max", "fn": fn, "args": args}
    return parse


def _avg_parse(k):
    op = f"avg_pool{k}d"
    fn = (F.avg_pool1d, F.avg_pool2d)[k - 1]

    def parse(input, kernel_size, stride=None, padding=0, ceil_mode=False,
              count_include_pad=True, divisor_override=None):
        if k == 1 and divisor_override is not None:
            raise TypeError("avg_pool1d() got an unexpected keyword argument "
                            "'divisor_override'")
        ks = _tuple(kernel_size, k, "kernel_size", op)
        st = _tuple(stride, k, "stride", op)
        args = (ks, st if st else ks, _tuple(padding, k, "padding", op), bool(ceil_mode),
                bool(count_include_pad)) + ((divisor_override,) if k == 2 else ())
        return (input,), {"k": k, "kind": "avg", "fn": fn, "args": args}
    return parse


def _adaptive_parse(k):
    fn = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d)[k - 1]

    def parse(input, output_size):
        if k == 2:
            os = (output_size,) * 2 if isinstance(output_size, int) else tuple(output_size)
            if any(s is None for s in os):          # None keeps the input's size there
                os = tuple(input.shape[input.dim() - 2 + i] if s is None else s
                           for i, s in enumerate(os))
        else:
            os = _tuple(output_size, 1, "output_size", "adaptive_avg_pool1d")
        return (input,), {"k": k, "kind": "adaptive", "fn": fn, "args": (os,)}
    return parse


def pool_cost(ins, outs, *, k, kind, args, **_):
    """Compares (max) or adds and a divide (average) per window element (module doc)."""
    x, y = ins[0], outs[0]
    if kind == "adaptive":
        flops = x.numel() + y.numel()
    else:
        window = math.prod(args[0])
        flops = y.numel() * window + (y.numel() if kind == "avg" else 0)
    saved = y.numel() * 8 if kind == "max" else 0          # max pooling's int64 indices
    return costs.Cost(flops, costs.nbytes(x) + costs.nbytes(y), 2 * flops,
                      costs.backward_bytes(ins, outs, saved))


def _samples(fn, k, **kw):
    sp = (7, 6)[:k]
    return lambda g: [Sample(fn, (g.rn(5, 4, *sp),), kw)]


for _k in (1, 2):
    register(f"max_pool{_k}d", [(F.max_pool1d, F.max_pool2d)[_k - 1],
                                (torch.max_pool1d, torch.max_pool2d)[_k - 1]],
             parse=_max_parse(_k), rule=pool_rule, local=_pool_local, cost=pool_cost,
             op_class="reduction",
             sample=_samples((F.max_pool1d, F.max_pool2d)[_k - 1], _k, kernel_size=3,
                             stride=2, padding=1))
    register(f"avg_pool{_k}d", [(F.avg_pool1d, F.avg_pool2d)[_k - 1]], parse=_avg_parse(_k),
             rule=pool_rule, local=_pool_local, cost=pool_cost, op_class="reduction",
             sample=_samples((F.avg_pool1d, F.avg_pool2d)[_k - 1], _k, kernel_size=2,
                             padding=1, count_include_pad=False))
    register(f"adaptive_avg_pool{_k}d",
             [(F.adaptive_avg_pool1d, F.adaptive_avg_pool2d)[_k - 1]],
             parse=_adaptive_parse(_k), rule=pool_rule, local=_pool_local, cost=pool_cost,
             op_class="reduction",
             sample=_samples((F.adaptive_avg_pool1d, F.adaptive_avg_pool2d)[_k - 1], _k,
                             output_size=(3,) * _k))
