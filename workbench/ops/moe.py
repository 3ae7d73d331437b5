"""Mixture-of-experts routing: top-k router, dispatch to experts, combine back.

    w, e, slot, aux = router_topk(logits, k, gating="softmax", capacity=C)  # logits (G, S, E)
    buf = moe_dispatch(x, e, slot, num_experts=E, capacity=C)               # (G, E, C, h)
    y = moe_combine(experts(buf), w, e, slot)                               # (G, S, h)

Tokens come in *groups* (GShard's word, Lepikhin et al. 2020, sec. 2.2 and Algorithm 1):
here a group is one sequence, so that capacity, dropping and the auxiliary loss of a
sequence do not depend on how the batch is split over ranks or micro-batches.

* **router_topk** (G, S, E) logits -> per token k experts and their gate weights:
  - ``gating="softmax"``: p = softmax(logits); the k largest, renormalised to sum 1
    (= softmax over the k chosen logits: Mixtral, Jiang et al. 2024, sec. 2.1; GShard top-2);
  - ``gating="sigmoid"``: s = sigmoid(logits); the k largest, normalised s_i / sum of the
    k chosen (DeepSeek-V3 technical report, Liu et al. 2024, eqs. 13-15);
  - ``normalize=False``: the k chosen p_i (or s_i) as they are, not renormalised: Switch
    Transformer's top-1 gate p_i (Fedus et al. 2021, eq. 2; with renormalisation a top-1
    gate is 1 and the router learns from the load-balancing loss alone), Qwen-MoE's
    ``norm_topk_prob=False``.
  ``slot``: where each (token, choice) lands in its expert's buffer, -1 when dropped.
  Ties in the scores go to the lower expert index (torch.argmax's rule, Switch's and
  GShard's argmax), the same on every backend (``torch.topk`` leaves their order open).
  Priority as GShard's Algorithm 1: every token's first choice, in sequence order,
  before any second choice.  With ``capacity`` C an expert takes at most C per group;
  the rest are dropped (they add nothing: the residual carries the token).
  ``aux``: the load-balancing loss per group, the Switch Transformer's form (Fedus et al.
  2021, eq. 4-6): E * sum_i f_i P_i with f_i the fraction of the group's S k assignments
  routed to expert i (counted before dropping; not differentiable; for k > 1 every choice
  counts, as Megatron-LM's ``switch_load_balancing_loss_func``, NVIDIA/Megatron-LM
  d98e8a64dd megatron/core/transformer/moe/moe_utils.py:63-87, where GShard's l_aux,
  Algorithm 1, counts first choices only) and
  P_i the mean over the group's tokens of the router's probability of i (softmax p;
  sigmoid: s normalised over all experts, DeepSeek-V3 eqs. 17-20).  It is 1 when the
  routing is perfectly uniform.
* **moe_dispatch**: (G, S, h) tokens -> (G, E, C, h) buffers, token copies at their slots,
  zeros elsewhere (GShard's dispatch einsum "GSEC,GSM->EGCM", as a scatter).
* **moe_combine**: (G, E, C, h) expert outputs -> (G, S, h): each token's k outputs
  weighted by its gates and summed (GShard's combine einsum "GSEC,EGCM->GSM", a gather).

Dispatch then combine with identity experts and gates summing to 1 gives the tokens
back (dropped ones as zeros).  Every function honours ``__torch_function__`` so the
SPMD layer runs it on DistTensors (rules: ``workbench/parallel/ops_table/moe.py``).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from . import _checks

__all__ = ["router_topk", "moe_dispatch", "moe_combine", "attach_aux_loss", "loss_share",
           "capacity", "GATINGS"]

GATINGS = ("softmax", "sigmoid")


def capacity(tokens: int, num_experts: int, k: int, factor: float | None) -> int:
    """Slots per expert per group of ``tokens``: ceil(factor * tokens * k / E) (GShard,
    Switch: "expert capacity = tokens per batch / experts x capacity factor"), at most
    ``tokens`` (a token picks an expert once); ``factor=None``: ``tokens`` (no drops).
    At least 1 (a group of no tokens has empty buffers of one slot)."""
    _int("capacity", "tokens", tokens, 0)
    _int("capacity", "num_experts", num_experts, 1)
    _int("capacity", "k", k, 1)
    if k > num_experts:
        raise ValueError(f"capacity: k={k} > num_experts={num_experts}: a token picks k "
                         f"distinct experts; lower k to at most {num_experts} or add experts")
    if factor is None:
        return max(1, tokens)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not 0 < factor < math.inf:
        raise ValueError(f"capacity: factor={factor!r} must be a finite number > 0 (1.0: "
                         "room for an even share; 1.25 as Switch), or None to drop nothing")
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def _int(op, name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{op}: {name}={v!r} must be an int >= {lo}")


def router_topk(logits, k: int, gating: str = "softmax", capacity: int | None = None,
                normalize: bool = True):
    """(G, S, E) router logits -> (weights (G, S, k), experts (G, S, k) int64, slots
    (G, S, k) int64, -1 = dropped, aux (G,) load-balancing loss per group).
    ``normalize=False``: the weights are the k chosen probabilities themselves (softmax
    p_i: Switch's top-1 gate, Fedus et al. 2021, eq. 2; Qwen-MoE's and DeepSeek's
    ``norm_topk_prob=False``; sigmoid s_i), not renormalised to sum 1."""
    if has_torch_function((logits,)):
        return handle_torch_function(router_topk, (logits,), logits, k, gating=gating,
                                     capacity=capacity, normalize=normalize)
    _checks.floating("router_topk", "logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"router_topk: logits.shape={tuple(logits.shape)}; give (groups, "
                         "tokens, experts), e.g. logits.view(B, S, E)")
    E = logits.shape[-1]
    _int("router_topk", "k", k, 1)
    if k > E:
        raise ValueError(f"router_topk: k={k} > {E} experts: a token picks k distinct "
                         f"experts; lower k to at most {E} or add experts")
    if gating not in GATINGS:
        raise ValueError(f"router_topk: gating={gating!r}; use one of {GATINGS}")
    if capacity is not None:
        _int("router_topk", "capacity", capacity, 1)
    if not isinstance(normalize, bool):
        raise TypeError(f"router_topk: normalize={normalize!r}; give True (the k gates "
                        "renormalised to sum 1) or False (the router's probabilities)")
    return _router_topk(logits, k, gating, capacity, normalize)


def _router_topk(logits, k, gating, cap, normalize=True):
    """The router on (..., S, E): every leading dim is a group."""
    S, E = logits.shape[-2], logits.shape[-1]
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))     # gates in fp32
    if gating == "softmax":
        scores = torch.softmax(z, -1)                                   # p (..., S, E)
        probs = scores
    else:
        scores = torch.sigmoid(z)                                       # s (..., S, E)
        # s' = s / sum s (DeepSeek-V3), written as softmax(log s): the same numbers, but
        # finite where every s of a token underflows (logits below -103 in float32: 0 / 0
        # made the aux loss and, through it, the router's gradient NaN)
        probs = torch.softmax(F.logsigmoid(z), -1)                      # s' (..., S, E)
    # the k largest, ties to the lower expert index (torch.argmax's rule, as Switch's and
    # GShard's argmax routers take it); torch.topk leaves the order of equal scores
    # unspecified (torch 2.13 on CPU put the higher index first), so a tie routed a token
    # by the backend's kernel: a stable sort is the same on every device
    top, experts = torch.sort(scores, stable=True, dim=-1, descending=True)
    top, experts = top[..., :k], experts[..., :k]                       # (..., S, k)
    if normalize:
        # the k chosen renormalised, written as a softmax over them: p_i / sum p_j =
        # softmax of the chosen logits (Mixtral's G(x) = softmax(TopK(x W_g)); Megatron-LM's
        # topk_softmax_with_capacity without pre-softmax), s_i / sum s_j = softmax of the
        # chosen log s. Equal in exact arithmetic to top / top.sum(), but at k = 1 the gate
        # is exactly 1 with an exactly zero gradient, as torch's softmax of one element
        # gives; top / top.sum() left rounding (3e-11 on the tiny model's router), which
        # Adam's normalised step turned into router updates of ~lr / 300 a step that no
        # loss asked for, different on every layout (one device vs dp 4: 1e-4 in the
        # loss after two steps)
        chosen = torch.gather(z, -1, experts)
        weights = torch.softmax(chosen if gating == "softmax" else F.logsigmoid(chosen), -1)
    else:
        weights = top
    weights = weights.to(logits.dtype)
    hot = F.one_hot(experts, E)                                         # (..., S, k, E)
    # k-major priority: first choices of every token, then second choices (GShard)
    order = hot.transpose(-3, -2).reshape(*hot.shape[:-3], k * S, E)     # (..., kS, E)
    pos = (torch.cumsum(order, -2) - 1) * order                          # place in its expert
    slots = pos.sum(-1).reshape(*hot.shape[:-3], k, S).transpose(-2, -1)  # (..., S, k)
    if cap is not None:
        slots = torch.where(slots < cap, slots, torch.full_like(slots, -1))
    # (a group of no tokens: f = P = 0, so aux = 0, not 0 / 0)
    f = hot.sum((-3, -2)).to(probs.dtype) / max(1, S * k)               # (..., E) f_i
    aux = E * (f * probs.sum(-2) / max(1, S)).sum(-1)                   # (...,) Switch eq. 4
    return weights, experts, slots.contiguous(), aux.to(logits.dtype)


def _check_routes(op, x_shape, experts, slots):
    for name, t in (("experts", experts), ("slots", slots)):
        _checks.tensor(op, name, t)
        if t.dtype != torch.int64 or t.shape[:2] != torch.Size(x_shape[:2]) or t.dim() != 3:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                             f"give int64 (G, S, k) with (G, S) = {tuple(x_shape[:2])}, as "
                             "router_topk returns")
    if experts.shape != slots.shape:
        raise ValueError(f"{op}: experts {tuple(experts.shape)} and slots "
                         f"{tuple(slots.shape)} differ; give both from one router_topk call")


def moe_dispatch(x, experts, slots, num_experts: int, capacity: int):
    """(G, S, h) tokens -> (G, E, C, h): token s's copy at [g, experts[g, s, j],
    slots[g, s, j]] for each of its k choices not dropped; zeros elsewhere."""
    if has_torch_function((x, experts, slots)):
        return handle_torch_function(moe_dispatch, (x, experts, slots), x, experts, slots,
                                     num_experts, capacity)
    _checks.floating("moe_dispatch", "x", x)
    if x.dim() != 3:
        raise ValueError(f"moe_dispatch: x.shape={tuple(x.shape)}; give (groups, tokens, h)")
    _check_routes("moe_dispatch", x.shape, experts, slots)
    _int("moe_dispatch", "num_experts", num_experts, 1)
    _int("moe_dispatch", "capacity", capacity, 1)
    _check_inside("moe_dispatch", experts, slots, num_experts, capacity)
    if slots.numel() and not slots.is_meta:
        # two (token, choice) pairs in one slot would be summed into it by the scatter
        idx = _flat_index(experts, slots, num_experts, capacity).reshape(slots.shape[0], -1)
        taken = torch.zeros(slots.shape[0], num_experts * capacity + 1, dtype=torch.int64,
                            device=slots.device).scatter_add_(1, idx, torch.ones_like(idx))
        if bool((taken[:, :-1] > 1).any()):
            g, row = (int(i) for i in (taken[:, :-1] > 1).nonzero()[0])
            raise ValueError(f"moe_dispatch: group {g} routes several tokens to expert "
                             f"{row // capacity}'s slot {row % capacity}; each slot holds one "
                             "token: give experts and slots from one router_topk call")
    return _dispatch(x, experts, slots, num_experts, capacity)


def _check_inside(op, experts, slots, E, C):
    """Every route inside E experts x C slots, a dropped one marked -1: a route outside
    would read or write another expert's slot (the rows are flat) or fail an index."""
    if not slots.numel() or slots.is_meta:
        return
    bounds = torch.stack((*torch.aminmax(slots), *torch.aminmax(experts)))   # one sync
    s_lo, s_hi, e_lo, e_hi = bounds.tolist()
    if s_hi >= C or s_lo < -1 or e_hi >= E or e_lo < 0:
        raise ValueError(f"{op}: a route falls outside {E} experts x {C} slots (experts in "
                         f"[{e_lo}, {e_hi}], slots in [{s_lo}, {s_hi}], -1 = dropped); give "
                         "the capacity and experts router_topk used")


def _flat_index(experts, slots, E, C):
    """Row of each (token, choice) in the (E C + 1) rows of a group; dropped: the last."""
    return torch.where(slots >= 0, experts * C + slots, torch.full_like(slots, E * C))


def _dispatch(x, experts, slots, E, C):
    G, S, h = x.shape[-3:]
    k = experts.shape[-1]
    lead = x.shape[:-3]
    n = math.prod(x.shape[:-2])                    # groups (shapes spelled out: a shard
    x = x.reshape(n, S, h)                         # may be empty, where -1 is ambiguous)
    idx = _flat_index(experts, slots, E, C).reshape(n, S * k, 1).expand(n, S * k, h)
    src = x.unsqueeze(2).expand(n, S, k, h).reshape(n, S * k, h)
    buf = x.new_zeros(n, E * C + 1, h).scatter_add(1, idx, src)        # one token a row
    return buf[:, :E * C].reshape(*lead, G, E, C, h)


def moe_combine(y, weights, experts, slots):
    """(G, E, C, h) expert outputs -> (G, S, h): sum over a token's k choices of its gate
    weight times its expert's output at its slot (a dropped choice adds nothing)."""
    if has_torch_function((y, weights, experts, slots)):
        return handle_torch_function(moe_combine, (y, weights, experts, slots), y, weights,
                                     experts, slots)
    _checks.floating("moe_combine", "y", y)
    _checks.floating("moe_combine", "weights", weights)
    if y.dim() != 4 or weights.dim() != 3 or y.shape[0] != weights.shape[0]:
        raise ValueError(f"moe_combine: y.shape={tuple(y.shape)}, weights.shape="
                         f"{tuple(weights.shape)}; give y (G, E, C, h) from the experts and "
                         "weights (G, S, k) from router_topk")
    _check_routes("moe_combine", weights.shape, experts, slots)
    if experts.shape != weights.shape:
        raise ValueError(f"moe_combine: experts {tuple(experts.shape)} and weights "
                         f"{tuple(weights.shape)} differ; give both from one router_topk call")
    _check_inside("moe_combine", experts, slots, y.shape[1], y.shape[2])
    return _combine(y, weights, experts, slots)


def _combine(y, weights, experts, slots):
    G, E, C, h = y.shape[-4:]
    S, k = weights.shape[-2:]
    lead = y.shape[:-4]
    n = math.prod(y.shape[:-3])
    y = y.reshape(n, E * C, h)
    y = torch.cat((y, y.new_zeros(n, 1, h)), 1)                         # row E C: dropped
    idx = _flat_index(experts, slots, E, C).reshape(n, S * k, 1).expand(n, S * k, h)
    picked = torch.gather(y, 1, idx).reshape(n, S, k, h)                # (G, S, k, h)
    w = weights.reshape(n, S, k, 1).to(y.dtype)
    return (picked * w).sum(2).reshape(*lead, G, S, h)


class _AuxLossScaler(torch.autograd.Function):
    """Identity on y; in backward, ``scale`` as the gradient of every element of aux
    (Megatron-LM's ``MoEAuxLossAutoScaler``, megatron/core/transformer/moe/moe_utils.py)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale, ctx.shape, ctx.dtype = scale, aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype, device=g.device), None


_SHARE = [1.0]      # the loss share of the forward now running (:func:`loss_share`)


@contextlib.contextmanager
def loss_share(share: float):
    """While one simulated data-parallel rank runs its forward, the share of its loss the
    wrapper's backward gives it: ``1/N``, where a wrapper joins the N ranks' losses as
    their mean and then sums the ranks' gradients (``wb.DistributedDataParallel``,
    ``FullyShardedDataParallel`` on simulated ranks), as torch DDP averages them.  A loss
    term attached by gradient (:func:`attach_aux_loss`) is not part of the joined loss, so
    it takes the same share here; without it the N ranks' sum would count it N times."""
    _SHARE.append(float(share))
    try:
        yield
    finally:
        _SHARE.pop()


_BATCH = [None]     # the batch whose per-rank forwards now run (:func:`one_batch`)


@contextlib.contextmanager
def one_batch():
    """While a simulated data-parallel wrapper runs its N ranks' forwards of one batch
    (``wb.DistributedDataParallel``, ``FullyShardedDataParallel`` on simulated ranks): a
    layer that reports statistics of its last forward (``models.moe.MoE.last_stats``)
    keeps every rank's part of this batch, as one device's forward over the whole batch
    counts them, instead of the last rank's alone."""
    _BATCH.append(object())
    try:
        yield
    finally:
        _BATCH.pop()


_STATS_SINK = [None]   # while a program is captured: the MoE layers, in call order


@contextlib.contextmanager
def stats_sink():
    """While ``workbench.compile`` captures a program: a layer that reports statistics of
    its last forward (``models.moe.MoE.last_stats``) appends itself to the yielded list
    instead of keeping the capture's (meta) routing, and the compiled program hands each
    such layer the routing of its ``router_topk`` node on every call, in call order (a
    captured graph would not repeat a write to the module)."""
    _STATS_SINK.append([])
    try:
        yield _STATS_SINK[-1]
    finally:
        _STATS_SINK.pop()


def stats_layers():
    """The list a capture collects the reporting layers in (:func:`stats_sink`), or None."""
    return _STATS_SINK[-1]


def batch_token():
    """An object naming the batch whose per-rank forwards now run (:func:`one_batch`), or
    None outside a simulated data-parallel forward."""
    return _BATCH[-1]


def attach_aux_loss(y, aux, scale: float):
    """``y`` unchanged; backward adds ``scale * aux.sum()``'s gradient to the router, as if
    ``scale * aux.sum()`` were added to the loss.  How the load-balancing loss trains
    without changing the loss every recipe and pipeline schedule computes (Megatron-LM's
    ``MoEAuxLossAutoScaler``).  The result is a view made by a custom autograd Function, so
    autograd refuses to modify it in place: attach to a tensor the layer itself consumes
    (``models.moe.MoE`` attaches to the gate weights), not to what it returns.  Inside
    :func:`loss_share` (a simulated data-parallel rank's forward) ``scale`` is multiplied
    by that share."""
    if has_torch_function((y, aux)):
        return handle_torch_function(attach_aux_loss, (y, aux), y, aux, scale)
    if not torch.is_grad_enabled() or not aux.requires_grad:
        return y
    return _AuxLossScaler.apply(y, aux, float(scale) * _SHARE[-1])
