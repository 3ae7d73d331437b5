"""What the planner's step for Narayanan et al.'s ZeRO-3 rows is made of.

    PYTHONPATH=$PWD python benchmarks/zero3_2021_breakdown.py      # ~3 s

For each ``narayanan_zero3`` row of ``benchmarks/published.py`` (DeepSpeed of spring
2021, ``framework="deepspeed-0.3"``, ``plan.zero3_2021``) it re-runs the micro-batch
simulation the estimate runs and prints, in seconds per step: the published step (the
global batch's FLOPs, as Narayanan et al.'s eq. 3 counts them, over the published
TFLOP/s), the predicted one, the compute, the simulation's exposed rest (everything
beside the compute in the micro-batch), ``_post_step``'s gather of the persistent
parameters, and the work behind them: the host's per-chunk loops (DeepSpeed's
``narrow`` loops, c10d's ``recordStream`` + ``copy_`` per chunk), the blocking releases,
NCCL's seconds as the clock prices them (and their bus bandwidth), the gradient
pre-division.  ``nodes``: the nodes the data-parallel group spans (NCCL's bus bandwidth
is priced alike at all of them: ``sim_mesh.nccl_tuning.scale_assumption``).  Work is
not exposure: the loops of one collective overlap the NCCL
time of another.  ``gap``: the published step less the predicted one.  ``prefetch``:
the gathers the prefetch issued in the step priced (step 2, ``zero3_2021.COUNTER_STEP``);
``late``: the predicted step at a late step (10,000), where DeepSpeed's live-parameter
counter has drifted low enough for every gather to be a prefetch (``plan.zero3_2021``'s
docstring: the counter loses the persistent parameters' elements every step).
``v0.3.14`` / ``v0.3.16``: the predicted step with those releases' hooks instead of
v0.3.13's (``zero3_2021.VERSIONS``: from v0.3.14 the trace is off by one, so nothing is
prefetched and nothing kept for a reuse; from v0.3.15 a norm and a host wait per fetched
parameter); the estimate prices v0.3.13 (``zero3_2021.VERSION``, ASSUMED from the dates).

Nothing here feeds the planner; it shows where the predicted time goes (the loops
over p chunks grow with the data-parallel size, the rest does not).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published as P  # noqa: E402
from workbench.plan import costs as C  # noqa: E402
from workbench.plan import zero3_2021 as Z  # noqa: E402
from workbench.plan.edge_cost import edge_times  # noqa: E402
from workbench.sim_mesh.cost import overlap_rate  # noqa: E402


def breakdown(row) -> dict:
    """The step's parts for one row (module docstring), seconds."""
    cfg, lay, cl = P.build(row)
    r = P.predict(row)
    est, prof = r["estimate"], cl.profile
    ranks = tuple(lay.grad_ranks(0, 0))
    p = len(ranks)
    moved = {"all_gather": 0.0, "reduce_scatter": 0.0}

    def price(kind):
        def f(n):
            moved[kind] += 2 * n * (p - 1) / p
            return C.group_price(kind, 2 * n, ranks, prof)
        return f

    edge = edge_times(cfg, lay.micro_batch, 1, False, prof)
    trace = Z.gpt_trace(cfg, est.details["layer"], est.details["head"], edge, lay.recompute,
                        Z.partition_activation_seconds(cfg, lay.micro_batch, prof),
                        lay.recompute_num_layers)
    sim = Z.simulate(trace, p, price("all_gather"), price("reduce_scatter"),
                     prof.memory_bandwidth, overlap_rate(prof, ranks))
    post, _ = Z.post_step_gather(trace, p, lambda n: C.group_price(
        "all_gather", 2 * n, ranks, prof))
    late = {}
    quiet = tuple((lambda n, k=kind: C.group_price(k, 2 * n, ranks, prof))
                  for kind in ("all_gather", "reduce_scatter"))   # not counted in moved
    for first in (True, False):      # the step's first micro-batch, the others
        a, b = (Z.simulate(trace, p, *quiet, prof.memory_bandwidth, overlap_rate(prof, ranks),
                           persistent_gathered=first, step=k)["seconds"]
                for k in (Z.COUNTER_STEP, 10_000))
        late[first] = a - b
    saved = late[True] + (lay.m - 1) * late[False]
    other = {}
    for v in ("0.3.14", "0.3.16"):
        d = [Z.simulate(trace, p, *quiet, prof.memory_bandwidth, overlap_rate(prof, ranks),
                        persistent_gathered=first, version=v)["seconds"]
             - Z.simulate(trace, p, *quiet, prof.memory_bandwidth, overlap_rate(prof, ranks),
                          persistent_gathered=first)["seconds"] for first in (True, False)]
        other[v] = est.step_time + d[0] + (lay.m - 1) * d[1]
    w = sim["work"]
    published = est.step_time * r["ratio"]
    return dict(name=row["name"], gpus=row["devices"], mb=lay.micro_batch,
                nodes=len({r // prof.devices_per_node for r in ranks}),
                published=published, predicted=est.step_time, compute=sim["compute"],
                exposed=sim["seconds"] - sim["compute"], post_step=post,
                host_loops=w["ag_loop"] + w["rs_loop"] + w["record_copy"],
                release=w["release"], nccl=w["nccl"], predivide=w["predivide"],
                busbw=(moved["all_gather"] + moved["reduce_scatter"]) / w["nccl"] / 1e9,
                gap=published - est.step_time, prefetch=sim["prefetches"],
                late=est.step_time - saved, **{"v0.3.14": other["0.3.14"],
                                                "v0.3.16": other["0.3.16"]})


def main():
    cols = ("published", "predicted", "compute", "exposed", "post_step", "host_loops",
            "release", "nccl", "predivide", "busbw", "gap", "prefetch", "late", "v0.3.14",
            "v0.3.16")
    print("narayanan_zero3 rows, seconds per step (busbw: GB/s of NCCL's all-gathers and "
          "reduce-scatters as the clock prices them)")
    print(f"  {'row':10} {'GPUs':>5} {'nodes':>5} {'mb':>3} "
          + " ".join(f"{c:>10}" for c in cols))
    for row in P.ROWS:
        if row["source"] != "narayanan_zero3":
            continue
        b = breakdown(row)
        print(f"  {b['name']:10} {b['gpus']:5d} {b['nodes']:5d} {b['mb']:3d} "
              + " ".join(f"{b[c]:10.1f}" for c in cols))


if __name__ == "__main__":
    main()
