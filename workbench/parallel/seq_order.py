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

import contextlib
from dataclasses import dataclass

import torch

from .dist_tensor import DistTensor

__all__ = ["RingOrder", "ring_order_of", "set_ring_order", "same_order", "propagate",
           "check_order", "check_op", "sensitive_dims", "reordering"]


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


# ---- ops that read positions along a dim in ring order -------------------------------------

_REORDERING = [0]


@contextlib.contextmanager
def reordering():
    """The layers that put a sequence in or out of ring order themselves
    (``to_ring_layout`` / ``from_ring_layout``, Ulysses' local reordering, the capacity
    router's, MoE's sequence order): their ``index_select`` along the recorded dim is the
    point, so :func:`check_op` lets it pass."""
    _REORDERING[0] += 1
    try:
        yield
    finally:
        _REORDERING[0] -= 1


# ops whose output reads positions along their ``dim`` / ``dims`` attribute (None: every
# dim, a flattened index): scans, reversals and shifts, slicing and picking by position,
# indices of extremes and of a sort, splitting and joining along it
_ALONG = frozenset((
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "flip", "roll",
    "argmax", "argmin", "sort", "argsort", "msort", "topk", "kthvalue_rows", "median_rows",
    "nanmedian", "chunk", "split", "unbind", "cat", "gather", "index_select", "index_add",
    "index_fill", "scatter", "scatter_add", "repeat_interleave", "take", "multinomial",
    "nanmedian_all"))
_LAST_TWO = frozenset(("tril", "triu"))           # a triangle of positions (rows, columns)
_SPATIAL = frozenset(("conv1d", "conv2d", "conv3d", "convolution", "avg_pool1d",
                      "avg_pool2d", "max_pool1d", "max_pool2d", "adaptive_avg_pool1d",
                      "adaptive_avg_pool2d"))    # neighbours along the last k dims


def _dims_of(v, ndim):
    if v is None:
        return set(range(ndim))
    if isinstance(v, int):
        return {v % ndim} if ndim else set()
    return {d % ndim for d in v if isinstance(d, int)}


def sensitive_dims(name, attrs, i, ndim):
    """The dims of input ``i`` (of ``ndim`` dims) whose positions op ``name`` reads (its
    answer changes when they are permuted, beyond permuting its output the same way)."""
    if name in _ALONG:
        if i != 0 and name != "cat":
            return set()                 # an index, a source: taken position by position
        if "dim" in attrs:
            return _dims_of(attrs["dim"], ndim)
        if "dims" in attrs:
            return _dims_of(attrs["dims"], ndim)
        return set(range(ndim))          # take, nanmedian_all, multinomial: flattened
    if name == "searchsorted":
        return {ndim - 1} if i == 0 else set()
    if i != 0:
        return set()
    if name in _LAST_TWO:
        return {ndim - 2, ndim - 1} if ndim >= 2 else set()
    if name == "diagonal":
        return _dims_of((attrs.get("dim1", 0), attrs.get("dim2", 1)), ndim)
    if name in _SPATIAL:
        k = attrs.get("k", 1)
        return set(range(ndim - k, ndim))
    if name == "pad":
        pad = attrs.get("pad") or ()
        return {ndim - 1 - j // 2 for j in range(len(pad)) if pad[j]}
    if name == "getitem":
        idx, d, out = attrs.get("index", ()), 0, set()
        for item in idx if isinstance(idx, tuple) else ():
            if not (isinstance(item, tuple) and item):
                return set(range(ndim))  # an index the table did not normalize
            if item[0] == "new":
                continue
            if item[0] != "all":
                out.add(d)
            d += 1
        return out
    return set()


def _fix(x, o, where):
    axis = x.mesh.dim_names[o.mesh_dim] if o.mesh_dim < x.mesh.ndim else o.mesh_dim
    return (f"Fix: undo the layout first, y = from_ring_layout(x, {axis!r}, {o.dim}) (the "
            f"sequence in its own order, whole on {axis!r}), run {where} on it, and lay "
            f"the result out again with to_ring_layout where the sequence goes on")


def _varies(y, e) -> bool:
    """Plain tensor ``y`` is not one value along its dim ``e`` (a table of ones, a full()
    bias, is order-free)."""
    with torch.no_grad():
        first = y.narrow(e, 0, 1)
        return not bool((y == first).all()) if y.numel() else False


def _aligned_dim(opdef, x, o, y, j, cand_dst):
    """The dim of input ``y`` the op takes together with ``x``'s ordered dim, or None."""
    if opdef.op_class == "elementwise":           # broadcasting, right-aligned
        e = o.dim - (x.ndim - y.ndim)
        return e if 0 <= e < y.ndim else None
    ps = cand_dst[j]                              # sliced along with it over the ring
    if ps is None or len(ps) <= o.mesh_dim:
        return None
    p = ps[o.mesh_dim]
    return p.dim % y.ndim if p.is_shard() else None


def check_op(opdef, inputs, specs, plans, attrs) -> None:
    """Refuse an op that would give a silently wrong answer on a sequence in load-balanced
    ring order (module docstring): one that reads positions along the recorded dim
    (:func:`sensitive_dims`: a scan, a flip, a slice, an argmax, a pad, a convolution, a
    causal triangle), or one that meets the recorded dim with a tensor whose order is not
    known to be the same (a plain causal mask or RoPE table, built in the sequence's own
    order, varying along it). Contiguous slots are the sequence's own order, and one rank
    is its own order: both pass. Called by the dispatcher before the op runs."""
    if _REORDERING[0]:
        return
    name = opdef.name
    dst = [None if s is None else
           (pl.dst if pl is not None and pl.steps else s.placements)
           for s, pl in zip(specs, plans)]
    for i, x in enumerate(inputs):
        o = getattr(x, "_ring_order", None) if type(x) is DistTensor else None
        if o is None or not o.balanced or o.ring < 2:
            continue
        if o.dim in sensitive_dims(name, attrs, i, x.ndim):
            raise ValueError(
                f"{name}: input {i} (shape {tuple(x.shape)}) has its {o} (to_ring_layout), "
                f"and {name} reads positions along dim {o.dim}: on the ring's order it would "
                f"give another answer than on the sequence's own (a causal triangle, a scan, "
                f"a slice or an index would count positions in the wrong order). "
                + _fix(x, o, name) + (
                    "; for causal attention call F.scaled_dot_product_attention(q, k, v, "
                    "is_causal=True) (inside context_parallel it runs as the load-balanced "
                    "ring)" if name in _LAST_TWO else ""))
        for j, y in enumerate(inputs):
            if j == i or not isinstance(y, torch.Tensor) or y.ndim == 0:
                continue
            r = getattr(y, "_ring_order", None) if type(y) is DistTensor else None
            e = _aligned_dim(opdef, x, o, y, j, dst)
            if e is None or y.shape[e] == 1:
                continue
            if r is not None and (r.mesh_dim, r.ring, r.dim, r.balanced) == \
                    (o.mesh_dim, o.ring, e, o.balanced):
                continue                         # laid out the same way, recorded
            if type(y) is not DistTensor and not _varies(y, e):
                continue                         # one value along it: order-free
            what = "a plain tensor" if type(y) is not DistTensor else (
                f"a DistTensor recorded as {r}" if r is not None else
                "a DistTensor with no record of its sequence's order")
            mask = opdef.name in ("masked_fill", "where", "add", "sub") or y.dtype == torch.bool
            raise ValueError(
                f"{name}: input {j}, {what} (shape {tuple(y.shape)}), meets input {i} (shape "
                f"{tuple(x.shape)}) along its dim {o.dim}, which is in {o} (to_ring_layout), "
                f"and varies along it (its dim {e}): a causal mask or a position table "
                f"(RoPE cos/sin) built in the sequence's own order would meet the wrong "
                f"positions, and a ring-ordered copy looks the same. "
                + ("Fix: for causal attention call F.scaled_dot_product_attention(q, k, v, "
                   "is_causal=True) (inside context_parallel it runs as the load-balanced "
                   "ring; a mask's keys are in ring order too), or " if mask else
                   "Fix: lay the table out as the sequence, whose order is then recorded: "
                   f"to_ring_layout(distribute_tensor(t, mesh, [Replicate()] * mesh.ndim), "
                   f"'cp', {e}) (PyTorch's context_parallel(buffers=[t], buffer_seq_dims="
                   f"[{e}])), or ")
                + _fix(x, o, name)[5:])
