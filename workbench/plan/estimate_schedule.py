"""An estimate's pipeline schedule: the bubble of the formula
(:func:`pipeline_bubble`), the schedule simulated from each rank's row (:func:`_simulate`,
:func:`_makespan`) and this library's recipe's layer-stages as the dry run composes them
(:func:`_recipe_chunks`)."""
from __future__ import annotations

from . import in_flight_peak as _peak
from .layout import Layout
from .estimate_ranks import _rows


def pipeline_bubble(stage_times, v: int = 1) -> float:
    """Idle time of a 1F1B / GPipe pipeline (interleaved: ``v`` chunks per device) whose
    stage s takes ``stage_times[s]`` per micro-batch (forward + backward):
    (sum - max) / v (Zheng et al. 2022, Alpa's pipeline latency; equal stages give the published
    (p - 1)(t_f + t_b) / v).  The step is m max(stage_times) + this."""
    times = list(stage_times)
    return (sum(times) - max(times)) / v


def _simulate(lay: Layout, stages: dict, m: int, links, rows=None):
    """``parallel.schedules.simulate`` of ``lay``'s schedule over ``m`` micro-batches,
    each pipeline rank's forward and backward taken from ``stages`` (estimate's
    ``details["stages"]``) with its own crossings on ``links`` (``details["p2p_links"]``),
    or from ``rows`` (``details["per_rank"]``: each rank's own, DeepSpeed's engine's as it
    prices them); this library's recipe (:func:`_recipe_chunks`): per layer-stage, as the
    dry run composes it."""
    from ..parallel.schedules import simulate
    rows = _rows(lay, stages, links) if rows is None else rows
    sched = _schedule(lay.schedule, lay.pp, m, lay.v)
    if lay.engine == "workbench" and lay.pp > 1:
        f, b = _recipe_chunks(lay, rows, links)
        return simulate(sched, f=f, b=b)
    return simulate(sched, f=[d["forward"] / lay.v for d in rows],
                    b=[(d["time"] - d["forward"]) / lay.v for d in rows])


# the (frozen) parallel.schedules Schedule of a shape, built once (in_flight_peak.schedule,
# which the memory's walk of an interleaved rank reads too)
_schedule = _peak.schedule


def _makespan(lay: Layout, stages: dict, m: int, links) -> float:
    """``_simulate(...).makespan``, from the schedules' event-driven core alone (the
    timeline ``simulate`` also builds is not read here; a search prices many layouts)."""
    from ..parallel.schedules._engine import run
    rows = _rows(lay, stages, links)
    sched = _schedule(lay.schedule, lay.pp, m, lay.v)
    if lay.engine == "workbench" and lay.pp > 1:
        f, b = _recipe_chunks(lay, rows, links)
    else:
        f = [d["forward"] / lay.v for d in rows]
        b = [(d["time"] - d["forward"]) / lay.v for d in rows]
        f, b = [f[s % lay.pp] for s in range(sched.stages)], [b[s % lay.pp]
                                                             for s in range(sched.stages)]
    stage = [[sched.stage(r, c) for c in range(sched.v)] for r in range(sched.p)]
    cost = {"F": f, "B": b}
    durations = [[cost[a.kind][stage[r][a.chunk]] for a in row]
                 for r, row in enumerate(sched.actions)]
    out = run(sched, durations, 0.0)
    if out.blocked:          # a library schedule never deadlocks: a bug, say so
        raise RuntimeError(f"estimate: the {lay.schedule} schedule of pp={lay.pp}, m={m}, "
                           f"v={lay.v} deadlocked in parallel.schedules' engine")
    return max(row[-1] for row in out.ends if row)


def _recipe_chunks(lay: Layout, rows: list, links) -> tuple[list, list]:
    """(forward, backward) seconds of each of the pp x v layer-stages of this library's
    recipe as ``plan.dryrun`` composes its pipeline: layer-stage k's forward with the send
    of its output (none from the last), its backward with the send of its input's
    gradient (none from the first), each send priced once, on the sender, on its own link
    (``links[r]``: a crossing of pipeline rank r -> r + 1; layer-stage k sits on rank
    k mod pp); the embedding on the first layer-stage and the head and loss on the last,
    not spread over a rank's v chunks.  ``rows``: per pipeline rank, its stage dict
    (``edge``: the (forward, total) seconds of the embedding or the head it holds;
    ``crossings``: the (forward, backward) seconds of sends inside it, taken out here)."""
    pp, v = lay.pp, lay.v
    n = pp * v
    f, b = [0.0] * n, [0.0] * n
    for r, d in enumerate(rows):
        ef, et = d["edge"]
        sf, sb = d["crossings"]
        cf = (d["forward"] - ef - sf) / v
        cb = (d["time"] - d["forward"] - (et - ef) - sb) / v
        for c in range(v):
            k = c * pp + r                 # parallel.schedules' layer-stage of chunk c
            edge = (r == 0 and c == 0) or (r == pp - 1 and c == v - 1)
            f[k] = max(0.0, cf + (ef if edge else 0.0) + (links[r] if k < n - 1 else 0.0))
            b[k] = max(0.0, cb + (et - ef if edge else 0.0)
                       + (links[(r - 1) % pp] if k > 0 else 0.0))
    return f, b
