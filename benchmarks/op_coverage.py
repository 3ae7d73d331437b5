"""Which ops of the op table the random programs (tests/random_programs*.py) never draw.

    python benchmarks/op_coverage.py [--draws 6000]

Draws ``--draws`` ops the way ``run_program(wide=True)`` does (``random_programs._op``:
the old kinds, tests/random_programs_more.py's, _habits' and _wide's) on leaves of random
shapes and first dtypes on a one-rank mesh, runs each drawn call on the one-device side
only, under a ``TorchFunctionMode`` that records the torch callables it is made of, and
maps them to the op table (``ops_table.BY_FUNC``: the registered ops) and to the
compositions (``habits.COMPOSED``).  Prints the registered ops whose torch callables no draw
reached; ops only workbench calls (its own functions: ``_bool_index``, ``megatron_f``,
``swiglu``...) are listed apart, as they have no torch callable a program could call.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def public(entry) -> bool:
    """Whether a torch callable answers to ``entry`` (not only a workbench function)."""
    return any(not (getattr(f, "__module__", None) or "").startswith("workbench")
               for f in entry.funcs)


def reached(draws: int, seed0: int = 0) -> collections.Counter:
    """{op-table name (or 'composed:<name>'): how many drawn calls reached it}."""
    import torch
    from torch.overrides import TorchFunctionMode

    import workbench as wb
    from tests import random_programs as rp
    from tests import random_programs_wide as rw
    from workbench.parallel.habits import COMPOSED
    from workbench.parallel.ops_table import BY_FUNC, load
    load()
    hits: collections.Counter = collections.Counter()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            hit = BY_FUNC.get(func)
            if hit is not None:
                hits[hit[0].name] += 1
            elif func in COMPOSED:
                hits["composed:" + getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    mesh = wb.Mesh([0])
    for i in range(draws):
        rng = random.Random(seed0 + i)
        p = rp._Prog(rng, ())
        p.wide, p.mesh = True, mesh
        try:
            cur = p.leaf(p.shape(), dtype=rw.dtype(rng))
            drawn = rp._op(p, cur)
        except Exception:  # noqa: BLE001 - a builder that does not fit: no draw
            continue
        if drawn is None:
            continue
        ref = cur[2].detach().clone().requires_grad_(cur[2].requires_grad)
        with Record():
            try:
                drawn[1](ref)
            except Exception:  # noqa: BLE001 - torch refused the call: still drawn
                pass
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=6000)
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from workbench.parallel.ops_table import TABLE, load
    load()
    hits = reached(a.draws)
    pub = sorted(n for n, e in TABLE.items() if public(e))
    own = sorted(n for n, e in TABLE.items() if not public(e))
    missing = [n for n in pub if not hits[n]]
    print(f"{len(TABLE)} registered ops: {len(pub)} with a torch callable, {len(own)} only "
          f"workbench's; {a.draws} draws reached {len(pub) - len(missing)} of the {len(pub)}")
    print(f"never drawn ({len(missing)}): {missing}")
    print(f"workbench's own ({len(own)}): {own}")
    from workbench.parallel.habits import COMPOSED
    comp = sorted({getattr(f, "__name__", str(f)) for f in COMPOSED})
    cmiss = [n for n in comp if not hits["composed:" + n]]
    print(f"compositions (habits.COMPOSED): {len(comp)} names, never drawn ({len(cmiss)}): "
          f"{cmiss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
