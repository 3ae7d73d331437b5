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


def test_max_over_every_dim_still_breaks_and_runs_eagerly():
    x = wb.distribute_tensor(X.clone(), MESH, [Shard(1)])
    prog = wb.compile(lambda t: t.max(), x)
    assert len(prog.breaks) == 1 and "max" in prog.breaks[0].reason
    assert torch.equal(prog(x).full_tensor(), X.max())


def test_bad_dim_is_torchs_index_error():
    """As for amax: capture notes the break, the call raises torch's IndexError."""
    x = wb.distribute_tensor(X.clone(), MESH, [Shard(0)])
    prog = wb.compile(lambda t: t.max(2).values, x)
    assert "IndexError" in prog.breaks[0].reason
    with pytest.raises(IndexError, match="Dimension out of range"):
        prog(x)
