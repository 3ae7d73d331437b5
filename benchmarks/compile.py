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

Measured on the shared 2-core machine (load about 9, so wall times are inflated; a100;
the step priced without a backward collective for a reshard's all_gather / all_reduce,
which the run never makes: see ``compile/propagate.py``'s ``BACKWARD_OF``):

    tiny (llama)      59 ops  capture 2.71 s  greedy 1.14 s  propagate 1.27 s  step 0.347 -> 0.263 ms
    small (llama)    163 ops  capture 0.12 s  greedy 1.61 s  propagate 2.38 s  step 4.327 -> 3.986 ms
    gpt 24 layers    537 ops  capture 0.33 s  greedy 1.08 s  propagate 4.70 s  step 273.644 -> 273.602 ms

With ``--beam 16``: tiny and small the same steps, the GPT 273.347 ms (46,388 states
against 11,948; its wall time was taken beside another job, not quoted).
The first capture pays torch's one-time set-up on meta tensors; the search's time is
mostly the reshard planner's (``plan_reshard`` on the 2-d mesh, once per distinct layout).
The search's keys hold only the live op outputs (inputs and parameters never move), which
took the GPT's propagation from 8.7 s to 1.3 s.
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
