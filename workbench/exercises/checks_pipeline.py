"""Checks for the exercises of notebook 07 (pipeline parallelism): a schedule by hand, how
many micro-batches a pipeline needs, and the zero-bubble saving.

The best hand schedule is found by an exhaustive search priced with this module's own
list scheduler (:func:`_makespan`); the micro-batch counts and the zero-bubble idle time
come from the published formulas.  The student's schedule is read with the library's
``validate`` and ``simulate``, as the notebook does."""
from __future__ import annotations

import itertools
import math

from ..parallel.schedules import (Schedule, ScheduleError, interleaved_1f1b, one_f_one_b,
                                  simulate, validate)
from .checks import _number, _ok, _whole
from .feedback import CheckError, exercise

__all__ = ["check_hand_schedule", "check_min_microbatches", "check_zb_bubble"]


# ---- 07 pipelines: a schedule by hand -----------------------------------------------------------

def _makespan(rows) -> float:
    """Makespan of a schedule (rows of "F<i>"/"B<i>" per rank, f = b = 1, no p2p cost), by
    list scheduling: F<i> on rank r waits for F<i> on rank r-1, B<i> for B<i> on rank
    r+1; each rank runs its row in order.  inf when the rows deadlock."""
    p = len(rows)
    done, clock, nxt = {}, [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(rows[r]):
                act = rows[r][nxt[r]]
                dep = (act[0], int(act[1:]), r - 1 if act[0] == "F" else r + 1)
                if 0 <= dep[2] < p and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                clock[r] = done[(act[0], int(act[1:]), r)] = start + 1.0
                nxt[r] += 1
                progress = True
    return max(clock) if all(n == len(row) for n, row in zip(nxt, rows)) else math.inf


def _best_makespan(p: int, m: int, memory_limit: int) -> float:
    """The shortest makespan (f = b = 1) of any schedule whose rows run F's and B's in
    micro-batch order, within ``memory_limit`` activations per rank (exhaustive)."""
    def rows():
        out = []
        for fb in itertools.combinations(range(2 * m), m):     # positions of the F's
            row, nf, nb, held, ok = [], 0, 0, 0, True
            for i in range(2 * m):
                if i in fb:
                    row.append(f"F{nf}"); nf += 1; held += 1
                else:
                    if nb >= nf:
                        ok = False; break
                    row.append(f"B{nb}"); nb += 1; held -= 1
                if held > memory_limit:
                    ok = False; break
            if ok:
                out.append(row)
        return out
    return min(_makespan(list(combo)) for combo in itertools.product(rows(), repeat=p))


@exercise
def check_hand_schedule(schedule, p: int = 3, m: int = 3, memory_limit: int = 2) -> None:
    """A hand-written schedule for p ranks and m micro-batches that runs, holds at most
    ``memory_limit`` micro-batch activations on every rank, and is as fast as possible.

    A schedule that runs but holds too much or is slow gets its timeline (f = b = 1) in
    the message, to show where it idles or piles up."""
    from ..viz.pipeline import render_text
    if not isinstance(schedule, Schedule):
        raise CheckError(f"give a Schedule, got {type(schedule).__name__}: build it with "
                         "wb.schedules.Schedule.from_text(['F0 F1 ...', ...]), one row per rank")
    if schedule.p != p:
        raise CheckError(f"your schedule has {schedule.p} rows; the exercise has p={p} ranks: "
                         "one row of actions per rank")
    if schedule.m != m:
        raise CheckError(f"your schedule runs m={schedule.m} micro-batches; the exercise has "
                         f"m={m}: every rank runs F0..F{m - 1} and B0..B{m - 1}")
    try:
        validate(schedule)
    except ScheduleError as e:
        raise CheckError(f"your schedule cannot run: {e}") from None
    if schedule.split_backward:
        # timed with w = 1 on top of b = 1 it read "a faster one exists" for the best order
        raise CheckError("your schedule splits each backward into B and W (section 4); this "
                         "exercise has one backward per micro-batch, B, as long as a forward "
                         "(f = b = 1): write F's and B's only")
    w = None
    got = simulate(schedule, w=w)
    timeline = "\n" + render_text(got).split("\n", 1)[1] + "\n"   # the rows and the bubble
    try:
        validate(schedule, memory_limit=memory_limit)
    except ScheduleError as e:
        raise CheckError(f"your schedule runs, but holds too much:{timeline}{e}") from None
    best = _best_makespan(p, m, memory_limit)
    ref = simulate(one_f_one_b(p, m))
    if got.makespan > best + 1e-9:
        raise CheckError(f"your schedule runs and fits in memory, but takes {got.makespan:g} "
                         f"time units (bubble {got.bubble_fraction:.0%}):{timeline}a faster one "
                         f"exists within {memory_limit} activations: start each backward as "
                         "soon as its gradient can arrive, and let later ranks run ahead",
                         expected=f"{best:g} time units")
    _ok(f"{got.makespan:g} time units, bubble {got.bubble_fraction:.2%}, at most "
        f"{max(got.peak_inflight)} activations per rank (1F1B: {ref.makespan:g} units, "
        f"bubble {ref.bubble_fraction:.2%}, {max(ref.peak_inflight)} on rank 0)")


# ---- 07 pipelines: how many micro-batches --------------------------------------------------------

def _int(name, value) -> int:
    """``value`` as an int: a Python, NumPy or torch integer (np.argmax over a table of
    bubbles gives np.int64) or a float with no fraction (64.0, what ``math.ceil`` of a
    NumPy float or a division gives, is 64, as 06's and 11's checks of a count take it);
    not a bool, not 64.5."""
    got = _whole(value)
    if got is None:
        raise CheckError(f"{name} should be a whole number of micro-batches (an int), "
                         f"got {value!r}")
    return got


@exercise
def check_min_microbatches(m_1f1b, m_interleaved, p: int = 8, v: int = 2,
                           target: float = 0.10) -> None:
    """The fewest micro-batches for which 1F1B (and interleaved 1F1B with v chunks, m a
    multiple of p) keep the bubble below ``target`` of the step, p stages."""
    a, b = _int("m_1f1b", m_1f1b), _int("m_interleaved", m_interleaved)
    want_a = next(m for m in range(1, 10_000) if (p - 1) / (m + p - 1) < target)
    want_b = next(m for m in range(p, 10_000, p) if (p - 1) / (v * m + p - 1) < target)
    # the answers over the ideal time instead of the step: (p-1)/m and (1/v)(p-1)/m
    ideal_a = next(m for m in range(1, 10_000) if (p - 1) / m < target)
    ideal_b = next(m for m in range(p, 10_000, p) if (p - 1) / (v * m) < target)
    for got, want, ideal, name, build, formula, over_ideal in (
            (a, want_a, ideal_a, "1F1B", lambda m: one_f_one_b(p, m), "(p-1)/(m+p-1)",
             "(p-1)/m"),
            (b, want_b, ideal_b, f"interleaved 1F1B (v={v})",
             lambda m: interleaved_1f1b(p, m, v), "(p-1)/(v m+p-1)", "(p-1)/(v m)")):
        if got == want:
            continue
        if got < 1:
            raise CheckError(f"{name}: m={got}: a step has at least one micro-batch")
        if name != "1F1B" and got % p:
            raise CheckError(f"{name}: m={got} is not a multiple of p={p}; interleaved 1F1B "
                             "needs one (Megatron-LM's rule, and the generator's)")
        frac = simulate(build(got)).bubble_fraction
        if frac < target and name != "1F1B" and got == next(
                k for k in range(p, 10_000, p) if (p - 1) / (k + p - 1) < target):
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but that m is "
                    f"the one plain 1F1B needs: with v={v} chunks the pipeline fills and drains "
                    f"v times faster, so the share of the step is {formula}")
        elif frac < target and got == ideal:
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but a smaller m "
                    f"also is: did you use {over_ideal}, the bubble over the ideal time? The "
                    f"share of the step is {formula}")
        elif frac < target:
            hint = (f"with m={got} the bubble is {frac:.2%}, below {target:.0%}, but a smaller m "
                    f"also is: find the first m at which {formula} drops below {target:.0%}"
                    + (" (m a multiple of p)" if name != "1F1B" else ""))
        elif math.isclose(frac, target):
            hint = f"with m={got} the bubble is exactly {target:.0%}; below means less than"
        else:
            hint = f"with m={got} the simulator measures {frac:.2%}, not below {target:.0%}"
        raise CheckError(f"{name}: your m is {got}: {hint}", expected=f"{name} m={want}")
    _ok(f"1F1B needs m={want_a} ({(p - 1) / (want_a + p - 1):.2%}); interleaved with v={v} "
        f"m={want_b} ({(p - 1) / (v * want_b + p - 1):.2%}): {want_a / want_b:.1f}x fewer "
        f"micro-batches per step, each crossing pv-1 = {p * v - 1} stage boundaries each way "
        f"instead of p-1 = {p - 1}")


# ---- 07 pipelines: the zero-bubble saving --------------------------------------------------------

@exercise
def check_zb_bubble(bubble, p: int = 4, m: int = 8, f: float = 2.0, b: float = 2.0,
                    w: float = 1.0) -> None:
    """ZB-H1's idle time per rank with per-micro-batch costs f (forward), b (input
    gradient), w (weight gradient): (p-1)(f + b - w), as the simulator measures it."""
    from ..parallel.schedules import zb_h1
    if isinstance(bubble, (tuple, list)) and len(bubble) == p:
        raise CheckError(f"bubble should be one number; {tuple(bubble)!r} holds one idle time "
                         "per rank (SimulationResult.bubble_time): give the idle time of one "
                         "rank (under ZB-H1 every rank idles as long)")
    bubble = _number("bubble", bubble)      # a Python or NumPy number (a tensor: .item())
    want = (p - 1) * (f + b - w)            # Qi et al. 2024, sec. 3.1 (w <= f, b)
    if math.isclose(bubble, want, rel_tol=1e-6):
        sim = simulate(zb_h1(p, m), f=f, b=b, w=w)
        _ok(f"(p-1)(f+b-w) = {want:g} time units per rank; the simulator measures "
            f"{sim.bubble_time[0]:g}; 1F1B idles (p-1)(f+b+w) = {(p - 1) * (f + b + w):g}")
        return
    wrong = [((p - 1) * (f + b + w), "that is 1F1B's bubble, (p-1)(f+b+w): ZB-H1 moves the "
              "W's into it"),
             ((p - 1) * (f + b), "(p-1)(f+b) leaves W out; ZB-H1's deferred W's also fill "
              "part of the warm-up's idle time: subtract w"),
             (want / (m * (f + b + w) + want), "that is the bubble's share of the step; give "
              "the idle time per rank, in the units of f, b, w"),
             ((p - 1) * (f + b - 2 * w), "that is ZB-H2's, (p-1)(f+b-2w), at the price of "
              "2p-1 activations in flight"),
             (p * (f + b - w), "p(f+b-w) counts p gaps: a pipeline of p stages idles "
              "through p-1 of them"),
             (m * (f + b + w) + want, "that is the whole step (its makespan); the bubble is "
              "the part of it each rank idles"),
             (100 * want / (m * (f + b + w) + want), "that is the bubble's share of the step "
              "as a percentage; give the idle time per rank, in the units of f, b, w")]
    if (f, b, w) != (1, 1, 1):      # section 4's costs in place of the exercise's
        wrong.append(((p - 1) * (1 + 1 - 1), f"that is with f = b = w = 1, section 4's costs; "
                      f"the exercise has f={f:g}, b={b:g}, w={w:g}"))
    # with some costs two mistakes give one number (p=4, f=b=2, w=1: (p-1)(f+b) = p(f+b-w)
    # = 12): name every mistake it matches, not only the first
    named = [text for value, text in wrong if math.isclose(bubble, value, rel_tol=1e-6)]
    if named:
        raise CheckError(f"your bubble is {bubble:g}: " + "; or ".join(named),
                         expected=f"{want:g}")
    raise CheckError(f"your bubble is {bubble:g}: ZB-H1 idles (p-1)(f+b-w) per rank, with "
                     f"p={p}, f={f:g}, b={b:g}, w={w:g}", expected=f"{want:g} = (p-1)(f+b-w)")
