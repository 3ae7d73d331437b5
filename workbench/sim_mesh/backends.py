"""The real engine: the same collectives on torch.distributed, one rank per process.

    # torchrun --nproc-per-node 4 my_script.py
    import workbench as wb
    wb.distributed.init()                                   # gloo on CPU, hccl / nccl on devices
    mesh = wb.distributed.mesh((2, 2), ("dp", "tp"))        # every process builds the same meshes
    x = wb.shard_tensor(X, mesh, [wb.Shard(0), wb.Replicate()])   # this process keeps its shard

A mesh built by :func:`mesh` is *distributed*: its DistTensors hold only this
process's local shard (the stacked layout with every leading axis of size 1), and
the collectives of :mod:`workbench.sim_mesh.collectives` run on torch.distributed
process groups, one per group along each mesh dim.  The autograd contract is the
simulator's: the backward of an all-gather to a per-rank use is a reduce-scatter,
of a compact (replicated) all-reduce the identity (Megatron's g), of
``expand_replicas`` an all-reduce (Megatron's f), and so on.

A dead or frozen rank ends the job within ``timeout_s`` (plus a few seconds): every
process group, subgroups included, carries init()'s timeout (``new_group``'s own default
is 30 minutes), so the peers of a dead rank fail; a rank stopped by SIGSTOP is ended by
its peers on the same host (:mod:`workbench.sim_mesh.peers`), since torchrun's SIGTERM
cannot reach a stopped process and its SIGKILL comes only after ``--shutdown-timeout``
(30 s by default; torch/distributed/run.py, launcher/api.py ``shutdown_timeout``).  That
launcher option, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, shortens the grace of *every*
worker and must be given by whoever launches; torch.distributed.elastic's own watch
(``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``) covers only uninterruptible sleep.

This module keeps one piece of process-wide state, as torch.distributed itself
does: which meshes are distributed, and their process groups.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import peers

__all__ = ["init", "MAX_TIMEOUT_S", "mesh", "is_distributed", "rank", "world_size", "shutdown",
           "group", "broadcast_", "all_reduce_", "reduce_scatter_single_"]

_GROUPS: dict = {}          # (mesh, axis, ranks) -> ProcessGroup
_MESHES: set = set()
_TIMEOUT: list = [None]     # init()'s timeout, given to every subgroup too
_ON_REGISTER: list = []     # caches keyed by a mesh's value, cleared when one turns real

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest init() timeout: a week.  A hung collective should end the job and free
its machines (torch's defaults, torch/distributed/constants.py: default_pg_timeout 30
minutes; default_pg_nccl_timeout 10 in CUDA builds), and far longer values overflow ``timedelta``
(999,999,999 days) before they reach the backend."""


def init(backend: str | None = None, timeout_s: float = 60.0) -> None:
    """Join the job torchrun started (env:// rendezvous).  ``backend`` defaults to the
    device's: hccl on Ascend, nccl on CUDA, gloo on CPU.  A failing rank makes the
    others stop after ``timeout_s`` with an error instead of hanging; a rank stopped
    for ``timeout_s`` is ended by its peers on its host (see the module docstring)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"init(timeout_s={timeout_s!r}): give a number of seconds in "
                         f"(0, {MAX_TIMEOUT_S:g}] (a week at most), e.g. timeout_s=60")
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("workbench.distributed.init(): no RANK / WORLD_SIZE in the "
                           "environment; launch with `torchrun --nproc-per-node N script.py`")
    if backend is None:
        from ..npu.device import dist_backend
        backend = dist_backend()
    _TIMEOUT[0] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=_TIMEOUT[0])
    # the store init_process_group rendezvoused on (torch has no public getter for it)
    peers.start(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                dist.get_world_size(), timeout_s)


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def shutdown() -> None:
    peers.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUPS.clear()
    _MESHES.clear()


def mesh(shape, dim_names=None, start: int = 0):
    """A distributed mesh over ranks ``start ..`` (row-major), with its process groups.

    Every process must build the same meshes in the same order (new_group is collective)."""
    from .mesh import Mesh
    m = Mesh.grid(shape, dim_names, start=start)
    return register(m)


def register(m):
    """Make an existing Mesh distributed (create a process group per group along each dim)."""
    if not dist.is_initialized():
        raise RuntimeError("workbench.distributed: call wb.distributed.init() first")
    if max(m.ranks) >= dist.get_world_size():
        raise ValueError(f"mesh ranks {list(m.ranks)} need {max(m.ranks) + 1} processes; this "
                         f"job has {dist.get_world_size()}: launch torchrun --nproc-per-node "
                         f"{max(m.ranks) + 1}")
    if m in _MESHES:
        return m
    # a mesh is compared by value: what was cached for a simulated mesh equal to this one
    # (e.g. dispatch's prepared ops, built for the stacked layout) is stale once it is real
    for fn in _ON_REGISTER:
        fn()
    for axis in range(m.ndim):
        for g in m.groups(axis):
            # new_group's own default is 30 minutes: a frozen peer would hang the job
            _GROUPS[(m, axis, g)] = dist.new_group(list(g), timeout=_TIMEOUT[0])
    _MESHES.add(m)
    return m


def register_submesh(parent, sub, dims):
    """Make ``sub`` (``parent``'s ranks along ``dims`` through this process's rank, e.g.
    ``mesh["dp"]``) distributed with the parent's process groups: each of its groups is
    one of the parent's along the same dim, so no process group is made (no collective)."""
    if sub in _MESHES:
        return sub
    for fn in _ON_REGISTER:
        fn()
    for axis, d in enumerate(dims):
        for g in sub.groups(axis):
            _GROUPS[(sub, axis, g)] = _GROUPS[(parent, d, g)]
    _MESHES.add(sub)
    return sub


def on_register(fn):
    """Call ``fn()`` whenever a mesh becomes distributed (:func:`register`)."""
    _ON_REGISTER.append(fn)
    return fn


def is_distributed(m) -> bool:
    return bool(_MESHES) and m in _MESHES      # (no hash of m in the simulator)


def group(m, axis: int):
    """(process group, ranks) of this process's group along mesh dim ``axis``."""
    g = m.group_of(dist.get_rank(), axis)
    return _GROUPS[(m, axis, g)], g


def coordinate(m):
    return m.coordinate(dist.get_rank())


def local_index(m, axis: int) -> int:
    return coordinate(m)[axis]


def broadcast_(t, m, axis: int, root: int = 0):
    """In place: this process's ``t`` becomes the one of the ``root``-th rank of its group
    along mesh dim ``axis`` (replicas made equal; no autograd)."""
    pg, g = group(m, axis)
    with torch.no_grad():
        dist.broadcast(t, src=g[root], group=pg)
    return t


# ---- the collectives ----------------------------------------------------------------------
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def _extreme(op, t) -> bool:
    return op in ("max", "min") and t.is_floating_point()


def all_reduce_(t, op: str = "sum", group=None):
    """In place: ``dist.all_reduce(t)`` by ``op`` ("sum", "avg": summed here, "max",
    "min") over ``group`` (None: every process).  A floating max / min propagates NaN, as
    torch's amax / amin and the simulator (grid.reduce) do: gloo's MAX / MIN drop a NaN
    (max(NaN, 0) gave 0 under torchrun, tests/test_sweep17.py), so the ranks' NaN
    positions are reduced beside the values (a second all-reduce, of the same size).
    Every caller of a MAX / MIN all-reduce of floats goes through here (sweep18)."""
    nan = None
    if _extreme(op, t):
        nan = t.isnan().to(t.dtype)
        dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(t, op=_OPS[op], group=group)
    if nan is not None:
        t.masked_fill_(nan > 0, float("nan"))
    return t


def reduce_scatter_single_(out, flat, op: str = "sum", group=None):
    """``dist.reduce_scatter_single(out, flat)`` by ``op``, NaN propagating for a floating
    max / min as :func:`all_reduce_` (gloo's MAX / MIN dropped it: a P(max) with a NaN part
    reduce-scattered to S(d) lost it, tests/test_sweep18.py)."""
    dist.reduce_scatter_single(out, flat, op=_OPS[op], group=group)
    if _extreme(op, flat):
        nan = torch.empty_like(out)
        dist.reduce_scatter_single(nan, flat.isnan().to(flat.dtype), op=dist.ReduceOp.MAX,
                                   group=group)
        out.masked_fill_(nan > 0, float("nan"))
    return out


def _all_reduce(t, pg, op="sum"):
    return all_reduce_(t.contiguous().clone(), op, pg)


def wire(t):
    """``t`` as the memory a collective sends: torch's lazy conjugate / negative bits
    resolved (``z.conj()``, ``z.conj().imag`` locals: gloo reads the memory behind the bit,
    and its complex path's view_as_real refuses a conjugate view, sweep18), contiguous."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def _all_gather(t, pg, n, dim):
    t = wire(t)
    out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_single(out, t.reshape(-1), group=pg)   # all_gather_into_tensor: deprecated
    return torch.cat(list(out.reshape((n,) + tuple(t.shape)).unbind(0)), dim)


def _reduce_scatter(t, pg, n, dim, op="sum"):
    pieces = torch.stack([c.contiguous() for c in t.chunk(n, dim)])      # (n, *chunk)
    out = torch.empty(pieces[0].numel(), dtype=t.dtype, device=t.device)
    reduce_scatter_single_(out, pieces.reshape(-1), op, pg)     # (_single, not _tensor)
    return out.reshape(pieces.shape[1:])


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, n, op, expanded):
        ctx.pg, ctx.n, ctx.op, ctx.expanded = pg, n, op, expanded
        y = _all_reduce(x, pg, op)
        if op == "avg":
            y = y / n
        if op in ("max", "min"):
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        if ctx.expanded:                  # each rank used its copy differently: sum them
            g = _all_reduce(g, ctx.pg, "sum")
        if ctx.op == "avg":
            g = g / ctx.n
        elif ctx.op in ("max", "min"):
            x, y = ctx.saved_tensors
            hit = (x == y) | (x.isnan() & y.isnan())                    # NaN: grid._Extreme
            count = _all_reduce(hit.to(g.dtype), ctx.pg, "sum")
            # zero off the mask, not g * 0: an inf / NaN upstream gradient gave NaN at the
            # ranks that lost (torch's evenly_distribute_backward fills zeros there, as
            # grid._Extreme does: tests/test_sweep17.py)
            g = torch.where(hit, g / count, g.new_zeros(()))
        return g, None, None, None, None


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, n, dim, k, expanded):
        ctx.pg, ctx.n, ctx.dim, ctx.k, ctx.expanded = pg, n, dim, k, expanded
        return _all_gather(x, pg, n, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.expanded:                  # per-rank uses: reduce-scatter the gradients
            return _reduce_scatter(g, ctx.pg, ctx.n, ctx.dim), None, None, None, None, None
        return g.chunk(ctx.n, ctx.dim)[ctx.k].contiguous(), None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, n, dim, op):
        ctx.pg, ctx.n, ctx.dim = pg, n, dim
        return _reduce_scatter(x, pg, n, dim, op)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.pg, ctx.n, ctx.dim), None, None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, n, split_dim, concat_dim):
        ctx.pg, ctx.n, ctx.split, ctx.concat = pg, n, split_dim, concat_dim
        return _all_to_all(x, pg, n, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.pg, ctx.n, ctx.concat, ctx.split), None, None, None, None


def _all_to_all(x, pg, n, split_dim, concat_dim):
    send = torch.stack([c.contiguous() for c in x.chunk(n, split_dim)]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return torch.cat(list(recv.unbind(0)), concat_dim)


class ExpandReplicas(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' gradients (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.pg, "sum"), None


class SliceOwn(torch.autograd.Function):
    """R -> S(dim): keep this rank's chunk; the backward all-gathers the gradient (R)."""

    @staticmethod
    def forward(ctx, x, pg, n, k, dim):
        ctx.pg, ctx.n, ctx.dim = pg, n, dim
        # a copy, not a view: a rank holds its shard, not the whole tensor behind it
        return x.chunk(n, dim)[k].clone(memory_format=torch.contiguous_format) \
            if x.shape[dim] % n == 0 else _uneven(x, n, k, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.pg, ctx.n, ctx.dim), None, None, None, None


def _uneven(x, n, k, dim):
    raise ValueError(f"SliceOwn: a dim of {x.shape[dim]} split over {n} processes is uneven; "
                     "use sim_mesh.padded.SliceOwn with the pieces' lengths "
                     "(parallel/dist_uneven.pieces)")


class KeepOnFirst(torch.autograd.Function):
    """R -> P(sum): the first rank of the group keeps the value, the others hold zeros.
    The gradient of a partial value is the same on every rank: the identity."""

    @staticmethod
    def forward(ctx, x, k):
        return x.clone() if k == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class GradOnFirst(torch.autograd.Function):
    """A replicated result computed from per-rank copies: one copy stands for it in
    backward (the simulator keeps the first copy of such a result), so the copies'
    gradients are not counted once per rank."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.k == 0 else torch.zeros_like(g)), None


def tag(t, axes):
    """Mark ``t`` as holding one copy per rank along ``axes`` (an expanded replica)."""
    t._wb_replica_axes = tuple(sorted(set(getattr(t, "_wb_replica_axes", ())) | set(axes)))
    return t
