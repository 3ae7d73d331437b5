"""Argument checks shared by the schedule generators."""
from __future__ import annotations


def check_pm(fn: str, p, m, v=None) -> None:
    """Clear errors for p (ranks), m (micro-batches) and v (chunks per rank)."""
    for arg, val in (("p", p), ("m", m), ("v", v)):
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            what = {"p": "pipeline ranks", "m": "micro-batches", "v": "model chunks per rank"}[arg]
            raise ValueError(f"{fn}({arg}={val!r}): the number of {what} must be an int >= 1")
