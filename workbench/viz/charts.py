"""Small charts for the notebooks: bars, lines and the roofline.  They draw numbers the
caller computed (formulas, the cost model, a trace) and compute none themselves, except
the roofline's two lines, which are the profile's own peak and bandwidth.

    >>> fig = lines([1, 2, 4], {"ring": [1.0, 2.0, 3.0]}, xlabel="p", ylabel="us")
    >>> show(fig)                     # PNG only in a notebook  # doctest: +SKIP

Deterministic, as the other figures: fixed colours and sizes, no pyplot state.  Artists
carry gids for tests: "bar", "value" (a bar's number), "line", "reference", "hline",
"hline_label", "point", "roof".
"""
from __future__ import annotations

import math

from .bar_labels import end_label, place_labels
from .placements import RC, show, to_png
from .ticks import log_axis, point_ticks

__all__ = ["SERIES_COLORS", "TILE_COLORS", "bars", "lines", "roofline", "tile_grid", "show",
           "to_png"]

# matplotlib's tab10, in its order: a series keeps its colour across charts
SERIES_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf")


ROOF_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"))   # per profile: line, marker
# a tile plan's kinds: computed whole, computed with the element-wise mask, skipped
TILE_COLORS = {"full": "#3a78b5", "partial": "#9ecae1", "skip": "#f0f0f0"}


def _figure(width, height, dpi):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), dpi=dpi, layout="constrained")


def _finite(name, values):
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}: every value must be a finite number, got {v!r}")


def _value(v: float) -> str:
    """A bar's number: whole above 100 (2,794), else 3 significant digits, keeping a
    rounded-away zero (15.996 s is "16.0", not "16", which reads as exact beside "15.4")
    but adding none to a number given exactly (70 tokens, a paper's 1.9 GB)."""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    text = f"{v:.3g}"
    return text if float(text) == v else f"{v:#.3g}"


def bars(groups: dict, *, unit: str = "", title: str = "", hline=None, log: bool = False,
         width: float = 7.5, dpi: int = 100):
    """Horizontal bars, one panel row per group: ``groups`` maps a group title to
    {label: value}.  ``hline`` = (value, label) draws a reference line (e.g. a device's
    memory), labelled in a row of its own above the bars; ``log`` a log axis.  Each bar is
    labelled with its value, right of the bar or, where the reference line would run
    through the number, right of the line (:mod:`.bar_labels`); the legend sits below
    the plot, where it covers nothing."""
    import matplotlib
    if not groups:
        raise ValueError("bars(groups={}): give at least one group {title: {label: value}}")
    rows = [(g, k, v) for g, d in groups.items() for k, v in d.items()]
    _finite("bars", [v for _, _, v in rows])
    if log and any(v <= 0 for _, _, v in rows):
        raise ValueError("bars(log=True): every value must be > 0 on a log axis")
    top = -1.3 if hline is not None else -0.8          # a row above the bars for its label
    ncols = 2 if len(groups) > 1 and max(map(len, groups)) <= 40 else 1
    with matplotlib.rc_context(RC):
        fig = _figure(width, 0.8 + 0.32 * len(rows) + 0.3 * len(groups)     # + the legend's
                      + (0.16 if hline is not None else 0) + 0.2 * -(-len(groups) // ncols), dpi)
        ax = fig.add_subplot(1, 1, 1)
        y, ticks, labels, ends = 0.0, [], [], []
        for gi, (g, d) in enumerate(groups.items()):
            color = SERIES_COLORS[gi % len(SERIES_COLORS)]
            for k, v in d.items():
                ax.barh(y, v, color=color, height=0.7, gid="bar",
                        label=g if k == next(iter(d)) else None)
                ends.append(end_label(ax, v, y, f"{_value(v)} {unit}".strip(), fontsize=9,
                                      gid="value"))
                ticks.append(y)
                labels.append(k)
                y += 1
            y += 0.5
        ax.set_yticks(ticks, labels, fontsize=9)
        ax.set_ylim(y - 0.5, top)
        if log:
            ax.set_xscale("log")
            log_axis(ax.xaxis, 10)
        fixed = []
        if hline is not None:
            value, text = hline
            ax.axvline(value, color="#333333", linestyle="--", linewidth=1.0, gid="hline")
            fixed.append(end_label(ax, value, (top - 0.35) / 2, text, fontsize=9,
                                   gid="hline_label"))
        hi = max(v for _, _, v in rows + [("", "", hline[0] if hline else 0)])
        ax.set_xlim(right=hi * (8 if log else 1.3))
        ax.set_xlabel(unit, fontsize=9)
        fig.legend(loc="outside lower center", fontsize=9, frameon=False, ncols=ncols)
        if title:
            ax.set_title(title, fontsize=10)
        place_labels(fig, ax, ends, [hline[0]] if hline is not None else [], fixed)
    return fig


def lines(x, series: dict, *, xlabel: str = "", ylabel: str = "", title: str = "",
          logx: bool = False, logy: bool = False, hlines=(), markers: bool = True,
          reference: dict | None = None, width: float = 7.0, height: float = 3.6,
          dpi: int = 100):
    """One line per entry of ``series`` ({label: y values}, same length as ``x``);
    ``hlines``: (value, label) reference lines.

    ``reference`` pairs a series with what it is held to ({series label: (label, y
    values)}, e.g. a formula beside a measurement): drawn dashed, without markers, in its
    series' colour and beneath it, so that a measured line lying on its formula stays
    visible (its markers on the dashes) and each pair reads as one colour."""
    import matplotlib
    x = list(x)
    reference = dict(reference or {})
    _finite("lines x", x)
    for k, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"lines: series {k!r} has {len(ys)} values for {len(x)} x values")
        _finite(f"lines series {k!r}", ys)
    for k, pair in reference.items():
        if k not in series:
            raise ValueError(f"lines: reference[{k!r}] names no series; the series are "
                             f"{list(series)}")
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"lines: reference[{k!r}] must be (label, y values), got {pair!r}")
        if len(pair[1]) != len(x):
            raise ValueError(f"lines: reference {pair[0]!r} has {len(pair[1])} values for "
                             f"{len(x)} x values")
        _finite(f"lines reference {pair[0]!r}", pair[1])
    with matplotlib.rc_context(RC):
        fig = _figure(width, height, dpi)
        ax = fig.add_subplot(1, 1, 1)
        for i, (k, ys) in enumerate(series.items()):
            color = SERIES_COLORS[i % len(SERIES_COLORS)]
            ax.plot(x, ys, marker="o" if markers else None, markersize=3.5, linewidth=1.5,
                    color=color, label=k, gid="line", zorder=3)
            if k in reference:
                label, ref = reference[k]
                ax.plot(x, ref, linestyle="--", linewidth=2.2, alpha=0.55, color=color,
                        label=label, gid="reference", zorder=2)
        for j, (value, text) in enumerate(hlines):
            ax.axhline(value, color="#555555", linestyle="--", linewidth=0.9, gid="hline")
            ax.text(x[0], value, f" {text}", va="bottom", ha="left", fontsize=9)
        if logx:
            ax.set_xscale("log", base=2)
            log_axis(ax.xaxis, 2)
            point_ticks(ax.xaxis, x)            # each label under its points, not between
        if logy:
            ax.set_yscale("log")
            log_axis(ax.yaxis, 10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.tick_params(labelsize=9)
        ax.grid(True, linewidth=0.4, alpha=0.5)
        if series:
            ax.legend(fontsize=9, frameon=False)
        if title:
            ax.set_title(title, fontsize=10)
    return fig


def roofline(profiles, points: dict, *, dtype: str = "bfloat16", width: float = 7.0,
             height: float = 3.8, dpi: int = 100):
    """The roofline of each profile, attainable FLOP/s = min(peak, intensity x memory
    bandwidth), with ``points`` ({label: {"flops": F, "bytes_moved": B}}) placed at their
    arithmetic intensity F / B on every profile's roof."""
    import matplotlib
    import numpy as np
    from matplotlib.lines import Line2D
    if not points:
        raise ValueError("roofline(points={}): give {label: {'flops': F, 'bytes_moved': B}}")
    for k, w in points.items():
        if not (w.get("flops", 0) > 0 and w.get("bytes_moved", 0) > 0):
            raise ValueError(f"roofline: point {k!r} needs flops > 0 and bytes_moved > 0, "
                             f"got {w!r}")
    inten = {k: w["flops"] / w["bytes_moved"] for k, w in points.items()}
    lo, hi = min(inten.values()) / 4, max(inten.values()) * 4
    xs = np.geomspace(min(lo, 1.0), max(hi, 1e3), 200)
    with matplotlib.rc_context(RC):
        fig = _figure(width, height, dpi)
        ax = fig.add_subplot(1, 1, 1)
        # profiles with about the same peak (910B 313, A100 312 TFLOP/s) share a roof: a
        # line style and a marker per profile (the later ones hollow and larger) keep each
        # roof and each point visible where they coincide
        handles = []
        for i, prof in enumerate(profiles):
            peak, bw = prof.peak(dtype), prof.memory_bandwidth
            c = SERIES_COLORS[i % len(SERIES_COLORS)]
            style, marker = ROOF_STYLES[i % len(ROOF_STYLES)]
            ax.plot(xs, np.minimum(peak, xs * bw) / 1e12, color=c, linewidth=1.5,
                    linestyle=style, gid="roof")
            handles.append(Line2D([], [], color=c, linewidth=1.5, linestyle=style,
                                  marker=marker, markerfacecolor=c if i == 0 else "none",
                                  label=f"{prof.name}: {peak / 1e12:g} TFLOP/s, "
                                        f"{bw / 1e12:g} TB/s"))
            for k, x in inten.items():
                ax.plot([x], [min(peak, x * bw) / 1e12], marker, color=c,
                        markersize=5 + 2 * i, markerfacecolor=c if i == 0 else "none",
                        markeredgewidth=1.3, gid="point")
        for n, (k, x) in enumerate(sorted(inten.items(), key=lambda kv: kv[1])):
            ax.axvline(x, color="#999999", linewidth=0.7, linestyle=":")
            value = f"{x:,.0f}" if x >= 100 else f"{x:.3g}"          # 2,730, not 2.73e+03
            # in the right quarter a label runs left of its line, so the frame never cuts it
            right = np.log(x / xs[0]) / np.log(xs[-1] / xs[0]) > 0.75
            text = f"{k} \n{value} FLOP/B " if right else f" {k}\n {value} FLOP/B"
            ax.text(x, 0.02 + 0.14 * (n % 3), text, ha="right" if right else "left",
                    transform=ax.get_xaxis_transform(), fontsize=9, va="bottom")  # staggered
        ax.set_xscale("log")
        ax.set_yscale("log")
        log_axis(ax.xaxis, 10)
        log_axis(ax.yaxis, 10)
        ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)", fontsize=9)
        ax.set_ylabel(f"attainable TFLOP/s ({dtype})", fontsize=9)
        ax.tick_params(labelsize=9)
        ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
        ax.legend(handles=handles, fontsize=8.5, frameon=False, loc="upper left")
        ax.set_title("roofline: below the slope memory-bound, on the flat roof compute-bound",
                     fontsize=10)
    return fig


def tile_grid(plans: dict, *, size: float = 2.6, dpi: int = 100):
    """Side by side, the tile plan of each entry of ``plans`` ({title: TilePlan}): query
    tiles down, key tiles across, each square coloured by its kind (``plan.kinds``:
    "full", "partial", "skip"), with the counts in the title."""
    import matplotlib
    from matplotlib.patches import Patch, Rectangle
    if not plans:
        raise ValueError("tile_grid(plans={}): give {title: TilePlan}")
    with matplotlib.rc_context(RC):
        fig = _figure(size * len(plans) + 0.4, size + 0.9, dpi)
        axes = fig.subplots(1, len(plans), squeeze=False)[0]
        for ax, (title, plan) in zip(axes, plans.items()):
            for i, row in enumerate(plan.kinds):
                for j, kind in enumerate(row):
                    if kind not in TILE_COLORS:
                        raise ValueError(f"tile_grid: unknown tile kind {kind!r}")
                    ax.add_patch(Rectangle((j, i), 1, 1, facecolor=TILE_COLORS[kind],
                                           edgecolor="white", linewidth=1.0, gid="tile"))
            nq, nk = len(plan.kinds), len(plan.kinds[0]) if plan.kinds else 0
            ax.set_xlim(0, nk)
            ax.set_ylim(nq, 0)
            ax.set_aspect("equal")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel("key tiles", fontsize=9)
            ax.set_ylabel("query tiles", fontsize=9)
            done = sum(k != "skip" for row in plan.kinds for k in row)
            ax.set_title(f"{title}\n{done} of {nq * nk} tiles computed", fontsize=9)
        fig.legend(handles=[Patch(color=c, label=k) for k, c in TILE_COLORS.items()],
                   loc="lower center", ncols=3, frameon=False, fontsize=9)
    return fig
