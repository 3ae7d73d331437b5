"""Value labels at the ends of horizontal bars that no reference line crosses and no
edge of the axes clips.

A label starts a few points right of its bar's end.  Where a vertical reference line
(a device's memory, an even share) would run through it, it starts a few points right
of that line instead (of the last such line: the 910B's usable 60 GB and its 64 GB lie
close), so the line passes in the gap before the number.  Where the labels would run
past the axes' right edge the x axis is widened until they fit.  Widths are measured on
a layout-only draw (``Figure.draw_without_rendering``, fonts as rendered), repeated
until the layout settles; the result is as deterministic as the fonts.

A reference line's own label (made with :func:`end_label` at the line) stays right of
its line, in a row of its own: the axis widens for it as for the bars' labels.  (Right
of the line only: flipped to its left it would run into a line just below, the usable
60 GB under the 910B's 64.)
"""
from __future__ import annotations

PAD_PT = 3.0          # points between a bar's end (or a line) and the label
ROUNDS = 6            # layout passes at most (the axis widens once or twice in practice)


def end_label(ax, x: float, y: float, text: str, **kw):
    """An annotation ``text`` anchored at the bar end (``x``, ``y``), PAD_PT to its right."""
    ann = ax.annotate(text, (x, y), xytext=(PAD_PT, 0), textcoords="offset points",
                      ha="left", va="center", **kw)
    ann._bar_end = x                                  # where place_labels starts from
    return ann


def place_labels(fig, ax, labels, lines=(), fixed=()):
    """Move each of ``labels`` (from :func:`end_label`) past the reference lines at data x
    ``lines`` that would cross it, and widen the x axis until every label, and every one
    of ``fixed`` (labels from :func:`end_label` that stay where they are: a line's own),
    fits inside the axes."""
    import numpy as np
    log = ax.get_xscale() == "log"
    fwd = np.log10 if log else (lambda v: v)
    inv = (lambda v: 10.0 ** v) if log else (lambda v: v)
    lines = sorted(float(x) for x in lines)
    for _ in range(ROUNDS):
        fig.draw_without_rendering()
        pad = PAD_PT * fig.dpi / 72
        x0, x1 = ax.bbox.x0, ax.bbox.x1
        lo, hi = ax.get_xlim()
        need = hi
        for ann in [*labels, *fixed]:
            y = ann.xy[1]
            width = ann.get_window_extent().width
            anchor = ann._bar_end
            for line in lines if ann in labels else ():   # left to right: past each it meets
                start = ax.transData.transform((anchor, y))[0] + pad
                at = ax.transData.transform((line, y))[0]
                if start - pad <= at <= start + width + pad:
                    anchor = line
            ann.xy = (anchor, y)
            # the label's right end, as a share of the axes: fits if <= 1
            room = (x1 - x0 - pad - width - pad) / (x1 - x0)
            if room <= 0:
                raise ValueError(f"bar label {ann.get_text()!r} is wider than the plot: "
                                 "give a larger width=")
            share = (fwd(anchor) - fwd(lo)) / (fwd(hi) - fwd(lo))
            if share > room:
                need = max(need, inv(fwd(lo) + (fwd(anchor) - fwd(lo)) / room))
        if need <= hi * (1 + 1e-9):
            return
        ax.set_xlim(lo, need * (1.02 if not log else 1.05))
    raise RuntimeError("place_labels: the layout did not settle")      # pragma: no cover
