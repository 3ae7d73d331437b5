"""Mixture-of-experts routing ops of ``workbench.ops.moe``: router_topk, moe_dispatch,
moe_combine (GShard's formulation, Lepikhin et al. 2020: groups G, tokens S, experts E,
capacity C, model dim h).

Per mesh dim:

    router_topk(logits (G, S, E))      G sharded passes to every output (a group's top-k,
                                       slots and aux loss are its own); S and E whole
                                       (slots count over the group's tokens, gates over
                                       the experts); not linear: no Partial
    moe_dispatch(x (G, S, h), e, slot) G sharded passes (x, e, slot S(0) -> S(0));
                                       h sharded passes (x S(2) -> S(3));
                                       x P(sum) -> P(sum) (a scatter is linear in x);
                                       S sharded -> P(sum): each rank writes its own
                                       tokens' slots, zeros elsewhere, and the slots are
                                       distinct, so the buffers add up
    moe_combine(y (G, E, C, h), w, e, slot)
                                       G sharded passes; h sharded passes (y S(3) ->
                                       S(2)); linear in y (P(sum) with w R) and in w
                                       (P(sum) with y R); S sharded passes (w, e, slot
                                       S(1) with y R -> S(1))

Expert parallelism shards the E dim of the buffers and the experts' weights; GShard
writes that step as an all-to-all resharding S(G) -> S(E), which the reshard planner
would insert here, but real routers send uneven counts with no padding:
``workbench/parallel/strategies/expert_parallel.py`` does that on the local tensors.
To a captured program (``wb.compile``) that dispatcher is one op, ``expert_parallel``:

    expert_parallel(x (B, S, h), w, e, slot)
                                       the batch sharded over the mesh's first dim "dp"
                                       passes (x, w, e, slot S(0) -> S(0)), whole on the
                                       others; its uneven all-to-alls, expert GEMMs and
                                       their clock are the dispatcher's own (the experts'
                                       weights live on the expert mesh: not inputs here)
"""
from __future__ import annotations

import math

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..placement import Partial, Replicate, Shard
from . import costs
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

try:
    from ...ops import moe as _moe
except ModuleNotFoundError as _e:          # workbench.ops absent: rules only
    if not (_e.name or "").endswith("workbench.ops"):
        raise
    _moe = None

__all__ = ["router_topk_rule", "dispatch_rule", "combine_rule", "aux_attach_rule",
           "expert_parallel", "expert_parallel_rule"]

R = Replicate()
P = Partial("sum")


def _sharded(x, d) -> bool:
    return x.shape[d] > 1


def router_topk_rule(logits, **_):
    """router_topk: groups (dim 0) sharded pass to all four outputs; tokens and experts
    whole; not linear."""
    opts = [((R,), (R,) * 4, "replicated")]
    if _sharded(logits, 0):
        opts.append(((Shard(0),), (Shard(0),) * 4, "groups sharded pass: each routes its own"))
    return combine(logits.mesh.ndim, [opts] * logits.mesh.ndim, 1, n_outputs=4)


def dispatch_rule(x, experts, slots, **_):
    """moe_dispatch: groups pass, h passes, linear in x, tokens sharded -> partial buffer."""
    opts = [((R, R, R), (R,), "replicated")]
    if _sharded(x, 0):
        opts.append(((Shard(0),) * 3, (Shard(0),), "groups sharded pass"))
    if _sharded(x, 2):
        opts.append(((Shard(2), R, R), (Shard(3),), "h sharded passes"))
    opts.append(((P, R, R), (P,), "a scatter is linear in x"))
    if _sharded(x, 1):
        opts.append(((Shard(1),) * 3, (P,), "tokens sharded: each rank fills its tokens' "
                     "slots, zeros elsewhere; the buffers add up"))
    return combine(x.mesh.ndim, [opts] * x.mesh.ndim, 3)


def combine_rule(y, weights, experts, slots, **_):
    """moe_combine: groups pass, h passes, linear in y and in the gate weights, tokens
    sharded pass."""
    opts = [((R, R, R, R), (R,), "replicated")]
    if _sharded(y, 0):
        opts.append(((Shard(0),) * 4, (Shard(0),), "groups sharded pass"))
    if _sharded(y, 3):
        opts.append(((Shard(3), R, R, R), (Shard(2),), "h sharded passes"))
    opts.append(((P, R, R, R), (P,), "linear in the expert outputs"))
    opts.append(((R, P, R, R), (P,), "linear in the gate weights"))
    if _sharded(weights, 1):
        opts.append(((R, Shard(1), Shard(1), Shard(1)), (Shard(1),), "tokens sharded pass"))
    return combine(y.mesh.ndim, [opts] * y.mesh.ndim, 4)


# ---- local implementations: every leading device axis is more groups -------------------

def _lead(nd, *xs):
    """The inputs with their device axes broadcast to one lead and folded into dim 0."""
    lead = broadcast_shapes(*(tuple(x.shape[:nd]) for x in xs))
    n = math.prod(lead)                 # shapes spelled out: a shard may be empty
    return lead, [x.expand(*lead, *x.shape[nd:]).reshape(n * x.shape[nd], *x.shape[nd + 1:])
                  for x in xs]


def _unfold(lead, t):
    return t.reshape(*lead, t.shape[0] // math.prod(lead), *t.shape[1:])


def _router_local(nd, ctx, logits, k, gating, capacity, normalize=True):
    if ctx is None:
        G, S, _ = logits.shape
        f = torch.empty(G, S, k, dtype=logits.dtype, device="meta")
        i = torch.empty(G, S, k, dtype=torch.int64, device="meta")
        return f, i, i.clone(), torch.empty(G, dtype=logits.dtype, device="meta")
    return _moe._router_topk(logits, k, gating, capacity, normalize)   # leading: groups


def _dispatch_local(nd, ctx, x, experts, slots, num_experts, capacity):
    if ctx is None:
        G, _, h = x.shape
        return torch.empty(G, num_experts, capacity, h, dtype=x.dtype, device="meta")
    lead, (x, e, s) = _lead(nd, x, experts, slots)
    return _unfold(lead, _moe._dispatch(x, e, s, num_experts, capacity))


def _combine_local(nd, ctx, y, weights, experts, slots):
    if ctx is None:
        G, S, _ = weights.shape
        return torch.empty(G, S, y.shape[-1], dtype=y.dtype, device="meta")
    lead, (y, w, e, s) = _lead(nd, y, weights, experts, slots)
    return _unfold(lead, _moe._combine(y, w, e, s))


# ---- costs -------------------------------------------------------------------------------

def _router_cost(ins, outs, k, **_):
    """Per logit: softmax or sigmoid and its normalisation, 5 FLOPs (exp, sum, divide as
    costs.py counts them), the top-k selection n ceil(log2(k + 1)) compares (as topk), and
    the aux loss's mean and product, 2; backward 2 x forward (costs.py)."""
    n = ins[0].numel()
    f = n * (7 + max(1, math.ceil(math.log2(k + 1))))
    return costs.Cost(f, costs.nbytes(ins[0]) + sum(costs.nbytes(o) for o in outs), 2 * f,
                      costs.backward_bytes(ins, outs[:1], costs.nbytes(ins[0])))


def _dispatch_cost(ins, outs, **_):
    """A scatter: the tokens read, the buffer written (zeros included); no arithmetic;
    backward gathers the tokens' gradients back."""
    return costs.movement(ins, outs)


def _combine_cost(ins, outs, **_):
    """Gather each token's k outputs (S k h read) and a weighted sum: 2 k FLOPs per output
    element; backward: the gradients of y's picked rows and of the weights, 2 x."""
    y, w = ins[0], ins[1]
    k = w.shape[-1]
    n = outs[0].numel()
    read = n * k * y.element_size() + costs.nbytes(w) + costs.nbytes(ins[2]) + \
        costs.nbytes(ins[3])
    return costs.Cost(2 * k * n, read + costs.nbytes(outs[0]), 4 * k * n,
                      costs.backward_bytes(ins, outs, read))


def aux_attach_rule(y, aux, **_):
    """attach_aux_loss: y passes as it is (identity, any placement); aux replicated or
    groups sharded, never partial (its backward gives every element of aux the same
    gradient, which is right for each part of a sum only by accident of the scale: so a
    partial aux is reduced first)."""
    py = [R] + [Partial(op) for op in ("sum", "avg", "max", "min")] + \
        [Shard(d) for d in range(y.ndim) if _sharded(y, d)]
    pa = [R] + ([Shard(0)] if _sharded(aux, 0) else [])
    opts = [((a, b), (a,), "identity on y") for a in py for b in pa]
    return combine(y.mesh.ndim, [opts] * y.mesh.ndim, 2)


def _aux_local(nd, ctx, y, aux, scale):
    if ctx is None:
        return torch.empty(y.shape, dtype=y.dtype, device="meta")
    # each aux element stands once in the loss: a replicated copy per rank (expanded
    # along a mesh dim) takes its share, since the copies' gradients are summed
    copies = 1
    for i, p in enumerate(ctx.in_specs[1].placements):
        if p.is_replicate():
            copies *= aux.shape[i]
    return _moe.attach_aux_loss(y, aux, scale / copies)


# ---- expert parallelism's dispatcher, one op to a captured program ----------------------

def expert_parallel(x, weights, experts, slots, dispatcher, module):
    """``dispatcher(x, weights, experts, slots, module)`` (an ``ExpertParallel``) as an op
    of the table: what ``wb.compile``'s capture records for it (the dispatcher and the
    experts module are its attributes).  On DistTensors the dispatcher itself runs; on a
    plain meta tensor (capture's) the (B, S, h) result's shape; anything else raises."""
    if has_torch_function((x, weights, experts, slots)):
        return handle_torch_function(expert_parallel, (x, weights, experts, slots), x,
                                     weights, experts, slots, dispatcher, module)
    if type(x) is torch.Tensor and x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    raise TypeError("ExpertParallel: the MoE layer's input is a plain tensor; expert "
                    "parallelism runs on DistTensors laid out by the recipe (torch.export "
                    "cannot hold its exchange: wb.compile captures it by tracing)")


def expert_parallel_rule(x, weights, experts, slots, **_):
    """The dispatcher's layout (``ExpertParallel._check_input``): the batch sharded over
    the first mesh dim, named "dp" (edp x ep ranks), whole on the others."""
    nd = x.mesh.ndim
    first = [((Shard(0),) * 4, (Shard(0),), "the batch over dp: each ep group exchanges "
              "its tokens (uneven all-to-all)")] if x.mesh.dim_names[0] == "dp" and \
        _sharded(x, 0) else []
    rest = [((R,) * 4, (R,), "whole: every rank the same tokens")]
    return combine(nd, [first] + [rest] * (nd - 1), 4)


def _expert_parallel_local(nd, ctx, x, weights, experts, slots, dispatcher, module):
    if ctx is None:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return dispatcher.run_locals(ctx, (x, weights, experts, slots), module)


# ---- registrations -------------------------------------------------------------------------

def _router_sample(g):
    return [Sample(_moe.router_topk, (g.rn(4, 5, 4), 2)),
            Sample(_moe.router_topk, (g.rn(5, 7, 3), 1), {"gating": "sigmoid", "capacity": 3}),
            Sample(_moe.router_topk, (g.rn(4, 5, 4), 2), {"capacity": 2, "normalize": False})]


def _routes(g, G, S, E, k, cap):
    logits = g.rn(G, S, E)
    _, e, s, _ = _moe.router_topk(logits, k, capacity=cap)
    return e, s


def _dispatch_sample(g):
    e, s = _routes(g, 4, 5, 3, 2, 3)
    return [Sample(_moe.moe_dispatch, (g.rn(4, 5, 6), e, s, 3, 3))]


def _combine_sample(g):
    e, s = _routes(g, 5, 4, 3, 2, 2)
    w = g.rn(5, 4, 2)
    return [Sample(_moe.moe_combine, (g.rn(5, 3, 2, 6), w, e, s))]


if _moe is not None:
    register("router_topk", [_moe.router_topk],
             parse=lambda logits, k, gating="softmax", capacity=None, normalize=True:
                 ((logits,), {"k": int(k), "gating": gating, "capacity": capacity,
                              "normalize": normalize}),
             rule=router_topk_rule, local=_router_local, cost=_router_cost,
             op_class="reduction", n_out=4, meta_check=False, sample=_router_sample)
    register("moe_dispatch", [_moe.moe_dispatch],
             parse=lambda x, experts, slots, num_experts, capacity:
                 ((x, experts, slots), {"num_experts": int(num_experts),
                                        "capacity": int(capacity)}),
             rule=dispatch_rule, local=_dispatch_local, cost=_dispatch_cost,
             op_class="data_movement", meta_check=False, sample=_dispatch_sample)
    register("moe_combine", [_moe.moe_combine],
             parse=lambda y, weights, experts, slots: ((y, weights, experts, slots), {}),
             rule=combine_rule, local=_combine_local, cost=_combine_cost,
             op_class="data_movement", meta_check=False, sample=_combine_sample)
    register("attach_aux_loss", [_moe.attach_aux_loss],
             parse=lambda y, aux, scale: ((y, aux), {"scale": float(scale)}),
             rule=aux_attach_rule, local=_aux_local, cost=costs.view, op_class="view",
             meta_check=False,
             sample=lambda g: [Sample(_moe.attach_aux_loss, (g.rn(4, 3), g.rn(4), 0.5))])
    register("expert_parallel", [expert_parallel],
             parse=lambda x, weights, experts, slots, dispatcher, module:
                 ((x, weights, experts, slots), {"dispatcher": dispatcher, "module": module}),
             rule=expert_parallel_rule, local=_expert_parallel_local,
             # the exchanges and expert GEMMs: the dispatcher's own clock
             # (expert_parallel_clock.record_layer), recorded as it runs
             cost=costs.view, op_class="data_movement", meta_check=False,
             sample="needs an ExpertParallel dispatcher over an expert mesh "
                    "(tests/test_fixlist16.py runs it against eager)")
