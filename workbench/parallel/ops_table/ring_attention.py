"""Ring attention's step: ``ring_attention_step(q, k, v, *, ring, step, causal, balanced)``.

Context parallelism (:mod:`workbench.parallel.strategies.context_parallel`) cuts the
sequence into ``ring`` slots, one per rank of a mesh dim. At step ``t`` of the ring, the
rank holding query slot ``i`` holds the K/V of slot ``j = (i - t) mod ring`` (the K/V
blocks travel one rank further each step). This op is what every rank computes at
one step: its queries against the K/V block it holds, returning the partial output
and the log-sum-exp of each row (FlashAttention's L, Dao 2023), which the ring merges.

On one device the op is block-diagonal: rows of slot i attend only to the keys laid
out in slot i (``k`` holds, in slot i, the K/V block of slot (i - t) mod ring; after
``t`` ring passes that is what the rank of slot i holds), so

    q, k, v S(2) on a mesh dim of ``ring`` ranks -> out S(2), lse S(2)   no communication
    q, k, v S(0) -> S(0) (batch);  S(1) -> S(1) (heads; GQA as attention's rule)

Positions. With ``balanced`` (causal load balancing, as Megatron-LM's context parallelism
and Llama 3 do: Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2; Megatron-LM
``megatron/training/utils.py: get_batch_on_this_cp_rank``) the sequence is cut into 2 ring
chunks of c = S / (2 ring) tokens and slot i holds chunks i and 2 ring - 1 - i, so every
rank has the same causal work. :func:`slot_positions` gives each slot's original token
positions. A causal block is then computed chunk by chunk (query chunk a against key chunk
b): b < a whole, b == a with the causal mask (the diagonal), b > a skipped: no FLOPs, its
rows get output 0 and log-sum-exp -inf (what FlashAttention returns for a row with no key),
so the merge ignores them. Without ``balanced`` slot i holds chunk i (contiguous; rank p-1
then does 2p-1 times the work of rank 0: p - 1/2 blocks against 1/2).
"""
from __future__ import annotations

import math

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .. import layout as L
from ..placement import Replicate, Shard
from . import costs
from .attention import _heads_line_up
from .attention_pricing import with_shape
from .samples import Sample
from .strategy import combine
from .table import register
from ._util import broadcast_shapes

try:
    from ... import ops as _ops
except ModuleNotFoundError as _e:          # workbench.ops absent: rules only
    if not (_e.name or "").endswith("workbench.ops"):
        raise
    _ops = None

__all__ = ["ring_attention_step", "slot_chunks", "slot_positions", "block_pairs",
           "check_ring"]

R = Replicate()
_OP = "ring_attention_step"


# ---- the layout of the sequence on the ring ---------------------------------------------------

def check_ring(S: int, ring: int, balanced: bool, where: str = _OP) -> None:
    """``ring`` ranks can hold a sequence of ``S`` tokens: an error naming the fix if not."""
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
        raise ValueError(f"{where}: ring={ring!r}; give the number of ranks in the ring, an "
                         "int >= 1")
    n = 2 * ring if balanced else ring
    if S % n:
        why = (f"causal load balancing cuts the sequence into 2 x cp = {n} equal chunks "
               f"(rank i holds chunks i and {n - 1} - i)" if balanced
               else f"every one of the cp = {ring} ranks holds an equal slot")
        fix = n * max(1, round(S / n))
        raise ValueError(f"{where}: sequence length {S} does not divide by {n}: {why}; use a "
                         f"sequence length that is a multiple of {n} (e.g. {fix}) or another cp")


def slot_chunks(i: int, ring: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunks slot (rank) ``i`` holds: (i, 2 ring - 1 - i) balanced, else (i,)."""
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < ring:
        raise ValueError(f"slot_chunks: i={i!r}; give a slot (rank) of the ring of {ring!r}, "
                         f"an int in [0, ring - 1]")
    return (i, 2 * ring - 1 - i) if balanced else (i,)


def slot_positions(S: int, ring: int, balanced: bool = True, i: int | None = None) -> torch.Tensor:
    """Original token positions of slot ``i`` (all slots in order when ``i`` is None: the
    permutation that lays a sequence out on the ring, ``x[:, slot_positions(S, p)]``)."""
    check_ring(S, ring, balanced, "slot_positions")
    if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < ring):
        raise ValueError(f"slot_positions: i={i!r}; give a slot (rank) of the ring, an int in "
                         f"[0, {ring - 1}], or None for every slot")
    c = S // (2 * ring if balanced else ring)
    slots = range(ring) if i is None else (i,)
    return torch.cat([torch.arange(ch * c, (ch + 1) * c) for s in slots
                      for ch in slot_chunks(s, ring, balanced)])


def block_pairs(i: int, j: int, ring: int, causal: bool, balanced: bool) -> list[tuple]:
    """(query chunk, key chunk, kind) for query slot ``i`` against K/V slot ``j``; kind is
    "full", "diagonal" (the causal mask) or "skipped" (entirely masked)."""
    out = []
    for a in slot_chunks(i, ring, balanced):
        for b in slot_chunks(j, ring, balanced):
            kind = "full" if not causal or b < a else "diagonal" if b == a else "skipped"
            out.append((a, b, kind))
    return out


# ---- one slot's block -----------------------------------------------------------------------

def _slot_block(q, k, v, i, j, ring, causal, balanced, scale):
    """q (..., B, H, 2c or c, D) of slot i against k, v of slot j -> (out, lse), rows of a
    query chunk with no visible key chunk get 0 and -inf."""
    qa = slot_chunks(i, ring, balanced)
    kb = slot_chunks(j, ring, balanced)
    c = q.shape[-2] // len(qa)
    outs, lses = [], []
    for n, a in enumerate(qa):
        qc = q[..., n * c:(n + 1) * c, :]                                   # (B, H, c, D)
        seen = [m for m, b in enumerate(kb) if not causal or b <= a]
        if not seen:                                  # skipped: nothing is computed
            outs.append(qc.new_zeros(qc.shape[:-1] + (v.shape[-1],)))
            lses.append(torch.full(qc.shape[:-1], -math.inf, dtype=_lse_dtype(q.dtype),
                                   device=q.device))
            continue
        ks = torch.cat([k[..., m * c:(m + 1) * c, :] for m in seen], -2)   # (B, Hkv, c*, D)
        vs = torch.cat([v[..., m * c:(m + 1) * c, :] for m in seen], -2)
        mask = None
        if causal and a in [kb[m] for m in seen]:     # the diagonal chunk: causal mask
            pq = torch.arange(a * c, (a + 1) * c)
            pk = torch.cat([torch.arange(kb[m] * c, (kb[m] + 1) * c) for m in seen])
            mask = (pq[:, None] >= pk[None, :]).to(q.device)               # (c, c*)
        if qc.is_meta:                                # the dry run: shapes and saved tensors
            o, lse = _MetaBlock.apply(qc, ks, vs)
        else:
            o, lse = _ops.flash_attention(qc, ks, vs, mask=mask, scale=scale, return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _lse_dtype(dtype):
    """The log-sum-exp's dtype: float32, float64 for float64 inputs (flash_attention's)."""
    return torch.promote_types(dtype, torch.float32)


class _MetaBlock(torch.autograd.Function):
    """A block on the meta device (``workbench.plan.dryrun``): the output's and the
    log-sum-exp's shapes, and for backward what FlashAttention-2 keeps (Dao 2023,
    Algorithm 1: Q, K, V, O and L in fp32), so the dry run counts a fused kernel's memory."""

    @staticmethod
    def forward(ctx, q, k, v):
        if v.shape[-1] == q.shape[-1] and q.dtype != torch.float64:
            # PyTorch's fused kernel on meta (its meta function: shapes only), the kernel
            # a CPU run of the block calls (``ops.flash_attention``'s native backend), so
            # that selective checkpointing (``models.op_sac``) sees it and saves its
            # outputs as there, as ``ops.flash_attention._MetaFused`` does.  Was
            # ``new_empty``, no op on the policy's list: the dry run kept none of the
            # steps' outputs under recompute "op" where a CPU run of the recipe keeps
            # every block's (one-layer "small" Llama, cp 2: 868,372 B against 1,226,772
            # counted alike; tests/test_plan13.py), while its clock priced the steps as
            # served from the policy's cache
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False)[:2]
        else:
            o = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
            lse = torch.empty(tuple(q.shape[:-1]), dtype=_lse_dtype(q.dtype), device=q.device)
        ctx.save_for_backward(q, k, v, o, lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _check(q, k, v, ring, step, causal, balanced, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name}.shape={tuple(t.shape)}; expected 4-d (batch, "
                             "heads, seq, head_dim)")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"{_OP}: q, k, v must have one sequence length (self-attention on "
                         f"the ring); got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    check_ring(q.shape[2], ring, balanced)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < ring:
        raise ValueError(f"{_OP}: step={step!r}; give an int in [0, {ring - 1}]")
    for name, b in (("causal", causal), ("balanced", balanced)):
        if not isinstance(b, bool):
            raise TypeError(f"{_OP}: {name}={b!r}; give True or False")


def ring_attention_step(q, k, v, *, ring: int, step: int, causal: bool = True,
                        balanced: bool = True, scale: float | None = None):
    """Slot i's queries against the K/V laid out in slot i, which came from slot
    (i - step) mod ring: -> (out (B, Hq, S, Dv), lse (B, Hq, S) float32; float64 for
    float64 inputs). See the module
    docstring; on DistTensors sharded S(2) over ``ring`` ranks, each rank computes its slot."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(ring_attention_step, (q, k, v), q, k, v, ring=ring,
                                     step=step, causal=causal, balanced=balanced, scale=scale)
    _check(q, k, v, ring, step, causal, balanced, scale)
    return _slots(q, k, v, 0, q.shape[2] // ring, ring, step, causal, balanced, scale)


def _slots(q, k, v, first, blk, ring, step, causal, balanced, scale):
    """q, k, v (B, H, n * blk, D) hold slots first .. first + n - 1: each against its K/V."""
    outs, lses = [], []
    for s in range(q.shape[-2] // blk):
        i, sl = first + s, slice(s * blk, (s + 1) * blk)
        o, lse = _slot_block(q[..., sl, :], k[..., sl, :], v[..., sl, :], i,
                             (i - step) % ring, ring, causal, balanced, scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


# ---- the op table entry ---------------------------------------------------------------------

# While a group of cells (the ranks holding one slot) computes its blocks: (the lead
# shape, the flat indices of those cells in it).  The ranks' blocks differ in number (a
# causal load-balanced ring: rank i computes cp + 1 + i blocks of s / (2 cp) rows), so
# a tensor made then belongs to those cells alone, split evenly among them; the dry run's
# count of what a rank saves (``plan.meta_run.SavedCounter``) reads this to tally each
# rank's own (selective checkpointing keeps every block's output: ``models.op_sac``).
OWNER: list = []


def _local(nd, ctx, q, k, v, *, ring, step, causal, balanced, scale):
    if ctx is None:                                      # global output shapes only
        return (torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device="meta"),
                torch.empty(tuple(q.shape[:-1]), dtype=_lse_dtype(q.dtype), device="meta"))
    lead = tuple(broadcast_shapes(*(t.shape[:nd] for t in (q, k, v))))
    if q.numel() == 0 or k.numel() == 0:                 # an empty shard: nothing to attend
        shape = lead + tuple(q.shape[nd:-1])
        return (q.new_zeros(shape + (v.shape[-1],)),
                torch.full(shape, -math.inf, dtype=_lse_dtype(q.dtype), device=q.device))
    q4, k4, v4 = (t.expand(lead + tuple(t.shape[nd:])).reshape((math.prod(lead),) +
                                                               tuple(t.shape[nd:]))
                  for t in (q, k, v))                    # (L, B, H, S_local, D)
    blk = ctx.in_specs[0].shape[2] // ring
    like = torch.empty(tuple(q.shape[:nd]) + (1,) * (q.dim() - nd))   # on the CPU: read below
    off = ctx.offsets(ctx.in_specs[0], 2, like)          # each cell's first global row
    first = off.expand(tuple(lead) + tuple(off.shape[nd:])).reshape(-1).tolist()
    groups: dict = {}                                    # first slot -> cells (one kernel each)
    for cell, o in enumerate(first):
        groups.setdefault(o // blk, []).append(cell)
    outs, lses, order = [], [], []
    L, B = q4.shape[0], q4.shape[1]
    for f, cells in groups.items():
        idx = torch.tensor(cells, device=q.device)
        flat = [t[idx].reshape((len(cells) * B,) + tuple(t.shape[2:])) for t in (q4, k4, v4)]
        OWNER.append((tuple(lead), tuple(cells)))
        try:
            o, lse = _slots(*flat, f, blk, ring, step, causal, balanced, scale)
        finally:
            OWNER.pop()
        outs.append(o.reshape((len(cells), B) + tuple(o.shape[1:])))
        lses.append(lse.reshape((len(cells), B) + tuple(lse.shape[1:])))
        order += cells
    out, lse = torch.cat(outs), torch.cat(lses)
    if order != sorted(order):
        back = torch.argsort(torch.tensor(order, device=q.device))
        out, lse = out[back], lse[back]
    return (out.reshape(tuple(lead) + tuple(out.shape[1:])),
            lse.reshape(tuple(lead) + tuple(lse.shape[1:])))


def _parse(q, k, v, *, ring, step, causal=True, balanced=True, scale=None):
    _check(q, k, v, ring, step, causal, balanced, scale)
    return (q, k, v), {"ring": ring, "step": step, "causal": causal, "balanced": balanced,
                       "scale": None if scale is None else float(scale)}


def ring_rule(q, k, v, *, ring, **_):
    """The step is block-diagonal over the ring's slots: batch, heads, or the sequence
    over a mesh dim of exactly ``ring`` ranks (one slot each) pass without communication;
    keys whole within a slot, head_dim whole."""
    opts_of = []
    for d in range(q.mesh.ndim):
        opts = [((R, R, R), (R, R), "replicated")]
        if q.shape[0] > 1:
            opts.append(((Shard(0),) * 3, (Shard(0), Shard(0)), "batch sharded"))
        if q.shape[1] > 1:
            kv = Shard(1) if k.shape[1] > 1 else R
            opts.append(((Shard(1), kv, kv), (Shard(1), Shard(1)), "heads sharded"))
        if q.mesh.shape[d] == ring > 1:
            opts.append(((Shard(2),) * 3, (Shard(2), Shard(2)),
                         "sequence on the ring: each rank its slot and the K/V it holds"))
        opts_of.append(opts)
    sts = combine(q.mesh.ndim, opts_of, 3, n_outputs=2)
    return [s for s in sts if sum(p.is_shard(2) for p in s.inputs[0]) <= 1
            and _heads_line_up(q, k, s)]


def slot_pairs(S: int, ring: int, i: int, j: int, causal: bool, balanced: bool) -> int:
    """(query, key) pairs slot i computes against slot j's K/V (skipped chunks: none)."""
    c = S // (2 * ring if balanced else ring)
    return sum(c * c if kind == "full" else c * (c + 1) // 2
               for _, _, kind in block_pairs(i, j, ring, causal, balanced) if kind != "skipped")


def _cost(ins, outs, layout=None, *, ring, step, causal, balanced, **_):
    """FlashAttention-2's count (``workbench.ops.flash_attention``'s cost: 2 (D + Dv) FLOPs
    per attended pair forward, 2 (3 D + 2 Dv) backward) on the pairs the busiest rank
    attends: skipped chunks cost nothing."""
    q, k, v = ins
    B, H, Sl, D = q.shape
    Dv = v.shape[3]
    S = Sl if layout is None else layout[1][0].shape[2]
    blk = S // ring

    def pairs(start, n):
        return sum(slot_pairs(S, ring, s, (s - step) % ring, causal, balanced)
                   for s in range(start // blk, (start + n) // blk))
    if layout is None:
        busiest = pairs(0, Sl)
    else:
        mesh, specs, st = layout
        busiest = max(pairs(*L.shard_bounds(specs[0].shape, mesh, st.inputs[0], r)[2])
                      for r in mesh.ranks)
    saved = sum(costs.nbytes(t) for t in (*ins, *outs))
    # backward reads dO and the saved q, k, v, O, lse and writes dq, dk, dv: no gradient of
    # the lse is read (FlashAttention-2's backward, Dao 2023 Algorithm 2: inputs Q, K, V,
    # O, dO, L; the ring's backward hands each step the merged lse, not a dlse), as
    # plan.context_cost.ring_times counts it
    c = costs.Cost(2 * busiest * B * H * (D + Dv), sum(costs.nbytes(t) for t in (*ins, *outs)),
                   2 * busiest * B * H * (3 * D + 2 * Dv),
                   costs.backward_bytes(ins, outs[:1], saved))
    # priced at the profile's rate for its shape (attention_pricing.py): the causal mask
    # runs inside the kernel at step 0 only (later steps: whole blocks, or none)
    return with_shape(c, q, causal and step == 0)


_cost.wants_layout = True


def _sample(g):
    q, k, v = g.rn(2, 2, 8, 4), g.rn(2, 1, 8, 4), g.rn(2, 1, 8, 4)          # GQA
    return [Sample(ring_attention_step, (q, k, v), {"ring": 2, "step": 1}),
            Sample(ring_attention_step, (q, k, v), {"ring": 2, "step": 0, "balanced": False}),
            Sample(ring_attention_step, (q, q, q), {"ring": 2, "step": 1, "causal": False})]


register(_OP, [ring_attention_step], parse=_parse, rule=ring_rule, local=_local, cost=_cost,
         op_class="attention", n_out=2, meta_check=False, sample=_sample)
