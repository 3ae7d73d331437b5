"""``torch.optim`` over the DistTensor parameters of a model parallelized alone
(``wb.parallelize_module``): torch's "optimizer can only optimize Tensors" named no fix
(task tp7); now the refusal names the wrapper whose parameters torch.optim steps, and that
way trains as one device does."""
import pytest
import torch
from torch import nn

import workbench as wb


def _mk():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 40), nn.ReLU(), nn.Linear(40, 8))


PLAN = {"0": wb.ColwiseParallel(), "2": wb.RowwiseParallel()}


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW([{"params": ps, "lr": 1e-3}]),
    lambda ps: torch.optim.SGD(ps[0], lr=0.1),                        # one tensor
])
def test_torch_optim_over_dist_tensors_names_the_way(make):
    m = _mk()
    wb.parallelize_module(m, wb.Mesh([0, 1], dim_names=["tp"]), PLAN)
    ps = list(m.parameters())
    with pytest.raises(TypeError, match=r"parameter 0 is a DistTensor .*"
                                        r"wb.DistributedDataParallel\(model, mesh, dim='dp'\)"):
        make(ps)


def test_plain_parameters_are_torchs_as_before():
    opt = torch.optim.SGD(_mk().parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 4
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors"):
        torch.optim.SGD([1.0], lr=0.1)
    named = torch.optim.SGD(_mk().named_parameters(), lr=0.1)
    assert named.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_the_named_way_trains_as_one_device():
    ref, m = _mk(), _mk()
    mesh = wb.Mesh.grid((1, 2), ["dp", "tp"])
    wb.parallelize_module(m, mesh, PLAN)
    ddp = wb.DistributedDataParallel(m, mesh, dim="dp")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    for _ in range(3):
        opt.zero_grad()
        ro.zero_grad()
        out = ddp(wb.shard_tensor(x, mesh, [wb.Replicate(), wb.Replicate()]))
        ((out.full() - y) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        ro.step()
    for a, b in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.detach(), rtol=1e-6, atol=1e-6)
