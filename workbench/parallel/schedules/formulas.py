"""Closed-form bubbles from the papers, to print beside what the simulator counts.

All assume every stage costs the same and messages are free (p2p = 0):

==================  ===========================  ===================================
schedule            bubble time per rank         source
==================  ===========================  ===================================
GPipe, 1F1B         (p-1)(t_f + t_b)             Huang et al. 2019; Narayanan et al.
interleaved 1F1B    (p-1)(t_f + t_b), per chunk  Narayanan et al. SC21 (1/v of 1F1B)
ZB-H1               (p-1)(t_F + t_B - t_W)       Qi et al. 2024 (m >= p, t_W <= t_F, t_B)
DualPipe            (p/2-1)(F&B + B - 3W)        DeepSeek-V3 report, Table 2 (B the
                                                 full backward b + w; F&B the pair)
==================  ===========================  ===================================

DualPipe's F&B is a forward and a backward run overlapped, taken here as f + b + w (no
overlap gain).  Simulated with each steady-state pair as one block (``dualpipe_costs``:
both outputs leave when the pair ends), the bubble is Table 2's exactly when
f = b = w (the zero-bubble papers' setting; tests/test_schedules_dualpipe.py, p = 2..8).
Run as separate actions (a forward's output leaving before its paired backward), the
simulator measures less, (p/2-1)(f + b - w) when b <= f.  Table 2's other columns hold as
simulated: p + 1 micro-batches of activations, two copies of the parameters.

ZB-V's published bubble is 0 when t_F = t_B = t_W (the comparison table of Qi et al.'s
schedules, sail-sg; m >= 2p here), counted from each rank's first action to its last
(``measure="span"``: compare with ``SimulationResult.span_bubble``); other costs have no
closed form (None).

With t_b the whole backward (t_B + t_W when ``w`` is given to a schedule that does
not split it).  As a fraction of the step, bubble / (bubble + busy), where busy is
m(t_f + t_b) per rank (m v chunk actions for interleaved).
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

from .actions import Schedule
from .gpipe import gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .zero_bubble import zb_h1
from .dualpipe import dualpipe
from .zb_v import zb_v

__all__ = ["BubbleFormula", "formula_bubble"]


@dataclass(frozen=True)
class BubbleFormula:
    """A published bubble formula evaluated for one schedule and its costs."""
    expression: str        # bubble fraction of the step, e.g. "(p-1)/(m+p-1)"
    value: float           # that fraction for this p, m, v and these costs
    bubble_time: float     # idle time per rank
    time_expression: str   # e.g. "(p-1)(f+b)"
    source: str            # the paper
    measure: str = "makespan"   # "makespan": SimulationResult.bubble_fraction / bubble_time;
    #                             "span": span_bubble_fraction / span_bubble (ZB-V)

    def __str__(self) -> str:
        return f"{self.expression} = {self.value:.2%}"


_SOURCES = {
    "gpipe": "Huang et al. 2019 (GPipe)",
    "1f1b": "Narayanan et al. 2021 (PipeDream-Flush / 1F1B)",
    "interleaved_1f1b": "Narayanan et al. SC21 (interleaved 1F1B)",
    "zb_h1": "Qi et al. 2024 (ZB-H1)",
    "dualpipe": "DeepSeek-AI 2024, DeepSeek-V3 technical report, Table 2 (DualPipe)",
    "zb_v": "Qi et al. 2024 (ZB-V, arXiv 2401.10241; sail-sg's comparison table: bubble "
            "rate 0 at t_F = t_B = t_W, activations 1x 1F1B)",
}


def _generated(s: Schedule) -> bool:
    """True when ``s`` is exactly what its named generator builds (hand edits lose the formula)."""
    try:
        ref = {"gpipe": lambda: gpipe(s.p, s.m), "1f1b": lambda: one_f_one_b(s.p, s.m),
               "interleaved_1f1b": lambda: interleaved_1f1b(s.p, s.m, s.v),
               "zb_h1": lambda: zb_h1(s.p, s.m),
               "dualpipe": lambda: dualpipe(s.p, s.m),
               "zb_v": lambda: zb_v(s.p, s.m)}[s.name]()
    except (KeyError, ValueError):
        return False
    return ref.actions == s.actions


def formula_bubble(schedule: Schedule, f=1.0, b=1.0, w=None, p2p=0.0) -> BubbleFormula | None:
    """The published bubble for ``schedule`` with uniform costs, or None where none applies.

    None for hand-written schedules, per-stage or callable costs, p2p > 0, and
    ZB-H1 outside the setting its formula holds in: m >= p micro-batches and
    t_W <= min(t_F, t_B), since a W longer than the F or B slot it fills cannot
    hide there (the simulator then measures (p-1)(t_F + t_B - min(t_F, t_B, t_W))).
    A NaN, infinite or negative cost raises ValueError, as in :func:`~.simulate.simulate`."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"formula_bubble(schedule={type(schedule).__name__}): pass a Schedule, "
                        "e.g. one_f_one_b(4, 8)")
    s = schedule
    given = {"f": f, "b": b, "w": w, "p2p": p2p}
    for arg, x in given.items():
        if x is None and arg == "w":
            continue
        if isinstance(x, numbers.Real) and not isinstance(x, bool):
            if not 0 <= x < math.inf:        # NaN fails this too
                raise ValueError(f"formula_bubble({arg}={x!r}): a cost must be a finite number "
                                 f"of seconds >= 0, e.g. {arg}=1.0")
        elif not (callable(x) or isinstance(x, (list, tuple)) or hasattr(x, "__array__")):
            raise TypeError(f"formula_bubble({arg}={x!r:.60}): give a number of seconds (or, as "
                            "for simulate, a per-stage list or a callable, which have no "
                            "closed form: the answer is then None)")
    if not all(isinstance(x, numbers.Real) for x in given.values() if x is not None):
        return None                          # per-stage or callable costs: no closed form
    if p2p or not _generated(s):
        return None
    p, m, v = s.p, s.m, s.v
    if s.name == "zb_v":
        if w is None or not f == b == w or m < 2 * p:
            return None
        return BubbleFormula("0 (counted from each rank's first action)", 0.0, 0.0, "0",
                             _SOURCES["zb_v"], measure="span")
    if s.name == "dualpipe":
        if w is None:
            return None
        full = b + w                                # Table 2's B: the full backward
        bubble, busy = (p / 2 - 1) * ((f + full) + full - 3 * w), m * (f + b + w)
        expr = "(p/2-1)(F&B+B-3W) / ((p/2-1)(F&B+B-3W) + m(f+b+w)), F&B = f+b+w"
        texpr = "(p/2-1)(F&B+B-3W)"
    elif s.name == "zb_h1":
        if w is None or w > min(f, b) or m < p:     # outside the paper's setting
            return None
        bubble, busy = (p - 1) * (f + b - w), m * (f + b + w)
        expr, texpr = "(p-1)(f+b-w) / ((p-1)(f+b-w) + m(f+b+w))", "(p-1)(f+b-w)"
    else:
        bw = b + (w or 0.0)
        tb = "(f+b+w)" if w is not None else "(f+b)"
        bubble = (p - 1) * (f + bw)
        if s.name == "interleaved_1f1b" and v > 1:
            busy = v * m * (f + bw)
            expr, texpr = "(p-1)/(v·m+p-1)", f"(p-1){tb} per chunk action"
        else:
            busy = m * (f + bw)
            expr, texpr = "(p-1)/(m+p-1)", f"(p-1){tb}"
    total = bubble + busy
    if not math.isfinite(total):
        raise ValueError(f"formula_bubble(f={f!r}, b={b!r}, w={w!r}): the step's time "
                         f"(bubble {texpr} plus busy time) overflows a float "
                         f"(> {sys.float_info.max:.3g} s); "
                         "give the costs in a larger unit, or relative costs (f=1, b=2)")
    return BubbleFormula(expr, bubble / total if total else 0.0, float(bubble), texpr,
                         _SOURCES[s.name])
