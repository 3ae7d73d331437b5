"""Gradient buckets at run time: the O2 program reduces its gradients in the buckets
the ``bucket`` pass chose (``passes/bucket.py``), one collective per bucket.

Run op by op, a parameter replicated over a mesh dim where its op's outputs diverge is
given one copy per rank (``collectives.expand_replicas``) and its gradient is all-reduced
over that dim once backward has summed its readers' gradients: one collective per
parameter (``workbench/parallel/reshard_backward.py``).
PyTorch's DDP reducer instead marks each gradient ready and launches a bucket's
all-reduce once every gradient in it is ready (Li et al. 2020, Sec. 3.2.3;
``torch/csrc/distributed/c10d/reducer.cpp``, ``Reducer::mark_variable_ready``).

:class:`GradBuckets` does that for a compiled program: before each op that the schedule
gives a gradient reduction, the parameter's per-rank copies are made here (so the
dispatcher makes none, and records no collective of its own), behind a marker whose
backward tells the bucket this gradient is ready; when the bucket's last gradient is
ready, one all-reduce of the bucket's bytes is recorded (asynchronous where the overlap
pass made it so, waited for at the end of the backward, as DDP waits in
``finalize_backward``).  A bucket whose gradients did not all arrive is launched with
those that did at the end of the backward (DDP's unused parameters).

On simulated ranks the rows of each gradient are summed by autograd (the backward of
the per-rank copies: exact, the value an all-reduce gives); what bucketing changes is
how many messages carry them and when, which is what the trace records.  Under
torch.distributed each rank holds one copy and its all-reduce is a real one, made per
parameter by the dispatcher: the program runs unbucketed there (``CompiledProgram.notes``
says so).
"""
from __future__ import annotations

import torch

from ..sim_mesh.collectives import record_collective
from ..sim_mesh.grid import ops_for
from ..sim_mesh.trace import current_trace

__all__ = ["GradBuckets"]


class _Ready(torch.autograd.Function):
    """Identity; its backward marks one gradient of a bucket ready."""

    @staticmethod
    def forward(ctx, reducer, keys, grad_of, x):
        ctx.reducer, ctx.keys, ctx.grad_of = reducer, keys, grad_of
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.reducer.ready(ctx.keys, g, ctx.grad_of)
        return None, None, None, g


class GradBuckets:
    """The buckets of one run of a compiled program (module docstring).

    ``buckets``: the schedule's gradient reductions, each ``(members, mesh_dim, async_)``
    with ``members`` the keys ``(node, input position, mesh dim)`` it reduces."""

    def __init__(self, mesh, buckets):
        self.mesh = mesh
        self.buckets = [(tuple(m), d, a) for m, d, a in buckets]
        self.of = {}
        for b, (members, _, _) in enumerate(self.buckets):
            for key in members:
                if key in self.of:
                    raise ValueError(f"gradient {key} is in two buckets ({self.of[key]}, {b})")
                self.of[key] = b
        self.ready_keys = [set() for _ in self.buckets]
        self.nbytes = [0] * len(self.buckets)
        self.launched = [False] * len(self.buckets)
        self.handles = []
        self._queued = False
        self.held: dict = {}        # id of an expanded tensor -> (the tensor, its bytes)
        self.counted = set()        # (id, mesh dim) of the gradients already in a bucket

    def axes(self, nid, pos) -> tuple:
        """The mesh dims along which input ``pos`` of node ``nid`` is reduced in a bucket."""
        return tuple(i for i in range(self.mesh.ndim) if (nid, pos, i) in self.of)

    def expand(self, nid, positions, local, axes, nbytes=None):
        """``local`` (a parameter's stacked local tensor, input ``positions`` of node
        ``nid``: one tensor read twice is expanded once, its gradient summed once) with one
        copy per rank along ``axes``, each behind its bucket's marker; None where it cannot
        be done here (the dispatcher then expands it, and reduces it, itself).  A tensor
        read by several ops counts its gradient's bytes once per mesh dim (autograd sums the
        readers' gradients first, as eager reduces once: ``grad_ways.py``); ``nbytes``: what
        one rank's gradient holds when it is reduced (a gathered copy's: its shard's, sliced
        first, as eager's ``reshard_backward.mark``), else the copy's own size."""
        if not isinstance(local, torch.Tensor) or not local.requires_grad \
                or not torch.is_grad_enabled():
            return None
        F = ops_for(local)
        for a in axes:
            if local.shape[a] != 1:
                return None
        src = local
        self.held.setdefault(id(src), (src, nbytes))
        for a in axes:
            keys = tuple((nid, p, a) for p in positions if (nid, p, a) in self.of)
            local = _Ready.apply(self, keys, (id(src), a),
                                 F.expand(local, a, self.mesh.shape[a]))
        return local

    def ready(self, keys, grad, grad_of=None):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        b = self.of[keys[0]]
        for key in keys:
            if key in self.ready_keys[b] or self.launched[b]:
                raise RuntimeError(f"compiled program: the gradient {key} arrived twice in "
                                   "one backward (backward through the same output twice?);"
                                   " run the program again for each backward")
            self.ready_keys[b].add(key)
        if grad_of not in self.counted:
            self.counted.add(grad_of)
            nb = self.held.get(grad_of[0], (None, None))[1] if grad_of else None
            # the gradient of the per-rank copies: one rank's copy is what travels
            self.nbytes[b] += nb if nb is not None else \
                grad[(0,) * self.mesh.ndim].numel() * grad.element_size()
        if len(self.ready_keys[b]) == len(self.buckets[b][0]):
            self._launch(b)

    def _launch(self, b):
        self.launched[b] = True
        members, dim, async_ = self.buckets[b]
        n = len(self.ready_keys[b])
        hs = record_collective("all_reduce", self.mesh, dim, self.nbytes[b],
                               f"grad bucket {b} ({n} gradient{'s' if n != 1 else ''})",
                               overlap=async_)
        if async_:
            self.handles.extend(hs)

    def finish(self):
        """End of the backward: launch the buckets still open, wait for every one."""
        for b in range(len(self.buckets)):
            if not self.launched[b] and self.ready_keys[b]:
                self._launch(b)
        tr = current_trace()
        for h in self.handles:
            if tr is not None:
                tr.wait(h)
        # ready for another backward through the same graph (retain_graph=True)
        self.ready_keys = [set() for _ in self.buckets]
        self.nbytes = [0] * len(self.buckets)
        self.counted = set()
        self.launched = [False] * len(self.buckets)
        self.handles, self._queued = [], False
