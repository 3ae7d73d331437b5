"""Argument checks shared by the schedule generators: types first, then the size.

A schedule is plain Python data, one :class:`~.actions.Action` per step of each
rank, and :func:`~.simulate.simulate` and :func:`~.validate.validate` visit every
one of them.  Measured on one core of this project's 2-core CI machine
(``one_f_one_b(100, 10_000)``, 2 million actions): 0.3 s to build, 5 s to
simulate, 4 s to validate, 0.5 GB.  So a generator refuses more than
:data:`MAX_ACTIONS` actions before it builds any, rather than running for minutes:
no pipeline needs that many, since 1F1B's bubble (p-1)/(m+p-1) is already about 1%
at m = 100 p micro-batches.
"""
from __future__ import annotations

MAX_ACTIONS = 1_000_000
"""The most actions a generated schedule may hold (about 2.5 s to simulate; see above)."""

_WHAT = {"p": "pipeline ranks", "m": "micro-batches", "v": "model chunks per rank"}


def check_pm(fn: str, p, m, v=None, per: int = 2) -> None:
    """Clear errors for p (ranks), m (micro-batches) and v (chunks per rank), then for a
    schedule of ``per * p * m * v`` actions (``per``: 2 for F and B, 3 with W) over
    :data:`MAX_ACTIONS`, in microseconds, before anything is built."""
    for arg, val in (("p", p), ("m", m), ("v", v)):
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{fn}({arg}={val!r}): the number of {_WHAT[arg]} must be an "
                             f"int >= 1")
    n = per * p * m * (v or 1)
    if n > MAX_ACTIONS:
        given = f"p={p}, m={m}" + (f", v={v}" if v is not None else "")
        formula = f"{per}·p·m" + ("·v" if v is not None else "")
        raise ValueError(
            f"{fn}({given}): the schedule would hold {formula} = {n:,} actions, over the limit "
            f"of {MAX_ACTIONS:,} (a schedule is one Python object per action, and simulating "
            f"a million takes seconds); use fewer ranks, micro-batches or chunks: at "
            f"m = 100·p the bubble (p-1)/(m+p-1) is already about 1%")
