"""Random sweep 11b: open defects of the wide random sweep (``run_program(rng, wide=True)``,
tests/random_programs_wide.py).  Each test holds a DistTensor call to torch on the full
tensor; the docstrings say what was wrong before."""
import pytest
import torch

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

MESH = wb.Mesh([[0, 1], [2, 3]])

TIES = torch.tensor([[2, -1, 2, -1, 1, 0, -3], [1, 1, 1, 0, 0, 0, 1],
                     [0, 0, 0, 0, 0, 0, 0], [3, -2, 3, 3, -2, 0, 3]], dtype=torch.float64)


def _d(x, ps, mesh=MESH, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "R"], ["S(1)", "S(0)"]])
def test_kthvalue_and_median_pick_torchs_index_among_ties(ps):
    """torch's kernel (std::nth_element) picks one index among equal values; a sort picks
    another.  Before: kthvalue([2, -1, 2, -1, 1, 0, -3], 7) gave index 2, torch 0 (seed
    2002189 wide); median's dim form likewise."""
    d = _d(TIES, ps)
    for k in range(1, 8):
        for keepdim in (False, True):
            got, want = torch.kthvalue(d, k, -1, keepdim), torch.kthvalue(TIES, k, -1, keepdim)
            assert torch.equal(got.indices.full(), want.indices), k
            assert torch.equal(got.values.full(), want.values), k
    for dim in (0, 1):
        got, want = d.median(dim), TIES.median(dim)
        assert torch.equal(got.indices.full(), want.indices)
        assert torch.equal(got.values.full(), want.values)


def test_kthvalue_gradient_goes_to_torchs_index():
    x = TIES.clone().requires_grad_(True)
    d = _d(TIES, ["S(0)", "R"]).requires_grad_(True)
    torch.kthvalue(d, 6, 1).values.sum().backward()
    torch.kthvalue(x, 6, 1).values.sum().backward()
    assert torch.equal(d.grad.full(), x.grad)


def test_bce_target_gradient_is_minus_logit_unclamped():
    """torch: the target's gradient is -grad logit(x): +-inf at x = 0 or 1, 690.8 at
    x = 1e-300.  Before: the clamped logs' -+100 (seed 2000267 wide)."""
    import torch.nn.functional as F
    x = torch.tensor([0., 1., 0.5, 1e-300, 0.2, 0.9], dtype=torch.float64)
    y = torch.tensor([0.3, 0.7, 0.2, 0.5, 1., 0.], dtype=torch.float64)
    for red in ("mean", "none"):
        xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        want = F.binary_cross_entropy(xr, yr, reduction=red)
        want.sum().backward()
        dx = _d(x, ["S(0)", "R"]).requires_grad_(True)
        dy = _d(y, ["R", "S(0)"], seed=4).requires_grad_(True)
        got = F.binary_cross_entropy(dx, dy, reduction=red)
        got.sum().backward()
        torch.testing.assert_close(got.full(), want)
        torch.testing.assert_close(dy.grad.full(), yr.grad)
        torch.testing.assert_close(dx.grad.full(), xr.grad)


@pytest.mark.parametrize("bad", [float("nan"), 1.5, -0.25])
def test_bce_refuses_an_input_outside_0_1_as_torch(bad):
    """torch raises RuntimeError for an input element outside [0, 1], NaN included.
    Before: a result (seed 2000267 wide)."""
    import torch.nn.functional as F
    x = torch.tensor([0.2, bad, 0.5, 0.7], dtype=torch.float64)
    y = torch.full((4,), 0.5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(x, y)
    d = _d(x, ["S(0)", "R"]).requires_grad_(True)
    before = d.full().clone()
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(d, _d(y, ["R", "R"]))
    torch.testing.assert_close(d.full(), before, equal_nan=True, rtol=0, atol=0)
    assert d.grad is None


@pytest.mark.parametrize("v", [float("nan"), float("inf"), 1e200, 1e-200, 0.0, -2.0])
@pytest.mark.parametrize("p", [2, 3, 0.5, -1, 1, float("inf")])
def test_norm_of_a_0d_has_torchs_gradient(v, p):
    """torch's gradient of a 0-d p-norm is x |x|^(p-2) / |x|^(p-1): NaN for a NaN or
    infinite x (and where the powers overflow).  Before: abs's, 0 or 1 (seed 2001189 wide:
    torch.dist of a 0-d NaN)."""
    x, y = torch.tensor(v, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64)
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    torch.linalg.vector_norm(xr, p).backward()
    torch.dist(xr, yr, p).backward()
    dx = _d(x, ["R", "R"]).requires_grad_(True)
    dy = _d(y, ["R", "R"]).requires_grad_(True)
    got = torch.linalg.vector_norm(dx, p)
    torch.testing.assert_close(got.full(), torch.linalg.vector_norm(x, p), equal_nan=True)
    got.backward()
    torch.dist(dx, dy, p).backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)
    torch.testing.assert_close(dy.grad.full(), yr.grad, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_nll_loss_of_an_integer_input_raises_as_torch(dtype):
    """torch's CPU kernel: NotImplementedError ("nll_loss_out_frame" not implemented for
    'Byte'), the meta kernel passes it.  Before: a result (seed 2002290 wide)."""
    import torch.nn.functional as F
    x, t = torch.zeros(4, 3, dtype=dtype), torch.tensor([0, 2, 1, 0])
    with pytest.raises(NotImplementedError) as want:
        F.nll_loss(x, t)
    with pytest.raises(NotImplementedError) as got:
        F.nll_loss(_d(x, ["S(0)", "R"]), _d(t, ["S(0)", "R"]))
    assert str(got.value) == str(want.value)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(F.nll_loss(_d(x, ["S(0)", "R"]), _d(t, ["S(0)", "R"])).full(),
                               F.nll_loss(x, t))


@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "R"], ["P(sum)", "S(1)"]])
def test_var_std_of_complex_computes_as_torch(ps):
    """torch.var / std / var_mean / std_mean of a complex tensor: the real variance of
    |x - mean|.  Before: RuntimeError "input dtype should be either floating point or
    complex" (the wide sweep)."""
    c = torch.randn(4, 6, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    d = _d(c, ps)
    calls = (lambda a: torch.var(a), lambda a: torch.var(a, 0), lambda a: a.var(1, correction=0),
             lambda a: torch.std(a, 1, keepdim=True), lambda a: torch.std_mean(a, 0),
             lambda a: torch.var_mean(a))
    for f in calls:
        want, got = f(c), f(d)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g.full(), w)
    with pytest.raises(RuntimeError, match="floating point or complex"):
        torch.var(_d(torch.ones(4, 6, dtype=torch.int64), ps))


@pytest.mark.parametrize("fn", ["smooth_l1_loss", "mse_loss"])
def test_losses_with_a_bool_operand_as_torch(fn):
    """torch promotes a bool operand against a float one, and its CPU kernel refuses an
    integer / bool result (NotImplementedError).  Before: smooth_l1_loss(bool, float)
    raised bool subtraction's RuntimeError (seed 2003341 wide); mse_loss(bool, bool) that
    RuntimeError, mse_loss(bool, int64) a result."""
    import torch.nn.functional as F
    f = getattr(F, fn)
    b = torch.tensor([[True, False, True]])
    x = torch.tensor([[-1.5, 0.25, 2.0]], dtype=torch.float64)
    for u, v in ((b, x), (x, b)):
        want = f(u, v, reduction="none")
        got = f(_d(u, ["R", "R"]), _d(v, ["R", "S(1)"]), reduction="none").full()
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    for u, v in ((b, b), (b, torch.tensor([[3, 1, 0]]))):
        with pytest.raises(NotImplementedError) as want:
            f(u, v)
        with pytest.raises(NotImplementedError) as got:
            f(_d(u, ["R", "R"]), _d(v, ["R", "R"]))
        assert str(got.value) == str(want.value)
