"""Random sweep 16: wide seed 2016720 (``t1.grad`` NaN where torch's is finite).

``R -> P(min) -> R`` of a NaN: the reduction over the ranks was ``amin`` of the stacked
parts, whose backward masks ``part == result`` only: no part equals NaN, a count of 0,
and the gradient was NaN where one device's passes through unchanged (log1p of values
below -1 there).  Now the ranks' max / min gives a NaN result's gradient to the NaN
parts (torch's evenly_distribute_backward, ``sim_mesh/grid.py`` ``_Extreme``)."""
import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M1 = wb.Mesh.grid(2, ["a"])
M2 = wb.Mesh([[0, 1], [2, 3]])


def _same(got, want):
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0))
    assert torch.equal(got.isinf() & (got < 0), want.isinf() & (want < 0))


def _layouts(mesh, extra):
    opts = ["R", "S(0)", "S(1)"] + extra
    return [list(c) for c in itertools.product(opts, repeat=mesh.ndim)]


X = torch.tensor([[-1.5, 0.5, float("nan"), -3.0],
                  [float("inf"), -1.0, 2.0, -float("inf")]], dtype=torch.float64)
G = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.25, float("inf"), 2.0]], dtype=torch.float64)


def _case(mesh, src, mid, dst, scale):
    x = X.clone().requires_grad_(True)
    want = torch.log1p(x) * scale
    gw, = torch.autograd.grad((want * G).sum(), x)
    t = distribute(X, mesh, parse_placements(src), seed=1).requires_grad_(True)
    d = torch.log1p(t).redistribute(mesh, parse_placements(mid)) * scale
    d = d.redistribute(mesh, parse_placements(dst))
    gd, = torch.autograd.grad((d * G).sum(), [t])
    _same(d.full().detach(), want.detach())
    _same(gd.full(), gw)


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("mesh", [M1, M2], ids=["1d", "2d"])
def test_partial_extreme_round_trip_keeps_torch_gradient_at_nan_and_inf(mesh, op):
    """x (every layout) -> log1p (NaN below -1, -inf at -1, inf at inf) -> P(op) on one
    mesh dim -> * 1.62 (kept P(min/max)) -> every layout: values and gradient (with an
    infinite upstream gradient) equal torch's, NaN / inf positions and signs included.
    Before: NaN at every NaN element's gradient (0 / 0 of amin's tie count)."""
    for src in _layouts(mesh, []):
        for k in range(mesh.ndim):
            mid = list(src)
            mid[k] = f"P({op})"
            for dst in _layouts(mesh, []):
                _case(mesh, src, mid, dst, 1.62)


def test_mixed_nan_parts_gradient_goes_to_the_nan_rank():
    """Parts [NaN, 1] of a P(min) on 2 ranks: the min is NaN and its gradient goes to the
    NaN part alone, as torch's min() of a tensor holding NaN (the CPU branch of
    evenly_distribute_backward); parts [1, 1]: half each; [2, 1]: the lower one."""
    for parts, grads in [([float("nan"), 1.0], [1.0, 0.0]), ([1.0, 1.0], [0.5, 0.5]),
                         ([2.0, 1.0], [0.0, 1.0])]:
        a = torch.tensor(parts, dtype=torch.float64, requires_grad=True)
        torch.min(a).backward()
        assert a.grad.tolist() == grads          # torch's own rule, one device
        locs = [torch.tensor([p], dtype=torch.float64, requires_grad=True) for p in parts]
        d = wb.DistTensor.from_local(locs, M1, parse_placements(["P(min)"]))
        d.full().sum().backward()
        assert [float(t.grad) for t in locs] == grads


def test_seed_2016720_wide_is_ok():
    """The sweep's program: log1p of a (2, 3, 5, 5) leaf, permuted, R -> P(min) * 1.62 ->
    S(1), adaptive_avg_pool2d, unsqueeze; t1.grad was NaN at 31 elements below -1."""
    from tests.random_programs import run_program
    out = run_program(random.Random(2016720), wide=True)
    assert out.status == "ok", out.detail
