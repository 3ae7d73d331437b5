"""Reshape family: reshape / view / flatten / unflatten / unsqueeze / squeeze (and
``reshape_as`` / ``view_as``). None computes anything: every one is linear,
``P(op) -> P(op)``.

Reshape. Row-major order groups the dims: ``(B, S, H) -> (B*S, H)`` has the groups
``{B, S} -> {B*S}`` and ``{H} -> {H}``; ``(B, S, H) -> (B, S, nh, hd)`` has
``{H} -> {nh, hd}``. Inside a group, a rank's block of the LEADING dim with the
later dims whole is one contiguous run of the flattened group, so it can become a
block of the leading output dim; a block of a later dim is strided and cannot (a
shard on S of ``{B, S}`` must be moved: all-to-all to S(0) or S(H), or gathered).
The exact condition (torch.chunk sizes on both sides): with ``R_in`` / ``R_out`` the
product of the group's later input / output dims, every rank's (start, size) along
the leading input dim times ``R_in`` must equal its (start, size) along the leading
output dim times ``R_out``. For one mesh dim of m ranks this is

    ceil(N_in / m) * R_in == ceil(N_out / m) * R_out

which holds whenever m divides both leading sizes (e.g. S(2) of (B, S, H) keeps
S(2) on nh in (B, S, nh, hd) when m | nh) and can fail when it does not: (5, 6)
-> (30,) on 4 ranks: rows 2,2,1,0 give runs of 12,12,6,0 but chunk(30, 4) is
8,8,8,6. Nested shards (one dim split by several mesh dims) are checked rank by
rank with the runtime's own offsets (:func:`layout.shard_bounds`).

view() is run as reshape() locally because stacked replicas are stride-0 views that a
real view() may refuse.
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import layout
from .samples import Sample
from .shape import VIEW, local_out_shape, shape_options
from .strategy import combine
from .table import add_funcs, register

__all__ = ["view_groups", "reshape_keeps", "reshape_rule"]

T = torch.Tensor


def _meta(x):
    return torch.empty(tuple(x.shape), device="meta")


def view_groups(in_shape, out_shape):
    """Pair the dims of a reshape into groups of equal product (row-major order):
    [(input dims, output dims)], size-1 dims left out. ``(2, 3, 4) -> (6, 4)``:
    [((0, 1), (0,)), ((2,), (1,))]."""
    if 0 in tuple(in_shape) or 0 in tuple(out_shape):
        return []
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [d for d, n in enumerate(out_shape) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                go.append(outs[j])
                po *= out_shape[outs[j]]
                j += 1
        groups.append((tuple(gi), tuple(go)))
    return groups


def reshape_keeps(in_shape, out_shape, mesh, in_ps, out_ps) -> bool:
    """True when every rank's input shard, reshaped locally, is exactly its output
    shard (the condition in the module docstring, checked rank by rank)."""
    for gi, go in view_groups(in_shape, out_shape):
        a, b = gi[0], go[0]
        if not any(p.is_shard(a) for p in in_ps):
            continue
        r_in = math.prod(in_shape[d] for d in gi[1:])
        r_out = math.prod(out_shape[d] for d in go[1:])
        for r in mesh.ranks:
            s_in, n_in = layout.shard_bounds(in_shape, mesh, in_ps, r)[a]
            s_out, n_out = layout.shard_bounds(out_shape, mesh, out_ps, r)[b]
            if (s_in * r_in, n_in * r_in) != (s_out * r_out, n_out * r_out):
                return False
    return True


def reshape_rule(x, shape, **_):
    """reshape(shape): a shard of a group's leading dim passes to the group's leading
    output dim when the ranks' blocks line up (torch.chunk sizes); P passes."""
    shape = tuple(shape)
    if any(s < 0 for s in shape) or math.prod(shape) != x.shape.numel():
        # infer hands the user's shape as given: -1 inferred, a wrong size torch's error
        shape = tuple(_meta(x).reshape(shape).shape)
    smap = [((gi[0],), go[0]) for gi, go in view_groups(tuple(x.shape), shape)]
    note = "leading dim {d} of its group sharded: its blocks are the blocks of dim {o}"
    sts = combine(x.mesh.ndim, shape_options([x], 1, smap, note), 1)
    return [s for s in sts if reshape_keeps(tuple(x.shape), shape, x.mesh,
                                            s.inputs[0], s.outputs[0])]


def _reshape_local(nd, ctx, x, shape):
    if ctx is None:
        return x.reshape(shape)
    return x.reshape(tuple(x.shape[:nd]) + tuple(local_out_shape(ctx)))


def _shape_attr(x, fn):
    return (x,), {"shape": tuple(fn(_meta(x)).shape)}


def _reshape_parse(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if shape and isinstance(shape[0], torch.dtype):
        raise TypeError(f"view(dtype={shape[0]}) on a DistTensor: reinterpreting bytes is not "
                        "supported; use .to(dtype) for a conversion")
    return _shape_attr(x, lambda m: m.reshape(tuple(int(s) for s in shape)))


def _view_parse(x, *shape):
    """``x.view(shape)``: torch's view needs strides it can keep ("view size is not
    compatible with input tensor's size and stride ... Use .reshape(...) instead"): judged
    on a meta tensor of x's global strides (seed 970294: x.permute(2, 1, 0).view(-1)
    returned a result where torch raises RuntimeError), kept beside the shards where they
    cannot tell them (strides.py; seed 1040236).  Strides still unknown: every place the
    lost dims could take is tried, and a view that only some allow is refused."""
    out = _reshape_parse(x, *shape)
    if not x.dim():
        return out
    to = out[1]["shape"]
    try:
        stride = tuple(x.stride())
    except NotImplementedError:     # shards of one element cannot tell a dim's place
        _view_unknown(x, to)
        return out
    m = torch.empty_strided(tuple(x.shape), _expanded_stride(x, stride), device="meta")
    m.view(to)                      # torch's RuntimeError, message and fix included
    return out


def _expanded_stride(x, stride) -> tuple:
    """x's strides as torch's where x is an expanded view (``x.expand(2, 7)``): stride 0 on
    the expanded dims, the others dense over the shape with those dims of size 1 (the
    expanded tensor's own), in x's order.  A shard's stride 0 on a dim it holds more than
    one element of tells it (the local op is torch's expand: its shards are expanded views,
    views.py); the global strides are dense otherwise (strides.py), so view(14) of a (1, 7)
    tensor expanded to (2, 7) returned a result where torch raises (seed 2011360 wide)."""
    from ..dist_tensor import DistTensor
    from ..strides import _shard
    t = _shard(x) if isinstance(x, DistTensor) else None
    if t is None or t.dim() != x.dim():
        return stride
    exp = {i for i in range(x.dim()) if t.stride(i) == 0 and t.shape[i] > 1}
    if not exp:
        return stride
    out, acc = list(stride), 1
    for i in sorted(range(x.dim()), key=lambda i: (stride[i], -i)):    # innermost first
        if i in exp:
            out[i] = 0
        else:
            out[i] = acc
            acc *= x.shape[i]
    return tuple(out)


def _view_unknown(x, to) -> None:
    """view(to) of x whose strides are unknown: allowed where every order of x's dims
    that its shards allow lets torch view it, torch's error where none does, refused
    (naming .reshape) where it depends on the order."""
    from ..strides import dense_stride, lost_dims, shard_stride
    shape, lost = tuple(x.shape), lost_dims(x)
    st = shard_stride(x)
    rest = sorted((i for i in range(len(shape)) if i not in lost), key=lambda i: -st[i])
    ok, error = 0, None
    for perm in itertools.permutations(lost):
        for slots in itertools.combinations_with_replacement(range(len(rest) + 1), len(perm)):
            order = list(rest)
            for d, at in sorted(zip(perm, slots), key=lambda p: -p[1]):
                order.insert(at, d)
            m = torch.empty_strided(shape, dense_stride(shape, order), device="meta")
            try:
                m.view(to)
                ok += 1
            except RuntimeError as e:
                error = e
    if error is None:
        return
    if not ok:
        raise error
    raise NotImplementedError(
        f"view({list(to)}) of a DistTensor of shape {list(shape)} with placements "
        f"{tuple(x.placements)}: every shard holds at most one element of dim(s) "
        f"{list(lost)}, so the shards cannot tell whether torch's strides allow this view; "
        f"use .reshape({list(to)}) (it copies where a view cannot), or redistribute so "
        "that those dims are split into pieces of more than one element")


def _flatten_parse(x, start_dim=0, end_dim=-1):
    return _shape_attr(x, lambda m: m.flatten(start_dim, end_dim))


def _unflatten_parse(x, dim, sizes):
    return _shape_attr(x, lambda m: m.unflatten(dim, tuple(sizes)))


def _unsqueeze_parse(x, dim):
    return _shape_attr(x, lambda m: m.unsqueeze(dim))


def _squeeze_parse(x, dim=None):
    if isinstance(dim, list):
        dim = tuple(dim)
    return _shape_attr(x, lambda m: m.squeeze() if dim is None else m.squeeze(dim))


def _as_parse(x, other):
    return (x,), {"shape": tuple(other.shape)}


for _name, _parse, _fns, _sample in (
        ("reshape", _reshape_parse, [torch.reshape, T.reshape], lambda g: [
            Sample(torch.reshape, (g.rn(5, 6), (30,))),
            Sample(torch.reshape, (g.rn(4, 6), (4, 2, 3))),
            Sample(torch.reshape, (g.rn(5, 3, 4), (5, 12)))]),
        ("view", _view_parse, [T.view], lambda g: [Sample(T.view, (g.rn(4, 6), 2, 12))]),
        ("flatten", _flatten_parse, [torch.flatten, T.flatten],
         lambda g: [Sample(torch.flatten, (g.rn(5, 3, 4), 1))]),
        ("unflatten", _unflatten_parse, [torch.unflatten, T.unflatten],
         lambda g: [Sample(torch.unflatten, (g.rn(5, 6), 1, (2, 3)))]),
        ("unsqueeze", _unsqueeze_parse, [torch.unsqueeze, T.unsqueeze],
         lambda g: [Sample(torch.unsqueeze, (g.rn(5, 6), 1))]),
        ("squeeze", _squeeze_parse, [torch.squeeze, T.squeeze],
         lambda g: [Sample(torch.squeeze, (g.rn(5, 1, 6), 1))])):
    register(_name, _fns, parse=_parse, rule=reshape_rule, local=_reshape_local, **VIEW,
             sample=_sample)
add_funcs("reshape", [T.reshape_as], _as_parse)
add_funcs("view", [T.view_as], _as_parse)
