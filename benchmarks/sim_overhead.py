"""How much does simulating many ranks cost over the same arithmetic on one device?

    OMP_NUM_THREADS=1 python benchmarks/sim_overhead.py [--rounds 5] [--min-time 0.3]
                        [--timer wall|cpu] [--dtensor] [--only step|coll|ops]

Three measurements, each printed beside plain torch:

1. **A tensor-parallel MLP step** (column-parallel then row-parallel linear, Megatron
   style, forward and backward) on 8 simulated ranks (``wb.shard_tensor`` DistTensors,
   ``loss.backward()`` through the simulated collectives) against the same step on one
   device, at toy size (tokens 32, hidden 64) and large size (tokens 1024, hidden 512).
   ``--dtensor`` adds PyTorch DTensor under ``LocalTensorMode`` (8 ranks in one process,
   fake process group) for comparison, timed once (it is ~100x slower).
2. **Small collectives on 64 ranks** (4 KiB float32 per rank), at both levels a user
   reaches them, against the single-tensor torch op that does the same arithmetic:

   * DistTensors: ``wb.reshard`` S(0) -> R (an all-gather, planning included as a user
     calls it) against ``torch.cat`` of the 64 shards; P -> R (all-reduce) against
     ``x.sum(0)``; P -> S(0) (reduce-scatter) against ``x.sum(0)`` viewed as 64 chunks;
   * the stacked collectives of ``workbench.sim_mesh.collectives``: ``all_gather``
     against ``torch.cat``, ``all_reduce`` and ``reduce_scatter`` as above.

3. **Microseconds per dispatched op** (``--only ops``; the simulator's overhead, task
   "simperf"): five workloads, each timed per call and divided by the number of
   DistTensor ops it dispatches (counted once, untimed, by watching
   ``workbench.parallel.dispatch.dispatch`` with ``sys.setprofile``; ``wb.reshard``
   calls counted as ops too).  The floor is the same computation in plain torch on one
   device divided by the same count:

   * ``elementwise 2x2``: ``(x * 2 + y).tanh() * x - y`` then ``.relu().sum()`` on a
     (8, 16) tensor sharded [Shard(0), Replicate()] on a 2x2 mesh (forward, no grad);
   * ``matmul + reshard``: ``x @ w`` with x [Shard(0), Replicate()] and w
     [Replicate(), Shard(1)] on a 2x2 mesh, then ``wb.reshard`` of the product to
     [Replicate(), Replicate()] (two all-gathers);
   * ``GPT fwd+bwd Hybrid``: ``Hybrid(dp=2, tp=2).forward_backward`` of the ``gpt-tiny``
     model on a batch of 4 (one device: the same model's ``model(x, y)`` and backward);
   * ``... under wb.trace``: the same step inside ``wb.trace()`` (events and the clock);
   * ``... + measure_activations()``: and the activations it keeps counted
     (``Hybrid.measure_activations``, what ``wb.train`` runs each step for its records).

   This part has no target: it is the figure to watch when the dispatcher changes.
   Compare two versions on the same machine back to back (``--timer cpu`` on a loaded
   one), e.g. by running this file from an export of each checkout.

Targets (issue "Before wave 3"): the toy step at most 2.0x one device, the large step
at most 1.05x, every small collective on 64 ranks at most 2x its torch equivalent.
No trace is recorded (``wb.trace`` off), as in plain interactive use, and no validator
runs.

Timing: each row is measured in ``--rounds`` rounds; a round times the plain-torch
baseline, then workbench, each as the median of
``torch.utils.benchmark.Timer.blocked_autorange`` (the CPU may be shared: interleaving
puts both sides under the same load).  The ratio printed is the median over rounds of
each round's ratio; the times are the medians over rounds.  Run with
``OMP_NUM_THREADS=1`` (one intra-op thread on both sides) and note the load
(``uptime``) beside the figures; on a loaded machine ``--timer cpu`` times this
process's CPU time (``time.process_time``) instead of the wall clock.  Exit status 1
if a target is missed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.benchmark import Timer  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.sim_mesh import collectives as C  # noqa: E402

TP = 8                      # ranks of the MLP step
N_COLL = 64                 # ranks of the small collectives
COLL_BYTES = 4 * 1024       # per rank
TARGET_STEP = {"toy": 2.0, "large": 1.05}
TARGET_COLL = 2.0


CLOCK = [time.perf_counter]  # --timer cpu: time.process_time


def blocked_median(fn, min_time: float) -> float:
    """Median seconds per call of ``fn()`` (torch.utils.benchmark's blocked_autorange)."""
    t = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(),
              timer=CLOCK[0])
    return t.blocked_autorange(min_run_time=min_time).median


def interleaved(ours, base, rounds: int, min_time: float):
    """(median ratio, median ours, median base) over ``rounds`` rounds of base then ours."""
    ts_o, ts_b, ratios = [], [], []
    for _ in range(rounds):
        b = blocked_median(base, min_time)
        o = blocked_median(ours, min_time)
        ts_b.append(b)
        ts_o.append(o)
        ratios.append(o / b)
    return statistics.median(ratios), statistics.median(ts_o), statistics.median(ts_b)


def fmt_t(s: float) -> str:
    return f"{s * 1e6:9.1f} us" if s < 1e-3 else f"{s * 1e3:9.2f} ms"


# ---- 1. the tensor-parallel MLP step ---------------------------------------------------

def single_step(X, W1, W2):
    w1 = W1.clone().requires_grad_()
    w2 = W2.clone().requires_grad_()

    def step():
        w1.grad = w2.grad = None
        y = F.linear(torch.relu(F.linear(X, w1)), w2)
        y.sum().backward()
    return step


def tp_params(X, W1, W2):
    mesh = wb.Mesh.grid(TP, ["tp"])
    x = wb.shard_tensor(X, mesh, [wb.Replicate()])
    w1 = wb.shard_tensor(W1, mesh, [wb.Shard(0)]).requires_grad_()     # column parallel
    w2 = wb.shard_tensor(W2, mesh, [wb.Shard(1)]).requires_grad_()     # row parallel
    return x, w1, w2


def workbench_step(X, W1, W2):
    x, w1, w2 = tp_params(X, W1, W2)

    def step():
        w1.grad = None
        w2.grad = None
        y = F.linear(torch.relu(F.linear(x, w1)), w2)
        y.sum().backward()
    return step


def dtensor_step(X, W1, W2):
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    mesh = DeviceMesh("cpu", torch.arange(TP))
    mode = LocalTensorMode(TP)
    with mode:
        lt = lambda t: LocalTensor({r: t.clone() for r in range(TP)})  # noqa: E731
        x = distribute_tensor(lt(X), mesh, [Replicate()])
        w1 = distribute_tensor(lt(W1), mesh, [Shard(0)]).requires_grad_()
        w2 = distribute_tensor(lt(W2), mesh, [Shard(1)]).requires_grad_()

    def step():
        with mode:
            w1.grad = None
            w2.grad = None
            y = F.linear(torch.relu(F.linear(x, w1)), w2)
            y.sum().backward()
    return step


def check_step(X, W1, W2):
    """The simulated gradients equal one device's (a benchmark of a wrong thing is worthless)."""
    x, w1, w2 = tp_params(X, W1, W2)
    F.linear(torch.relu(F.linear(x, w1)), w2).sum().backward()
    a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    F.linear(torch.relu(F.linear(X, a)), b).sum().backward()
    torch.testing.assert_close(w1.grad.full(), a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w2.grad.full(), b.grad, rtol=1e-4, atol=1e-4)


def run_steps(args) -> int:
    print(f"1. tensor-parallel MLP step, {TP} simulated ranks, forward + backward")
    head = (f"{'size':<24}{'one device':>13}{'workbench':>13}{'ratio':>8}  target"
            + (f"{'DTensor':>14}{'ratio':>8}" if args.dtensor else ""))
    print(head)
    print("-" * len(head))
    misses = 0
    for name, (T, H), min_time in [("toy", (32, 64), args.min_time),
                                   ("large", (1024, 512), max(args.min_time, 1.0))]:
        X = torch.randn(T, H)
        W1, W2 = torch.randn(4 * H, H) / H ** 0.5, torch.randn(H, 4 * H) / H ** 0.5
        check_step(X, W1, W2)
        r, tw, t1 = interleaved(workbench_step(X, W1, W2), single_step(X, W1, W2),
                                args.rounds, min_time)
        hit = r <= TARGET_STEP[name]
        misses += not hit
        row = (f"{name + f' (T={T}, H={H})':<24}{fmt_t(t1):>13}{fmt_t(tw):>13}{r:>7.2f}x"
               f"  <= {TARGET_STEP[name]}x {'PASS' if hit else 'MISS'}")
        if args.dtensor:
            try:
                td = blocked_median(dtensor_step(X, W1, W2), min_time)
                row += f"{fmt_t(td):>14}{td / t1:>7.1f}x"
            except Exception as e:  # noqa: BLE001 - report, keep the rest
                row += f"  (DTensor LocalTensorMode unavailable: {type(e).__name__}: {e})"
        print(row, flush=True)
    return misses


# ---- 2. small collectives on 64 ranks --------------------------------------------------

def coll_cases():
    """(name, ours, torch baseline) at N_COLL ranks, COLL_BYTES per rank."""
    N, n = N_COLL, COLL_BYTES // 4
    mesh = wb.Mesh.grid((N,), ["x"])
    x = torch.randn(N, n)                         # rank k's buffer is x[k]
    shards = list(x.unbind(0))                    # the same buffers as 64 tensors
    tP = wb.DistTensor(x, mesh, (wb.Partial(),), (n,))
    tS = wb.DistTensor(x, mesh, (wb.Shard(0),), (N * n,))
    R, S0 = [wb.Replicate()], [wb.Shard(0)]

    # the values first: each pair computes the same thing
    assert torch.equal(wb.reshard(tS, mesh, R).local(N - 1), torch.cat(shards))
    assert torch.equal(C.all_gather(x, mesh, 0, 0)[0], torch.cat(shards))
    torch.testing.assert_close(wb.reshard(tP, mesh, R).local(3), x.sum(0))
    torch.testing.assert_close(C.all_reduce(x, mesh, 0)[0], x.sum(0))
    torch.testing.assert_close(torch.stack(wb.reshard(tP, mesh, S0).locals()),
                               x.sum(0).view(N, n // N))
    torch.testing.assert_close(C.reduce_scatter(x, mesh, 0, 0), x.sum(0).view(N, n // N))

    cat = lambda: torch.cat(shards)                        # noqa: E731
    sum0 = lambda: x.sum(0, keepdim=True)                  # noqa: E731
    rs = lambda: x.sum(0).view(N, n // N)                  # noqa: E731
    return [
        ("reshard S(0)->R (all-gather)", lambda: wb.reshard(tS, mesh, R), cat, "torch.cat"),
        ("reshard P->R (all-reduce)", lambda: wb.reshard(tP, mesh, R), sum0, "x.sum(0)"),
        ("reshard P->S(0) (reduce-scatter)", lambda: wb.reshard(tP, mesh, S0), rs,
         "x.sum(0).view"),
        ("collectives.all_gather", lambda: C.all_gather(x, mesh, 0, 0), cat, "torch.cat"),
        ("collectives.all_reduce", lambda: C.all_reduce(x, mesh, 0), sum0, "x.sum(0)"),
        ("collectives.reduce_scatter", lambda: C.reduce_scatter(x, mesh, 0, 0), rs,
         "x.sum(0).view"),
    ]


def run_collectives(args) -> int:
    print(f"\n2. small collectives, {N_COLL} simulated ranks, {COLL_BYTES // 1024} KiB float32 "
          "per rank")
    head = f"{'op':<34}{'workbench':>13}{'torch':>13}  {'(as)':<15}{'ratio':>7}  target"
    print(head)
    print("-" * len(head))
    misses = 0
    for name, ours, base, what in coll_cases():
        r, to, tb = interleaved(ours, base, args.rounds, args.min_time)
        hit = r <= TARGET_COLL
        misses += not hit
        print(f"{name:<34}{fmt_t(to):>13}{fmt_t(tb):>13}  {what:<15}{r:>6.2f}x"
              f"  <= {TARGET_COLL}x {'PASS' if hit else 'MISS'}", flush=True)
    return misses


# ---- 3. microseconds per dispatched op -------------------------------------------------

def count_ops(fn) -> int:
    """DistTensor ops one call of ``fn`` dispatches: calls of the dispatcher's entry
    point (and of ``wb.reshard``), watched with ``sys.setprofile`` (untimed)."""
    import importlib
    D = importlib.import_module("workbench.parallel.dispatch")
    RS = importlib.import_module("workbench.parallel.reshard")
    codes = {D.dispatch.__code__, RS.reshard.__code__}
    n = [0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def ops_cases():
    """(name, workbench fn, plain-torch fn) for the per-op workloads."""
    from workbench.models.config import build_model, get_config
    from workbench.models.data import get_batch
    from workbench.recipes.hybrid import Hybrid
    R, S = wb.Replicate(), wb.Shard
    mesh = wb.Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    X, Y = torch.randn(8, 16), torch.randn(8, 16)
    x, y = wb.shard_tensor(X, mesh, [S(0), R]), wb.shard_tensor(Y, mesh, [S(0), R])

    def ew(a, b):
        with torch.no_grad():
            return ((a * 2 + b).tanh() * a - b).relu().sum()
    torch.testing.assert_close(ew(x, y).full(), ew(X, Y))

    A, W = torch.randn(16, 32), torch.randn(32, 24)
    a, w = wb.shard_tensor(A, mesh, [S(0), R]), wb.shard_tensor(W, mesh, [R, S(1)])

    def mm():
        with torch.no_grad():
            return wb.reshard(a @ w, mesh, [R, R])

    def mm_plain():
        with torch.no_grad():
            return A @ W
    torch.testing.assert_close(mm().full(), mm_plain())

    cfg = get_config("gpt-tiny")
    st = Hybrid(dp=2, tp=2)
    model = st.build_model(cfg, 0)
    one = build_model(cfg, 0)
    inp, tgt = get_batch(cfg, 4, 0, 0)

    def gpt():
        model.zero_grad(set_to_none=True)
        return st.forward_backward(model, inp, tgt)

    def gpt_plain():
        one.zero_grad(set_to_none=True)
        _, loss = one(inp, tgt)
        loss.backward()
        return loss.detach()

    def gpt_traced():
        with wb.trace():
            return gpt()

    def gpt_measured():
        with wb.trace(), st.measure_activations():
            return gpt()
    torch.testing.assert_close(gpt(), gpt_plain(), rtol=1e-5, atol=1e-5)
    return [("elementwise 2x2 (8x16)", lambda: ew(x, y), lambda: ew(X, Y)),
            ("matmul + reshard 2x2", mm, mm_plain),
            ("GPT fwd+bwd Hybrid(dp2,tp2)", gpt, gpt_plain),
            ("  ... under wb.trace()", gpt_traced, gpt_plain),
            ("  ... + measure_activations()", gpt_measured, gpt_plain)]


def run_ops(args) -> int:
    print("\n3. microseconds per dispatched DistTensor op (no target)")
    head = (f"{'workload':<30}{'ops':>6}{'workbench':>13}{'us/op':>9}{'torch':>13}"
            f"{'floor us/op':>13}{'ratio':>8}")
    print(head)
    print("-" * len(head))
    for name, ours, base in ops_cases():
        n = count_ops(ours)
        r, to, tb = interleaved(ours, base, args.rounds, args.min_time)
        print(f"{name:<30}{n:>6}{fmt_t(to):>13}{to / n * 1e6:>9.1f}{fmt_t(tb):>13}"
              f"{tb / n * 1e6:>13.2f}{r:>7.1f}x", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--min-time", type=float, default=0.3,
                    help="seconds per blocked_autorange (default 0.3; the large step >= 1)")
    ap.add_argument("--dtensor", action="store_true",
                    help="also time PyTorch DTensor under LocalTensorMode (slow)")
    ap.add_argument("--only", choices=["step", "coll", "ops"], help="run one of the three parts")
    ap.add_argument("--timer", choices=["wall", "cpu"], default="wall",
                    help="wall clock (default) or this process's CPU time (time.process_time: "
                         "less disturbed by other work on a loaded machine)")
    args = ap.parse_args(argv)
    CLOCK[0] = time.process_time if args.timer == "cpu" else time.perf_counter
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; {args.timer} time, median over "
          f"{args.rounds} interleaved rounds (baseline, then workbench)")
    if hasattr(os, "getloadavg"):
        print("load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    misses = 0
    if args.only in (None, "step"):
        misses += run_steps(args)
    if args.only in (None, "coll"):
        misses += run_collectives(args)
    if args.only in (None, "ops"):
        misses += run_ops(args)
    if hasattr(os, "getloadavg"):
        print("\nload average after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"{misses} row(s) missed the target")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
