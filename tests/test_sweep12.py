"""Random sweep 12: defects found by the random program sweep (``benchmarks/random_sweep.py``,
wide seeds 2004000.., tests/random_programs_wide.py) and by probes of the same ops.  Each
test holds a DistTensor call to torch on the full tensor; the docstrings say what was wrong
before."""
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


@pytest.mark.parametrize("shape", [(0, 2, 3, 3), (0, 2, 0, 0)])
def test_conv2d_of_an_empty_batch_with_per_rank_weights(shape):
    """A Partial weight gives every rank its own filters (the grouped form); an empty batch
    made its reshape(N, n, -1) ambiguous: RuntimeError (seed 2004087 wide)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, 1, 1, generator=g, dtype=torch.float64)
    mesh = wb.Mesh([[[1], [0]]])
    wr = w.clone().requires_grad_(True)
    want = F.conv2d(x, wr, stride=2, padding=1)
    dx = _d(x, ["P(max)", "R", "P(max)"], mesh, seed=423)
    dw = _d(w, ["S(1)", "P(sum)", "R"], mesh, seed=62).requires_grad_(True)
    got = F.conv2d(dx, dw, stride=2, padding=1)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.full(), want)
    (want * 2).sum().backward()
    (got * 2).sum().backward()
    torch.testing.assert_close(dw.grad.full(), wr.grad)


def test_sum_over_dim_0_of_a_0d_complex_stays_complex():
    """A 0-d tensor's sum over dim 0 is the identity and a cast; a complex one was cast to
    int64 as an integer would be (AssertionError 'op table bug', seed 2004150 wide)."""
    z = torch.tensor(1.5 - 2.25j, dtype=torch.complex64)
    d = _d(z, ["R", "R"])
    for kw in ({}, {"keepdim": True}):
        got, want = d.sum((0,), **kw), z.sum((0,), **kw)
        assert got.dtype == want.dtype == torch.complex64
        assert torch.equal(got.full(), want)
    i = torch.tensor(3, dtype=torch.int32)
    assert _d(i, ["R", "R"]).sum(0).dtype == i.sum(0).dtype == torch.int64


I, F64, F32 = torch.int64, torch.float64, torch.float32


@pytest.mark.parametrize("fn,si,sa,sb", [
    (torch.addbmm, (), (0, 2, 3), (0, 3, 4)), (torch.addbmm, (2, 4), (2, 0, 3), (2, 3, 4)),
    (torch.addbmm, (), (2, 2, 3), (2, 3, 4)), (torch.baddbmm, (2, 1, 4), (2, 2, 0), (2, 0, 4)),
    (torch.addmm, (), (0, 3), (3, 4)), (torch.addmv, (2,), (2, 0), (0,))])
@pytest.mark.parametrize("dts", [(F64, I, F64), (I, F64, F64), (F64, F64, I), (F32, F64, F64)])
def test_blas_updates_check_dtypes_as_torchs_cpu_kernels(fn, si, sa, sb, dts):
    """torch's CPU addbmm skips its dtype check for an empty batch (the result is
    beta * input in the input's dtype); a mixed-dtype addbmm of no batch raised here
    (seed 2004481 wide).  Elsewhere torch raises RuntimeError, as here."""
    g = torch.Generator().manual_seed(1)
    x, a, b = ((torch.randn(s, generator=g) * 3).to(dt) for s, dt in zip((si, sa, sb), dts))
    kw = {"beta": 0.02, "alpha": -0.15}
    want_kind, want = _kind(lambda: fn(x, a, b, **kw))
    mesh = wb.Mesh([0, 1, 2])
    dx = distribute(x, mesh, parse_placements(["R"]), seed=1)
    da = distribute(a, mesh, parse_placements(["S(0)" if a.dim() == 3 else "R"]), seed=1)
    db = distribute(b, mesh, parse_placements(["R"]), seed=1)
    got_kind, got = _kind(lambda: fn(dx, da, db, **kw))
    assert got_kind == want_kind
    if want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.full(), want)


@pytest.mark.parametrize("op", [torch.addcmul, torch.addcdiv])
@pytest.mark.parametrize("dts", [(torch.bool,) * 3, (F64, torch.bool, torch.bool),
                                 (I, torch.bool, torch.bool), (F64, F64, F64)])
def test_addcmul_addcdiv_of_bools_raise_as_torch(op, dts):
    """torch's CPU kernels refuse addcmul of three bools (NotImplementedError) and addcdiv
    of bool tensors (RuntimeError, integer division); its meta kernels do not check, and
    here both computed a result."""
    x, t1, t2 = (torch.tensor([1, 0, 1, 1]).to(dt) for dt in dts)
    want_kind, want = _kind(lambda: op(x, t1, t2, value=2))
    ds = [_d(t, ["S(0)", "R"]) for t in (x, t1, t2)]
    got_kind, got = _kind(lambda: op(*ds, value=2))
    assert got_kind == want_kind
    if want is not None:
        torch.testing.assert_close(got.full(), want, equal_nan=True)


def test_gather_of_float16_shards_under_bfloat16_autocast():
    """A collective's simulated math (torch.cat / torch.stack of the shards) ran under the
    caller's autocast, whose promote policy refuses float16 under bfloat16: ``x.float()``
    of a float16 S(2) P(max) tensor raised 'Unexpected floating ScalarType in
    at::autocast::prioritize' (seed 2004533 wide).  torch computes the cat in float32."""
    g = torch.Generator().manual_seed(2)
    x1 = torch.randn(2, 4, 1, generator=g).half()
    x2 = torch.randn(2, 4, 1, generator=g)
    mesh = wb.Mesh([[[3], [0]], [[1], [2]]])
    t1 = _d(x1, ["S(2)", "R", "P(max)"], mesh, seed=0)
    t2 = _d(x2, ["R", "P(max)", "R"], mesh, seed=162)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.cat([t1.full().float(), t2.full()], dim=1)
        got = torch.cat([t1.float(), t2], dim=1)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got.full(), want)


@pytest.mark.parametrize("src", [["R", "S(0)"], ["R", "P(sum)"], ["S(1)", "S(0)"],
                                 ["R", "P(max)"]])
@pytest.mark.parametrize("dst", [["R", "R"], ["R", "S(1)"], ["S(0)", "S(0)"]])
def test_redistribute_of_float16_under_bfloat16_autocast(src, dst, dtype=torch.float16):
    """A reshard moves bytes: under bfloat16 autocast a float16 (uneven) gather or reduce
    raised 'Unexpected floating ScalarType in at::autocast::prioritize' (14 of 16 layout
    pairs before)."""
    mesh = wb.Mesh([[0, 1, 2]])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(8)).to(dtype)
    d = _d(x, src, mesh, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = d.redistribute(mesh, parse_placements(dst))
    assert y.dtype == dtype and torch.equal(y.full(), d.full())


_DTS = (F64, F32, torch.complex128, I, torch.bool)


@pytest.mark.parametrize("name", ["maximum", "minimum", "maximum_", "minimum_", "pow_"])
@pytest.mark.parametrize("d1", _DTS)
@pytest.mark.parametrize("form", ["list", "scalar", "scalars"])
def test_foreach_maximum_minimum_as_torchs_foreach(name, d1, form):
    """torch._foreach_maximum is its own kernel: NotImplementedError for a complex (where
    Tensor.maximum raises RuntimeError: seed 2004315 wide), a Scalar or a list of them
    accepted (a clamp; here TypeError), an in-place int64 by a float list refused (here
    copy_ truncated it silently); _foreach_pow_ of bools NotImplementedError."""
    g = torch.Generator().manual_seed(4)
    for d2 in _DTS:
        a, b = ((torch.randn(4, generator=g) * 3).to(dt) for dt in (d1, d2))
        other = {"list": [b], "scalar": 2.5, "scalars": [-1.5]}[form]
        f = getattr(torch, f"_foreach_{name}")
        ta = a.clone()
        want_kind, want = _kind(lambda: f([ta], other))
        da = _d(a, ["S(0)", "R"])
        dother = [_d(b, ["R", "S(0)"])] if form == "list" else other
        got_kind, got = _kind(lambda: f([da], dother))
        assert got_kind == want_kind, (d2, want_kind, got_kind)
        if want_kind != "ok":
            assert torch.equal(da.full(), a)                     # left untouched
        elif name.endswith("_"):
            assert want[0] is ta and got[0] is da            # the list written (torch 2.13)
            torch.testing.assert_close(da.full(), ta, equal_nan=True)
        else:
            assert got[0].dtype == want[0].dtype
            torch.testing.assert_close(got[0].full(), want[0], equal_nan=True)


@pytest.mark.parametrize("op", ["addcdiv_", "addcmul_", "addcdiv", "addcmul"])
def test_foreach_addcdiv_with_a_tensor_of_scalars(op):
    """torch._foreach_addcdiv_(xs, t1s, t2s, scalars) takes the scalars as one 1-d tensor
    (torch.optim's capturable steps); here each tensor got the whole tensor as its value
    (TypeError 'value must be Number')."""
    g = torch.Generator().manual_seed(7)
    xs, t1, t2 = ([torch.randn(4, generator=g, dtype=torch.float64),
                   torch.randn(6, generator=g, dtype=torch.float64)] for _ in range(3))
    sc = torch.tensor([0.5, -2.0], dtype=torch.float64)
    f = getattr(torch, f"_foreach_{op}")
    ws = [x.clone() for x in xs]
    want = f(ws, t1, t2, sc)
    ds = [_d(x, ["S(0)", "R"]) for x in xs]
    got = f(ds, [_d(t, ["R", "S(0)"]) for t in t1], [_d(t, ["R", "R"]) for t in t2], sc)
    for d, w, o, r in zip(ds, ws, got, want):
        torch.testing.assert_close(d.full(), w)
        torch.testing.assert_close(o.full(), r)
        if op.endswith("_"):        # torch 2.13 returns the list it wrote (here: None)
            assert o is d and r is w


def test_foreach_norm_of_a_partial_is_its_sums_norm_and_differentiable():
    """torch._foreach_norm is vector_norm per tensor: a Partial DistTensor was refused
    ('a Partial gradient has no norm', seeds 2004270 / 2004489 wide), a replicated or
    sharded one's norm was detached (no gradient), a complex one's norm complex."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    z = torch.randn(5, generator=g, dtype=torch.complex128)
    for ps in (["P(sum)", "R"], ["S(0)", "P(min)"], ["S(0)", "S(1)"], ["R", "R"]):
        xr = x.clone().requires_grad_(True)
        d = _d(x, ps).requires_grad_(True)
        for p in (2, 1, float("inf")):
            want = torch._foreach_norm([xr, z], p)
            got = torch._foreach_norm([d, _d(z, ["S(0)", "R"])], p)
            for w, o in zip(want, got):
                assert o.dtype == w.dtype
                torch.testing.assert_close(o.full(), w)
        want[0].backward()
        got[0].backward()
        if ps[0] != "S(0)" or ps[1] != "P(min)":     # a P(min) leaf's parts: not x's grad
            torch.testing.assert_close(d.grad.full(), xr.grad)


def test_foreach_outputs_require_grad_when_any_input_does():
    """torch records one node for a foreach call: output 0 requires grad when only input
    1 does, its gradient to input 1 None.  Here it did not, and a backward of it raised
    'does not require grad' (seed 2004489 wide)."""
    a = torch.randn(3, 2, dtype=torch.float64)
    b = torch.randn(3, 2, dtype=torch.float64)
    da = _d(a, ["S(0)", "R"])
    db = _d(b, ["R", "P(sum)"]).requires_grad_(True)
    br = b.clone().requires_grad_(True)
    for call in (lambda u, v: torch._foreach_norm([u, v])[0],
                 lambda u, v: torch._foreach_mul([u, v], 2.0)[0]):
        want, got = call(a, br), call(da, db)
        assert got.requires_grad == want.requires_grad is True
        assert torch.autograd.grad(want.sum(), [br], allow_unused=True) == (None,)
        assert torch.autograd.grad(got.sum(), [db], allow_unused=True) == (None,)
    with torch.no_grad():
        assert not torch._foreach_norm([da, db])[0].requires_grad


@pytest.mark.parametrize("mask", [None, "bool3", "float2"])
@pytest.mark.parametrize("ps", [["R", "R"], ["S(0)", "R"], ["S(1)", "S(2)"], ["P(sum)", "R"]])
def test_sdpa_of_3d_query_key_value(mask, ps):
    """torch's scaled_dot_product_attention takes (batch, seq, head_dim) q, k, v (one
    head); here it was refused as not 4-d (seeds 2004113 / 2004164 wide)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 2, generator=g, dtype=torch.float64)
    k = torch.randn(2, 4, 2, generator=g, dtype=torch.float64)
    v = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    m = {None: None, "bool3": torch.rand(2, 3, 4, generator=g) > 0.3,
         "float2": torch.randn(3, 4, generator=g, dtype=torch.float64)}[mask]
    rs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*rs, attn_mask=m)
    ds = [_d(q, ps).requires_grad_(True)] + \
        [_d(t, ["R", "S(0)"]).requires_grad_(True) for t in (k, v)]
    got = F.scaled_dot_product_attention(*ds, attn_mask=None if m is None else _d(m, ["R", "R"]))
    assert got.shape == want.shape
    torch.testing.assert_close(got.full(), want)
    (want * want).sum().backward()
    (got * got).sum().backward()
    for d, r in zip(ds, rs):
        torch.testing.assert_close(d.grad.full(), r.grad)


def test_sdpa_of_3d_inputs_raises_torchs_error_for_mixed_dtypes():
    q = torch.randn(2, 3, 2)
    k = torch.randn(2, 4, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(_d(q, ["S(0)", "R"]), _d(k, ["R", "R"]),
                                       _d(k, ["R", "R"]))


_ZERO_D = {"sort": lambda t: t.sort(0)[1], "sort_stable": lambda t: torch.sort(t, stable=True)[0],
           "argsort": lambda t: t.argsort(), "msort": torch.msort, "max": lambda t: t.max(),
           "amax": lambda t: t.amax(), "amin0": lambda t: t.amin(0),
           "aminmax": lambda t: torch.aminmax(t)[0], "cummax": lambda t: t.cummax(0)[1],
           "cummin": lambda t: t.cummin(0)[0],
           "index_select": lambda t: t.index_select(0, torch.tensor([0])),
           "index_select2": lambda t: t.index_select(0, torch.tensor([0, 0])),
           "trace": lambda t: t.reshape(1, 1).trace()}


@pytest.mark.parametrize("name", sorted(_ZERO_D))
@pytest.mark.parametrize("dt", [torch.complex128, torch.bool, torch.int64, torch.float64])
def test_0d_inputs_take_torchs_kernel_checks(name, dt):
    """A 0-d input skipped torch's kernel in the local implementations: sort / argsort /
    msort / amax / max / aminmax of a complex gave a result where torch raises (seed
    2004315 wide, after its foreach), cummax / cummin of a complex raised where torch
    returns it, index_select of a 0-d raised IndexError, trace of a bool matrix summed."""
    x = (torch.tensor(1.5 - 0.5j) if dt.is_complex else torch.tensor(-1.5)).to(dt)
    f = _ZERO_D[name]
    want_kind, want = _kind(lambda: f(x))
    got_kind, got = _kind(lambda: f(_d(x, ["R", "R"])))
    assert got_kind == want_kind
    if want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.full(), want)


@pytest.mark.parametrize("ps", [["P(sum)", "R"], ["R", "P(sum)"], ["P(sum)", "P(sum)"]])
def test_avg_pool_of_an_integer_partial_reduces_first(ps):
    """An integer average truncates each part: avg_pool1d of an int64 P(sum) passed the
    Partial as linear and was off by 1 (seed 2006018 wide)."""
    x = torch.tensor([[1, -3, 1, 1, 1, 1, 0, 3, 3], [0, 0, 2, 0, -1, -1, 1, -2, -2],
                      [-3, -1, -3, 3, 2, 2, 3, -3, 2]])
    want = F.avg_pool1d(x, 2)
    got = F.avg_pool1d(_d(x, ps, seed=924), 2)
    assert got.dtype == want.dtype and torch.equal(got.full(), want)


@pytest.mark.parametrize("x_dt,q_dt", [(torch.complex128, torch.complex128),
                                       (torch.float32, torch.complex64),
                                       (torch.float32, torch.float64),
                                       (torch.float64, torch.float64)])
@pytest.mark.parametrize("fn", [torch.quantile, torch.nanquantile])
def test_quantile_with_a_tensor_q_checks_dtypes_as_torch(fn, x_dt, q_dt):
    """torch raises RuntimeError for a complex input or a q of another dtype; a complex q
    was read with float() here: a raw TypeError (seed 2005974 wide)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x = x.to(x_dt)
    q = torch.tensor([0.1, 0.7]).to(q_dt)
    want_kind, want = _kind(lambda: fn(x, q, -1))
    got_kind, got = _kind(lambda: fn(_d(x, ["S(0)", "R"]), q, -1))
    assert got_kind == want_kind
    if want is not None:
        torch.testing.assert_close(got.full(), want)
