"""Context parallelism by all-to-all: DeepSpeed-Ulysses (``cp_comm="a2a"``).

The ring (:mod:`.context_parallel`) keeps each rank's queries and passes K/V blocks round.
DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", arXiv 2309.14509, sec. 3)
turns the sequence-sharded q, k, v into head-sharded full sequences by one all-to-all
each, runs ordinary attention on the rank's heads, and turns the output back:

    q, k, v: (B, H, S/p, D) on each rank  --all-to-all-->  (B, H/p, S, D)     3 all-to-alls
    o = attention(q, k, v)  on the rank's H/p heads, the whole sequence         (local)
    o: (B, H/p, S, D)  --all-to-all-->  (B, H, S/p, D)                          1 all-to-all

Backward is the same four all-to-alls in reverse (dO in, dQ, dK, dV out): each is the
backward of the reshard ``Shard(2) -> Shard(1)`` on the cp mesh dim (an all-to-all whose
gradient is the inverse all-to-all, traced and priced by the clock as every reshard).
Per layer a rank sends (p-1)/p of each of its four (B, H, S/p, D) blocks: 4 B S H D e
(p-1)/p^2 bytes forward, as many backward; the paper's "aggregate communication volume
per link of 4Nh/P" (sec. 3.2, N = S, h = H D, counted per element) is that figure
without the (p-1)/p a rank keeps: constant when S and p grow together.

The degree is bounded by the heads: every rank needs whole heads. Transformer Engine
refuses cp_comm_type='a2a' unless both the query heads and the K/V heads divide by cp
(NVIDIA/TransformerEngine d0067d0d ``transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py``:4246-4249), as DeepSpeed of 2023 did for its
heads (microsoft/DeepSpeed 38327e07 ``deepspeed/sequence/layer.py``:34); so does this
module (GQA with fewer K/V heads than cp ranks: the fix is cp_comm="p2p", the ring, or a cp
that divides the K/V heads).  DeepSpeed since deals heads out unevenly and asserts only
more heads than ranks (deepspeedai/DeepSpeed edaa7221 ``deepspeed/sequence/layer.py``:
190-254: 7 heads over 4 ranks as 2, 2, 2, 1); uneven heads are not built here. The hierarchical "a2a+p2p" (a2a inside, ring across:
``context_parallel.py``:5020) is not built.

With tensor parallelism (Megatron-LM ``--cp-comm-type a2a`` beside ``--tensor-model-parallel-
size``) the heads are split over tp first: each tp rank holds heads / tp of q and of k/v
(NVIDIA/Megatron-LM d98e8a64 ``megatron/core/transformer/attention.py``:364-367; TE's
``DotProductAttention`` likewise, ``dot_product_attention.py``:739 at d0067d0d), and the
all-to-all over the cp group (the ranks of one tp rank, stride tp in Megatron's rank order
"tp-cp-ep-dp-pp", ``parallel_state.py``:617) splits those tp-local heads further: TE views
the rank's (b, H / tp, s / cp, d) block as (b, cp, H / (tp cp), s / cp, d) and sends piece c
to cp rank c (``context_parallel.py``:456-467), so cp rank c of tp rank t attends heads
t H / tp + c H / (tp cp) + [0, H / (tp cp)), and TE's condition (:4246) is on the tp-local
heads: (H / tp) and (H_kv / tp) divisible by cp.  Here the same: one all-to-all per tensor
over cp of each rank's own block (:func:`_swap`), nothing on tp; that layout is not a
placement list (tp's head split outside cp's, where the mesh order (dp, cp, tp) puts cp
outside), so the head-sharded q, k, v are held as the DistTensors of their heads in the
order (cp rank, tp rank, head), a relabelling that moves no data: attention treats every
head alone (and a query head's K/V head stays on its rank: both split alike), and the
output's all-to-all back undoes it.  Per rank and layer: 4 blocks of (b, s / cp, H / tp,
d), (cp-1)/cp of each sent, tp times less than at tp = 1 (tp groups run side by side).

Megatron-Core names the choice ``cp_comm_type`` (NVIDIA/Megatron-LM d98e8a64:
``megatron/training/arguments.py``:3221 ``--cp-comm-type`` p2p | a2a | allgather | a2a+p2p,
per layer; ``megatron/core/transformer/transformer_config.py``:1030;
``megatron/core/extensions/transformer_engine.py``:2063-2153 hands it to TE's
``DotProductAttention``, whose ``attn_forward_func_with_cp`` (TE ``context_parallel.py``:
4924, :5123) runs ``AttnFuncWithCPAndQKVOA2A`` (:4170) for "a2a"): this library's
``cp_comm`` keyword takes the same names ("p2p", "a2a").

Layout: the sequence may be in the ring's load-balanced order (rank i holds chunks i and
2p-1-i, :func:`~.context_parallel.to_ring_layout`); after the all-to-all each rank holds
the whole sequence in that order and puts it back in sequence order before attention
(a local reordering), as Transformer Engine's a2a path reorders the chunks after its
all-to-all (``context_parallel.py``:4338, ``reorder_seq_chunks_for_a2a_before_attn``).
Load balancing does not matter here: every rank attends the whole sequence.
"""
from __future__ import annotations

import math

import torch

from ...sim_mesh import collectives as C
from ...sim_mesh.trace import current_trace
from .. import storage
from ..dist_tensor import DistTensor
from ..placement import Shard
from ..reshard import reshard
from ..seq_order import check_order, reordering, ring_order_of, set_ring_order
from ..ops_table.ring_attention import slot_positions

__all__ = ["ulysses_attention", "check_ulysses_heads", "ulysses_bytes", "CP_COMMS"]

CP_COMMS = ("p2p", "a2a")   # Megatron-LM's --cp-comm-type names (a2a+p2p, all_gather: not built)


def check_ulysses_heads(hq: int, hkv: int, cp: int, where: str, tp: int = 1) -> None:
    """Raise ValueError naming the heads and the fix unless both head counts divide by tp
    and each tp rank's heads by cp (module docstring: Transformer Engine's and DeepSpeed's
    condition on the tp-local heads)."""
    if tp > 1:
        for name, h in (("query", hq), ("key/value", hkv)):
            if h % tp:
                raise ValueError(
                    f"{where}: tensor parallelism gives each of the tp={tp} ranks whole "
                    f"heads, but the {name} heads ({h}; q {hq}, k/v {hkv}) do not divide by "
                    f"{tp}. Fix: a tp dividing both head counts")
    lq, lkv = hq // tp, hkv // tp
    for name, h in (("query", lq), ("key/value", lkv)):
        if h % cp:
            good = [c for c in range(2, lkv + 1) if lq % c == 0 and lkv % c == 0]
            if tp == 1:
                heads = f"the {name} heads ({h}; q {hq}, k/v {hkv})"
            else:
                heads = (f"each tp rank's {name} heads ({h * tp} / tp={tp} = {h}; q {hq} / "
                         f"{tp} = {lq}, k/v {hkv} / {tp} = {lkv})")
            raise ValueError(
                f"{where}: cp_comm='a2a' (DeepSpeed-Ulysses) gives each of the cp={cp} ranks "
                f"whole heads, but {heads} do not divide by {cp}. Fix: use cp_comm='p2p' "
                f"(ring attention, no head limit), or a cp dividing both "
                + ("head counts" if tp == 1 else "per-tp-rank head counts")
                + f" ({good or 'none > 1'})" + (", or a smaller tp" if tp > 1 else ""))


def ulysses_bytes(shape_q, shape_kv_k, shape_kv_v, p: int, itemsize: int) -> int:
    """Bytes one rank sends in the forward's four all-to-alls of q (B, Hq, S, D), k, v
    and the output (q's shape, v's head dim): (p-1)/p of each local (S/p) block."""
    def block(shape):
        n = 1
        for s in shape:
            n *= s
        return n // p * itemsize * (p - 1) // p
    out = tuple(shape_q[:3]) + (shape_kv_v[3],)
    return sum(block(s) for s in (shape_q, shape_kv_k, shape_kv_v, out))


def _check_inputs(q, k, v, axis, where):
    """The cp ranks p and the mesh dims that shard the heads beside cp (tp), or an error
    naming the fix."""
    mesh = q.mesh
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, DistTensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}; give DistTensors whose "
                            f"sequence (dim 2) is sharded over the cp mesh dim")
        if t.mesh != mesh:
            raise ValueError(f"{where}: q, k, v live on different meshes; reshard them onto one")
        if t.ndim != 4 or t.placements[axis] != Shard(2):
            raise ValueError(f"{where}: {name} (shape {tuple(t.shape)}, placements "
                             f"{list(t.placements)}) must be 4-d (batch, heads, seq, head_dim) "
                             f"with its sequence sharded, Shard(2), on mesh dim "
                             f"{mesh.dim_names[axis]!r}; reshard it")
        for a, pl in enumerate(t.placements):
            if a != axis and pl.is_shard(2):
                raise ValueError(
                    f"{where}: {name} is {pl} on mesh dim {mesh.dim_names[a]!r} as well: the "
                    f"all-to-all needs the whole sequence off the cp dim (sequence "
                    f"parallelism gathers it on tp before the QKV projection). Fix: "
                    f"replicate dim 2 on {mesh.dim_names[a]!r}, or use cp_comm='p2p' (the "
                    f"ring)")
            if pl.is_partial():
                raise ValueError(f"{where}: {name} is {pl} on mesh dim {mesh.dim_names[a]!r}; "
                                 f"reduce it first (reshard to Replicate)")
    heads = tuple(a for a, pl in enumerate(q.placements) if a != axis and pl.is_shard(1))
    for name, t in (("k", k), ("v", v)):
        mine = tuple(a for a, pl in enumerate(t.placements) if a != axis and pl.is_shard(1))
        if mine != heads:
            raise ValueError(
                f"{where}: q's heads are sharded on mesh dims "
                f"{[mesh.dim_names[a] for a in heads]}, {name}'s ({list(t.placements)}) on "
                f"{[mesh.dim_names[a] for a in mine]}: the all-to-all splits each rank's "
                f"heads of q, k and v alike. Fix: shard the K/V heads as q's (tensor "
                f"parallelism: k/v heads divisible by tp), or use cp_comm='p2p' (the ring)")
    p = mesh.shape[axis]
    tp = math.prod(mesh.shape[a] for a in heads)
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{where}: q has {q.shape[1]} heads, k {k.shape[1]} and v "
                         f"{v.shape[1]}: grouped-query attention needs k and v alike and "
                         f"their heads dividing q's")
    check_ulysses_heads(q.shape[1], k.shape[1], p, where, tp)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] % p:
            raise ValueError(f"{where}: {name}'s sequence ({t.shape[2]}) does not divide by "
                             f"cp={p}: the all-to-all moves equal blocks; pad the sequence "
                             f"to a multiple of {p}")
        for a, pl in enumerate(t.placements):
            n = mesh.shape[a]
            if pl.is_shard() and t.shape[pl.dim] % n:
                raise ValueError(f"{where}: {name} (shape {tuple(t.shape)}) is {pl} on mesh "
                                 f"dim {mesh.dim_names[a]!r} of {n} ranks: dim {pl.dim} does "
                                 f"not divide; use a multiple of {n}")
    return p, heads


def _swap(t, axis: int, to_heads: bool):
    """One all-to-all over mesh dim ``axis`` of each rank's own block, the heads already
    sharded on other mesh dims (tp): ``to_heads`` scatters the rank's heads (dim 1) and
    gathers the sequence (dim 2), as TE's ``flash_attn_a2a_communicate`` (module
    docstring); else back. The head-sharded result is the DistTensor of the heads in
    (cp rank, tp rank, head) order (a relabelling, no data moved but the all-to-all's);
    the swap back restores the order."""
    mesh = t.mesh
    ps = list(t.placements)
    ps[axis] = Shard(1) if to_heads else Shard(2)
    ps = tuple(ps)
    x = storage.for_layout(t._local, t.shape, mesh, t.placements, ps)
    split, concat = (1, 2) if to_heads else (2, 1)
    label = (f"{t.placements[axis]}->{ps[axis]} on {mesh.dim_names[axis]} (heads of each "
             f"tp rank)" if current_trace() is not None else "")
    y = C.all_to_all(x, mesh, axis, split, concat, label=label)
    return DistTensor(storage.settle(y, t.shape, mesh, ps), mesh, ps, t.shape, t.dtype,
                      t.names)


def ulysses_attention(q, k, v, mesh_dim="cp", *, causal: bool = True, balanced: bool = True,
                      scale: float | None = None):
    """DeepSpeed-Ulysses attention (module docstring) of q (B, Hq, S, D) against k, v
    (B, Hkv, S, D*), DistTensors whose sequence is sharded (``Shard(2)``) over
    ``mesh_dim``; ``balanced``: the sequence is in the ring's load-balanced order
    (:func:`~.context_parallel.to_ring_layout`), else contiguous: the default, True, is
    :func:`~.context_parallel.ring_attention`'s, ``to_ring_layout``'s and ``ring_order``'s
    (was False: q, k, v laid out by those defaults got a causal mask over the wrong
    positions, 1.2 off one device's output where the ring was exact). Returns the output
    (B, Hq, S, Dv), laid out as q; equal to ``flash_attention(q, k, v, causal=causal)``
    of the sequences in their own order. Four all-to-alls forward, four backward. The
    heads may be sharded on other mesh dims too (tensor parallelism), alike for q, k and
    v: the all-to-all then splits each tp rank's heads over cp (module docstring)."""
    where = "ulysses_attention"
    for name, b in (("causal", causal), ("balanced", balanced)):
        if not isinstance(b, bool):
            raise TypeError(f"{where}: {name}={b!r}; give True or False")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{where}: scale={scale!r}; give a float or None (1/sqrt(head_dim))")
    if not isinstance(q, DistTensor):
        raise TypeError(f"{where}: q is a {type(q).__name__}; give DistTensors whose sequence "
                        "(dim 2) is sharded over the cp mesh dim")
    axis = q.mesh.dim(mesh_dim)
    p, heads = _check_inputs(q, k, v, axis, where)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if balanced and t.shape[2] % (2 * p):
            raise ValueError(f"{where}: balanced=True (the ring's load-balanced order, 2 x cp "
                             f"= {2 * p} chunks) on {name}'s sequence of {t.shape[2]} tokens, "
                             f"which does not divide by {2 * p}; pass balanced=False if q, k, v "
                             f"are in contiguous slots, or use a sequence length that is a "
                             f"multiple of {2 * p}")
    check_order((q, k, v), axis, p, balanced, causal, where)
    mesh = q.mesh

    def to(t, dim):
        if heads:                   # each tp rank's heads split further over cp (_swap)
            return _swap(t, axis, dim == 1)
        ps = list(t.placements)
        ps[axis] = Shard(dim)
        return reshard(t, mesh, ps)
    # the sequence gathered, the heads scattered: one all-to-all each (Shard(2) -> Shard(1))
    hq, hk, hv = (to(t, 1) for t in (q, k, v))
    pos = slot_positions(q.shape[2], p, True).to(q.device) if balanced else None
    if pos is not None:             # ring order -> sequence order, locally on each rank,
        # each by its own length: keys of another length than the queries (attention to a
        # longer context) were put back in the queries' order, which dropped the rest
        # (silently: 0.7 off one device's output); one index per length, shared (each
        # index_select saves its index for backward: the dry run counts them)
        inv = {n: torch.argsort(slot_positions(n, p, True).to(q.device))
               for n in {t.shape[2] for t in (hq, hk, hv)}}
        with reordering():
            hq, hk, hv = (torch.index_select(t, 2, inv[t.shape[2]]) for t in (hq, hk, hv))
    from ... import ops
    o = ops.flash_attention(hq, hk, hv, causal=causal, scale=scale)
    if pos is not None:
        with reordering():
            o = torch.index_select(o, 2, pos)
    if heads and o.placements != hq.placements:     # the swap back reads q's head layout
        o = reshard(o, mesh, hq.placements)
    # the heads gathered, the sequence scattered back, in q's order (seq_order.py)
    return set_ring_order(to(o, 2), ring_order_of(q))
