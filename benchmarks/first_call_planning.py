"""What the dispatcher's first call for a new input layout costs in planning alone: the
chooser's decision (``free_choice.choose``: the rule, the zero-communication shortcut,
the full ranking of every candidate with the reshard planner), in CPU seconds of this
process, from cold caches (decisions, plans, plan templates forgotten, as in a fresh
process), for every placement combination of a few ops' inputs on meshes of 2, 4 and
2 x 2 ranks (what ``tests/test_rules_exhaustive.py`` dispatches, without running the ops).

    OMP_NUM_THREADS=1 python benchmarks/first_call_planning.py [--repeat 3] [--check]
        [--ops linear,matmul,add] [--digest]

``--check``: the dispatcher's validator's way (``check=True``: the full decision is made
for a shortcut's too, as under ``dispatch.VALIDATE``).  ``--digest``: print a hash of
every decision's ranking (each candidate's strategy, plans and prices, the reason), to
compare two versions of the chooser: a speed-up must leave it unchanged.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.parallel.ops_table import free_choice as FC  # noqa: E402
from workbench.parallel.ops_table import strategy as ST  # noqa: E402
from workbench.parallel.spec import TensorSpec  # noqa: E402

RS = sys.modules["workbench.parallel.reshard"]     # (wb.parallel.reshard is the function)

# op: (input shapes (None: not a tensor), attributes); the shapes of
# tests/test_rules_exhaustive.py
OPS = {
    "linear": ([(3, 5, 6), (4, 6), (4,)], {}),
    "matmul": ([(5, 6), (6, 3)], {}),
    "add": ([(5, 6), (5, 6)], {}),
}
MESHES = [wb.Mesh.grid(2, ["a"]), wb.Mesh.grid(4, ["a"]), wb.Mesh.grid((2, 2), ["a", "b"])]


def cold():
    """Forget what the chooser learned: decisions, plans, templates, deferred prices."""
    ST._infer_cached.cache_clear()
    RS._plan_cached.cache_clear()
    FC._TEMPLATES.clear()
    ST._DEFERRED.clear()
    getattr(ST, "_COMBINED", {}).clear()         # (combine's strategies, task speed18b)
    getattr(ST, "_PRICES", {}).clear()           # (each input's price, task speed18b)


def layouts(shapes):
    """Every (mesh, specs) of the inputs: Replicate, Shard(d), Partial per mesh dim."""
    for mesh in MESHES:
        per = []
        for s in shapes:
            opts = [wb.Replicate()] + [wb.Shard(d) for d in range(len(s))] + [wb.Partial()]
            per.append(list(itertools.product(opts, repeat=mesh.ndim)))
        for combo in itertools.product(*per):
            yield mesh, tuple(TensorSpec(s, mesh, ps) for s, ps in zip(shapes, combo))


def run(ops, check):
    decisions = []
    t0 = time.process_time()
    for op in ops:
        shapes, attrs = OPS[op]
        for _, specs in layouts(shapes):
            decisions.append(FC.choose(op, specs, attrs, check=check))
    return time.process_time() - t0, decisions


def digest(decisions) -> str:
    h = hashlib.sha256()
    for d in decisions:
        full = d.full() if isinstance(d, FC.FreeDecision) else d
        h.update(repr((str(d.chosen), type(d).__name__, full.reason,
                       [(c.strategy, c.plans, c.time, c.bytes, c.deferred_time,
                         c.deferred_bytes) for c in full.candidates])).encode())
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--digest", action="store_true")
    ap.add_argument("--ops", default=",".join(OPS))
    a = ap.parse_args()
    ops = a.ops.split(",")
    best, decisions = None, None
    for _ in range(a.repeat):
        cold()
        t, decisions = run(ops, a.check)
        best = t if best is None else min(best, t)
    print(f"{len(decisions)} first-call decisions ({', '.join(ops)}; check={a.check}): "
          f"best of {a.repeat} cold runs {best:.2f} s CPU, {best / len(decisions) * 1e3:.2f} "
          f"ms each; torch threads {torch.get_num_threads()}")
    if a.digest:
        print("digest", digest(decisions))


if __name__ == "__main__":
    main()
