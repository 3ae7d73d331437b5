"""Per-sample normalizations of CNN activations: ``F.group_norm`` (Wu & He 2018) and
``F.instance_norm`` (Ulyanov et al. 2016).

x (N, C, *spatial). GroupNorm normalizes each sample's groups of C / G channels over the
group's channels and every position; InstanceNorm each (sample, channel) plane over its
positions. Neither mixes samples, so per mesh dim (x, [running stats,] weight, bias -> y):

    R,    R,    R    -> R
    S(0), R,    R    -> S(0)    batch sharded: each rank normalizes its own samples
    S(1), S(0), S(0) -> S(1)    channels sharded with their weight and bias: instance norm
                                always; group norm when the ranks sharding channels divide
                                the number of groups (each rank holds whole groups)
    S(spatial)                  not offered: the statistics span the positions (gathered)
    P                           not valid: the statistics of a sum are not the sum of the
                                statistics; the planner reduces first

``instance_norm(use_input_stats=False)`` normalizes by running statistics: batch_norm's
evaluation (``batch_norm.py``). With ``use_input_stats=True`` and running statistics
given (``nn.InstanceNorm*d(track_running_stats=True)`` in training), their update averages
the statistics over the batch: not supported on DistTensors (it raises, naming the fix).

Cost: 7 FLOPs per element, as layer_norm's (``norm.py``); backward 2 x, saving x and a
float32 mean and rstd per group or plane (``batch_norm.channel_norm_cost``).
"""
from __future__ import annotations

import math

import torch.nn.functional as F

from ..placement import Replicate, Shard
from ._util import check_number
from .batch_norm import affine_eval, channel_norm_cost, per_channel
from .samples import Sample
from .strategy import combine
from .table import register

__all__ = ["group_norm_rule", "instance_norm_rule"]

R = Replicate()


def _options(x, specs_present):
    """Per-mesh-dim options: replicated, batch sharded, channels sharded (the per-channel
    tensors given as ``specs_present``, True where a tensor is given, sharded alike)."""
    def ins(xp, par):
        return (xp,) + tuple(par if there else None for there in specs_present)
    opts = [(ins(R, R), (R,), "replicated")]
    if x.shape[0] > 1:
        opts.append((ins(Shard(0), R), (Shard(0),), "batch sharded: each rank its samples"))
    if x.shape[1] > 1:
        opts.append((ins(Shard(1), Shard(0)), (Shard(1),),
                     "channels sharded with their weight and bias"))
    return opts


def group_norm_rule(x, w=None, b=None, *, num_groups, **_):
    """group_norm: batch shards pass; channel shards pass along whole groups."""
    if x.ndim < 2:
        raise ValueError(f"group_norm: input of shape {tuple(x.shape)}; give (N, C, *)")
    opts = _options(x, (w is not None, b is not None))
    out = []
    for st in combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3):
        n = math.prod(x.mesh.shape[i] for i, p in enumerate(st.inputs[0]) if p.is_shard(1))
        if num_groups % n == 0:
            out.append(st)
    return out


def instance_norm_rule(x, rm=None, rv=None, w=None, b=None, *, use_input_stats, **_):
    """instance_norm: batch and channel shards pass (running statistics, when they are
    read, sharded with the channels)."""
    if x.ndim < 3:
        raise ValueError(f"instance_norm: input of shape {tuple(x.shape)}; give (N, C, *)")
    opts = _options(x, tuple(t is not None for t in (rm, rv, w, b)))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 5)


# ---- local functions on stacked tensors -----------------------------------------------------

def _same(t, nd) -> bool:
    return t is None or all(t.shape[i] == 1 or t.stride(i) == 0 for i in range(nd))


def _one(t, nd):
    return None if t is None else t[(0,) * nd]


def _folded(nd, x, fn, w, b):
    """``fn(x, w, b)`` on the device axes folded into the batch: weight and bias passed to
    torch's kernel where every rank has the same ones, else applied per rank after it."""
    if x.numel() == 0:                 # an empty shard (uneven split): nothing to normalize
        return x.clone()
    lead = tuple(x.shape[:nd])
    same = _same(w, nd) and _same(b, nd)
    xf = x.reshape((math.prod(x.shape[:nd + 1]),) + tuple(x.shape[nd + 1:]))
    y = fn(xf, _one(w, nd) if same else None, _one(b, nd) if same else None)
    y = y.reshape(x.shape)
    if not same:
        n = x.dim() - nd
        if w is not None:
            y = y * per_channel(w, nd, n)
        if b is not None:
            y = y + per_channel(b, nd, n)
        y = y.to(x.dtype)
    return y


def _group_norm_local(nd, ctx, x, w=None, b=None, *, num_groups, eps):
    g = num_groups * x.shape[nd + 1] // (ctx.in_specs[0].shape[1] if ctx is not None
                                         else x.shape[nd + 1])       # this rank's groups
    return _folded(nd, x, lambda t, w_, b_: F.group_norm(t, g, w_, b_, eps), w, b)


def _instance_norm_local(nd, ctx, x, rm=None, rv=None, w=None, b=None, *, use_input_stats,
                         eps):
    if not use_input_stats:
        return affine_eval(nd, x, rm, rv, w, b, eps)
    return _folded(nd, x, lambda t, w_, b_: F.instance_norm(t, None, None, w_, b_, True,
                                                            0.0, eps), w, b)


# ---- parsing, registration ------------------------------------------------------------------

def _gn_parse(input, num_groups, weight=None, bias=None, eps=1e-5):
    return (input, weight, bias), {"num_groups": int(num_groups),
                                   "eps": check_number("group_norm", "eps", eps, False)}


def _in_parse(input, running_mean=None, running_var=None, weight=None, bias=None,
              use_input_stats=True, momentum=0.1, eps=1e-5):
    if use_input_stats and (running_mean is not None or running_var is not None):
        raise NotImplementedError(
            "instance_norm(use_input_stats=True) with running statistics on DistTensors: "
            "their update averages over the batch and is not supported; use "
            "nn.InstanceNorm*d(track_running_stats=False) (the default), or eval mode")
    return (input, running_mean, running_var, weight, bias), {
        "use_input_stats": bool(use_input_stats),
        "eps": check_number("instance_norm", "eps", eps, False)}


def _gn_samples(g):
    return [Sample(F.group_norm, (g.rn(5, 4, 3, 2), 2, g.rn(4), g.rn(4))),
            Sample(F.group_norm, (g.rn(3, 6, 4), 3))]


def _in_samples(g):
    return [Sample(F.instance_norm, (g.rn(5, 4, 3, 2), None, None, g.rn(4), g.rn(4))),
            Sample(F.instance_norm, (g.rn(5, 4, 3), g.rn(4), g.pos(4)),
                   {"use_input_stats": False})]


register("group_norm", [F.group_norm], parse=_gn_parse, rule=group_norm_rule,
         local=_group_norm_local, cost=channel_norm_cost(7), op_class="norm",
         sample=_gn_samples)
register("instance_norm", [F.instance_norm], parse=_in_parse, rule=instance_norm_rule,
         local=_instance_norm_local, cost=channel_norm_cost(7), op_class="norm",
         sample=_in_samples)
