"""The library's DataParallel (ZeRO 0-2) and Zero3 keep frozen parameters frozen, skip
parameters unused in forward (as torch.optim does), and name parameters fully."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.a.bias.requires_grad_(False)                          # frozen, used
        self.spare = nn.Linear(4, 4)                               # never used
        self.spare.weight.requires_grad_(False)                    # ... one half frozen

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def one_device(X, Y, steps=3):
    m = Net()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        ((m(X) - Y) ** 2).mean().backward()
        opt.step()
    return dict(m.named_parameters())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_frozen_and_unused_parameters(zero):
    X, Y = torch.randn(8, 8), torch.randn(8, 4)
    ref = one_device(X, Y)
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Net()
    wb.parallelize(m, mesh, {})
    opt = Zero3(m, mesh, "dp", lr=1e-2) if zero == 3 else \
        DataParallel(list(wb.dist_parameters(m)), mesh, "dp", zero=zero, lr=1e-2)
    x = wb.shard_tensor(X, mesh, ["S(0)"])
    y = wb.shard_tensor(Y, mesh, ["S(0)"])
    for _ in range(3):
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
    got = dict(opt.full_parameters()) if zero == 3 else \
        {n: p.full() for n, p in wb.dist_parameters(m)}
    assert sorted(got) == sorted(ref)                   # qualified names, none lost
    for n, q in ref.items():
        torch.testing.assert_close(got[n], q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    assert torch.equal(got["a.bias"], ref["a.bias"].detach())      # frozen: untouched
    if zero != 3:
        assert not dict(wb.dist_parameters(m))["a.bias"].requires_grad


@pytest.mark.parametrize("zero", [0, 3])
def test_step_before_backward_is_a_clear_error(zero):
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Net()
    wb.parallelize(m, mesh, {})
    opt = Zero3(m, mesh, "dp") if zero == 3 else \
        DataParallel(list(wb.dist_parameters(m)), mesh, "dp")
    with pytest.raises(RuntimeError, match="call loss.backward"):
        opt.step()
