"""Random sweep 15: the random programs draw the registered ops no kind drew
(``benchmarks/op_coverage.py``: 15 of 223 -> 0; tests/random_programs_wide.py ``NEW15``),
and what the new draws found.  Each test holds a DistTensor call to torch on the full
tensor; the docstrings say what was wrong before."""
import random

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import parse_placements
from workbench.parallel.validate_inputs import distribute

M1 = wb.Mesh.grid(2, ["a"])
M2 = wb.Mesh([[0, 1], [2, 3]])


def _d(x, ps, mesh=M2, seed=3):
    return distribute(x, mesh, parse_placements(ps), seed=seed)


# ---- the generator reaches every registered op -------------------------------------------

NEVER_DRAWN_BEFORE = {"convolution", "gcd", "lcm", "igamma", "igammac", "ldexp", "logaddexp",
                      "logaddexp2", "mode", "multinomial", "nextafter", "renorm", "unfold",
                      "xlog1py", "zeta"}


def test_new_kinds_reach_the_ops_never_drawn():
    """Each NEW15 kind, drawn on leaves of random shapes and dtypes, calls its ops: the 15
    registered ops benchmarks/op_coverage.py listed as never drawn (30,000 draws) and the
    compositions pairwise_distance / vdot / norm / linalg.norm / index_put."""
    from torch.overrides import TorchFunctionMode

    from tests import random_programs as rp
    from tests import random_programs_wide as rw
    from workbench.parallel.habits import COMPOSED
    from workbench.parallel.ops_table import BY_FUNC, load
    load()
    hit = set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in BY_FUNC:
                hit.add(BY_FUNC[func][0].name)
            elif func in COMPOSED:
                hit.add(func.__name__)
            return func(*args, **(kwargs or {}))

    mesh = wb.Mesh([0])
    for k in rw.NEW15:
        for i in range(40):
            rng = random.Random(i)
            p = rp._Prog(rng, ())
            p.wide, p.mesh = True, mesh
            shape = (3, 2, 3, 3)[:rng.randint(1, 4)] if k != "vdot" else (3,)
            cur = p.leaf(shape, dtype=torch.int64 if k == "gcd_lcm" and i % 2 else
                         torch.float64)
            drawn = rw.build(p, cur, k)
            if drawn is None:
                continue
            with Record():
                try:
                    drawn[1](cur[2])
                except RuntimeError:
                    pass
    missing = NEVER_DRAWN_BEFORE - hit
    assert not missing, missing
    assert {"pairwise_distance", "vdot", "norm", "linalg_norm", "index_put"} <= hit


# ---- renorm of a tensor of no element -----------------------------------------------------

@pytest.mark.parametrize("shape,dim,ps", [((1, 4, 0), -2, ["S(1)", "R"]),
                                          ((0, 3), 0, ["S(0)", "S(1)"]),
                                          ((2, 0, 3), 2, ["R", "S(2)"]),
                                          ((3, 0), 1, ["S(1)", "S(0)"])])
def test_renorm_of_no_element(shape, dim, ps):
    """Seed 5000048 (sweep15 focus): renorm of a (1, 4, 0) tensor with the slices' dim
    sharded raised reshape's RuntimeError (-1 is ambiguous for 0 elements); now torch's
    empty result, dtype and empty gradient."""
    x = torch.randn(shape, dtype=torch.float64)
    r = x.clone().requires_grad_(True)
    want = torch.renorm(r, 1.5, dim, 0.75)
    d = _d(x, ps).requires_grad_(True)
    got = torch.renorm(d, 1.5, dim, 0.75)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.full().detach(), want.detach())
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(d.grad.full(), r.grad)


def test_renorm_sharded_slices_still_normed_alone():
    """The fix spells the merged length out; a tensor with elements still normed per slice
    (values and gradient as torch's)."""
    x = torch.randn(4, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = x.clone().requires_grad_(True)
    d = _d(x, ["S(1)", "S(0)"]).requires_grad_(True)
    want, got = torch.renorm(r, 2, 1, 0.5), torch.renorm(d, 2, 1, 0.5)
    torch.testing.assert_close(got.full().detach(), want.detach())
    (want * torch.arange(24.).reshape(4, 3, 2)).sum().backward()
    (got * torch.arange(24.).reshape(4, 3, 2)).sum().backward()
    torch.testing.assert_close(d.grad.full(), r.grad)


# ---- _foreach unary ops over a list holding an integer and a tensor with grad -------------

@pytest.mark.parametrize("op", ["sign", "abs", "neg", "exp", "sqrt", "reciprocal"])
@pytest.mark.parametrize("order", ["float_first", "int_first"])
@pytest.mark.parametrize("grad", [True, False])
def test_foreach_unary_with_an_integer_and_a_grad_tensor(op, order, grad):
    """Seeds 5000097 / 5000260: torch._foreach_sign([t9, t8]) with t9 requiring grad and
    t8 int64 returned a result where torch raises RuntimeError 'Autograd not support dtype:
    Long' (its stand-in check ran without grad); each op raises as torch's or gives its
    values and dtypes, the DistTensors untouched."""
    f = getattr(torch, f"_foreach_{op}")
    a = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64)
    i = torch.tensor([1, -2, 3])
    ra, ri = a.clone().requires_grad_(grad), i.clone()
    da = _d(a, ["S(0)", "R"], M2).requires_grad_(grad)
    di = _d(i, ["R", "S(0)"], M2)
    refs, ds = ([ra, ri], [da, di]) if order == "float_first" else ([ri, ra], [di, da])
    try:
        want = f(refs)
    except Exception as e:  # noqa: BLE001 - torch's error: ours is of its type
        with pytest.raises(type(e), match="Autograd not support dtype"):
            f(ds)
        torch.testing.assert_close(da.full().detach(), a)
        torch.testing.assert_close(di.full(), i)
        return
    got = f(ds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.full().detach(), w.detach(), equal_nan=True)


def test_foreach_binary_with_an_integer_and_a_grad_tensor_runs_as_torch():
    """torch's check is the unary ops': _foreach_add([a, i], [i, a]) with a requiring grad
    runs (values and gradient as torch's)."""
    a = torch.tensor([1.5, -2.0], dtype=torch.float64)
    i = torch.tensor([1, 3])
    ra = a.clone().requires_grad_(True)
    da = _d(a, ["S(0)", "R"], M2).requires_grad_(True)
    di = _d(i, ["R", "R"], M2)
    want = torch._foreach_add([ra, i], [i, ra])
    got = torch._foreach_add([da, di], [di, da])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.full().detach(), w.detach())
    (want[0] * 2 + want[1]).sum().backward()
    (got[0] * 2 + got[1]).sum().backward()
    torch.testing.assert_close(da.grad.full(), ra.grad)


# ---- torch's own quirks the sweep met (documented, not 'fixed') ---------------------------

def test_torch_foreach_addcdiv_backward_of_a_0d_input_is_torchs_index_error():
    """Seed 5000090: on one device (torch 2.13), the backward of _foreach_addcdiv([s],
    [b], [c]) with a 0-d s raises IndexError (select() of a 0-dim tensor); the harness takes
    an error of the one-device backward as 'no derivative' (it took only RuntimeError: the
    program was 'raised outside workbench')."""
    b = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    y = torch._foreach_addcdiv([torch.tensor(0.0)], [b], [b.abs() + 1], 0.5)[0]
    with pytest.raises(IndexError):
        y.backward()


# ---- torch.convolution's CPU dtype checks ------------------------------------------------

@pytest.mark.parametrize("xd,wd", [(torch.complex128, torch.complex128),
                                   (torch.complex128, torch.float64),
                                   (torch.complex64, torch.complex64),
                                   (torch.float32, torch.float64),
                                   (torch.int64, torch.float64), (torch.int64, torch.int64),
                                   (torch.bool, torch.bool)])
@pytest.mark.parametrize("dil", [1, 2])
def test_convolution_dtypes_as_torch(xd, wd, dil):
    """Seed 5000513: torch.convolution of a complex input raised F.conv1d's RuntimeError
    (torch's CPU kernel: NotImplementedError), and of two complex tensors returned a result
    (F.conv1d has a complex path, aten's convolution none); now torch's error type, or its
    values and dtype."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 4, 6, generator=g) * 3).to(xd)
    w = (torch.randn(4, 2, 2, generator=g) * 3).to(wd)
    args = ([1], [1], [dil], False, [0], 2)
    try:
        want = torch.convolution(x, w, None, *args)
    except Exception as e:  # noqa: BLE001 - torch's error: ours is of its type
        with pytest.raises(type(e)):
            torch.convolution(_d(x, ["S(0)", "R"]), _d(w, ["R", "S(0)"]), None, *args)
        return
    got = torch.convolution(_d(x, ["S(0)", "R"]), _d(w, ["R", "S(0)"]), None, *args)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.full(), want)


# ---- dot / vdot of integers keep their dtype ---------------------------------------------

@pytest.mark.parametrize("fn", [torch.dot, torch.vdot])
@pytest.mark.parametrize("dt", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                torch.bool, torch.float16, torch.complex128])
def test_dot_vdot_dtype_as_torch(fn, dt):
    """Seed 5000308: vdot of two uint8 vectors came back int64 (sum() promotes an integer),
    torch's is uint8 (wrapping modulo 2^8); a bool raises NotImplementedError as torch."""
    a = torch.tensor([200, 100, 7, 3, 1], dtype=torch.int64).to(dt)
    b = torch.tensor([3, 1, 2, 5, 4], dtype=torch.int64).to(dt)
    da, db = _d(a, ["R", "S(0)"], M2), _d(b, ["S(0)", "R"], M2)
    try:
        want = fn(a, b)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            fn(da, db)
        return
    got = fn(da, db)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.full(), want)


# ---- a constant written over a tensor with history, uneven shards ------------------------

@pytest.mark.parametrize("op", ["zero_", "fill_", "copy_"])
@pytest.mark.parametrize("shape,ps", [((3,), ["S(0)", "S(0)"]), ((2, 3), ["R", "S(1)"]),
                                      ((5,), ["S(0)", "R"])])
def test_constant_written_over_history_uneven_backward(op, shape, ps):
    """Wide seed 2015290: t.clone().zero_() of 3 elements over 4 ranks, then backward,
    raised 'element 1 of tensors does not require grad' (only the first rank's tensor was
    tied to the old value's history); now torch's zero gradient."""
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    args = {"zero_": (), "fill_": (0.5,), "copy_": (torch.ones(shape, dtype=torch.float64),)}
    r = x.clone().requires_grad_(True)
    d = _d(x, ps).requires_grad_(True)
    want = getattr((r * 2).clone(), op)(*args[op])
    got = getattr((d * 2).clone(), op)(*args[op])
    assert got.requires_grad == want.requires_grad
    torch.testing.assert_close(got.full().detach(), want.detach())
    g = torch.arange(float(x.numel()), dtype=torch.float64).reshape(shape)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(d.grad.full(), r.grad)


def test_vdot_complex_values():
    """vdot of complex DistTensors raised NoRuleError (conj() has no rule); now
    dot(conj(a), b) from view_as_real / complex: torch's value and dtype (its gradient:
    tests/test_sweep17.py, since complex DistTensors require grad)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(5, dtype=torch.complex128, generator=g)
    b = torch.randn(5, dtype=torch.complex128, generator=g)
    want, got = torch.vdot(a, b), torch.vdot(_d(a, ["S(0)", "R"]), _d(b, ["R", "S(0)"]))
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.full(), want)
    torch.testing.assert_close(torch.vdot(_d(b, ["R", "R"]), _d(a, ["S(0)", "S(0)"])).full(),
                               torch.vdot(b, a))


def test_foreach_over_a_grad_float_and_a_complex():
    """Seed 5000724: torch._foreach_exp([t2, t1]) with t2 requiring grad and t1 complex
    raised TypeError (the complex output was marked to require grad, which a complex
    DistTensor could not then); now torch's values and dtypes, and t2's gradient."""
    a = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    c = torch.tensor([1 + 1j, -0.5j, 2.0], dtype=torch.complex128)
    ra = a.clone().requires_grad_(True)
    da = _d(a, ["S(0)", "R"]).requires_grad_(True)
    dc = _d(c, ["R", "S(0)"])
    want, got = torch._foreach_exp([ra, c]), torch._foreach_exp([da, dc])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.full().detach(), w.detach())
    want[0].sum().backward()
    got[0].sum().backward()
    torch.testing.assert_close(da.grad.full(), ra.grad)


@pytest.mark.parametrize("xd,wd", [(torch.complex128, torch.complex128), (torch.bool, torch.bool),
                                   (torch.float64, torch.float64), (torch.int64, torch.float64)])
@pytest.mark.parametrize("shape", [(0, 2, 4, 4), (0, 1, 3, 3)])
def test_convolution_of_no_element_as_torch(xd, wd, shape):
    """Seed 5000970: torch runs no kernel for an input of no element (no dtype check: a
    complex or bool one gives an empty result); the stand-in check raised torch's dtype
    error there.  Same dtypes: torch's empty result; int64 by float64 (torch's CPU call
    float64, its meta kernel int64): a clear NotImplementedError naming the cast."""
    x = torch.zeros(shape, dtype=xd)
    w = torch.ones((2, shape[1], 1, 1), dtype=wd)
    args = ([1, 2], [0, 1], [1, 2], False, [0, 0], 1)
    want = torch.convolution(x, w, None, *args)
    dx, dw = _d(x, ["S(0)", "R"]), _d(w, ["R", "R"])
    if xd != wd:
        with pytest.raises(NotImplementedError, match="cast"):
            torch.convolution(dx, dw, None, *args)
        return
    got = torch.convolution(dx, dw, None, *args)
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("conv", ["conv2d", "convolution"])
def test_convolution_of_no_input_channel_refused(conv):
    """torch gives (N, 0, H', W') for a weight of no input channel (its quirk: not the
    C_out channels of zeros); ours raised AssertionError 'op table bug' (the local gave
    (N, C_out, ..)): now a clear NotImplementedError, the inputs untouched."""
    x, w = torch.zeros(2, 0, 4, 4), torch.ones(2, 0, 1, 1)
    assert torch.nn.functional.conv2d(x, w).shape == (2, 0, 4, 4)
    dx, dw = _d(x, ["S(0)", "R"]), _d(w, ["R", "R"])
    with pytest.raises(NotImplementedError, match="no input channel"):
        if conv == "conv2d":
            torch.nn.functional.conv2d(dx, dw)
        else:
            torch.convolution(dx, dw, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("dt", [torch.complex32, torch.float16, torch.bool, torch.int64])
@pytest.mark.parametrize("shape", [(0, 2), (3,)])
def test_equal_dtypes_as_torch(dt, shape):
    """Wide seed 2015490: torch.equal of a complex32 DistTensor returned True where torch
    raises NotImplementedError ('"equal_cpu" not implemented for ComplexHalf'); now its
    CPU kernel's dtype check runs on cut stand-ins after the size check."""
    x = torch.ones(shape, dtype=torch.float32).to(dt)
    d = _d(x, ["S(0)", "R"] if shape[0] else ["R", "R"])
    try:
        want = torch.equal(x, x.clone())
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            torch.equal(d, d.clone())
        return
    assert torch.equal(d, d.clone()) is want
    assert torch.equal(d, _d(torch.zeros(7, dtype=dt), ["R", "R"])) is \
        torch.equal(x, torch.zeros(7, dtype=dt))


def test_torch_bool_tensor_written_with_a_tracked_float_requires_grad():
    """Wide seed 2015652 (torch's own): ``v[3:4] = f`` with v bool and f a float that
    requires grad makes v require grad in torch 2.13 (CopySlices; an int64 v does not),
    and then aminmax / amax / clone of v raise 'Autograd not support dtype: Bool'.  Here the
    write is (a bool DistTensor holds no gradient: inplace.setitem, as for
    integers: inplace15), refused up front with the fix named, the bool tensor untouched
    (a state torch reaches only to raise at the next op; the fix, ``value.detach()``,
    gives torch's values of the same write under no_grad)."""
    v = torch.zeros(5, 2, dtype=torch.bool)
    f = torch.tensor(-1.4, dtype=torch.float64, requires_grad=True)
    v[3:4] = f
    assert v.requires_grad
    with pytest.raises(RuntimeError, match="Autograd not support dtype: Bool"):
        torch.aminmax(v, dim=0)
    d = _d(torch.zeros(5, 2, dtype=torch.bool), ["S(0)", "R"])
    fd = _d(torch.tensor(-1.4, dtype=torch.float64), ["R", "R"]).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"requires grad.*value\.detach\(\)"):
        d[3:4] = fd
    assert not d.full().any()                    # nothing written
    d[3:4] = fd.detach()
    got = torch.aminmax(d, dim=0)
    want = torch.aminmax(v.detach(), dim=0)
    torch.testing.assert_close(got[0].full(), want[0])
    torch.testing.assert_close(got[1].full(), want[1])


_PIECES = {"split": lambda t: t.split(2, 0)[0], "chunk": lambda t: t.chunk(2, 0)[1],
           "unbind": lambda t: t.unbind(0)[0]}
_WRITES = {"add_": lambda v: v.add_(1), "select.lerp_": lambda v: v.select(0, -1).lerp_(
    torch.zeros((), dtype=torch.float64), 0.5) if v.dim() else v.lerp_(
    torch.zeros((), dtype=torch.float64), 0.5), "setitem": lambda v: v.__setitem__(0, 1.0)}


@pytest.mark.parametrize("piece", sorted(_PIECES))
@pytest.mark.parametrize("write", sorted(_WRITES))
@pytest.mark.parametrize("grad", [True, False])
def test_write_into_a_piece_of_split_as_torch(piece, write, grad):
    """Old seed 1071550: ``t3.split(1, 0)[0].select(0, -1).lerp_(t5)`` returned a result
    where torch raises RuntimeError (an output of a function returning several views may
    not be written in place, nor its views, with grad on); without grad torch writes, and
    so do we (values as torch's)."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    r = x.clone().requires_grad_(grad)
    d = _d(x, ["R", "S(1)"]).requires_grad_(grad)
    rv, dv = _PIECES[piece](r * 1), _PIECES[piece](d * 1)
    try:
        _WRITES[write](rv)
    except RuntimeError as e:
        assert "returns multiple views" in str(e)
        with pytest.raises(RuntimeError, match="returns multiple views"):
            _WRITES[write](dv)
        return
    _WRITES[write](dv)
    torch.testing.assert_close(dv.full().detach(), rv.detach())


def test_cumprod_backward_through_a_view_made_in_backward():
    """Old seed 1071256: the backward of this chain raised 'Attempted to access the data
    pointer on an invalid python storage' (views.note_views read the storage of a view made
    inside cumprod's gradient); now torch's gradient."""
    mesh = wb.Mesh([[0, 2, 4], [5, 1, 3]])
    x = torch.tensor([[[0.11193907501674136, -0.6223854724700036, -0.7816418346095078,
                        0.686164692929235, -0.8399115831515142]],
                      [[0.1797736807567211, 1.6779759666544989, -0.24247607132805413,
                        0.37022008852833, -0.5827918832200895]]], dtype=torch.float64)
    d = distribute(x, mesh, parse_placements(["P(avg)", "S(0)"]), seed=361).requires_grad_(True)
    r = d.full().detach().clone().requires_grad_(True)

    def chain(t):
        return torch.tanh(F.elu(torch.sgn(t.amax((0, -2))).sum(-1, dtype=torch.float32))
                          .cumprod(-1))
    want, got = chain(r), chain(d)
    torch.testing.assert_close(got.full().detach(), want.detach())
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(d.grad.full(), r.grad)


@pytest.mark.parametrize("v", [float("nan"), 1.0, float("inf"), float("-inf")])
@pytest.mark.parametrize("j", [0, 1])
@pytest.mark.parametrize("dt", [torch.float64, torch.int64, torch.bool])
def test_aminmax_of_0d_as_torch(v, j, dt):
    """Wide seed 2016292: aminmax of a 0-d NaN passed the gradient through (a clone), torch's
    gradient is NaN (grad * (x == min) / count); values, dtypes and gradients as torch's."""
    if not dt.is_floating_point and v != 1.0:
        return
    x = torch.tensor(v).to(dt)
    grad = dt.is_floating_point
    r = x.clone().requires_grad_(grad)
    d = _d(x, ["R", "R"]).requires_grad_(grad)
    want, got = torch.aminmax(r * 2 if grad else r)[j], torch.aminmax(d * 2 if grad else d)[j]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.full().detach(), want.detach(), equal_nan=True)
    if grad:
        want.backward(torch.tensor(1.5, dtype=dt))
        got.backward(torch.tensor(1.5, dtype=dt))
        torch.testing.assert_close(d.grad.full(), r.grad, equal_nan=True)
