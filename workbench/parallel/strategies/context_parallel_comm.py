"""Context parallelism's communication: K/V blocks passed to the next rank of the ring.

The sibling of :mod:`.context_parallel` (as picotron keeps ``cp_communications.py`` beside
its context parallelism). One send/recv per ring step, async on the modeled clock so it
runs beside the step's attention block; its backward sends the gradients (dK, dV) back to
the previous rank. In the simulator a pass is a roll of the stacked shards along the mesh
dim; on torch.distributed a ``batch_isend_irecv`` pair in the cp process group.
"""
from __future__ import annotations

import torch

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh.backward_pass import in_weight_pass
from ...sim_mesh.trace import current_trace
from .. import storage
from ..dist_tensor import DistTensor

__all__ = ["ring_pass", "pass_on", "wait", "await_in_backward"]


# ---- moving K/V around the ring -------------------------------------------------------------

def _shift(x, mesh, axis: int, by: int):
    """Rank i gets the local tensor of rank i - by along mesh dim ``axis`` (stacked)."""
    if _B.is_distributed(mesh):
        import torch.distributed as dist
        pg, g = _B.group(mesh, axis)
        k, p = g.index(_B.rank()), len(g)
        own = x.contiguous()
        buf = torch.empty_like(own)
        ops = [dist.P2POp(dist.isend, own, g[(k + by) % p], pg),
               dist.P2POp(dist.irecv, buf, g[(k - by) % p], pg)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        return buf
    return torch.roll(x, by, dims=axis)


def _record(mesh, axis, nb, label):
    """One async send/recv per ring (every rank sends one block to its next rank and
    receives one at once, full duplex): its handles, to wait on before the data is used."""
    return C.record_collective("send_recv", mesh, axis, nb, label, overlap=True)


class _RingPass(torch.autograd.Function):
    """Forward: each rank's tensors go to the next rank of the ring. Backward: the
    gradients go back to the previous rank (dK/dV travel the ring back), recorded as
    an async send/recv that overlaps the backward of the attention blocks."""

    @staticmethod
    def forward(ctx, info, *xs):
        ctx.info = info
        mesh, axis, _, _ = info
        return tuple(_shift(x, mesh, axis, 1) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        mesh, axis, label, box = ctx.info
        if current_trace() is not None and not (getattr(ctx, "recorded", False)
                                                and in_weight_pass()):   # (W: B's, again)
            ctx.recorded = True
            box.extend(_record(mesh, axis, sum(storage.rank_bytes(g, mesh.ndim) for g in grads),
                               f"{label}: dK/dV back (backward)"))
        return (None,) + tuple(_shift(g, mesh, axis, -1) for g in grads)


class _AwaitInBackward(torch.autograd.Function):
    """Identity; in backward, the compute streams wait for the send/recvs in ``box``
    (the dK/dV that came home) before the gradient goes on to K's and V's producers."""

    @staticmethod
    def forward(ctx, box, *xs):
        ctx.box = box
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        wait(ctx.box)
        ctx.box.clear()
        return (None,) + grads


def ring_pass(tensors, mesh_dim, *, label: str = "ring attention K/V", box=None):
    """Send each DistTensor's local shard to the next rank along ``mesh_dim`` (and receive
    the previous rank's), asynchronously on the modeled clock. Returns (the moved
    DistTensors, handles): ``wait(handles)`` before the moved data is used. ``box``: a
    list that collects the backward's send/recv handles (see :func:`await_in_backward`)."""
    mesh = tensors[0].mesh
    axis = mesh.dim(mesh_dim)
    try:
        locs = [storage.to_stacked(t._local) for t in tensors]
    except RuntimeError:                  # cells of different shapes: uneven shards
        locs = None
    if locs is None or any(l.shape[axis] != mesh.shape[axis]
                           for l in locs if not _B.is_distributed(mesh)):
        raise ValueError(f"ring_pass: every tensor must be sharded over mesh dim "
                         f"{mesh.dim_names[axis]!r}, with even shards on every mesh dim; got "
                         f"shapes {[tuple(t.shape) for t in tensors]} with placements "
                         f"{[list(t.placements) for t in tensors]}: make each sharded tensor "
                         "dim divide by its mesh dims (e.g. the batch by dp)")
    handles = []
    if current_trace() is not None:
        nb = sum(storage.rank_bytes(l, mesh.ndim) for l in locs)
        handles = _record(mesh, axis, nb, label)
    moved = _RingPass.apply((mesh, axis, label, [] if box is None else box), *locs)
    out = [DistTensor(m, mesh, t.placements, t.shape, t.dtype) for m, t in zip(moved, tensors)]
    return out, handles


def pass_on(locs, mesh, axis: int, label: str, record: bool = True):
    """Local tensors (the stacked form, or this process's own) to the next rank along mesh
    dim ``axis``, outside autograd (ring attention's backward moves K/V and dK/dV so:
    ``context_parallel_backward.py``), as one async send/recv on the clock when ``record``
    and a trace is on. Returns (the moved tensors, handles)."""
    handles = []
    if record and current_trace() is not None:
        handles = _record(mesh, axis, sum(storage.rank_bytes(l, mesh.ndim) for l in locs),
                          label)
    return [_shift(l, mesh, axis, 1) for l in locs], handles


def wait(handles) -> None:
    """The compute streams wait for the send/recvs of ``handles`` (:func:`ring_pass`)."""
    tr = current_trace()
    if tr is not None:
        for h in handles:
            tr.wait(h)


def await_in_backward(tensors, box: list):
    """``tensors`` (DistTensors) unchanged; when their gradients pass in backward, the
    compute streams first wait for the send/recvs collected in ``box``."""
    if not any(storage.requires_grad(t._local) for t in tensors) or not torch.is_grad_enabled():
        return list(tensors)
    locs = [storage.to_stacked(t._local) for t in tensors]
    out = _AwaitInBackward.apply(box, *locs)
    return [DistTensor(o, t.mesh, t.placements, t.shape, t.dtype) for o, t in zip(out, tensors)]
