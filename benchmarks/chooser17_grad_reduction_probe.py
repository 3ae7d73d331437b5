"""chooser17 probe (gap 1, not adopted): how many eager choices change, and what the traced
forward + backward does, if the chooser priced the gradient reduction of a replicated input
read per rank (an op whose strategy leaves that input's gradient Partial along a mesh dim:
the backward all-reduce, or the reduce-scatter back to a gathered input's shards).

The price added here is ``compile/propagate._Pricer.grad_reduction``'s rule (the planner's
plan from the Partial gradient back to the copy's layout), charged to every reader of
every such input (an upper bound: no sharing between readers, no data-parallel replica
dims), monkeypatched into ``strategy.backward_price``; the free-choice shortcut is off in
both runs so the full decisions are compared.  DTensor's own selection prices the forward
redistribute cost only (torch 2.13 git cf30153, torch/distributed/tensor/
_sharding_prop.py:295-360 ``_select_min_cost_strategy``) and runs the all-reduce where the
Partial gradient meets ``from_local``'s backward (``_api.py:239-286``): the current choices
are DTensor's.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/chooser17_grad_reduction_probe.py
"""
import sys, math
from collections import Counter
import torch
import workbench as wb
from workbench.parallel.ops_table import strategy as st
from workbench.parallel.ops_table import free_choice
from workbench.parallel.placement import Partial
R, S = wb.Replicate, wb.Shard
orig_bp = st.backward_price
MODE = ["old"]

def red_price(specs, plans, grads, strat, profile):
    """(seconds, wire bytes) of the gradient reductions of the inputs that require grad
    and that ``strat`` reads per rank (``strategy.grad_reduction_steps``: compile's rule)."""
    from workbench.sim_mesh import cost as _cost
    from workbench.parallel.spec import TensorSpec
    prof = st.get_profile(profile)
    mesh = next(s for s in specs if s is not None).mesh
    diverge = [i for i in range(mesh.ndim)
               if any(not ps[i].is_replicate() for ps in strat.outputs)]
    t = b = 0
    for spec, plan, g, req in zip(specs, plans, grads, strat.inputs):
        if not g or spec is None or req is None:
            continue
        dims = [i for i in diverge if req[i].is_replicate()]
        if not dims:
            continue
        copy = TensorSpec(spec.shape, mesh, tuple(req), spec.dtype, _trusted=True)
        for s_ in st.grad_reduction_steps(copy, plan, dims, None, profile):
            gs = mesh.groups(s_.mesh_dim)
            t += max(_cost.price(s_.kind, s_.buffer_bytes, gg, prof) for gg in gs)
            b += _cost.wire_bytes(s_.kind, s_.buffer_bytes, len(gs[0]))
    return t, b


orig_sc = st.strategy_cost
CUR = [None]
def sc(specs, s, profile):
    CUR[0] = s
    return orig_sc(specs, s, profile)
def bp(specs, plans, grads, profile):
    t, b = orig_bp(specs, plans, grads, profile)
    if MODE[0] == "new":
        t2, b2 = red_price(specs, plans, grads, CUR[0], profile)
        t, b = t + t2, b + b2
    return t, b
st.strategy_cost = sc
st.backward_price = bp

DEC = []
orig_ic = st._infer_cached
ic_dummy = 0
def ic(op, specs, frozen, profile, grads=()):
    d = orig_ic(op, specs, frozen, profile, grads)
    DEC.append((op, tuple(tuple(s.placements) if s is not None else None for s in specs), grads != (), d.chosen.strategy))
    return d
ic.cache_clear = orig_ic.cache_clear
st._infer_cached = ic

def run(name, build):
    out = {}
    for mode in ("old", "new"):
        MODE[0] = mode
        from workbench.parallel.ops_table.table import _changed; _changed(); orig_ic.cache_clear(); DEC.clear()
        with free_choice.disabled():
            call, x = build()
            with wb.trace("a100") as tr:
                loss = call(x)
                loss = (loss[0] if isinstance(loss, tuple) else loss).float().pow(2).mean()
                n = len(tr.collectives())
                loss.backward()
            ev = [e for e in tr.collectives() if 0 in e.ranks]
            out[mode] = (list(DEC), sum(e.bytes for e in ev[:n]), sum(e.bytes for e in ev[n:]),
                         len(ev), tr.end_time if hasattr(tr, "end_time") else max(e.start + e.duration for e in tr.events))
    a, b = out["old"], out["new"]
    ch = [(x, y) for x, y in zip(a[0], b[0]) if x != y]
    print(f"{name}: decisions {len(a[0])}/{len(b[0])}, changed {len(ch)}; fwd B {a[1]}->{b[1]}, bwd B {a[2]}->{b[2]}, colls {a[3]}->{b[3]}, time {a[4]*1e6:.2f}->{b[4]*1e6:.2f} us")
    for x, y in ch[:6]:
        print("   ", x[0], x[1], x[2], fmt(x[3]), "->", fmt(y[3]))

def fmt(s):
    from workbench.parallel.placement import fmt_placements
    return "(" + ", ".join(fmt_placements(p) if p is not None else "-" for p in s.inputs) + ")->" + ",".join(fmt_placements(p) for p in s.outputs)

def gpt(mesh_shape):
    from workbench.models.gpt import TP_PLAN, GPTLayer
    def b():
        mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
        g = torch.Generator().manual_seed(0)
        X = torch.randn((4, 2, 16), generator=g)
        layer = wb.parallelize(GPTLayer(16, 2, dropout=0.0, dtype=torch.float32), mesh, TP_PLAN, mesh_dim="tp")
        x = wb.shard_tensor(X, mesh, [S(1), R()] if len(mesh_shape) == 2 else [R()])
        return layer, x
    return b

def llama(mesh_shape, gpt_=False):
    from workbench.models import TP_PLAN, GPT_TP_PLAN, build_model, get_config
    def b():
        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=64, seq_len=8, dropout=0.0, dtype="float32", **({"arch": "gpt"} if gpt_ else {}))
        mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
        idx = torch.randint(0, 75, (2, 8), generator=torch.Generator().manual_seed(0))
        m = wb.parallelize(build_model(cfg, seed=0), mesh, GPT_TP_PLAN if gpt_ else TP_PLAN, mesh_dim="tp")
        x = wb.shard_tensor(idx, mesh, [S(0), R()] if len(mesh_shape) == 2 else [R()])
        return m, x
    return b

for nm, bld in [("gpt layer tp4", gpt((4,))), ("gpt layer 2x2", gpt((2, 2))),
                ("llama tp4", llama((4,))), ("llama 2x2", llama((2, 2)))]:
    try:
        run(nm, bld)
    except Exception as e:
        import traceback; traceback.print_exc()
