"""The order a DistTensor's sequence is in: context parallelism's ring layout, recorded.

``to_ring_layout`` (``strategies/context_parallel.py``) permutes a sequence so that,
sharded over the cp ranks, rank i holds chunks i and 2p-1-i; from then on the global
tensor's sequence dim is in *ring order*, and nothing in its shape or placements says
so: ``Shard(2)`` of a sequence in its own order looks the same.  Causal attention must
know which order it has (the mask compares positions), so the order is recorded on the
tensor as a :class:`RingOrder` (``x._ring_order``), and kept exactly where it is known:

* :func:`workbench.reshard` keeps it (a reshard never changes the global tensor);
* an op on DistTensors keeps it (``propagate``, called by the dispatcher) when the op's
  rule keeps the ordered dim sharded over the ring's mesh dim with its length unchanged,
  ``Shard(d_in) -> Shard(d_out)``, and every input sharded there is in the same order:
  a rule that leaves a dim sharded with no communication computes each position from
  the same position of its inputs (elementwise ops, linear layers, norms, views and
  transposes, casts, embedding lookups, RoPE's products), so the output's ``d_out`` is
  in the input's order.  Everything else (an op whose rule gathers the sequence, an
  ``index_select`` along it, a view that merges it with another dim, an input sharded
  there whose order is not recorded) gives an output with no recorded order.
  A plain tensor in such an op (RoPE's cos/sin tables, a bias) is taken as it is given:
  tables along the sequence must come in the same order (the recipe reorders them,
  ``recipes/context_parallel.py`` ``_ring_positions``; PyTorch's ``buffers=`` shards
  them), which no record can check; a DistTensor that the op would slice along the
  ordered dim counts as an input sharded there.

A tensor with no recorded order may still be in ring order (laid out by hand,
``shard_tensor(ring_order(t, p, 2), ...)``): "not recorded" means "not known", and
load-balanced causal attention inside ``context_parallel`` refuses it, naming
``to_ring_layout``.  PyTorch keeps the same fact on the context instead
(``torch.distributed.tensor.experimental.context_parallel`` reorders the ``buffers`` it
is given and its attention assumes that order of every input; ``context_parallel_
unshard`` undoes it), so an input sharded another way gives a wrong attention there;
DTensor's ``_StridedShard`` records a different interleaving (split_factor) in the
placement itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .dist_tensor import DistTensor

__all__ = ["RingOrder", "ring_order_of", "set_ring_order", "same_order", "propagate",
           "check_order"]


@dataclass(frozen=True)
class RingOrder:
    """The global tensor's dim ``dim`` is in the ring order of ``ring`` ranks of mesh dim
    ``mesh_dim`` (an index): chunks i and 2p-1-i side by side (``balanced``), or, not
    balanced, contiguous slots (the sequence's own order, recorded all the same)."""
    mesh_dim: int
    ring: int
    dim: int
    balanced: bool

    def __str__(self) -> str:
        how = "load-balanced ring order" if self.balanced else "contiguous-slot ring order"
        return f"dim {self.dim} in {how} over {self.ring} ranks"


# torch.load(weights_only=True) of a saved ring-ordered DistTensor, as the placements are
# allowlisted (dist_tensor._allow_in_checkpoints)
torch.serialization.add_safe_globals([RingOrder])


def ring_order_of(x) -> RingOrder | None:
    """``x``'s recorded sequence order (None: not a DistTensor, or not known)."""
    return getattr(x, "_ring_order", None) if isinstance(x, DistTensor) else None


def set_ring_order(x, order: RingOrder | None):
    """Record ``order`` on DistTensor ``x`` (its values are already in that order) and
    return ``x``; for the layers that lay a sequence out themselves."""
    if order is not None and not 0 <= order.dim < x.ndim:
        raise ValueError(f"set_ring_order: {order} on a {x.ndim}-d tensor")
    x._ring_order = order
    return x


def same_order(out, x):
    """``out``, a new wrapper of ``x``'s values (a hook's, an autograd function's), with
    x's recorded order; returns ``out``."""
    out._ring_order = getattr(x, "_ring_order", None)
    return out


def propagate(inputs, specs, plans, outs_ps, out_shapes, wrapped) -> None:
    """The dispatcher's outputs ``wrapped`` get the inputs' order where the op keeps it
    (module docstring); ``specs``/``plans``: each input's spec and reshard plan (the
    placements the op ran on are the plan's destination)."""
    order = None
    for x in inputs:
        o = getattr(x, "_ring_order", None) if type(x) is DistTensor else None
        if o is not None:
            order = o
            break
    if order is None:
        return
    axis = order.mesh_dim
    length = None
    for x, spec, plan in zip(inputs, specs, plans):
        if spec is None or type(x) is not DistTensor:
            continue
        ps = plan.dst if plan is not None and plan.steps else spec.placements
        if len(ps) <= axis:
            return
        p = ps[axis]
        if not p.is_shard():
            continue                    # whole on the ring's dim: it maps no order
        o = getattr(x, "_ring_order", None)
        if o is None or o.mesh_dim != axis or o.ring != order.ring \
                or o.balanced != order.balanced or o.dim != p.dim % x.ndim:
            return                      # sharded there in an order not known to match
        length = x.shape[o.dim]
    if length is None:
        return
    for w, ps, shape in zip(wrapped, outs_ps, out_shapes):
        if type(w) is not DistTensor or len(ps) <= axis or not ps[axis].is_shard():
            continue
        d = ps[axis].dim % len(shape)
        if shape[d] == length:
            w._ring_order = RingOrder(axis, order.ring, d, order.balanced)


def check_order(qkv, axis, p, balanced, causal, where, *, known=False):
    """Causal attention over ``p`` ranks of mesh dim ``axis`` that takes q, k, v's sequence
    (dim 2) in ``balanced`` ring order: an order recorded on an input that is another one
    is refused (the mask would hide the wrong keys); ``known``: a sequence whose order is
    not recorded is refused too where that order is load-balanced (``context_parallel``,
    which cannot tell a sequence in its own order from one in ring order; a direct call's
    ``balanced`` says which it is). Attention without a mask takes any order of the keys,
    its output rows in q's."""
    if not causal or p == 1:                # one rank: the ring order is the sequence's
        return
    want = RingOrder(axis, p, 2, balanced)
    for name, t in zip("qkv", qkv):
        got = ring_order_of(t)
        if got is None and not (known and balanced):
            continue
        if got == want:
            continue
        how = "load-balanced ring order (rank i: chunks i and 2p-1-i)" if balanced else \
            "contiguous slots (the sequence's own order)"
        mesh = t.mesh
        cp = mesh.dim_names[axis]
        if got is None:
            raise ValueError(
                f"{where}: causal attention whose {name} (shape {tuple(t.shape)}) is "
                f"sharded Shard(2) on mesh dim {cp!r} with no record of its sequence's "
                f"order: the load-balanced ring takes the sequence in {how}, and a "
                f"sequence sharded in its own order (distribute_tensor, shard_tensor, "
                f"reshard) would get a causal mask over the wrong positions. Fix: lay the "
                f"model's input out with to_ring_layout(x, {cp!r}, dim, balanced=True), "
                f"whose order is recorded and kept through elementwise ops, linear "
                f"layers, norms, views and RoPE (an op that gathers or reorders the "
                f"sequence loses it), or, for a sequence sharded in its own order, run "
                f"context_parallel(..., balanced=False)")
        got_cp = mesh.dim_names[got.mesh_dim] if got.mesh_dim < mesh.ndim else got.mesh_dim
        raise ValueError(
            f"{where}: causal attention in {how} over {p} ranks of mesh dim {cp!r} on "
            f"{name} (shape {tuple(t.shape)}) whose sequence is recorded as {got} of mesh "
            f"dim {got_cp!r}: the causal mask would hide the wrong keys. Fix: lay q, k, v "
            f"out with to_ring_layout(..., balanced={balanced}) on {cp!r} (undo another "
            f"layout with from_ring_layout), or set balanced={got.balanced} to match, "
            f"with the sequence on dim 2")
