"""A partial sum reduce-scattered onto the batch rows when B / dp < tp leaves uneven
shards (some ranks hold no row); the next linear, plain or parallelized either way, runs
on them and gives one device's values and gradients (reported as a crash in
storage.to_stacked, "stack expects each tensor to be equal size"; it does not occur on
main as of this test)."""
import pytest
import torch
from torch import nn

import workbench as wb

R, S = wb.Replicate(), wb.Shard


@pytest.mark.parametrize("shape, B", [((2, 2), 2), ((1, 4), 2), ((1, 4), 3)],
                         ids=["dp2-tp2-B2", "tp4-B2", "tp4-B3"])
@pytest.mark.parametrize("plan", ["colwise", "rowwise", None])
def test_linear_after_a_partial_scattered_onto_uneven_rows(shape, B, plan):
    mesh = wb.Mesh.grid(shape, ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    X, W1 = torch.randn(B, 3, 8, generator=g), torch.randn(8, 8, generator=g)
    lin = nn.Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    wb.parallelize(lin, mesh, {"": plan} if plan else {}, mesh_dim="tp")
    x = wb.shard_tensor(X, mesh, [S(0), S(2)]).requires_grad_()
    w1 = wb.shard_tensor(W1, mesh, [R, S(0)]).requires_grad_()
    h = wb.reshard(x @ w1, mesh, [S(0), S(0)])           # P(sum) on tp -> the rows
    assert isinstance(h._local, wb.sim_mesh.grid.Cells)   # uneven: a rank holds no row
    y = lin(h)
    y.sum().backward()
    Xr, W1r = X.clone().requires_grad_(), W1.clone().requires_grad_()
    yr = ref(Xr @ W1r)
    yr.sum().backward()
    torch.testing.assert_close(y.full(), yr)
    torch.testing.assert_close(x.grad.full(), Xr.grad)
    torch.testing.assert_close(w1.grad.full(), W1r.grad)
    torch.testing.assert_close(lin.weight.grad.full(), ref.weight.grad)
