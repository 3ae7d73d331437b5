"""Draw ring attention step by step: which rank holds which K/V block, what it computes.

Renders data only: the rows come from
:func:`workbench.parallel.strategies.context_parallel.ring_schedule` (nothing here
decides which block is where or what the causal mask skips).

    >>> from workbench.parallel.strategies.context_parallel import ring_schedule
    >>> print(render_ring_text(ring_schedule(2)))
    ring attention, p=2: per rank and step, the K/V chunks held, the chunk pairs
    (q x kv, row by row: F full, D diagonal, . skipped), ->j: K/V sent on to rank j
                   step 0            step 1
    rank 0 q(0,3)  kv(0,3) D.FD ->1  kv(1,2) ..FF
    rank 1 q(1,2)  kv(1,2) D.FD ->0  kv(0,3) F.F.

Figures are deterministic (fixed colours and sizes, no pyplot state).
"""
from __future__ import annotations

__all__ = ["render_ring_text", "draw_ring", "KIND_COLORS"]

KIND_COLORS = {"full": "#3a78b5", "diagonal": "#8fb8de", "skipped": "#eeeeee"}
_MARK = {"full": "F", "diagonal": "D", "skipped": "."}


def _steps(rows):
    p = max(r["rank"] for r in rows) + 1
    n = max(r["step"] for r in rows) + 1
    grid = {(r["step"], r["rank"]): r for r in rows}
    return p, n, grid


def render_ring_text(rows) -> str:
    """A table, a row per rank (its query chunks) and a column per step: the K/V chunks the
    rank holds, its chunk pairs (F full, D diagonal, . skipped) and the rank it sends
    those K/V chunks to next.  Ranks down and steps across, as :func:`draw_ring` draws
    them, so that p = 4 fits a notebook's width (about 90 characters) unwrapped."""
    p, n, grid = _steps(rows)
    def entry(r):
        marks = "".join(_MARK[k] for *_, k in r["pairs"])
        send = f" ->{r['send_to']}" if r["send_to"] is not None else ""
        return f"kv({','.join(map(str, r['kv_chunks']))}) {marks}{send}"
    heads = [f"rank {i} q({','.join(map(str, grid[(0, i)]['q_chunks']))})" for i in range(p)]
    cells = {(t, i): entry(grid[(t, i)]) for t in range(n) for i in range(p)}
    w0 = max(map(len, heads))
    w = max(max(map(len, cells.values())), len(f"step {n - 1}"))
    lines = [f"ring attention, p={p}: per rank and step, the K/V chunks held, the chunk pairs",
             "(q x kv, row by row: F full, D diagonal, . skipped), ->j: K/V sent on to rank j",
             " " * w0 + "".join(f"  {f'step {t}':<{w}}" for t in range(n)).rstrip()]
    for i in range(p):
        lines.append((heads[i].ljust(w0)
                      + "".join(f"  {cells[(t, i)]:<{w}}" for t in range(n))).rstrip())
    return "\n".join(lines)


def draw_ring(rows, *, cell: float = 1.0):
    """A grid, steps across and ranks down: each cell is the rank's block at that step,
    split into its (query chunk, key chunk) pairs, a row per query chunk (named beside the
    rank) and a column per K/V chunk (named above the cell), coloured full / diagonal /
    skipped; \u2192j marks the send of those K/V chunks to rank j."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    p, n, grid = _steps(rows)
    fig = Figure(figsize=(1.4 * cell * n + 1.5, 1.1 * cell * p + 1.0))
    ax = fig.add_subplot()
    for (t, i), r in grid.items():
        pairs = r["pairs"]
        k = int(round(len(pairs) ** 0.5))                     # a k x k grid of chunk pairs
        for m, (_, _, kind) in enumerate(pairs):
            a, b = divmod(m, k)                               # row: query chunk, column: key
            ax.add_patch(Rectangle((t + 0.1 + b * 0.8 / k, i + 0.22 + a * 0.72 / k),
                                   0.8 / k, 0.72 / k, facecolor=KIND_COLORS[kind],
                                   edgecolor="white"))
        kv = ",".join(map(str, r["kv_chunks"]))
        ax.text(t + 0.5, i + 0.19, f"K/V chunks {kv}", ha="center", va="bottom", fontsize=7)
        if r["send_to"] is not None:
            ax.text(t + 0.96, i + 0.58, f"\u2192{r['send_to']}", ha="center", va="center",
                    fontsize=7, color="#555555")
    ax.set_xlim(0, n)
    ax.set_ylim(p, 0)
    ax.set_xticks([t + 0.5 for t in range(n)], [f"step {t}" for t in range(n)])
    q_chunks = {i: ",".join(map(str, grid[(0, i)]["q_chunks"])) for i in range(p)}
    ax.set_yticks([i + 0.58 for i in range(p)],
                  [f"rank {i}\nquery chunks {q_chunks[i]}" for i in range(p)], fontsize=8)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False,
              fontsize=8)
    ax.set_title(f"ring attention over {p} ranks: query chunks (rows) x K/V chunks held "
                 f"(columns);\n\u2192j: the rank then sends those K/V chunks to rank j",
                 fontsize=9)
    fig.tight_layout()
    return fig
