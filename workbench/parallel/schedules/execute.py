"""Run a real model, split into pipeline stages on simulated ranks, in a schedule's order.

Each stage lives on its own mesh (a 1-rank mesh for plain pipeline parallelism, or
e.g. ``[[0, 1], [2, 3]]`` when every stage is itself data x tensor parallel).  For
every action of the schedule:

* ``F`` (stage s, micro-batch i): receive the activation from stage s-1 (an async
  send/recv across meshes, recorded in the trace), run stage s, keep its output;
  the last stage computes the loss of micro-batch i, scaled by 1/m;
* ``B``: receive the output gradient from stage s+1 and backpropagate through stage
  s; with a split backward (zero bubble), ``B`` computes only the input gradient
  and ``W`` later the weight gradients.  On the modeled clock B + W is one backward
  (Qi et al. 2023, sec. 2): ``B`` prices each GEMM's dgrad and every other op's
  backward, ``W`` only the weight-gradient GEMMs (``ops_table.backward_split``,
  ``sim_mesh.backward_pass``), though autograd walks the graph again for ``W``.  The
  first stage has no input gradient: its ``B`` runs nothing and its ``W`` the whole
  backward (the same kernels, later on that rank).  A gradient sent back is waited
  for when the receiving rank's backward uses it.

Gradients accumulate over the micro-batches, so after :func:`run_pipeline` every
parameter holds the gradient of the mean loss: the same as one device running
the whole batch.  Actions run in the order of the schedule's own simulation
(a valid global order); the modeled clock of each rank advances with the ops
the rank really ran, so the trace shows the schedule's bubbles as they happen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...sim_mesh import cost as _cost
from ...sim_mesh.backward_pass import micro_batch, weight_pass
from ...sim_mesh.trace import current_trace, suspend
from .. import storage
from ..dist_tensor import DistTensor
from ..reshard import reshard
from .actions import Action, Schedule
from .execute_checks import (check_even_microbatches, check_graph_weights, check_meshes,
                             check_sendable, check_weights, input_grad, microbatch_rows,
                             stage_loss)
from .simulate import simulate
from .validate import validate

__all__ = ["run_pipeline", "PipelineRun"]


@dataclass
class PipelineRun:
    """What a pipeline run produced: the loss per micro-batch and the order it ran."""
    losses: list            # per micro-batch loss (floats), unscaled
    order: list             # (rank, Action) in execution order
    outputs: list | None = None     # forward_only: the last stage's output per micro-batch

    @property
    def loss(self) -> float:
        if not self.losses:
            raise ValueError("PipelineRun.loss: this run computed no loss (forward_only "
                             "with loss_fn=None); read .outputs, or pass a loss_fn")
        return sum(self.losses) / len(self.losses)


def _detach_leaf(t):
    if isinstance(t, DistTensor):
        return t.detach().requires_grad_()
    return t.detach().requires_grad_()


def _send(t, dst_mesh, placements, label, ready=None, handles=None):
    """Move DistTensor t onto dst_mesh; record async sends in the trace.  ``ready``:
    {sender rank: when its data was ready} (default: the sender's clock now, right for
    a send issued as soon as its data is made).  The receivers wait for the data now,
    or, given a list ``handles``, when they use it (the caller waits on the handles
    appended to it: a gradient is used by the receiver's next backward action, which
    may come after forwards the receiver runs meanwhile)."""
    tr = current_trace()
    with suspend():
        out = reshard(t, dst_mesh, placements)
    if tr is not None:
        nb = storage.rank_bytes(t._local, t.mesh.ndim)
        for a, b in zip(t.mesh.ranks, dst_mesh.ranks):
            if a == b:
                continue
            dur = _cost.price("send_recv", nb, (a, b), tr.profile)
            at = tr.now(a) if ready is None else ready[a]
            h = tr.record_send(a, b, "send_recv", dur, ready=at, bytes=nb, label=label,
                               args={"src": a, "dst": b})
            if handles is None:
                tr.wait(h)
            else:
                handles.append(h)
    return out


def run_pipeline(schedule: Schedule, stages: Sequence[Callable], meshes: Sequence,
                 inputs: Sequence, loss_fn: Callable | None, *, params: Sequence | None = None,
                 costs: dict | None = None, forward_only: bool = False) -> PipelineRun:
    """Run ``schedule`` over model stages.

    Args:
        stages: ``p * v`` callables, indexed by ``schedule.slot(rank, chunk)``: stage
            ``s`` maps the previous stage's output to its own (stage 0 takes
            ``inputs[i]``); for the "dualpipe" layout, ``stages[s]`` and
            ``stages[p + s]`` are the two copies of stage s (on rank s and on rank
            p - 1 - s): give them separate parameters and add their gradients, as
            DualPipe all-reduces them.
        meshes: the mesh of each rank (``p`` of them; chunk c of rank r runs on
            ``meshes[r]``); an input on another rank's mesh is sent to the rank of
            its first stage.
        inputs: ``m`` micro-batches for stage 0, each a DistTensor on ``meshes[0]``
            (or whatever stage 0 accepts), all of one size: each loss weighs 1/m.
            Every stage but the last returns a DistTensor (it is sent to the next mesh).
        loss_fn: ``loss_fn(output, i)`` -> scalar DistTensor for micro-batch i.
        params: per stage, its parameters (DistTensors or tensors); needed only for
            a split backward (``W`` computes exactly these gradients).
        costs: f/b/w costs for ordering (the schedule's simulation), default 1.
        forward_only: evaluation (Megatron-LM's ``forward_backward_func(...,
            forward_only=True)``, ``torch.distributed.pipelining``'s ``schedule.eval()``):
            only the ``F`` actions run, under ``torch.no_grad()``, nothing is kept for a
            backward and no gradient is touched; ``loss_fn`` may be None, and
            ``PipelineRun.outputs`` holds the last stage's output of each micro-batch.
    """
    # a split backward: the GEMMs note where their gradients go (in every trace), so that
    # B and W are priced with the kernels each runs, B + W one backward
    # (ops_table.backward_split)
    return _run_pipeline(schedule, stages, meshes, inputs, loss_fn, params=params,
                         costs=costs, forward_only=forward_only)


def _run_pipeline(schedule: Schedule, stages: Sequence[Callable], meshes: Sequence,
                  inputs: Sequence, loss_fn: Callable | None, *, params: Sequence | None = None,
                  costs: dict | None = None, forward_only: bool = False) -> PipelineRun:
    """:func:`run_pipeline` under its pricing context."""
    if not isinstance(forward_only, bool):
        raise TypeError(f"run_pipeline(forward_only={forward_only!r}): give True or False")
    if not forward_only and not torch.is_grad_enabled():
        raise RuntimeError("run_pipeline under torch.no_grad(): the schedule's backward "
                           "actions need the forward's graph; for evaluation pass "
                           "forward_only=True (as torch.distributed.pipelining's eval()), or "
                           "run with gradients enabled")
    if loss_fn is None and not forward_only:
        raise ValueError("run_pipeline(loss_fn=None): a training step backpropagates a "
                         "loss; give loss_fn(output, i), or forward_only=True")
    validate(schedule)
    if storage.holds_own(meshes[0]):          # each process runs its own rank's actions
        from .execute_dist import run_pipeline_dist
        if forward_only:
            with torch.no_grad():
                return run_pipeline_dist(schedule, stages, meshes, inputs, loss_fn,
                                         forward_only=True)
        return run_pipeline_dist(schedule, stages, meshes, inputs, loss_fn, params=params)
    p, m, v = schedule.p, schedule.m, schedule.v
    if len(stages) != p * v:
        raise ValueError(f"stages has {len(stages)} callables; schedule {schedule.name} with "
                         f"p={p}, v={v} needs p*v={p * v}")
    if len(meshes) != p:
        raise ValueError(f"meshes has {len(meshes)} entries; give one mesh per rank (p={p})")
    check_meshes(meshes)
    if len(inputs) != m:
        raise ValueError(f"inputs has {len(inputs)} micro-batches; the schedule has m={m}")
    if schedule.split_backward and not forward_only and (params is None or
                                                         len(params) != p * v):
        raise ValueError(f"schedule {schedule.name} splits the backward into B and W: pass "
                         f"params=[parameters of each of the {p * v} stages]")
    if schedule.split_backward and not forward_only:
        check_weights(stages, params)
    costs = dict(costs or {})
    if schedule.split_backward:
        costs.setdefault("w", costs.get("b", 1.0))
    check_even_microbatches(inputs)
    sim = simulate(schedule, **costs)
    order = run_order(schedule, sim)
    if forward_only:
        with torch.no_grad():
            return _forward_only(schedule, stages, meshes, inputs, loss_fn, order)
    stage_in: dict = {}          # (stage, mb) -> input leaf (detached) of that stage
    stage_out: dict = {}         # (stage, mb) -> output of that stage
    grad_in: dict = {}           # (stage, mb) -> gradient arriving for the stage's output
    made: dict = {}              # (stage, mb) -> {rank: when its output was ready}
    arrived: dict = {}           # (stage, mb) -> trace handles of its gradient's sends
    losses = [0.0] * m
    done = []
    last = schedule.stages - 1
    checked: set = set()         # slots whose graph's weights were checked (split backward)
    for _, r, i in order:
        a: Action = schedule.actions[r][i]
        s, slot = schedule.stage(r, a.chunk), schedule.slot(r, a.chunk)
        key = (s, a.mb)
        if a.kind == "F":
            if s == 0:
                x = inputs[a.mb]
                if isinstance(x, DistTensor) and x.mesh != meshes[r]:   # DualPipe's far end
                    x = _detach_leaf(_send(x.detach(), meshes[r], x.placements,
                                           f"input {a.mb} -> rank {r}"))
            else:
                prev = stage_out[(s - 1, a.mb)]
                # the send leaves when stage s-1 made it, not when stage s asks: its rank
                # may have run later actions by now (1F1B's next forward and backward)
                x = _send(prev.detach(), meshes[r], prev.placements,
                          f"F{a.mb} stage {s - 1}->{s}", ready=made.pop((s - 1, a.mb), None))
                x = _detach_leaf(x)
            stage_in[key] = x
            with microbatch_rows(x, a.mb, m):     # keyed dropout: its rows
                out = stages[slot](x)
            if s == last:
                out, losses[a.mb] = last_stage_loss(loss_fn, out, a.mb, m)
            else:
                check_sendable(out, slot)
                tr = current_trace()
                if tr is not None:
                    made[key] = {q: tr.now(q) for q in out.mesh.ranks}
            if schedule.split_backward and slot not in checked:
                check_graph_weights(out, x, params[slot], slot)
                checked.add(slot)
            stage_out[key] = out
        else:
            out = stage_out[key]
            split_b = a.kind == "B" and schedule.split_backward
            if s == last:
                g = None
            else:
                g = grad_in[key] if split_b else grad_in.pop(key)
                _wait_all(arrived.pop(key, ()))     # the gradient's receive, on first use
            x = stage_in[key]
            needs_input_grad = s > 0
            backward_action(a, schedule, out, g, x, s, params, stage_out, key, slot=slot)
            if needs_input_grad and a.kind == "B":
                gx = input_grad(_grad_of(x), s, slot, a.mb)
                dst_mesh = meshes[schedule.placement(s - 1, a.mb)[0]]
                hs = arrived.setdefault((s - 1, a.mb), [])
                gx_moved = _send(gx, dst_mesh, gx.placements, f"B{a.mb} stage {s}->{s - 1}",
                                 handles=hs)
                grad_in[(s - 1, a.mb)] = gx_moved
        done.append((r, a))
    return PipelineRun(losses, done)


def run_order(schedule: Schedule, sim) -> list:
    """[(start, rank, index)]: the actions in the order of their simulated starts (rank
    first at a tie), each after the actions it needs.  Sorting the starts alone is that
    order while every action takes time; with zero costs (``costs=dict(f=0, b=0)``) every
    start is 0 and rank 0's B0 sorted before the last rank's, whose gradient it needs
    (KeyError (0, 0))."""
    p, last = schedule.p, schedule.stages - 1
    rows = schedule.actions
    pos, order = [0] * p, []
    made, grads = set(), set()          # (stage, mb) whose F / B has run
    total = sum(len(row) for row in rows)
    while len(order) < total:
        best = None
        for r in range(p):
            i = pos[r]
            if i == len(rows[r]):
                continue
            a = rows[r][i]
            s = schedule.stage(r, a.chunk)
            ready = (a.kind == "W" or
                     (a.kind == "F" and (s == 0 or (s - 1, a.mb) in made)) or
                     (a.kind == "B" and (s == last or (s + 1, a.mb) in grads)))
            if ready and (best is None or (sim.starts[r][i], r) < best[:2]):
                best = (sim.starts[r][i], r, i, a, s)
        if best is None:                # (validate() refused such a schedule already)
            raise RuntimeError(f"schedule {schedule.name}: no action can run next")
        t, r, i, a, s = best
        (made if a.kind == "F" else grads if a.kind == "B" else set()).add((s, a.mb))
        pos[r] += 1
        order.append((t, r, i))
    return order


def _wait_all(handles) -> None:
    tr = current_trace()
    for h in handles:
        if tr is not None:
            tr.wait(h)


def _forward_only(schedule, stages, meshes, inputs, loss_fn, order) -> PipelineRun:
    """The ``F`` actions of ``order`` alone (module docstring of :func:`run_pipeline`):
    each stage's input freed once it ran, nothing kept for backward."""
    m, last = schedule.m, schedule.stages - 1
    stage_out: dict = {}
    losses, outputs, done = [0.0] * m, [None] * m, []
    for _, r, i in order:
        a: Action = schedule.actions[r][i]
        if a.kind != "F":
            continue
        s, slot = schedule.stage(r, a.chunk), schedule.slot(r, a.chunk)
        if s == 0:
            x = inputs[a.mb]
            if isinstance(x, DistTensor) and x.mesh != meshes[r]:
                x = _send(x, meshes[r], x.placements, f"input {a.mb} -> rank {r}")
        else:
            prev = stage_out.pop((s - 1, a.mb))
            x = _send(prev, meshes[r], prev.placements, f"F{a.mb} stage {s - 1}->{s}")
        with microbatch_rows(x, a.mb, m):
            out = stages[slot](x)
        if s != last:
            check_sendable(out, slot)
        if s == last:
            outputs[a.mb] = out
            if loss_fn is not None:
                losses[a.mb] = float(_value(stage_loss(loss_fn, out, a.mb)))
        else:
            stage_out[(s, a.mb)] = out
        done.append((r, a))
    return PipelineRun(losses if loss_fn is not None else [], done, outputs)


def _value(loss):
    if isinstance(loss, DistTensor):
        return loss.full().detach()
    return loss.detach()


def _grad_of(x):
    if isinstance(x, DistTensor):
        g = x.grad
        x.grad = None
        return g
    g = x.grad
    x.grad = None
    return g


def last_stage_loss(loss_fn, out, mb: int, m: int):
    """The last stage's loss of micro-batch ``mb``: (loss / m to backpropagate, its value).
    A partial loss is reduced first, so every rank seeds the same gradient."""
    loss = stage_loss(loss_fn, out, mb)
    if isinstance(loss, DistTensor) and any(q.is_partial() for q in loss.placements):
        loss = reshard(loss, loss.mesh, loss._grad_placements())
    return loss * (1.0 / m), float(_value(loss))


def backward_action(a, schedule, out, g, x, s, params, stage_out, key, slot=None) -> None:
    """B (the whole backward, or only the input gradient when the schedule splits it)
    or W (the weight gradients) of stage ``s`` for one micro-batch (``slot``: the index
    of its parameters in ``params``, ``s`` when None)."""
    with micro_batch(key):      # (a node shared by micro-batches records in each one)
        _backward_action(a, schedule, out, g, x, s, params, stage_out, key, slot)


def _backward_action(a, schedule, out, g, x, s, params, stage_out, key, slot) -> None:
    if a.kind == "B" and schedule.split_backward:
        if s > 0:
            _backward(out, g, inputs=[x], retain=True)
    elif a.kind == "W":
        _backward(out, g, weights=params[s if slot is None else slot], retain=False)
        stage_out.pop(key, None)
    else:
        _backward(out, g, retain=False)
        stage_out.pop(key, None)


def _leaves(xs) -> list:
    """The tensors autograd sees behind DistTensors (or the tensors themselves)."""
    return [t for x in xs for t in (storage.tensors(x._local) if isinstance(x, DistTensor)
                                    else [x])]


def _backward(out, grad, inputs=None, retain=False, weights=None):
    """Backward from ``out`` with ``grad``; only into ``inputs`` when given (the input
    gradient of a split backward); only into ``weights`` when given (W)."""
    if isinstance(out, DistTensor):
        if grad is not None:
            # the output's local tensors and their gradients, per cell where the shards
            # are uneven (a micro-batch of 5 rows on 2 data-parallel ranks), the gradient
            # laid out as the output (DistTensor.backward's own seeding)
            o, g = out._seed(grad, "backward")
        else:
            o = out._local
            g = torch.ones_like(o) if o.numel() == 1 else None
            o, g = [o], [g]
    else:
        o, g = [out], [torch.ones_like(out) if grad is None else grad]
    if not any(t.requires_grad for t in o):
        # nothing behind this output trains (a first stage whose parameters are all
        # frozen, fed data): one device's backward would not reach it either
        return
    if inputs is not None:
        # (backward, not autograd.grad: the engine then tells the pricing which GEMM
        # gradients it runs, ops_table.backward_split; it accumulates into .grad alike)
        leaves = [t for t in _leaves(inputs) if t.requires_grad]
        if leaves:
            torch.autograd.backward(o, g, retain_graph=True, inputs=leaves)
        return
    if weights is not None:
        # W: the gradients of the stage's trainable parameters (none for a stage without
        # any, a ReLU or a frozen block: its graph is simply freed)
        leaves = [t for t in _leaves(weights) if t.requires_grad]
        if leaves:
            with weight_pass():         # the clock prices only the kernels B left out
                torch.autograd.backward(o, g, retain_graph=retain, inputs=leaves)
        return
    torch.autograd.backward(o, g, retain_graph=retain)
