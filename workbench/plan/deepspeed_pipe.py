"""DeepSpeed's pipeline schedule as its engine runs it: the instruction streams of
``TrainSchedule`` and their timing with blocking point-to-point transfers.

Source: microsoft/DeepSpeed v0.5.4 (bc7778ea5b, 2021-10-06; what is priced here reads
the same in v0.4.0 and v0.5.8 of 2021-11-30, whose engine.py diff adds dtype ids to the
shape exchange and curriculum resets), the engine
Megatron-Turing NLG 530B trained with (Smith et al. 2022, sec. 2.3: DeepSpeed's
pipeline and data parallelism, Megatron's tensor slicing).

``deepspeed/runtime/pipe/schedule.py``, ``TrainSchedule.steps``: a step counter runs
over 2 (m + p - 1) steps; on step k stage s runs a FORWARD when k + s is even, on
micro-batch (k - s) / 2, else a BACKWARD on micro-batch (k + s + 1) / 2 - p (the
``_even_step_forward_id`` ... ``_odd_step_backward_id`` arithmetic); an out-of-range
micro-batch is an idle step.  Before its compute, a forward step receives that
micro-batch's activation from s - 1 (``RecvActivation``) and sends s - 1 the gradient
its previous (backward) step made (``SendGrad``); a backward step sends s + 1 the
activation its previous (forward) step made (``SendActivation``) and receives the
gradient it is about to use (``RecvGrad``).  The last step ends with
``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep`` (``plan.deepspeed_step``).

The transfers block: ``runtime/pipe/p2p.py`` ``send``/``recv`` assert ``async_op ==
False`` and call ``dist.send``/``dist.recv`` (torch >= 1.8; ``dist.broadcast`` in a
two-rank group before), whose ``wait()`` makes the compute stream wait for the NCCL
transfer, and NCCL's transfer needs the peer's matching call: a rendezvous.  So a stage
cannot start step k's compute before its partner of step k has finished step k - 1.
The step parity does NOT make the pipeline lock-step: stages start their steps at
different times, and :func:`simulate`, which runs the instruction streams with that
rendezvous rule instead of assuming a period, finds the steady state of 1F1B (one
forward and one backward per micro-batch, no wait beyond the transfers; equal stages
end at (m + p - 1)(f + b) plus the transfers, as Megatron-LM's 1F1B does).  What the
engine adds is per transfer: every activation or gradient is a blocking rendezvous of
its own (a middle stage waits on four per micro-batch, where Megatron-LM's 2021
``megatron/p2p_communication.py`` ``_communicate`` batches a send with a receive,
``batch_isend_irecv``, into one wait), priced in ``plan.deepspeed_step``.  The tests hold
:func:`simulate` to hand-computed timelines.
"""
from __future__ import annotations

__all__ = ["train_schedule", "programs", "simulate", "SOURCE"]

SOURCE = "microsoft/DeepSpeed v0.5.4 (bc7778ea5b, 2021-10-06)"


def _check(stages, micro_batches, stage_id=0):
    for name, v, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"train_schedule: {name}={v!r} must be an int >= {low}")
    if isinstance(stage_id, bool) or not isinstance(stage_id, int) \
            or not 0 <= stage_id < stages:
        raise ValueError(f"train_schedule: stage_id={stage_id!r} must be an int in "
                         f"[0, {stages})")


def _micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of ``step`` on ``stage`` (module docstring)."""
    if (step + stage) % 2 == 0:
        return (step - stage) // 2, True
    return (step + stage + 1) // 2 - stages, False


def train_schedule(stages: int, micro_batches: int, stage_id: int) -> list[list[tuple]]:
    """The instructions of ``TrainSchedule`` for one stage, step by step: each a list of
    (name, micro-batch) with names ``recv_act``, ``send_grad``, ``forward``,
    ``send_act``, ``recv_grad``, ``backward``, and on the last step
    ``reduce_tied_grads``, ``reduce_grads``, ``optimizer_step`` (micro-batch None)."""
    _check(stages, micro_batches, stage_id)
    p, m, s = stages, micro_batches, stage_id
    valid = range(m).__contains__
    total = 2 * (m + p - 1)
    out, prev = [], -1
    for k in range(total):
        mb, fwd = _micro_batch(k, s, p)
        cmds = []
        if fwd and s > 0:
            if valid(mb):
                cmds.append(("recv_act", mb))
            if valid(prev):
                cmds.append(("send_grad", prev))
        if not fwd and s < p - 1:
            if valid(prev):
                cmds.append(("send_act", prev))
            if valid(mb):
                cmds.append(("recv_grad", mb))
        if valid(mb):
            cmds.append(("forward" if fwd else "backward", mb))
        if k == total - 1:
            cmds += [("reduce_tied_grads", None), ("reduce_grads", None),
                     ("optimizer_step", None)]
        out.append(cmds)
        prev = mb
    return out


_PEER = {"recv_act": -1, "send_grad": -1, "send_act": 1, "recv_grad": 1}
_TAG = {"recv_act": "act", "send_act": "act", "send_grad": "grad", "recv_grad": "grad"}


def _links(crossing, p: int) -> list:
    """``crossing`` as seconds per boundary k -> k + 1 (one number: every boundary's)."""
    if isinstance(crossing, (list, tuple)):
        if len(crossing) != p - 1:
            raise ValueError(f"crossing: {len(crossing)} seconds for {p} stages; give one "
                             f"per boundary ({p - 1}) or one number for all")
        return list(crossing)
    return [crossing] * (p - 1)


def programs(forward, backward, micro_batches: int, crossing) -> list[list[tuple]]:
    """Each stage's timed stream up to its last backward: (peer or None, seconds, tag);
    ``forward[s]``, ``backward[s]``: stage s's compute per micro-batch; ``crossing``:
    the seconds one activation or gradient takes between two stages, one number for
    every boundary or one per boundary k -> k + 1 (each on its own link)."""
    p = len(forward)
    if len(backward) != p or p < 1:
        raise ValueError(f"programs: forward ({len(forward)}) and backward "
                         f"({len(backward)}) must give one time per stage")
    links = _links(crossing, p)
    out = []
    for s in range(p):
        ops = []
        for step in train_schedule(p, micro_batches, s):
            for name, mb in step:
                if name in _PEER:
                    peer = s + _PEER[name]
                    ops.append((peer, links[min(s, peer)], (_TAG[name], mb)))
                elif name in ("forward", "backward"):
                    ops.append((None, (forward if name == "forward" else backward)[s],
                                (name, mb)))
        out.append(ops)
    return out


def simulate(forward, backward, micro_batches: int, crossing) -> list[float]:
    """The time each stage ends its last backward, all starting at 0: compute runs in
    order, and a transfer completes at max(both sides ready) + ``crossing`` (one number,
    or one per boundary k -> k + 1) when the two stages' next instructions are its two
    ends (module docstring).  Raises if the streams deadlock or pair a send with the
    wrong receive (DeepSpeed's would hang)."""
    for name, xs in (("forward", forward), ("backward", backward)):
        if any(not isinstance(x, (int, float)) or x < 0 for x in xs):
            raise ValueError(f"simulate: {name}={list(xs)!r} must be seconds >= 0")
    xs = crossing if isinstance(crossing, (list, tuple)) else [crossing]
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 for x in xs):
        raise ValueError(f"simulate: crossing={crossing!r} must be seconds >= 0 (one "
                         f"number, or one per stage boundary)")
    progs = programs(forward, backward, micro_batches, crossing)
    p = len(progs)
    at, t = [0] * p, [0.0] * p
    while True:
        moved = False
        for s in range(p):
            ops = progs[s]
            while at[s] < len(ops):
                peer, dt, tag = ops[at[s]]
                if peer is None:
                    t[s] += dt
                    at[s] += 1
                    moved = True
                    continue
                other = progs[peer][at[peer]] if at[peer] < len(progs[peer]) else None
                if other is None or other[0] != s:
                    break                       # the peer is not there yet
                if other[2] != tag:
                    raise RuntimeError(f"simulate: stage {s} waits for {tag} while stage "
                                       f"{peer} offers {other[2]}: mismatched streams")
                t[s] = t[peer] = max(t[s], t[peer]) + dt
                at[s] += 1
                at[peer] += 1
                moved = True
        if all(at[s] == len(progs[s]) for s in range(p)):
            return t
        if not moved:
            raise RuntimeError(f"simulate: deadlock at instructions {at}")
