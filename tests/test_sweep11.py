"""Random sweep 11: the wide space of the random programs (tests/random_programs_wide.py,
``run_program(rng, wide=True)``) and what it found.  Each test holds a DistTensor call to
torch on the full tensor (values, dtype, gradient, or torch's exception type); the
docstrings say what was wrong before."""
import hashlib
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

MESH = wb.Mesh([[0, 1], [2, 3]])
LINE = wb.Mesh([2, 0, 1])


def _d(x, ps, mesh=MESH, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


def _x(*shape, dtype=torch.float64, seed=11):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "R"], ["P(sum)", "S(1)"], ["S(1)", "P(max)"]])
def test_cosine_similarity_broadcasts_before_the_norms(ps):
    """torch expands both inputs first: a (1, 1) x2 against a (3, 8) x1 is normed over 8
    elements.  Before: over its 1 element, 3.0 where torch gives 1.0 (seed 2000082 wide)."""
    x1, x2 = _x(3, 8), _x(1, 1, seed=12)
    want = F.cosine_similarity(x1, x2, 1)
    got = F.cosine_similarity(_d(x1, ps), _d(x2, ["R", "R"]), 1).full()
    torch.testing.assert_close(got, want)
    x3 = _x(8, seed=13)                       # fewer dims: the dim is the broadcast one's
    torch.testing.assert_close(F.cosine_similarity(_d(x1, ps), _d(x3, ["S(0)", "R"]), 1).full(),
                               F.cosine_similarity(x1, x3, 1))


def test_logsumexp_of_complex_is_complex():
    """torch.logsumexp of a complex tensor: complex, the max taken over the real parts.
    Before: cast to float32 (the imaginary part dropped; seed 2000023 wide)."""
    x = torch.complex(_x(3, 4), _x(3, 4, seed=5))
    for ps in (["R", "R"], ["S(0)", "S(1)"], ["S(1)", "R"]):
        for dim in (0, 1, (0, 1)):
            got = torch.logsumexp(_d(x, ps), dim).full()
            assert got.dtype == torch.complex128
            torch.testing.assert_close(got, torch.logsumexp(x, dim))


@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "R"], ["S(1)", "S(0)"]])
def test_nanmean_gradient_of_an_all_nan_slice_is_nan(ps):
    """nanmean is nansum / count (torch's composition), nansum's gradient grad * ~isnan:
    over a slice of nans (count 0) an inf gradient times 0 is nan, as torch's.  Before:
    0 there (a where), so nan did not spread (seed 2000039 wide: finite t2.grad, torch's
    all nan)."""
    n, i = float("nan"), float("inf")
    x = torch.tensor([[1.5, n, n, i], [0.5, n, -1.0, 2.0]], dtype=torch.float64)
    for f in (lambda t: t.nanmean(0, keepdim=True), lambda t: torch.nansum(t, 1) * 2,
              lambda t: t.nanmean()):
        r, d = x.clone().requires_grad_(), _d(x, ps).requires_grad_()
        f(r).sum().backward()
        f(d).sum().backward()
        torch.testing.assert_close(f(d).full().detach(), f(r).detach(), equal_nan=True)
        torch.testing.assert_close(d.grad.full(), r.grad, equal_nan=True)


@pytest.mark.parametrize("call", [lambda t: torch.kthvalue(t, 2, 1), lambda t: t.median(),
                                  lambda t: torch.median(t, 0)])
def test_sort_selections_refuse_bool_as_torch(call):
    """kthvalue / median of a bool tensor: torch's CPU kernel raises NotImplementedError
    (its meta kernel does not check).  Before: a result (seed 2000015 wide)."""
    x = _x(4, 3) > 0
    with pytest.raises(NotImplementedError):
        call(x)
    with pytest.raises(NotImplementedError):
        call(_d(x, ["S(0)", "R"]))
    e = torch.zeros(0, 3, dtype=torch.bool)          # torch's median() of no element: nan
    assert torch.median(_d(e, ["R", "R"])).full().dtype == torch.median(e).dtype


def test_cdist_dtypes_as_torch():
    """cdist of float32 and float64: torch raises for rows, returns the first input's dtype
    for none (2000162 wide: float64 here); of bfloat16, NotImplementedError (2000221)."""
    a, b = _x(0, 3, dtype=torch.float32), _x(2, 3)
    assert torch.cdist(_d(a, ["R", "R"]), _d(b, ["S(0)", "R"])).full().dtype == \
        torch.cdist(a, b).dtype == torch.float32
    a = _x(2, 3, dtype=torch.float32)
    with pytest.raises(RuntimeError):
        torch.cdist(a, b)
    with pytest.raises(RuntimeError):
        torch.cdist(_d(a, ["R", "R"]), _d(b, ["R", "R"]))
    c = _x(2, 3).bfloat16()
    with pytest.raises(NotImplementedError):
        torch.cdist(c, c, p=1.0)
    with pytest.raises(NotImplementedError):
        torch.cdist(_d(c, ["S(0)", "R"]), _d(c, ["R", "R"]), p=1.0)


@pytest.mark.parametrize("name", ["smooth_l1", "huber", "bce_dtypes", "bce_logits_bool",
                                  "l1_complex"])
def test_losses_check_dtypes_as_torch_cpu(name):
    """Loss dtype checks of torch's CPU kernels, which its meta kernels skip: a complex
    smooth_l1 / huber (NotImplementedError, seeds 2000052, 2000520), bce of a float32 input
    and a float64 target (RuntimeError, 2000057), bce_with_logits of a bool
    (NotImplementedError; RuntimeError from the meta decomposition before, 2000225)."""
    x, y = _x(3, 4), _x(3, 4, seed=4)
    cx = torch.complex(x, y)
    calls = {"smooth_l1": (lambda a, b: F.smooth_l1_loss(a, b), cx, y),
             "huber": (lambda a, b: F.huber_loss(a, b), cx, y),
             "l1_complex": (lambda a, b: F.l1_loss(a, b), cx, cx),
             "bce_dtypes": (lambda a, b: F.binary_cross_entropy(a, b),
                            x.sigmoid().float(), y.sigmoid()),
             "bce_logits_bool": (lambda a, b: F.binary_cross_entropy_with_logits(a, b),
                                 x > 0, y.sigmoid())}
    f, a, b = calls[name]
    try:
        want = f(a, b)
    except Exception as e:          # noqa: BLE001 - torch's verdict, any type
        with pytest.raises(type(e)):
            f(_d(a, ["S(0)", "R"]), _d(b, ["R", "S(1)"]))
        return
    torch.testing.assert_close(f(_d(a, ["S(0)", "R"]), _d(b, ["R", "S(1)"])).full(), want)


def test_distribute_uint8_max_min_parts_do_not_wrap():
    """validate_inputs.distribute: P(max) parts are x minus an offset, which wrapped for a
    uint8 0 (0 - 1 = 255: the held value was 255, seed 2000094 wide); parts now stay x."""
    x = torch.tensor([[0, 1, 255], [2, 0, 7]], dtype=torch.uint8)
    for ps in (["P(max)", "R"], ["P(min)", "P(min)"], ["S(0)", "P(max)"]):
        assert torch.equal(_d(x, ps).full(), x)


@pytest.mark.parametrize("name", ["mul_s", "add_f64", "div", "sum", "cumsum", "add_i64",
                                  "mul_i", "neg"])
def test_integer_partial_sum_reduced_before_another_dtype(name):
    """A uint8 P(sum) holds sums modulo 256 (parts 255 + 2 are 1): promoted part by part
    (* 1.5 -> float32, sum() -> int64, + int64) each part's own value was summed: 769.5
    where torch gives 1.5 (seeds 2000437, 2000489 wide).  Reduced first now; same-dtype
    ops (* 3, neg) stay Partial (modular arithmetic is exact part by part)."""
    x = torch.tensor([1, 0, 5, 200], dtype=torch.uint8)
    d = _d(x, ["P(sum)"], mesh=LINE, seed=1)
    assert any(int(v) > 200 for loc in d.locals() for v in loc)       # the parts wrap
    f = {"mul_s": lambda t: t * 1.5, "add_f64": lambda t: t + torch.ones(4, dtype=torch.float64),
         "div": lambda t: t / 2, "sum": lambda t: t.sum(), "cumsum": lambda t: t.cumsum(0),
         "add_i64": lambda t: t + torch.ones(4, dtype=torch.int64), "mul_i": lambda t: t * 3,
         "neg": lambda t: -t}[name]
    got, want = f(d), f(x)
    assert got.dtype == want.dtype
    assert torch.equal(got.full(), want)
    if name in ("mul_i", "neg"):
        assert got.placements[0].is_partial()


def _text_md5(seed, wide):
    from tests.random_programs import run_program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_program(random.Random(seed), avoid=(), wide=wide)
    return out.status, hashlib.md5(out.text.encode()).hexdigest()[:10]


def test_old_programs_unchanged_by_the_wide_space():
    """run_program(wide=False) draws the programs it drew before random_programs_wide.py
    existed (md5 of the program text at 325273cf, seeds of sweep 11's first range)."""
    assert _text_md5(1054000, False) == ("ok", "80f0e6bb07")
    assert _text_md5(1054001, False) == ("ok", "aade2fc9a7")


@pytest.mark.parametrize("seed", [2000082, 2000437])
def test_wide_programs_found_by_the_sweep_now_ok(seed):
    """Two of the wide sweep's wrong programs (cosine_similarity broadcast, an integer
    partial sum times a float), whole: ok now."""
    assert _text_md5(seed, True)[0] == "ok"


@pytest.mark.parametrize("call", [lambda t: torch.nansum(t, 0), lambda t: t.nanmean(),
                                  lambda t: t.nanmean(1, keepdim=True)])
def test_nansum_nanmean_of_complex_raise_as_torch(call):
    """torch's CPU nansum refuses complex inputs (RuntimeError; its meta kernel does not).
    Before: a result (seed 2000595 wide)."""
    x = torch.complex(_x(3, 4), _x(3, 4, seed=5))
    with pytest.raises(RuntimeError):
        call(x)
    with pytest.raises(RuntimeError):
        call(_d(x, ["S(0)", "R"]))


@pytest.mark.parametrize("red", ["none", "sum", "mean"])
@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "S(1)"], ["P(sum)", "R"]])
def test_bce_input_gradient_at_saturation_is_torchs(red, ps):
    """binary_cross_entropy's input gradient is torch's kernel's, grad (x - y) / max((1 - x)
    x, 1e-12): finite where sigmoid saturates to exactly 0 or 1.  Before: the clamped
    log's 0 times 1 / 0, nan (seeds 2000323, 2000418 wide: nan gradients, torch's finite).
    (The target's gradient there is still the clamped logs' -100, torch's -inf: not fixed.)"""
    z = torch.tensor([[40.0, -40.0, 0.3], [1.0, -2.0, 50.0]], dtype=torch.float64)
    y = torch.tensor([[0.2, 0.9, 0.5], [1.0, 0.0, 0.3]], dtype=torch.float64)
    w = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    r, d = z.clone().requires_grad_(), _d(z, ps).requires_grad_()
    a = F.binary_cross_entropy(r.sigmoid(), y, weight=w, reduction=red)
    b = F.binary_cross_entropy(d.sigmoid(), _d(y, ["R", "S(1)"]), weight=_d(w, ["R", "R"]),
                               reduction=red)
    torch.testing.assert_close(b.full(), a)
    a.backward(torch.ones_like(a))
    b.backward(torch.ones_like(a))
    assert torch.isfinite(r.grad).all()
    torch.testing.assert_close(d.grad.full(), r.grad)


@pytest.mark.parametrize("shape", [(1, 3, 0), (1, 0, 3), (2, 0)])
@pytest.mark.parametrize("o", [1, -1, float("inf"), float("-inf")])
def test_matrix_norm_over_an_empty_dim_as_torch(shape, o):
    """matrix_norm(ord=1 / inf) whose max runs over an empty dim: torch's 0 (the max of no
    norm).  Before: amax's IndexError (seed 2001270 wide); ord=-1 / -inf raise as torch."""
    x = torch.zeros(shape, dtype=torch.float64)
    d = _d(x, ["R", "S(0)"])
    try:
        want = torch.linalg.matrix_norm(x, o, keepdim=True)
    except IndexError:
        with pytest.raises(IndexError):
            torch.linalg.matrix_norm(d, o, keepdim=True)
        return
    torch.testing.assert_close(torch.linalg.matrix_norm(d, o, keepdim=True).full(), want)
