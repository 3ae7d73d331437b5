"""Random sweep 13: defects found by the random program sweep (``benchmarks/random_sweep.py``,
wide seeds 2006200.., tests/random_programs_wide.py) and by probes of the same ops.  Each
test holds a DistTensor call to torch on the full tensor; the docstrings say what was wrong
before."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

MESH = wb.Mesh([[0, 1], [2, 3]])


def _d(x, ps, mesh=MESH, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


def _kind(f):
    try:
        return "ok", f()
    except Exception as e:  # noqa: BLE001 - the type is compared with torch's
        return type(e), None


@pytest.mark.parametrize("batch", [0, 2])
def test_sdpa_of_no_head(batch):
    """q with no head (an empty batch and head dim): torch computes an empty output; the
    rule's 'every rank keeps a head' check left no layout (ValueError 'the rule found no
    valid placement', seed 2006313 wide)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, batch, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(batch, batch, 4, 3, generator=g, dtype=torch.float64)
    v = torch.randn(batch, batch, 4, 1, generator=g, dtype=torch.float64)
    mesh = wb.Mesh([[[0, 5, 2]], [[3, 1, 4]]])
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr)
    dq = _d(q, ["R", "R", "R"], mesh).requires_grad_(True)
    dk = _d(k, ["S(1)", "S(3)", "R"], mesh).requires_grad_(True)
    dv = _d(v, ["P(sum)", "P(sum)", "R"], mesh).requires_grad_(True)
    got = F.scaled_dot_product_attention(dq, dk, dv)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.full(), want)
    gy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    for d, r in ((dq, qr), (dk, kr), (dv, vr)):
        torch.testing.assert_close(d.grad.full(), r.grad)


@pytest.mark.parametrize("loss,kw", [(F.smooth_l1_loss, {"beta": 1.0}),
                                     (F.smooth_l1_loss, {"beta": 0.5}),
                                     (F.huber_loss, {"delta": 0.7})])
@pytest.mark.parametrize("inf", [float("-inf"), float("inf")])
def test_smooth_l1_and_huber_gradient_at_an_infinite_difference(loss, kw, inf):
    """Where |x - y| is infinite the linear branch is taken; the square's branch gave its
    gradient 0 * inf = nan (the where's other side): the target's gradient of
    smooth_l1_loss(-inf, y) was nan where torch's is -grad (seed 2006376 wide).  A NaN
    difference keeps torch's NaN gradient (its kernels take the square's side there)."""
    x = torch.tensor([inf, 0.25, -3.0, float("nan")], dtype=torch.float64)
    y = torch.tensor([-0.3, 0.5, 2.0, 0.1], dtype=torch.float64)
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    want = loss(xr, yr, reduction="none", **kw)
    dx = _d(x, ["S(0)", "R"]).requires_grad_(True)
    dy = _d(y, ["R", "R"]).requires_grad_(True)
    got = loss(dx, dy, reduction="none", **kw)
    torch.testing.assert_close(got.full(), want, equal_nan=True)
    gy = torch.tensor([0.5, -1.25, 2.0, 1.0], dtype=torch.float64)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)
    torch.testing.assert_close(dy.grad.full(), yr.grad, equal_nan=True)
    assert not torch.isnan(dy.grad.full()[:3]).any() and torch.isnan(yr.grad[3])


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("shape,dtype,dim", [((4, 0, 4, 1), torch.complex128, -3),
                                             ((4, 0, 4, 1), torch.float64, 1),
                                             ((3, 4), torch.complex64, 0),
                                             ((0, 3), torch.complex64, 1),
                                             ((0, 3), torch.float32, 1),
                                             ((2, 3), torch.float32, 1)])
def test_max_min_of_a_dim_raise_as_torch(kind, shape, dtype, dim):
    """max / min(x, dim) runs torch's kernel checks first: an empty reduction dim is
    torch's IndexError, also for a complex x (was argmax's RuntimeError 'does not support
    complex input', seed 2006934 wide); a complex x names max / min, not argmax."""
    x = torch.zeros(shape, dtype=dtype)
    if x.numel():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    d = _d(x, ["R", "R"])
    wk, want = _kind(lambda: getattr(x, kind)(dim))
    gk, got = _kind(lambda: getattr(d, kind)(dim))
    assert gk == wk
    if wk == "ok":
        assert torch.equal(got[0].full(), want[0]) and torch.equal(got[1].full(), want[1])
    else:
        with pytest.raises(wk) as e:
            getattr(d, kind)(dim)
        assert kind in str(e.value)


@pytest.mark.parametrize("shape", [(4, 2, 0), (3, 2)])
@pytest.mark.parametrize("xd,bd", [(torch.float32, torch.float64),
                                   (torch.bfloat16, torch.float32),
                                   (torch.float32, torch.int64),
                                   (torch.int32, torch.int64)])
@pytest.mark.parametrize("call", ["min", "max", "both", "clip", "clamp_min", "clamp_max"])
def test_clamp_by_a_0d_tensor_keeps_the_dtype(shape, xd, bd, call):
    """A 0-d bound promotes as on one device: clamp(float32 x, min=float64 0-d) is
    float32; stacked with its device axes the bound made the result float64 (seed 2007193
    wide)."""
    fs = {"min": lambda a, b: torch.clamp(a, min=b), "max": lambda a, b: torch.clamp(a, max=b),
          "both": lambda a, b: torch.clamp(a, b - 1, b), "clip": lambda a, b: torch.clip(a, b),
          "clamp_min": lambda a, b: a.clamp_min(b), "clamp_max": torch.clamp_max}
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 3).to(xd)
    b = torch.tensor(0.7, dtype=bd) if bd.is_floating_point else torch.tensor(1, dtype=bd)
    want = fs[call](x, b)
    got = fs[call](_d(x, ["S(0)", "R"]), _d(b, ["R", "R"]))
    assert got.dtype == want.dtype
    assert torch.equal(got.full(), want)


def _complex_leaf(shape, ps, rg, mesh=MESH):
    """A complex tensor that requires grad (a complex leaf cannot): a real leaf times
    1 + 0.5j, as one device and as a DistTensor."""
    b = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    one = b.clone().requires_grad_(rg) * (1 + 0.5j)
    return one, _d(b, ps, mesh).requires_grad_(rg) * (1 + 0.5j)


@pytest.mark.parametrize("call,shape", [
    (c, s) for c in ("amax0", "amin1", "amax01", "cummax", "cummin", "kthvalue", "max_dim")
    for s in ((), (2, 1, 0), (2, 0, 3), (3, 2)) if s or c not in ("amin1", "amax01")])
@pytest.mark.parametrize("ps", [["R", "R"], ["P(sum)", "R"], ["R", "P(max)"]])
@pytest.mark.parametrize("rg,grad_on", [(True, True), (True, False), (False, True)])
def test_complex_extremes_refuse_autograd_as_torch(call, shape, ps, rg, grad_on):
    """amax / amin / cummax / cummin / kthvalue have real-only derivatives: torch raises
    RuntimeError '... does not support automatic differentiation for outputs with complex
    dtype' where a complex input requires grad and its kernel has nothing to refuse (an
    empty or 0-d input).  amax of an empty Partial complex went through the even-gradient
    Function (no autograd in its forward): a result (seed 2007734 wide); cummax / kthvalue
    of a 0-d complex returned it."""
    fs = {"amax0": lambda t: t.amax(0), "amin1": lambda t: t.amin(1),
          "amax01": lambda t: t.amax((0, 1)), "cummax": lambda t: t.cummax(0),
          "cummin": lambda t: t.cummin(-1), "kthvalue": lambda t: t.kthvalue(1, 0),
          "max_dim": lambda t: t.max(0)}
    one, d = _complex_leaf(shape, ps, rg)
    with torch.set_grad_enabled(grad_on):
        wk, want = _kind(lambda: fs[call](one))
        gk, got = _kind(lambda: fs[call](d))
    assert gk == wk
    if wk == "ok":
        w0, g0 = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
        assert torch.equal(g0.full(), w0)


@pytest.mark.parametrize("shape,k,dim", [((0,), 1, 0), ((0,), 2, -1), ((3, 0), 5, -1),
                                         ((3, 0), 5, 0), ((0, 3), 1, 0), ((0, 3), 1, -1),
                                         ((3, 2), 5, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_kthvalue_of_an_empty_dim_raises_index_error(shape, k, dim, dtype):
    """torch's kernel checks an empty reduction dim (IndexError) before k's range; the meta
    check asked first gave 'selected number k out of range' (RuntimeError)."""
    x = torch.zeros(shape, dtype=dtype)
    d = _d(x, ["R", "R"])
    wk, want = _kind(lambda: torch.kthvalue(x, k, dim))
    gk, got = _kind(lambda: torch.kthvalue(d, k, dim))
    assert gk == wk
    if wk == "ok":
        assert torch.equal(got[0].full(), want[0]) and torch.equal(got[1].full(), want[1])


_LOGITS = [0.0, -0.0, 1e-30, -3.0, 30.0, -30.0, 800.0, -800.0, float("inf"), float("-inf"),
           float("nan"), 0.5]
_TARGETS = [0.5, 0.0, 1.0, 0.7, 1.0, 0.0, 0.5, 0.2, 0.5, 0.5, 0.5, 1.0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pos_weight", [None, 2.0])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_bce_with_logits_gradient_at_zero_logits(dtype, pos_weight, reduction):
    """softplus(-x) composed of |x| and relu had derivative 0 at x = 0 where torch's
    kernel gives sigmoid(0) - 1: bce_with_logits(0, 0.5) had input gradient 0.5, torch's
    0 (a zeroed Partial factor made the logits 0: seed 2008353 wide).  Values, the input's
    and the target's gradients held to torch at 0, +-0, large, infinite and NaN logits."""
    x = torch.tensor(_LOGITS, dtype=dtype)
    y = torch.tensor(_TARGETS, dtype=dtype)
    pw = None if pos_weight is None else torch.full((len(_LOGITS),), pos_weight, dtype=dtype)
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    want = F.binary_cross_entropy_with_logits(xr, yr, reduction=reduction, pos_weight=pw)
    dx = _d(x, ["S(0)", "R"]).requires_grad_(True)
    dy = _d(y, ["R", "S(0)"]).requires_grad_(True)
    got = F.binary_cross_entropy_with_logits(
        dx, dy, reduction=reduction, pos_weight=None if pw is None else _d(pw, ["R", "R"]))
    torch.testing.assert_close(got.full(), want, equal_nan=True)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)
    torch.testing.assert_close(dy.grad.full(), yr.grad, equal_nan=True)


_NORM_ROWS = [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 2.0, 0.0], [1.0, -2.0, 0.0, 3.0],
              [-0.0, 0.0, -0.0, 0.0], [float("inf"), 1.0, 0.0, 3.0],
              [float("nan"), 1.0, 0.0, 3.0], [-1.0, -2.0, -3.0, -4.0]]


@pytest.mark.parametrize("p", [0.5, 0.3, 1.5, 3, -1, -0.5])
@pytest.mark.parametrize("ps", [["R", "R"], ["S(1)", "R"], ["P(sum)", "S(0)"]])
@pytest.mark.parametrize("dim", [1, None])
def test_vector_norm_p_gradient_at_zeros(p, ps, dim):
    """ord p < 1: the gradient of |x|^p at x = 0 was 0 * inf = nan where torch's
    linalg_vector_norm_backward masks it to 0 (times the rest: NaN where the norm's factor
    is NaN or infinite, as torch's).  Probe 7 ords x 3 layouts x 2 dims: 15 -> 0 of 84."""
    x = torch.tensor(_NORM_ROWS, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    want = torch.linalg.vector_norm(xr, p, dim)
    dx = _d(x, ps).requires_grad_(True)
    got = torch.linalg.vector_norm(dx, p, dim)
    torch.testing.assert_close(got.full(), want, equal_nan=True)
    gy = torch.linspace(-1, 1, want.numel(), dtype=torch.float64).reshape(want.shape)
    (want * gy).sum().backward()
    (got * gy).sum().backward()
    torch.testing.assert_close(dx.grad.full(), xr.grad, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.complex128,
                                   torch.complex64, torch.int64, torch.bool])
@pytest.mark.parametrize("shape,dim", [((2, 4), -1), ((3, 3), 1), ((0, 2), 1), ((2, 0), 1)])
def test_glu_dtypes_as_torch_cpu_kernel(dtype, shape, dim):
    """torch's glu CPU kernel has no complex (NotImplementedError '"glu_cpu" not
    implemented'); a complex DistTensor was computed (seed 2009093 wide).  Shape errors
    (an odd dim) come first, as torch's."""
    x = (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) / 3).to(dtype)
    d = _d(x, ["R", "S(0)"])
    wk, want = _kind(lambda: F.glu(x, dim))
    gk, got = _kind(lambda: F.glu(d, dim))
    assert gk == wk
    if wk == "ok":
        assert got.dtype == want.dtype and torch.equal(got.full(), want)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64])
@pytest.mark.parametrize("shape,dim", [((2, 0, 3), 1), ((0, 3), 0), ((2, 3), 1)])
@pytest.mark.parametrize("fn", [torch.std_mean, torch.var_mean])
def test_std_mean_of_no_element_keeps_a_complex_mean(dtype, shape, dim, fn):
    """Over no element the mean's NaN is made positive as torch's kernel's; its abs() made a
    complex mean real (float64 where torch's is complex128: seed 2010165 wide)."""
    x = torch.ones(shape).to(dtype)
    d = _d(x, ["S(0)", "R"])
    with warnings.catch_warnings():          # torch's 'degrees of freedom is <= 0'
        warnings.simplefilter("ignore")
        want = fn(x, dim)
        got = fn(d, dim)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        gf = g.full()
        bits = (lambda t: torch.view_as_real(t).signbit()) if w.is_complex() else torch.signbit
        assert torch.equal(bits(gf), bits(w))
        torch.testing.assert_close(gf, w, equal_nan=True)

