"""Draw how a tensor lies on a mesh: its blocks coloured by device, as a figure or as text.

Renders data only.  First the shard boxes are computed from
:func:`workbench.parallel.layout.shard_bounds` (the runtime's own offset
function, as PyTorch DTensor's visualizer does), then they are drawn.  Everything
works from (shape, mesh, placements) alone, so it draws what has not been
computed::

    >>> mesh = Mesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    >>> print(render_text((4, 3), mesh, [Shard(0), Shard(1)]))
    f32[I_x, J_y]  shape (4, 3)  [S(0), S(1)]  mesh x=2, y=3
          0:1 1:2 2:3
      0:2   0   1   2
      2:4   3   4   5
    >>> fig = draw_placements(TensorSpec((10, 4), Mesh.grid(4), ["S(0)"]))   # uneven 3,3,3,1
    >>> show(fig)        # in a notebook: PNG only, no text  # doctest: +SKIP

How a block reads: ``3`` one rank holds it, in its colour; ``copies: 0,1`` copies
(Replicate) on ranks 0 and 1, the whole block grey with a dot per copy; ``sum 0+2``
parts of one value (Partial: the tensor is their sum), white and hatched.  (The text
rendering writes ``0,1`` and ``0+2``.)
Tensors of rank > 2 are drawn as facets, one per block of their leading dims.

Figures are deterministic: one fixed colour per rank, fixed fonts and sizes, no
pyplot state (``matplotlib.figure.Figure``).  Artists carry gids for tests and
tools: "block" (one rectangle per block, at its true position and size), "copy"
(one dot per holding rank of a shared block), "label", "mesh-rank", "step", "total".
"""
from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass

from ..parallel import layout as _layout
from ..parallel.dist_tensor import notation as _notation
from ..parallel.placement import Partial, fmt_placements, normalize_placements

__all__ = ["RANK_COLORS", "Box", "Block", "Layout", "placement_layout", "render_text",
           "draw_placements", "render_reshard_text", "draw_reshard", "to_png", "show", "rank_color"]

# One fixed colour per rank (ColorBrewer Set3, then the light half of tab20); rank r
# gets RANK_COLORS[r % 20].  Light enough for black labels.
RANK_COLORS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5",
               "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f", "#ffffb3", "#aec7e8", "#ffbb78",
               "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d")
RC = {"font.family": "DejaVu Sans", "font.size": 9, "hatch.linewidth": 0.8,
      "svg.hashsalt": "workbench"}
HATCH = "///"
COPY_FACE = "#e6e6e6"       # Replicate: one grey block, the copies listed and dotted
PARTIAL_FACE = "#ffffff"    # Partial: white, hatched
MAX_LABEL_GROUPS = 6
MAX_DOTS = 16


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


# ---- data: boxes from the runtime's offset function ------------------------------------------

@dataclass(frozen=True)
class Box:
    """One rank's shard: its mesh coordinate and, per tensor dim, (start, size)."""
    rank: int
    coord: tuple
    bounds: tuple

    @property
    def empty(self) -> bool:
        return any(n == 0 for _, n in self.bounds)


@dataclass(frozen=True)
class Block:
    """A region of the tensor and the ranks holding it.  ``groups``: the ranks of one
    group hold parts of one value (Partial, summed); different groups are copies."""
    bounds: tuple
    groups: tuple
    partial: tuple          # e.g. ("dp",) or ("dp(max)",): mesh dims the parts reduce over

    @property
    def ranks(self) -> tuple:
        return tuple(r for g in self.groups for r in g)

    @property
    def label(self) -> str:
        parts = ["+".join(map(str, g)) for g in self.groups]
        if len(parts) > MAX_LABEL_GROUPS:
            parts = parts[:MAX_LABEL_GROUPS - 1] + [f"..(+{len(parts) - MAX_LABEL_GROUPS + 1})"]
        return ",".join(parts)


@dataclass(frozen=True)
class Layout:
    """Everything the renderers draw, computed from (shape, mesh, placements)."""
    shape: tuple
    mesh: object
    placements: tuple
    notation: str
    boxes: tuple            # one Box per rank, mesh order
    blocks: tuple           # distinct non-empty regions, in order of first holder
    cuts: tuple             # per tensor dim, the sorted block boundaries

    @property
    def empty_ranks(self) -> tuple:
        return tuple(b.rank for b in self.boxes if b.empty)

    def facets(self) -> list:
        """[(index text, blocks)]: one facet per block of the dims before the last two."""
        lead = len(self.shape) - 2
        if lead <= 0:
            return [("", list(self.blocks))]
        segs = [list(zip(c[:-1], c[1:])) for c in self.cuts[:lead]]
        out = []
        for key in itertools.product(*segs):
            inside = [b for b in self.blocks
                      if all(s <= k0 and k1 <= s + n for (s, n), (k0, k1) in zip(b.bounds, key))]
            idx = ", ".join(f"{a}:{b}" if b - a > 1 else str(a) for a, b in key)
            out.append((f"[{idx}, :, :]", inside))
        return out


def placement_layout(x, mesh=None, placements=None, dtype=None) -> Layout:
    """The shard boxes and blocks of ``x``: a DistTensor or TensorSpec, or a shape with
    ``mesh`` and ``placements``."""
    import torch
    if hasattr(x, "placements") and hasattr(x, "mesh"):
        shape, mesh, ps, dtype = tuple(x.shape), x.mesh, tuple(x.placements), x.dtype
    else:
        if mesh is None or placements is None:
            raise ValueError(f"placement_layout(x={x!r}): give a DistTensor or TensorSpec, or a "
                             "shape with mesh= and placements=, e.g. ((8, 6), mesh, ['S(0)', 'R'])")
        shape = tuple(x)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
            raise ValueError(f"shape={x!r}: every dim must be an int >= 0")
        ps = normalize_placements(placements, mesh, len(shape))
    dtype = torch.float32 if dtype is None else dtype
    boxes = tuple(Box(r, mesh.coordinate(r), _layout.shard_bounds(shape, mesh, ps, r))
                  for r in mesh.ranks)
    pdims = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    pnames = tuple(mesh.dim_names[i] + ("" if ps[i].reduce_op == "sum" else f"({ps[i].reduce_op})")
                   for i in pdims)
    regions: dict = {}
    for b in boxes:
        if not b.empty:
            regions.setdefault(b.bounds, []).append(b)
    blocks = []
    for bounds, holders in regions.items():
        groups: dict = {}       # ranks that differ only along Partial dims form one group
        for b in holders:
            key = tuple(c for i, c in enumerate(b.coord) if i not in pdims)
            groups.setdefault(key, []).append(b.rank)
        blocks.append(Block(bounds, tuple(tuple(g) for g in groups.values()),
                            pnames if pdims else ()))
    cuts = tuple(tuple(sorted({0, n} | {s for bl in blocks for s in (bl.bounds[d][0],
                                                                      sum(bl.bounds[d]))}))
                 for d, n in enumerate(shape))
    return Layout(shape, mesh, ps, _notation(shape, mesh, ps, dtype), boxes, tuple(blocks), cuts)


def _grid(lay: Layout, bounds) -> tuple:
    """(row start, rows, col start, cols) of a block in the drawn 2-d grid."""
    nd = len(lay.shape)
    if nd == 0:
        return 0, 1, 0, 1
    if nd == 1:
        return 0, 1, bounds[0][0], bounds[0][1]
    return bounds[-2][0], bounds[-2][1], bounds[-1][0], bounds[-1][1]


def _grid_cuts(lay: Layout) -> tuple:
    nd = len(lay.shape)
    if nd == 0:
        return (0, 1), (0, 1)
    if nd == 1:
        return (0, 1), lay.cuts[0]
    return lay.cuts[-2], lay.cuts[-1]


def _header(lay: Layout) -> str:
    dims = ", ".join(f"{n}={s}" for n, s in zip(lay.mesh.dim_names, lay.mesh.shape))
    return f"{lay.notation}  shape {lay.shape}  {fmt_placements(lay.placements)}  mesh {dims}"


def _legend(lay: Layout) -> list:
    out = []
    along = ", ".join(n for n, p in zip(lay.mesh.dim_names, lay.placements) if p.is_replicate())
    partial = lay.blocks[0].partial if lay.blocks else ()
    if any(len(b.groups) > 1 for b in lay.blocks):
        out.append("copies a,b: same values on a and b" + (f", along {along}" if along else "")
                   + " (Replicate)")
    if partial:
        out.append(f"sum a+b: parts of one value, reduced over {', '.join(partial)} (Partial)"
                   + (f"; the sums are copies along {along}" if along else ""))
    if lay.empty_ranks:
        out.append(f"empty shard: rank{'s' if len(lay.empty_ranks) > 1 else ''} "
                   f"{', '.join(map(str, lay.empty_ranks))} (torch.chunk ran out)")
    return out


# ---- text ---------------------------------------------------------------------------------

def _text_grid(lay: Layout, blocks) -> list:
    rcuts, ccuts = _grid_cuts(lay)
    rsegs, csegs = list(zip(rcuts[:-1], rcuts[1:])), list(zip(ccuts[:-1], ccuts[1:]))
    if not rsegs or not csegs:
        return ["  (no elements)"]
    ri, ci = {v: i for i, v in enumerate(rcuts)}, {v: i for i, v in enumerate(ccuts)}
    cells = [["."] * len(csegs) for _ in rsegs]
    for b in blocks:                            # each block covers whole segments
        r0, rh, c0, cw = _grid(lay, b.bounds)
        for i in range(ri[r0], ri[r0 + rh]):
            for j in range(ci[c0], ci[c0 + cw]):
                cells[i][j] = b.label
    rlab = [f"{a}:{b}" for a, b in rsegs] if len(lay.shape) >= 2 else [""]
    clab = [f"{a}:{b}" for a, b in csegs]
    if len(lay.shape) == 0:
        clab = ["()"]
    w = max([len(s) for s in clab] + [len(s) for row in cells for s in row])
    lw = max(len(s) for s in rlab)
    lines = [" " * (lw + 2) + "".join(f" {s:>{w}}" for s in clab)]
    for lab, row in zip(rlab, cells):
        lines.append(f"  {lab:>{lw}}" + "".join(f" {s:>{w}}" for s in row))
    return [ln.rstrip() for ln in lines]


def render_text(x, mesh=None, placements=None, *, max_facets: int = 64) -> str:
    """A terminal picture: the grid of blocks (row and column ranges) with the ranks
    holding each (``0,1`` copies, ``0+2`` partial parts); facets for rank > 2."""
    lay = x if isinstance(x, Layout) else placement_layout(x, mesh, placements)
    facets = lay.facets()
    _check_facets(len(facets), max_facets)
    lines = [_header(lay)]
    for idx, blocks in facets:
        if idx:
            lines.append(f" {idx}")
        lines += _text_grid(lay, blocks)
    return "\n".join(lines + _legend(lay))


def _check_facets(n, max_facets):
    if n > max_facets:
        raise ValueError(f"{n} facets (one per block of the leading dims) exceed "
                         f"max_facets={max_facets}: pass a larger max_facets or draw a "
                         "lower-rank view of the tensor")


# ---- figures ------------------------------------------------------------------------------

def _block_text(b: Block) -> str:
    """The label drawn in a block: the rank, "copies: 0,1" (Replicate), "sum 0+2" (Partial)."""
    if b.partial:
        return "sum\n" + b.label
    if len(b.groups) > 1:
        return "copies\n" + b.label
    return b.label


def _draw_blocks(ax, lay: Layout, blocks, title: str) -> None:
    """One rectangle per block.  One rank: its colour.  Copies (Replicate): the whole block
    light grey, a double edge, "copies: 0,1,..." and one rank-coloured dot per copy.
    Partial: white, hatched, "sum 0+2", dots likewise.  Dots have a fixed size in points,
    so they never read as stripes (which would look like a Shard)."""
    from matplotlib.patches import Rectangle
    rcuts, ccuts = _grid_cuts(lay)
    nrows, ncols = rcuts[-1] or 1, ccuts[-1] or 1
    for b in blocks:
        r0, rh, c0, cw = _grid(lay, b.bounds)
        ranks = b.ranks
        many = len(ranks) > 1
        face = rank_color(ranks[0]) if not many else (PARTIAL_FACE if b.partial else COPY_FACE)
        ax.add_patch(Rectangle((c0, r0), cw, rh, gid="block", linewidth=2.4 if many else 1.2,
                               edgecolor="black", facecolor=face,
                               hatch=HATCH if b.partial else None))
        if many:
            ax.add_patch(Rectangle((c0, r0), cw, rh, fill=False, edgecolor="white",
                                   linewidth=0.8, gid="edge"))
            shown = ranks[:MAX_DOTS]
            for k, r in enumerate(shown):
                ax.plot([c0 + cw * (k + 1) / (len(shown) + 1)], [r0 + rh * 0.78], "o",
                        markersize=7, markerfacecolor=rank_color(r), markeredgecolor="black",
                        markeredgewidth=0.6, gid="copy")
        ax.text(c0 + cw / 2, r0 + rh * (0.4 if many else 0.5), _block_text(b), ha="center",
                va="center", gid="label", fontsize=9, wrap=True,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none",
                          alpha=0.85))
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)                       # row 0 on top, as a matrix is printed
    ax.set_box_aspect(min(4.0, max(0.25, nrows / ncols)))
    ax.set_xticks(ccuts if len(ccuts) <= 17 else [0, ncols])
    ax.set_yticks(rcuts if len(lay.shape) >= 2 and len(rcuts) <= 17 else
                  ([0, nrows] if len(lay.shape) >= 2 else []))
    ax.tick_params(labelsize=8, length=2)
    nd = len(lay.shape)
    ax.set_xlabel(f"dim {nd - 1}" if nd else "scalar", fontsize=9)
    if nd >= 2:
        ax.set_ylabel(f"dim {nd - 2}", fontsize=9)
    if title:
        ax.set_title(title, fontsize=9)


def _draw_mesh(ax, mesh) -> None:
    """The device grid: one square per rank in its mesh position and colour."""
    from matplotlib.patches import Rectangle
    shape = mesh.shape
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1]
    panels = math.prod(shape[:-2]) if len(shape) > 2 else 1
    for r in mesh.ranks:
        c = mesh.coordinate(r)
        row = c[-2] if len(c) >= 2 else 0
        panel = 0
        for ci, n in zip(c[:-2], shape[:-2]):
            panel = panel * n + ci
        x = panel * (cols + 0.5) + c[-1]
        ax.add_patch(Rectangle((x + 0.05, row + 0.05), 0.9, 0.9, facecolor=rank_color(r),
                               edgecolor="black", linewidth=0.8, gid="mesh-rank"))
        ax.text(x + 0.5, row + 0.5, str(r), ha="center", va="center", fontsize=9)
    width = panels * (cols + 0.5) - 0.5
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(rows + 0.1, -0.1)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for s in ax.spines.values():
        s.set_visible(False)
    names = mesh.dim_names
    ax.set_xlabel(names[-1] + (f" (panels: {', '.join(names[:-2])})" if len(names) > 2 else ""),
                  fontsize=9)
    if len(names) >= 2:
        ax.set_ylabel(names[-2], fontsize=9)
    ax.set_title("mesh", fontsize=9)


def _draw_layout(fig, lay: Layout, title: str, max_facets: int, mesh_panel: bool = True) -> None:
    facets = lay.facets()
    _check_facets(len(facets), max_facets)
    ncols = min(len(facets), 4)
    nrows = -(-len(facets) // ncols)
    gs = fig.add_gridspec(nrows, ncols + (1 if mesh_panel else 0),
                          width_ratios=[1.0] * ncols + ([0.8] if mesh_panel else []))
    for k, (idx, blocks) in enumerate(facets):
        _draw_blocks(fig.add_subplot(gs[k // ncols, k % ncols]), lay, blocks, idx)
    if mesh_panel:
        _draw_mesh(fig.add_subplot(gs[:, ncols]), lay.mesh)
    fig.suptitle(title or _header(lay), fontsize=9)
    legend = _legend(lay)
    if legend:
        import textwrap
        # lines no wider than the (sub)figure: a narrow panel of a reshard figure clipped
        # 44 characters ("copies a,b: ... along x, y" lost its end); about 0.6 em a character
        chars = max(20, min(44, int(fig.bbox.width / fig.dpi * 72 / (9 * 0.6))))
        fig.supxlabel("\n".join(textwrap.fill(x, chars) for x in legend), fontsize=9,
                      gid="legend")


def _figure(width, height, dpi):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), dpi=dpi, layout="constrained")


def draw_placements(x, mesh=None, placements=None, *, title: str | None = None,
                    facet_size: float = 2.4, dpi: int = 100, max_facets: int = 16):
    """A matplotlib Figure of ``x`` (DistTensor, TensorSpec, or shape + mesh + placements):
    each block a rectangle at its true position and size, coloured by the rank holding
    it (striped for copies, hatched for Partial), beside the mesh of devices."""
    import matplotlib
    lay = x if isinstance(x, Layout) else placement_layout(x, mesh, placements)
    n = len(lay.facets())
    ncols, nrows = min(n, 4), -(-n // min(n, 4))
    with matplotlib.rc_context(RC):
        fig = _figure(facet_size * (ncols + 0.8) + 0.4,
                      facet_size * nrows * _row_height(lay, nrows) + 0.6
                      + 0.18 * len(_legend(lay)), dpi)
        _draw_layout(fig, lay, title, max_facets)
    return fig


def _row_height(lay: Layout, nrows: int) -> float:
    """The height of one row of facets, in facet widths: the taller of a facet's block grid
    (its box aspect, as ``_draw_blocks`` sets it) and the mesh panel's share (0.8 of a
    facet wide, square ranks), at least 0.45 (a 1-d tensor's copies and dots need it) and
    at most 1.  A whole facet width for every row left a wide tensor (a (64, 256) weight,
    a (12, 32) logits matrix) far below its title, in a band of white space."""
    rcuts, ccuts = _grid_cuts(lay)
    blocks = min(4.0, max(0.25, (rcuts[-1] or 1) / (ccuts[-1] or 1)))
    shape = lay.mesh.shape
    rows = shape[-2] if len(shape) >= 2 else 1
    panels = math.prod(shape[:-2]) if len(shape) > 2 else 1
    mesh = 0.8 * (rows + 0.2) / (panels * (shape[-1] + 0.5) - 0.5 + 0.2) / nrows
    return min(1.0, max(blocks, mesh, 0.45))


# ---- notebooks ----------------------------------------------------------------------------

# a widget's text line (<pre>) wraps at spaces, not inside a word (JupyterLab's own style
# breaks anywhere)
PRE_WRAP = ' style="white-space: pre-wrap; word-break: normal; overflow-wrap: break-word"'


def to_png(fig) -> bytes:
    """The figure as PNG bytes, rendered with Agg (no pyplot, no metadata)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def show(fig) -> None:
    """Display a figure in a notebook as PNG only: no ``<Figure size ...>`` text is
    stored in the notebook (nbval compares text outputs, not PNGs)."""
    from IPython.display import display
    display({"image/png": to_png(fig)}, raw=True)


# the reshard figures live in reshard_figure.py; imported last, as they draw with the above
from .reshard_figure import draw_reshard, render_reshard_text  # noqa: E402
