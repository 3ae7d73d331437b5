"""Tick labels a student reads as numbers: a log axis labelled 1, 2, 4 ... 512, 1K, 2K ...
(base 2) or 0.1, 1, 10, 100, 1,000 (base 10), never matplotlib's 2^10 or 10^3.

    >>> tick_label(8192, base=2), tick_label(1000, base=10), tick_label(0.5, base=2)
    ('8K', '1,000', '0.5')

On a base-2 axis K, M, G, T are the binary units (1K = 1,024 = 2^10, 1M = 2^20 ...), as
in bytes and in the powers-of-two sizes those axes sweep; on a base-10 axis a thousand is
written out (1,000), so that a K never means 1,000 in one figure and 1,024 in another.
Minor ticks carry no label (base 10 keeps their marks, base 2 has none).
"""
from __future__ import annotations

import math

__all__ = ["BINARY_UNITS", "tick_label", "log_axis", "point_ticks"]

# (suffix, value): the binary prefixes of IEC 80000-13 (Ki, Mi, Gi, Ti), written K, M, G, T
BINARY_UNITS = (("T", 2 ** 40), ("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10))


def _snap(value: float, base: int) -> float:
    """``value`` itself, or the power of ``base`` it is within rounding of (a locator's
    1024.0000000000002 is 1024)."""
    p = round(math.log(value, base))
    exact = float(base) ** p
    return exact if math.isclose(value, exact, rel_tol=1e-9) else value


def _plain(value: float) -> str:
    if value >= 1 and value == round(value):
        return f"{round(value):,}"                     # 1,000 (not 1e+03)
    return f"{value:.3g}"                              # 0.5, 0.125, 1.5, 0.01


def tick_label(value: float, *, base: int = 10) -> str:
    """The label of a tick at ``value`` on a log axis of ``base`` (2 or 10)."""
    if base not in (2, 10):
        raise ValueError(f"tick_label(base={base!r}): give 2 or 10")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"tick_label(value={value!r}): give a finite number")
    if value <= 0:
        return ""                                      # no tick of a log axis sits here
    value = _snap(float(value), base)
    if base == 2:
        for suffix, unit in BINARY_UNITS:
            if value >= unit:
                return f"{_plain(value / unit)}{suffix}"
    return _plain(value)


def log_axis(axis, base: int) -> None:
    """Label the major ticks of a log ``axis`` (``ax.xaxis`` or ``ax.yaxis``, already
    set to a log scale of ``base``) with :func:`tick_label`; minor ticks unlabelled, and
    on a base-2 axis not drawn."""
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator
    if base not in (2, 10):
        raise ValueError(f"log_axis(base={base!r}): give 2 or 10")
    axis.set_major_formatter(FuncFormatter(lambda v, pos: tick_label(v, base=base)))
    axis.set_minor_formatter(NullFormatter())
    if base == 2:
        axis.set_minor_locator(NullLocator())


POINT_TICKS = 12        # the most labels point_ticks puts under a 7-inch chart


def point_ticks(axis, values, most: int = POINT_TICKS) -> list:
    """Put the major ticks of ``axis`` at the data's own ``values`` (the x of a chart's
    points), so that each label sits under a marker: a base-2 log axis's locator ticks
    every other octave where the points sweep every other one, and the labels fell between
    the points (notebook 12's 1K, 4K ... 256M under ticks 2K, 8K ..., browser review nb18).
    Over ``most`` distinct values, every k-th from the first (k the least that leaves at
    most ``most``), so the labels stay apart.  Returns the tick values; labels are left to
    the axis's formatter (:func:`log_axis`)."""
    from matplotlib.ticker import FixedLocator
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ValueError(f"point_ticks(most={most!r}): give a positive int")
    xs = sorted({float(v) for v in values})
    step = -(-len(xs) // most)
    ticks = xs[::step]
    axis.set_major_locator(FixedLocator(ticks))
    return ticks
