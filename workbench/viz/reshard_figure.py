"""Draw a reshard Plan: the layout before, after each of its steps, and after; as a
figure or as text.  Renders data only (the plan comes from ``plan_reshard``, each
layout from :func:`workbench.viz.placements.placement_layout`).
"""
from __future__ import annotations

from ..parallel.dist_tensor import notation as _notation
from ..parallel.placement import fmt_placements
from .placements import RC, _draw_layout, _figure, placement_layout, render_text

__all__ = ["draw_reshard", "render_reshard_text"]


def _step_lines(plan) -> list:
    """[(text, gid)] for each step of a plan, then its total."""
    out = []
    for k, s in enumerate(plan.steps, 1):
        # same-mesh steps run on the source mesh; send/recv lands on the target mesh
        after_mesh = plan.dst_mesh if s.kind == "send_recv" else plan.src_mesh
        before = _notation(plan.shape, plan.src_mesh, s.src, plan.dtype)
        after = _notation(plan.shape, after_mesh, s.dst, plan.dtype)
        where = f" on {s.mesh_dim_name}" if s.mesh_dim_name else (f" ({s.note})" if s.note else "")
        out.append((f"{k}. {s.kind}{where}\n{fmt_placements(s.src)} -> {fmt_placements(s.dst)}\n"
                    f"{before} -> {after}\n{s.bytes:,d} "
                    f"{'B/rank' if not s.note.startswith('busiest rank') else 'B, ' + s.note}"
                    f", {s.time * 1e6:.2f} us", "step"))
    if not out:
        out.append(("(nothing to do)", "step"))
    out.append((f"total {plan.total_bytes:,d} B {plan.total_label()}\n{plan.total_time * 1e6:.2f} us "
                f"on {plan.profile}", "total"))
    return out


def _fit(text: str, chars: int) -> str:
    """``text`` with each line longer than ``chars`` broken before its " -> "."""
    out = []
    for line in text.split("\n"):
        if len(line) > chars and " -> " in line:
            head, tail = line.split(" -> ", 1)
            out += [head, "-> " + tail]
        else:
            out.append(line)
    return "\n".join(out)


def render_reshard_text(plan) -> str:
    """Before, the plan's steps, after: a terminal picture of a reshard Plan."""
    before = placement_layout(plan.shape, plan.src_mesh, plan.src, plan.dtype)
    after = placement_layout(plan.shape, plan.dst_mesh, plan.dst, plan.dtype)
    mid = ["", *("  " + ln for ln in str(plan).splitlines()), ""]
    return "\n".join(["before: " + render_text(before), *mid, "after:  " + render_text(after)])


def _stages(plan) -> list:
    """[(title, Layout)]: the layout before, then after each step of the plan."""
    before = placement_layout(plan.shape, plan.src_mesh, plan.src, plan.dtype)
    out = [("before", before)]
    for k, s in enumerate(plan.steps, 1):
        mesh = plan.dst_mesh if s.kind == "send_recv" else plan.src_mesh
        last = k == len(plan.steps)
        out.append(("after" if last else f"after step {k}",
                    placement_layout(plan.shape, mesh, s.dst, plan.dtype)))
    if not plan.steps:
        out.append(("after", placement_layout(plan.shape, plan.dst_mesh, plan.dst, plan.dtype)))
    return out


def draw_reshard(plan, *, facet_size: float = 1.8, dpi: int = 100, max_facets: int = 8,
                 max_width: float = 8.2):
    """A Figure of a reshard Plan, left to right: the layout before, each step (its
    collective, the placement and notation edit, bytes and modeled time) and the layout
    it leaves, up to the layout after; the total above.

    A row is at most ``max_width`` inches wide (8.2: about 820 px, what a JupyterLab
    output shows unscaled in a 1280 px window with the file browser open); longer plans go
    on in the next row, which then starts with its step's arrow.  (One row of 14-16 inches
    was shown at 55% in JupyterLab: its 9 pt text read as 5 pt.)"""
    import matplotlib
    stages = _stages(plan)
    lines = _step_lines(plan)
    steps, total = lines[:-1], lines[-1]
    cols = [min(len(lay.facets()), 4) for _, lay in stages]
    frows = max(-(-len(lay.facets()) // c) for (_, lay), c in zip(stages, cols))
    meshes = [i == 0 or lay.mesh != stages[i - 1][1].mesh for i, (_, lay) in enumerate(stages)]
    items = []                                         # (kind, index, width in facets)
    for i, c in enumerate(cols):
        if i:
            items.append(("step", i - 1, 1.15))        # the step between
        items.append(("layout", i, c + (0.8 if meshes[i] else 0.1)))
    rows, row, used = [], [], 0.0                      # greedy: fill a row, then wrap
    for it in items:
        if row and facet_size * (used + it[2]) + 0.6 > max_width:
            rows.append(row)
            row, used = [], 0.0
        row.append(it)
        used += it[2]
    rows.append(row)
    units = max(sum(it[2] for it in r) for r in rows)
    with matplotlib.rc_context(RC):
        fig = _figure(facet_size * units + 0.6, (facet_size * frows + 1.7) * len(rows) + 0.3, dpi)
        for r, rowfig in zip(rows, fig.subfigures(len(rows), 1, squeeze=False)[:, 0]):
            widths = [it[2] for it in r]
            if sum(widths) < units - 1e-9:
                widths.append(units - sum(widths))     # blank: the same scale in every row
            subs = rowfig.subfigures(1, len(widths), width_ratios=widths, squeeze=False)[0]
            for sub, (kind, i, _) in zip(subs, r):
                if kind == "layout":
                    name, lay = stages[i]
                    _draw_layout(sub, lay, f"{name}\n{lay.notation}\n"
                                 f"{fmt_placements(lay.placements)}", max_facets,
                                 mesh_panel=meshes[i])
                    continue
                text, gid = steps[i]
                ax = sub.add_subplot(1, 1, 1)
                ax.set_axis_off()
                ax.set_xlim(0, 1)
                ax.set_ylim(0, 1)
                ax.annotate("", xy=(0.98, 0.5), xytext=(0.02, 0.5),
                            arrowprops=dict(arrowstyle="-|>", color="#555555", linewidth=1.5))
                # a line wider than the step's column breaks before its arrow (about
                # 0.55 em a character at 9 pt): clipped, it also squeezed the arrow
                chars = int(1.15 * facet_size * 72 / (9 * 0.55))
                ax.text(0.5, 0.56, _fit(text, chars), ha="center", va="bottom", fontsize=9,
                        gid=gid)
        fig.suptitle(total[0].replace("\n", ", "), fontsize=10, fontweight="bold", gid="total")
    return fig
