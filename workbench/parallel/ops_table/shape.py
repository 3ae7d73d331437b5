"""Shape ops: permute / transpose, cat / stack, split / chunk / unbind, and basic
indexing ``x[...]`` (reshape / view / flatten / (un)squeeze: ``reshape.py``).

None of them computes anything, so every one is linear: ``P(op) -> P(op)``
(``reshape(sum a_i) = sum reshape(a_i)``, the same for max/min/avg). Per mesh dim:

    permute(dims)        S(d) -> S(j) where dims[j] == d        a relabeling of dims
    cat / stack(dim)     S(d) -> S(d'), d != dim                 every input split alike
                         S(dim): the cat dim must be whole       pieces would interleave
    split / chunk(dim)   S(d) -> S(d) on every piece, d != dim;  S(dim): whole
    x[idx]               S(d) passes when idx takes all of d (``:``); a partial slice
                         or an int on d needs d whole (the ranks' blocks would not
                         line up); an int elsewhere drops its dim, None adds one
    reshape / view       ``reshape.py``

Local ops run on stacked shards (``nd`` leading device axes), so user dims shift by
``nd``. The rules wrap a negative dim as the parsers do (``wb.spmd.infer`` hands a rule
the user's ``dim=-1`` as given); out of range, torch's IndexError.
"""
from __future__ import annotations

import torch

from .. import layout
from ..placement import Replicate, Shard
from . import costs
from ._util import wrap_dim
from .samples import Sample
from .strategy import combine
from .table import add_funcs, register

__all__ = ["shape_options", "local_out_shape", "normalize_index", "VIEW", "COPY"]

T = torch.Tensor
R = Replicate()


def shape_options(specs, n_out, shard_map, note):
    """Per mesh dim: R; each ``(input dims, output dim)`` of ``shard_map``; and the
    Partial of the first input that is partial on that mesh dim."""
    mesh = next(s for s in specs if s is not None).mesh
    per_dim = []
    for i in range(mesh.ndim):
        opts = [(tuple(None if s is None else R for s in specs), (R,) * n_out, "replicated")]
        for ins, out in shard_map:
            opts.append((tuple(None if s is None else (Shard(d) if d is not None else R)
                               for s, d in zip(specs, ins)), (Shard(out),) * n_out,
                         note.format(d=next(d for d in ins if d is not None), o=out)))
        ps = [s.placements[i] for s in specs if s is not None and s.placements[i].is_partial()]
        if ps:
            p = ps[0]
            opts.append((tuple(None if s is None else p for s in specs), (p,) * n_out,
                         f"linear: {p} passes through"))
        per_dim.append(opts)
    return per_dim


def local_out_shape(ctx, j=0):
    """This rank's (or, when even, every rank's) shard shape of output ``j``."""
    shape, ps = ctx.out_shape[j], ctx.out_placements[j]
    if ctx.coord is None:
        return layout.max_local_shape(shape, ctx.mesh, ps)
    return layout.local_shape(shape, ctx.mesh, ps, ctx.mesh.rank_at(ctx.coord))


def _meta(x):
    return torch.empty(tuple(x.shape), device="meta")


VIEW = dict(cost=costs.view, op_class="view")          # no kernel runs
COPY = dict(cost=costs.movement, op_class="data_movement")


# ---- permute / transpose ----------------------------------------------------------------

def permute_rule(x, dims, **_):
    """permute(dims): S(dims[j]) -> S(j); P passes (a relabeling of dims)."""
    dims = _perm_dims(dims, x.ndim)
    smap = [((d,), j) for j, d in enumerate(dims) if x.shape[d] > 1]
    return combine(x.mesh.ndim, shape_options([x], 1, smap, "dim {d} sharded moves to dim {o}"), 1)


def _perm_dims(dims, ndim):
    """``dims`` wrapped, checked to be a permutation of the ``ndim`` dims (torch's words)."""
    dims = tuple(wrap_dim(d, ndim) for d in dims)
    if len(dims) != ndim:
        raise RuntimeError("permute(sparse_coo): number of dimensions in the tensor input does "
                           "not match the length of the desired ordering of dimensions i.e. "
                           f"input.dim() = {ndim} is not equal to len(dims) = {len(dims)}")
    if len(set(dims)) != len(dims):
        raise RuntimeError("permute(): duplicate dims are not allowed.")
    return dims


def _permute_local(nd, ctx, x, dims):
    return x.permute(tuple(range(nd)) + tuple(d + nd for d in dims))


def _perm_parse(x, *dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
        dims = tuple(dims[0])
    return (x,), {"dims": tuple(wrap_dim(int(d), x.ndim) for d in dims)}


def _transpose_parse(x, dim0=None, dim1=None):
    if dim0 is None:                                 # .t(): 0-d, 1-d unchanged; 2-d swapped
        dim0, dim1 = (0, 1) if x.ndim == 2 else (0, 0)
    perm = list(range(x.ndim))
    a, b = wrap_dim(dim0, x.ndim), wrap_dim(dim1, x.ndim)
    if x.ndim == 0:
        return (x,), {"dims": ()}
    perm[a], perm[b] = perm[b], perm[a]
    return (x,), {"dims": tuple(perm)}


def _movedim_parse(x, source, destination):
    # a meta tensor of sizes 1..n shows where each dim went
    moved = torch.empty(tuple(range(1, x.ndim + 1)), device="meta").movedim(source, destination)
    return (x,), {"dims": tuple(n - 1 for n in moved.shape)}


register("permute", [torch.permute, T.permute], parse=_perm_parse, rule=permute_rule,
         local=_permute_local, **VIEW, sample=lambda g: [
             Sample(torch.permute, (g.rn(5, 3, 4), (2, 0, 1))),
             Sample(torch.movedim, (g.rn(5, 3, 4), 0, -1))])
add_funcs("permute", [torch.movedim, T.movedim, torch.moveaxis, T.moveaxis], _movedim_parse)
register("transpose", [torch.transpose, T.transpose, torch.swapaxes, T.swapaxes, torch.swapdims,
                       T.swapdims, torch.t, T.t], parse=_transpose_parse, rule=permute_rule,
         local=_permute_local, **VIEW, sample=lambda g: [
             Sample(torch.transpose, (g.rn(5, 3, 4), 0, 1)), Sample(torch.t, (g.rn(5, 6),))])


# ---- cat / stack ----------------------------------------------------------------------------

def cat_rule(*xs, dim, **_):
    """cat(dim): a shard on another dim passes (all inputs split alike); dim whole."""
    dim = wrap_dim(dim, xs[0].ndim)
    smap = [((d,) * len(xs), d) for d in range(xs[0].ndim)
            if d != dim and xs[0].shape[d] > 1]
    return combine(xs[0].mesh.ndim, shape_options(xs, 1, smap, "dim {d} sharded passes"),
                   len(xs))


def stack_rule(*xs, dim, **_):
    """stack(dim): S(d) -> S(d if d < dim else d + 1); the new dim is whole."""
    dim = wrap_dim(dim, xs[0].ndim + 1)             # a dim of the output
    smap = [((d,) * len(xs), d if d < dim else d + 1) for d in range(xs[0].ndim)
            if xs[0].shape[d] > 1]
    return combine(xs[0].mesh.ndim, shape_options(xs, 1, smap, "dim {d} sharded -> dim {o}"),
                   len(xs))


def _seq_parse(tensors, dim=0, *, out=None, extra=0):
    if out is not None:
        raise TypeError("cat/stack(out=...) on DistTensors is not supported; assign the result")
    tensors = tuple(tensors)
    if not tensors:
        raise ValueError("cat/stack: expected a non-empty list of tensors")
    return tensors, {"dim": wrap_dim(dim, tensors[0].ndim + extra)}


def _cat_local(nd, ctx, *xs, dim):
    return torch.cat(xs, dim + nd)


def _stack_local(nd, ctx, *xs, dim):
    return torch.stack(xs, dim + nd)


register("cat", [torch.cat, torch.concat, torch.concatenate], parse=_seq_parse, rule=cat_rule,
         local=_cat_local, **COPY, sample=lambda g: [
             Sample(torch.cat, ([g.rn(5, 6), g.rn(5, 6)], 0)),
             Sample(torch.cat, ([g.rn(5, 6), g.rn(5, 2)], 1))])
register("stack", [torch.stack], parse=lambda t, dim=0, *, out=None:
         _seq_parse(t, dim, out=out, extra=1), rule=stack_rule, local=_stack_local, **COPY,
         sample=lambda g: [Sample(torch.stack, ([g.rn(5, 6), g.rn(5, 6)], 1))])


# ---- split / chunk / unbind -----------------------------------------------------------------

def split_rule(x, sizes, dim, **_):
    """split(sizes, dim): every piece keeps a shard on another dim; dim must be whole."""
    dim = wrap_dim(dim, x.ndim)
    smap = [((d,), d) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    return combine(x.mesh.ndim, shape_options([x], len(sizes), smap, "dim {d} sharded passes"), 1,
                   n_outputs=len(sizes))


def unbind_rule(x, dim, **_):
    """unbind(dim): S(d) -> S(d if d < dim else d - 1) on every piece; dim whole."""
    dim = wrap_dim(dim, x.ndim)
    smap = [((d,), d if d < dim else d - 1) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    return combine(x.mesh.ndim, shape_options([x], x.shape[dim], smap, "dim {d} sharded -> {o}"), 1,
                   n_outputs=x.shape[dim])


def _split_parse(x, split_size_or_sections, dim=0):
    dim = wrap_dim(dim, x.ndim)
    pieces = _meta(x).split(split_size_or_sections, dim)
    return (x,), {"sizes": tuple(p.shape[dim] for p in pieces), "dim": dim}


def _chunk_parse(x, chunks, dim=0):
    dim = wrap_dim(dim, x.ndim)
    pieces = _meta(x).chunk(chunks, dim)
    return (x,), {"sizes": tuple(p.shape[dim] for p in pieces), "dim": dim}


def _unbind_parse(x, dim=0):
    dim = wrap_dim(dim, x.ndim)
    return (x,), {"dim": dim}


def _split_local(nd, ctx, x, sizes, dim):
    return tuple(torch.split(x, list(sizes), dim + nd))


def _unbind_local(nd, ctx, x, dim):
    return tuple(torch.unbind(x, dim + nd))


for _n, _fs, _parse, _local, _rule, _sample in (
        ("split", [torch.split, T.split], _split_parse, _split_local, split_rule,
         lambda g: [Sample(torch.split, (g.rn(7, 4), 3, 0)),
                    Sample(torch.split, (g.rn(5, 6), [2, 4], 1))]),
        ("chunk", [torch.chunk, T.chunk], _chunk_parse, _split_local, split_rule,
         lambda g: [Sample(torch.chunk, (g.rn(5, 6), 2, 1))]),
        ("unbind", [torch.unbind, T.unbind], _unbind_parse, _unbind_local, unbind_rule,
         lambda g: [Sample(torch.unbind, (g.rn(3, 5), 0))])):
    register(_n, _fs, parse=_parse, rule=_rule, local=_local, multi=True, **VIEW, sample=_sample)


# ---- basic indexing x[idx] ---------------------------------------------------------------

def normalize_index(shape, idx) -> tuple:
    """``x[idx]`` as a hashable tuple, one entry per input dim plus Nones:
    ``("all",)`` take the whole dim, ``("slice", start, stop, step)``, ``("int", i)``,
    ``("new",)`` for None. Ellipsis is expanded; advanced indexing is refused."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("x[...]: an index can only have a single Ellipsis")
    if used > len(shape):
        raise IndexError(f"x[{idx}]: too many indices for a tensor of {len(shape)} dims")
    out, d = [], 0
    for i in idx:
        if i is Ellipsis:
            out += [("all",)] * (len(shape) - used)
            d += len(shape) - used
        elif i is None:
            out.append(("new",))
        elif isinstance(i, slice):
            start, stop, step = i.indices(shape[d])
            if step <= 0:
                raise ValueError(f"x[{idx}]: step must be positive (torch does not support "
                                 "negative steps); use torch.flip")
            whole = start == 0 and stop >= shape[d] and step == 1
            out.append(("all",) if whole else ("slice", start, stop, step))
            d += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            if not -shape[d] <= i < shape[d]:
                raise IndexError(f"x[{idx}]: index {i} is out of bounds for dimension {d} "
                                 f"with size {shape[d]}")                 # torch's words
            out.append(("int", i % shape[d]))
            d += 1
        else:
            _torch_verdict(shape, idx)
            raise NotImplementedError(
                f"x[{idx!r}]: DistTensor indexing takes ints, slices, None and Ellipsis; "
                f"for {type(i).__name__} indices (advanced indexing) use torch.index_select "
                "or torch.gather, or gather first with .full()")
    out += [("all",)] * (len(shape) - d)
    return tuple(out)


def _torch_verdict(shape, idx) -> None:
    """torch's own error for an index this table does not take (``x['a']``: a TypeError
    or IndexError there), from the same index on a stand-in of x's shape (one byte
    expanded); nothing where torch would take it."""
    from ..dist_tensor import DistTensor
    if any(isinstance(i, DistTensor) for i in idx):
        return
    torch.zeros((), dtype=torch.bool).expand(tuple(shape))[idx]


def _normalized(index, ndim) -> bool:
    """``index`` is :func:`normalize_index`'s form (one tagged tuple per input dim)."""
    return isinstance(index, tuple) and all(
        isinstance(i, tuple) and i and i[0] in ("all", "slice", "int", "new") for i in index
    ) and sum(1 for i in index if i[0] != "new") == ndim


def getitem_rule(x, index, **_):
    """x[idx]: S(d) passes where idx takes all of d; a slice or int of d needs d whole."""
    if not _normalized(index, x.ndim):        # infer: the index as the user writes it
        index = normalize_index(tuple(x.shape), index)
    smap, d, o = [], 0, 0
    for item in index:
        if item[0] == "new":
            o += 1
            continue
        if item[0] == "all" and x.shape[d] > 1:
            smap.append(((d,), o))
        o += item[0] != "int"
        d += 1
    return combine(x.mesh.ndim, shape_options([x], 1, smap, "dim {d} taken whole -> dim {o}"), 1)


def _getitem_local(nd, ctx, x, index):
    conv = {"all": lambda it: slice(None), "new": lambda it: None,
            "int": lambda it: it[1], "slice": lambda it: slice(*it[1:])}
    return x[(slice(None),) * nd + tuple(conv[it[0]](it) for it in index)]


register("getitem", [T.__getitem__], parse=lambda x, idx: ((x,), {
    "index": normalize_index(tuple(x.shape), idx)}), rule=getitem_rule, local=_getitem_local,
    **VIEW, sample=lambda g: [
        Sample(T.__getitem__, (g.rn(5, 6), (slice(1, 4),))),
        Sample(T.__getitem__, (g.rn(5, 6), (slice(None), 2))),
        Sample(T.__getitem__, (g.rn(5, 3, 4), (None, Ellipsis, slice(0, 4, 2))))])


# x.narrow(dim, start, length), x.select(dim, i): x[..., start:start + length] and x[..., i]
# (views of x, as torch's: a write into them reaches x)
def _narrow_parse(x, dim, start, length):
    dim = wrap_dim(dim, x.ndim)
    n, start, length = x.shape[dim], int(start), int(length)
    if not -n <= start <= n:       # torch's checks (the cache key must not clamp them away)
        raise IndexError(f"start out of range (expected to be in range of [{-n}, {n}], but "
                         f"got {start})")
    start = start + n if start < 0 else start
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    if start + length > n:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({n}).")
    idx = (slice(None),) * dim + (slice(start, start + length),)
    return (x,), {"index": normalize_index(tuple(x.shape), idx)}


def _select_parse(x, dim, index):
    dim = wrap_dim(dim, x.ndim)
    return (x,), {"index": normalize_index(tuple(x.shape), (slice(None),) * dim + (int(index),))}


add_funcs("getitem", [(torch.narrow, _narrow_parse), (T.narrow, _narrow_parse),
                      (torch.select, _select_parse), (T.select, _select_parse)])
