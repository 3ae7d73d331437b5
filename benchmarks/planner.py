"""How long does the planner take?  Search time for GPT-3 175B on 1,024 devices, and the
time of one ``estimate`` per layout.

    python benchmarks/planner.py [--profile a100] [--devices 1024] [--global-batch 1536]
    python benchmarks/planner.py --model llama2-70b --global-batch 1024    # a Llama

(Llama 2 70B, 1,024 A100s, 1,024 sequences of 4,096 tokens (Llama 2's 4M-token batch,
Touvron et al. 2023 sec. 2.2): 4,752 layouts tried (torchtitan's op-level recompute
among them), 1,281 fit, 1.2 s cold on the 2-core machine shared with other jobs (load
average 5); the best, dp32 tp4 pp8 interleaved v=10 with SP and ZeRO-1, at 64.9% MFU,
tied (0.1%) with dp512 tp2 ZeRO-3 and op-level recompute, by the estimate's count, which
takes attention as 4 b s^2 h per layer (Korthikanti eq. 7) though the causal kernel
computes half of it.)

A mixture of experts (issue 18): Mixtral-8x7B (``plan.presets``, 32K context) on 64 H100s,

    python benchmarks/planner.py --model mixtral-8x7b --profile h100 --devices 64 --global-batch 256

(on the 2-core machine at load average 8-10: 24,981 layouts tried, 3,206 fit, 2.1 s cold;
16,701 and 2,328, 1.5 s at load average 2, before the search tried the all-to-all,
``cp_comm="a2a"``, whose cp4a of the best layout ranks #3, 29.7 s/step, its all-to-alls
waited for where the ring hides its hops.
At the paper's 32K tokens the best is dp1 tp2 pp8 cp4, 27.9 s/step: context parallelism
beats expert parallelism, which is carved out of dp here (Megatron-Core's folding of EP
over CP is not modeled) and leaves too little room for the 32K-token activations.  At
the 4,096 tokens of Megatron-LM's Mixtral example (``--seq-len 4096``): 6,111 tried,
2,505 fit, 1.6 s; the best is dp16 pp4 interleaved v=4 ep8, 2.66 s/step, 51.7% MFU, its
four all-to-alls per layer and micro-batch 0.76 ms inside one node.  The top layout's
``explain()`` follows the table.)

Long context (issue 18): Llama 3 8B at 128K tokens (``llama3-8b-128k``) on 256 A100s,

    python benchmarks/planner.py --model llama3-8b-128k --devices 256 --global-batch 64

(22,536 layouts tried, 5,976 fit, 2.2 s cold at load average 8-10 (18,480 and 5,581
before the search tried ``cp_comm="a2a"``: Llama 3's 8 K/V heads allow it at cp 2 on tp 4);
the best dp16 tp4 cp4 with SP and ZeRO-1, no recompute, 28.4 s/step: each rank keeps 32K
tokens' activations and its ring's K/V hops hide behind the half blocks.  Its MFU, 92.7%,
reads high: the count takes attention as 4 b s^2 h per layer, 83% of the FLOPs at 128K,
twice what the causal kernel computes; the table says so under it.)

Target (issue 21): the search in under 10 s on a 2-core machine; GPT-3 175B on 1,024
A100s: 13,464 layouts tried, 4,188 fit.  On 2026-11-29 it took 7.35 s cold alone, 14.7 s
at load average 6, two thirds of it in the memory filter's walk of interleaved schedules
(``plan.in_flight_peak`` built all p ranks' rows of each (pp, m, v) and checked them to
read one rank); walking that rank's order alone (``schedules.interleaved.rank_order``),
keeping only the vectors a peak can be at: 4.3 s cold in the same minutes, the printed
table unchanged.  The search
is timed cold (empty caches, first call) and warm; ``estimate`` is timed over the
layouts the search kept, cold caches cleared before each timing round, as the median of
5 rounds.
Prints what it measured and the top layouts with the planner's explanation.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workbench.plan import Cluster, costs, ep_cp, estimate, search  # noqa: E402
from workbench.plan import comm_memory, layer_cost, memory  # noqa: E402
from workbench.plan.presets import get_config  # noqa: E402   # + mixtral-8x7b, 128K Llamas


def _clear():
    for fn in (costs.group_price, costs.layer_cost, costs.head_cost, ep_cp._layer,
               layer_cost._flash, memory._gathered_numel):
        fn.cache_clear()
    comm_memory._MEMO.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--profile", default="a100")
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--seq-len", type=int, default=None, help="override the preset's")
    args = ap.parse_args(argv)
    cfg = get_config(args.model, **({"seq_len": args.seq_len} if args.seq_len else {}))
    cl = Cluster(args.profile, args.devices)

    _clear()
    t0 = time.perf_counter()
    ranking = search(cfg, cl, global_batch=args.global_batch, top=5)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    search(cfg, cl, global_batch=args.global_batch, top=5)
    warm = time.perf_counter() - t0
    print(f"search {args.model} on {cl}: {ranking.tried} layouts tried, {ranking.fitting} fit; "
          f"{cold:.2f} s cold, {warm:.2f} s warm (target < 10 s)")

    layouts = [lay for lay, _ in ranking]
    rounds_cold, rounds_warm = [], []
    for _ in range(5):
        _clear()
        t0 = time.perf_counter()
        for lay in layouts:
            estimate(cfg, lay, cl)
        rounds_cold.append((time.perf_counter() - t0) / len(layouts))
        t0 = time.perf_counter()
        for lay in layouts:
            estimate(cfg, lay, cl)
        rounds_warm.append((time.perf_counter() - t0) / len(layouts))
    print(f"estimate per layout: {statistics.median(rounds_cold) * 1e3:.2f} ms cold caches, "
          f"{statistics.median(rounds_warm) * 1e3:.3f} ms warm (median of 5 rounds over the "
          f"top {len(layouts)})")
    print(f"layer times from: {costs.LAYER_TIME_SOURCE}")
    print(ranking)
    if ranking and ep_cp.applies(cfg, ranking[0][0]):     # MoE or context parallel: why
        print(ranking[0][1].explain())


if __name__ == "__main__":
    main()
