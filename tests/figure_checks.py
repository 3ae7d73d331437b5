"""Checks that a figure reads: no reference line through a label, no label on another or
on a bar, nothing outside the axes, no legend over the data (measured on an Agg draw)."""


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def crossed(fig, line_gids):
    """Texts of the first axes that a vertical line (by gid) runs through, strictly inside
    them (a label that starts at its own line is not crossed)."""
    renderer = _drawn(fig)
    ax = fig.axes[0]
    xs = [ax.transData.transform((ln.get_xdata()[0], 0))[0]
          for ln in ax.get_lines() if ln.get_gid() in line_gids]
    return [(t.get_text(), x) for t in ax.texts for x in xs
            if t.get_text().strip() and
            t.get_window_extent(renderer).x0 + 1 < x < t.get_window_extent(renderer).x1 - 1]


def covered(fig, bar_gid="bar"):
    """Pairs (text, what it overlaps) among the first axes' texts and bars, the texts kept
    inside the axes (else clipped by the figure or lost past the frame)."""
    renderer = _drawn(fig)
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    bars = [(f"bar {p.get_width():g}", p.get_window_extent(renderer)) for p in ax.patches
            if p.get_gid() == bar_gid]
    bad = [(a, "outside the axes") for a, b in boxes
           if not (ax.bbox.x0 <= b.x0 and b.x1 <= ax.bbox.x1 and ax.bbox.y0 <= b.y0
                   and b.y1 <= ax.bbox.y1)]
    for i, (a, box) in enumerate(boxes):
        bad += [(a, c) for c, other in boxes[i + 1:] + bars if box.overlaps(other)]
    legends = [lg.get_window_extent(renderer) for lg in fig.legends] + \
        ([ax.get_legend().get_window_extent(renderer)] if ax.get_legend() else [])
    bad += [("legend", a) for lg in legends for a, b in boxes + bars if lg.overlaps(b)]
    return bad
