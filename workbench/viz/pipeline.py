"""Draw pipeline schedules: a Gantt chart per rank, memory over time, text, a widget.

Renders data only: the timings, bubbles and memory come from
:func:`workbench.parallel.schedules.simulate`, the closed-form bubble from
:func:`~workbench.parallel.schedules.formula_bubble`; nothing here computes
schedule semantics.

    >>> from workbench.parallel.schedules import one_f_one_b, simulate
    >>> fig = draw_pipeline(simulate(one_f_one_b(4, 8)))      # a matplotlib Figure
    >>> print(render_text(simulate(one_f_one_b(2, 2))))       # doctest: +NORMALIZE_WHITESPACE
    1f1b p=2 m=2 v=1   (1 char = 1 time unit; . = idle)
    rank 0 |FF.B.B|
    rank 1 |.FBFB.|
    bubble: measured 33.33% | formula (p-1)/(m+p-1) = 33.33%

Figures are deterministic: fixed colours (one per action kind, lighter for later
model chunks), fixed sizes and fonts, no pyplot state (``matplotlib.figure.Figure``).
"""
from __future__ import annotations

import base64
import io

import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.path import Path

from ..parallel.schedules import (KINDS, SCHEDULES, Schedule, SimulationResult, formula_bubble,
                                  simulate)
from ..text_width import wrap
from .placements import PRE_WRAP

__all__ = ["KIND_COLORS", "BUBBLE_COLOR", "PipelineFigure", "draw_pipeline", "render_text",
           "bubble_caption", "pipeline_widget", "PipelineExplorer", "memory_colors",
           "text_color", "contrast"]

KIND_COLORS = {"F": "#3a78b5",     # forward
               "B": "#e8862a",     # backward (input gradient when split)
               "W": "#4a9b45"}     # weight gradient
BUBBLE_COLOR = "#f3c6c6"           # idle time
FONT = {"family": "DejaVu Sans", "size": 9}
MAX_LABELS = 400          # above this many blocks, micro-batch numbers are not written
AXES_WIDTH_IN = 10 * (0.9 - 0.08)   # the Gantt axes' width: figure width x (right - left)
LABEL_CHAR_IN = 7 * 0.64 / 72       # a digit at 7 pt: DejaVu Sans digits are 0.64 em wide
LABEL_PAD_IN = 0.03                 # white space a label keeps inside its block
LEGEND_CHUNKS = 4                   # a legend swatch per chunk up to this many chunks
MEMORY_CMAP_END = 0.6               # plasma(0.6) has a 3.4:1 contrast on white (memory_colors)


class PipelineFigure(Figure):
    """A Figure that shows itself in a notebook without pyplot (through ``_repr_png_``)."""

    def _repr_png_(self) -> bytes:
        return _png(self)


def _png(fig: Figure) -> bytes:
    """The figure as PNG bytes, rendered with Agg (deterministic, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def _result(data, f, b, w, p2p) -> SimulationResult:
    if isinstance(data, SimulationResult):
        return data
    if isinstance(data, Schedule):
        return simulate(data, f=f, b=b, w=w, p2p=p2p)
    raise TypeError(f"draw a SimulationResult or a Schedule, got {type(data).__name__}: "
                    f"e.g. draw_pipeline(simulate(one_f_one_b(4, 8)))")


def bubble_caption(result: SimulationResult) -> str:
    """'bubble: measured 27.27% | formula (p-1)/(m+p-1) = 27.27%' (formula where one applies)."""
    c = result.costs
    fb = formula_bubble(result.schedule, c.get("f", 1.0), c.get("b", 1.0), c.get("w"),
                        c.get("p2p", 0.0))
    formula = f"formula {fb}" if fb is not None else "no closed-form formula for this case"
    if fb is not None and fb.measure == "span":      # ZB-V: counted from each rank's start
        return (f"bubble from each rank's start: measured "
                f"{result.span_bubble_fraction:.2%} | {formula}")
    return f"bubble: measured {result.bubble_fraction:.2%} | {formula}"


def contrast(a, b) -> float:
    """WCAG 2.1 contrast ratio of two colours, 1 (none) to 21 (black on white)."""
    def lum(c):
        c = np.array(to_rgb(c))
        c = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
        return float(c @ [0.2126, 0.7152, 0.0722])
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def text_color(fill) -> str:
    """Black or white, whichever reads better on ``fill``: white on the forward's blue
    (4.6:1), black on the backward's orange (white there was 2.7:1) and on lighter
    chunks."""
    return "white" if contrast("white", fill) > contrast("black", fill) else "black"


def _shade(kind: int, chunk: int, v: int) -> tuple:
    """Kind colour mixed with white by chunk: chunk 0 full colour, later chunks lighter."""
    mix = chunk / max(v, 2) * 0.6
    return tuple(x * (1 - mix) + mix for x in to_rgb(KIND_COLORS[KINDS[kind]]))


def draw_pipeline(data, *, f=1.0, b=1.0, w=None, p2p=0.0, memory: bool = True,
                  max_labels: int = MAX_LABELS, dpi: int = 100,
                  caption: bool = True, row_label: str = "rank",
                  time_unit: "str | None" = None) -> PipelineFigure:
    """Gantt chart of ``data`` (a SimulationResult, or a Schedule simulated with f, b, w, p2p).

    Top: one row per rank (rank 0 on top); F, B, W blocks in fixed colours with the
    micro-batch written inside (up to ``max_labels`` blocks), lighter shades for
    later model chunks, idle time shaded, and the measured bubble next to the
    published formula (``caption=False`` leaves it to the caller, e.g. a widget that
    prints it).  ``row_label`` names a row ("stage" where each pipeline rank is a group
    of devices); ``time_unit`` the unit of the times simulated ("s" for a planner
    estimate's ``pipeline()``; None: the schedule's own units).  Bottom
    (``memory=True``): activations in flight per rank.
    Artists carry gids for tests and tools: "blocks" (a collection with one
    compound path of rectangles per kind and chunk), "bubbles", "labels", "caption".
    """
    if not isinstance(row_label, str) or not row_label:
        raise ValueError(f"draw_pipeline: row_label={row_label!r} must be a non-empty str, "
                         "e.g. 'rank' or 'stage'")
    if time_unit is not None and (not isinstance(time_unit, str) or not time_unit):
        raise ValueError(f"draw_pipeline: time_unit={time_unit!r} must be a non-empty str "
                         "such as 's' or 'ms', or None for the schedule's own units")
    res = _result(data, f, b, w, p2p)
    s, bl = res.schedule, res.blocks
    height = 1.6 + min(0.32 * s.p, 6.0)
    fig = PipelineFigure(figsize=(10, height + (2.2 if memory else 0)), dpi=dpi)
    ax, axm = (fig.subplots(2, 1, sharex=True, height_ratios=[height, 2.2]) if memory
               else (fig.subplots(1, 1), None))

    # bubbles first, so the blocks sit on top; one compound path per colour keeps
    # 100k+ blocks fast to build and to render
    gaps = [(r, lo, hi) for r, row in enumerate(res.bubbles()) for lo, hi in row]
    g = np.array(gaps, float).reshape(-1, 3)
    ax.add_collection(PathCollection([_rects(g[:, 0], g[:, 1], g[:, 2] - g[:, 1], 0.9)],
                                     facecolors=BUBBLE_COLOR, edgecolors="none", gid="bubbles"),
                      autolim=False)
    paths, colors = [], []
    for k in range(len(KINDS)):                       # one path per (kind, chunk): its colour
        for c in range(s.v):
            sel = (bl.kind == k) & (bl.chunk == c)
            if sel.any():
                paths.append(_rects(bl.rank[sel], bl.start[sel], bl.duration[sel], 0.8))
                colors.append(_shade(k, c, s.v))
    ax.add_collection(PathCollection(paths, facecolors=colors, linewidths=0.5, gid="blocks",
                                     edgecolors="white" if len(bl) <= 2000 else "none"),
                      autolim=False)
    if len(bl) <= max_labels:
        inch = AXES_WIDTH_IN / (res.makespan or 1.0)          # inches per time unit
        for r, t, d, mb, k, c in zip(bl.rank.tolist(), bl.start.tolist(),
                                     bl.duration.tolist(), bl.mb.tolist(), bl.kind.tolist(),
                                     bl.chunk.tolist()):
            if d * inch < LABEL_CHAR_IN * len(str(mb)) + LABEL_PAD_IN:
                continue                # too narrow: the numbers would run into each other
            ax.text(t + d / 2, r, str(mb), ha="center", va="center", fontsize=7,
                    color=text_color(_shade(k, c, s.v)), gid="labels")

    ax.set_xlim(0, res.makespan or 1.0)
    ax.set_ylim(s.p - 0.5, -0.5)                                    # rank 0 on top
    step = max(1, s.p // 16)
    ax.set_yticks(range(0, s.p, step), [f"{row_label} {r}" for r in range(0, s.p, step)], **FONT)
    ax.set_title(f"{s.name}   p={s.p}  m={s.m}  v={s.v}", loc="left", fontdict=FONT)
    if caption:
        ax.text(1.0, 1.01, bubble_caption(res), transform=ax.transAxes, ha="right",
                va="bottom", gid="caption", **FONT)
    # beyond LEGEND_CHUNKS chunks the shades step too finely to match by eye (v = 12 gave
    # 24 swatches in 4 rows): the first and the lightest chunk only, the rest between them
    shown = [c for c in range(s.v)
             if s.v <= LEGEND_CHUNKS or c in (0, s.v - 1)]
    handles = [Patch(color=_shade(i, c, s.v), label=k if s.v == 1 else
                     f"{k} chunk {c}" + (f" (1-{c - 1} between)" if c > 1 and s.v > LEGEND_CHUNKS
                                         else ""))
               for i, k in enumerate(KINDS) if (bl.kind == i).any()
               for c in shown if ((bl.kind == i) & (bl.chunk == c)).any()]
    handles.append(Patch(color=BUBBLE_COLOR, label="bubble"))
    ncols = min(len(handles), 7)
    fig.legend(handles=handles, loc="lower center", ncols=ncols, frameon=False, prop=FONT)
    (axm or ax).set_xlabel("time (modeled)" if time_unit is None
                           else f"time (modeled, {time_unit})", **FONT)
    if axm is not None:
        _draw_memory(axm, res, row_label)
    # the legend sits below the time axis: each row past the first (interleaved, v >= 4:
    # 2 x v + 1 entries) gets 0.2 in more at the bottom, so it never covers the axis
    extra = 0.2 * (-(-len(handles) // ncols) - 1)
    inches = height + (2.2 if memory else 0) + extra
    fig.set_size_inches(10, inches)
    fig.subplots_adjust(left=0.08, right=0.9, top=1 - 0.45 / inches,       # AXES_WIDTH_IN
                        bottom=((0.85 if memory else 0.75) + extra) / inches)
    return fig


def _rects(rank, start, duration, h) -> Path:
    """One compound path of rectangles: time along x, rank along y, height ``h``.

    Five vertices per rectangle (MOVETO, 3 x LINETO, CLOSEPOLY)."""
    x0, x1 = start, start + duration
    y0, y1 = rank - h / 2, rank + h / 2
    verts = np.stack([np.stack(xy, -1) for xy in ((x0, y0), (x1, y0), (x1, y1), (x0, y1),
                                                  (x0, y0))], 1)          # (N, 5, 2)
    codes = np.tile([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY],
                    len(verts))
    return Path(verts.reshape(-1, 2), codes.astype(Path.code_type))


def memory_colors(p: int) -> list:
    """One colour per rank for the activations-in-flight lines: matplotlib's plasma from
    its dark end to MEMORY_CMAP_END, evenly spaced, rank 0 darkest.  Every one has at
    least a 3:1 contrast on white (WCAG 2.1's minimum for graphics, SC 1.4.11), whatever
    p: the full map ends in pale yellow (1.2:1), which vanished on the white page."""
    from matplotlib import colormaps
    cmap = colormaps["plasma"]
    return [cmap(MEMORY_CMAP_END * r / max(p - 1, 1)) for r in range(p)]


def _draw_memory(ax, res: SimulationResult, row_label: str = "rank") -> None:
    """Step lines of activations in flight, one per rank (fixed colours: memory_colors).

    Counted in model chunks where a rank holds v > 1 of them (interleaved): the peak
    is then also given in micro-batches' worth, a chunk holding 1/v of a stage's layers."""
    from matplotlib.ticker import MaxNLocator
    p, v = res.schedule.p, res.schedule.v
    colors = memory_colors(p)
    for r, (times, counts) in enumerate(res.memory):
        t = np.append(times, res.makespan)
        c = np.append(counts, counts[-1])
        ax.step(t, c, where="post", color=colors[r], linewidth=1.2,
                label=f"{row_label} {r}" if p <= 8 else None, gid=f"memory-{r}")
    peak = max(res.peak_inflight)
    ax.axhline(peak, color="#555555", linestyle="--", linewidth=0.8, gid="peak")
    label = f" peak {peak}" if v == 1 else f" peak {peak} chunks = {peak / v:.3g} micro-batches"
    ax.text(0.0, peak, label, va="bottom", ha="left", **FONT)
    ax.set_ylim(0, peak * 1.25 + 0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))       # a count: whole numbers
    ax.set_ylabel("activations\nin flight" if v == 1 else "chunks\nin flight", **FONT)
    if p <= 8:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, prop=FONT)


def render_text(data, *, width: int = 120, unit: float | None = None, f=1.0, b=1.0, w=None,
                p2p=0.0) -> str:
    """The timeline in plain text: one row per rank, one character per ``unit`` of time.

    A character is the kind busy for most of its cell (F, B, W; lower case for
    odd model chunks) or '#' when several kinds share it; ':' when the rank is
    idle for a quarter to three quarters of the cell, '.' when idle for more.
    ``unit`` defaults to the largest time step that every block starts and ends
    on (the shortest block, or a half, third, quarter of it), widened so that a
    row fits in ``width`` characters."""
    res = _result(data, f, b, w, p2p)
    s, bl = res.schedule, res.blocks
    if unit is None:
        unit = _default_unit(bl, res.makespan, width)
    if not unit > 0:
        raise ValueError(f"render_text(unit={unit!r}): give a positive time per character")
    cells = int(np.ceil(res.makespan / unit - 1e-9))
    edges = np.minimum(np.arange(cells + 1) * unit, res.makespan)
    size = np.diff(edges)
    group = bl.kind * 2 + bl.chunk % 2                 # (kind, chunk parity): 6 letters
    letters = np.array([c for k in KINDS for c in (k, k.lower())] + ["#", ":", "."])
    rows = []
    for r in range(s.p):
        busy = np.zeros((6, cells))
        for g in range(6):
            sel = (bl.rank == r) & (group == g)
            if sel.any():
                busy[g] = np.diff(_busy_until(bl.start[sel], bl.duration[sel], edges))
        total = busy.sum(0)
        code = np.where(busy.max(0) >= 0.75 * total, busy.argmax(0), 6)
        code = np.where(total < 0.75 * size, 7, code)
        code = np.where(total < 0.25 * size, 8, code)
        rows.append("".join(letters[code]))
    keys = [x for x in (". = idle", ": = partly idle", "# = mixed") if any(x[0] in y for y in rows)]
    head = f"{s.name} p={s.p} m={s.m} v={s.v}   (1 char = {unit:g} time unit{'s' * (unit != 1)}"
    pad = len(str(s.p - 1))
    return "\n".join([head + "".join("; " + k for k in keys) + ")"]
                     + [f"rank {r:>{pad}} |{row}|" for r, row in enumerate(rows)]
                     + [bubble_caption(res)])


def _default_unit(bl, makespan: float, width: int) -> float:
    """The shortest block or a half, third, quarter of it, if every block edge is on that grid."""
    pos = bl.duration[bl.duration > 0]
    if not len(pos):
        return 1.0
    times = np.concatenate([bl.start, bl.start + bl.duration])
    for k in (1, 2, 3, 4):
        unit = float(pos.min()) / k
        steps = times / unit
        if makespan / unit > width:
            break
        if np.allclose(steps, np.round(steps), rtol=0, atol=1e-6):
            return unit
    return max(float(pos.min()), makespan / width)


def _busy_until(start, duration, t) -> np.ndarray:
    """Time spent inside the (sorted, disjoint) blocks before each time in ``t``."""
    end = start + duration
    done = np.concatenate([[0.0], np.cumsum(duration)])
    i = np.searchsorted(end, t, side="right")          # blocks finished by t
    nxt = np.minimum(i, len(start) - 1)
    partial = np.where(i < len(start), np.clip(t - start[nxt], 0, duration[nxt]), 0.0)
    return done[i] + partial


_WRAP = PRE_WRAP
"""The status line wraps at spaces, not inside a word (``placements.PRE_WRAP``)."""


class PipelineExplorer:
    """Sliders for p, m, v and a dropdown of schedules, redrawing the Gantt chart.

    The figure is an image widget whose PNG is replaced in place on every change (the
    page does not jump); the line of text below it gives the measured bubble beside
    its formula, or what is wrong when a choice cannot be built (printed once: the
    live figure carries no caption).  The v slider is enabled only for the schedule
    that uses it; its chunks cost 1/v of a stage's f, b, w each (the same work).
    Displayed where no widget front end runs (nbval, nbconvert, a static viewer) its
    display data also carries a PNG of the current figure, with the caption drawn in,
    and as plain text the call that rebuilds the current choice beside that caption
    (:meth:`describe`).
    """

    USES_V = ("Interleaved 1F1B",)

    def __init__(self, p=4, m=8, v=2, schedule="1F1B", f=1.0, b=1.0, w=1.0, dpi=80):
        try:
            import ipywidgets as widgets
        except ImportError:
            raise ImportError("pipeline_widget needs ipywidgets (pip install 'workbench[course]'); "
                              "draw_pipeline(simulate(...)) draws the static figure") from None
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline_widget(schedule={schedule!r}): choose one of "
                             f"{list(SCHEDULES)}")
        self.costs, self.dpi = dict(f=f, b=b, w=w), dpi
        style = dict(continuous_update=False, style={"description_width": "initial"},
                     layout=widgets.Layout(width="320px"))
        self.controls = {
            "schedule": widgets.Dropdown(options=list(SCHEDULES), value=schedule,
                                         description="schedule",
                                         style={"description_width": "initial"}),
            "p": widgets.IntSlider(value=p, min=1, max=16, description="stages p", **style),
            "m": widgets.IntSlider(value=m, min=1, max=64, description="micro-batches m", **style),
            "v": widgets.IntSlider(value=v, min=1, max=4, description="chunks v", **style),
        }
        self.image = widgets.Image(format="png",                 # at its own size, not stretched
                                   layout=widgets.Layout(align_self="flex-start", max_width="100%"))
        self.status = widgets.HTML()
        self.box = widgets.VBox([widgets.HBox([self.controls["schedule"], self.controls["p"]]),
                                 widgets.HBox([self.controls["m"], self.controls["v"]]),
                                 self.image, self.status])
        self.figure, self.result, self.message = None, None, ""
        for c in self.controls.values():
            c.observe(lambda change: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        """Rebuild the schedule from the controls, simulate it, and replace the image."""
        import html
        c = {k: w.value for k, w in self.controls.items()}
        self.controls["v"].disabled = c["schedule"] not in self.USES_V
        try:
            sched = SCHEDULES[c["schedule"]](c["p"], c["m"], c["v"])
            # a chunk holds 1/v of a stage's layers: the same work under every schedule
            self.result = simulate(sched, **{k: None if x is None else x / sched.v
                                              for k, x in self.costs.items()})
            self.figure = draw_pipeline(self.result, dpi=self.dpi, caption=False)
            self.message = bubble_caption(self.result)    # measured beside the formula
        except ValueError as err:          # e.g. interleaved with m % p != 0: say how to fix
            self.figure, self.result, self.message = None, None, str(err)
        if self.figure is not None:
            self.image.value = _png(self.figure)          # in place: no emptied output
        # an error collapses the figure, so that its message stands right under the
        # controls (a hidden figure kept its height: a blank screen, the message below it)
        self.image.layout.display = None if self.figure is not None else "none"
        self.status.value = f"<pre{_WRAP}>{html.escape(self.message)}</pre>"

    def describe(self) -> str:
        """The call that rebuilds the current choice, and under it the caption (or the
        error), in lines of at most ``text_width.WIDTH`` characters::

            pipeline_widget(p=4, m=8, v=2, schedule='1F1B')
            bubble: measured 27.27% | formula (p-1)/(m+p-1) = 27.27%

        Costs are named where they differ from the default 1.0."""
        c = {k: w.value for k, w in self.controls.items()}
        costs = "".join(f", {k}={x!r}" for k, x in self.costs.items() if x != 1.0)
        return wrap(f"pipeline_widget(p={c['p']}, m={c['m']}, v={c['v']}, "
                    f"schedule={c['schedule']!r}{costs})\n{self.message}")

    def _repr_mimebundle_(self, **kwargs):
        """The widget view, plus a PNG and :meth:`describe` as text for front ends that
        cannot show widgets (ipywidgets' own text, the VBox's repr cut at 110 characters,
        named none of the choices past the dropdown's options)."""
        bundle = dict(self.box._repr_mimebundle_(**kwargs))
        if self.result is not None:
            static = draw_pipeline(self.result, dpi=self.dpi)        # the caption drawn in
            bundle["image/png"] = base64.b64encode(_png(static)).decode("ascii")
        bundle["text/plain"] = self.describe()
        return bundle


def pipeline_widget(p: int = 4, m: int = 8, v: int = 2, schedule: str = "1F1B",
                    f=1.0, b=1.0, w=1.0) -> PipelineExplorer:
    """An explorer of :data:`~workbench.parallel.schedules.SCHEDULES` (needs ipywidgets).

    ``v`` applies to interleaved 1F1B only.  Costs are per stage and micro-batch; a chunk
    of interleaved 1F1B costs 1/v of them, so that every schedule does the same work and
    their time axes compare.  With ``w`` given, every backward is drawn as B then W, so
    1F1B and ZB-H1 compare like for like."""
    return PipelineExplorer(p=p, m=m, v=v, schedule=schedule, f=f, b=b, w=w)
