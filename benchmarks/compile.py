"""How long does ``wb.compile`` take?  Capture and whole-graph propagation time for the
tiny and small Llama and a 24-layer GPT, on meta tensors (no data), dp2 x tp2.

    python benchmarks/compile.py [--profile a100] [--beam 4]

Each model is built on the meta device and parallelized with its own tensor-parallel plan
(``model.tp_plan(2)``) on a (dp=2, tp=2) mesh; the batch is sharded over dp.  Timed, cold
(fresh caches: the op table's decisions and the reshard plans are cached per process):

* capture: ``torch.export`` is not tried (``method="trace"``: export cannot take the
  models' fused ``wb.ops`` calls, see ``compile/export.py``), then tracing on meta;
* greedy: the op-by-op choice, priced;
* propagate: the whole-graph search (beam ``--beam``, 6 candidates per op).

Prints the ops captured, the times, and the modeled step of both choices.

Measured on the shared 2-core machine (load about 1.4; a100), with the search's
objective equal to the O1 step the program replays (``tests/test_compile_estimate_agrees.py``:
a reshard read by several ops priced once, a linear's backward as its two kernels):

    tiny (llama)      59 ops  capture 0.84 s  greedy 0.07 s  propagate 0.14 s  step 0.362 -> 0.278 ms
    small (llama)    163 ops  capture 0.03 s  greedy 0.11 s  propagate 0.48 s  step 4.439 -> 4.203 ms
    gpt 24 layers    537 ops  capture 0.14 s  greedy 0.15 s  propagate 1.00 s  step 282.365 -> 282.228 ms

With ``--beam 16`` (propagate 0.65, 1.12, 2.96 s): tiny and the GPT the same steps, the
small Llama 4.098 ms: beam 4 keeps every layer after the first sequence-sharded
through its attention (cheaper on the partial sums, dearer later), beam 16 finds the layout beam 4 found when
the objective priced shared reshards per consumer (its step then 4.098 ms as well).
The first capture pays torch's one-time set-up on meta tensors; the search's time is
mostly the reshard planner's (``plan_reshard`` on the 2-d mesh, once per distinct layout).
The search's keys hold only the live op outputs (inputs and parameters never move), and
the other layouts already made of tensors still read; keying on the live outputs took the
GPT's propagation from 8.7 s to 1.3 s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.compile.capture import capture  # noqa: E402
from workbench.compile.propagate import greedy, propagate  # noqa: E402
from workbench.models import build_model, get_config  # noqa: E402

MODELS = {
    "tiny (llama)": dict(preset="tiny", batch=8),
    "small (llama)": dict(preset="small", batch=8),
    "gpt 24 layers": dict(preset="gpt-tiny", batch=8,
                          overrides=dict(n_layer=24, d_model=1024, n_head=16, seq_len=1024)),
}


def _clear():
    from workbench.parallel.ops_table.strategy import _infer_cached
    from workbench.parallel import reshard
    _infer_cached.cache_clear()
    for name in ("_plan_cached",):
        fn = getattr(reshard, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def run(name, spec, profile, beam):
    cfg = get_config(spec["preset"], **spec.get("overrides", {}))
    with torch.device("meta"):
        model = build_model(cfg)
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    wb.parallelize(model, mesh, model.tp_plan(2), mesh_dim="tp")
    R, S = wb.Replicate(), wb.Shard(0)
    ids = torch.zeros(spec["batch"], cfg.seq_len, dtype=torch.long, device="meta")
    x = wb.shard_tensor(ids, mesh, [S, R])
    _clear()
    t0 = time.perf_counter()
    graph, placements = capture(model, (x, x), "trace")
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = greedy(graph, placements, mesh, profile)
    t_greedy = time.perf_counter() - t0
    t0 = time.perf_counter()
    a = propagate(graph, placements, mesh, profile, beam=beam)
    t_prop = time.perf_counter() - t0
    print(f"{name:<14} {len(graph.nodes):>5} ops  capture {t_cap:6.2f} s  greedy "
          f"{t_greedy:6.2f} s  propagate {t_prop:7.2f} s ({a.states:,d} states)  step "
          f"greedy {g.time * 1e3:8.3f} ms, whole-graph {a.time * 1e3:8.3f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100")
    ap.add_argument("--beam", type=int, default=4)
    args = ap.parse_args(argv)
    print(f"wb.compile on meta tensors, dp2 x tp2, {args.profile}, beam {args.beam}")
    for name, spec in MODELS.items():
        run(name, spec, args.profile, args.beam)


if __name__ == "__main__":
    main()
