"""Review of the afternoon's merges (revR): each case held to plain PyTorch on one device."""
import pytest
import torch

import workbench as wb


# ---- quantile: a q that requires grad ------------------------------------------------------

@pytest.mark.parametrize("fn", [torch.quantile, torch.nanquantile], ids=["quantile", "nan"])
def test_quantile_q_requiring_grad_raises_instead_of_a_missing_gradient(fn):
    # torch differentiates through q (the lerp weight between the two order statistics);
    # the op table read q as floats, so q.grad stayed None after backward, silently
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    q = torch.tensor(0.3, requires_grad=True)
    fn(x, q, dim=0).sum().backward()
    assert q.grad is not None and q.grad.abs() > 0          # torch's answer has one
    mesh = wb.Mesh.grid((2,), ["a"])
    q2 = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"q\.detach\(\)"):
        fn(wb.shard_tensor(x, mesh, ["S(1)"]).requires_grad_(), q2, dim=0)
    # a detached q (or one read under no_grad) still gives torch's values
    y = fn(wb.shard_tensor(x, mesh, ["S(1)"]), q2.detach(), dim=0)
    torch.testing.assert_close(y.full(), fn(x, q2.detach(), dim=0))
    with torch.no_grad():
        y = fn(wb.shard_tensor(x, mesh, ["S(1)"]), q2, dim=0)
    torch.testing.assert_close(y.full(), fn(x, q2.detach(), dim=0))
