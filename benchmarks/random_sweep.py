"""2,000 random SPMD programs against one device: every silent wrong answer and every raw
library exception, grouped by kind.

    python benchmarks/random_sweep.py [--cases 2000] [--start 0] [--avoid slow_planning] [--wide]
                                      [--focus NEW15,BLAS,...] [--dtypes complex128,int64]

Program ``i`` is ``tests.random_programs.run_program(random.Random(start + i))``, the
generator of the property test (tests/test_random_programs.py), here with none of the
known bugs kept off (``--avoid`` names generator guards to keep, e.g. ``slow_planning``:
no binary op on 3-d meshes, whose strategy choice plans 125-343 candidates).  ``--wide``
draws ``run_program(..., wide=True)``: tests/random_programs_wide.py's wider space (other
dtypes, reshards, no_grad / autocast, more ops and backward forms); ``--focus`` (implies
``--wide``) draws the wide kinds from the named groups / kinds of that module only
(``NEW15``, ``BLAS``, ``NN``, ``COMPLEX18``, ... or single kinds such as ``vdot``);
``--dtypes`` (implies ``--wide``) draws the first leaf's dtype from the named ones only.
Outcomes:

* wrong: the result or a gradient differs from one device, and nothing was raised (or
  torch raised for the call and the DistTensor call returned a result);
* raised: an exception other than ValueError / NotImplementedError (a raw IndexError,
  TypeError, RuntimeError... from inside workbench, where a clear error is due);
* refused: a ValueError / NotImplementedError (listed, not counted as bugs).

Prints the counts, then one reproducer (seed and program) per group
(kind, exception type, innermost workbench frame), and the time taken.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--avoid", default="", help="comma-separated generator guards to keep")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wide", action="store_true", help="the wider space (random_programs_wide)")
    ap.add_argument("--focus", default="", help="comma-separated wide kind groups / kinds")
    ap.add_argument("--dtypes", default="", help="comma-separated first-leaf dtypes of the "
                    "wide space, equally likely (e.g. complex128,int64; implies --wide)")
    a = ap.parse_args(argv)
    if a.focus:
        _focus(a.focus.split(","))
        a.wide = True
    if a.dtypes:
        _dtypes(a.dtypes.split(","))
        a.wide = True
    import torch
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    avoid = tuple(x for x in a.avoid.split(",") if x)
    counts = collections.Counter()
    groups: dict = {}
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)      # stopped early: report the cases run so far
    done = 0
    try:
        for i in range(a.start, a.start + a.cases):
            _one(i, avoid, counts, groups, a.wide)
            done += 1
            if done % 100 == 0:
                print(f"{done} cases: {dict(counts)} ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"stopped after {done} cases", file=sys.stderr)
    wall = time.perf_counter() - t0
    print(f"{done} random programs (seeds {a.start}..{a.start + done - 1}, avoid "
          f"{list(avoid)}{', wide' if a.wide else ''}{', focus ' + a.focus if a.focus else ''}"
          f"): {dict(counts)} in {wall:.0f} s")
    for (status, kind, where, what), cases in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        seed, out = cases[0]
        print(f"\n== {status} {kind} {where} {what}: {len(cases)} cases "
              f"(seeds {[s for s, _ in cases[:8]]})\n{out.detail}\n{out.text[:1500]}")
    return 1 if counts["wrong"] or counts["raised"] else 0


def _focus(names):
    """Draw the wide kinds from ``names`` only (``random_programs._op`` reads
    ``random_programs_wide.WIDE`` at each draw)."""
    from tests import random_programs_wide as rw
    kinds = []
    for n in names:
        group = getattr(rw, n, None)
        if isinstance(group, tuple):
            kinds += group
        elif n in rw.WIDE:
            kinds.append(n)
        else:
            raise SystemExit(f"--focus {n!r}: not a kind group or kind of "
                             "tests/random_programs_wide.py (e.g. NEW15, BLAS, vdot)")
    rw.WIDE = tuple(kinds)


def _dtypes(names):
    """The wide space's first leaf drawn from ``names`` only (torch dtype names), each as
    likely (``random_programs_wide.dtype`` reads ``DTYPES`` at each draw)."""
    import torch
    from tests import random_programs_wide as rw
    dts = []
    for n in names:
        dt = getattr(torch, n, None)
        if not isinstance(dt, torch.dtype):
            raise SystemExit(f"--dtypes {n!r}: not a torch dtype (e.g. complex128, int64)")
        dts.append((dt, 1))
    rw.DTYPES = tuple(dts)


def _stop(signum, frame):
    raise KeyboardInterrupt


def _one(i, avoid, counts, groups, wide=False):
    from tests.random_programs import run_program
    out = run_program(random.Random(i), avoid=avoid, wide=wide)
    counts[out.status] += 1
    if out.status != "ok":
        key = (out.status, out.kind, out.where,
               out.detail.split(": ")[1].split(" (")[0] if out.status == "wrong" else "")
        groups.setdefault(key, []).append((i, out))


if __name__ == "__main__":
    sys.exit(main())
