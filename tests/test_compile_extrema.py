"""``torch.max`` / ``torch.min`` inside ``wb.compile``: captured as eager composes them
(argmax / argmin + gather, or maximum / minimum) instead of breaking the graph; values,
indices and gradients as torch's, ties included."""
import pytest
import torch

import workbench as wb
from workbench.parallel import Replicate, Shard

MESH = wb.init_device_mesh("cpu", (4,))
X = torch.tensor([[3., 3., 1., 3., 0., 2., 1., 0.],
                  [0., -1., 5., 5., 2., 2., 7., 7.],
                  [1., 2., 3., 4., 5., 6., 7., 8.]])

CASES = {
    "max dim": lambda x: x.max(1).values * 2,
    "max dim indices": lambda x: x.max(1).indices,
    "min dim keepdim": lambda x: torch.min(x, dim=0, keepdim=True)[0].sum(1),
    "max neg dim": lambda x: x.max(-1)[0] + x.min(-2)[0].sum(),
    "max other": lambda x: torch.max(x, x.flip(1)).sum(0),
    "min other kw": lambda x: torch.min(x, other=x * 0.5),
    "bool max": lambda x: (x > 2).max(1).indices,
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("pl", [Shard(0), Shard(1), Replicate()], ids=str)
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_extrema_compiled_as_torch(name, pl, level):
    fn = CASES[name]
    xr = X.clone().requires_grad_()
    ref = fn(xr)
    x = wb.distribute_tensor(X.clone(), MESH, [pl]).requires_grad_()
    prog = wb.compile(fn, x, level=level)
    assert prog.breaks == []
    out = prog(x)
    got = out.full_tensor()
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    if ref.dtype.is_floating_point:
        ref.sum().backward()
        out.sum().backward()
        assert torch.equal(x.grad.full_tensor(), xr.grad)


def test_max_over_every_dim_is_captured():
    """(it broke the graph before; tests/test_compile10.py holds its gradient to torch's)"""
    x = wb.distribute_tensor(X.clone(), MESH, [Shard(1)])
    prog = wb.compile(lambda t: t.max(), x)
    assert prog.breaks == []
    assert torch.equal(prog(x).full_tensor(), X.max())


def test_bad_dim_is_torchs_index_error():
    """As for amax: capture notes the break, the call raises torch's IndexError."""
    x = wb.distribute_tensor(X.clone(), MESH, [Shard(0)])
    prog = wb.compile(lambda t: t.max(2).values, x)
    assert "IndexError" in prog.breaks[0].reason
    with pytest.raises(IndexError, match="Dimension out of range"):
        prog(x)


# ---- new tensors shaped like traced ones, and advanced indexing, inside wb.compile ----

Y = torch.arange(48.).reshape(8, 6).sin()
IDX = torch.tensor([0, 2, -1])
MORE = {
    "zeros_like": lambda x: torch.zeros_like(x) + x * 2,
    "ones_like dtype": lambda x: torch.ones_like(x, dtype=torch.float64) * x,
    "full_like int": lambda x: torch.full_like(x.long(), 2.5) + x.long(),  # x's dtype: 2
    "full_like -inf mask": lambda x: torch.where(x > 0, x, torch.full_like(x, -1e9)).softmax(-1),
    "new_zeros": lambda x: x.new_zeros(6) + x,
    "new_ones tuple": lambda x: x.new_ones((8, 1)) * x,
    "new_full": lambda x: x.new_full((8, 6), 3.0) - x,
    "const index": lambda x: x[IDX] * 2,
    "const index dim1": lambda x: x[:, IDX].sum(1),
    "const list index": lambda x: x[[1, 3]],
    "const mixed": lambda x: x[IDX, 1:],
    "const two indices": lambda x: x[IDX, torch.tensor([5, 0, -6])],
    "const bool 1-d": lambda x: x[:, torch.tensor([True, False, True, False, True, True])],
    "traced index": lambda x: x[x.argmax(0)],
    "traced negative": lambda x: x[:, x.argmax(1) - 6],
    "traced rows cols": lambda x: x[torch.arange(8), x.argmin(1)],
}


@pytest.mark.parametrize("name", sorted(MORE))
@pytest.mark.parametrize("pl", [Shard(0), Shard(1)], ids=str)
def test_like_and_indexing_compiled_as_torch(name, pl):
    fn = MORE[name]
    xr = Y.clone().requires_grad_()
    ref = fn(xr)
    x = wb.distribute_tensor(Y.clone(), MESH, [pl]).requires_grad_()
    prog = wb.compile(fn, x, level="O2")
    assert prog.breaks == []
    out = prog(x)
    got = out.full_tensor()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    if ref.requires_grad:
        ref.sum().backward()
        out.sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), xr.grad, rtol=0, atol=1e-6)


def test_computed_bool_mask_breaks_the_graph_and_runs_eagerly():
    x = wb.distribute_tensor(Y.clone(), MESH, [Shard(0)])
    prog = wb.compile(lambda t: t[:, t[0] > 0], x)
    assert len(prog.breaks) == 1 and "nonzero" in prog.breaks[0].reason
    torch.testing.assert_close(prog(x).full_tensor(), Y[:, Y[0] > 0])


def test_out_of_range_computed_index_raises_when_run():
    x = wb.distribute_tensor(Y.clone(), MESH, [Shard(1)])
    prog = wb.compile(lambda t: t[t.argmax(1) + 8], x)
    assert prog.breaks == []
    with pytest.raises((IndexError, RuntimeError)):   # torch's index_select kernel's
        prog(x)
