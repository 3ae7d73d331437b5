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
  A DistTensor that the op would slice along the ordered dim counts as an input sharded
  there.
* other dims in that order, whole on the ring's mesh dim, are recorded beside it
  (``_ring_also``, :func:`propagate_whole`): a matmul's output columns are its second
  input's last dim (the keys of ``q @ k.transpose(-2, -1)``, gathered by the rule), its
  rows its first input's; elementwise ops and norms (softmax) keep a same-shaped input's.
* :func:`check_op` (the dispatcher, before the op runs) refuses, naming the fix, what
  would give another answer than one device on the sequence in its own order: an op
  that reads positions along a recorded dim (:func:`sensitive_dims`: scans, flip, roll,
  slices and picks, index_select / gather, argmax / sort / topk / mode (their indices would
  count the ring's order), pad, unfold's windows, convolutions and pools, tril / triu, split
  / cat, repeat / tile
  along it, the data-dependent ops that list elements in the order met (nonzero,
  masked_select, ``x[mask]``, unique_consecutive, unsorted unique or its inverse), a view
  that merges the dim with another or splits it (its order could not be recorded); causal
  attention outside ``context_parallel``; ``x[i] = v`` at positions or with values in the
  sequence's own order, :func:`check_write`), and
  an op where a recorded dim meets a tensor varying along it whose order is not recorded
  the same: a plain tensor (a causal mask ``torch.triu(torch.ones(S, S), 1)``, a
  key-padding mask, RoPE's cos/sin tables from positions 0..S-1), a DistTensor with no
  record that is whole on the ring's mesh dim, or one recorded on another dim (a mask
  laid out along its rows, whose keys are not), or a DistTensor sharded there by hand with
  no record (``distribute_tensor(t, mesh, [Shard(1)])`` of a sequence in its own order, or
  of one put in ring order by hand: they look the same; ``set_ring_order`` states the
  latter).  Permuting such a plain tensor "into" the order would be exact only if it were
  in the sequence's own order, and one put in ring order by hand (``cos[perm]``, this
  module's earlier advice) looks the same: refused either way, with the fix
  (``F.scaled_dot_product_attention(..., is_causal=True)`` inside ``context_parallel``;
  a table laid out with ``to_ring_layout``, as PyTorch's ``context_parallel(buffers=,
  buffer_seq_dims=)`` shards the buffers it is handed, and the recipe's
  ``_ring_positions`` now does; or ``from_ring_layout`` first).  A tensor of one value
  along the dim (``torch.ones``, ``full``; ``ones_like`` of a recorded tensor carries its
  record) is order-free and passes.  PyTorch's ``context_parallel`` runs any of these on
  its sharded buffers without a word.  Contiguous slots (``balanced=False``) are the
  sequence's own order and one rank is its own: neither is checked.

A tensor with no recorded order may still be in ring order (laid out by hand,
``shard_tensor(ring_order(t, p, 2), ...)``): "not recorded" means "not known", and
load-balanced causal attention inside ``context_parallel`` refuses it, naming
``to_ring_layout``, as ``from_ring_layout`` does (undoing an order it may not be in would
scramble it) and any op where it meets a recorded one; ``set_ring_order`` states it.
PyTorch keeps the same fact on the context instead
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
from .placement import Shard

__all__ = ["RingOrder", "ring_order_of", "set_ring_order", "same_order", "propagate",
           "check_order", "check_op", "sensitive_dims", "reordering", "orders_of",
           "propagate_whole", "check_write", "RingOrderError"]


class RingOrderError(ValueError):
    """An op refused because it would read a ring-ordered dim by position (check_op)."""


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
    out._ring_also = getattr(x, "_ring_also", ())
    return out


def orders_of(x) -> tuple:
    """Every recorded order of DistTensor ``x``'s dims: its sequence's (``_ring_order``)
    and other dims known to be in that order, whole on the ring's mesh dim
    (``_ring_also``: the keys of a score matrix ``q @ k.transpose(-2, -1)``)."""
    if type(x) is not DistTensor:
        return ()
    o = getattr(x, "_ring_order", None)
    also = getattr(x, "_ring_also", ())
    return ((o,) + tuple(also)) if o is not None else tuple(also)


_MATMULS = frozenset(("matmul", "bmm", "mm"))
_TOKENWISE = frozenset(("moe_combine", "attach_aux_loss"))    # (G, S, ...) token by token


def _also(w, orders):
    """Record ``orders`` on output ``w`` beside its sequence's (one per dim)."""
    if type(w) is not DistTensor:
        return
    main = getattr(w, "_ring_order", None)
    have = {o.dim for o in ((main,) if main is not None else ())}
    keep = []
    ps = w.placements
    for o in orders:
        if o.mesh_dim < len(ps) and ps[o.mesh_dim].is_shard() and \
                ps[o.mesh_dim].dim % w.ndim == o.dim:
            continue        # sharded there: its order is propagate's to tell (an input
            #                 sharded there with no record of it leaves it unknown)
        if o.dim not in have and 0 <= o.dim < w.ndim:
            have.add(o.dim)
            keep.append(o)
    if keep:
        w._ring_also = tuple(getattr(w, "_ring_also", ())) + tuple(keep)


def propagate_whole(opdef, inputs, out_shapes, wrapped, attrs=None) -> None:
    """The dims in ring order that are whole on the ring's mesh dim, or that the op's rule
    gathered: a matmul's output columns are its second input's last dim (``q @ k^T``:
    the keys), its rows its first input's rows; an einsum's output letter is in the order
    of its input dim of that letter; an elementwise op or a norm (position by
    position along every dim, or a softmax / normalisation along one: its output in the
    input's order) keeps its same-shaped input's. Every other op loses them (nothing
    known). ``check_op`` holds an op to them as to the sequence's."""
    if len(wrapped) != 1:
        return
    w, shape = wrapped[0], out_shapes[0]
    if opdef.name in _MATMULS and len(inputs) >= 2:
        a, b = inputs[0], inputs[1]
        got = []
        if type(a) is DistTensor and a.ndim >= 2:
            got += [RingOrder(o.mesh_dim, o.ring, len(shape) - 2, o.balanced)
                    for o in orders_of(a) if o.dim == a.ndim - 2]
        if type(b) is DistTensor and b.ndim >= 2:
            got += [RingOrder(o.mesh_dim, o.ring, len(shape) - 1, o.balanced)
                    for o in orders_of(b) if o.dim == b.ndim - 1]
        _also(w, got)
    elif opdef.name == "einsum" and attrs is not None and "equation" in attrs:
        # each output letter in the order of the input dim of that letter (the rows of
        # "bsh,bth->bst" are x's sequence, its columns y's)
        lhs, rhs = attrs["equation"].split("->")
        got = []
        for x, subs in zip(inputs, lhs.split(",")):
            if type(x) is not DistTensor or len(subs) != x.ndim:
                continue
            for o in orders_of(x):
                c = subs[o.dim]
                if c in rhs and rhs.count(c) == 1:
                    got.append(RingOrder(o.mesh_dim, o.ring, rhs.index(c), o.balanced))
        _also(w, got)
    elif opdef.name in _TOKENWISE:
        # token t of the output from token t of the inputs (G, S, ...): moe_combine sums
        # token t's own k choices (weights (G, S, k), ops/moe.py), attach_aux_loss is y
        got = []
        for x in inputs:
            if type(x) is DistTensor:
                got += [o for o in orders_of(x) if o.dim < 2 and o.dim < len(shape)
                        and tuple(x.shape[:o.dim + 1]) == tuple(shape[:o.dim + 1])]
        _also(w, got)
    elif opdef.op_class in ("elementwise", "norm"):
        for x in inputs:
            if type(x) is DistTensor and tuple(x.shape) == tuple(shape):
                _also(w, orders_of(x))


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
    """The layers that handle the ring order themselves: those that put a sequence in or
    out of it (``to_ring_layout`` / ``from_ring_layout``, Ulysses' local reordering, the
    capacity router's, MoE's sequence order: their ``index_select`` along the recorded dim
    is the point) and the ring's own steps (``ring_attention``, whose inputs'
    order :func:`check_order` checked); :func:`check_op` lets their ops pass."""
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
    "nanmedian_all", "mode", "unfold"))
_LAST_TWO = frozenset(("tril", "triu"))           # a triangle of positions (rows, columns)
_SPATIAL = frozenset(("conv1d", "conv2d", "conv3d", "convolution", "avg_pool1d",
                      "avg_pool2d", "max_pool1d", "max_pool2d", "adaptive_avg_pool1d",
                      "adaptive_avg_pool2d"))    # neighbours along the last k dims


# ops whose output lists elements, or their positions, in the order it meets them (data
# dependent: dispatch_datadep.py): every dim of every tensor input
_LISTING = frozenset(("nonzero", "argwhere", "masked_select", "bool_mask_index"))
# views that keep a dim only where it stays one dim of the same length behind the same
# product of the dims before it (a merge with another dim, or a split, loses its order)
_RESHAPES = frozenset(("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze"))


def _kept_by_reshape(shape, out, d) -> bool:
    """Dim ``d`` of ``shape`` is one dim of ``out`` (same length, same product before it)."""
    out = tuple(out)
    if -1 in out:
        known = 1
        for n in out:
            known *= n if n != -1 else 1
        total = 1
        for n in shape:
            total *= n
        out = tuple(total // max(known, 1) if n == -1 else n for n in out)
    pre = 1
    for n in shape[:d]:
        pre *= n
    acc = 1
    for n in out:
        if acc == pre and n == shape[d]:
            return True
        acc *= n
        if acc > pre:
            return False
    return False


def _dims_of(v, ndim):
    if v is None:
        return set(range(ndim))
    if isinstance(v, int):
        return {v % ndim} if ndim else set()
    return {d % ndim for d in v if isinstance(d, int)}


def sensitive_dims(name, attrs, i, ndim, shape=None):
    """The dims of input ``i`` (of ``ndim`` dims, ``shape``) whose positions op ``name``
    reads (its answer changes when they are permuted, beyond permuting its output the same
    way), or whose order its output cannot record (a view merging the dim with another)."""
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
    if name in _LISTING:
        return set(range(ndim))          # elements (their indices) listed in its order
    if name == "unique_consecutive" or name == "unique" and (
            not attrs.get("sorted", True) or attrs.get("return_inverse")):
        # runs of equal neighbours; unsorted values in the order met; inverse indices
        # into an output built in that order (sorted unique values and counts are free)
        return _dims_of(attrs.get("dim"), ndim) if i == 0 else set()
    if i != 0:
        return set()
    if name == "repeat":
        reps = tuple(attrs.get("reps") or ())
        lead = len(reps) - ndim
        return {d for d in range(ndim) if 0 <= lead + d < len(reps) and reps[lead + d] != 1}
    if name in _RESHAPES and "shape" in attrs and shape is not None:
        return {d for d in range(ndim) if shape[d] != 1
                and not _kept_by_reshape(tuple(shape), attrs["shape"], d)}
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


def _how_read(name, attrs) -> str:
    """What op ``name`` does with the positions of the dim (for its refusal)."""
    if name in _LISTING or name in ("unique", "unique_consecutive"):
        return ("it lists elements, or their indices, in the order it meets them: "
                "data-dependent")
    if name == "unfold":
        return (f"its windows of {attrs.get('size')} neighbours, {attrs.get('step')} apart, "
                f"would hold positions of the ring's order")
    if name in _RESHAPES:
        return (f"to shape {tuple(attrs.get('shape', ()))} it merges the dim with another "
                f"or splits it, and the result's order could not be recorded")
    if name == "repeat":
        return f"it repeats the sequence end to end, reps {tuple(attrs.get('reps', ()))}"
    if name in ("argmax", "argmin", "sort", "argsort", "topk", "cummax", "cummin",
                "kthvalue_rows", "median_rows", "nanmedian", "mode"):
        return "its indices would count the ring's order, not the sequence's"
    return "its answer depends on which position is which"


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


def _aligned_dim(opdef, x, o, y, i, j, cand_dst, attrs):
    """The dim of input ``y`` (input ``j``) the op takes together with ``x``'s (input
    ``i``) ordered dim, or None."""
    if opdef.op_class == "attention":             # (q, k, v, mask): the mask's rows are
        if j != 3 or i > 2 or o.dim != 2:         # q's positions, its columns k's and v's
            return None
        e = y.ndim - 2 if i == 0 else y.ndim - 1
        return e if e >= 0 else None
    if opdef.name == "einsum" and "equation" in attrs:     # the dim of the same letter
        subs = attrs["equation"].split("->")[0].split(",")
        if max(i, j) >= len(subs) or len(subs[i]) != x.ndim or len(subs[j]) != y.ndim:
            return None
        c = subs[i][o.dim]
        return subs[j].index(c) if c in subs[j] else None
    if opdef.name in _MATMULS:                    # the contracted dims: x's last, y's rows
        if i == 0 and j == 1 and o.dim == x.ndim - 1 and y.ndim >= 2:
            return y.ndim - 2
        if i == 1 and j == 0 and x.ndim >= 2 and o.dim == x.ndim - 2:
            return y.ndim - 1
        if x.ndim >= 3 and y.ndim >= 3 and o.dim < x.ndim - 2:
            e = y.ndim - x.ndim + o.dim          # a batch dim: broadcast, right-aligned
            return e if 0 <= e < y.ndim - 2 else None     # over the batch dims
        if not (o.dim == x.ndim - 1 if i == 0 else o.dim == x.ndim - 2):
            return None                          # a row or column dim: the output's own
    if opdef.op_class == "elementwise":           # broadcasting, right-aligned
        e = o.dim - (x.ndim - y.ndim)
        return e if 0 <= e < y.ndim else None
    ps, mine = cand_dst[j], cand_dst[i]           # sliced along with it over the ring
    if ps is None or mine is None or len(ps) <= o.mesh_dim or len(mine) <= o.mesh_dim \
            or mine[o.mesh_dim] != Shard(o.dim):
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
    if _REORDERING[0] or opdef.name == "ring_attention_step":   # (the ring's own steps)
        return
    name = opdef.name
    dst = [None if s is None else
           (pl.dst if pl is not None and pl.steps else s.placements)
           for s, pl in zip(specs, plans)]
    for i, x, o in ((i, x, o) for i, x in enumerate(inputs) for o in orders_of(x)):
        if not o.balanced or o.ring < 2:
            continue
        if o.dim in sensitive_dims(name, attrs, i, x.ndim, tuple(x.shape)):
            raise RingOrderError(
                f"{name}: input {i} (shape {tuple(x.shape)}) has its {o} (to_ring_layout), "
                f"and {name} reads positions along dim {o.dim} ({_how_read(name, attrs)}): "
                f"on the ring's order it would give another answer than on the sequence's "
                f"own (a causal triangle, a scan, a slice or an index would count positions "
                f"in the wrong order). "
                + _fix(x, o, name) + (
                    "; for causal attention call F.scaled_dot_product_attention(q, k, v, "
                    "is_causal=True) (inside context_parallel it runs as the load-balanced "
                    "ring)" if name in _LAST_TWO else ""))
        if opdef.op_class == "attention" and o.dim == 2 and i < 3 and (
                attrs.get("causal") or attrs.get("pattern") is not None):
            axis = x.mesh.dim_names[o.mesh_dim] if o.mesh_dim < x.mesh.ndim else o.mesh_dim
            raise RingOrderError(
                f"{name}: causal (or patterned) attention on {'qkv'[i]} (shape "
                f"{tuple(x.shape)}) whose {o} (to_ring_layout), outside context_parallel: "
                f"its mask would compare positions in the ring's order as if they were the "
                f"sequence's. Fix: run it inside `with context_parallel(mesh, {axis!r}):` "
                f"(load-balanced ring attention, which knows the order), or "
                + _fix(x, o, name)[5:])
        for j, y in enumerate(inputs):
            if j == i or not isinstance(y, (torch.Tensor, DistTensor)) or y.ndim == 0:
                continue
            e = _aligned_dim(opdef, x, o, y, i, j, dst, attrs)
            if e is None or y.shape[e] == 1:
                continue
            rs = orders_of(y)
            if RingOrder(o.mesh_dim, o.ring, e, o.balanced) in rs:
                continue                         # laid out the same way, recorded
            r = rs[0] if rs else None
            if type(y) is not DistTensor and not _varies(y, e):
                continue                         # one value along it: order-free
            if r is None and type(y) is DistTensor and len(y.placements) > o.mesh_dim \
                    and y.placements[o.mesh_dim] == Shard(e):
                axis = x.mesh.dim_names[o.mesh_dim] if o.mesh_dim < x.mesh.ndim \
                    else o.mesh_dim
                raise RingOrderError(
                    f"{name}: input {j}, a DistTensor sharded Shard({e}) on mesh dim "
                    f"{axis!r} with no record of its sequence's order (shape "
                    f"{tuple(y.shape)}: distribute_tensor / shard_tensor / reshard of a "
                    f"sequence), meets input {i} (shape {tuple(x.shape)}) along its dim "
                    f"{o.dim}, which is in {o} (to_ring_layout): a sequence sharded in its "
                    f"own order would meet the wrong positions, and one put in ring order "
                    f"by hand looks the same. Fix: lay it out with to_ring_layout("
                    f"distribute_tensor(t, mesh, [Replicate()] * mesh.ndim), {axis!r}, {e}) "
                    f"from the sequence in its own order; if it is in that ring order "
                    f"already, say so: seq_order.set_ring_order(y, RingOrder({o.mesh_dim}, "
                    f"{o.ring}, {e}, True)); or " + _fix(x, o, name)[5:])
            what = "a plain tensor" if type(y) is not DistTensor else (
                f"a DistTensor recorded as {r}" if r is not None else
                "a DistTensor with no record of its sequence's order")
            mask = opdef.name in ("masked_fill", "where", "add", "sub") or y.dtype == torch.bool
            raise RingOrderError(
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


def check_write(x, index, mask, value, vals, where) -> None:
    """``x[index] = value`` (``setitem``, ``index_put_``) on ``x`` with a dim in load-balanced
    ring order: refused where the written positions (``mask``, x's shape) vary along it and
    the index is not one DistTensor in that order (a bool mask computed from x's values,
    ``x[x > 1] = 0``, is), or where the written values (``vals``) vary along it and
    ``value`` is not a DistTensor in that order: a position or a table in the sequence's
    own order would land on the wrong tokens. ``index``/``value``: as the caller was given
    them (DistTensors kept)."""
    if _REORDERING[0]:
        return
    parts = index if isinstance(index, tuple) else (index,)
    for o in orders_of(x):
        if not o.balanced or o.ring < 2:
            continue
        want = RingOrder(o.mesh_dim, o.ring, o.dim, o.balanced)
        known_idx = len(parts) == 1 and type(parts[0]) is DistTensor and \
            tuple(parts[0].shape) == tuple(x.shape) and want in orders_of(parts[0])
        known_val = type(value) is DistTensor and any(
            r.mesh_dim == o.mesh_dim and r.ring == o.ring and r.balanced == o.balanced
            for r in orders_of(value))
        if not known_idx and _varies(mask, o.dim):
            what = "positions"
        elif not known_val and isinstance(vals, torch.Tensor) and vals.ndim == x.ndim \
                and _varies(vals, o.dim):
            what = "values"
        else:
            continue
        raise RingOrderError(
            f"{where}: x (shape {tuple(x.shape)}) has its {o} (to_ring_layout), and the "
            f"{what} written vary along dim {o.dim} with no record of that order (an index "
            f"or a tensor in the sequence's own order, or a DistTensor whose order is not "
            f"recorded): they would land on the wrong tokens. Fix: index with a mask or "
            f"values computed from x's ring-ordered tensors, or lay the index / values out "
            f"with to_ring_layout; or " + _fix(x, o, where)[5:])
