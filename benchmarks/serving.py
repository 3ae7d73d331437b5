"""Continuous against static batching on the modeled clock: throughput, time to first
token (TTFT) and time per output token (TPOT), p50 / p99, for a seeded Poisson trace.

    python benchmarks/serving.py [--model llama2-7b] [--profile ascend-910b] [--requests 200]
                                 [--rate 8] [--max-batch 32] [--token-budget 512] [--seed 0]

The schedules and the step prices are :mod:`workbench.serve.batching` (Orca, Yu et al.
OSDI'22; vLLM, Kwon et al. SOSP'23): every step is priced on the profile's roofline, so
the figures say what the schedule buys on that device, not how fast this CPU is.  It
prints the two schedules at ``--rate``, then the throughput ratio over a sweep of
arrival rates, and how that compares with the MindSpore article's claim of 2x+ throughput
from continuous batching with prefill and decode mixed (as issue 19 quotes it).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workbench.serve.batching import StepPricer, continuous, poisson_trace, static  # noqa: E402

COLS = ["schedule", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
        "tpot_p99_ms", "useful_decode", "steps"]


def run(pricer, rate, args):
    trace = poisson_trace(args.requests, rate, prompt=(args.prompt_min, args.prompt_max),
                          output=(args.output_min, args.output_max), seed=args.seed)
    return (continuous(trace, pricer, args.max_batch, args.token_budget),
            static(trace, pricer, args.max_batch))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--profile", default="ascend-910b")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pricer = StepPricer(args.model, args.profile)
    print(f"{args.model} on {args.profile} ({pricer.dtype}); {args.requests} requests, Poisson "
          f"{args.rate:g}/s, prompts U[{args.prompt_min}, {args.prompt_max}], outputs "
          f"U[{args.output_min}, {args.output_max}]; max batch {args.max_batch}, token budget "
          f"{args.token_budget}; KV cache {pricer.kv_capacity():,} tokens")
    one = pricer.seconds(decode=[512]) * 1e3
    full = pricer.seconds(decode=[512] * args.max_batch) * 1e3
    pre = pricer.seconds(prefill=[(0, args.token_budget)]) * 1e3
    print(f"step prices: decode 1 seq {one:.2f} ms, {args.max_batch} seqs {full:.2f} ms "
          f"(memory-bound: {args.max_batch}x the tokens for {full / one:.2f}x the time); "
          f"prefill {args.token_budget} tokens {pre:.2f} ms")
    cont, stat = run(pricer, args.rate, args)
    rows = [cont.summary(), stat.summary()]
    print(" ".join(f"{c:>16}" for c in COLS))
    for r in rows:
        print(" ".join(f"{r[c]:>16}" for c in COLS))
    ratio = cont.throughput / stat.throughput
    print(f"continuous / static throughput at {args.rate:g}/s: {ratio:.2f}x; TTFT p50 "
          f"{stat.ttft_p50 / cont.ttft_p50:.1f}x lower")
    print("\nrate/s  continuous tok/s  static tok/s  ratio")
    sweep = []
    for rate in (1, 2, 4, 8, 16, 32):
        c, s = run(pricer, rate, args)
        sweep.append(c.throughput / s.throughput)
        print(f"{rate:>6}  {c.throughput:>17.1f}  {s.throughput:>12.1f}  {sweep[-1]:>5.2f}x")
    print(f"\nThe MindSpore article claims 2x+ throughput from continuous batching. Here: "
          f"{min(sweep):.2f}x at light load up to {max(sweep):.2f}x once requests queue. "
          f"Under light load the engine idles between arrivals whatever the schedule. "
          f"Under load, static batching computes padded slots for requests already finished "
          f"(only {stat.useful_decode_share:.0%} of its decode tokens were needed at "
          f"{args.rate:g}/s) and keeps new requests waiting for the batch to drain, while "
          f"a decode step is memory-bound (the weights are read once per step), so the "
          f"slots continuous batching keeps full cost almost nothing: the gain grows with "
          f"the padded share (the spread of output lengths) and the queue. The article's "
          f"2x+ is this regime; vLLM (Kwon et al. 2023) reports 2-4x over Orca and "
          f"FasterTransformer at the same latency.")


if __name__ == "__main__":
    main()
