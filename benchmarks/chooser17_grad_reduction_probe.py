"""chooser17 probe (gap 1, not adopted): how many eager choices change, and what the traced
forward + backward does, if the chooser priced the gradient reduction of a replicated input
read per rank (an op whose strategy leaves that input's gradient Partial along a mesh dim:
the backward all-reduce, or the reduce-scatter back to a gathered input's shards).

The price added here is ``compile/propagate._Pricer.grad_reduction``'s rule (the planner's
plan from the Partial gradient back to the copy's layout), monkeypatched into
``strategy.backward_price``, two ways: ``upper`` charges every reader of every such input;
``once`` only the dims along which the input is one copy (its local held once, or gathered
by the plan) and only its first per-rank reader (later readers meet on the same identity
node, ``reshard_backward.gather``, and the run reduces once), as the run records it; the free-choice shortcut is off in
both runs so the full decisions are compared.  DTensor's own selection prices the forward
redistribute cost only (torch 2.13 git cf30153, torch/distributed/tensor/
_sharding_prop.py:295-360 ``_select_min_cost_strategy``) and runs the all-reduce where the
Partial gradient meets ``from_local``'s backward (``_api.py:239-286``): the current choices
are DTensor's.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/chooser17_grad_reduction_probe.py

Measured (this commit, a100 profile, traced forward + backward, rank 0; ``once`` gave the
same as ``upper`` on every model):

    GPTLayer tp4          2/23 decisions change, 4,800 -> 4,608 B, 99.43 -> 79.39 us
    GPTLayer dp2 x tp2   23/23, 7,904 -> 2,816 B, 132.67 -> 78.11 us (the batch gathered)
    tiny Llama tp4       10/22, 34,752 -> 32,256 B, 131.46 -> 98.59 us (weights gathered)
    tiny Llama dp2 x tp2 22/22, 54,528 -> 21,568 B, 152.17 -> 92.18 us (the batch gathered)

Lower traced time at these toy sizes, where compute is a few microseconds; at a real width
(:func:`real_sizes`) the same price gathers a 4096-wide column-parallel weight over tp, or
an 8192-wide one's batch over dp: communication traded for replicated compute and memory
that the chooser's rank key (communication only) does not see, against DTensor's choice.
"""
import torch

import workbench as wb
from workbench.parallel import dispatch as _dispatch
from workbench.parallel import reshard_backward as _rb
from workbench.parallel.ops_table import free_choice
from workbench.parallel.ops_table import strategy as st
from workbench.parallel.ops_table.table import _changed
from workbench.parallel.placement import fmt_placements

R, S = wb.Replicate, wb.Shard
MODE = ["old"]
_orig_bp, _orig_sc, _orig_ic = st.backward_price, st.strategy_cost, st._infer_cached
_orig_grads, _orig_key = _dispatch._grads, st.grads_key
CUR = [None]
DEC = []


class Once(frozenset):
    """A ``_grads`` entry (mode ``once``): requires grad; the mesh dims along which the
    input's local is one copy and no reader has met on it yet (-1 keeps it truthy)."""


def _grads(inputs):
    out = _orig_grads(inputs)
    if MODE[0] != "once" or not out:
        return out
    out = list(out)
    for k, x in enumerate(inputs):
        if out[k] is True and type(x._local) is torch.Tensor:
            loc = x._local
            met = any(h[0] is loc for h in _rb._entries(x).values())
            dims = () if met else tuple(
                i for i, n in enumerate(x.mesh.shape)
                if n > 1 and (loc.shape[i] == 1 or x.placements[i].is_shard()))
            out[k] = Once((-1,) + dims)
    return tuple(out)


def grads_key(grads):
    g = tuple(x if type(x) in (tuple, Once) else bool(x) for x in grads)
    return g if any(g) else ()


def red_price(specs, plans, grads, strat, profile):
    """(seconds, wire bytes) of the gradient reductions of the inputs that require grad
    and that ``strat`` reads per rank (``strategy.grad_reduction_steps``: compile's rule)."""
    from workbench.parallel.spec import TensorSpec
    from workbench.sim_mesh import cost as _cost
    prof = st.get_profile(profile)
    mesh = next(s for s in specs if s is not None).mesh
    diverge = [i for i in range(mesh.ndim)
               if any(not ps[i].is_replicate() for ps in strat.outputs)]
    t = b = 0
    for spec, plan, g, req in zip(specs, plans, grads, strat.inputs):
        if not g or spec is None or req is None or type(g) is tuple:
            continue
        dims = [i for i in diverge if req[i].is_replicate() and
                (type(g) is not Once or i in g)]
        if not dims:
            continue
        copy = TensorSpec(spec.shape, mesh, tuple(req), spec.dtype, _trusted=True)
        for s_ in st.grad_reduction_steps(copy, plan, dims, None, profile):
            gs = mesh.groups(s_.mesh_dim)
            t += max(_cost.price(s_.kind, s_.buffer_bytes, gg, prof) for gg in gs)
            b += _cost.wire_bytes(s_.kind, s_.buffer_bytes, len(gs[0]))
    return t, b


def sc(specs, strat, profile):
    CUR[0] = strat
    return _orig_sc(specs, strat, profile)


def bp(specs, plans, grads, profile):
    t, b = _orig_bp(specs, plans, tuple(True if type(g) is Once else g for g in grads),
                    profile)
    if MODE[0] != "old":
        t2, b2 = red_price(specs, plans, grads, CUR[0], profile)
        t, b = t + t2, b + b2
    return t, b


def ic(op, specs, frozen, profile, grads=()):
    d = _orig_ic(op, specs, frozen, profile, grads)
    DEC.append((op, tuple(None if s is None else tuple(s.placements) for s in specs),
                d.chosen.strategy))
    return d


ic.cache_clear = _orig_ic.cache_clear
st.strategy_cost, st.backward_price, st._infer_cached = sc, bp, ic
st.grads_key, _dispatch._grads = grads_key, _grads


def fmt(s):
    return "(" + ", ".join(fmt_placements(p) if p is not None else "-" for p in s.inputs) + \
        ") -> " + ", ".join(fmt_placements(p) for p in s.outputs)


def traced(build, mode):
    MODE[0] = mode
    _changed()
    DEC.clear()
    with free_choice.disabled():
        call, x = build()
        with wb.trace("a100") as tr:
            loss = call(x)
            loss = (loss[0] if isinstance(loss, tuple) else loss).float().pow(2).mean()
            n = len([e for e in tr.collectives() if 0 in e.ranks])
            loss.backward()
    ev = [e for e in tr.collectives() if 0 in e.ranks]
    return (list(DEC), sum(e.bytes for e in ev[:n]), sum(e.bytes for e in ev[n:]), len(ev),
            tr.time())


def run(name, build):
    a = traced(build, "old")
    print(f"{name}: old: {len(a[0])} decisions, traced fwd {a[1]:,d} B, bwd {a[2]:,d} B, "
          f"{a[3]} collectives (rank 0), {a[4] * 1e6:.2f} us")
    for mode in ("upper", "once"):
        b = traced(build, mode)
        ch = [(x, y) for x, y in zip(a[0], b[0]) if x != y]
        print(f"  {mode}: {len(ch)} of {len(b[0])} decisions changed; traced fwd {b[1]:,d} B, "
              f"bwd {b[2]:,d} B, {b[3]} collectives, {b[4] * 1e6:.2f} us")
        for x, y in ch[:4]:
            print(f"    {x[0]} {[fmt_placements(p) if p else '-' for p in x[1]]}: "
                  f"{fmt(x[2])}  =>  {fmt(y[2])}")


def gpt(mesh_shape):
    from workbench.models.gpt import TP_PLAN, GPTLayer

    def b():
        mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
        X = torch.randn((4, 2, 16), generator=torch.Generator().manual_seed(0))
        layer = wb.parallelize(GPTLayer(16, 2, dropout=0.0, dtype=torch.float32), mesh,
                               TP_PLAN, mesh_dim="tp")
        return layer, wb.shard_tensor(X, mesh, [S(1), R()] if len(mesh_shape) == 2 else [R()])
    return b


def llama(mesh_shape):
    from workbench.models import TP_PLAN, build_model, get_config

    def b():
        cfg = get_config("tiny", n_layer=1, d_model=32, n_head=2, d_ff=64, seq_len=8,
                         dropout=0.0, dtype="float32")
        mesh = wb.Mesh.grid(mesh_shape, ["dp", "tp"][-len(mesh_shape):])
        idx = torch.randint(0, 75, (2, 8), generator=torch.Generator().manual_seed(0))
        m = wb.parallelize(build_model(cfg, seed=0), mesh, TP_PLAN, mesh_dim="tp")
        return m, wb.shard_tensor(idx, mesh, [S(0), R()] if len(mesh_shape) == 2 else [R()])
    return b


def real_sizes():
    """One linear's decision (specs only, nothing runs) at a real width: x [S(0), R] bf16
    on dp 2 x tp 2 (a100), the weight column-parallel [R, S(0)], both requiring grad.  The
    rank key is communication only: charged the reductions, the chooser gathers the
    weight over tp or the batch over dp, whose replicated compute it does not see."""
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    for shape, h in [((8, 2048, 4096), 4096), ((2, 2048, 8192), 8192)]:
        x = wb.TensorSpec(shape, mesh, [S(0), R()], torch.bfloat16)
        w = wb.TensorSpec((h, h), mesh, [R(), S(0)], torch.bfloat16)
        for mode in ("old", "upper"):
            MODE[0] = mode
            _changed()
            c = st.infer_on("a100", "linear", x, w, None, _grads=(True, True, False)).chosen
            print(f"  linear x{shape} w({h}, {h}) {mode}: {fmt(c.strategy)}; forward "
                  f"{c.bytes:,d} B {c.time * 1e6:.1f} us, backward priced "
                  f"{c.backward_bytes:,d} B {c.backward_time * 1e6:.1f} us")


if __name__ == "__main__":
    for nm, bld in [("GPTLayer tp4", gpt((4,))), ("GPTLayer dp2 x tp2", gpt((2, 2))),
                    ("tiny Llama tp4", llama((4,))), ("tiny Llama dp2 x tp2", llama((2, 2)))]:
        run(nm, bld)
    real_sizes()
