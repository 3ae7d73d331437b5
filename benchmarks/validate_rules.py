"""Every candidate of every SPMD rule, forced and held to one device.

    python benchmarks/validate_rules.py [--ops relu,add] [--max-layouts 300] [--all-missing]
                                        [--known-bugs/--no-known-bugs]

Runs :func:`workbench.parallel.validate.validate` on every op with a rule and a sample
call (registered with the op in its family's module, ``workbench/parallel/ops_table/``),
on meshes of 2 and 3 ranks and 2x2 (uneven sizes; Partial inputs of unequal parts, every reduce op), forcing each
candidate the rule offers; then searches 1-d meshes for exact layouts the rules do
not offer.  Prints the report (every wrong candidate, up to 3 missing layouts per
op unless ``--all-missing``) and the time it took.  On the 2x2 mesh at most
``--max-layouts`` input layouts per sample are checked (a fixed-seed choice; the
report says how many of how many), 1-d meshes are checked whole when the cap is
above their count.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    ap.add_argument("--max-layouts", type=int, default=120)
    ap.add_argument("--all-missing", action="store_true", help="list every missing layout")
    ap.add_argument("--known-bugs", action=argparse.BooleanOptionalAction, default=True,
                    help="include the sample calls that hit bugs filed in issue 10")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    from workbench.parallel.validate import MESHES, validate
    from workbench.parallel.ops_table.samples import samples
    warnings.filterwarnings("ignore", category=UserWarning)
    from workbench.parallel.rules import RULES
    ops = a.ops.split(",") if a.ops else sorted(RULES)
    t0 = time.perf_counter()
    rep = None
    for op in ops:                 # one op at a time: progress on stderr
        r = validate([op], meshes=MESHES, max_layouts=a.max_layouts,
                     table=samples(known_bugs=a.known_bugs))
        print(f"{op}: {r.runs} runs, {len(r.wrong)} wrong, {len(r.missing)} missing, "
              f"{r.seconds:.1f} s", file=sys.stderr, flush=True)
        rep = r if rep is None else rep.merge(r)
    wall = time.perf_counter() - t0
    print(rep.format(per_op=10 ** 9 if a.all_missing else 3))
    print(f"meshes {list(MESHES)}; wall time {wall:.1f} s on {a.threads} thread(s)")
    return 1 if rep.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
