"""Storage: the local data of a DistTensor, whatever form it takes, behind one interface.

A DistTensor's ``_local`` takes one of three forms:

* **stacked** (the fast path): one tensor ``(*lead, *local)`` with one leading axis per
  mesh dim, of size ``mesh.shape[i]`` where the shards differ along mesh dim i and of
  size 1 where every rank holds the same data (a replicated copy is not stored);
* **cells**: uneven shards (``torch.chunk`` sizes differ), a :class:`Cells` grid of the
  same leading shape holding one tensor per cell;
* **own**: on torch.distributed, this process's shard only, stacked with every leading
  axis of size 1; uneven shards too (the collectives pad them: ``sim_mesh/padded.py``).

Only this module asks which form it holds.  ``dist_tensor.py`` and ``reshard.py`` call
the functions below: make a stack from a global tensor (:func:`from_global`), a rank's
view (:func:`rank_view`), the form a layout needs (:func:`for_layout`, :func:`settle`),
the tensors behind it (:func:`tensors`, :func:`map_tensors`), and the three local
transitions of a reshard (:func:`local_step`): slice a shard (R -> S), keep a part
(R -> P) and zero-pad into a partial sum (S -> P(sum)).  Each transition is written
once per rank (used by cells and by the own shard) plus one vectorized form for the
stack.  Collectives live below, in :mod:`workbench.sim_mesh.collectives`.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh import collectives as C
from ..sim_mesh import grid
from ..sim_mesh import padded as _padded
from ..sim_mesh.grid import Cells
from . import dist_uneven, layout
from .placement import Partial, Replicate, Shard

__all__ = ["Cells", "form", "holds_own", "is_cells", "from_global", "replicated",
           "from_own", "rank_view", "own", "own_coord", "rank_bytes", "to_cells", "to_stacked",
           "for_layout", "for_run", "settle", "tensors", "with_tensors", "requires_grad",
           "map_tensors", "device", "seeds_partial", "seed_like", "local_step", "run_per_cell",
           "keep_first_replica", "backward_scalar"]


def form(loc, mesh) -> str:
    """``"own"`` (torch.distributed), ``"cells"`` (uneven) or ``"stacked"``."""
    if _B.is_distributed(mesh):
        return "own"
    return "cells" if isinstance(loc, Cells) else "stacked"


def holds_own(mesh) -> bool:
    """True on torch.distributed: a DistTensor on ``mesh`` holds this process's shard."""
    return _B.is_distributed(mesh)


def own_coord(mesh):
    """This process's mesh coordinate on torch.distributed; None in the simulator (the
    stack holds every rank)."""
    return _B.coordinate(mesh) if _B.is_distributed(mesh) else None


def is_cells(loc) -> bool:
    """True for uneven shards held one tensor per cell."""
    return isinstance(loc, Cells)


# ---- building and viewing -------------------------------------------------------------

def from_global(x: torch.Tensor, mesh) -> torch.Tensor:
    """The replicated layout of the global tensor ``x``: a stack with every leading axis
    of size 1.  A copy: later in-place edits of ``x`` do not reach the DistTensor."""
    return x.clone().reshape((1,) * mesh.ndim + tuple(x.shape))


def replicated(x: torch.Tensor, mesh) -> torch.Tensor:
    """A plain tensor met by an op, as a replicated stack (a view: no copy)."""
    return x.reshape((1,) * mesh.ndim + tuple(x.shape))


def from_own(t: torch.Tensor, mesh) -> torch.Tensor:
    """This process's shard (torch.distributed) as the local data of a DistTensor."""
    return t.reshape((1,) * mesh.ndim + tuple(t.shape))


def rank_bytes(loc, nd: int) -> int:
    """Bytes of the largest shard one rank holds."""
    return grid.ops_for(loc).rank_bytes(loc, nd)


def _lead(loc, nd: int) -> tuple:
    return loc.lead if isinstance(loc, Cells) else tuple(loc.shape[:nd])


def rank_view(loc, mesh, rank: int) -> torch.Tensor:
    """The local shard ``rank`` holds (a view; no copy)."""
    c = mesh.coordinate(rank)
    if isinstance(loc, Cells):
        return loc[c]
    lead = loc.shape[:mesh.ndim]
    return loc[tuple(ci if n > 1 else 0 for ci, n in zip(c, lead))]


def own(loc, mesh) -> torch.Tensor:
    """This process's shard on torch.distributed (the stack without its size-1 lead)."""
    return loc.reshape(loc.shape[mesh.ndim:])


def to_cells(loc, nd: int) -> Cells:
    """The local data as Cells (one tensor per cell of the leading grid)."""
    if isinstance(loc, Cells):
        return loc
    lead = tuple(loc.shape[:nd])
    # an explicit leading size (not -1): a zero-size shard has no size to infer
    flat = loc.reshape((math.prod(lead),) + tuple(loc.shape[nd:]))
    return Cells(lead, list(flat.unbind(0)))


def to_stacked(cells) -> torch.Tensor:
    """Cells whose tensors have one shape, as one stack (the fast layout)."""
    if not isinstance(cells, Cells):
        return cells
    st = grid.stack(cells.items)         # per-cell gradients kept apart
    return st.reshape(tuple(cells.lead) + tuple(st.shape[1:]))


def for_layout(loc, shape, mesh, *placements):
    """The form in which every layout of ``placements`` can be held: stacked when all
    are even, cells otherwise (the own shard stays as it is)."""
    if _B.is_distributed(mesh):
        return loc
    for ps in placements:
        if not _is_even(shape, mesh, ps):
            return to_cells(loc, mesh.ndim)
    return to_stacked(loc)


_EVEN: dict = {}     # id(placements) -> (placements, shape, mesh, layout.is_even)


def _is_even(shape, mesh, ps) -> bool:
    """layout.is_even, remembered per placements object (a plan's steps and a DistTensor
    keep theirs: no placement is hashed again on the hot path)."""
    hit = _EVEN.get(id(ps))
    if hit is not None and hit[0] is ps and hit[2] is mesh and hit[1] == shape:
        return hit[3]
    even = layout.is_even(shape, mesh, ps)
    if type(ps) is tuple:
        if len(_EVEN) > 4096:
            _EVEN.clear()
        _EVEN[id(ps)] = (ps, shape, mesh, even)       # holds ps: its id stays its own
    return even


def for_run(loc, mesh, even: bool):
    """The form a local op runs on: the stack when the op's layouts are all even (once
    per op for every rank), cells otherwise (once per cell)."""
    if even:
        return to_stacked(loc) if isinstance(loc, Cells) else loc
    if _B.is_distributed(mesh):
        return loc                      # this process's shard, whatever its length
    return to_cells(loc, mesh.ndim)


def settle(loc, shape, mesh, placements):
    """Cells that a now even layout ``placements`` allows are stacked again."""
    if isinstance(loc, Cells) and layout.is_even(shape, mesh, placements):
        return to_stacked(loc)
    return loc


def tensors(loc) -> list[torch.Tensor]:
    """The tensors that hold the data (one per cell, or the one stack)."""
    return list(loc.items) if isinstance(loc, Cells) else [loc]


def requires_grad(loc) -> bool:
    """True if any tensor behind ``loc`` takes part in autograd."""
    if isinstance(loc, Cells):
        return any(t.requires_grad for t in loc.items)
    return loc.requires_grad


def with_tensors(loc, ts):
    """The same form holding ``ts`` (as many as :func:`tensors` gave) instead."""
    if isinstance(loc, Cells):
        return Cells(loc.lead, list(ts))
    (t,) = ts
    return t


def map_tensors(loc, fn):
    """The same form with ``fn`` applied to each tensor behind it."""
    if isinstance(loc, Cells):
        return Cells(loc.lead, [fn(t) for t in loc.items])
    return fn(loc)


def backward_scalar(loc, mesh, placements) -> bool:
    """``backward()`` from a one-element value held stacked: replicated (compact), or a
    Partial sum or avg, each rank's partial seeded with its share of the implicit 1 (1,
    or 1/n for avg: see :func:`seed_like`; no all-reduce).  True if done; False for the
    caller's general path (other forms, a max / min Partial, non-real dtypes)."""
    if isinstance(loc, Cells) or _B.is_distributed(mesh) or not loc.is_floating_point() \
            or loc.numel() != math.prod(loc.shape[:mesh.ndim]):
        return False
    share = 1
    for p, n, k in zip(placements, mesh.shape, loc.shape):
        if isinstance(p, Partial):
            if p.reduce_op not in ("sum", "avg") or k != n:
                return False
            share *= n if p.reduce_op == "avg" else 1
        elif k != 1:
            return False
    # one 1 for every rank, held once (stride 0): the gradient is the same on every rank,
    # and the backward of a row-parallel linear sees it (ops_table/matmul._RankLinear)
    ones = (loc.new_ones(()) if share == 1 else loc.new_full((), 1.0 / share))
    # (the sizes as ints: torch parses a torch.Size argument slower, ~2.2 us against 1.0)
    ones = ones.expand(*loc.shape) if loc.dim() else ones.expand(loc.shape)
    if _ENGINE_RUN is not None and _FUNCTORCH_ACTIVE is not None and \
            type(loc) is torch.Tensor and not _FUNCTORCH_ACTIVE():
        # what torch.autograd.backward runs once it has checked its arguments (a gradient of
        # the output's shape and dtype, made here): 4 us less per step (toy TP step,
        # benchmarks/sim_overhead.py)
        _ENGINE_RUN((loc,), (ones,), False, False, (), allow_unreachable=True,
                    accumulate_grad=True)
    else:
        torch.autograd.backward(loc, ones)
    return True


try:        # torch's engine entry point behind torch.autograd.backward (torch >= 2.3)
    from torch.autograd.graph import _engine_run_backward as _ENGINE_RUN
except ImportError:  # pragma: no cover - older or newer torch: the public call
    _ENGINE_RUN = None
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def device(loc) -> torch.device:
    return tensors(loc)[0].device


def seeds_partial(like, mesh, placements) -> bool:
    """True if backward can start from the partials of ``like`` (laid out by
    ``placements``) as they are, without reducing them: every Partial is a sum or an avg
    and holds one partial per rank (on torch.distributed, this process's own).  A max or
    min Partial needs the reduced value (which rank holds it) first."""
    lead = None if _B.is_distributed(mesh) else _lead(like, mesh.ndim)
    return all(not isinstance(p, Partial) or (p.reduce_op in ("sum", "avg") and (
        lead is None or lead[i] == mesh.shape[i])) for i, p in enumerate(placements))


def seed_like(g, like, mesh, placements):
    """The gradient to start backward from the local data ``like`` (laid out by
    ``placements``; a Partial is a sum or avg, see :func:`seeds_partial`), given ``g``,
    the global tensor's gradient laid out as ``like`` with each Partial made Replicate
    (replicated axes compact).  Along a Partial axis every rank's partial gets its share:
    d(sum_i x_i)/dx_i = g, d(mean_i x_i)/dx_i = g/n (no all-reduce: each DDP rank
    backprops its own loss, and DTensor's ``ones_like`` of a Partial is Replicate
    without communication, torch/distributed/tensor/_ops/_tensor_ops.py
    create_like_strategy).  Along a replicated axis where ``like`` holds one copy per
    rank, one copy stands for the value: the first rank gets ``g``, the others zeros
    (as in backward of a scalar).  On torch.distributed, this process's share."""
    nd = mesh.ndim
    share = math.prod(n for p, n in zip(placements, mesh.shape)
                      if isinstance(p, Partial) and p.reduce_op == "avg")
    if share != 1:
        g = map_tensors(g, lambda t: t / share)
    if _B.is_distributed(mesh):
        return g
    spread = [isinstance(p, Partial) for p in placements]
    if isinstance(like, Cells) or isinstance(g, Cells):
        g = to_cells(g, nd)
        lead = _lead(like, nd)
        if g.lead == lead:
            return g
        grown = [i for i in range(nd) if g.lead[i] < lead[i] and not spread[i]]
        coords = itertools.product(*[range(n) for n in lead])
        return Cells(lead, [g[c] if all(c[i] == 0 for i in grown) else torch.zeros_like(g[c])
                            for c in coords])
    for i in range(nd):
        n = like.shape[i]
        if g.shape[i] == 1 and n > 1:
            if spread[i]:          # the same gradient on every rank, held once (stride 0)
                g = g.expand(*[n if j == i else -1 for j in range(g.dim())])
                continue
            zshape = list(g.shape)
            zshape[i] = n - 1
            g = torch.cat([g, g.new_zeros(zshape)], dim=i)
    return g


# ---- running a local op on uneven shards, and its replicated outputs -------------------

def run_per_cell(fn, locs, lead: tuple, n_out: int) -> tuple:
    """Run ``fn(coord, args)`` once per cell of the grid ``lead``, each input given as
    its piece at ``coord`` with a size-1 leading axis per mesh dim (non-tensors as they
    are); ``fn`` returns a tuple of ``n_out`` such outputs, gathered into ``n_out`` Cells."""
    nd = len(lead)
    coords = list(itertools.product(*[range(n) for n in lead]))
    pieces = [_pieces(x, coords, nd) for x in locs]
    results = []
    for k, c in enumerate(coords):
        rs = fn(c, [p[k] for p in pieces])
        results.append(tuple(o.reshape(o.shape[nd:]) for o in rs))
    return tuple(Cells(lead, [r[j] for r in results]) for j in range(n_out))


def _pieces(x, coords, nd):
    """``x``'s piece at each of ``coords`` (a size-1 axis of a stack or of cells is
    shared by every coordinate along it)."""
    one = (1,) * nd
    if isinstance(x, Cells):
        ts = [x[c] for c in coords]
        return [t.reshape(one + tuple(t.shape)) for t in ts]
    if isinstance(x, torch.Tensor) and x.dim() >= nd:
        lead, rest = x.shape[:nd], tuple(x.shape[nd:])
        return [x[tuple(ci if n > 1 else 0 for ci, n in zip(c, lead))].reshape(one + rest)
                for c in coords]
    return [x] * len(coords)


def keep_first_replica(outs, outs_ps, shapes, locs, mesh, check: bool = False) -> tuple:
    """An op's outputs, each in the form its layout is held in.  Cells of a now even
    layout are stacked; an output announced replicated along a mesh dim but computed once
    per rank there keeps the first rank's copy (a stack stores a replicated value once;
    on torch.distributed only the first rank's copy carries the gradient).  ``check``
    (tests) raises if the ranks' copies differ: the op's rule announced a wrong layout."""
    if _B.is_distributed(mesh):
        tagged = set()
        for x in locs:          # the axes C.expand_replicas gave per-rank copies
            tagged |= set(getattr(x, "_wb_replica_axes", ()))
        if not tagged:
            return outs
        coord = _B.coordinate(mesh)
        res = []
        for o, ps in zip(outs, outs_ps):
            for a in sorted(tagged):
                if ps[a].is_replicate() and o.requires_grad:
                    o = _B.GradOnFirst.apply(o, coord[a])
            res.append(o)
        return tuple(res)
    res = []
    for o, ps, shape in zip(outs, outs_ps, shapes):
        if isinstance(o, Cells):
            o = settle(o, shape, mesh, ps)
        res.append(o if isinstance(o, Cells) else _first_copy(o, mesh, ps, check))
    return tuple(res)


def _first_copy(o, mesh, placements, check):
    shape = o.shape
    for i, p in enumerate(placements):
        if shape[i] != 1 and isinstance(p, Replicate):
            first = o.narrow(i, 0, 1)
            if check and not torch.allclose(o, first.expand_as(o), rtol=1e-4, atol=1e-5,
                                            equal_nan=True):
                raise AssertionError(
                    f"rule bug: output announced Replicate on mesh dim "
                    f"{mesh.dim_names[i]!r} but ranks along it computed different values")
            o = first
    return o


# ---- the local transitions of a reshard (no communication) -----------------------------

def local_step(loc, shape, mesh, old_ps, new_ps, i: int, label: str = ""):
    """Change mesh dim ``i`` from ``old_ps[i]`` to ``new_ps[i]`` without moving data:
    R -> S(d) keeps this rank's chunk, R -> P keeps the value on the group's first rank
    (zeros elsewhere; every rank for max, min and avg), S(d) -> P(sum) zero-pads each
    shard to its group's length.  Returns the local data of the new layout."""
    old, new = old_ps[i], new_ps[i]
    if type(loc) is torch.Tensor and type(old) is Replicate and type(new) is Shard \
            and not _B.is_distributed(mesh) and _is_even(shape, mesh, old_ps) \
            and _is_even(shape, mesh, new_ps):
        # the common case, stacked and even both sides (for_layout and settle leave it as it is)
        return _slice_stacked(loc, shape, mesh, old_ps, i, new, label)
    if isinstance(old, Replicate) and isinstance(new, Shard):
        kind = "slice"
    elif isinstance(old, Replicate) and isinstance(new, Partial):
        kind = "partial"
    elif isinstance(old, Shard) and isinstance(new, Partial) and new.reduce_op == "sum":
        kind = "pad"
    else:
        raise ValueError(f"no local step from {old} to {new}: it needs communication")
    x = for_layout(loc, shape, mesh, old_ps, new_ps)
    if isinstance(x, Cells) or _B.is_distributed(mesh):
        y = _per_rank(kind, x, shape, mesh, old_ps, i, new, label)
        # torch.distributed: a replica tagged one copy per rank on other dims (DDP's dp)
        # stays so (C.expand_replicas skips them); untagged, its next meeting with the
        # dp-sharded batch all-reduced its gradient over dp, then DDP summed it again:
        # a row-parallel linear's bias got twice one device's gradient on a dp x tp mesh
        had = tuple(a for a in getattr(loc, "_wb_replica_axes", ())
                    if a != i and new_ps[a].is_replicate())
        if had and isinstance(y, torch.Tensor):
            _B.tag(y, had)
    else:
        y = _STACKED[kind](x, shape, mesh, old_ps, i, new, label)
    return settle(y, shape, mesh, new_ps)


def _per_rank(kind, x, shape, mesh, old_ps, i, new, label):
    """One rank's transition, applied to every cell, or to this process's shard."""
    n = mesh.shape[i]
    if _B.is_distributed(mesh):
        coord = _B.coordinate(mesh)
        pg, group = _B.group(mesh, i)
        t = own(x, mesh)
        if kind == "slice":             # the backward gathers the gradient across processes
            new_ps = old_ps[:i] + (new,) + old_ps[i + 1:]
            sizes = None if _is_even(shape, mesh, new_ps) else \
                dist_uneven.pieces(shape, mesh, new_ps, i, new.dim, coord)
            y = _B.SliceOwn.apply(t, pg, n, coord[i], new.dim) if sizes is None or \
                len(set(sizes)) <= 1 else _padded.SliceOwn.apply(t, pg, sizes, coord[i], new.dim)
            # the bytes the simulator records: the largest rank's block (uneven: not ours)
            nb = t.numel() * t.element_size() if _is_even(shape, mesh, old_ps) else \
                layout.local_numel_max(tuple(shape), mesh, old_ps) * t.element_size()
            # and, uneven, the busiest member's (grid.gather_sent), as on cells
            sent = None if _is_even(shape, mesh, old_ps) and _is_even(shape, mesh, new_ps) \
                else (C._dist_gather_sent(
                y.reshape((1,) * mesh.ndim + tuple(y.shape)), mesh, i, new.dim, sizes,
                False),)
            y = C._on_backward(y, "all_gather", mesh, i, nb, label, groups=[group], sent=sent)
        elif kind == "partial":          # every process keeps the gradient of its copy
            y = _B.KeepOnFirst.apply(t, coord[i]) if new.reduce_op == "sum" else t
        else:
            y = _pad_one(t, shape, mesh, old_ps, i, coord)
        return y.reshape((1,) * mesh.ndim + tuple(y.shape))
    src = x
    if kind == "slice":
        # the cells along mesh dim i share one source cell (R: size 1 there): cut each
        # source once, not once per rank (that was quadratic in n: 4 rows S(0) over 1024
        # ranks took 11.9 s)
        cut: dict = {}

        def piece(c):
            k = src.index(c)
            parts = cut.get(k)
            if parts is None:
                parts = cut[k] = grid.chunks(src.items[k], new.dim, n)
            return parts[c[i]]
        y = x.with_axis(i, n, piece)
        nb = grid.CellGrid.rank_bytes(src, mesh.ndim)
        if n == 1 or not (torch.is_grad_enabled() and grid.CellGrid.requires_grad(y)):
            return y                      # no backward to record
        # the backward all-gather: each group's busiest rank (grid.gather_sent)
        groups = list(mesh.groups(i))
        return C._on_backward(y, "all_gather", mesh, i, nb, label, groups=groups,
                              sent=tuple(C._cells_gather_sent(y, mesh, i, g) for g in groups))
    if kind == "partial":
        keep_all = new.reduce_op != "sum"
        return x.with_axis(i, n, lambda c: src[c] if keep_all or c[i] == 0
                           else torch.zeros_like(src[c]))
    return Cells(x.lead, [_pad_one(x[c], shape, mesh, old_ps, i, c) for c in x.coords()])


def _pad_one(t, shape, mesh, old_ps, i, coord):
    """S(d) -> P(sum) for the rank at ``coord``: place its shard at its offset within
    the block its group along mesh dim ``i`` holds, zeros elsewhere."""
    d = old_ps[i].dim
    whole = old_ps[:i] + (Replicate(),) + old_ps[i + 1:]
    coord = tuple(coord)
    start, size = layout._bounds(tuple(shape), mesh.shape, tuple(old_ps), coord)[d]
    g_start, g_size = layout._bounds(tuple(shape), mesh.shape, whole, coord)[d]
    off = start - g_start
    pads = [0, 0] * (t.dim() - 1 - d) + [off, g_size - off - size]
    return torch.nn.functional.pad(t, pads)


def _slice_stacked(x, shape, mesh, old_ps, i, new, label):
    nd, n, d = mesh.ndim, mesh.shape[i], new.dim
    if x.shape[i] != 1:                   # one copy per rank (data-parallel replicas, each
        s = x.shape                       # keeping its own gradient): rank c keeps chunk c
        z = x.unflatten(nd + d, (n, s[nd + d] // n))                  # of its own copy
        y = torch.diagonal(z, 0, i, nd + d).movedim(-1, i)
    elif i == nd - 1 and d == 0:          # the chunk index lands where the mesh axis was
        s = x.shape
        y = x.view(s[:i] + (n, s[nd] // n) + s[nd + 1:])
    else:
        y = grid.split_axis(x.squeeze(i), nd - 1 + d, n).movedim(nd - 1 + d, i)
    if not y.requires_grad:
        return y                          # no backward to record
    nb = grid.Stacked.rank_bytes(x, nd)
    return C._on_backward(y, "all_gather", mesh, i, nb, label)


def _partial_stacked(x, shape, mesh, old_ps, i, new, label):
    n = mesh.shape[i]
    if new.reduce_op != "sum":
        return grid.Stacked.expand(x, i, n)
    zshape = list(x.shape)
    zshape[i] = n - 1
    return torch.cat([x, x.new_zeros(zshape)], dim=i) if n > 1 else x


def _pad_stacked(x, shape, mesh, old_ps, i, new, label):
    nd, n, d = mesh.ndim, mesh.shape[i], old_ps[i].dim
    # rank k of the group puts its block at position k of n: a block-diagonal expand
    xe = x.unsqueeze(nd + d).expand(*x.shape[:nd + d], n, *x.shape[nd + d:])
    sel = [1] * xe.dim()
    sel[i] = n
    sel[nd + d] = n
    eye = torch.eye(n, dtype=torch.bool, device=x.device).reshape(sel)
    y = torch.where(eye, xe, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.flatten(nd + d, nd + d + 1)


_STACKED = {"slice": _slice_stacked, "partial": _partial_stacked, "pad": _pad_stacked}
