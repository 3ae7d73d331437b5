"""The uneven all-to-all: expert parallelism's token exchange, over the simulated mesh or
torch.distributed, priced, traced and differentiable (re-exported by ``collectives``).

``torch.distributed.all_to_all_single(out, x, output_split_sizes, input_split_sizes)``
sends each rank a different number of rows; a router makes exactly that (Megatron-LM's
``MoEAlltoAllTokenDispatcher``: the counts first, then the tokens).  On the simulator
the exchange is a re-indexing of the ranks' tensors (autograd sends the gradients back
the same way); the trace gets the count exchange, the exchange priced by its busiest
rank, and in backward the reverse exchange.
"""
from __future__ import annotations

import math

import torch

from . import backends as _B
from . import cost as _cost
from .backward_pass import in_weight_pass
from .collectives import record_collective
from .trace import current_trace

__all__ = ["all_to_all_v", "all_to_all_v_time", "record_all_to_all_v"]


def all_to_all_v_time(send_bytes, group, profile) -> tuple[float, int]:
    """(seconds, bytes the busiest rank sends) of an all-to-all where rank ``group[i]``
    sends ``send_bytes[i][j]`` bytes to ``group[j]`` (uneven, as
    ``torch.distributed.all_to_all_single`` with split sizes).  Every rank's links carry
    its own sends and receives, so the busiest rank sets the time: priced as the even
    all-to-all whose per-rank off-rank traffic, (p-1)/p n, is the busiest rank's
    max(sent, received) (the module's size convention), on the profile's topology."""
    p = len(group)
    if p == 1:
        return 0.0, 0
    sent = [sum(row) - row[i] for i, row in enumerate(send_bytes)]
    recv = [sum(send_bytes[i][j] for i in range(p)) - send_bytes[j][j] for j in range(p)]
    busiest = max(max(s, r) for s, r in zip(sent, recv))
    if busiest == 0:
        return 0.0, 0
    return _cost.price("all_to_all", busiest * p / (p - 1), group, profile), max(sent)


def record_all_to_all_v(send_bytes, group, label: str = "", overlap: bool = False,
                        ready=None, args=None):
    """Record the uneven all-to-all of :func:`all_to_all_v_time` on the current trace
    (blocking, or async on the comm stream with ``overlap=True``); its handle, or None."""
    tr = current_trace()
    if tr is None or len(group) == 1:
        return None
    dur, sent = all_to_all_v_time(send_bytes, group, tr.profile)
    return tr.record_collective(
        group, "all_to_all", dur, bytes=int(sent), label=label, overlap=overlap, ready=ready,
        args={"uneven": True, "send_bytes": [list(map(int, r)) for r in send_bytes],
              **(args or {})})


class _AllToAllVDist(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` with split sizes; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, pg, send_rows, recv_rows):
        ctx.pg, ctx.send, ctx.recv = pg, send_rows, recv_rows
        return _a2av_dist(x, pg, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, g):
        return _a2av_dist(g, ctx.pg, ctx.recv, ctx.send), None, None, None


def _a2av_dist(x, pg, send_rows, recv_rows):
    import torch.distributed as dist
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_rows),
                           input_split_sizes=list(send_rows), group=pg)
    return out


def all_to_all_v(chunks, mesh, axis, *, label: str = "", record: bool = True,
                 recv_rows=None):
    """Uneven all-to-all over the groups of ``mesh`` along ``axis``: rank i of a group
    sends ``chunks[i][j]`` (any number of rows) to rank j; the counts go first (a small
    all-to-all of int64 row counts, as Megatron-LM's ``MoEAlltoAllTokenDispatcher``
    exchanges ``tokens_per_expert`` before the tokens), then the rows.

    Simulator: ``chunks`` is ``{group: [[tensor to j for j] for i]}`` for the groups
    listed (any subset of ``mesh.groups(axis)``); returns ``{group: recv}`` with
    ``recv[j][i] = chunks[i][j]`` (autograd flows through: the gradient goes back the
    same way).  torch.distributed: ``chunks`` is this process's list (one tensor per
    group rank); returns the list it receives (autograd: the reverse all-to-all).
    ``record``: put the count exchange and the exchange (backward: the reverse) on the
    trace, priced by :func:`all_to_all_v_time`.  ``recv_rows`` (torch.distributed): the
    rows this process receives from each, when the caller exchanged the counts already."""
    ax = mesh.dim(axis)
    if _B.is_distributed(mesh):
        import torch.distributed as dist
        pg, g = _B.group(mesh, ax)
        p = len(g)
        if len(chunks) != p:
            raise ValueError(f"all_to_all_v: {len(chunks)} chunks for a group of {p} ranks "
                             f"along {mesh.dim_names[ax]!r}; give one per rank")
        send_rows = [int(c.shape[0]) for c in chunks]
        exchange = recv_rows is None
        if exchange:
            counts = torch.tensor(send_rows, dtype=torch.int64)
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=pg)               # counts first
            recv_rows = got.tolist()
        row = math.prod(chunks[0].shape[1:]) * chunks[0].element_size()   # bytes a row
        me = g.index(_B.rank())
        matrix = [[0] * p for _ in range(p)]             # what this process knows
        matrix[me] = [r * row for r in send_rows]
        for i, r in enumerate(recv_rows):
            matrix[i][me] = r * row
        if record:
            if exchange:
                record_collective("all_to_all", mesh, ax, 8 * p, label + " counts",
                                  groups=[g])
            record_all_to_all_v(matrix, g, label)
        y = _AllToAllVDist.apply(torch.cat(list(chunks)), pg, send_rows, recv_rows)
        if record:
            y = _on_backward_v(y, [(g, [list(r) for r in zip(*matrix)])], label)
        return list(y.split(recv_rows))
    out, pending = {}, []
    for g, send in chunks.items():
        p = len(g)
        if len(send) != p or any(len(row) != p for row in send):
            raise ValueError(f"all_to_all_v: chunks[{g}] must be {p} lists of {p} tensors "
                             "(what each rank of the group sends to each)")
        out[g] = [[send[i][j] for i in range(p)] for j in range(p)]
        matrix = [[t.numel() * t.element_size() for t in row] for row in send]
        if record:
            record_collective("all_to_all", mesh, ax, 8 * p, label + " counts", groups=[g])
            record_all_to_all_v(matrix, g, label)
            pending.append((g, [list(r) for r in zip(*matrix)]))
    if record and pending:
        flat = [t for g in out for row in out[g] for t in row]
        idx = [i for i, t in enumerate(flat) if t.requires_grad]
        if idx and torch.is_grad_enabled():
            marked = _BackwardV.apply((pending, label), *[flat[i] for i in idx])
            marked = marked if isinstance(marked, tuple) else (marked,)
            for i, m in zip(idx, marked):
                flat[i] = m
            k = 0
            for g in out:
                for row in out[g]:
                    for i in range(len(row)):
                        row[i] = flat[k]
                        k += 1
    return out


class _BackwardV(torch.autograd.Function):
    """Identity whose backward records the reverse uneven all-to-all of each group."""

    @staticmethod
    def forward(ctx, info, *xs):
        ctx.info = info
        return tuple(x.view_as(x) for x in xs) if len(xs) > 1 else xs[0].view_as(xs[0])

    @staticmethod
    def backward(ctx, *grads):
        if getattr(ctx, "recorded", False) and in_weight_pass():
            return (None,) + grads       # a split backward's W walking B's graph again
        ctx.recorded = True
        pending, label = ctx.info
        for g, reverse in pending:
            record_all_to_all_v(reverse, g, label + " (backward)")
        return (None,) + grads


def _on_backward_v(y, pending, label):
    if y.requires_grad and torch.is_grad_enabled():
        return _BackwardV.apply((pending, label), y)
    return y
