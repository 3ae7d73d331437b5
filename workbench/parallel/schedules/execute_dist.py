"""The pipeline executor on torch.distributed: each process runs its own rank's actions.

Same contract as :func:`~.execute.run_pipeline`, but every stage mesh is distributed
(``wb.distributed.mesh`` / ``register``) and each process belongs to one of them.
A process walks its rank's action list in order; activations go forward and
gradients backward by point-to-point messages between the processes at the same
coordinate of neighbouring stage meshes.  Sends are asynchronous (isend), receives
block, so the schedule's order cannot deadlock on a send (1F1B's rank 0 may send
F1 while rank 1 sends back the gradient of micro-batch 0).  Each message is a small
header (global shape, local shape, placements, and the sender's modeled clock when its
data was ready) followed by the data.

A process's trace knows only its own clock, so each message is recorded on both of its
processes (the simulated ranks record it once for the pair, :func:`.execute._send`): the
sender when it sends, the receiver when it receives, from the sender's ready time carried
in the header and its own view of the pair's link (``Trace.record_send``: the later of
the two), its compute stream waiting for the arrival before it uses the data, as the
simulated receiver waits.  Without the time carried a stage waited for no activation and
no gradient (tiny dp 2 x tp 2 x pp 2 sp, 1F1B, rank 0: 0.37281 ms, its own work packed,
for the simulator's 0.648783 ms).  What stays apart: the simulator records a forward
message when the receiving stage runs its forward, behind the pair's earlier messages
(1F1B's F1 behind B0's gradient); the sender's trace here records it when sent.  That
moves the start of those events on the sender's trace only (tiny pp 2: F1..F3 on rank 0
start at 43.2, 136.1, 199.1 us for the simulator's 84.6, 147.6, 210.6), not its clocks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...sim_mesh import backends as _B
from ...sim_mesh import cost as _cost
from ...sim_mesh.trace import current_trace
from .. import storage
from ..dist_tensor import DistTensor
from ..placement import Partial, Replicate, Shard
from .execute_checks import (check_graph_weights, check_sendable, input_grad, microbatch_rows,
                             stage_loss)

__all__ = ["run_pipeline_dist"]

_HEADER = 40          # int64 slots: ndim, global shape, local shape, placement codes,
_READY = _HEADER - 1  # and in the last, as a float64, when the sender's data was ready


def _encode(t: DistTensor) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.long)
    loc = t.local()
    nd = len(t.shape)
    h[0] = nd
    h[1:1 + nd] = torch.tensor(tuple(t.shape))
    h[9:9 + nd] = torch.tensor(tuple(loc.shape))
    codes = [-1 if p.is_replicate() else (p.dim if p.is_shard() else -2) for p in t.placements]
    h[17] = len(codes)
    h[18:18 + len(codes)] = torch.tensor(codes)
    return h


def _decode(h: torch.Tensor):
    nd = int(h[0])
    shape = tuple(int(v) for v in h[1:1 + nd])
    local = tuple(int(v) for v in h[9:9 + nd])
    ps = [Replicate() if c == -1 else (Partial("sum") if c == -2 else Shard(int(c)))
          for c in h[18:18 + int(h[17])].tolist()]
    return shape, local, ps


def _tag(kind: int, stage: int, mb: int) -> int:
    return (kind * 1000 + stage) * 1000 + mb


def run_pipeline_dist(schedule, stages, meshes, inputs, loss_fn, *, params=None,
                      dtype=torch.float32, forward_only: bool = False):
    """Run ``schedule``; ``inputs`` are used only on the first stage's processes.
    Returns a PipelineRun whose losses are broadcast to every process.  ``forward_only``
    (the caller holds ``torch.no_grad()``): the ``F`` actions alone, in the rank's order
    (removing backward actions removes dependencies only, so no receive can wait on a
    send that comes later); ``outputs`` holds the last stage's output of each
    micro-batch on its processes, None elsewhere."""
    from .execute import PipelineRun, _grad_of, _value, backward_action, last_stage_loss
    if schedule.layout != "interleaved":
        raise NotImplementedError(f"run_pipeline on torch.distributed: the {schedule.layout!r} "
                                  f"layout runs on the simulator only; use an interleaved "
                                  f"schedule (gpipe, 1f1b, interleaved, zb_h1)")
    me = _B.rank()
    p, m, v = schedule.p, schedule.m, schedule.v
    mine = [r for r in range(p) if me in meshes[r]]
    if len(mine) != 1:
        raise ValueError(f"process {me} is in {len(mine)} stage meshes; each process must "
                         "belong to exactly one")
    r = mine[0]
    mesh = meshes[r]
    coord = mesh.coordinate(me)
    partner = lambda q: meshes[q].rank_at(coord)          # noqa: E731  same coordinate
    last = p * v - 1
    pending, losses = [], torch.zeros(m)
    stage_in, stage_out = {}, {}
    checked: set = set()          # stages whose graph's weights were checked (split backward)
    tr = current_trace()

    def send(t: DistTensor, q: int, tag: int, label: str):
        dst = partner(q)
        head, data = _encode(t), t.local().detach().contiguous()
        ready = head.view(torch.float64)
        ready[_READY] = float("nan")
        if tr is not None:
            nb = data.numel() * data.element_size()
            ready[_READY] = tr.now(me)
            tr.record_send(me, dst, "send_recv", _cost.price("send_recv", nb, (me, dst),
                           tr.profile), ready=tr.now(me), bytes=nb, label=label,
                           args={"src": me, "dst": dst})
        pending.append(dist.isend(head, dst, tag=tag))
        pending.append(dist.isend(data, dst, tag=tag + 1))

    def recv(q: int, tag: int, label: str) -> DistTensor:
        src = partner(q)
        head = torch.empty(_HEADER, dtype=torch.long)
        dist.recv(head, src, tag=tag)
        shape, local, ps = _decode(head)
        data = torch.empty(local, dtype=dtype)
        dist.recv(data, src, tag=tag + 1)
        ready = float(head.view(torch.float64)[_READY])
        if tr is not None and ready == ready:           # the sender's trace timed it
            nb = data.numel() * data.element_size()     # the receiver's side: the arrival
            tr.wait(tr.record_send(src, me, "send_recv",
                                   _cost.price("send_recv", nb, (src, me), tr.profile),
                                   ready=ready, bytes=nb, label=label,
                                   args={"src": src, "dst": me}))
        return DistTensor(storage.from_own(data, mesh), mesh, ps, shape, dtype)

    outputs = [None] * m
    actions = [a for a in schedule.actions[r] if a.kind == "F" or not forward_only]
    for a in actions:
        s = a.chunk * p + r
        key = (s, a.mb)
        if a.kind == "F" and forward_only:
            x = inputs[a.mb] if s == 0 else recv((s - 1) % p, _tag(1, s, a.mb),
                                                 f"F{a.mb} stage {s - 1}->{s}")
            with microbatch_rows(x, a.mb, m):
                out = stages[s](x)
            if s != last:
                check_sendable(out, s)
                send(out, (s + 1) % p, _tag(1, s + 1, a.mb), f"F{a.mb} stage {s}->{s + 1}")
                continue
            outputs[a.mb] = out
            if loss_fn is not None:         # a partial loss reduced over the last mesh
                losses[a.mb] = float(_value(stage_loss(loss_fn, out, a.mb)))
            continue
        if a.kind == "F":
            if s == 0:
                x = inputs[a.mb]
            else:
                x = recv((s - 1) % p, _tag(1, s, a.mb),
                         f"F{a.mb} stage {s - 1}->{s}").detach().requires_grad_()
            stage_in[key] = x
            with microbatch_rows(x, a.mb, m):     # keyed dropout: its rows
                out = stages[s](x)
            if s == last:
                out, losses[a.mb] = last_stage_loss(loss_fn, out, a.mb, m)
            else:
                check_sendable(out, s)
                send(out, (s + 1) % p, _tag(1, s + 1, a.mb), f"F{a.mb} stage {s}->{s + 1}")
            if schedule.split_backward and params is not None and s not in checked:
                check_graph_weights(out, x, params[s], s)
                checked.add(s)
            stage_out[key] = out
            continue
        out = stage_out[key]
        split_b = a.kind == "B" and schedule.split_backward
        if s == last:
            g = None
        elif a.kind == "W":
            g = stage_out.pop(("g",) + key)
        else:
            g = recv((s + 1) % p, _tag(2, s, a.mb), f"B{a.mb} stage {s + 1}->{s}")
            if split_b:
                stage_out[("g",) + key] = g
        x = stage_in[key]
        backward_action(a, schedule, out, g, x, s, params, stage_out, key)
        if s > 0 and a.kind == "B":
            send(input_grad(_grad_of(x), s, s, a.mb), (s - 1) % p, _tag(2, s - 1, a.mb),
                 f"B{a.mb} stage {s}->{s - 1}")
    for w in pending:
        w.wait()
    dist.broadcast(losses, src=meshes[last % p].ranks[0])
    order = [(r, a) for a in actions]
    if forward_only:
        return PipelineRun([float(v) for v in losses] if loss_fn is not None else [], order,
                           outputs)
    return PipelineRun([float(v) for v in losses], order)
