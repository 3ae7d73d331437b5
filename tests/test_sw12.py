"""sw12: silent wrong answers in DistTensor ops, held to torch on one device.

1. The inf-norm gradient (``vector_norm`` / ``norm`` / ``linalg.norm`` / ``dist`` with ord
   +-inf): torch's ``norm_backward`` masks ``|x| == norm`` or NaN and multiplies by
   ``sgn(x)`` (0 for NaN), so a NaN-holding slice gets a zero gradient; ours was amax's
   (NaN everywhere).  Ties share the gradient evenly, across ranks too.  Probe (24 calls x
   7 inputs x 10 layouts, NaN / ties / inf / zeros / empty / 0-d): 1000 of 2940 unlike
   torch before, 0 after.
2. In-place writes through views (probe: 16 written views x 16 in-place ops x 6 layouts):
   a write into a view sharing x's memory left x's views that are copies (uneven shards)
   stale, and so did ``x[1:].detach()`` (a copy's handle); ``x[1:].detach().add_(x[:-1])``
   (the view a temporary) was computed where torch refuses the overlap;
   ``masked_fill_`` / ``index_fill_`` into an expanded view raised where torch writes the
   base.  Probe (benchmarks/sw12_probes/probe_inplace.py): 528 of 1536 unlike torch
   before (418 wrong values or error types, 110 refusals naming the fix), 131 after, all
   refusals (NotImplementedError naming clone() or the fix) where torch computes in its
   loop order or through a copy view's handle.
3. ``median()`` of every element (NaN, ties: 128 of 240 before, 0 after), nll_loss's target
   and input dtypes (a uint8 target computed, a bool input's NotImplementedError), addbmm /
   baddbmm of no batch with mixed dtypes (sweep wide seed 2003330; BLAS probe 609 of 2592
   before, 0 after).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.dist_tensor import shard_tensor
from workbench.parallel.placement import Replicate, parse_placements
from workbench.parallel.validate_inputs import distribute

INF, NAN = math.inf, math.nan
M1 = wb.Mesh([0, 1, 2, 3])
M2 = wb.Mesh([[0, 1], [2, 3]])
M3 = wb.Mesh([0, 1, 2])
LAYOUTS = [(M1, ["R"]), (M1, ["S(0)"]), (M1, ["S(1)"]), (M1, ["P(sum)"]), (M3, ["S(1)"]),
           (M2, ["S(0)", "S(1)"]), (M2, ["P(sum)", "S(1)"])]
IDS = ["-".join(ps) + f"@{m.ndim}d{m.size}" for m, ps in LAYOUTS]


def _run(f, x, w_seed=5):
    """``f(x)``, then ``(f(x) * w).sum().backward()``: (value, dtype, x.grad)."""
    y = f(x)
    full = y.full() if hasattr(y, "full") else y
    g = torch.Generator().manual_seed(w_seed)
    w = torch.rand(tuple(full.shape), generator=g, dtype=torch.float64).to(full.dtype) + 0.5
    if hasattr(y, "full"):
        w = shard_tensor(w, y.mesh, [Replicate()] * y.mesh.ndim)
    (y * w).sum().backward()
    gx = x.grad.full() if hasattr(x.grad, "full") else x.grad
    return full.detach(), full.dtype, gx


def _same(got, want):
    assert got[1] == want[1]
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12, equal_nan=True)


# ---- item 1: the inf-norm gradient ---------------------------------------------------------
X_NORM = torch.tensor([[1., -3., 2., 3., 0.], [-3., 1., NAN, 2., 1.], [0., 0., 0., 0., 0.],
                       [2., -2., 1., -1., 0.5], [INF, 1., -INF, 2., 1.]], dtype=torch.float64)
NORM_CALLS = {
    "vector_norm(inf)": lambda t: torch.linalg.vector_norm(t, INF),
    "vector_norm(inf, 1)": lambda t: torch.linalg.vector_norm(t, INF, 1),
    "vector_norm(-inf, 0, keepdim)": lambda t: torch.linalg.vector_norm(t, -INF, 0, True),
    "t.norm(inf, 1)": lambda t: t.norm(INF, 1),
    "torch.norm(-inf)": lambda t: torch.norm(t, -INF),
    "linalg.norm(inf, dim=0)": lambda t: torch.linalg.norm(t, INF, 0),
    "dist(inf)": lambda t: torch.dist(t, t.detach() * 0.5, INF),
    "normalize(inf)": lambda t: F.normalize(t, INF, 1),
}


@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_inf_norm_gradient_with_nan_and_ties_as_torch(mesh, ps):
    """Rows / columns holding NaN get 0 (torch's mask holds the NaN, ``sgn(NaN)`` is 0),
    not NaN everywhere; ties (3 and -3 twice in row 0, across ranks on shards) share the
    gradient evenly; an all-zero row gets 0; inf / -inf are selected as any maximum."""
    for name, f in NORM_CALLS.items():
        r = X_NORM.clone().requires_grad_()
        want = _run(f, r)
        d = distribute(X_NORM.clone(), mesh, parse_placements(ps), seed=3).requires_grad_()
        got = _run(f, d)
        _same(got, want)
        assert not torch.isnan(want[2][0]).any(), name      # the case is the one meant


def test_inf_norm_gradient_float32_and_ties_across_ranks():
    """float32, a tie split over four ranks (one maximum per rank: 1/4 each), the 0-d norm
    of a NaN (gradient 0 as abs's)."""
    x = torch.tensor([[5., 1.], [-5., 2.], [5., 0.], [-5., 4.]], dtype=torch.float32)
    for ps in (["S(0)"], ["P(sum)"], ["R"]):
        for f in (lambda t: torch.linalg.vector_norm(t, INF),
                  lambda t: torch.linalg.vector_norm(t[:, 0], INF),
                  lambda t: torch.linalg.vector_norm(t * NAN, -INF, 0)):
            r = x.clone().requires_grad_()
            d = distribute(x.clone(), M1, parse_placements(ps), seed=3).requires_grad_()
            _same(_run(f, d), _run(f, r))
    r = torch.tensor(NAN, dtype=torch.float64, requires_grad=True)
    d = distribute(torch.tensor(NAN, dtype=torch.float64), M1, [Replicate()]).requires_grad_()
    _same(_run(lambda t: torch.linalg.vector_norm(t, INF), d),
          _run(lambda t: torch.linalg.vector_norm(t, INF), r))


def test_matrix_norm_of_an_empty_matrix_and_its_errors_as_torch():
    """``matrix_norm(inf)`` of a (0, 3) matrix is torch's constant 0 (no grad_fn: x.grad
    stays None; before, an empty gradient); ``linalg.norm(-inf)`` of it raises torch's
    CPU IndexError (before, the meta kernel's RuntimeError)."""
    for shape, ord in (((0, 3), INF), ((3, 0), 1)):
        x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        d = distribute(x.detach().clone(), M1, parse_placements(["S(1)"])).requires_grad_()
        want, got = torch.linalg.matrix_norm(x, ord), torch.linalg.matrix_norm(d, ord)
        assert got.requires_grad == want.requires_grad is False
        torch.testing.assert_close(got.full(), want, rtol=0, atol=0)
    x = torch.zeros((0, 3), dtype=torch.float64)
    with pytest.raises(IndexError):
        torch.linalg.norm(x, -INF)
    with pytest.raises(IndexError):
        torch.linalg.norm(distribute(x, M1, parse_placements(["R"])), -INF)


# ---- item 3: median() of every element, nll_loss's target dtypes, addbmm of no batch ------
X_MED = {"ties": torch.tensor([[1., 2., 2.], [2., 3., 2.], [0., 2., 5.], [2., 1., 4.]],
                              dtype=torch.float64),
         "nan": torch.tensor([[1., NAN, 2.], [2., 3., NAN], [0., 2., 5.], [2., 1., 4.]],
                             dtype=torch.float64),
         "even": torch.tensor([[3., 1.], [2., 2.], [1., 3.]], dtype=torch.float32)}


@pytest.mark.parametrize("mesh,ps", LAYOUTS, ids=IDS)
def test_median_of_every_element_as_torch(mesh, ps):
    """``x.median()``: NaN where x holds one (before, the k-th of a sort: 2.0), and torch's
    ``evenly_distribute_backward``: the equal elements share the gradient (before, the
    k-th's one index took it all)."""
    for name, x in X_MED.items():
        for f in (lambda t: t.median(), lambda t: torch.median(t * 2)):
            r = x.clone().requires_grad_()
            d = distribute(x.clone(), mesh, parse_placements(ps), seed=3).requires_grad_()
            _same(_run(f, d), _run(f, r))


def test_nll_loss_target_and_input_dtypes_as_torch():
    """A uint8 target is torch's ("Long or Byte": computed; before, gather's RuntimeError);
    a bool target: torch's RuntimeError; a bool input: torch's NotImplementedError (before,
    the meta decomposition's negation RuntimeError), also with a weight given."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64).log_softmax(1)
    t = torch.tensor([2, 0, 1, 2], dtype=torch.uint8)
    for ps in (["R"], ["S(0)"]):
        for red in ("mean", "none"):
            r = x.clone().requires_grad_()
            d = distribute(x.clone(), M1, parse_placements(ps)).requires_grad_()
            f = (lambda tt: lambda u: F.nll_loss(u, tt, reduction=red))
            _same(_run(f(distribute(t, M1, parse_placements(ps))), d), _run(f(t), r))
        d = distribute(x, M1, parse_placements(ps))
        for xx, tt, err in ((x, t.bool(), RuntimeError), (x > 0, t.long(), NotImplementedError)):
            for kw in ({}, {"weight": torch.ones(3, dtype=xx.dtype)}):
                with pytest.raises(err):
                    F.nll_loss(xx, tt, **kw)
                with pytest.raises(err):
                    F.nll_loss(distribute(xx, M1, parse_placements(ps)),
                               distribute(tt, M1, parse_placements(ps)), **kw)


def test_addbmm_and_baddbmm_of_no_batch_as_torch():
    """torch's CPU kernel of no batch multiplies nothing and checks no batch dtype: addbmm
    is ``input * beta`` in input's dtype (sweep wide seed 2003330: float64 input, float32
    and float64 batches; before, "input dtypes must be the same"), its int input with a
    float beta raises torch's RuntimeError; baddbmm's empty output takes batch2's dtype;
    addmm of an empty k with mixed dtypes still raises as torch."""
    g = torch.Generator().manual_seed(3)
    inp = torch.randn(1, 3, generator=g, dtype=torch.float64)
    b1, b2 = torch.zeros(0, 1, 2), torch.zeros(0, 2, 3, dtype=torch.float64)
    for mesh, pi in ((M1, ["R"]), (M1, ["S(1)"]), (M2, ["R", "P(sum)"])):
        for beta, alpha in ((-0.16, -1.18), (0, 1), (2, 3)):
            r = inp.clone().requires_grad_()
            d = distribute(inp.clone(), mesh, parse_placements(pi), seed=1).requires_grad_()
            rep = [Replicate()] * mesh.ndim
            f = (lambda u, v, w: lambda t: torch.addbmm(t, u, v, beta=beta, alpha=alpha))
            want = _run(f(b1, b2, None), r)
            got = _run(f(shard_tensor(b1, mesh, rep), shard_tensor(b2, mesh, rep), None), d)
            assert got[1] == want[1]
            torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)
        rep = [Replicate()] * mesh.ndim
        i64 = torch.ones(1, 3, dtype=torch.int64)
        with pytest.raises(RuntimeError):
            torch.addbmm(i64, b1, b2, beta=-0.16)
        with pytest.raises(RuntimeError):
            torch.addbmm(shard_tensor(i64, mesh, rep), shard_tensor(b1, mesh, rep),
                         shard_tensor(b2, mesh, rep), beta=-0.16)
        want = torch.baddbmm(torch.zeros(0, 1, 3, dtype=torch.float64), b1.double(), b2.float())
        got = torch.baddbmm(shard_tensor(torch.zeros(0, 1, 3, dtype=torch.float64), mesh, rep),
                            shard_tensor(b1.double(), mesh, rep),
                            shard_tensor(b2.float(), mesh, rep))
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        for f in (lambda t, u, v: torch.addmm(t, u, v), ):
            args = (inp, torch.zeros(1, 0), torch.zeros(0, 3, dtype=torch.float64))
            with pytest.raises(RuntimeError):
                f(*args)
            with pytest.raises(RuntimeError):
                f(*[shard_tensor(a, mesh, rep) for a in args])


# ---- item 2: writes through views, detach() handles and expanded views ---------------------
def _x(mesh, ps):
    g = torch.Generator().manual_seed(11)
    x = torch.rand((4, 4), generator=g, dtype=torch.float64) + 0.5
    return distribute(x, mesh, parse_placements(ps), seed=3)


INPLACE_LAYOUTS = [(M1, ["R"]), (M1, ["S(0)"]), (M3, ["S(0)"]), (M3, ["S(1)"]),
                   (M2, ["S(0)", "S(1)"]), (M2, ["S(1)", "P(max)"])]
INPLACE_IDS = ["-".join(ps) + f"@{m.size}" for m, ps in INPLACE_LAYOUTS]


@pytest.mark.parametrize("mesh,ps", INPLACE_LAYOUTS, ids=INPLACE_IDS)
def test_detach_of_a_temporary_view_overlap_refused_as_torch(mesh, ps):
    """``x[1:].detach().add_(x[:-1])``: the view x[1:] is a temporary, gone when the write
    comes; its handle still shares x's memory (torch refuses the partial overlap).  Before,
    computed from values read first; now torch's error, x untouched."""
    d = _x(mesh, ps)
    before = d.full().clone()
    with pytest.raises(RuntimeError, match="single memory location"):
        (lambda c: c[1:].detach().add_(c[:-1]))(before.clone())
    with pytest.raises(RuntimeError, match="single memory location"):
        d[1:].detach().add_(d[:-1])
    torch.testing.assert_close(d.full(), before, rtol=0, atol=0)


@pytest.mark.parametrize("mesh,ps", INPLACE_LAYOUTS, ids=INPLACE_IDS)
def test_copy_views_and_their_handles_see_writes_through_other_views(mesh, ps):
    """``vc = x[:, 1:]`` over uneven column shards, ``v1 = x[1:]`` over uneven rows are
    copies; a write into x through another view (``x[1:].add_``, ``x.t().mul_``) left
    them as they were, and ``x[1:].detach()`` kept its values after a write into x
    (silently).  Now torch's values, as one memory."""
    d = _x(mesh, ps)
    r = d.full().clone()
    kept_d = [d[:, 1:], d[1:], d[1:].detach(), d[:, 1:].detach(), d[1:].data]
    kept_r = [r[:, 1:], r[1:], r[1:].detach(), r[:, 1:].detach(), r[1:].data]
    for f in (lambda t: t[1:].add_(100.), lambda t: t.t().mul_(2.), lambda t: t.add_(1.),
              lambda t: t.detach()[0].fill_(-1.), lambda t: t[:, 2:].zero_(),
              lambda t: t[1:].detach().mul_(3.), lambda t: t.t().detach()[1:].add_(5.)):
        try:
            f(d)
        except NotImplementedError:    # the handle of a view that is a copy: refused
            torch.testing.assert_close(d.full(), r, rtol=0, atol=0)   # (inplace11b), x kept
            continue
        f(r)
        torch.testing.assert_close(d.full(), r, rtol=1e-12, atol=1e-12)
        for kd, kr in zip(kept_d, kept_r):
            torch.testing.assert_close(kd.full(), kr, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh,ps", INPLACE_LAYOUTS, ids=INPLACE_IDS)
def test_masked_and_index_fill_of_an_expanded_view_write_the_base(mesh, ps):
    """torch fills a written-to tensor whose elements share memory (deprecated, with a
    warning): the value lands in the base element under any selected position; before,
    "more than one element ... single memory location" was raised.  copy_ into one still
    raises torch's error."""
    m = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    for f in (lambda t: t[:1].expand(4, 4).masked_fill_(m, 9.),
              lambda t: t[:, 2:3].expand(4, 4).masked_fill_(m, t[0, 0]),
              lambda t: t[:1].expand(4, 4).index_fill_(1, torch.tensor([0, 2]), -2.),
              lambda t: t[:, 1:2].expand(4, 4).index_fill_(0, torch.tensor([3]), 5.),
              lambda t: t[1].expand(2, 4, 4).masked_fill_(m[0], 7.)):
        d = _x(mesh, ps)
        r = d.full().clone()
        with pytest.warns(UserWarning, match="expanded tensors is deprecated"):
            e_r = f(r)
        with pytest.warns(UserWarning, match="expanded tensors is deprecated"):
            e_d = f(d)
        torch.testing.assert_close(d.full(), r, rtol=0, atol=0)
        torch.testing.assert_close(e_d.full(), e_r, rtol=0, atol=0)
    d = _x(mesh, ps)
    with pytest.raises(RuntimeError, match="more than one element"):
        d.full()[:1].expand(4, 4).copy_(torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="more than one element"):
        d[:1].expand(4, 4).copy_(torch.ones(4, 4, dtype=torch.float64))
