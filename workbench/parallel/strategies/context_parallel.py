"""Context parallelism: the sequence sharded over a mesh dim, attention as a ring.

Every op of a transformer block but attention works token by token, so a sequence
sharded over ``cp`` ranks (``Shard(seq)`` on the "cp" mesh dim) runs them unchanged.
Attention needs every key of a row. Ring attention (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers"; Megatron-Core's context parallelism in
TransformerEngine ``AttnFuncWithCPAndKVP2P``) keeps the queries where they are and
passes the K/V blocks around the ring of cp ranks:

    for step t = 0 .. p-1:                     # rank i holds the K/V of rank (i - t) mod p
        if t < p-1: send my K/V block to rank i+1, receive from rank i-1   (async)
        (o_t, lse_t) = my queries against the K/V block I hold              (overlapped)
        merge: lse = log(e^lse + e^lse_t);  o = o e^(lse_old - lse) + o_t e^(lse_t - lse)
        wait for the K/V of the next step

The merge by log-sum-exp is FlashAttention's online softmax across blocks (Dao 2023,
FlashAttention-2, eq. for the rescaled running output): exact, whatever the order of the
blocks. Each rank sends and receives p-1 K/V blocks forward (2 (p-1) tensors: K and V).

Backward, as PyTorch's ring runs it (``context_parallel_backward.py``): the ring keeps
only q, k, v, the merged output and the merged log-sum-exp; each step's block backward
runs against those global statistics (every block's gradient exact up to one kernel's
rounding), dQ accumulates in float32 where it is, the K/V blocks go round again (p-1
sends) and each block's float32 dK/dV travel with it, back to the owner (p sends), which
waits for them at the end; cast to the input dtype once.

Causal load balancing: with a causal mask, contiguous slots would give rank p-1 2p-1 times
the work of rank 0. The sequence is cut into 2p chunks and rank i holds chunks i and
2p-1-i (Megatron-LM / TransformerEngine context parallelism; Llama 3, Dubey et al. 2024
sec. 3.3.2): every step after the first, every rank computes exactly half a block (its
queries against one K/V chunk, or its second query chunk against both), and fully
masked chunk pairs are skipped (``ops_table/ring_attention.py``). A sequence is laid out
so with :func:`to_ring_layout` (``x[:, slot_positions(S, p)]``); its positions (RoPE
tables, learned position ids) must be laid out the same way, with ``to_ring_layout``
(a plain table, a natural-order causal mask, and an op reading positions along the
ring order are refused: ``seq_order.check_op``).

``context_parallel(mesh, "cp")`` is PyTorch's ``torch.distributed.tensor.experimental.
context_parallel`` idea: while it is active, attention on DistTensors whose query is
sequence-sharded on that mesh dim (``wb.ops.flash_attention``, ``F.scaled_dot_product_
attention``) runs as :func:`ring_attention`; every other op runs as usual. With
``cp_comm="a2a"`` (Megatron-LM's ``--cp-comm-type a2a``) it runs as DeepSpeed-Ulysses'
all-to-all attention instead (:mod:`.context_parallel_a2a`).

The order of the sequence. ``Shard(2)`` of a sequence in ring order and of one in its own
order look alike, and a load-balanced causal ring on the latter is wrong (0.9 to 1.9 off
one device's output at cp 2 and 4, with no error, before this was checked). PyTorch keeps
the order on the context (its ``context_parallel(mesh, buffers=, buffer_seq_dims=)``
reorders the buffers it is handed, its attention assumes that order of every input, and
``context_parallel_unshard`` undoes it), so a DTensor sharded another way gets the same
wrong answer there; DTensor's ``_StridedShard`` carries an interleaving in the placement.
Two designs were weighed. (a) The order in the placement (a ``Shard`` that carries it):
``full()`` and every reshard would then be in the sequence's own order, but every rule of
the op table reads ``Shard(d)`` and would have to learn the new placement or refuse it,
and a rule that treated it as a plain ``Shard`` would silently lose the order: the whole
table is the surface. (b), built here: ``to_ring_layout`` records the order on the
tensor (:mod:`workbench.parallel.seq_order`), the dispatcher keeps it exactly where an
op's rule keeps the ordered dim sharded over the ring with its length (elementwise ops,
linear layers, norms, views, transposes, RoPE's products, embedding lookups), reshards
and ``detach`` keep it, and everywhere else it is lost; causal attention in the
load-balanced context requires it and refuses a sequence without it, naming
``to_ring_layout`` (reordering such a sequence "exactly" would assume it is in its own
order, and a sequence laid out in ring order by hand, ``ring_order``, looks the same).
Safe by default: an op nobody taught gives no record, so a refusal, never a wrong
attention. ``full()`` of a ring-ordered tensor stays in ring order, as before
(:func:`from_ring_layout` undoes it). Direct calls of :func:`ring_attention` and
``ulysses_attention`` say the order themselves (``balanced``): a recorded order that is
another one is refused, an unrecorded one is taken as they say.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import autocast as _autocast
from ..dist_tensor import DistTensor
from ..placement import Replicate, Shard
from ..reshard import reshard
from ..seq_order import (RingOrder, check_order, orders_of, reordering, ring_order_of,
                         set_ring_order)
from ..ops_table.ring_attention import (block_pairs, check_ring, ring_attention_step,
                                        slot_chunks, slot_positions)
from .. import storage
from .context_parallel_autograd import autograd_in_context, tensor_backward_args
from .context_parallel_backward import ring_attention_function
from .context_parallel_comm import ring_pass, wait
from .context_parallel_a2a import CP_COMMS, ulysses_attention

__all__ = ["ring_attention", "ring_pass", "context_parallel", "to_ring_layout",
           "from_ring_layout", "ring_order", "slot_positions", "slot_chunks",
           "ring_schedule", "check_ring", "wait", "ulysses_attention"]


# ---- ring attention ---------------------------------------------------------------------------

def _check_inputs(q, k, v, mesh_dim, where):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, DistTensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}; give DistTensors whose "
                            f"sequence (dim 2) is sharded over mesh dim {mesh_dim!r}")
    mesh = q.mesh
    if k.mesh != mesh or v.mesh != mesh:
        raise ValueError(f"{where}: q, k, v live on different meshes; reshard them onto one")
    axis = mesh.dim(mesh_dim)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4 or t.placements[axis] != Shard(2):
            raise ValueError(f"{where}: {name} (shape {tuple(t.shape)}, placements "
                             f"{list(t.placements)}) must be 4-d (batch, heads, seq, head_dim) "
                             f"with its sequence sharded, Shard(2), on mesh dim "
                             f"{mesh.dim_names[axis]!r}; reshard it, or lay the sequence out "
                             f"with to_ring_layout")
    return mesh, axis


def ring_attention(q, k, v, mesh_dim="cp", *, causal: bool = True, balanced: bool = True,
                   scale: float | None = None):
    """Attention of q (B, Hq, S, D) against k, v (B, Hkv, S, D*), DistTensors whose sequence
    is sharded over ``mesh_dim`` in the ring layout (``balanced``: rank i holds chunks i
    and 2p-1-i, :func:`to_ring_layout`; else contiguous slots), by passing K/V blocks
    around the ring. Returns the output (B, Hq, S, Dv), laid out as q. Equal to
    ``flash_attention(q, k, v, causal=causal)`` of the sequences in their original order.
    Its backward is the ring's (``context_parallel_backward.py``): each block's backward
    against the merged output and log-sum-exp, dK/dV passed round with K/V."""
    mesh, axis = _check_inputs(q, k, v, mesh_dim, "ring_attention")
    for name, b in (("causal", causal), ("balanced", balanced)):
        if not isinstance(b, bool):
            raise TypeError(f"ring_attention: {name}={b!r}; give True or False")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"ring_attention: scale={scale!r}; give a float (the scores' factor, "
                        "1/sqrt(head_dim) when None) or None")
    p = mesh.shape[axis]
    check_ring(q.shape[2], p, balanced, "ring_attention")
    check_order((q, k, v), axis, p, balanced, causal, "ring_attention")
    label = f"ring attention K/V on {mesh.dim_names[axis]}"

    def forward(q, k, v):
        with reordering():          # the ring's own steps: the order is checked above
            return _ring_forward(q, k, v, axis, p, causal, balanced, scale, label)
    order = ring_order_of(q)                # the output's rows are q's: its order too
    if not torch.is_grad_enabled() or not any(storage.requires_grad(t._local)
                                              for t in (q, k, v)):
        _check_even(q, k, v)
        return set_ring_order(forward(q, k, v)[0], order)
    q, k, v, expand = _aligned(q, k, v, axis)
    _check_even(q, k, v)
    return set_ring_order(ring_attention_function(
        forward, q, k, v, axis=axis, ring=p, causal=causal, balanced=balanced, scale=scale,
        label=label, expand=expand), order)


def _check_even(*ts):
    """Every sharded dim of q, k, v divides by its mesh dim: the ring moves one block per
    rank, all of one shape (uneven batch or heads shards are refused with the fix)."""
    for name, t in zip("qkv", ts):
        for a, pl in enumerate(t.placements):
            n = t.mesh.shape[a]
            if pl.is_shard() and t.shape[pl.dim] % n:
                raise ValueError(
                    f"ring_attention: {name} (shape {tuple(t.shape)}) is {pl} on mesh dim "
                    f"{t.mesh.dim_names[a]!r} of {n} ranks, and its dim {pl.dim} "
                    f"({t.shape[pl.dim]}) does not divide by {n}: the ring needs even shards; "
                    f"use a batch (dp) or a head count (tp) that is a multiple of {n}, or "
                    f"replicate that dim")


def _ring_forward(q, k, v, axis, p, causal, balanced, scale, label):
    """The ring's forward on DistTensors: (output in q's dtype, merged log-sum-exp, the
    blocks' dtype)."""
    out = lse = kdtype = None
    for t in range(p):
        handles = ()
        if t < p - 1:                     # the next step's K/V, sent while this step computes
            (k_next, v_next), handles = ring_pass([k, v], axis, label=label)
        o_t, lse_t = ring_attention_step(q, k, v, ring=p, step=t, causal=causal,
                                         balanced=balanced, scale=scale)
        kdtype = o_t.dtype
        acc = torch.promote_types(o_t.dtype, torch.float32)
        if o_t.dtype != acc:              # the running output in float32 (float64 inputs:
            o_t = o_t.to(acc)             # float64), as FlashAttention keeps its accumulator
        if out is None:
            out, lse = o_t, lse_t
        else:                             # online softmax across blocks (FlashAttention-2)
            m = torch.maximum(lse, lse_t)
            new = m + torch.log(torch.exp(lse - m) + torch.exp(lse_t - m))
            out = (out * torch.exp(lse - new).unsqueeze(-1)
                   + o_t * torch.exp(lse_t - new).unsqueeze(-1))
            lse = new
        if t < p - 1:
            wait(handles)
            k, v = k_next, v_next
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse, kdtype


def _aligned(q, k, v, axis):
    """q, k, v laid out alike off the ring's mesh dim (what ``ring_attention_step``'s rule
    would ask): q's batch or heads may be sharded there (anything else, and a Partial q,
    is resharded to Replicate); k and v follow q, resharded, except a single K/V head
    (GQA) replicated beside q's sharded heads: each rank gets its own copy (``expand``)."""
    mesh = q.mesh
    ok = (Replicate(), Shard(0), Shard(1))
    ps = [p if a == axis or p in ok else Replicate() for a, p in enumerate(q.placements)]
    if tuple(ps) != q.placements:
        q = reshard(q, mesh, ps)
    out, expand = [q], [()]
    for t in (k, v):
        want, ax = list(t.placements), []
        for a, p in enumerate(q.placements):
            if a == axis or t.placements[a] == p:
                continue
            if p == Shard(1) and t.placements[a].is_replicate() and t.shape[1] == 1:
                ax.append(a)
            else:
                want[a] = p
        out.append(t if tuple(want) == t.placements else reshard(t, mesh, want))
        expand.append(tuple(ax))
    return (*out, tuple(expand))


# ---- laying a sequence out on the ring --------------------------------------------------------

def ring_order(t: torch.Tensor, ring: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """A plain tensor's sequence ``dim`` in ring order (slot 0's tokens, then slot 1's...)."""
    return t.index_select(dim, slot_positions(t.shape[dim], ring, balanced).to(t.device))


def _seq_dim(x, dim, where) -> int:
    """``dim`` as a non-negative sequence dim of ``x``, or an error naming the range."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{where}: dim={dim!r} on a {x.ndim}-d tensor (shape "
                         f"{tuple(x.shape)}); give the sequence dim, an int in "
                         f"[{-x.ndim}, {x.ndim - 1}]")
    return dim % x.ndim


def to_ring_layout(x: DistTensor, mesh_dim="cp", dim: int = 1, balanced: bool = True):
    """``x`` (whole along sequence ``dim`` on ``mesh_dim``) in ring order, sharded over
    ``mesh_dim``: rank i then holds chunks i and 2p-1-i (``balanced``), or slot i."""
    axis = x.mesh.dim(mesh_dim)
    p = x.mesh.shape[axis]
    dim = _seq_dim(x, dim, "to_ring_layout")
    if not x.placements[axis].is_replicate():
        raise ValueError(f"to_ring_layout: x is {x.placements[axis]} on mesh dim "
                         f"{x.mesh.dim_names[axis]!r}; give it whole (Replicate) there")
    if (got := ring_order_of(x)) is not None and got.dim == dim:
        raise ValueError(f"to_ring_layout: x's {got} already (laid out by to_ring_layout); "
                         "a second reordering would scramble it. Fix: use x as it is, or "
                         "undo the first with from_ring_layout")
    perm = slot_positions(x.shape[dim], p, balanced).to(x.device)
    with reordering():                  # (the reordering the record will say)
        y = torch.index_select(x, dim, perm)
    ps = list(y.placements)
    ps[axis] = Shard(dim)
    return set_ring_order(reshard(y, y.mesh, ps), RingOrder(axis, p, dim, balanced))


def from_ring_layout(x: DistTensor, mesh_dim="cp", dim: int = 1, balanced: bool = True):
    """The inverse of :func:`to_ring_layout`: the sequence in its original order, whole on
    ``mesh_dim`` (an all-gather, then a local reordering). ``x`` must carry the record of
    that order (``to_ring_layout`` and the ops that keep it leave it; ``set_ring_order``
    states it for a layout made by hand): one without is refused (load-balanced, over
    more than one rank), as a sequence in its own order looks the same."""
    axis = x.mesh.dim(mesh_dim)
    p = x.mesh.shape[axis]
    dim = _seq_dim(x, dim, "from_ring_layout")
    got, want = ring_order_of(x), RingOrder(axis, p, dim, balanced)
    if got is not None and got != want and p > 1:
        raise ValueError(f"from_ring_layout: x's {got} (mesh dim {got.mesh_dim}), not "
                         f"{want} (mesh dim {axis}): undoing that would scramble it. Fix: "
                         f"pass the mesh_dim, dim and balanced that to_ring_layout was given")
    if got is None and p > 1 and balanced and want not in orders_of(x):
        # not known to be in ring order: a sequence sharded in its own order looks the same
        # (distribute_tensor, reshard, an op that lost the record), and "undoing" an order
        # it is not in would scramble it
        raise ValueError(
            f"from_ring_layout: x (shape {tuple(x.shape)}, placements {list(x.placements)}) "
            f"has no record of its dim {dim} being in {want}: a sequence in its own order "
            f"looks the same, and reordering it would scramble it. Fix: if it is in its own "
            f"order, use it as it is (reshard it to Replicate on "
            f"{x.mesh.dim_names[axis]!r}); if it was laid out in ring order by hand, say so "
            f"first: seq_order.set_ring_order(x, RingOrder({axis}, {p}, {dim}, True)); "
            f"to_ring_layout records the order itself, and ops that keep it pass it on")
    ps = list(x.placements)
    ps[axis] = Replicate()
    y = reshard(x, x.mesh, ps)
    inv = torch.argsort(slot_positions(x.shape[dim], p, balanced)).to(x.device)
    with reordering():                  # (undoing the recorded order)
        return set_ring_order(torch.index_select(y, dim, inv), None)


# ---- the context manager ----------------------------------------------------------------------

class context_parallel(TorchFunctionMode):
    """``with context_parallel(mesh, "cp"):`` attention on DistTensors whose query is
    sequence-sharded (``Shard(2)``) on mesh dim "cp" runs as :func:`ring_attention`
    (causal, or no mask); anything else, a mask tensor, dropout, is refused with the fix.
    A mixture-of-experts router with a capacity (``wb.ops.router_topk``) on tokens
    sequence-sharded (``Shard(1)``) on "cp", in ring order, routes them in sequence
    order, as one device does. ``cp_comm``: "p2p" (the ring) or "a2a" (DeepSpeed-Ulysses:
    :func:`~.context_parallel_a2a.ulysses_attention`), Megatron-LM's ``--cp-comm-type``."""

    def __init__(self, mesh, mesh_dim="cp", *, balanced: bool = True, cp_comm: str = "p2p"):
        if not isinstance(balanced, bool):
            raise TypeError(f"context_parallel(balanced={balanced!r}): give True (rank i holds "
                            "chunks i and 2cp-1-i) or False (contiguous slots)")
        if cp_comm not in CP_COMMS:
            raise ValueError(f"context_parallel(cp_comm={cp_comm!r}): give one of {CP_COMMS} "
                             "(Megatron-LM's --cp-comm-type; 'a2a+p2p' and 'all_gather' are "
                             "not built)")
        super().__init__()
        self.mesh, self.axis, self.balanced = mesh, mesh.dim(mesh_dim), balanced
        self.cp_comm = cp_comm
        self.name = mesh.dim_names[self.axis]

    def _mine(self, q) -> bool:
        return isinstance(q, DistTensor) and q.mesh == self.mesh and q.ndim == 4 \
            and q.placements[self.axis] == Shard(2)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is _flash():
            q = args[0] if args else kwargs.get("query", kwargs.get("q"))
            if self._mine(q):
                return self._ring(func, args, kwargs)
            self._refuse_ring_ordered(func, q, args, kwargs)
        if func is torch.autograd.backward or func is torch.autograd.grad:
            return autograd_in_context(self, func, types, args, kwargs)
        if func is torch.Tensor.backward:       # loss.backward() on a plain tensor
            return autograd_in_context(self, torch.autograd.backward, types,
                                       *tensor_backward_args(args, kwargs))
        if func is _router() and self.balanced and kwargs.get("capacity") is not None:
            logits = args[0] if args else kwargs.get("logits")
            if isinstance(logits, DistTensor) and logits.mesh == self.mesh \
                    and logits.ndim == 3 and logits.placements[self.axis] == Shard(1):
                return self._route_in_sequence_order(func, logits, args[1:], kwargs)
        return func(*args, **kwargs)

    def _route_in_sequence_order(self, func, logits, rest, kwargs):
        """A mixture-of-experts router with a capacity on tokens in ring order: tokens
        claim their experts' slots in sequence order (GShard's priority, ``ops/moe.py``),
        so the router runs on the sequence in its own order and its per-token outputs go
        back to ring order (the per-sequence aux loss does not depend on the order).
        Tokens whose order is not recorded as the ring's (seq_order.py) are refused: in
        their own order they would be put "back" into a scrambled one."""
        p = self.mesh.shape[self.axis]
        got = ring_order_of(logits)
        if p > 1 and got != RingOrder(self.axis, p, 1, True):
            how = "with no record of their order" if got is None else f"recorded as {got}"
            raise ValueError(
                f"context_parallel({self.name!r}): router_topk(..., capacity=...) on logits "
                f"(shape {tuple(logits.shape)}) sharded Shard(1) on mesh dim {self.name!r} "
                f"{how}: tokens claim their experts' slots in sequence order, and the "
                f"load-balanced context takes them in its ring order. Fix: lay the model's "
                f"input out with to_ring_layout(x, {self.name!r}, 1) (the order is kept to "
                f"the router), or run context_parallel(..., balanced=False) for tokens in "
                f"their own order")
        pos = slot_positions(logits.shape[1], p, True)
        pos = pos.to(logits.device)                     # ring slot -> original position
        with reordering():              # (the recorded order undone, then redone)
            z = torch.index_select(logits, 1, torch.argsort(pos))
        kwargs = {n: v for n, v in kwargs.items() if n != "logits"}
        w, e, slots, aux = func(z, *rest, **kwargs)
        with reordering():              # (back in the logits' order: recorded so)
            w, e, slots = (set_ring_order(torch.index_select(t, 1, pos), got)
                           for t in (w, e, slots))
        return w, e, slots, aux

    def _refuse_ring_ordered(self, func, q, args, kwargs):
        """Causal attention on a query of this mesh that is not sequence-sharded on cp:
        with load balancing its sequence is in ring order (chunks i and 2p-1-i side by
        side), where a plain causal mask hides the wrong keys; refused, not computed."""
        if not (self.balanced and isinstance(q, DistTensor) and q.mesh == self.mesh):
            return
        sdpa = func is F.scaled_dot_product_attention
        pos, name = (5, "is_causal") if sdpa else (4, "causal")
        causal = args[pos] if len(args) > pos else kwargs.get(name, False)
        if causal:
            op = "scaled_dot_product_attention" if sdpa else "flash_attention"
            raise ValueError(
                f"context_parallel({self.name!r}): {op}(..., {name}=True) on a query laid out "
                f"{[str(p) for p in q.placements]} (shape {tuple(q.shape)}): inside the "
                "load-balanced context the sequences of this mesh are in ring order, where a "
                "plain causal mask hides the wrong keys. Fix: shard the query, key and value "
                f"on the sequence, Shard(2), over mesh dim {self.name!r} (reshard the layer's "
                "input back to the residual stream's layout), or run this attention outside "
                "the context")

    def _ring(self, func, args, kwargs):
        sdpa = func is F.scaled_dot_product_attention
        # torch.autocast's cast first, as the dispatcher applies it to attention on
        # DistTensors (parallel/autocast.py: "lower", bfloat16 under CPU autocast): this
        # mode runs before the dispatcher, and the ring computed float32 inputs in float32
        # where one device's attention gives bfloat16 (Ulysses' SDPA was cast already)
        kind = _autocast.policy_for("scaled_dot_product_attention" if sdpa
                                    else "flash_attention", args, kwargs)
        if kind is not None:
            args, kwargs = _autocast.cast_args(kind, args, kwargs)
        names = (("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                  "enable_gqa") if sdpa else ("q", "k", "v"))
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k, v = (a.get(n) for n in names[:3])
        mask = a.get("attn_mask" if sdpa else "mask")
        causal = bool(a.get("is_causal" if sdpa else "causal", False))
        op = "scaled_dot_product_attention" if sdpa else "flash_attention"
        where = f"context_parallel({self.name!r}): {op}"
        if mask is not None:
            raise ValueError(f"{where} with mask={type(mask).__name__}: the ring balances only "
                             "causal attention (causal=True) or attention without a mask; an "
                             "arbitrary mask cannot be load-balanced over the ring. Fix: pass "
                             "causal=True and no mask, or run attention without context "
                             "parallelism (cp=1)")
        if float(a.get("dropout_p", 0.0) or 0.0) > 0:
            raise ValueError(f"{where}: dropout_p={a['dropout_p']} is not supported on the "
                             "ring; set the model's dropout to 0 (cfg.replace(dropout=0.0)) or "
                             "use cp=1")
        if a.get("return_lse"):
            raise NotImplementedError(f"{where}: return_lse=True under context parallelism")
        if a.get("tile_stats") is not None:        # the ring runs its own kernels
            raise ValueError(f"{where}: tile_stats counts the reference kernel's tiles of one "
                             "call; the ring runs one kernel per step and chunk, which it "
                             "does not fill. Fix: count tiles outside context_parallel (cp=1)")
        if sdpa and not a.get("enable_gqa", False) and q.shape[1] != k.shape[1]:
            raise ValueError(f"{where}: q has {q.shape[1]} heads and k {k.shape[1]}; pass "
                             "enable_gqa=True for grouped-query attention")
        if not self._mine(k) or not self._mine(v):
            raise ValueError(f"{where}: q is sequence-sharded on {self.name!r} but k or v is "
                             "not; shard all three the same way")
        # the order of the sequence is checked against the context's (seq_order.py): a
        # sequence sharded in its own order is indistinguishable from the ring's by
        # placements alone, so only a recorded order (to_ring_layout's) is load-balanced
        check_order((q, k, v), self.axis, self.mesh.shape[self.axis], self.balanced, causal,
                    where, known=True)
        if self.cp_comm == "a2a":
            return ulysses_attention(q, k, v, self.axis, causal=causal,
                                     balanced=self.balanced, scale=a.get("scale"))
        return ring_attention(q, k, v, self.axis, causal=causal, balanced=self.balanced,
                              scale=a.get("scale"))


def _flash():
    from ... import ops
    return ops.flash_attention


def _router():
    from ...ops import moe
    return moe.router_topk


# ---- the ring, step by step, as data ------------------------------------------------------------

def ring_schedule(p: int, *, causal: bool = True, balanced: bool = True) -> list[dict]:
    """Step-by-step record of ring attention over ``p`` ranks, plain data for a figure: one
    dict per (step, rank) with the K/V slot it holds (``kv_from``), where it sends it
    (``send_to``; None on the last step), its query and K/V chunks, and every (query chunk,
    key chunk, kind) pair, kind "full" | "diagonal" | "skipped" (causal mask), plus the
    fraction of a whole block it computes (``work``)."""
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"ring_schedule: p={p!r}; give the number of cp ranks, an int >= 1")
    for name, b in (("causal", causal), ("balanced", balanced)):
        if not isinstance(b, bool):
            raise TypeError(f"ring_schedule: {name}={b!r}; give True or False")
    rows = []
    for t in range(p):
        for i in range(p):
            j = (i - t) % p
            pairs = block_pairs(i, j, p, causal, balanced)
            n = len(pairs)
            work = sum(1.0 if kind == "full" else 0.5 if kind == "diagonal" else 0.0
                       for _, _, kind in pairs) / n
            rows.append({"step": t, "rank": i, "kv_from": j,
                         "send_to": (i + 1) % p if t < p - 1 else None,
                         "q_chunks": slot_chunks(i, p, balanced),
                         "kv_chunks": slot_chunks(j, p, balanced),
                         "pairs": pairs, "work": work})
    return rows
