"""Compute/communication overlap: decomposed collectives and multi-copy, exact and timed.

Values: every chunked op is compared with the library's unsplit collectives.
With integer-valued data every summation order gives the same float, so these
checks are torch.equal whatever the BLAS does.  With random floats they are
allclose only: MKL picks different micro-kernels for different row counts and
sums K in a different order (measured here: about 1 in 6 random shapes differ in
the last bit), so splitting rows is exact in exact arithmetic but not bitwise.

Time: on a profile without link latency whose kernels are FLOP-bound, a chunk
costs c = C/k and m = M/k, and the measured numbers must match the two-stage
pipeline formula of ``overlap.expected_hidden_share``.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench as wb
from workbench.parallel.strategies.overlap import (OverlapReport, all_gather_matmul,
                                                   expected_hidden_share, exposed_intervals,
                                                   matmul_all_reduce, matmul_reduce_scatter)
from workbench.parallel.strategies.overlap_multicopy import (LayerParams, init_layer,
                                                             multi_copy_estimate,
                                                             multi_copy_layer, tp_layer)
from workbench.parallel.strategies.overlap_sweep import meta_inputs, overlap_sweep
from workbench.sim_mesh.collectives import all_gather, all_reduce, reduce_scatter
from workbench.sim_mesh.profiles import Link, Profile

OPS = (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter)


def flat_profile(flops=1e12, link=1e11, latency=0.0, memory=1e18):
    """No latency, (almost) infinite memory bandwidth: chunks cost exactly C/k and M/k."""
    return Profile(name="flat", description="test profile",
                   peak_flops={"float32": flops, "bfloat16": flops, "float16": flops},
                   memory_bandwidth=memory, memory_bytes=10 ** 12, devices_per_node=64,
                   intra_node=Link("test link", link, latency),
                   inter_node=Link("test link", link, latency))


def ints(*shape, gen):
    return torch.randint(-4, 5, shape, generator=gen).float()


def inputs(op, mesh, ax, rows, K, N, gen, *, integer=True):
    """Stacked x, w for op (rows = local rows of x), leading axes p at ax, 1 elsewhere."""
    p = mesh.shape[ax]
    lead = [1] * mesh.ndim
    lead[ax] = p
    mk = ints if integer else (lambda *s, gen: torch.randn(*s, generator=gen))
    if op is all_gather_matmul:
        return mk(*lead, rows, K, gen=gen), mk(*lead, K, N, gen=gen)
    return mk(*lead, rows, K, gen=gen), mk(*lead, K, N, gen=gen)


def unsplit(op, x, w, mesh, ax):
    if op is matmul_all_reduce:
        return all_reduce(x @ w, mesh, ax)
    if op is all_gather_matmul:
        return all_gather(x, mesh, ax, 0) @ w
    return reduce_scatter(x @ w, mesh, ax, 0)


MESHES = [(wb.Mesh.grid(4, ("tp",)), 0), (wb.Mesh.grid((2, 2), ("dp", "tp")), 1),
          (wb.Mesh.grid((2, 3), ("tp", "dp")), 0)]


# ---- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("mesh,ax", MESHES, ids=["tp4", "dp2xtp2", "tp2xdp3"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_chunked_equals_unsplit_exactly(op, mesh, ax, k):
    gen = torch.Generator().manual_seed(k)
    rows = 5 * mesh.shape[ax]                       # uneven chunks for k = 2, 3
    x, w = inputs(op, mesh, ax, rows, 6, 7, gen)
    y, rep = op(x, w, mesh, mesh.dim_names[ax], chunks=k)
    ref = unsplit(op, x, w, mesh, ax)
    assert y.shape == ref.shape and torch.equal(y, ref)
    assert rep.k == k and rep.kind == op.__name__


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_random_floats_agree_to_rounding(op):
    mesh, ax = MESHES[1]
    gen = torch.Generator().manual_seed(0)
    x, w = inputs(op, mesh, ax, 42, 33, 17, gen, integer=False)
    y, _ = op(x, w, mesh, ax, chunks=3)
    torch.testing.assert_close(y, unsplit(op, x, w, mesh, ax), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), p=st.sampled_from([1, 2, 4]), per=st.integers(1, 6),
       K=st.integers(1, 9), N=st.integers(1, 9), data=st.data())
def test_hypothesis_exact_over_k_and_sizes(op, p, per, K, N, data):
    mesh = wb.Mesh.grid(p, ("tp",))
    rows = per * p
    kmax = per if op is matmul_reduce_scatter else rows
    k = data.draw(st.integers(1, kmax), label="k")
    x, w = inputs(op, mesh, 0, rows, K, N * p if op is all_gather_matmul else N,
                  torch.Generator().manual_seed(rows * 100 + K * 10 + N))
    if op is all_gather_matmul:
        w = w[..., :N]
    y, rep = op(x, w, mesh, 0, chunks=k)
    assert torch.equal(y, unsplit(op, x, w, mesh, 0))
    assert_well_formed(rep.events)


def test_autograd_flows_through_the_chunks():
    mesh, ax = MESHES[0]
    gen = torch.Generator().manual_seed(1)
    x, w = inputs(matmul_all_reduce, mesh, ax, 8, 4, 3, gen)
    x.requires_grad_()
    y, _ = matmul_all_reduce(x, w, mesh, ax, chunks=4)
    (gx,) = torch.autograd.grad(y.sum(), [x])
    xr = x.detach().requires_grad_()
    (gr,) = torch.autograd.grad(all_reduce(xr @ w, mesh, ax).sum(), [xr])
    assert torch.equal(gx, gr)


# ---- the modeled clock --------------------------------------------------------------------

def assert_well_formed(events):
    """No two events overlap on one stream of one rank; durations are >= 0."""
    by = {}
    for e in events:
        assert e.duration >= 0 and e.stream in ("compute", "comm")
        for r in e.ranks:
            by.setdefault((r, e.stream), []).append((e.start, e.end))
    for iv in by.values():
        iv.sort()
        for (s0, e0), (s1, e1) in zip(iv, iv[1:]):
            assert s1 >= e0 - 1e-15


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_dependencies_on_the_clock(op):
    mesh, ax = MESHES[1]
    x, w = meta_inputs(op, (64, 32, 48), mesh, ax, torch.float32)
    _, rep = op(x, w, mesh, ax, chunks=4, profile="ascend-910b")
    ev = rep.events
    assert_well_formed(ev)
    comp = [e for e in ev if e.stream == "compute"]
    comm = [e for e in ev if e.stream == "comm"]
    groups = len(mesh.groups(ax))
    assert len(comp) == 4 and len(comm) == 4 * groups
    for i, c in enumerate(comp):
        mine = [e for e in comm if e.label == f"chunk {i}"]
        assert len(mine) == groups and c.label == f"chunk {i}"
        for m in mine:
            if op is all_gather_matmul:       # the matmul needs its gathered chunk
                assert c.start >= m.end - 1e-15
            else:                             # the collective needs the matmul's result
                assert m.start >= c.end - 1e-15
    assert rep.total == pytest.approx(max(e.end for e in ev) - min(e.start for e in ev))


def per_chunk(rep):
    c = {e.duration for e in rep.events if e.stream == "compute"}
    m = {e.duration for e in rep.events if e.stream == "comm"}
    assert len(c) == 1 and len(m) == 1          # equal chunks
    return c.pop(), m.pop()


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("link", [1e9, 3e11])   # comm-bound and compute-bound
def test_hidden_share_matches_the_pipeline_formula(op, link):
    prof = flat_profile(link=link)
    mesh = wb.Mesh.grid(4, ("tp",))
    x, w = meta_inputs(op, (1024, 512, 512), mesh, 0, torch.float32)
    _, base = op(x, w, mesh, 0, chunks=1, profile=prof)
    C, M = base.compute, base.comm
    last = 0.0
    for k in (1, 2, 4, 8, 16):
        _, rep = op(x, w, mesh, 0, chunks=k, profile=prof)
        c, m = per_chunk(rep)
        assert c == pytest.approx(C / k) and m == pytest.approx(M / k)
        assert rep.exposed == pytest.approx(m + (k - 1) * max(0.0, m - c))
        assert rep.total == pytest.approx(c + m + (k - 1) * max(c, m))
        share = (1 - 1 / k) * min(1.0, C / M)
        assert rep.hidden_share == pytest.approx(share)
        assert rep.hidden_share == pytest.approx(expected_hidden_share(C, M, k))
        assert rep.hidden_share >= last and rep.hidden_share <= min(1.0, C / M) + 1e-12
        last = rep.hidden_share
        if C >= M:                                # all but the last chunk's comm hides
            assert rep.exposed == pytest.approx(M / k)
    assert (C >= M) == (link > 1e10)              # both regimes are exercised


def test_latency_and_weight_rereads_give_an_optimal_k():
    mesh = wb.Mesh.grid(8, ("tp",))
    sw = overlap_sweep("matmul_all_reduce", [(4096, 4096, 4096)], mesh, "tp",
                       [1, 2, 4, 8, 16, 32], "ascend-910b")
    shares = [r.hidden_share for r in sw.rows]
    speed = [r.speedup for r in sw.rows]
    assert shares[0] == 0 and max(shares) > 0
    assert speed[-1] < max(speed)                 # too many chunks: latency wins back
    for r in sw.rows:                             # the formula holds for equal chunks
        assert r.hidden_share == pytest.approx(r.expected)
        assert r.hidden_share <= min(1.0, r.compute / r.comm) + 1e-9  # chunks' own C/M
    text = str(sw)
    assert text.splitlines()[0] == "op matmul_all_reduce"          # one op per sweep
    assert text.splitlines()[1].split()[:2] == ["profile", "M"]
    assert len(text.splitlines()) == 2 + len(sw.rows)


def test_printed_sweep_and_report_fit_a_notebook_line():
    """Notebook 10 printed the sweep 110 characters wide (its op repeated on every row)
    and a report 117 wide; JupyterLab wraps past about 100, mid-word."""
    mesh = wb.Mesh.grid(8, ("tp",))
    sw = overlap_sweep("matmul_reduce_scatter", [(16384, 8192, 32768)], mesh, "tp", [1, 32],
                       ["ascend-910b", "a100"])
    assert max(len(line) for line in str(sw).splitlines()) <= 100, str(sw)
    x, w = meta_inputs("matmul_reduce_scatter", (16384, 8192, 32768), mesh, "tp")
    _, rep = matmul_reduce_scatter(x, w, mesh, "tp", 32, profile="ascend-910b")
    assert max(len(line) for line in str(rep).splitlines()) <= 100, str(rep)
    assert "hidden" in str(rep) and str(rep).startswith("matmul_reduce_scatter k=32 on")


def test_sweep_over_profiles_and_sizes_varies_the_ratio():
    mesh = wb.Mesh.grid(8, ("tp",))
    sw = overlap_sweep(all_gather_matmul, [(2048, 4096, 4096), (8192, 8192, 8192)], mesh, 0,
                       [2, 8], ["ascend-910b", "a100"])
    assert len(sw.rows) == 2 * 2 * 2
    ratios = {(r.profile, r.shape): r.ratio for r in sw.rows}
    assert len(set(ratios.values())) == 4
    # k = 2: at k = 8 the launch cost of 8 small chunks inflates the small shape's compute
    big = [r for r in sw.rows if r.shape == (8192, 8192, 8192) and r.k == 2]
    small = [r for r in sw.rows if r.shape == (2048, 4096, 4096) and r.k == 2]
    for b, s in zip(big, small):                  # more compute per byte hides more
        assert b.ratio > s.ratio and b.hidden_share > s.hidden_share


def test_records_into_the_current_trace_and_checks_the_profile():
    mesh, ax = MESHES[0]
    x, w = meta_inputs(matmul_all_reduce, (64, 64, 64), mesh, ax, torch.float32)
    with wb.trace(profile="a100") as tr:
        _, r1 = matmul_all_reduce(x, w, mesh, ax, chunks=2)
        _, r2 = matmul_all_reduce(x, w, mesh, ax, chunks=2, profile="a100")
        with pytest.raises(ValueError, match="current trace prices on 'a100'"):
            matmul_all_reduce(x, w, mesh, ax, chunks=2, profile="ascend-910b")
    assert len(tr.events) == len(r1.events) + len(r2.events) == 8
    assert tr.events[:4] == list(r1.events) and r1.profile == "a100"
    assert min(e.start for e in r2.events) >= max(e.start for e in r1.events)


def test_report_from_events_and_exposed_intervals():
    E = wb.Event
    ev = [E("mm", "compute", 0.0, 2.0, (0, 1)), E("ar", "comm", 1.0, 3.0, (0, 1)),
          E("mm", "compute", 3.0, 0.5, (0,)), E("ar", "comm", 5.0, 1.0, (1,))]
    assert exposed_intervals(ev, 0) == [(2.0, 3.0), (3.5, 4.0)]
    assert exposed_intervals(ev, 1) == [(2.0, 4.0), (5.0, 6.0)]
    rep = OverlapReport.from_events(ev, "x", 1, "p")
    assert (rep.rank, rep.comm, rep.exposed, rep.compute, rep.total) == (1, 4.0, 3.0, 2.0, 6.0)
    assert rep.hidden == 1.0 and rep.hidden_share == 0.25
    assert OverlapReport.from_events([]).hidden_share == 0.0
    assert "hidden 25.0%" in str(rep)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, m: matmul_all_reduce(x, w, m, 0, chunks=0),
     r"chunks=0 must be an int in \[1, 8\]"),
    (lambda x, w, m: matmul_all_reduce(x, w, m, 0, chunks=9), r"chunks=9"),
    (lambda x, w, m: matmul_all_reduce(x[:1], w, m, 0), "replicated along mesh dim 'tp'"),
    (lambda x, w, m: matmul_all_reduce(x, w[..., :3, :], m, 0), r"local columns \(4\)"),
    (lambda x, w, m: matmul_all_reduce(x[0], w, m, 0), "stacked tensor"),
    (lambda x, w, m: matmul_reduce_scatter(x[..., :6, :], w, m, 0), "6 rows, not divisible"),
    (lambda x, w, m: matmul_reduce_scatter(x, w, m, 0, chunks=3), r"\[1, 2\]"),
    (lambda x, w, m: overlap_sweep("matmul", [(8, 8, 8)], m, 0, [1]), "use one of"),
    (lambda x, w, m: meta_inputs(matmul_all_reduce, (8, 6, 8), m, 0), "K=6 not divisible"),
])
def test_errors_name_the_argument_and_the_fix(call, match):
    mesh = wb.Mesh.grid(4, ("tp",))
    x, w = torch.zeros(4, 8, 4), torch.zeros(4, 4, 5)
    with pytest.raises(ValueError, match=match):
        call(x, w, mesh)


# ---- multi-copy ---------------------------------------------------------------------------

def reference(x, params, mesh, ax, grad_out):
    xl = x.clone().requires_grad_()
    ws = {n: getattr(params, n).clone().requires_grad_() for n in LayerParams.NAMES}
    out = tp_layer(xl, LayerParams(**ws, heads=params.heads), mesh, ax)
    out.backward(grad_out)
    return out.detach(), xl.grad, {n: w.grad for n, w in ws.items()}


@pytest.mark.parametrize("copies", [1, 2, 3])
@pytest.mark.parametrize("mesh,ax", [(wb.Mesh.grid(2, ("tp",)), 0),
                                     (wb.Mesh.grid((2, 2), ("dp", "tp")), 1)],
                         ids=["tp2", "dp2xtp2"])
def test_multi_copy_equals_the_single_copy_layer(copies, mesh, ax):
    gen = torch.Generator().manual_seed(copies)
    params = init_layer(16, 4, 32, mesh, ax, seed=3)
    lead = [1] * mesh.ndim
    if mesh.ndim == 2:
        lead[0] = 2                                   # batch sharded over dp as well
    x = torch.randn(*lead, 6, 5, 16, generator=gen)
    g = torch.randn(*lead, 6, 5, 16, generator=gen)
    out, gx, gw = reference(x, params, mesh, ax, g)
    r = multi_copy_layer(x, params, mesh, ax, copies=copies, grad_out=g)
    # every sample's math is unchanged: outputs and input gradients are bitwise equal
    assert torch.equal(r.out, out) and torch.equal(r.grad_x, gx)
    for n in LayerParams.NAMES:
        if copies == 1:
            assert torch.equal(r.grads[n], gw[n])
        else:  # sum of the copies' gradients: the batch summed in another order
            torch.testing.assert_close(r.grads[n], gw[n], rtol=1e-5, atol=1e-5)
    assert_well_formed(r.forward.events + r.backward.events)
    assert max(e.end for e in r.forward.events) <= min(e.start for e in r.backward.events)


def times(rep):
    """Per-copy durations by event label ('attention A', 'ffn dX B', ...)."""
    out = {}
    for e in rep.events:
        out.setdefault((e.stream, e.label), e.duration)
    return out


@pytest.mark.parametrize("link", [5e10, 2e11, 2e12])
def test_multi_copy_forward_matches_its_analytic_schedule(link):
    """Two copies, blocks a (attention) and f (ffn), all-reduce m per copy:
    makespan = s1 + 2 max(f, m) + m with s1 = a + max(a, m); exposed = makespan - 2a - 2f."""
    prof = flat_profile(flops=1e14, link=link)
    mesh = wb.Mesh.grid(4, ("tp",))
    r = multi_copy_estimate(2, 512, 1024, 16, 4096, mesh, 0, profile=prof)
    t = times(r.forward)
    a, f, m = t["compute", "attention A"], t["compute", "ffn A"], t["comm", "ffn A"]
    assert t["compute", "attention B"] == a and t["comm", "attention A"] == m
    s1 = a + max(a, m)
    exposed = s1 + 2 * max(f, m) + m - 2 * a - 2 * f
    assert r.forward.exposed == pytest.approx(exposed)
    assert r.forward.hidden_share == pytest.approx(1 - exposed / (4 * m))
    assert r.forward.hidden_share > 0
    if m <= min(a, f):                            # only the last all-reduce shows: 3/4
        assert r.forward.hidden_share == pytest.approx(0.75)
    one = multi_copy_estimate(2, 512, 1024, 16, 4096, mesh, 0, copies=1, profile=prof)
    assert one.forward.hidden_share == 0.0        # one copy: every all-reduce blocks


@pytest.mark.parametrize("link", [5e10, 1e11, 4e11])
def test_multi_copy_backward_hides_behind_weight_gradients(link):
    """Megatron-LM's rule per copy and block: the row-parallel linear's dX and dW (R), the
    core and the column-parallel linear's dX (X), then the all-reduce m beside that
    linear's dW (W) only; a copy's next block waits for its all-reduce, the comm stream
    runs them in order.  Two copies, FFN (f) then attention (a), by hand."""
    prof = flat_profile(flops=1e14, link=link)
    mesh = wb.Mesh.grid(4, ("tp",))
    r = multi_copy_estimate(2, 512, 1024, 16, 4096, mesh, 0, profile=prof)
    t = times(r.backward)
    m = t["comm", "attention dX B"]
    assert t["comm", "ffn dX A"] == m
    t0 = min(e.start for e in r.backward.events)
    clock, comm, done = t0, t0, {}
    for blk, row, col, prev in (("ffn", "w2", "w1", None), ("attention", "wo", "wqkv", "ffn")):
        for c in "AB":
            if prev:
                clock = max(clock, done[prev, c])          # the all-reduced gradient
            clock += t["compute", f"{row} dX dW {c}"] + t["compute", f"{blk} dX {c}"]
            comm = done[blk, c] = max(clock, comm) + m     # issued after the dgrad
            clock += t["compute", f"{col} dW {c}"]         # beside it
    end = max(clock, comm)
    busy = sum(v for (stream, _), v in t.items() if stream == "compute")
    assert r.backward.total == pytest.approx(end - t0)
    assert r.backward.exposed == pytest.approx(end - t0 - busy)
    one = multi_copy_estimate(2, 512, 1024, 16, 4096, mesh, 0, copies=1, profile=prof)
    t1 = times(one.backward)
    M = t1["comm", "ffn dX A"]
    expected = max(0.0, M - t1["compute", "w1 dW A"]) + max(0.0, M - t1["compute",
                                                                        "wqkv dW A"])
    assert one.backward.exposed == pytest.approx(expected)
    assert r.backward.hidden_share >= one.backward.hidden_share


def test_multi_copy_realistic_layer_on_ascend():
    """H=4096, 32 heads, FFN 4H, S=2048, micro-batch 2, tp=8 in one Atlas 800T A2 server."""
    mesh = wb.Mesh.grid(8, ("tp",))
    two = multi_copy_estimate(2, 2048, 4096, 32, 16384, mesh, 0, profile="ascend-910b")
    one = multi_copy_estimate(2, 2048, 4096, 32, 16384, mesh, 0, copies=1,
                              profile="ascend-910b")
    assert two.forward.hidden_share > 0.5 and one.forward.hidden_share == 0
    assert two.backward.hidden_share > one.backward.hidden_share > 0.5
    assert two.forward.total < one.forward.total
    assert two.out.device.type == "meta"


def test_multi_copy_errors():
    mesh = wb.Mesh.grid(2, ("tp",))
    params = init_layer(8, 2, 8, mesh, 0)
    with pytest.raises(ValueError, match=r"copies=3 must be an int in \[1, 2\]"):
        multi_copy_layer(torch.zeros(1, 2, 3, 8), params, mesh, 0, copies=3)
    with pytest.raises(ValueError, match="size 1 along mesh dim 'tp'"):
        multi_copy_layer(torch.zeros(2, 2, 3, 8), params, mesh, 0)
    with pytest.raises(ValueError, match="heads=3 is not divisible"):
        init_layer(12, 3, 8, mesh, 0)
