"""Draw memory per rank as stacked bars, and a widget that redraws them for a layout.

Renders numbers only: the bytes come from :mod:`workbench.plan.memory` (ZeRO's model
states, Korthikanti et al. 2022 Table 2 activations, the schedule's in-flight
micro-batches); nothing here computes memory itself.

    >>> from workbench.plan.memory import model_state_bytes
    >>> rows = {f"ZeRO-{z}": model_state_bytes(7.5e9, 64, z) for z in range(4)}
    >>> fig = memory_bars(rows, limit=80e9, title="7.5B on 64 GPUs")    # a Figure
    >>> show(fig)                                                        # doctest: +SKIP

Figures are deterministic (fixed colours and sizes, no pyplot state).  Artists carry
gids for tests: "segment" (one per part of a bar), "limit", "limit_label",
"usable", "usable_label", "total".
"""
from __future__ import annotations

import base64
import html
import math

from .bar_labels import end_label, place_labels
from .placements import PRE_WRAP, RC, show, to_png

__all__ = ["PARTS", "PART_COLORS", "memory_bars", "stage_rows", "memory_widget",
           "MemoryExplorer", "show"]

PARTS = ("params", "grads", "optimizer", "buffers", "comm_buffers", "activations",
         "workspace")
PART_COLORS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c",
               "buffers": "#8c564b", "comm_buffers": "#7f7f7f", "activations": "#9467bd",
               "workspace": "#bcbd22"}
_LABELS = {"params": "16-bit weights", "grads": "16-bit gradients",
           "optimizer": "optimizer states (fp32 weights, m, v)",
           "buffers": "framework buffers (fp32 gradients, ZeRO-3 gathers)",
           "comm_buffers": "NCCL / HCCL buffers",
           "activations": "activations",
           "workspace": "peak workspace (loss, recompute)"}
# The workspace is a transient peak, not memory kept: hatched, and outlined so that a
# sliver (0.25 GB on a 100 GB axis is about one pixel) still shows as a line
_EDGE = {"workspace": dict(edgecolor="#6b6b12", hatch="////", linewidth=0.8)}


def memory_bars(rows: dict, *, limit: float | None = None, limit_label: str = "device memory",
                title: str = "", unit: float = 1e9, unit_name: str = "GB",
                width: float = 7.5, dpi: int = 100, usable: float | None = None):
    """Horizontal stacked bars: ``rows`` maps a bar's label to a dict of bytes with some
    of the keys of :data:`PARTS` (others, e.g. "total", are ignored).  ``limit`` (bytes)
    draws the device's memory as a dashed line; ``usable`` (bytes, at most ``limit``:
    ``Profile.usable_memory()``, what the planner's ``fits`` compares with) a dotted one.
    A bar past ``usable`` (else ``limit``) has its total in red."""
    import matplotlib
    from matplotlib.figure import Figure
    if not rows:
        raise ValueError("memory_bars(rows={}): give {label: {'params': bytes, ...}}")
    for label, parts in rows.items():
        if not isinstance(parts, dict) or not any(p in parts for p in PARTS):
            raise ValueError(f"memory_bars: row {label!r} must be a dict with some of {PARTS}, "
                             f"got {parts!r}")
        for p in PARTS:
            v = parts.get(p, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"memory_bars: row {label!r} {p}={v!r} must be bytes >= 0")
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"memory_bars: limit={limit!r} must be a number of bytes > 0 or None")
    if usable is not None and not (isinstance(usable, (int, float)) and 0 < usable
                                   and (limit is None or usable <= limit)):
        raise ValueError(f"memory_bars: usable={usable!r} must be bytes > 0 and at most "
                         f"limit={limit!r} (the device's memory), or None")
    cap = usable if usable is not None else limit
    totals = {k: sum(d.get(p, 0.0) for p in PARTS) for k, d in rows.items()}
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(width, 1.6 + 0.42 * len(rows)), dpi=dpi, layout="constrained")
        ax = fig.add_subplot(1, 1, 1)
        used = [p for p in PARTS if any(d.get(p, 0.0) > 0 for d in rows.values())]
        ends = []
        for y, (label, parts) in enumerate(rows.items()):
            left = 0.0
            for p in PARTS:
                v = parts.get(p, 0.0) / unit
                if v > 0:
                    ax.barh(y, v, left=left, height=0.65, color=PART_COLORS[p], gid="segment",
                            label=_LABELS[p] if y == _first_row(rows, p) else None,
                            **_EDGE.get(p, {}))
                    left += v
            over = cap is not None and totals[label] > cap
            # a few points right of the bar (or of a line that would cross the number):
            # its white box must not cover the bar's end
            ends.append(end_label(ax, left, y, f"{totals[label] / unit:,.1f} {unit_name}",
                                  fontsize=9, color="#c00000" if over else "#222222",
                                  fontweight="bold" if over else "normal", gid="total",
                                  bbox=dict(facecolor="white", edgecolor="none", pad=0.5,
                                            alpha=0.85)))
        ax.set_yticks(range(len(rows)), list(rows), fontsize=9)
        ax.set_ylim(len(rows) - (0.4 if usable is None else 0.05), -1.05)   # a row for the limit
        hi = max(list(totals.values()) + [limit or 0.0, usable or 0.0]) / unit
        right = hi * 1.35 or 1.0        # room for the totals and the limit label
        ax.set_xlim(0, right)
        fixed, lines = [], [x / unit for x in (limit, usable) if x is not None]
        if limit is not None:
            ax.axvline(limit / unit, color="#333333", linestyle="--", linewidth=1.0, gid="limit")
            # one decimal at most: CUDA's 85.094e9 bytes of an A100 80GB read 85.1 GB
            fixed.append(end_label(ax, limit / unit, -0.7,
                                   f"{limit_label} {round(limit / unit, 1):g} {unit_name}",
                                   fontsize=9, gid="limit_label"))
        usable_label = None
        if usable is not None:
            ax.axvline(usable / unit, color="#333333", linestyle=":", linewidth=1.2,
                       gid="usable")
            usable_label = ax.text(usable / unit, len(rows) - 0.3,
                                   f"usable {usable / unit:.1f} {unit_name} ", ha="right",
                                   va="center", fontsize=8.5, color="#333333",
                                   gid="usable_label")
        ax.set_xlabel(unit_name, fontsize=9)
        ax.tick_params(labelsize=9)
        # at most 3 a row: five entries in one row ran past the figure's edges; fewer
        # where the longest labels make 3 wider than the figure (measured below)
        legend = fig.legend(loc="outside lower center", fontsize=8.5, frameon=False,
                            ncols=min(len(used), 3))
        if title:
            ax.set_title(title, fontsize=10, loc="left")
        ncols = min(len(used), 3)
        while ncols > 1:
            fig.draw_without_rendering()
            if legend.get_window_extent().width <= fig.bbox.width:
                break
            ncols -= 1
            legend.remove()
            legend = fig.legend(loc="outside lower center", fontsize=8.5, frameon=False,
                                ncols=ncols)
        # no line through a total, every label inside the plot (measured on a layout-only
        # draw, legend and title in place): the axis widens where one would not fit
        place_labels(fig, ax, ends, lines, fixed)
        if usable_label is not None:
            _keep_inside(fig, ax, usable_label, max(lines))
    return fig


def _keep_inside(fig, ax, label, right_of: float) -> None:
    """The usable line's label sits left of its line; where the bars run far past the
    device (GPipe, no ZeRO at PP = 1) the line lies near 0 and the label would run left
    out of the axes, over the row names: move it right of the rightmost line, saying
    which line it names."""
    fig.draw_without_rendering()
    if label.get_window_extent().x0 >= ax.bbox.x0:
        return
    label.set_text(f" {label.get_text().strip()} (dotted)")
    label.set_x(right_of)
    label.set_horizontalalignment("left")


def _first_row(rows, part):
    return next(i for i, d in enumerate(rows.values()) if d.get(part, 0.0) > 0)


def stage_rows(model, layout, attention: str = "materialized", profile=None) -> dict:
    """{"stage s (first)": bytes dict, ...}: ``workbench.plan.memory.stage_memory`` of the
    first, the middle (pp // 2) and the last pipeline stage of ``layout`` (one row when
    pp == 1); with the hardware's ``profile``, the communication library's buffers
    too."""
    from ..plan.memory import stage_memory
    pp = layout.pp
    stages = {0: "first", pp // 2: "middle", pp - 1: "last"} if pp > 2 else \
        ({0: "first", 1: "last"} if pp == 2 else {0: "only"})
    return {f"stage {s} ({name})": stage_memory(model, layout, s, attention, profile)
            for s, name in stages.items()}


class MemoryExplorer:
    """Sliders for TP, PP, micro-batch, recompute and ZeRO (and a schedule, SP) of
    ``model`` on ``devices`` devices of ``profile``; redraws the stacked bars of the
    first, the middle and the last stage against the device memory.

    The bars are an image widget replaced in place on every change; the text below says
    the layout, the busiest rank and whether it fits, or why a choice is not a layout.
    Sequence parallelism is greyed out at TP = 1.  (The schedule still matters at
    PP = 1: it is the order of gradient accumulation, GPipe holding every micro-batch.)
    Where no widget front end runs (nbval, nbconvert) its display data carries a PNG."""

    def __init__(self, model, devices=1024, profile="a100", global_batch=1536, tp=8, pp=16,
                 micro_batch=1, recompute="none", zero=0, sp=False, schedule="1f1b",
                 dpi: int = 100):
        try:
            import ipywidgets as widgets
        except ImportError:
            raise ImportError("memory_widget needs ipywidgets (pip install 'workbench[course]'); "
                              "memory_bars(stage_rows(...)) draws the static figure") from None
        from ..plan.layout import Cluster
        self.model, self.cluster, self.dpi = model, Cluster(profile, devices), dpi
        self.global_batch = global_batch
        pow2 = [2 ** i for i in range(11) if 2 ** i <= devices]
        style = dict(continuous_update=False, style={"description_width": "initial"},
                     layout=widgets.Layout(width="340px"))   # room for "selective", "1024"
        self.controls = {
            "tp": widgets.SelectionSlider(options=pow2, value=tp, description="TP", **style),
            "pp": widgets.SelectionSlider(options=pow2, value=pp, description="PP", **style),
            "micro_batch": widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=micro_batch,
                                                   description="micro-batch", **style),
            "recompute": widgets.SelectionSlider(options=["none", "selective", "full"],
                                                 value=recompute, description="recompute",
                                                 **style),
            "zero": widgets.IntSlider(value=zero, min=0, max=3, description="ZeRO", **style),
            "schedule": widgets.Dropdown(options=["1f1b", "gpipe"], value=schedule,
                                         description="schedule",
                                         style={"description_width": "initial"}),
            "sp": widgets.Checkbox(value=sp, description="sequence parallel"),
        }
        c = self.controls
        self.image = widgets.Image(format="png",                 # at its own size, not stretched
                                   layout=widgets.Layout(align_self="flex-start", max_width="100%"))
        self.status = widgets.HTML()
        self.box = widgets.VBox([widgets.HBox([c["tp"], c["pp"]]),
                                 widgets.HBox([c["micro_batch"], c["recompute"]]),
                                 widgets.HBox([c["zero"], c["schedule"], c["sp"]]),
                                 self.image, self.status])
        self.figure, self.rows, self.message = None, None, ""
        for w in c.values():
            w.observe(lambda change: self.redraw(), names="value")
        self.redraw()

    def layout(self):
        """The :class:`~workbench.plan.Layout` the controls describe (ValueError if none)."""
        from ..plan.layout import Layout, check_layout
        c = {k: w.value for k, w in self.controls.items()}
        n = self.cluster.devices
        if c["tp"] * c["pp"] > n:
            raise ValueError(f"TP x PP = {c['tp']} x {c['pp']} = {c['tp'] * c['pp']} is more "
                             f"than the {n} devices: lower TP or PP")
        if n % (c["tp"] * c["pp"]):
            raise ValueError(f"TP x PP = {c['tp'] * c['pp']} does not divide the {n} devices")
        self._check_batch(c["tp"] * c["pp"], c["micro_batch"])
        lay = Layout(dp=n // (c["tp"] * c["pp"]), tp=c["tp"], pp=c["pp"], sp=c["sp"] and
                     c["tp"] > 1, zero=c["zero"], recompute=c["recompute"],
                     micro_batch=c["micro_batch"], global_batch=self.global_batch,
                     schedule=c["schedule"])
        check_layout(self.model, lay, self.cluster)
        return lay

    def _check_batch(self, model_parallel: int, micro_batch: int) -> None:
        """Say, in the sliders' terms, when dp x micro-batch does not divide the global
        batch (``Layout`` would say it in its own fields, global_batch and dp, which the
        widget does not offer)."""
        n, gb = self.cluster.devices, self.global_batch
        dp = n // model_parallel
        if gb % (micro_batch * dp) == 0:
            return
        head = (f"dp x micro-batch = {dp} x {micro_batch} = {dp * micro_batch} does not divide "
                f"the global batch of {gb} sequences (dp = {n} devices / (TP x PP))")
        if gb % dp == 0:
            fits = [o for o in self.controls["micro_batch"].options if (gb // dp) % o == 0]
            raise ValueError(f"{head}: lower the micro-batch to one dividing {gb} / {dp} = "
                             f"{gb // dp} ({', '.join(map(str, fits))})")
        # dp does not divide the batch: no micro-batch helps, a larger TP x PP does
        ks = [k for k in (2 ** i for i in range(1, 21))        # TP x PP on the sliders
              if model_parallel < k <= n and n % k == 0 and gb % (micro_batch * (n // k)) == 0]
        raise ValueError(f"{head}: raise TP x PP to at least {ks[0]} (dp = {n // ks[0]}, "
                         f"dp x micro-batch = {micro_batch * (n // ks[0])} divides {gb})"
                         if ks else f"{head}: no TP x PP of the sliders gives a dp dividing "
                         f"{gb}; build the widget with another global_batch")

    def redraw(self) -> None:
        """Read the controls, ask the planner for each stage's bytes, replace the image."""
        limit, usable = self.cluster.memory_bytes, self.cluster.profile.usable_memory()
        # greyed out where it changes nothing: SP splits over the TP group (the layout drops it)
        self.controls["sp"].disabled = self.controls["tp"].value == 1
        try:
            lay = self.layout()
            self.rows = stage_rows(self.model, lay, profile=self.cluster.profile)
            busiest = max(self.rows, key=lambda k: self.rows[k]["total"])
            total = self.rows[busiest]["total"]
            self.message = (f"{lay.short()} (m = {lay.m} micro-batches): busiest {busiest}\n"
                            f"{total / 1e9:.1f} GB of the {usable / 1e9:.1f} GB usable "
                            f"({round(limit / 1e9, 1):g} GB device): "
                            f"{'fits' if total <= usable else 'does NOT fit'}")
            self.figure = memory_bars(self.rows, limit=limit, usable=usable, dpi=self.dpi,
                                      title=f"{self.cluster.profile.name}: {lay.short()}")
        except ValueError as err:        # not a layout of this model: say why, keep the page
            self.figure, self.rows, self.message = None, None, str(err)
        if self.figure is not None:
            self.image.value = to_png(self.figure)
        self.image.layout.visibility = "visible" if self.figure is not None else "hidden"
        # wrapped at spaces: a message that is no layout runs to about 180 characters
        self.status.value = f"<pre{PRE_WRAP}>{html.escape(self.message)}</pre>"

    def _repr_mimebundle_(self, **kwargs):
        bundle = dict(self.box._repr_mimebundle_(**kwargs))
        if self.figure is not None:
            bundle["image/png"] = base64.b64encode(to_png(self.figure)).decode("ascii")
        bundle["text/plain"] = self.message
        return bundle


def memory_widget(model, devices=1024, profile="a100", global_batch=1536, **start):
    """A :class:`MemoryExplorer` (needs ipywidgets); ``start``: tp, pp, micro_batch,
    recompute, zero, sp, schedule to begin with."""
    return MemoryExplorer(model, devices, profile, global_batch, **start)
