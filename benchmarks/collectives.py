"""How much does simulating N ranks cost over the same arithmetic on one tensor?

    python benchmarks/collectives.py [--threads 1] [--min-time 0.05] [--rounds 7] [--profile]

For 8 and 64 simulated ranks and 4 KiB / 4 MiB per rank (float32), time

* ``workbench.sim_mesh.collectives`` on stacked tensors: all_reduce,
  all_gather, reduce_scatter (one leading device axis, a 1-d mesh of N);
* ``wb.reshard`` on DistTensors: P -> R, S(0) -> R, P -> S(0) (planning
  included, as a user calls it), and, for information, the same with the plan
  made once (``execute(plan, t)``);

against the single-tensor torch op that does the same arithmetic:

* all_reduce over N ranks     ~ ``x.sum(0)`` of an (N, n) tensor,
* all_gather                  ~ a copy of the same N * n elements,
* reduce_scatter              ~ ``x.sum(0)`` then a view as (N, n / N).

"per rank" is each rank's input buffer (n = bytes / 4 elements).  Targets:
ratio <= 2 at 4 KiB, <= 1.2 at 4 MiB.  Times are medians of
``torch.utils.benchmark.Timer.blocked_autorange``; each side is measured in
``--rounds`` interleaved rounds and the smallest median kept (the CPU may be
shared, and interference only adds time).  No trace is
recorded (``wb.trace`` off), as in plain interactive use.

A simulated all_gather along the leading axis of a contiguous stack is a view
(no bytes copied; the "note" column says so): at 4 MiB its ratio against a real
copy is ~0, at 4 KiB it is the Python cost of three view ops against one small
memcpy.  ``--profile`` prints where the reshard rows spend their time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.benchmark import Timer  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.parallel.reshard import execute  # noqa: E402
from workbench.sim_mesh import collectives as C  # noqa: E402

KIB = 1024
SIZES = [4 * KIB, 4 * KIB * KIB]
RANKS = [8, 64]
TARGET = {4 * KIB: 2.0, 4 * KIB * KIB: 1.2}


def median(stmt, env, min_time):
    t = Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads())
    return t.blocked_autorange(min_run_time=min_time).median


def measure(ours, base, env, min_time, rounds):
    """Interleaved rounds of (base, ours); the smallest median of each side (other
    work on a shared CPU only ever adds time)."""
    bs, os_ = [], []
    for _ in range(rounds):
        bs.append(median(base, env, min_time))
        os_.append(median(ours, env, min_time))
    return min(os_), min(bs)


def fmt_t(s):
    return f"{s * 1e6:9.1f} us" if s < 1e-3 else f"{s * 1e3:9.3f} ms"


def fmt_b(b):
    return f"{b // KIB} KiB" if b < KIB * KIB else f"{b // (KIB * KIB)} MiB"


def cases(N, nbytes):
    """(name, ours stmt, baseline stmt, env, note) for one (N, per-rank bytes)."""
    n = nbytes // 4
    mesh = wb.Mesh.grid((N,), ["x"])
    x = torch.randn(N, n)                                   # rank k's buffer is x[k]
    env = dict(C=C, wb=wb, execute=execute, mesh=mesh, x=x, N=N, n=n)
    # DistTensors over the same stacked storage
    env["tP"] = wb.DistTensor(x, mesh, (wb.Partial(),), (n,))
    env["tS"] = wb.DistTensor(x, mesh, (wb.Shard(0),), (N * n,))
    env["R"], env["S0"] = [wb.Replicate()], [wb.Shard(0)]
    env["planPR"] = wb.plan_reshard(env["tP"], mesh, env["R"])
    env["planSR"] = wb.plan_reshard(env["tS"], mesh, env["R"])
    env["planPS"] = wb.plan_reshard(env["tP"], mesh, env["S0"])

    ag = C.all_gather(x, mesh, 0, 0)
    view = "view, 0 B copied" if ag.data_ptr() == x.data_ptr() else "copies"
    sum0, copy, rs = "x.sum(0, keepdim=True)", "x.reshape(-1).clone()", "x.sum(0).view(N, n // N)"
    return [
        ("collectives.all_reduce", "C.all_reduce(x, mesh, 0)", sum0, env, ""),
        ("collectives.all_gather", "C.all_gather(x, mesh, 0, 0)", copy, env, view),
        ("collectives.reduce_scatter", "C.reduce_scatter(x, mesh, 0, 0)", rs, env, ""),
        ("reshard P->R", "wb.reshard(tP, mesh, R)", sum0, env, ""),
        ("reshard S(0)->R", "wb.reshard(tS, mesh, R)", copy, env, view),
        ("reshard P->S(0)", "wb.reshard(tP, mesh, S0)", rs, env, ""),
        ("  execute(plan) P->R", "execute(planPR, tP)", sum0, env, "info: plan made once"),
        ("  execute(plan) S(0)->R", "execute(planSR, tS)", copy, env, "info: plan made once"),
        ("  execute(plan) P->S(0)", "execute(planPS, tP)", rs, env, "info: plan made once"),
    ]


def check_results():
    """The benchmarked calls compute the right values (small sizes)."""
    N, n = 8, 64
    mesh = wb.Mesh.grid((N,), ["x"])
    x = torch.randn(N, n)
    torch.testing.assert_close(C.all_reduce(x, mesh, 0)[0], x.sum(0))
    assert torch.equal(C.all_gather(x, mesh, 0, 0)[0], x.reshape(-1))
    torch.testing.assert_close(C.reduce_scatter(x, mesh, 0, 0), x.sum(0).view(N, n // N))
    tP = wb.DistTensor(x, mesh, (wb.Partial(),), (n,))
    torch.testing.assert_close(wb.reshard(tP, mesh, [wb.Replicate()]).local(0), x.sum(0))
    tS = wb.DistTensor(x, mesh, (wb.Shard(0),), (N * n,))
    assert torch.equal(wb.reshard(tS, mesh, [wb.Replicate()]).local(5), x.reshape(-1))
    out = wb.reshard(tP, mesh, [wb.Shard(0)])
    torch.testing.assert_close(torch.stack(out.locals()), x.sum(0).view(N, n // N))


def profile_rows(N, nbytes, reps=2000):
    """cProfile of the reshard rows: where the Python time goes."""
    rows = [c for c in cases(N, nbytes) if c[0].startswith("reshard")]
    for name, stmt, _, env, _ in rows:
        code = compile(stmt, "<bench>", "eval")
        eval(code, env)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(reps):
            eval(code, env)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s).sort_stats("cumulative")
        st.print_stats(r"workbench|importlib|pathlib|torch", 16)
        print(f"\n==== cProfile {name}, N={N}, {fmt_b(nbytes)}/rank, {reps} calls, "
              f"by cumulative time (us per call = cumtime / {reps} * 1e6; the profiler "
              f"itself inflates these ~2x) ====")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        for line in s.getvalue().splitlines()[6:]:
            print(line.replace(root, "").replace(os.path.dirname(torch.__file__), "torch"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--min-time", type=float, default=0.05,
                    help="seconds per blocked_autorange (default 0.05)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved rounds per side; the smallest median is kept (default 7)")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile the reshard rows at 4 KiB / 8 ranks")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    check_results()
    print(f"torch {torch.__version__}, torch.set_num_threads({torch.get_num_threads()}), "
          f"float32, min over {args.rounds} interleaved rounds of the median of "
          f"blocked_autorange(min_run_time={args.min_time})")
    print(f"targets: ratio <= {TARGET[SIZES[0]]} at 4 KiB/rank, <= {TARGET[SIZES[1]]} at 4 MiB/rank\n")
    head = f"{'op':<28}{'ranks':>6}{'per rank':>10}{'workbench':>14}{'torch':>14}{'ratio':>8}  result"
    print(head)
    print("-" * len(head))
    misses = 0
    for nbytes in SIZES:
        for N in RANKS:
            for name, ours, base, env, note in cases(N, nbytes):
                to, tb = measure(ours, base, env, args.min_time, args.rounds)
                ratio = to / tb
                info = note.startswith("info")
                ok = ratio <= TARGET[nbytes]
                verdict = ("(info)" if info else "PASS" if ok else "MISS")
                misses += (not ok and not info)
                extra = f"  [{note}]" if note else ""
                print(f"{name:<28}{N:>6}{fmt_b(nbytes):>10}{fmt_t(to):>14}{fmt_t(tb):>14}"
                      f"{ratio:>8.2f}  {verdict}{extra}", flush=True)
            print()
    print(f"{misses} row(s) missed the target")
    if args.profile:
        profile_rows(8, SIZES[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
