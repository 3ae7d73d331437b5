"""A tracked write into a ``detach()``ed DistTensor: torch writes it into the memory the
detached tensor shares with its source (``t.detach().mul_(w)`` with ``w`` requiring grad
changes ``t``); here the write gives the detached tensor memory of its own, so ``t`` kept
its values silently (found by task sweep8).  Now refused before anything is written;
untracked writes (``p.detach().zero_()``, under no_grad) still reach the source."""
import pytest
import torch

import workbench as wb

MESH = wb.Mesh([0, 1])


def _pair(requires_grad):
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    d = wb.distribute_tensor(x0.clone(), MESH, [wb.Shard(0)]).requires_grad_(requires_grad)
    w = wb.distribute_tensor(w0.clone(), MESH, [wb.Shard(0)]).requires_grad_()
    return x0, d, w


@pytest.mark.parametrize("requires_grad", [True, False])
def test_tracked_write_into_a_detached_tensor_is_refused(requires_grad):
    x0, d, w = _pair(requires_grad)
    r = x0.clone().requires_grad_(requires_grad)
    a = r.detach()
    a.mul_(w.full().detach().requires_grad_())
    assert not torch.equal(r.detach(), x0)          # torch: the source sees the write
    b = d.detach()
    with pytest.raises(NotImplementedError, match="detach"):
        b.mul_(w)
    torch.testing.assert_close(d.full().detach(), x0, rtol=0, atol=0)     # untouched
    torch.testing.assert_close(b.full().detach(), x0, rtol=0, atol=0)


def test_untracked_writes_and_clones_are_as_before():
    x0, d, w = _pair(True)
    with torch.no_grad():
        d.detach().mul_(2)
    torch.testing.assert_close(d.full().detach(), 2 * x0)
    d.detach().zero_()                              # no value requires grad: in place
    assert float(d.full().abs().sum()) == 0.0
    c = d.detach().clone()
    c.add_(w)                                       # a clone has memory of its own
    assert c.requires_grad
    torch.testing.assert_close(c.full().detach(), w.full().detach())
