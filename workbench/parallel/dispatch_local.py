"""The local side of dispatch: the context a local implementation receives, running
per cell when shards are uneven, wrapping local results as DistTensors, and the opt-in
replicate fallback.  The forms of the local data are :mod:`.storage`'s business."""
from __future__ import annotations

import torch

from ..sim_mesh.trace import current_trace
from . import layout, storage
from .dist_tensor import DistTensor, TensorSpec
from .placement import Replicate

__all__ = ["Ctx", "run_cells", "wrap", "fallback", "VALIDATE"]

VALIDATE = [False]         # tests: check that "replicated" outputs really are identical


class Ctx:
    """What a local function may need beyond its tensors: the mesh, the layouts, and
    (for rank-dependent ops such as vocabulary-parallel embedding) shard offsets."""
    __slots__ = ("mesh", "in_specs", "out_placements", "out_shape", "coord", "memo")

    def __init__(self, mesh, in_specs, out_placements, out_shape, coord=None):
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_placements = out_placements
        self.out_shape = out_shape
        self.coord = coord              # set when running per rank (uneven shards)
        # a local implementation's facts of these layouts, computed on its first call (the
        # dispatcher keeps one Ctx per prepared op: per op, input specs and attributes)
        self.memo = {}

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


def run_cells(opdef, ctx, locs, attrs, outs_ps, mesh):
    """Run the local op once per cell (uneven shards); an output replicated along a mesh
    dim is computed once there."""
    nd = mesh.ndim
    lead = tuple(1 if all(ps[i].is_replicate() for ps in outs_ps) else mesh.shape[i]
                 for i in range(nd))
    many = opdef.multi or opdef.n_out > 1

    def one(c, args):
        cctx = Ctx(ctx.mesh, ctx.in_specs, ctx.out_placements, ctx.out_shape, coord=c)
        r = opdef.local(nd, cctx, *args, **attrs)
        return r if many else (r,)
    outs = storage.run_per_cell(one, locs, lead, len(outs_ps))
    return outs if many else outs[0]


def wrap(o, mesh, ps, shape):
    return DistTensor(o, mesh, ps, shape, o.dtype)


def fallback(func, args, kwargs):
    """Gather every DistTensor input, run ``func`` on the global tensors, and return
    replicated DistTensors (recorded in the trace as the gathers it needed)."""
    mesh = None

    def conv(x):
        nonlocal mesh
        if isinstance(x, DistTensor):
            mesh = x.mesh
            return x.full()
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
    return DistTensor(storage.replicated(x, mesh), mesh, (Replicate(),) * mesh.ndim,
                      x.shape, x.dtype)
