"""Run a schedule on the modeled clock: makespan, bubbles, memory, a timeline.

Timing.  Each rank runs its row in order; an action starts when the rank is free
and its input has arrived (F on stage s after F on stage s - 1, B on stage s
after B on stage s + 1, ``p2p`` seconds later when the stages are on different
ranks).  Costs are per action (one chunk of one micro-batch), and each of ``f``,
``b``, ``w`` may be

* a number: every stage alike;
* a list of p numbers (one per rank) or p * v numbers (one per layer-stage);
* a callable ``cost(action) -> seconds`` or ``cost(action, rank) -> seconds``,
  e.g. from the cost model.

Backward.  With ``w=None`` a backward is one action costing ``b``.  With ``w``
given, the backward is B (input gradient, cost ``b``) and W (weight gradient,
cost ``w``).  A schedule with ``split_backward=True`` places its W's itself (and
needs ``w``).  For one that does not split (GPipe, 1F1B), each B runs as B then
W at once, and its gradient leaves the rank only when both are done, as with
one autograd call; so 1F1B's bubble is (p - 1)(t_F + t_B + t_W) (Qi et al. 2024).

Memory ("micro-batch activations in flight").  On each rank, +1 when an F starts
(it allocates the activations of one micro-batch on one chunk) and -1 when the
action that frees them ends: the backward for a schedule without split; W for a
split one, because W still reads the saved layer inputs to form the weight
gradient.  (Qi et al. count the residue W needs as M_W < M_B, so later ranks of
ZB-H1 are counted high; rank 0, where the peak p sits, is exact: ZB-H1 and 1F1B
both peak at p.)  For interleaved schedules one unit is one chunk's activations,
1/v of a rank's layers.  ``memory[r] = (times, counts)`` is a step function, the
count from ``times[j]`` on once every change at that instant is made (a backward
that ends as the next forward starts makes no dip); ``peak_inflight[r]`` is its
maximum (counted in run order, so even zero-cost actions are seen).

Bubble fraction: idle rank-time over p x makespan, idle time including waits
for messages.
"""
from __future__ import annotations

import inspect
import math
import numbers
import sys
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ...sim_mesh.trace import Event
from ._engine import run
from .actions import KINDS, Schedule
from .validate import ScheduleError, check_structure, deadlock_message

__all__ = ["Blocks", "SimulationResult", "simulate"]


@dataclass(frozen=True)
class Blocks:
    """The drawn compute blocks as columns (numpy arrays), sorted by rank, then start.

    One row per block: an action, except that a non-split backward simulated
    with ``w`` gives two rows, B then W."""
    rank: np.ndarray        # int
    start: np.ndarray       # seconds
    duration: np.ndarray    # seconds
    kind: np.ndarray        # index into KINDS: 0 F, 1 B, 2 W
    mb: np.ndarray          # micro-batch
    chunk: np.ndarray       # model chunk on the rank

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured; plain data, drawn by :mod:`workbench.viz.pipeline`."""
    schedule: Schedule
    makespan: float                       # end of the last action, seconds
    bubble_fraction: float                # idle rank-time / (p * makespan)
    busy: tuple[float, ...]               # compute time per rank
    peak_inflight: tuple[int, ...]        # most activations held at once, per rank
    memory: tuple = field(repr=False)     # per rank (times, counts): counts[j] from times[j] on
    starts: tuple = field(repr=False)     # starts[r][i]: start of schedule.actions[r][i]
    ends: tuple = field(repr=False)       # ends[r][i]: its end (after W, for a fused B+W)
    blocks: Blocks = field(repr=False)    # the same, as drawable columns
    costs: dict = field(default_factory=dict)            # f, b, w, p2p as given

    @property
    def bubble_time(self) -> tuple[float, ...]:
        """Idle time per rank: makespan - busy."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def span_bubble(self) -> tuple[float, ...]:
        """Idle time per rank between its first action's start and its last action's end:
        the bubble the zero-bubble papers count (their schedulers add a rank's idle time
        only once it has started; the start-up skew is absorbed across iterations)."""
        return tuple((max(en) - min(st) - b) if st else 0.0
                     for st, en, b in zip(self.starts, self.ends, self.busy))

    @property
    def span_bubble_fraction(self) -> float:
        """The largest span bubble over that rank's span: bubble / (bubble + busy)."""
        sb = self.span_bubble
        r = max(range(len(sb)), key=lambda i: sb[i])
        total = sb[r] + self.busy[r]
        return sb[r] / total if total > 0 else 0.0

    @cached_property
    def timeline(self) -> list[Event]:
        """Every block as a trace :class:`~workbench.sim_mesh.trace.Event` (stream "compute"),
        then the send/recv messages (stream "comm", when p2p > 0).  Built on first use."""
        bl, s = self.blocks, self.schedule
        events = [Event(KINDS[k], "compute", t, d, (r,),
                        label=f"{KINDS[k]}{mb}" + (f"c{c}" if c else ""),
                        args={"mb": mb, "chunk": c, "stage": s.stage(r, c)})
                  for r, t, d, k, mb, c in zip(bl.rank.tolist(), bl.start.tolist(),
                                               bl.duration.tolist(), bl.kind.tolist(),
                                               bl.mb.tolist(), bl.chunk.tolist())]
        p2p = float(self.costs.get("p2p") or 0.0)
        if p2p > 0:
            events.extend(_comm_events(s, self.ends, p2p))
        return events

    def bubbles(self) -> list[list[tuple[float, float]]]:
        """Per rank, the idle intervals (start, end) within [0, makespan]."""
        out = []
        for st, en in zip(self.starts, self.ends):
            lo = np.concatenate([[0.0], np.asarray(en, float)])
            hi = np.concatenate([np.asarray(st, float), [self.makespan]])
            gap = hi > lo
            out.append(list(zip(lo[gap].tolist(), hi[gap].tolist())))
        return out

    def summary(self) -> str:
        s = self.schedule
        return (f"{s.name} p={s.p} m={s.m} v={s.v}: makespan {self.makespan:g}, "
                f"bubble {self.bubble_fraction:.2%}, peak in flight {max(self.peak_inflight)} "
                f"(rank 0: {self.peak_inflight[0]})")


def simulate(schedule: Schedule, f=1.0, b=1.0, w=None, p2p: float = 0.0) -> SimulationResult:
    """Time ``schedule`` with per-action costs ``f``, ``b``, ``w`` and message latency ``p2p``.

    Raises :class:`~.validate.ScheduleError` for a schedule that cannot run (see
    :func:`~.validate.validate`).  Send/recv events (stream "comm") are recorded
    when ``p2p > 0``; :func:`~.actions.transfers` lists them regardless."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate(schedule={type(schedule).__name__}): pass a Schedule")
    if schedule.split_backward and w is None:
        raise ValueError(f"simulate(w=None) but schedule {schedule.name!r} splits the backward "
                         f"into B and W: pass w=, the weight-gradient cost (e.g. w=b)")
    if isinstance(p2p, bool) or not isinstance(p2p, numbers.Real) or not 0 <= p2p < math.inf:
        raise ValueError(f"simulate(p2p={p2p!r}): the message latency must be a finite "
                         "number of seconds >= 0 (e.g. p2p=0.0 for free messages)")
    check_structure(schedule)
    cost = {"F": _cost("f", f, schedule), "B": _cost("b", b, schedule)}
    fused_w = w is not None and not schedule.split_backward   # B then W in one backward
    if w is not None:
        cost["W"] = _cost("w", w, schedule)
    durations, w_parts = [], []
    for r, row in enumerate(schedule.actions):
        d = [cost[a.kind](a, r) for a in row]
        if fused_w:
            wp = [cost["W"](a, r) if a.kind == "B" else 0.0 for a in row]
            d = [x + y for x, y in zip(d, wp)]
            w_parts.append(wp)
        durations.append(d)
    _check_total(schedule, durations, float(p2p), dict(f=f, b=b, w=w, p2p=p2p))
    out = run(schedule, durations, float(p2p))
    if out.blocked:
        raise ScheduleError(deadlock_message(schedule, out.pos, out.blocked))
    return _result(schedule, out, durations, w_parts, dict(f=f, b=b, w=w, p2p=p2p))


def _result(s: Schedule, out, durations, w_parts, costs) -> SimulationResult:
    p, split = s.p, s.split_backward
    code = {k: i for i, k in enumerate(KINDS)}
    n_row = [len(row) for row in s.actions]
    rank = np.repeat(np.arange(p), n_row)
    start = np.fromiter((t for row in out.starts for t in row), float, len(rank))
    end = np.fromiter((t for row in out.ends for t in row), float, len(rank))
    kind = np.fromiter((code[a.kind] for row in s.actions for a in row), np.int8, len(rank))
    mb = np.fromiter((a.mb for row in s.actions for a in row), np.int64, len(rank))
    chunk = np.fromiter((a.chunk for row in s.actions for a in row), np.int64, len(rank))
    dur = end - start
    # memory: +1 when an F starts, -1 when the action that frees its activations ends
    frees = kind == (code["W"] if split else code["B"])
    delta = np.where(kind == 0, 1, np.where(frees, -1, 0))
    when = np.where(kind == 0, start, end)
    memory, peaks, offsets = [], [], np.concatenate([[0], np.cumsum(n_row)])
    for r in range(p):
        lo, hi = offsets[r], offsets[r + 1]
        keep = delta[lo:hi] != 0
        counts = np.concatenate([[0], np.cumsum(delta[lo:hi][keep])])     # in run order
        times = np.concatenate([[0.0], when[lo:hi][keep]])
        peaks.append(int(counts.max()))
        last = np.append(times[1:] != times[:-1], True)   # the count once an instant settles
        times, counts = times[last], counts[last]
        moved = np.insert(counts[1:] != counts[:-1], 0, True)   # drop steps that change nothing
        memory.append((times[moved], counts[moved]))
    if w_parts:                           # a non-split backward with w: draw B, then W
        wdur = np.fromiter((x for row in w_parts for x in row), float, len(rank))
        isb = kind == code["B"]
        dur = np.where(isb, dur - wdur, dur)
        rank, start, dur, kind, mb, chunk = (
            np.concatenate([x, y[isb]]) for x, y in
            ((rank, rank), (start, start), (dur, wdur), (kind, np.full_like(kind, code["W"])),
             (mb, mb), (chunk, chunk)))
        start[len(isb):] += dur[:len(isb)][isb]
        order = np.lexsort((start, rank))
        rank, start, dur, kind, mb, chunk = (x[order] for x in (rank, start, dur, kind, mb, chunk))
    makespan = float(end.max()) if len(end) else 0.0
    busy = tuple(float(sum(d)) for d in durations)
    idle = p * makespan - sum(busy)
    return SimulationResult(
        schedule=s, makespan=makespan,
        bubble_fraction=idle / (p * makespan) if makespan > 0 else 0.0,
        busy=busy, peak_inflight=tuple(peaks), memory=tuple(memory),
        starts=tuple(map(tuple, out.starts)), ends=tuple(map(tuple, out.ends)),
        blocks=Blocks(rank, start, dur, kind, mb, chunk), costs=costs)


def _comm_events(s: Schedule, ends, p2p: float) -> list[Event]:
    """One send/recv per stage boundary crossed: activations forward, gradients back."""
    last, events = s.stages - 1, []
    for r, row in enumerate(s.actions):
        for i, a in enumerate(row):
            stage = s.stage(r, a.chunk)
            if a.kind == "F" and stage < last:
                dst, what = s.placement(stage + 1, a.mb)[0], "activation"
            elif a.kind == "B" and stage > 0:
                dst, what = s.placement(stage - 1, a.mb)[0], "gradient"
            else:
                continue
            if dst != r:
                events.append(Event("send_recv", "comm", ends[r][i], p2p, (r, dst),
                                    label=f"{what} of {a} {r}->{dst}",
                                    args={"mb": a.mb, "chunk": a.chunk, "kind": what}))
    return events


def _check_total(s: Schedule, durations, p2p: float, costs: dict) -> None:
    """Refuse finite costs whose step overflows a float: the makespan is at most every
    action's cost plus one message per action, and the bubble fraction divides by p
    times that; past ``sys.float_info.max`` they would come out inf and NaN."""
    bound = s.p * (sum(sum(row) for row in durations) + p2p * len(s))    # inf past the max
    if not math.isfinite(bound):
        given = ", ".join(f"{k}={_short(v)}" for k, v in costs.items() if v is not None)
        raise ValueError(f"simulate({given}): the step's {len(s)} actions on p={s.p} ranks add "
                         f"up to more than the largest float ({sys.float_info.max:.3g} s), so "
                         "the makespan and bubble fraction would be inf and NaN; give the costs "
                         "in a larger unit, or relative costs (e.g. f=1, b=2)")


def _short(x) -> str:
    if callable(x):
        return "<callable>"
    if isinstance(x, numbers.Real):
        return repr(x)
    return f"<{type(x).__name__} of {len(x)}>" if hasattr(x, "__len__") else repr(x)


def _bad_cost(x) -> bool:
    """True unless ``x`` is a finite real number >= 0 (NaN, inf, negatives and
    non-numbers would make a NaN or too-short makespan)."""
    return (isinstance(x, bool) or not isinstance(x, numbers.Real) or
            not 0 <= float(x) < math.inf)


def _checked(arg: str, fn):
    """Wrap a cost callable so that every value it returns is checked."""
    def cost(a, r):
        x = fn(a, r)
        if _bad_cost(x):
            raise ValueError(
                f"simulate({arg}=<callable>): the cost of action {a} on rank {r} is {x!r}; a "
                "cost must be a finite number of seconds >= 0: fix the cost function (e.g. "
                "return 0.0 for an action that costs nothing)")
        return float(x)
    return cost


def _cost(arg: str, value, s: Schedule):
    """Normalise a cost to ``fn(action, rank) -> seconds`` (every value checked)."""
    if callable(value):
        try:
            one_arg = len(inspect.signature(value).parameters) == 1
        except (TypeError, ValueError):              # a builtin without a signature
            one_arg = False
        return _checked(arg, (lambda a, r: value(a)) if one_arg else value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if _bad_cost(value):
            raise ValueError(f"simulate({arg}={value!r}): a cost must be a finite number of "
                             f"seconds >= 0, e.g. {arg}=1.0")
        v = float(value)
        return lambda a, r: v
    try:
        if isinstance(value, (str, bytes)):      # "1" is not a list of costs
            raise TypeError
        vals = [float(x) for x in value]
    except (TypeError, ValueError):
        raise ValueError(f"simulate({arg}={value!r}): give a number, a list of p={s.p} numbers "
                         f"(one per rank) or p*v={s.stages} (one per layer-stage), or a "
                         f"callable cost(action, rank)") from None
    bad = [i for i, x in enumerate(vals) if _bad_cost(x)]
    if bad:
        raise ValueError(f"simulate({arg}={value!r}): entry {bad[0]} is {vals[bad[0]]!r}; every "
                         "cost must be a finite number of seconds >= 0")
    if len(vals) == s.stages and s.layout == "dualpipe":
        # p entries are ambiguous here (p ranks, p stages): read per stage, as for 1F1B,
        # so both copies of a stage cost the same (a callable gives per-rank costs)
        return lambda a, r: vals[s.stage(r, a.chunk)]
    if len(vals) == s.p:
        return lambda a, r: vals[r]
    if len(vals) == s.stages:
        return lambda a, r: vals[s.stage(r, a.chunk)]
    raise ValueError(f"simulate({arg}=<list of {len(vals)}>): a per-stage cost list needs "
                     f"p={s.p} entries (one per rank) or p*v={s.stages} (one per layer-stage)")
