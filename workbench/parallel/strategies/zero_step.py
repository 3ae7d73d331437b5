"""ZeRO stages 1 and 2 of :class:`.data_parallel.DataParallel`: the step on sharded
states, with the gradients and parameters moved in one buffer each.

* one buffer: every gradient (flattened, padded to a multiple of N_d) is laid out
  rank-major in one contiguous buffer, so one reduce-scatter leaves rank k its chunk k
  of each (Megatron-LM's distributed optimizer shards one contiguous gradient buffer
  the same way, ``megatron/core/distributed/param_and_grad_buffer.py``), and the
  updated shards come back in one all-gather;
* ZeRO-2 (DeepSpeed's ``overlap_comm``): each gradient's reduce-scatter is launched
  from a post-accumulate-grad hook as soon as backward has produced it, async on the
  simulated clock (the dp group's comm stream), and only the shard is kept; ``step``
  waits for them.  A gradient a wgrad produced is issued after the collective of the
  same backward's input gradient (tensor parallelism's f), which Megatron-LM launches
  before the wgrad GEMM (``Trace.defer``).  On torch.distributed the collectives are
  blocking calls, so there the reduce-scatter stays in ``step``.
"""
from __future__ import annotations

import math

import torch

from ...ops import adamw as _adamw
from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh import cost as _cost
from .flat_shards import pack_rank_major, unflat, unpack

__all__ = ["ZeroStep", "defer_reduce_scatter"]


def defer_reduce_scatter(tr, mesh, axis: int, nbytes: int, label: str, pending: list) -> None:
    """A gradient's async reduce-scatter over ``axis``, issued now (its data ready at the
    ranks' compute clock) from a gradient hook: recorded before the next event unless
    that is the collective of the same backward's input gradient, which Megatron-LM
    launches before the wgrad GEMM that made this gradient (``Trace.defer``); its
    handles go to ``pending`` as ``(trace, handle)``."""
    ready = max(tr.now(r) for r in mesh.ranks)

    def record():
        for g in mesh.groups(axis):
            if len(g) > 1:
                pending.append((tr, tr.record_collective(
                    g, "reduce_scatter", _cost.price("reduce_scatter", nbytes, g, tr.profile),
                    bytes=_cost.wire_bytes("reduce_scatter", nbytes, len(g)), label=label,
                    args={"mesh_dim": mesh.dim_names[axis], "buffer_bytes": int(nbytes)},
                    overlap=True, ready=ready)))
    tr.defer(ready, record)


class ZeroStep:
    """The ZeRO-1/2 half of ``DataParallel`` (it holds mesh, axis, n, m, v, params)."""

    def _lead(self, t):
        """``t`` with every mesh axis at full size (one copy per rank), so tensors of
        different placements can share one buffer (torch.distributed: one rank, all 1)."""
        lead = (1,) * self.mesh.ndim if self.distributed else tuple(self.mesh.shape)
        return t.expand(lead + tuple(t.shape[self.mesh.ndim:]))

    def _pack(self, flats):
        """Padded flat tensors (lead, N_d * c_i) -> one buffer (lead, N_d * sum c_i) laid
        out rank-major (chunk k of every tensor, then chunk k + 1...): a reduce-scatter of
        it leaves rank k exactly its chunk k of each (Megatron's distributed optimizer
        shards one contiguous gradient buffer the same way)."""
        return pack_rank_major([self._lead(f) for f in flats], self.n, self.mesh.ndim)

    def _unpack(self, buf, like):
        """A buffer of shards (lead, sum c_i) -> one shard per tensor, each with the
        lead axes of ``like[i]`` (a replicated axis back to one copy)."""
        out, nd = [], self.mesh.ndim
        for t, piece in zip(like, unpack(buf, [t.shape[-1:] for t in like], nd)):
            for a in range(nd):
                if t.shape[a] == 1 and piece.shape[a] != 1:
                    piece = piece.narrow(a, 0, 1)
            out.append(piece)
        return out

    def _adamw(self, ps, gs, ms, vs, live) -> None:
        """One AdamW call per step count (parameter ``live[j]`` has taken
        ``self._steps[live[j]]`` steps, as torch.optim.AdamW counts them: a parameter
        left without a gradient does not advance); every parameter in one call when all
        agree, the usual case."""
        by_step: dict = {}
        for j, i in enumerate(live):
            by_step.setdefault(self._steps[i], []).append(j)
        for t, js in by_step.items():
            _adamw(*([seq[j] for j in js] for seq in (ps, gs, ms, vs)), t, lr=self.lr,
                   beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                   weight_decay=self.wd)

    def _reduce_scatter_hook(self, i):
        """ZeRO-2 (DeepSpeed's overlap_comm): as soon as backward has accumulated a
        parameter's gradient, launch its reduce-scatter on the comm stream and keep only
        this rank's shard (the full gradient is freed); ``step`` waits for it."""
        def hook(leaf):
            from ...sim_mesh.trace import current_trace, suspend
            g = leaf.grad
            with suspend(), torch.no_grad():     # the math; recorded below as async
                gs = C.reduce_scatter(self._flat(g), self.mesh, self.axis, 0, "sum")
            gs = self._unpack(gs, [self.m[i]])[0]
            self._gshard[i] = gs if i not in self._gshard else self._gshard[i] + gs
            nb = math.prod(self._flat(g).shape[self.mesh.ndim:]) * g.element_size()
            tr = current_trace()
            leaf.grad = None
            if tr is not None:
                defer_reduce_scatter(tr, self.mesh, self.axis, nb, "zero-2 grad (async)",
                                 self._pending)
        return hook

    def _zero_step(self, params, grads, ms, vs, live):
        from ...sim_mesh.trace import current_trace
        mesh, ax, nd = self.mesh, self.axis, self.mesh.ndim
        tr = current_trace()
        if tr is not None:
            tr.flush()                      # ZeRO-2's deferred reduce-scatters recorded
        for t, h in self._pending:          # ZeRO-2: the reduce-scatters launched in backward
            if t is tr and tr is not None:
                tr.wait(h)
        self._pending = []
        shards = [self._gshard.pop(i, None) for i in live]
        todo = [j for j, g in enumerate(grads) if g is not None]
        if todo:     # gradients not reduced in backward: one reduce-scatter of one buffer
            buf = self._pack([self._flat(grads[j]) for j in todo])
            red = C.reduce_scatter(buf, mesh, ax, 0, "sum", label=f"zero-{self.zero} grad")
            for j, gs in zip(todo, self._unpack(red, [ms[j] for j in todo])):
                shards[j] = gs if shards[j] is None else shards[j] + gs
        # my shard of the parameters (rank k of dp keeps chunk k of the flat tensor)
        ps = []
        for p in params:
            chunks = self._flat(p._local.detach()).unflatten(-1, (self.n, -1))
            if self.distributed:
                ps.append(chunks.select(-2, _B.local_index(mesh, ax)).contiguous())
            else:
                ps.append(torch.diagonal(chunks, dim1=ax, dim2=nd).movedim(-1, ax).contiguous())
        self._adamw(ps, [g.contiguous() for g in shards], ms, vs, live)
        # the updated shards, gathered back in one buffer
        full = C.all_gather(torch.cat([self._lead(s) for s in ps], dim=-1), mesh, ax, 0,
                            expanded=True, label=f"zero-{self.zero} params")
        full = full.unflatten(-1, (self.n, -1))
        off = 0
        for p, s in zip(params, ps):        # rank-major: chunk k of each, back whole
            loc, c = p._local, s.shape[-1]
            piece = unflat(full[..., off:off + c].flatten(-2), loc.shape[nd:], nd)
            off += c
            for a in range(nd):
                if loc.shape[a] == 1 and piece.shape[a] != 1:
                    piece = piece.narrow(a, 0, 1)
            loc.copy_(piece)
