"""Random sweep 8: writes through a diagonal view that autograd records (they were
refused: "the view op could not keep in its memory"); ... (see each test's docstring)."""
import random

import pytest
import torch

import workbench as wb
from tests.random_programs import run_program

R, S = wb.Replicate(), wb.Shard


def _pair(x0, mesh, placements):
    ref = x0.clone().requires_grad_()
    d = wb.distribute_tensor(x0.clone(), mesh, placements).requires_grad_()
    return ref, d


@pytest.mark.parametrize("offset,dim1,dim2,placements", [
    (0, 0, 1, [S(0), S(2)]),
    (1, 2, 0, [S(1), R]),
    (-2, 1, 2, [S(2), S(0)]),
    (-1, -1, 0, [R, S(1)]),
    (9, 0, 2, [S(0), R]),          # an empty diagonal
])
def test_write_through_a_tracked_diagonal_is_torchs(offset, dim1, dim2, placements):
    """``t.diagonal(offset, dim1, dim2).mul_(w)`` on a tensor with history: the base's
    values and both leaves' gradients are torch's (diagonal_scatter), bit for bit, and
    the view reads the base's diagonal after a later write into the base."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    g = torch.Generator().manual_seed(offset + 10 * dim1)
    x0 = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    shape = tuple(torch.diagonal(x0, offset, dim1, dim2).shape)
    w0 = torch.randn(shape, generator=g, dtype=torch.float64)
    gout = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    rx, x = _pair(x0, mesh, placements)
    rw, w = _pair(w0, mesh, [R, R])
    rt, t = rx * 2, x * 2
    rv, v = rt.diagonal(offset, dim1, dim2), t.diagonal(offset, dim1, dim2)
    rv.mul_(rw)
    v.mul_(w)
    torch.testing.assert_close(t.full(), rt.detach(), rtol=0, atol=0)
    torch.testing.assert_close(v.full(), rv.detach(), rtol=0, atol=0)
    (rt * gout).sum().backward()
    (t * gout).sum().backward()
    torch.testing.assert_close(x.grad.full(), rx.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad.full(), rw.grad, rtol=0, atol=0)
    with torch.no_grad():
        rt.add_(1)
        t.add_(1)
    torch.testing.assert_close(v.full(), rv.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [1028653, 1028983, 1030332, 1030958, 1031491])
def test_diagonal_sweep_seeds_run(seed):
    out = run_program(random.Random(seed))
    assert out.status == "ok", out


def test_tracked_write_into_a_zero_size_tensor_keeps_its_layout():
    """A write autograd records into a zero-size DistTensor: the clone of the value came
    back laid out R, R (any layout of nothing is free) while x kept S(0), S(1), so the
    next op on x (its view refreshed) found the wrong local tensors and raised
    "nothing to all_gather" (sweep seed 1028653, before its diagonal)."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    x = wb.distribute_tensor(torch.zeros(2, 5, 0, dtype=torch.float64), mesh,
                             [S(0), S(1)]).requires_grad_()
    t = (x * 2).redistribute(mesh, [S(0), S(1)])
    t.copy_(t.detach().clone() + 1)
    assert t.placements == (S(0), S(1))
    assert tuple(t.transpose(1, 2).full().shape) == (2, 0, 5)


_X = torch.tensor([[0.3, -1.2], [5.0, 5.0], [2.0, -0.7]], dtype=torch.float64)
_STATS = {"var": torch.var, "std": torch.std,
          "var_mean": lambda *a, **k: torch.var_mean(*a, **k)[0],
          "std_mean": lambda *a, **k: torch.std_mean(*a, **k)[0]}


def _same(got, want):
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("fn", list(_STATS))
@pytest.mark.parametrize("x0,kw,placements", [
    (_X, dict(dim=1, correction=2), [S(0), R]),                    # N == c: factor inf
    (_X, dict(dim=1, correction=3), [S(0), S(1)]),                 # N < c: factor -2
    (_X, dict(dim=1, correction=2.5, keepdim=True), [R, S(0)]),
    (_X, dict(correction=6), [S(0), R]),                           # dim None: where(nan, inf)
    (_X, dict(dim=(0, 1), correction=9), [S(1), R]),               # dims given: finite
    (torch.tensor(2.0, dtype=torch.float64), dict(dim=0), [R, R]),  # 0-d: as dim None
    (torch.zeros(0, dtype=torch.float64), dict(dim=0, correction=0), [S(0), R]),
])
def test_no_degrees_of_freedom_is_torchs(fn, x0, kw, placements):
    """var / std / var_mean / std_mean with N - correction <= 0 on a tensor that
    requires grad: torch's value (inf, nan) and var_backward's gradient, inf / nan in
    the same places (it was refused; the composition's s / 0 would put nan everywhere)."""
    mesh = wb.Mesh([[0, 1], [2, 3]])
    f = _STATS[fn]
    rx, x = _pair(x0, mesh, placements)
    with pytest.warns(UserWarning):
        rv = f(rx, **kw)
    with pytest.warns(UserWarning):
        v = f(x, **kw)
    g = torch.Generator().manual_seed(1)
    go = torch.randn(rv.shape, generator=g, dtype=torch.float64)
    go.view(-1)[:1] = 0                     # inf * 0: nan where torch has it
    (rv * go).sum().backward()
    (v * go).sum().backward()
    _same(v.full(), rv.detach())
    _same(x.grad.full(), rx.grad)


def test_std_mean_of_a_constant_row_has_torchs_zero_gradient():
    """std_mean's std went through sqrt(var): nan gradient where the std is 0; torch's
    std_mean_backward masks it to 0 (as std's)."""
    mesh = wb.Mesh([0, 1])
    x0 = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    rx, x = _pair(x0, mesh, [S(0)])
    torch.std_mean(rx, 1)[0].sum().backward()
    torch.std_mean(x, 1)[0].sum().backward()
    torch.testing.assert_close(x.grad.full(), rx.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", [1028782, 1028825, 1029111])
def test_var_sweep_seeds_run(seed):
    out = run_program(random.Random(seed))
    assert out.status == "ok", out


def test_no_gradient_into_a_replicated_operand_leaves_grad_none():
    """``vector_norm(a @ b, 0)`` gives its input no gradient (torch: undefined), so torch
    leaves ``b.grad`` None; the identities that record a replicated operand's backward
    collectives (grad_record._BackwardSteps, collectives._BackwardEvent) materialized
    that None as zeros, and b.grad was a zero DistTensor (an optimizer skips a None
    grad, but steps weight decay on zeros)."""
    mesh = wb.Mesh([0, 1, 2, 3])
    g = torch.Generator().manual_seed(0)
    a0 = torch.randn(4, 3, 4, generator=g, dtype=torch.float64)
    b0 = torch.randn(4, 5, generator=g, dtype=torch.float64)
    ra, a = _pair(a0, mesh, [S(0)])
    rb, b = _pair(b0, mesh, [R])
    torch.linalg.vector_norm(ra @ rb, 0, (1, 2)).sum().backward()
    torch.linalg.vector_norm(a @ b, 0, (1, 2)).sum().backward()
    assert ra.grad is None and rb.grad is None
    assert a.grad is None and b.grad is None
    # where a gradient does flow, it is unchanged: b's is the ranks' sum
    (torch.linalg.vector_norm(ra @ rb, 2, (1, 2)).sum()).backward()
    (torch.linalg.vector_norm(a @ b, 2, (1, 2)).sum()).backward()
    torch.testing.assert_close(b.grad.full(), rb.grad)
    torch.testing.assert_close(a.grad.full(), ra.grad)


def test_write_through_positive_is_torchs():
    """``torch.positive(t)`` is ``t`` itself in torch: ``positive(t).mul_(w)`` on a tensor
    with history writes t (it was refused: "could not keep in its memory")."""
    mesh = wb.Mesh([0, 1])
    g = torch.Generator().manual_seed(3)
    x0, w0 = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    rx, x = _pair(x0, mesh, [S(0)])
    rw, w = _pair(w0, mesh, [R])
    rt, t = rx * 1, x * 1
    torch.positive(rt).mul_(rw)
    torch.positive(t).mul_(w)
    torch.testing.assert_close(t.full(), rt.detach(), rtol=0, atol=0)
    (rt * 2).sum().backward()
    (t * 2).sum().backward()
    torch.testing.assert_close(x.grad.full(), rx.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad.full(), rw.grad, rtol=0, atol=0)
