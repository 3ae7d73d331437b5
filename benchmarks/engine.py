"""The generating engine against serving one request at a time, in wall-clock seconds on
this machine (not the modeled clock): continuous batching (``workbench.serve.Engine``,
one packed forward per step) against ``workbench.serve.generate`` called once per request
(a KV cache each), with the tokens held equal.

    OMP_NUM_THREADS=1 python benchmarks/engine.py [--preset small] [--requests 32]
        [--prompt-min 4] [--prompt-max 48] [--output-min 4] [--output-max 48]
        [--block-size 16] [--max-batch 32] [--dtype float32] [--seed 0] [--repeat 3]

Prompt and output lengths are drawn uniformly (seeded); every request is greedy.  Each
way runs ``--repeat`` times; the best wall-clock and the best CPU time of each are printed
(a shared CPU's noise only adds time; with one thread the process's CPU time is the
steadier figure when other jobs compete for the cores).  The engine's pool holds every request at once (no preemption).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.serve import generate  # noqa: E402
from workbench.serve.engine import Engine  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=4)
    ap.add_argument("--prompt-max", type=int, default=48)
    ap.add_argument("--output-min", type=int, default=4)
    ap.add_argument("--output-max", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = wb.models.get_config(args.preset, dtype=args.dtype)
    model = wb.models.build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g)
    news = torch.randint(args.output_min, args.output_max + 1, (args.requests,), generator=g)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in lens]
    news = [int(n) for n in news]
    blocks = sum(-(-(len(p) + n) // args.block_size) for p, n in zip(prompts, news))

    def engine():
        e = Engine(model, num_blocks=blocks, block_size=args.block_size,
                   max_batch=args.max_batch)
        return e.generate_all(prompts, news)

    def one_by_one():
        return [generate(model, torch.tensor([p]), n)[0, len(p):].tolist()
                for p, n in zip(prompts, news)]

    times, cpu, outs = {}, {}, {}
    for name, fn in (("engine", engine), ("one by one", one_by_one)):
        times[name] = cpu[name] = float("inf")
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] = fn()
            times[name] = min(times[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    same = outs["engine"] == outs["one by one"]
    total = sum(len(p) for p in prompts) + sum(news)
    print(f"{args.requests} requests of {args.preset!r} ({args.dtype}), {sum(news)} new tokens "
          f"({total} with the prompts), torch threads {torch.get_num_threads()}")
    print(f"engine {times['engine']:.2f} s, one by one {times['one by one']:.2f} s "
          f"({times['one by one'] / times['engine']:.1f}x); CPU time (this process) engine "
          f"{cpu['engine']:.2f} s, one by one {cpu['one by one']:.2f} s; tokens equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
