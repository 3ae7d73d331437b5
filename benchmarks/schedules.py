"""Benchmark: build, simulate and draw 1F1B with p=64 ranks and m=1024 micro-batches.

    python benchmarks/schedules.py [--repeat 3]

The course redraws schedules interactively, so the whole path must stay well
under 2 s at this size (131,072 actions): the simulator is event-driven
(O(actions)) and the figure is one PolyCollection.  Prints the time of each
step (best of ``--repeat`` runs, then the median of the totals) and exits 1 if
the median total exceeds the 2 s budget.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from workbench.parallel.schedules import one_f_one_b, simulate  # noqa: E402
from workbench.viz.pipeline import draw_pipeline, render_text  # noqa: E402

BUDGET_S = 2.0


def run_once(p: int, m: int) -> dict:
    t = {}
    t0 = time.perf_counter()
    sched = one_f_one_b(p, m)
    t["build"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = simulate(sched)
    t["simulate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fig = draw_pipeline(res)
    t["draw (figure)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    FigureCanvasAgg(fig).draw()
    t["render (Agg)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    render_text(res)
    t["text"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    t["_result"] = res
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    runs = [run_once(args.p, args.m) for _ in range(args.repeat)]
    res = runs[-1].pop("_result")
    for r in runs[:-1]:
        r.pop("_result")
    print(f"1F1B p={args.p} m={args.m}: {len(res.schedule)} actions, {res.summary()}")
    for step in runs[0]:
        if step == "total":
            continue
        best = min(r[step] for r in runs)
        print(f"  {step:<14} {best * 1e3:8.1f} ms   (best of {args.repeat})")
    median = statistics.median(r["total"] for r in runs)
    print(f"  {'total':<14} {median * 1e3:8.1f} ms   (median of {args.repeat}; first run "
          f"{runs[0]['total'] * 1e3:.1f} ms; budget {BUDGET_S:.0f} s)")
    if median > BUDGET_S:
        print(f"over budget: {median:.2f} s > {BUDGET_S} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
