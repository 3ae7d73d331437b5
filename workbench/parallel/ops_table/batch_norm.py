"""Batch normalization (Ioffe & Szegedy 2015): ``F.batch_norm`` and ``torch.batch_norm``.

x (N, C, *spatial), statistics per channel over the batch and every spatial position:

    y = (x - mean) / sqrt(var + eps) * weight + bias

Training (``training=True``) normalizes by the batch's own mean and biased variance and
updates the running statistics in place as torch does (``momentum * stat + (1 - momentum)
* running``, the variance unbiased, n / (n - 1)); evaluation normalizes by the running
statistics. Per mesh dim (x, running_mean, running_var, weight, bias -> y):

    training
    R,    -, -, R,    R    -> R      every rank normalizes the whole batch
    S(d), -, -, R,    R    -> S(d)   d the batch or a spatial dim: the statistics are GLOBAL,
                                     as SyncBatchNorm computes them: the per-channel sum is
                                     all-reduced (the mean), then the sum of squared
                                     deviations (the variance); two all-reduces of C floats
                                     inside the op (and their two in backward, autograd's).
                                     Offered on even shards (collectives need every rank's
                                     shard at once); uneven, x is gathered instead
    S(1), -, -, S(0), S(0) -> S(1)   channels split: each rank's channels' statistics are
                                     its own
    P                                not valid: the statistics of a sum are not the sum of
                                     the statistics; the planner reduces first
    ("-": the running statistics stay as they are, since they are written in place: R on
    the mesh dims that do not split channels, S(0) on those that do; other layouts raise)

    evaluation: an affine map per channel
    R / S(d), R, R, R, R   -> R / S(d)   d not the channel dim: pass
    S(1), S(0) x 4         -> S(1)       channels split with their statistics

Cost per element (the counting of ``norm.py``'s layer_norm): training 7 FLOPs (mean,
subtract, square, mean, multiply by rstd, * w, + b; the per-channel update of the running
statistics not counted), evaluation 4 (subtract, multiply by rstd, * w, + b); backward
2 x forward (``costs.py``), saving x and a float32 mean and rstd per channel.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...sim_mesh import collectives as C
from .. import layout
from ..placement import Replicate, Shard, fmt_placements
from . import costs
from ._util import check_number
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["batch_norm_rule", "affine_eval", "per_channel"]

R = Replicate()


def _stat_req(spec, i, channels_split):
    """What running statistic ``spec`` must be on mesh dim ``i``: its own placement, which
    must be R (channels whole there) or S(0) (channels split); None if absent."""
    if spec is None:
        return None
    p = spec.placements[i]
    if p == (Shard(0) if channels_split else R):
        return p
    return False


def batch_norm_rule(x, rm=None, rv=None, w=None, b=None, *, training, **_):
    """batch_norm: batch / spatial shards -> global statistics all-reduced inside (training)
    or passed (evaluation); channel shards pass with their per-channel tensors."""
    if x.ndim < 2:
        raise ValueError(f"batch_norm: input of shape {tuple(x.shape)}; give (N, C, *)")
    mesh = x.mesh
    per_dim = []
    for i in range(mesh.ndim):
        opts = []
        for d in [None] + [d for d in range(x.ndim) if x.shape[d] > 1]:
            ch = d == 1
            xp = R if d is None else Shard(d)
            par = Shard(0) if ch else R
            if training:
                stats = [_stat_req(s, i, ch) for s in (rm, rv)]
                if any(s is False for s in stats):
                    continue
            else:
                stats = [None if s is None else par for s in (rm, rv)]
            ins = (xp, *stats, None if w is None else par, None if b is None else par)
            what = ("replicated" if d is None else "channels sharded: per-channel statistics"
                    if ch else f"dim {d} sharded: " + ("global statistics all-reduced"
                                                        if training else "passes"))
            opts.append((ins, (xp,), what))
        if not opts:
            raise ValueError(
                f"batch_norm(training=True): running statistics placed "
                f"{fmt_placements(rm.placements if rm is not None else rv.placements)} on "
                f"mesh dim {i}; they are updated in place, so give them Replicate(), or "
                "Shard(0) on the mesh dims that shard the input's channels (dim 1)")
        per_dim.append(opts)
    out = []
    for st in combine(mesh.ndim, per_dim, 5):
        xs = st.inputs[0]
        syncs = any(p.is_shard() and p.dim != 1 for p in xs)
        writes = training and rm is not None and any(p.is_shard(1) for p in xs)
        if (syncs or writes) and not layout.is_even(x.shape, mesh, xs):
            continue                 # collectives / in-place writes need every rank's shard
        out.append(st)
    return out


# ---- local functions on stacked tensors ---------------------------------------------------

def per_channel(t, nd, ndim_local):
    """A per-channel tensor (lead..., C) shaped to meet x (lead..., N, C, *spatial)."""
    return t.reshape(tuple(t.shape[:nd]) + (1, t.shape[-1]) + (1,) * (ndim_local - 2))


def affine_eval(nd, x, rm, rv, w, b, eps):
    """(x - running_mean) / sqrt(running_var + eps) * w + b with per-rank channel tensors."""
    n = x.dim() - nd
    y = (x - per_channel(rm, nd, n)) * torch.rsqrt(per_channel(rv, nd, n) + eps)
    if w is not None:
        y = y * per_channel(w, nd, n)
    if b is not None:
        y = y + per_channel(b, nd, n)
    return y.to(x.dtype)


def _same(t, nd) -> bool:
    return t is None or all(t.shape[i] == 1 or t.stride(i) == 0 for i in range(nd))


def _one(t, nd):
    return None if t is None else t[(0,) * nd]


def _write(run, new, nd, momentum):
    """running = momentum * new + (1 - momentum) * running, in place, on the stored copy (a
    replica's per-rank views are stride-0: their first rank is the storage)."""
    idx = tuple(slice(0, 1) if run.shape[i] > 1 and run.stride(i) == 0 else slice(None)
                for i in range(nd))
    run = run[idx]
    new = new[tuple(slice(0, 1) if run.shape[i] == 1 else slice(None) for i in range(nd))]
    run.copy_(momentum * new.to(run.dtype) + (1 - momentum) * run)


def _batch_norm_local(nd, ctx, x, rm=None, rv=None, w=None, b=None, *, training, momentum,
                      eps):
    xspec = ctx.in_specs[0] if ctx is not None else None
    sync = [] if xspec is None else [i for i, p in enumerate(xspec.placements)
                                     if p.is_shard() and p.dim != 1]
    if x.numel() == 0:                 # an empty shard (uneven split): nothing to normalize
        return x.clone()
    plain = all(_same(t, nd) for t in (rm, rv, w, b))
    # torch's kernel on each rank's rows, the device axes folded into the batch: in
    # evaluation always; in training where no statistic needs the other ranks' rows and
    # each rank's channels are its own (one stacked rank, or one process per rank)
    alone = not sync and all(x.shape[i] == 1 for i in range(nd))
    if plain and (not training or alone):
        lead = tuple(x.shape[:nd])
        y = F.batch_norm(x.reshape((math.prod(x.shape[:nd + 1]),) + tuple(x.shape[nd + 1:])),
                         *(_one(t, nd) for t in (rm, rv, w, b)), training, momentum, eps)
        return y.reshape(x.shape)
    if not training:
        return affine_eval(nd, x, rm, rv, w, b, eps)
    n_loc = x.dim() - nd
    dims = (nd,) + tuple(range(nd + 2, x.dim()))
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x   # torch: opmath
    count = x[(0,) * nd].numel() // x.shape[nd + 1] if xspec is None else \
        math.prod(xspec.shape) // xspec.shape[1]
    s = xs.sum(dims, keepdim=True)                                    # (lead, 1, C, 1..)
    for a in sync:
        s = C.all_reduce(s, ctx.mesh, a, "sum", expanded=True, label="batch_norm: sum per channel")
    mean = s / count
    dev = xs - mean
    v = (dev * dev).sum(dims, keepdim=True)
    for a in sync:
        v = C.all_reduce(v, ctx.mesh, a, "sum", expanded=True,
                             label="batch_norm: sum of squared deviations")
    var = v / count
    y = dev * torch.rsqrt(var + eps)
    if w is not None:
        y = y * per_channel(w, nd, n_loc)
    if b is not None:
        y = y + per_channel(b, nd, n_loc)
    y = y.to(x.dtype)
    if rm is not None and ctx is not None:
        with torch.no_grad():
            lead = tuple(mean.shape[:nd])
            _write(rm, mean.reshape(lead + (-1,)), nd, momentum)
            _write(rv, var.reshape(lead + (-1,)) * (count / max(count - 1, 1)), nd, momentum)
    return y


# ---- parsing, cost, registration ----------------------------------------------------------

def _parse(input, running_mean=None, running_var=None, weight=None, bias=None,
           training=False, momentum=0.1, eps=1e-5, _functional=True):
    if momentum is None:
        raise TypeError("batch_norm: momentum=None; give a number (nn.BatchNorm computes "
                        "the cumulative factor itself)")
    if _functional and training and hasattr(input, "shape"):
        # F.batch_norm checks the batch size before the kernel's dtype check (its
        # ValueError for one value per channel; wide seed 2021354: an int64 (1, 1, 1)
        # raised the dtype's NotImplementedError here); torch.batch_norm does not
        F._verify_batch_size(torch.Size(input.shape))
    dt = getattr(input, "dtype", None)
    if dt is not None and not dt.is_floating_point:
        # torch's kernel: NotImplementedError (the meta check's eager re-run on expanded
        # zeros raised mean()'s RuntimeError instead, seed 995514)
        name = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}.get(dt, dt)
        raise NotImplementedError(f'"batch_norm" not implemented for \'{name}\'; normalize a '
                                  "floating tensor, e.g. input.float()")
    return (input, running_mean, running_var, weight, bias), {
        "training": bool(training), "momentum": check_number("batch_norm", "momentum", momentum,
                                                             False),
        "eps": check_number("batch_norm", "eps", eps, False)}


def _torch_parse(input, weight, bias, running_mean, running_var, training, momentum, eps,
                 cudnn_enabled=True):
    return _parse(input, running_mean, running_var, weight, bias, training, momentum, eps,
                  _functional=False)


def channel_norm_cost(per_element: int):
    """``per_element`` FLOPs per element; backward 2 x, saving x and a float32 mean and
    rstd per (plane or channel); per-input terms (``costs.norm_terms``): the weight's and
    bias's gradients, and the running statistics' (never computed)."""
    def cost(ins, outs, **_):
        x = ins[0]
        stats = 2 * 4 * (x.shape[1] if x.dim() > 1 else 1)
        fwd = sum(costs.nbytes(t) for t in ins if isinstance(t, torch.Tensor)) + \
            costs.nbytes(outs[0])
        n, k = x.numel(), len(ins)          # (x, [running mean, running var,] w, b)
        shares = {k - 2: 2 * n, k - 1: n, **({1: 0, 2: 0} if k == 5 else {})}
        return costs.TermsCost(per_element * n, fwd, 2 * per_element * n,
                               costs.backward_bytes(ins, outs, costs.nbytes(x) + stats),
                               terms=costs.norm_terms(ins, 2 * per_element * n, shares))
    return cost


def _bn_cost(ins, outs, *, training, **attrs):
    return channel_norm_cost(7 if training else 4)(ins, outs)


def _bn_samples(g):
    return [Sample(F.batch_norm, (g.rn(6, 4, 5), None, None, g.rn(4), g.rn(4)),
                   {"training": True}),
            Sample(F.batch_norm, (g.rn(4, 3, 5, 2), None, None), {"training": True}),
            Sample(F.batch_norm, (g.rn(5, 4, 3), g.rn(4), g.pos(4)), {"training": False})]


register("batch_norm", [F.batch_norm, (torch.batch_norm, _torch_parse)], parse=_parse,
         rule=batch_norm_rule, local=_batch_norm_local, cost=_bn_cost, op_class="norm",
         sample=_bn_samples)
