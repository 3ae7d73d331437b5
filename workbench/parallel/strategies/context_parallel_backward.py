"""Ring attention's backward as ring implementations run it.

Autograd going back through the ring's forward (each block's output rounded to the
compute dtype, then the online-softmax merge) would differentiate the merge: a gradient
through every block's log-sum-exp, every block's K/V kept for backward. Real ring
attention does not. PyTorch's ``context_parallel`` (torch 2.13,
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``,
``_templated_ring_attention_backward``), zhuzilin's ring-flash-attention
(``ring_flash_attn_backward``) and TransformerEngine's ``AttnFuncWithCPAndKVP2P`` keep
only q, k, v, the merged output O and the merged log-sum-exp L, and in backward run
each block's FlashAttention backward against the GLOBAL O and L (Dao 2023,
FlashAttention-2, Algorithm 2: P = exp(S - L), D = rowsum(dO o O), dS = P o (dP - D)):
P is then the block's slice of the whole row's softmax, so each block's gradient is exact
up to one kernel's rounding, and the blocks' gradients add up::

    for step t = 0 .. p-1:                      # rank i holds the K/V of rank (i - t) mod p
        if t > 0:  wait for this step's K/V
        if t < p-1: send my K/V block to rank i+1 (async)        (K/V travel again: p-1)
        dq_t, dk_t, dv_t = block backward(q, K, V, O, L, dO)     (the kernel's dtype)
        dQ += dq_t                                               (fp32, kept)
        dKV = dkv_t (t = 0)  or  received dKV + dkv_t             (fp32)
        send dKV to rank i+1 (async)                             (dK/dV travel: p sends)
    wait for the dK/dV of my own block (the last send)

as torch runs it: dQ, dK, dV accumulate in float32 (``_cp_options.convert_to_f32``, its
default; float64 inputs: float64) and dK/dV travel the ring in it, riding along with the
K/V block they belong to, so after p sends the sum is back at its owner; each is cast
to the input dtype once at the end. The backward's K/V sends and the dK/dV sends share
the ring's stream (one process group): each step's block backward runs beside the
previous step's dK/dV and this step's K/V.

:func:`ring_attention_function` is that torch.autograd.Function over the DistTensors'
local tensors. Its forward runs the ring's forward (``context_parallel.ring_attention``:
per-step blocks and the merge, on DistTensors, traced as always) and keeps q, k, v, O and
L; its backward moves K/V and dK/dV as above, and under a trace records the sends, the
accumulations and the final wait, and each step's block backward when the forward ran
under a trace too (as every op's backward event: the op table's ``ring_attention_step``
backward cost, captured from the forward).
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh import cost as _cost
from ...sim_mesh.backward_pass import in_weight_pass
from ...sim_mesh.trace import current_trace
from .. import storage
from ..dispatch import explain_hooks
from ..dist_tensor import DistTensor
from ..ops_table import pricing
from ..ops_table.ring_attention import slot_chunks
from .context_parallel_comm import pass_on, wait

__all__ = ["ring_attention_function", "block_backward"]


def _acc(dtype):
    """The accumulator: float32 (float64 for float64 inputs), torch's convert_to_f32."""
    return torch.promote_types(dtype, torch.float32)


# ---- one step's block backward --------------------------------------------------------------

def block_backward(q, k, v, o, lse, do, delta, i, j, ring, causal, balanced, scale):
    """Slot ``i``'s queries against slot ``j``'s K/V: (dq, dk, dv) in the accumulator's
    dtype. q, o, do (N, Hq, n c, D*), lse, delta (N, Hq, n c) of the whole rows (the merged
    output's); k, v (N, Hkv, n c, D*). One kernel per query chunk, as the forward's
    ``ring_attention_step`` runs them; each kernel's gradients rounded to q's dtype (the
    kernel writes them so), then added up in the accumulator."""
    acc = _acc(q.dtype)
    qa, kb = slot_chunks(i, ring, balanced), slot_chunks(j, ring, balanced)
    c = q.shape[-2] // len(qa)
    g = q.shape[1] // k.shape[1]                                    # GQA group
    dq = q.new_zeros(q.shape, dtype=acc)
    dk = k.new_zeros(k.shape, dtype=acc)
    dv = v.new_zeros(v.shape, dtype=acc)
    for n, a in enumerate(qa):
        seen = [m for m, b in enumerate(kb) if not causal or b <= a]
        if not seen:                                   # skipped: no kernel runs
            continue
        rows = slice(n * c, (n + 1) * c)
        cols = torch.cat([torch.arange(m * c, (m + 1) * c) for m in seen]).to(q.device)
        Q = q[..., rows, :].to(acc)                                     # (N, Hq, c, D)
        K = k.index_select(-2, cols).to(acc).repeat_interleave(g, 1)    # (N, Hq, c*, D)
        V = v.index_select(-2, cols).to(acc).repeat_interleave(g, 1)    # (N, Hq, c*, Dv)
        dO = do[..., rows, :].to(acc)                                   # (N, Hq, c, Dv)
        L = lse[..., rows].to(acc)
        L = torch.where(torch.isneginf(L), torch.zeros_like(L), L)     # a row with no key
        s = (Q @ K.transpose(-2, -1)) * scale                           # (N, Hq, c, c*)
        if causal and a in [kb[m] for m in seen]:      # the diagonal chunk: causal mask
            pq = torch.arange(a * c, (a + 1) * c)
            pk = torch.cat([torch.arange(kb[m] * c, (kb[m] + 1) * c) for m in seen])
            s = s.masked_fill(~(pq[:, None] >= pk[None, :]).to(q.device), -math.inf)
        p = torch.exp(s - L.unsqueeze(-1))             # the block's slice of the row softmax
        dp = dO @ V.transpose(-2, -1)                                   # (N, Hq, c, c*)
        ds = p * (dp - delta[..., rows].to(acc).unsqueeze(-1))
        gq = (ds @ K) * scale                                           # (N, Hq, c, D)
        gk = (ds.transpose(-2, -1) @ Q) * scale                         # (N, Hq, c*, D)
        gv = p.transpose(-2, -1) @ dO                                   # (N, Hq, c*, Dv)
        gk, gv = (t.unflatten(1, (k.shape[1], g)).sum(2) for t in (gk, gv))   # GQA: sum
        # the kernel writes its gradients in the input dtype; torch adds them in fp32
        gq, gk, gv = (t.to(q.dtype).to(acc) for t in (gq, gk, gv))
        dq[..., rows, :] += gq
        dk.index_add_(-2, cols, gk)
        dv.index_add_(-2, cols, gv)
    return dq, dk, dv


def _step_grads(q, k, v, o, lse, do, delta, coords, axis, nd, t, ring, causal, balanced,
                scale):
    """Every cell's block backward at step ``t``: cells along the ring's mesh dim ``axis``
    hold slot i (``coords``: the slot of each index along it), the other leading dims and
    the batch go together."""
    outs = ([], [], [])
    for idx, i in enumerate(coords):
        cell = [x.narrow(axis, idx, 1) for x in (q, k, v, o, lse, do, delta)]
        lead = cell[0].shape[:nd]
        flat = [x.reshape((-1,) + tuple(x.shape[nd + 1:])) for x in cell]   # (N, H, ...)
        grads = block_backward(*flat, i, (i - t) % ring, ring, causal, balanced, scale)
        for acc, g, like in zip(outs, grads, cell[:3]):
            acc.append(g.reshape(tuple(lead) + tuple(like.shape[nd:])))
    return tuple(torch.cat(x, axis) for x in outs)


# ---- the autograd Function -------------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    """Forward: the ring's forward on DistTensors (``info.forward``); keeps q, k, v, the
    merged output and log-sum-exp. Backward: the module docstring's loop."""

    @staticmethod
    def forward(ctx, info, q, k, v):
        mesh = info["mesh"]
        dists = [DistTensor(_unexpanded(x, axes), mesh, ps, shape, dtype)
                 for x, (ps, shape, dtype, axes) in zip((q, k, v), info["inputs"])]
        costs: list = []
        hook = (lambda dec, specs, wrapped, cost:
                costs.append((cost, pricing.pricing_dtype(specs, [w.dtype for w in wrapped])))
                if dec.op == "ring_attention_step" else None)
        traced = current_trace() is not None
        if traced:
            with explain_hooks(hook):
                out, lse, kdtype = info["forward"](*dists)
        else:
            out, lse, kdtype = info["forward"](*dists)
        o_loc, l_loc = (storage.to_stacked(x._local) for x in (out, lse))
        ctx.info, ctx.costs, ctx.kdtype = info, costs if traced else None, kdtype
        ctx.save_for_backward(q, k, v, o_loc, l_loc)
        return o_loc

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        info = ctx.info
        mesh, axis, p = info["mesh"], info["axis"], info["ring"]
        q, k, v, o, lse = ctx.saved_tensors
        nd, kd = mesh.ndim, ctx.kdtype
        dtypes = (q.dtype, k.dtype, v.dtype)
        q, k, v, o = (x.to(kd) for x in (q, k, v, o))   # the kernels' dtype (autocast's)
        do = do.to(kd)
        acc = _acc(kd)
        lead = torch.broadcast_shapes(*(x.shape[:nd] for x in (q, k, v, o, do)))
        q, k, v, o, do = (x.expand(tuple(lead) + tuple(x.shape[nd:])) for x in (q, k, v, o, do))
        lse = lse.expand(tuple(lead) + tuple(lse.shape[nd:]))
        delta = (do.to(acc) * o.to(acc)).sum(-1)        # D = rowsum(dO o O), FA2 Alg. 2
        coords = ([_B.local_index(mesh, axis)] if _B.is_distributed(mesh)
                  else list(range(lead[axis])))
        tr = current_trace()
        record = tr is not None and not (getattr(ctx, "recorded", False) and in_weight_pass())
        ctx.recorded = True
        label = info["label"]
        dq = kv_in = None
        kv_handles = dkv_handles = []
        K, V = k, v
        for t in range(p):
            if t > 0:
                wait(kv_handles)                       # this step's K/V arrived
                K, V = kv_next
            if t < p - 1:                              # the next step's K/V, sent again
                kv_next, kv_handles = pass_on([K, V], mesh, axis,
                                              f"{label}: K/V again (backward)", record)
            gq, gk, gv = _step_grads(q, K, V, o, lse, do, delta, coords, axis, nd, t, p,
                                     info["causal"], info["balanced"], info["scale"])
            if record and ctx.costs and t < len(ctx.costs):
                _record_block(tr, mesh, *ctx.costs[t])
            dq = gq if dq is None else dq + gq
            if t > 0:
                wait(dkv_handles)                      # the dK/dV accumulated so far
                gk, gv = kv_in[0] + gk, kv_in[1] + gv
            if record:
                _record_accumulate(tr, mesh, gq, gk, gv, kd)
            if p > 1:                                  # dK/dV ride on with their block
                kv_in, dkv_handles = pass_on([gk, gv], mesh, axis,
                                             f"{label}: dK/dV (backward)", record)
            else:
                kv_in = (gk, gv)
        wait(dkv_handles)                              # my own block's dK/dV, home
        dk, dv = kv_in
        return None, dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])


def _unexpanded(x, axes):
    """A local whose leading ``axes`` were expanded (replicated copies, one per rank) as the
    DistTensor held it before: one copy."""
    for a in axes:
        x = x.narrow(a, 0, 1)
    return x


def _record_block(tr, mesh, cost, dtype):
    """One step's block backward on the clock: the op table's ``ring_attention_step``
    backward (FlashAttention-2's count, priced as its forward's backward event)."""
    pricing.record_backward_now("ring_attention_step", "attention", mesh.ranks, cost, dtype)


def _record_accumulate(tr, mesh, gq, gk, gv, dtype):
    """Adding the step's dQ, dK, dV into the float32 accumulators (torch adds all three at
    every step, ``grad_query += grad_query_``...): read two, write one, per element of one
    rank (plan.context_cost prices it alike)."""
    n = sum(g[(0,) * mesh.ndim].numel() for g in (gq, gk, gv))
    nbytes = 3 * gq.element_size() * n
    dur = _cost.compute_time(n, nbytes, tr.profile, dtype, "elementwise")
    tr.record_compute(mesh.ranks, "ring_attention_grad_accumulate", dur, flops=n,
                      bytes=nbytes, label="backward",
                      args={"op_class": "elementwise", "phase": "backward"})


def ring_attention_function(forward, q, k, v, *, axis, ring, causal, balanced, scale, label,
                            expand=((), (), ())):
    """The ring's output as a DistTensor whose backward is the module docstring's ring.
    ``forward(q, k, v)`` (DistTensors) -> (out, lse, the kernels' dtype); ``expand``: per
    input, the mesh dims where it is replicated but q (so the output) is not: each rank
    gets its own copy, whose gradients are summed by a traced all-reduce in backward
    (:func:`~workbench.sim_mesh.collectives.expand_replicas`, Megatron's ``f``)."""
    mesh = q.mesh
    locs = [storage.to_stacked(t._local) for t in (q, k, v)]
    locs = [C.expand_replicas(x, mesh, ax, label=f"{label}: grad of a replicated input")
            if ax else x for x, ax in zip(locs, expand)]
    leads = {tuple(x.shape[:mesh.ndim]) for x in locs}
    if len(leads) != 1:
        raise ValueError(f"ring_attention: q, k, v hold local shards of different layouts "
                         f"({[list(t.placements) for t in (q, k, v)]}); lay k and v out as q "
                         "off the ring's mesh dim")
    D = q.shape[-1]
    info = {"mesh": mesh, "axis": axis, "ring": ring, "causal": causal, "balanced": balanced,
            "scale": 1.0 / math.sqrt(D) if scale is None else float(scale), "label": label,
            "forward": forward,
            "inputs": [(t.placements, t.shape, t.dtype, ax) for t, ax in zip((q, k, v),
                                                                            expand)]}
    o = _RingAttention.apply(info, *locs)
    return DistTensor(o, mesh, q.placements, tuple(q.shape[:-1]) + (v.shape[-1],), o.dtype)
