"""Silent wrong answers found by trying the core as a new user would (issue 10), each
reproduced: now equal to one device, or PyTorch's own error."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.spmd_harness import distribute

M2 = wb.Mesh.grid(2, ["a"])
R, S, P = wb.Replicate(), wb.Shard, wb.Partial()


def partial(x, mesh=M2):
    return distribute(x, mesh, [P], seed=1)        # unequal parts that sum to x


# ---- a constant meets a Partial(sum) ------------------------------------------------------

@pytest.mark.parametrize("fn", [lambda x: x + 1, lambda x: 1 - x, lambda x: x - 2.5,
                                lambda x: x + torch.tensor(3.0), lambda x: torch.add(x, 1, alpha=2),
                                lambda x: 2.0 + x, lambda x: torch.sub(x, 0.5),
                                lambda x: torch.where(x > 0, x, 0.0)],
                         ids=["x+1", "1-x", "x-c", "x+0d", "add_alpha", "c+x", "sub", "where"])
def test_constant_added_once_to_a_partial_sum(fn):
    z = torch.zeros(2)
    assert torch.equal(fn(partial(z)).full(), fn(z))              # was [2., 2.] on 2 ranks
    x = torch.randn(3, 4)
    torch.testing.assert_close(fn(partial(x)).full(), fn(x))


def test_scaling_a_partial_sum_stays_partial_and_exact():
    x = torch.randn(3, 4)
    y = partial(x) * 3.0
    assert y.placements == (P,)
    torch.testing.assert_close(y.full(), x * 3.0)


def test_cast_of_a_partial_sum_to_int_reduces_first():
    x = torch.tensor([0.5, 1.5, -0.5])
    got = partial(x).to(torch.int64)
    assert got.full().tolist() == x.to(torch.int64).tolist()
    assert partial(x).to(torch.float64).placements == (P,)         # widening: exact per part


# ---- dims out of range: PyTorch's IndexError, never a wrap --------------------------------

def torch_error(fn, *args):
    with pytest.raises(Exception) as e:
        fn(*args)
    return type(e.value), str(e.value)


@pytest.mark.parametrize("fn", [
    lambda t: torch.softmax(t, 5), lambda t: t.sum(7), lambda t: t.transpose(0, 4),
    lambda t: torch.cat([t, t], 5), lambda t: torch.stack([t, t], 4), lambda t: t.mean(-3),
    lambda t: torch.cumsum(t, 2), lambda t: t.amax((0, 3)), lambda t: torch.argmax(t, 2),
    lambda t: t.split(1, 2), lambda t: t.unbind(-3), lambda t: torch.topk(t, 1, dim=2),
    lambda t: torch.gather(t, 2, torch.zeros(2, 2, dtype=torch.long)),
    lambda t: F.log_softmax(t, -3)])
def test_out_of_range_dim_raises_like_torch(fn):
    x = torch.randn(4, 6)
    kind, msg = torch_error(fn, x)
    assert kind is IndexError
    with pytest.raises(IndexError, match=re.escape(msg)):
        fn(wb.shard_tensor(x, M2, [S(0)]))


def test_swiglu_dim_out_of_range():
    x = wb.shard_tensor(torch.randn(4, 6), M2, [S(0)])
    with pytest.raises(IndexError, match=re.escape("[-2, 1], but got 5")):
        wb.ops.swiglu(x, dim=5)


# ---- reductions: dtype= and integer promotion ------------------------------------------------

def test_sum_dtype_argument_and_integer_promotion():
    x = torch.randn(4, 6)
    d = wb.shard_tensor(x, M2, [S(0)])
    y = d.sum(0, dtype=torch.float64)
    assert y.dtype == torch.float64 and y.full().dtype == torch.float64
    torch.testing.assert_close(y.full(), x.sum(0, dtype=torch.float64))
    i = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    b = i % 3 == 0
    for t in (i, b):
        for ps in ([S(0)], [S(1)], [R]):
            got = wb.shard_tensor(t, M2, ps).sum(0)
            assert got.dtype == torch.int64 and torch.equal(got.full(), t.sum(0))
    with pytest.raises(RuntimeError, match="mean"):                 # as torch: no int mean
        wb.shard_tensor(i, M2, [S(0)]).mean()


# ---- matmul shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", [((3, 1, 1), (1,)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)),
                                   ((5,), (5,)), ((2, 1, 3, 4), (5, 4, 2))])
def test_matmul_shapes_like_torch(sa, sb):
    a, b = torch.randn(sa), torch.randn(sb)
    for pa in ([R], [S(0)]):
        da = wb.shard_tensor(a, M2, pa)
        out = da @ wb.shard_tensor(b, M2, [R])
        assert out.shape == (a @ b).shape
        torch.testing.assert_close(out.full(), a @ b)


def test_matmul_with_a_0d_tensor_is_torchs_error_with_a_fix():
    z = wb.shard_tensor(torch.tensor(2.0), M2, [R])
    m = wb.shard_tensor(torch.randn(3, 4), M2, [S(0)])
    with pytest.raises(RuntimeError, match=r"at least 1D, but they are 0D and 2D.*torch.mul"):
        z @ m


# ---- vocabulary-parallel embedding ---------------------------------------------------------

@pytest.mark.parametrize("bad", [10, -1])
@pytest.mark.parametrize("wp", [[S(0)], [S(1)], [R]])
def test_embedding_id_out_of_range_raises(bad, wp):
    W = torch.randn(10, 4)
    with pytest.raises(IndexError, match="index out of range"):
        F.embedding(torch.tensor([1, bad]), W)
    ids = wb.shard_tensor(torch.tensor([1, bad]), M2, [R])
    with pytest.raises(IndexError, match=r"index out of range in self.*\[0, 10\)"):
        F.embedding(ids, wb.shard_tensor(W, M2, wp))


# ---- broadcasting: reduce the small one ----------------------------------------------------

def test_broadcast_partial_reduces_the_small_input():
    x = wb.TensorSpec((1, 32, 1), M2, [P])
    y = wb.TensorSpec((16, 32, 64), M2, [S(0)])
    dec = wb.spmd.infer("mul", x, y)
    assert dec.inputs == ((R,), (S(0),)) and dec.outputs == ((S(0),),)
    assert dec.chosen.collectives == ["all_reduce"] and dec.chosen.bytes == 128
    grown = [c for c in dec.candidates if c.strategy.inputs == ((P,), (R,))]
    assert grown and grown[0].deferred_bytes > 0                     # still offered, ranked fairly
    X, Yt = torch.randn(1, 32, 1), torch.randn(16, 32, 64)
    got = partial(X) * wb.shard_tensor(Yt, M2, [S(0)])
    torch.testing.assert_close(got.full(), X * Yt)


# ---- bad input: the argument, the value and the fix -----------------------------------------

def test_flash_attention_3d_names_the_fix():
    q = wb.shard_tensor(torch.randn(2, 5, 8), M2, [S(0)])
    with pytest.raises(ValueError, match=r"q.shape=\(2, 5, 8\).*4-d.*Fix: q.unsqueeze\(1\)"):
        wb.ops.flash_attention(q, q, q)


@pytest.mark.parametrize("call,match", [
    (lambda q: wb.ops.flash_attention(q, q, q, scale="a"), r"scale='a' must be a number or None"),
    (lambda q: wb.ops.flash_attention(q, q, q, dropout_p=[0.1]), r"dropout_p=\[0.1\] must be a"),
    # torch's own argument parser answers before dispatch reaches the DistTensor
    (lambda q: F.scaled_dot_product_attention(q, q, q, scale="a"), r"'scale' must be float")])
def test_non_numeric_scale(call, match):
    q = wb.shard_tensor(torch.randn(1, 2, 4, 8), M2, [S(1)])
    with pytest.raises(TypeError, match=match):
        call(q)


def test_non_numeric_eps():
    x = wb.shard_tensor(torch.randn(4, 6), M2, [S(0)])
    with pytest.raises(TypeError, match=r"eps='x' must be a number"):
        F.layer_norm(x, (6,), eps="x")
    with pytest.raises(TypeError, match=r"eps='x' must be a number"):
        wb.ops.rms_norm(x, wb.shard_tensor(torch.ones(6), M2, [R]), eps="x")


def test_parallelize_unknown_style_names_key_value_and_styles():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"plan\['0'\] = 'colwize'.*'colwise', 'rowwise'"):
        wb.parallelize(model, M2, {"0": "colwize"})
    assert isinstance(model[0].weight, nn.Parameter)                  # nothing changed


# ---- type promotion with 0-d tensors ---------------------------------------------------------

@pytest.mark.parametrize("fn", [torch.mul, torch.add, lambda a, b: b - a, torch.lt,
                                lambda a, b: torch.where(a > 0, a, b)],
                         ids=["mul", "add", "rsub", "lt", "where"])
def test_zero_dim_operand_promotes_like_torch(fn):
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    for s in (torch.tensor(1.3), torch.tensor(3, dtype=torch.int64)):
        ref = fn(x, s)
        got = fn(wb.shard_tensor(x, M2, [S(0)]), wb.shard_tensor(s, M2, [R]))
        assert got.dtype == ref.dtype and torch.equal(got.full(), ref)


def test_zero_dim_times_scalar_keeps_its_layout():
    loss = wb.shard_tensor(torch.tensor(2.5), M2, [R])
    assert (loss * 0.5).full().item() == 1.25
    p = partial(torch.tensor(2.5))
    assert (p * 0.5).placements == (P,) and (p * 0.5).full().item() == 1.25
