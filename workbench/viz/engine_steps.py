"""What a serving engine ran, step by step: the batch of each step, the KV blocks in use
and the queue, drawn from ``wb.serve.Engine``'s own step log.

    >>> engine.run()                                               # doctest: +SKIP
    >>> pool = engine.num_blocks                   # doctest: +SKIP
    >>> show(engine_steps(engine.log, num_blocks=pool))            # doctest: +SKIP

Three panels on one step axis, read straight from the :class:`StepRecord` fields and
computing nothing (no schedule, no block arithmetic):

* requests: one row per request (in the order they first ran), a cell per step that ran
  it: light for a prompt chunk (labelled with its token count, so a recomputed prompt
  shows how much was redone), dark for a decode token; a red cross on the step that
  preempted it (``preempted``), a black bar on the right edge of the step it finished in
  (``finished``);
* KV blocks in use after each step (``blocks_in_use``: a finished request's blocks are
  already back), with the pool's size as a dashed line;
* the requests waiting after each step (``waiting``).

Deterministic: fixed colours and sizes.  Artists carry gids for tests: "prefill",
"decode", "preempted", "finished", "blocks", "pool", "waiting".
"""
from __future__ import annotations

import matplotlib
from matplotlib.ticker import MaxNLocator, MultipleLocator

from .charts import _figure
from .placements import RC, show
from .serving import DECODE

__all__ = ["engine_steps", "show"]

PREFILL, PREEMPT, BLOCKS, WAITING = "#f2b880", "#d62728", "#8c8c8c", "#bcbd22"
FIELDS = ("step", "prefill", "decode", "preempted", "finished", "blocks_in_use", "waiting")


def _check(log, num_blocks):
    log = list(log)
    if not log:
        raise ValueError("engine_steps(log=[]): give an engine's log (engine.log) after at "
                         "least one step")
    for rec in log:
        missing = [f for f in FIELDS if not hasattr(rec, f)]
        if missing:
            raise TypeError(f"engine_steps(log=...): {type(rec).__name__} has no {missing}; "
                            "give the StepRecords of wb.serve.Engine.log")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(
            num_blocks, int) or num_blocks < max(r.blocks_in_use for r in log)):
        raise ValueError(f"engine_steps(num_blocks={num_blocks!r}): give the pool's size, an "
                         f"int >= the {max(r.blocks_in_use for r in log)} blocks the log "
                         "holds in use (engine.num_blocks), or None")
    return log


def engine_steps(log, num_blocks: int | None = None, *, width: float = 8.0,
                 row: float = 0.28, dpi: int = 90):
    """The steps of ``log`` (``Engine.log``, a StepRecord per step) in three panels:
    requests x steps, KV blocks in use (``num_blocks``: the pool, drawn as a line), and
    the queue (module docstring)."""
    log = _check(log, num_blocks)
    order = []                                   # request ids, in the order they first ran
    for rec in log:
        for rid in [p[0] for p in rec.prefill] + [d[0] for d in rec.decode] + list(
                rec.preempted) + list(rec.finished):
            if rid not in order:
                order.append(rid)
    y = {rid: k for k, rid in enumerate(order)}
    with matplotlib.rc_context(RC):
        fig = _figure(width, 1.6 + len(order) * row + 2.2, dpi)
        ax, axb, axw = fig.subplots(3, 1, sharex=True, height_ratios=[
            max(len(order), 2) * row, 1.4, 0.8])
        for rec in log:
            x = rec.step
            for rid, _context, n in rec.prefill:
                ax.barh(y[rid], 1, left=x - 0.5, height=0.8, color=PREFILL, edgecolor="white",
                        gid="prefill")
                ax.text(x, y[rid], str(n), ha="center", va="center", fontsize=7)
            for rid, _context in rec.decode:
                ax.barh(y[rid], 1, left=x - 0.5, height=0.8, color=DECODE, edgecolor="white",
                        gid="decode")
            for rid in rec.preempted:
                ax.plot([x], [y[rid]], marker="x", color=PREEMPT, markersize=9,
                        markeredgewidth=2.2, linestyle="none", gid="preempted")
            for rid in rec.finished:
                ax.plot([x + 0.5, x + 0.5], [y[rid] - 0.45, y[rid] + 0.45], color="black",
                        linewidth=2.2, gid="finished")
        ax.set_yticks(range(len(order)), [str(r) for r in order])
        ax.set_ylim(len(order) - 0.5, -0.5)
        ax.set_ylabel("request")
        ax.set_title("what each step ran (one forward per step)", fontsize=9)
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color=PREFILL, label="prompt tokens (count)"),
                           Patch(color=DECODE, label="1 decode token"),
                           Line2D([], [], marker="x", color=PREEMPT, linestyle="none",
                                  markeredgewidth=2.2, label="preempted (blocks freed)"),
                           Line2D([], [], color="black", linewidth=2.2, label="finished")],
                  fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)

        steps = [rec.step for rec in log]
        axb.bar(steps, [rec.blocks_in_use for rec in log], width=0.8, color=BLOCKS, gid="blocks")
        for rec in log:
            axb.text(rec.step, rec.blocks_in_use, str(rec.blocks_in_use), ha="center",
                     va="bottom", fontsize=7)
        if num_blocks is not None:
            axb.axhline(num_blocks, color="black", linestyle="--", linewidth=1.0, gid="pool")
            axb.text(1.01, num_blocks, f"pool: {num_blocks}", transform=axb.get_yaxis_transform(),
                     va="center", ha="left", fontsize=7)
        axb.set_ylim(0, max([num_blocks or 0] + [r.blocks_in_use for r in log]) * 1.2 + 0.5)
        axb.set_ylabel("KV blocks\nin use", fontsize=8)
        axb.yaxis.set_major_locator(MaxNLocator(integer=True))

        axw.bar(steps, [rec.waiting for rec in log], width=0.8, color=WAITING, gid="waiting")
        axw.set_ylim(0, max(1, max(rec.waiting for rec in log)) * 1.2)
        axw.set_ylabel("waiting", fontsize=8)
        axw.yaxis.set_major_locator(MaxNLocator(integer=True))
        axw.set_xlabel("engine step (blocks and queue after the step)")
        axw.xaxis.set_major_locator(MultipleLocator(1) if len(steps) <= 30
                                    else MaxNLocator(integer=True))
        axw.set_xlim(min(steps) - 0.6, max(steps) + 0.6)
    return fig
