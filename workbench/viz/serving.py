"""The timeline of a serving schedule: one row per request, waiting, decoding, then padding.

    >>> fig = batching_timeline({"static": s, "continuous": c})   # batching.Result each
    >>> show(fig)                                                  # doctest: +SKIP

Draws what :mod:`workbench.serve.batching` computed (arrival, first token, last token
of each request, and the steps that held it) and computes nothing.  Deterministic: fixed
colours and sizes.  Artists carry gids for tests: "wait" (arrival to first token),
"decode" (first to last token), "pad" (last token to the end of the last step that still
held the request's slot: static batching's padding; none under continuous batching).
"""
from __future__ import annotations

import matplotlib
from matplotlib.ticker import MaxNLocator

from .charts import _figure
from .placements import RC, show

__all__ = ["batching_timeline", "show"]

WAIT, DECODE, PAD = "#f2b880", "#3a78b5", "#c9c9c9"


def batching_timeline(results: dict, *, width: float = 8.0, row: float = 0.16, dpi: int = 90):
    """One panel per schedule (``results``: {title: Result}) on a shared time axis: each
    request a row, light from its arrival to its first token (queued and prefilling),
    dark from its first token to its last (decoding), grey while its slot stays held after
    its last token (the batch's padded decode steps)."""
    if not results:
        raise ValueError("batching_timeline(results={}): give {title: batching.Result}")
    n = max(len(r.requests) for r in results.values())
    with matplotlib.rc_context(RC):
        fig = _figure(width, 0.9 + len(results) * (0.5 + n * row), dpi)
        axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (title, res) in zip(axes, results.items()):
            held = {}                               # request id -> end of its last step
            for st in res.steps:
                for rid in st.requests:
                    held[rid] = st.start + st.seconds
            for k, r in enumerate(sorted(res.requests, key=lambda q: q.id)):
                first, last = res.first_token[r.id], res.finish[r.id]
                ax.barh(k, first - r.arrival, left=r.arrival, color=WAIT, height=0.8, gid="wait")
                ax.barh(k, max(last - first, 1e-9), left=first, color=DECODE, height=0.8,
                        gid="decode")
                if held.get(r.id, last) > last:
                    ax.barh(k, held[r.id] - last, left=last, color=PAD, height=0.8, gid="pad")
            ax.set_ylim(len(res.requests) - 0.5, -0.5)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("request")
            ax.set_title(f"{title}: {res.throughput:,.0f} output tokens/s, "
                         f"TTFT p50 {res.ttft_p50 * 1e3:,.0f} ms", fontsize=9)
        axes[-1].set_xlabel("modeled time (s)")
        from matplotlib.patches import Patch
        axes[0].legend(handles=[Patch(color=WAIT, label="waiting + prefill"),
                                Patch(color=DECODE, label="decoding"),
                                Patch(color=PAD, label="done, slot held (padding)")], fontsize=8,
                       loc="upper right")
    return fig
