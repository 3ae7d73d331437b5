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
                    f"{before} -> {after}\n{s.bytes:,d} B/rank, {s.time * 1e6:.2f} us", "step"))
    if not out:
        out.append(("(nothing to do)", "step"))
    out.append((f"total {plan.total_bytes:,d} B sent per rank\n{plan.total_time * 1e6:.2f} us "
                f"on {plan.profile}", "total"))
    return out


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


def draw_reshard(plan, *, facet_size: float = 2.2, dpi: int = 100, max_facets: int = 8):
    """A Figure of a reshard Plan, left to right: the layout before, each step (its
    collective, the placement and notation edit, bytes and modeled time) and the layout
    it leaves, up to the layout after; the total below."""
    import matplotlib
    stages = _stages(plan)
    lines = _step_lines(plan)
    steps, total = lines[:-1], lines[-1]
    cols = [min(len(lay.facets()), 4) for _, lay in stages]
    rows = max(-(-len(lay.facets()) // c) for (_, lay), c in zip(stages, cols))
    meshes = [i == 0 or lay.mesh != stages[i - 1][1].mesh for i, (_, lay) in enumerate(stages)]
    widths = []
    for i, c in enumerate(cols):
        if i:
            widths.append(1.15)                                  # the step between
        widths.append(c + (0.8 if meshes[i] else 0.1))
    with matplotlib.rc_context(RC):
        fig = _figure(facet_size * sum(widths) + 0.6, facet_size * rows + 1.9, dpi)
        subs = fig.subfigures(1, len(widths), width_ratios=widths)
        for i, (name, lay) in enumerate(stages):
            _draw_layout(subs[2 * i], lay, f"{name}\n{lay.notation}\n"
                         f"{fmt_placements(lay.placements)}", max_facets, mesh_panel=meshes[i])
        for i, (text, gid) in enumerate(steps):
            ax = subs[2 * i + 1].add_subplot(1, 1, 1)
            ax.set_axis_off()
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.annotate("", xy=(0.98, 0.5), xytext=(0.02, 0.5),
                        arrowprops=dict(arrowstyle="-|>", color="#555555", linewidth=1.5))
            ax.text(0.5, 0.56, text, ha="center", va="bottom", fontsize=9, gid=gid,
                    wrap=True)
        fig.suptitle(total[0].replace("\n", ", "), fontsize=10, fontweight="bold", gid="total")
    return fig
