"""The local side of dispatch: the context a local implementation receives, running
per rank when shards are uneven (:class:`Cells`), wrapping local results as DistTensors,
and the opt-in replicate fallback."""
from __future__ import annotations

import torch

from ..sim_mesh import backends as _B
from ..sim_mesh.collectives import Cells
from ..sim_mesh.trace import current_trace
from . import layout
from .dist_tensor import DistTensor, TensorSpec, _stack_cells
from .placement import Replicate

__all__ = ["Ctx", "run_cells", "wrap", "dist_replicated_outputs", "fallback", "VALIDATE"]

VALIDATE = [False]         # tests: check that "replicated" outputs really are identical


class Ctx:
    """What a local function may need beyond its tensors: the mesh, the layouts, and
    (for rank-dependent ops such as vocabulary-parallel embedding) shard offsets."""
    __slots__ = ("mesh", "in_specs", "out_placements", "out_shape", "coord")

    def __init__(self, mesh, in_specs, out_placements, out_shape, coord=None):
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_placements = out_placements
        self.out_shape = out_shape
        self.coord = coord              # set when running per rank (uneven shards)

    def offsets(self, spec: TensorSpec, dim: int, like: torch.Tensor) -> torch.Tensor:
        """Per-rank start of ``spec``'s shard along ``dim``, shaped to broadcast against
        the stacked local tensors (lead dims, then ones)."""
        mesh, nd = self.mesh, self.mesh.ndim
        if self.coord is not None:
            r = mesh.rank_at(self.coord)
            start = layout.shard_bounds(spec.shape, mesh, spec.placements, r)[dim][0]
            return torch.full((1,) * like.dim(), start, dtype=torch.long, device=like.device)
        lead = tuple(like.shape[:nd])
        vals = []
        import itertools
        for c in itertools.product(*[range(n) for n in lead]):
            full = tuple(ci for ci in c)
            r = mesh.rank_at(tuple(ci if n > 1 else 0 for ci, n in zip(full, lead)))
            vals.append(layout.shard_bounds(spec.shape, mesh, spec.placements, r)[dim][0])
        return torch.tensor(vals, dtype=torch.long, device=like.device).reshape(
            lead + (1,) * (like.dim() - nd))


def dist_replicated_outputs(outs, outs_ps, locs, mesh):
    """On torch.distributed: a replicated output computed from per-rank copies keeps one
    copy's gradient path (as the simulator keeps the first copy of such a result)."""
    tagged = set()
    for x in locs:
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


def run_cells(opdef, ctx, locs, attrs, outs_ps, mesh):
    nd = mesh.ndim
    lead = tuple(1 if all(ps[i].is_replicate() for ps in outs_ps) else mesh.shape[i]
                 for i in range(nd))
    import itertools
    results = []
    for c in itertools.product(*[range(n) for n in lead]):
        args = []
        for x in locs:
            if isinstance(x, Cells):
                args.append(x[c].reshape((1,) * nd + tuple(x[c].shape)))
            elif isinstance(x, torch.Tensor) and x.dim() >= nd and x is not None:
                idx = tuple(ci if x.shape[i] > 1 else 0 for i, ci in enumerate(c))
                args.append(x[idx].reshape((1,) * nd + tuple(x.shape[nd:])))
            else:
                args.append(x)
        cctx = Ctx(ctx.mesh, ctx.in_specs, ctx.out_placements, ctx.out_shape, coord=c)
        r = opdef.local(nd, cctx, *args, **attrs)
        rs = r if (opdef.multi or opdef.n_out > 1) else (r,)
        results.append(tuple(o.reshape(o.shape[nd:]) for o in rs))
    outs = tuple(Cells(lead, [r[j] for r in results]) for j in range(len(outs_ps)))
    return outs if (opdef.multi or opdef.n_out > 1) else outs[0]


def wrap(o, mesh, ps, shape):
    if isinstance(o, Cells) and layout.is_even(shape, mesh, ps):
        o = _stack_cells(o, mesh.ndim)
    if not isinstance(o, Cells):
        # an output replicated along a mesh dim must be stored once (compact)
        for i, p in enumerate(ps):
            if p.is_replicate() and o.shape[i] != 1:
                if VALIDATE[-1]:
                    first = o.narrow(i, 0, 1)
                    if not torch.allclose(o, first.expand_as(o), rtol=1e-4, atol=1e-5,
                                          equal_nan=True):
                        raise AssertionError(
                            f"rule bug: output announced Replicate on mesh dim "
                            f"{mesh.dim_names[i]!r} but ranks along it computed different values")
                o = o.narrow(i, 0, 1)
    return DistTensor(o, mesh, ps, shape, o.dtype)


def fallback(func, args, kwargs):
    """Gather every DistTensor input, run ``func`` on the global tensors, and return
    replicated DistTensors (recorded in the trace as the gathers it needed)."""
    from .reshard import reshard
    mesh = None

    def conv(x):
        nonlocal mesh
        if isinstance(x, DistTensor):
            mesh = x.mesh
            return reshard(x, x.mesh, [Replicate()] * x.mesh.ndim)._local.reshape(x.shape)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x
    a = conv(args)
    k = {n: conv(v) for n, v in kwargs.items()}
    out = func(*a, **k)
    tr = current_trace()
    if tr is not None:
        tr.record_compute(mesh.ranks, f"fallback:{getattr(func, '__name__', func)}", 0.0,
                          label="replicate fallback: every input gathered")

    def wrap(o):
        if isinstance(o, torch.Tensor):
            return as_dist(o, mesh)
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(y) for y in o)
        return o
    return wrap(out)


def as_dist(x, mesh) -> DistTensor:
    """A plain tensor as a replicated DistTensor (stored once)."""
    if isinstance(x, DistTensor):
        return x
    return DistTensor(x.reshape((1,) * mesh.ndim + tuple(x.shape)), mesh,
                      (Replicate(),) * mesh.ndim, x.shape, x.dtype)
