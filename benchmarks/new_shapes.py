"""What new shapes cost the simulator: the dispatcher's first calls, with and without the
zero-communication shortcut (``workbench/parallel/ops_table/free_choice.py``) and the
fast planner search (``workbench/parallel/reshard_search.py``), in wall-clock and CPU
seconds on this machine (not the modeled clock).

    OMP_NUM_THREADS=1 python benchmarks/new_shapes.py [--only engine|train] [--repeat 3]
        [--preset small] [--requests 32] [--tp 2] [--train-preset tiny]
        [--batches 1,2,3,4,5,6,7,8] [--profile]

Two programs whose shapes change from step to step, each run from cold dispatch caches
(every prepared op, decision, reshard plan and plan template forgotten, as in a fresh
process), three ways: "readable planner" (every new shape's decision prices every
candidate with ``reshard._plan_same_mesh``, as before both changes), "fast planner" (the
same decisions, the planner's search by ``reshard_search.plan_steps``), "shortcut" (both):

1. **engine**: ``workbench.serve.Engine`` serving ``--requests`` greedy requests (prompt
   and output lengths drawn as ``benchmarks/engine.py`` draws them, seeded) on
   ``serve_model(preset, tp=--tp)``: the packed step's token count changes at almost
   every step, so almost every step's ops are new layouts;
2. **train**: tensor-parallel training steps (``Hybrid(tp=--tp)``, forward, backward and
   AdamW, in a trace) with the batch size of each step taken from ``--batches``.

Printed per program and way: the best wall-clock and CPU time (this process) of
``--repeat`` cold runs, the full decisions and the shortcut's (``free_choice.COUNTS``),
and whether the two ways gave the same tokens / losses.  ``--profile`` prints the
cProfile of one cold run each way (the parts of a first call: rule, planner, meta checks).
Exit status 1 if the two ways differ.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.models.data import get_batch  # noqa: E402
from workbench.parallel import dispatch as D  # noqa: E402
from workbench.parallel.ops_table import free_choice as FC  # noqa: E402
from workbench.parallel.ops_table import strategy as ST  # noqa: E402
from workbench.recipes.hybrid import Hybrid  # noqa: E402
from workbench.serve.engine import Engine  # noqa: E402

RS = sys.modules["workbench.parallel.reshard"]     # (wb.parallel.reshard is the function)


def cold():
    """Forget what the dispatcher learned: prepared ops, decisions, plans, templates."""
    D._PREPARED.clear()
    ST._infer_cached.cache_clear()
    RS._plan_cached.cache_clear()
    RS._PLANS.clear()
    FC._TEMPLATES.clear()
    ST._COMBINED.clear()        # combine's strategies, each input's price (task speed18b)
    ST._PRICES.clear()


@contextlib.contextmanager
def readable_planner():
    """The planner's search by reshard._plan_same_mesh (the fast one answers None)."""
    fast = RS.plan_steps
    RS.plan_steps = lambda *a: None
    try:
        yield
    finally:
        RS.plan_steps = fast


def engine_program(args):
    cfg = wb.models.get_config(args.preset, dtype="float32")
    one = wb.models.build_model(cfg, seed=0).eval()
    model = wb.serve.serve_model(cfg, tp=args.tp, state_dict=one.state_dict()).model
    g = torch.Generator().manual_seed(args.seed)        # as benchmarks/engine.py draws them
    lens = torch.randint(4, 48 + 1, (args.requests,), generator=g)
    news = [int(n) for n in torch.randint(4, 48 + 1, (args.requests,), generator=g)]
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in lens]
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, news))

    def run():
        e = Engine(model, num_blocks=blocks, block_size=16, max_batch=32)
        out = e.generate_all(prompts, news)
        return out, len(e.log), len({r.tokens for r in e.log})
    return run, f"engine: {args.requests} requests of {args.preset!r} at tp={args.tp}"


def train_program(args):
    cfg = wb.models.get_config(args.train_preset)
    batches = [int(b) for b in args.batches.split(",")]

    def run():
        s = Hybrid(tp=args.tp)
        torch.manual_seed(0)
        model = s.build_model(cfg, 0)
        opt = s.build_optimizer(model, 1e-3, 0.01)
        losses = []
        for step, b in enumerate(batches):
            x, y = get_batch(cfg, b, 0, step)
            with wb.trace():
                losses.append(float(s.forward_backward(model, x, y)))
                s.optimizer_step(opt)
        return losses, len(batches), len(set(batches))
    return run, f"train: {args.train_preset!r} at tp={args.tp}, batch sizes {batches}"


def measure(run, repeat, profile=False):
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        cold()
        before = dict(FC.COUNTS)
        t0, c0 = time.perf_counter(), time.process_time()
        out = run()
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        counts = {k: FC.COUNTS[k] - before[k] for k in before}
    if profile:
        cold()
        pr = cProfile.Profile()
        pr.enable()
        run()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    return out, best_wall, best_cpu, counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("engine", "train"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-preset", default="tiny")
    ap.add_argument("--batches", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    same = True
    for name, make in (("engine", engine_program), ("train", train_program)):
        if args.only not in (None, name):
            continue
        run, title = make(args)
        run()                       # imports and one-time set-up out of the timings
        with FC.disabled(), readable_planner():
            old = measure(run, args.repeat, args.profile)
        with FC.disabled():
            fast = measure(run, args.repeat, args.profile)
        on = measure(run, args.repeat, args.profile)
        steps, shapes = old[0][1], old[0][2]
        print(f"{title}: {steps} steps, {shapes} distinct sizes; torch threads "
              f"{torch.get_num_threads()}; best of {args.repeat} cold runs")
        for way, (out, wall, cpu, n) in (("readable planner", old), ("fast planner", fast),
                                         ("shortcut", on)):
            print(f"  {way:<17} {wall:6.2f} s wall, {cpu:6.2f} s CPU; decisions made in full "
                  f"{n['full']}, by the shortcut {n['free']}")
        eq = old[0][0] == fast[0][0] == on[0][0]
        same &= eq
        print(f"  shortcut against readable planner: {old[1] / on[1]:.2f}x wall, "
              f"{old[2] / on[2]:.2f}x CPU; results equal: {eq}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
