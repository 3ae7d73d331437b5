"""Draw the modeled clock: a compute and a comm stream per rank, exposed communication marked.

Renders data only: events come from a :class:`~workbench.sim_mesh.trace.Trace`,
an :class:`~workbench.parallel.strategies.overlap.OverlapReport` (or anything
with ``.events``) or a list of Events; hidden and exposed times are measured by
``OverlapReport.from_events`` and ``exposed_intervals``, nothing here computes them.

    >>> y, rep = matmul_all_reduce(x, w, mesh, "tp", chunks=4, profile="ascend-910b")
    >>> fig = draw_timeline(rep)            # a matplotlib Figure (no pyplot state)
    >>> print(render_text(rep, width=40))   # the same picture for a terminal

Figures are deterministic: fixed colours (one per stream, red for exposed
communication), fixed sizes and fonts.
"""
from __future__ import annotations

import io
import math
from typing import Iterable

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..parallel.strategies.overlap import OverlapReport, exposed_intervals
from ..sim_mesh.trace import Event
from .timeline_labels import key_lines, place_labels

__all__ = ["STREAM_COLORS", "EXPOSED_COLOR", "TimelineFigure", "draw_timeline", "render_text",
           "caption", "time_unit", "as_report"]

STREAM_COLORS = {"compute": "#3a78b5",    # compute stream
                 "comm": "#e8862a"}       # communication stream
EXPOSED_COLOR = "#d62728"                 # communication the compute stream waits for
FONT = {"family": "DejaVu Sans", "size": 9}
MAX_LABELS = 80                           # above this many bars, no text inside them
FIG_WIDTH, LEFT, RIGHT = 10.0, 0.14, 0.83  # inches; the axes' share of the width
TOP, TITLE_PAD = 0.6, 16                  # inches above the axes; points between title and axes
KEY_LINE = 0.19                           # inches per line of the label key (8 pt, spaced 1.5)


class TimelineFigure(Figure):
    """A Figure that shows itself in a notebook without pyplot (through ``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        buf = io.BytesIO()
        FigureCanvasAgg(self).print_png(buf)
        return buf.getvalue()


def as_report(data) -> OverlapReport:
    """An OverlapReport for a report (as is), a Trace, an object with ``.events``, or Events."""
    if isinstance(data, OverlapReport):
        return data
    events = getattr(data, "events", data)
    try:
        events = tuple(events)
    except TypeError:
        events = None
    if events is None or not all(isinstance(e, Event) for e in events):
        raise TypeError(f"draw a Trace, an OverlapReport or a list of Events, got "
                        f"{type(data).__name__}: e.g. draw_timeline(report)")
    prof = getattr(getattr(data, "profile", None), "name", "")
    return OverlapReport.from_events(events, "trace", 1, prof)


def time_unit(seconds: float) -> tuple[str, float]:
    """('us', 1e6) below 0.1 ms, ('ms', 1e3) below 1 s, else ('s', 1.0)."""
    if seconds < 1e-4:
        return "us", 1e6
    if seconds < 1:
        return "ms", 1e3
    return "s", 1.0


def caption(report: OverlapReport, span: float | None = None) -> str:
    """'comm hidden 75.0% (0.510 of 0.680 ms) | exposed 0.170 ms | total 1.190 ms', in the
    unit of ``span`` seconds (a figure's time axis) where given, else of the step's own
    length: a caption under a stretched axis (``draw_timeline(until=)``) reads in the
    axis's unit."""
    if span is not None and (isinstance(span, bool) or not isinstance(span, (int, float))
                             or not span > 0):
        raise ValueError(f"caption(span={span!r}): give the axis's length in seconds (> 0), "
                         "or None for the step's own")
    ref = span or report.total or report.comm
    u, s = time_unit(ref)

    def t(x):
        return _digits(x * s, ref * s)
    return (f"comm hidden {_share(report.hidden_share)} ({t(report.hidden)} of "
            f"{t(report.comm)} {u}) | exposed {t(report.exposed)} {u} | "
            f"total {t(report.total)} {u}")


# below this share of the caption's reference time a figure is float noise of the
# clock's subtractions (hidden = comm - exposed), printed as 0
_NOISE = 1e-9


def _digits(v: float, ref: float) -> str:
    """``v`` with 3 decimals, or, where those would print a nonzero time as 0.000,
    with the decimals that show its 3 significant digits (0.000312)."""
    if abs(v) < 5e-4 and abs(v) > _NOISE * abs(ref):
        return f"{v:.{min(2 - math.floor(math.log10(abs(v))), 15)}f}"
    return f"{0.0 if abs(v) <= _NOISE * abs(ref) else v:.3f}"


def _share(x: float) -> str:
    """A share as 75.0%; one that is not 0 or 1 but would print as 0.0% or 100.0% gets
    3 significant digits of its distance from them (0.0312%, 99.9688%)."""
    text = f"{x:.1%}"
    if text in ("0.0%", "100.0%") and _NOISE < x < 1 - _NOISE:
        d = 2 - math.floor(math.log10(min(x, 1 - x) * 100))
        text = f"{x:.{min(d, 13)}%}"
    return text


def _ranks(events: Iterable[Event], ranks) -> list[int]:
    seen = sorted({r for e in events for r in e.ranks})
    if ranks is None:
        return seen
    missing = [r for r in ranks if r not in seen]
    if missing:
        raise ValueError(f"ranks={list(ranks)}: {missing} recorded no events; the events "
                         f"cover ranks {seen}")
    return list(ranks)


def _rect(x0, x1, y, h):
    return [(x0, y - h / 2), (x1, y - h / 2), (x1, y + h / 2), (x0, y + h / 2)]


def draw_timeline(data, *, ranks=None, title: str | None = None, labels: bool = True,
                  dpi: int = 100, until: float | None = None) -> TimelineFigure:
    """Bars on the modeled clock: per rank a compute row above a comm row.

    Comm time during which that rank's compute stream idles is overlaid in red
    (exposed); the caption gives the hidden share.  ``until`` (seconds, at least the
    step's own length) stretches the time axis, so that two steps drawn with the same
    ``until`` share one scale and unit.  Artists carry gids for tests and
    tools: "compute", "comm", "exposed" (PolyCollections, one rectangle per event
    and rank), "labels" (texts in bars, up to ``MAX_LABELS`` bars), "label_marks" (circled
    numbers in bars too short for their label) and "label_key" (those labels, under the
    axis), "caption"."""
    rep = as_report(data)
    events = rep.events
    rows = _ranks(events, ranks)
    t0 = min((e.start for e in events), default=0.0)
    if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))
                              or not until >= rep.total * (1 - 1e-9)):
        raise ValueError(f"until={until!r} must be a number of seconds no shorter than the "
                         f"step drawn ({rep.total!r} s): pass the longest of the steps you "
                         "compare, or None")
    span = max(float(until), rep.total) if until is not None else rep.total
    unit, scale = time_unit(span or 1.0)
    height = 1.3 + TOP - 0.4 + 0.55 * len(rows)                    # inches
    fig = TimelineFigure(figsize=(FIG_WIDTH, height), dpi=dpi)
    ax = fig.subplots()
    bars = {"compute": [], "comm": []}
    texts = []
    for i, r in enumerate(rows):
        for e in events:
            if r in e.ranks and e.stream in bars:
                y = 2 * i + (e.stream == "comm")
                x0, x1 = (e.start - t0) * scale, (e.end - t0) * scale
                bars[e.stream].append(_rect(x0, x1, y, 0.8))
                texts.append(((x0 + x1) / 2, y, e.label or e.name, x1 - x0))
    exposed = [_rect((s - t0) * scale, (e - t0) * scale, 2 * i + 1, 0.8)
               for i, r in enumerate(rows) for s, e in exposed_intervals(events, r)]
    for gid, verts, color in (("compute", bars["compute"], STREAM_COLORS["compute"]),
                              ("comm", bars["comm"], STREAM_COLORS["comm"]),
                              ("exposed", exposed, EXPOSED_COLOR)):
        ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors="white",
                                         linewidths=0.5, gid=gid), autolim=False)
    key = {}
    if labels and len(texts) <= MAX_LABELS:
        # a label is written in its bar where it fits, else a circled number in the bar
        # and the label in the key under the axis (timeline_labels.py)
        pt_per_unit = FIG_WIDTH * (RIGHT - LEFT) * 72 / (span * scale or 1.0)
        inside, marked, key, _ = place_labels(texts, pt_per_unit)
        for x, y, s in inside:
            ax.text(x, y, s, ha="center", va="center", fontsize=7, color="white",
                    gid="labels")
        for x, y, s in marked:
            ax.text(x, y, s, ha="center", va="center", fontsize=9, color="white",
                    gid="label_marks")
    ax.set_xlim(0, span * scale or 1.0)
    ax.set_ylim(2 * len(rows) - 0.5, -0.5)                        # rank 0 on top
    ax.set_yticks(range(2 * len(rows)),
                  [f"rank {r} {s}" for r in rows for s in ("compute", "comm")], **FONT)
    ax.set_xlabel(f"time ({unit}, modeled on {rep.profile or 'the trace profile'})", **FONT)
    head = title if title is not None else (
        f"{rep.kind}  k={rep.k}" if rep.kind and rep.kind != "trace" else "timeline")
    # the title on its own line above the caption: a long title never runs into it
    ax.set_title(head, loc="left", fontdict=FONT, pad=TITLE_PAD)
    ax.text(1.0, 1.01, caption(rep, span or 1.0), transform=ax.transAxes, ha="right", va="bottom",
            gid="caption", **FONT)
    handles = [Patch(color=STREAM_COLORS["compute"], label="compute"),
               Patch(color=STREAM_COLORS["comm"], label="comm (hidden)"),
               Patch(color=EXPOSED_COLOR, label="comm (exposed)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1, 1), frameon=False,
              prop=FONT)
    bottom = 0.6
    if key:                                       # the key under the axis label, in a band
        lines = key_lines(key)                    # of its own that the figure grows by
        band = KEY_LINE * len(lines) - 0.04       # its top in the x label's margin
        height, bottom = height + band, bottom + band
        fig.set_size_inches(FIG_WIDTH, height)
        fig.text(LEFT, (band + 0.12) / height, "\n".join(lines), ha="left", va="top", fontsize=8,
                 family=FONT["family"], linespacing=1.5, gid="label_key")
    fig.subplots_adjust(left=LEFT, right=RIGHT, top=1 - TOP / height, bottom=bottom / height)
    return fig


def _covered(intervals, lo, hi) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def render_text(data, *, ranks=None, width: int = 80) -> str:
    """The timeline in plain text, ``width`` characters of time per row.

    Compute rows: '#' busy, '.' idle.  Comm rows: '=' communicating while compute
    runs (hidden), '!' communicating while compute idles (exposed), '.' idle.  A
    character shows what fills at least half of its cell."""
    rep = as_report(data)
    events = rep.events
    rows = _ranks(events, ranks)
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"render_text(width={width!r}): give a positive number of characters")
    t0 = min((e.start for e in events), default=0.0)
    cell = (rep.total or 1.0) / width
    unit, scale = time_unit(rep.total or 1.0)
    pad = len(str(max(rows, default=0)))
    head = f"{rep.kind} k={rep.k}" if rep.kind not in ("", "trace") else "trace"
    lines = [f"{head} on {rep.profile or '?'}   (1 char = "
             f"{cell * scale:.4g} {unit}; # compute, = comm hidden, ! comm exposed, . idle)"]
    for r in rows:
        comp = [(e.start, e.end) for e in events if e.stream == "compute" and r in e.ranks]
        comm = [(e.start, e.end) for e in events if e.stream == "comm" and r in e.ranks]
        expo = exposed_intervals(events, r)
        crow, mrow = [], []
        for j in range(width):
            lo, hi = t0 + j * cell, t0 + (j + 1) * cell
            crow.append("#" if _covered(comp, lo, hi) >= cell / 2 else ".")
            busy, bad = _covered(comm, lo, hi), _covered(expo, lo, hi)
            mrow.append("." if busy < cell / 2 else "!" if bad >= busy / 2 else "=")
        lines.append(f"rank {r:>{pad}} compute |{''.join(crow)}|")
        lines.append(f"rank {r:>{pad}} comm    |{''.join(mrow)}|")
    lines.append(caption(rep))
    return "\n".join(lines)
