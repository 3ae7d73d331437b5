"""Random sweep 17 (wide seeds 2017000.., old 1072000.., focus kinds) and the known gaps it
was asked to close.  Each test holds a DistTensor call to torch on the full tensor (or the
torch.distributed runner to the simulator); the docstrings say what was wrong before."""
import itertools
import math
import random

import pytest
import torch

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M1 = wb.Mesh.grid(2, ["a"])
M2 = wb.Mesh([[0, 1], [2, 3]])


def _d(x, ps, mesh=M2, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


def _layouts(mesh, extra):
    opts = ["R", "S(0)", "S(1)"] + extra
    return [list(c) for c in itertools.product(opts, repeat=mesh.ndim)]


# ---- P(max) / P(min) under torch.distributed: inf / NaN upstream, NaN parts ---------------

PARTS = {0: [1.0, 3.0, 2.0, 5.0, float("nan")], 1: [2.0, 3.0, 1.0, -1.0, 0.0]}
G = [float("inf"), float("nan"), -float("inf"), float("inf"), 2.0]


def _simulated(op):
    locs = [torch.tensor(PARTS[r], dtype=torch.float64, requires_grad=True) for r in (0, 1)]
    d = wb.DistTensor.from_local(locs, M1, parse_placements([f"P({op})"]))
    full = d.redistribute(M1, parse_placements(["R"]))
    full.local(0).backward(torch.tensor(G, dtype=torch.float64))
    return full.local(0).detach(), [t.grad for t in locs]


@pytest.mark.parametrize("op", ["max", "min"])
def test_simulated_extreme_is_torchs_evenly_distributed_gradient(op):
    """The simulator's P(max/min) -> R: value torch's amax / amin of the stacked parts (NaN
    propagates), gradient torch's evenly_distribute_backward: upstream inf / NaN at the
    winning parts only, 0 (not inf * 0 = NaN) at the others, halved at a tie."""
    value, grads = _simulated(op)
    stack = torch.tensor([PARTS[0], PARTS[1]], dtype=torch.float64)
    torch.testing.assert_close(value, getattr(stack, f"a{op}")(0), equal_nan=True)
    for k in range(5):                  # torch's own rule on each column, one device
        col = stack[:, k].clone().requires_grad_(True)
        getattr(torch, op)(col).backward(torch.tensor(G[k], dtype=torch.float64))
        for r in (0, 1):
            torch.testing.assert_close(grads[r][k], col.grad[r], equal_nan=True)


def test_torch_distributed_extreme_is_the_simulators(tmp_path_factory):
    """tests/dist_scripts/sweep17_extreme_check.py (torchrun, 2 gloo processes): the same
    parts and upstream gradient give the simulator's values and gradients.  Before: the
    losing rank's gradient was g * 0 / count, NaN under an inf / NaN upstream gradient
    (sim_mesh/backends.AllReduce), and gloo's MAX / MIN dropped a NaN part (max(NaN, 0)
    was 0, the simulator's and torch's NaN)."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "sweep17_extreme_check.py")   # one launch
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["rank"], r["case"]): r for r in json_rows(text)}
    for op in ("max", "min"):
        value, grads = _simulated(op)
        for r in (0, 1):
            row = rows[(r, op)]
            got_v = torch.tensor([float(v) for v in row["value"]], dtype=torch.float64)
            got_g = torch.tensor([float(v) for v in row["grad"]], dtype=torch.float64)
            torch.testing.assert_close(got_v, value, equal_nan=True)
            torch.testing.assert_close(got_g, grads[r], equal_nan=True)


# ---- sum / mean of a P(avg): the Partial stays (DTensor's linear reduction) ----------------

@pytest.mark.parametrize("kind", ["sum", "mean"])
@pytest.mark.parametrize("dim", [0, 1, (0, 2), None])
def test_sum_mean_keep_p_avg(kind, dim):
    """sum / mean of a P(avg) keep P(avg) on that mesh dim (no collective), as DTensor's
    linear reduction strategy keeps any Partial; values and gradients torch's over every
    layout of the other mesh dim.  Before: P(avg) was reduced (reduce-scatter) first."""
    x = torch.randn(4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(getattr(x, kind)(dim) if dim is not None else x.sum())
    for other in ["R", "S(0)", "S(1)", "P(avg)"]:
        t = _d(x, ["P(avg)", other]).requires_grad_(True)
        r = t.full().detach().clone().requires_grad_(True)
        with wb.trace("a100") as tr:
            y = getattr(t, kind)(dim) if dim is not None else getattr(t, kind)()
        want = getattr(r, kind)(dim) if dim is not None else getattr(r, kind)()
        assert y.placements[0] == wb.Partial("avg")
        if other in ("R", "P(avg)"):
            assert not [e for e in tr.events if e.name in ("all_reduce", "reduce_scatter")]
        torch.testing.assert_close(y.full(), want)
        (y * g).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(t.grad.full(), r.grad)


def test_bf16_p_avg_sum_over_a_dim_of_one_keeps_its_value():
    """Wide seed 2015043: t1 a bfloat16 P(avg) on a (2, 4) mesh; t1.sum(2, keepdim=True)
    over a dim of size 1 is t1 itself, bit for bit, as on one device.  Before: the sum
    reduce-scattered the parts (another rounding order than t1.full()'s), 0.047 off."""
    x = torch.randn(1, 3, 1, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = _d(x, ["P(avg)", "P(avg)"], mesh=wb.Mesh([[6, 4, 1, 5], [7, 2, 3, 0]]), seed=140)
    assert torch.equal(t.sum(2, keepdim=True).full(), t.full().sum(2, keepdim=True))
    assert torch.equal(t.mean(2, keepdim=True).full(), t.full().mean(2, keepdim=True))


# ---- sum(dtype=int) of a float Partial: each element truncated first -----------------------

@pytest.mark.parametrize("op", ["sum", "avg"])
def test_sum_to_int_of_float_partial_is_torchs(op):
    """x.sum(dim, dtype=torch.int64) casts every element before summing: truncation is not
    linear, so a float P(sum) / P(avg) is reduced first.  Before: P(sum) passed (each
    part truncated apart: 2 off one device's sum); a P(avg) passed when the planner chose
    it (on a (2, 4) mesh, (3, 4, 5) P(avg) P(avg) .sum(1, dtype=int64) raised mean()'s
    RuntimeError on the int64 parts, torch gives a result)."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    for other in ["R", "S(0)", "S(1)", f"P({op})"]:
        t = _d(x, [f"P({op})", other], seed=5)
        held = t.full()
        for dim in (0, 1, None):
            want = held.sum(dim, dtype=torch.int64) if dim is not None else \
                held.sum(dtype=torch.int64)
            got = t.sum(dim, dtype=torch.int64) if dim is not None else t.sum(dtype=torch.int64)
            assert got.dtype == torch.int64
            assert torch.equal(got.full(), want), (other, dim)


# ---- the sweep's programs ------------------------------------------------------------------

@pytest.mark.parametrize("seed,wide", [(2015043, True), (1072063, False), (2018161, True),
                                       (2019269, True), (2019394, True)])
def test_sweep_seed_is_ok(seed, wide):
    """2015043 (wide): bfloat16 P(avg) leaf of parts up to 183 (mean |part| 51): mean of its
    parts 0.033 off one device's mean of the value, the harness's 2e-2 tolerance (the parts'
    rounding, now in the harness's half tolerance: random_programs._Prog.part_atol);
    1072063 (old): t2.to(bfloat16) + t3 summed t3's gradient over bfloat16 elements in two
    shards (0.2300 against one device's 0.2295, one bfloat16 ulp): the half tolerance
    applies to old programs' bfloat16 steps too; 2018161 (wide): torch._foreach_sqrt([t2,
    t1])[1] of a complex t1 beside t2 requiring grad requires grad in torch (so its median
    raises torch's complex-autograd RuntimeError); here it did not (a result).  2019269 /
    2019394: the harness's own part tolerance on a bfloat16 Partial leaf of uneven shards
    (stacked its locals) and of an int64 leaf (finfo) raised in the harness."""
    from tests.random_programs import run_program
    out = run_program(random.Random(seed), wide=wide)
    assert out.status == "ok", out.detail


# ---- complex DistTensors require grad, as torch (and DTensor) allow -----------------------

CX = torch.complex(torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
                   torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
CY = torch.complex(torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6)),
                   torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8)))
CW = torch.complex(torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9)),
                   torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10)))
COMPLEX_PROGRAMS = {
    "mul_exp": lambda a, b, w: (a * b).exp(),
    "matmul": lambda a, b, w: (a / b) @ w,
    "sum_mean": lambda a, b, w: (a * b).sum(0) + a.mean(0),
    "abs_softmax": lambda a, b, w: torch.softmax((a + b).abs(), 1),
    "view_as_real": lambda a, b, w: torch.view_as_real(a.sqrt() * b),
    "reshape_cat": lambda a, b, w: torch.cat([a.reshape(6, 4).t(), b], 1) * 2j,
    "vdot": lambda a, b, w: torch.vdot(a.flatten(), b.flatten()),
}


@pytest.mark.parametrize("name", sorted(COMPLEX_PROGRAMS))
def test_complex_dist_tensor_requires_grad_as_torch(name):
    """A complex DistTensor requires grad (torch and DTensor allow complex autograd):
    values and the leaves' (conjugate Wirtinger) gradients are torch's, over layouts with
    shards and a P(sum).  Before: requires_grad_() raised TypeError ('only floating point
    tensors can require gradients', torch's words for an integer)."""
    f = COMPLEX_PROGRAMS[name]
    for la, lb in [(["R", "R"], ["S(0)", "S(1)"]), (["S(1)", "P(sum)"], ["R", "S(0)"]),
                   (["P(sum)", "S(0)"], ["S(1)", "R"])]:
        a, b = _d(CX, la, seed=1).requires_grad_(True), _d(CY, lb, seed=2).requires_grad_(True)
        w = _d(CW, ["R", "S(0)"]).requires_grad_(True)
        ra, rb, rw = (t.full().detach().clone().requires_grad_(True) for t in (a, b, w))
        out, ref = f(a, b, w), f(ra, rb, rw)
        torch.testing.assert_close(out.full().detach(), ref.detach())
        g = torch.randn(ref.shape, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(7)).to(ref.dtype)
        out.backward(g)
        ref.backward(g)
        for t, r in ((a, ra), (b, rb), (w, rw)):
            if r.grad is None:              # w unused
                assert t.grad is None
                continue
            assert t.grad.dtype == r.grad.dtype == torch.complex128
            torch.testing.assert_close(t.grad.full(), r.grad)


def test_complex_int_requires_grad_refusals_are_torchs():
    """An integer DistTensor still refuses with torch's condition (floating point or
    complex); a foreach op over a float requiring grad marks its complex output as torch
    does (sweep15 had skipped it while complex could not require grad)."""
    with pytest.raises(TypeError, match="floating point and complex"):
        _d(torch.arange(4), ["S(0)", "R"]).requires_grad_(True)
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    c = torch.tensor([1 + 1j, -0.5j, 2.0], dtype=torch.complex128)
    want = torch._foreach_exp([x.clone().requires_grad_(True), c])
    got = torch._foreach_exp([_d(x, ["S(0)", "R"]).requires_grad_(True), _d(c, ["R", "S(0)"])])
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [True, True]


def test_aminmax_of_a_complex_of_no_element_raises_torchs_error():
    """Complex-grad focus seed 7000009: torch.aminmax(t1, dim=-2) of a (1, 1, 0) complex
    requiring grad: torch's CPU kernel raises NotImplementedError (no complex aminmax);
    here amin's autograd RuntimeError came first."""
    x = torch.zeros(1, 1, 0, dtype=torch.complex128)
    with pytest.raises(NotImplementedError):
        torch.aminmax(x.clone().requires_grad_(True), dim=-2)
    mesh = wb.Mesh([[[1, 2, 0]]])
    t = distribute(x, mesh, parse_placements(["S(1)", "P(sum)", "S(1)"]), seed=167)
    with pytest.raises(NotImplementedError):
        torch.aminmax(t.requires_grad_(True), dim=-2)
