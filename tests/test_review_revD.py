"""Review of the library changes merged since 4568877 (reviewer revD): custom
``torch.autograd.Function`` on DistTensors, ``torch.autocast``, DDP's replica writes, FSDP's
reduce_dtype, the compile search.

Each test named for a defect failed before its fix (named in its docstring); each result
is held to plain torch's."""
import pytest
import torch

import workbench as wb
from workbench import Replicate, Shard

BF = torch.bfloat16


def _x(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---- custom Function: a forward with a non-tensor output ---------------------------------

class _ScaleAndCount(torch.autograd.Function):
    """Returns (2 x, the number of elements): torch passes None to backward for the int."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x.numel()

    @staticmethod
    def backward(ctx, g, g_count):
        assert g_count is None, g_count
        return g * 2


@pytest.mark.parametrize("kind", ["S0", "R"])
def test_custom_function_backward_gets_none_for_a_non_tensor_output(kind):
    """custom_function._Bridge.backward passed the user's backward one gradient per
    DistTensor / tensor output only: a forward returning (tensor, int) got backward(ctx, g)
    and raised TypeError 'missing 1 required positional argument' where torch passes
    (g, None) (torch.autograd.Function.backward's docs)."""
    mesh = wb.Mesh.grid((2,))
    x = _x((5, 3))
    xr = x.clone().requires_grad_()
    yr, nr = _ScaleAndCount.apply(xr)
    (yr * yr).sum().backward()
    d = wb.shard_tensor(x, mesh, [Shard(0) if kind == "S0" else Replicate()]).requires_grad_()
    y, n = _ScaleAndCount.apply(d)
    assert n == nr == 15
    (y * y).sum().backward()
    torch.testing.assert_close(d.grad.full(), xr.grad)


# ---- autocast: in-place and out= ops are not autocast ------------------------------------

_M1, _M2, _A = _x((3, 4), 1), _x((4, 3), 2), _x((3, 3), 3)
_WRITES = {
    "addmm_": lambda f: f(_A.clone()).addmm_(f(_M1), f(_M2)),
    "baddbmm_": lambda f: f(_A.expand(2, 3, 3).contiguous()).baddbmm_(
        f(_M1.expand(2, 3, 4).contiguous()), f(_M2.expand(2, 4, 3).contiguous())),
    "addbmm_": lambda f: f(_A.clone()).addbmm_(f(_M1.expand(2, 3, 4).contiguous()),
                                               f(_M2.expand(2, 4, 3).contiguous())),
    "mm(out=)": lambda f: (lambda o: (torch.mm(f(_M1), f(_M2), out=o), o)[1])(
        f(torch.zeros(3, 3))),
    "matmul(out=)": lambda f: (lambda o: (torch.matmul(f(_M1), f(_M2), out=o), o)[1])(
        f(torch.zeros(3, 3))),
}


@pytest.mark.parametrize("name", list(_WRITES))
def test_in_place_and_out_matmuls_are_not_autocast(name):
    """dispatch._writes computed an in-place method (x.addmm_) or an out= call by its
    out-of-place op, which the autocast hook cast to bfloat16: the float32 result held
    bfloat16-rounded values (0.2500 where torch gives 0.2507).  torch.autocast casts
    out-of-place ops only ('In-place variants and calls that explicitly supply an out=...
    Tensor ... won't go through autocasting', torch.amp docs)."""
    mesh = wb.Mesh.grid((2,))
    fn = _WRITES[name]
    with torch.autocast("cpu", dtype=BF):
        ref = fn(lambda t: t)
        got = fn(lambda t: wb.shard_tensor(t, mesh, [Replicate()]))
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got.full(), ref)


# ---- autocast: cat / stack's promote policy ------------------------------------------------

@pytest.mark.parametrize("dtypes", [(torch.float16,), (torch.float16, torch.float32),
                                    (torch.float16, torch.float64)])
def test_promote_of_a_float16_under_bfloat16_autocast_raises_as_torch(dtypes):
    """autocast.cast_args promoted cat / stack's inputs to their widest dtype, so a
    float16 input under bfloat16 autocast gave a result (float32, or float16) where torch
    raises 'Unexpected floating ScalarType in at::autocast::prioritize' (its promote
    starts at the autocast dtype, ignores float64, prefers float32, and refuses another
    lower-precision dtype)."""
    mesh = wb.Mesh.grid((2,))
    ts = [torch.ones(2, 3, dtype=d) for d in dtypes]
    with torch.autocast("cpu", dtype=BF):
        with pytest.raises(RuntimeError, match="prioritize"):
            torch.cat(ts)
        with pytest.raises(RuntimeError, match=r"cat\(\).*float16.*autocast"):
            torch.cat([wb.shard_tensor(t, mesh, [Replicate()]) for t in ts])
    assert all(t.dtype == d for t, d in zip(ts, dtypes))          # inputs untouched


@pytest.mark.parametrize("dtypes", [(BF, torch.float64), (torch.float32, torch.float64),
                                    (BF, torch.float32), (BF, BF)])
def test_promote_keeps_torchs_dtypes_and_values(dtypes):
    mesh = wb.Mesh.grid((2,))
    ts = [_x((2, 3), k).to(d) for k, d in enumerate(dtypes)]
    for op in (torch.cat, torch.stack):
        with torch.autocast("cpu", dtype=BF):
            ref = op(ts)
            got = op([wb.shard_tensor(t, mesh, [Replicate()]) for t in ts])
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.full(), ref)
