"""eager14: the op-by-op choice prices the backward of its reshards (inputs that require
grad), eager and O0 alike; the dry run files ZeRO-2's exposed reduce-scatter tail under its
sync heading, as the estimate does.

1. Slicing / padding a sharded tensor: the forward-only price took ``x[2:14]`` of a
   row-sharded x by an all-to-all to ``S(1)`` (then the linear sliced its replicated
   weight to ``S(1)``: the weight's gradient all-gathered back), 512 + 4,608 B on rank 0
   against DTensor's all-gather, 2,048 + 0 B (``benchmarks/eager_comm_probe.py``).  With
   the reshards' transposes priced (``ops_table/strategy.backward_price``) both executors
   move DTensor's collectives; with no gradient wanted the forward-only choice stays.

Values are held to one device (float64).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.ops_table import free_choice
from workbench.parallel.ops_table.strategy import infer

R, S = wb.Replicate, wb.Shard


def _v(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _slice_rows(x, w):
    return F.linear(x[2:14], w)


def _pad_rows(x, w):
    return F.linear(F.pad(x, (0, 0, 2, 2)), w)


def _slice_cols(x, w):
    return F.linear(x[:, 4:12], w)


def _narrow_pad(x, w):                 # both at once, then an element-wise op
    return torch.tanh(F.linear(F.pad(x[:, 2:], (0, 2)), w))


CASES = {
    "slice rows": (_slice_rows, [((16, 16), [S(0)]), ((32, 16), [R()])]),
    "pad rows": (_pad_rows, [((16, 16), [S(0)]), ((32, 16), [R()])]),
    "slice cols": (_slice_cols, [((8, 16), [S(1)]), ((32, 8), [R()])]),
    "slice + pad cols": (_narrow_pad, [((8, 16), [S(1)]), ((32, 16), [R()])]),
}


def _run(fn, specs, level, grad=True):
    """(forward {kind: n}, backward {kind: n}, forward bytes, backward bytes on rank 0,
    output, gradients)."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    xs = [wb.shard_tensor(_v(s, k), mesh, ps) for k, (s, ps) in enumerate(specs)]
    if grad:
        xs = [x.requires_grad_() for x in xs]
    call = fn if level == "eager" else wb.compile(fn, *xs, level=level)
    with wb.trace("a100") as tr:
        out = call(*xs)
        n = len(tr.collectives())
        if grad:
            G = wb.shard_tensor(_v(tuple(out.shape), 99), mesh, [R()])
            (out * G).sum().backward()
    ev = [e for e in tr.collectives() if 0 in e.ranks]
    nf = len([e for e in tr.collectives()[:n] if 0 in e.ranks])
    f, b = ev[:nf], ev[nf:]
    return (Counter(e.name for e in f), Counter(e.name for e in b),
            sum(e.args["buffer_bytes"] for e in f), sum(e.args["buffer_bytes"] for e in b),
            out, [x.grad.full() for x in xs] if grad else None)


def _one_device(fn, specs):
    xs = [_v(s, k).requires_grad_() for k, (s, _) in enumerate(specs)]
    out = fn(*xs)
    (out * _v(tuple(out.shape), 99)).sum().backward()
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("name", list(CASES))
def test_slice_pad_priced_with_backward(name):
    """Eager and O0: one all-gather of x in forward (its buffer: x's whole bytes), nothing
    in backward (DTensor's redistribute); values and gradients one device's."""
    fn, specs = CASES[name]
    ref_out, ref_g = _one_device(fn, specs)
    x_bytes = 16 * 8 * 8                    # x's whole buffer, float64
    if name.startswith("slice rows") or name.startswith("pad rows"):
        x_bytes = 16 * 16 * 8
    got = {}
    for level in ("eager", "O0"):
        f, b, fb, bb, out, grads = _run(fn, specs, level)
        torch.testing.assert_close(out.full().detach(), ref_out)
        for g, r in zip(grads, ref_g):
            torch.testing.assert_close(g, r)
        assert f == Counter({"all_gather": 1}) and b == Counter(), (level, f, b)
        assert (fb, bb) == (x_bytes, 0), (level, fb, bb)
        got[level] = (f, b, fb, bb)
    assert got["eager"] == got["O0"]


def test_no_grad_keeps_forward_choice():
    """Without a gradient the forward price alone decides: the all-to-all (512 B against
    the all-gather's 2,048), as before."""
    f, b, fb, bb, out, _ = _run(_slice_rows, CASES["slice rows"][1], "eager", grad=False)
    assert f == Counter({"all_to_all": 1}) and fb == 512 and b == Counter()
    torch.testing.assert_close(out.full(), _one_device(*CASES["slice rows"])[0])


def test_decision_prices_transposes():
    """The decision: x[2:14] of S(0) on 4 ranks.  Forward only: all-to-all to S(1); with
    x's gradient wanted the all-to-all is priced twice (its transpose runs in backward)
    and the all-gather, whose gradient comes back by a local slice, wins; the linear's
    local slice of a replicated weight that requires grad is priced as its gradient's
    all-gather."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    x = wb.TensorSpec((16, 16), mesh, [S(0)], torch.float64)
    with wb.trace("a100"):
        fwd = infer("getitem", x, index=(slice(2, 14),))
        both = infer("getitem", x, index=(slice(2, 14),), _grads=(True,))
    assert fwd.chosen.collectives == ["all_to_all"] and fwd.chosen.backward_bytes == 0
    assert both.chosen.collectives == ["all_gather"]
    a2a = next(c for c in both.candidates if c.collectives == ["all_to_all"])
    assert a2a.backward_bytes == a2a.bytes and a2a.backward_time == pytest.approx(a2a.time)
    assert both.chosen.backward_bytes == 0
    xs = wb.TensorSpec((12, 16), mesh, [S(1)], torch.float64)
    w = wb.TensorSpec((32, 16), mesh, [R()], torch.float64)
    with wb.trace("a100"):
        lin = infer("linear", xs, w, None, _grads=(True, True, False))
        lin_fwd = infer("linear", xs, w, None)
    assert lin_fwd.chosen.strategy.inputs[1] == (S(1),)       # the weight sliced, free
    sliced = next(c for c in lin.candidates if c.strategy.inputs[:2] == ((S(1),), (S(1),)))
    assert sliced.backward_bytes == 32 * 16 * 8 * 3 // 4     # its gradient all-gathered
    assert lin.chosen.rank_key <= sliced.rank_key and lin.chosen is not sliced


def test_free_shortcut_agrees_under_grads():
    """The zero-communication shortcut takes no local slice of an input that requires
    grad as free: its choice is the full decision's (check=True raises otherwise)."""
    mesh = wb.Mesh.grid((4,), ["tp"])
    a = wb.TensorSpec((8, 16), mesh, [S(0)], torch.float64)
    b = wb.TensorSpec((8, 16), mesh, [R()], torch.float64)
    with wb.trace("a100"):
        for grads in ((), (True, True), (False, True), (True, False)):
            d = free_choice.choose("add", (a, b), {}, check=True, grads=grads)
            full = infer("add", a, b, _grads=grads)
            assert d.chosen == full.chosen, grads


# ---- 3. ZeRO-2's exposed reduce-scatter tail under one heading -----------------------------

def test_zero2_sync_tail_filed_under_dp_sync():
    """A toy GPT (h 512, one layer) at tp 8 x dp 2, ZeRO-2, on two 910B nodes: the
    reduce-scatters ZeRO-2's hooks issue in backward end after the backward's compute; the
    dry run filed that tail under "pipeline" (its dp_sync only the step's all-gather: 47
    against the estimate's 157 us).  Now "dp_sync" holds the tail plus the all-gather, read
    off the trace's events, "pipeline" ends with the compute, and the step is unchanged;
    both sides' headings (``agree.headings``) are the dry run's breakdown keys, each side
    summing to its step."""
    from workbench.plan import Cluster, Layout
    from workbench.plan.agree import compare
    from workbench.plan.presets import get_config
    cfg = get_config("gpt3-175b", d_model=512, n_head=8, seq_len=512, vocab_size=4096,
                     n_layer=1)
    lay = Layout(dp=2, tp=8, zero=2, micro_batch=1, global_batch=2)
    ag = compare(cfg, lay, Cluster("ascend-910b", 16))
    dr, est = ag.dry_run, ag.estimate
    ev = dr.trace.events
    comp_end = max(e.end for e in ev if e.stream == "compute")
    rs = [e for e in ev if e.label == "zero-2 grad (async)"]
    ag_ = [e for e in ev if e.name == "all_gather" and e.label == "zero-2 params"]
    assert rs and ag_
    tail = max(e.end for e in rs) - comp_end
    assert tail > 50e-6                                     # (73.6 us: most of the sync)
    step_ag = max(e.end for e in ag_) - min(e.start for e in ag_)
    assert dr.breakdown["dp_sync"] == pytest.approx(tail + step_ag, rel=1e-9)
    start = min(e.start for e in ev)
    assert dr.breakdown["pipeline"] == pytest.approx(comp_end - start, rel=1e-9)
    assert dr.step_time == pytest.approx(max(e.end for e in ev) - start
                                         + dr.breakdown["optimizer"], rel=1e-9)
    h = ag.headings
    assert list(h) == list(dr.breakdown)
    assert sum(e for e, _ in h.values()) == pytest.approx(est.step_time, rel=1e-12)
    assert sum(d for _, d in h.values()) == pytest.approx(dr.step_time, rel=1e-12)
    e_sync, d_sync = h["dp_sync"]
    assert 0.7 < d_sync / e_sync < 1.3, (e_sync, d_sync)   # was 0.30 (47 / 157 us)


# ---- 2. the experts' backward on the runtime's clock (the dry run's) -----------------------

@pytest.mark.parametrize("profile", ["a100", "h100", "ascend-910b"])
def test_expert_backward_reads_weights_and_writes_their_gradients(profile):
    """One MoE layer's experts (the course's "small" Llama, 4 experts, top 2, ep 2, even
    routing) on the runtime's clock (``expert_parallel_clock.record_layer``, what the dry
    run records) against the planner's GEMMs (``moe_cost.backward_ops``: per matrix an
    input-gradient GEMM reading the output gradient and the weights, a weight-gradient
    GEMM reading the activations and the output gradient and writing the weights' size).
    The runtime's backward recorded the forward's bytes (no weight gradient written, one
    GEMM's reads) and one launch per matrix (the planner: two): 910B 24.6 us against the
    planner's 43.3 (forward 19.8 / 21.6); the h100 3 launches short.  Now the runtime's
    backward stands to the planner's as its forward does (the forward's own gap, its
    activation bytes without the [rows, ffn] intermediates, is left)."""
    from workbench.parallel.strategies.expert_parallel import record_layer
    from workbench.plan import Cluster, Layout
    from workbench.plan import moe_cost as M
    from workbench.plan.ep_cp import _price_moe
    from workbench.plan.presets import get_config
    cfg = get_config("small").replace(moe_experts=4, moe_topk=2, n_layer=1, dropout=0.0,
                                      dtype="bfloat16")
    lay = Layout(dp=2, ep=2, micro_batch=1, global_batch=2, framework="workbench")
    e = 2
    _, h, _, _, El, Mr, _, ft, _ = M._dims(cfg, 1, 1, 2, e, False)
    rows = int(round(Mr))
    prof = Cluster(profile, 2).profile
    got = {}
    for phase, ops in (("forward", M.forward_ops(cfg, 1, 1, 2, e, False, False)),
                       ("backward", M.backward_ops(cfg, 1, 1, 2, e, False, False,
                                                   main_grad=False))):
        priced = [o for o in _price_moe(ops, phase, lay, prof, cfg.dtype, False)
                  if o[0].startswith("expert_w")]
        flops = sum(o[2] for o in ops if o[0].startswith("expert_w"))
        matrix = [[0, rows // 2 * h * e], [rows // 2 * h * e, 0]]
        with wb.trace(profile=profile) as tr:
            record_layer(tr, [((0, 1), matrix, [rows, rows])], 3 * h * ft,
                         El * 3 * h * ft * e, h * e, torch.bfloat16, 1, phase)
        ev, = [x for x in tr.events if x.name == f"experts {phase}" and 0 in x.ranks]
        assert ev.flops == flops
        got[phase] = (ev.duration, ev.bytes, sum(o[3] for o in priced))
    (tf, bf, pf), (tb, bb, pb) = got["forward"], got["backward"]
    assert bb == 2 * bf                  # the weights read (dgrad) and written (wgrad)
    # the runtime against the planner: the backward as the forward (910B: 0.57 against
    # 0.92 before); on the h100 (measured rates per GEMM shape) the same time
    assert tb / pb == pytest.approx(tf / pf, rel=1e-9)
    if profile == "h100":
        assert (tf, tb) == (pytest.approx(pf, rel=1e-9), pytest.approx(pb, rel=1e-9))
    else:                                 # roofline rates: twice the forward's work
        assert (tb, pb) == (pytest.approx(2 * tf, rel=1e-9), pytest.approx(2 * pf, rel=1e-9))
