"""Defects found this session (fixlist5), each held to a reference that does not use the
code under test: plain PyTorch on one device (what one rank keeps), torch's own saved
tensors, the collectives a traced run records."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.strategies.memory import saved_activation_bytes


# ---- 1. saved_activation_bytes: a saved view without the lead axes --------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_parallel_shared_input_counted_whole_per_rank(dtype):
    """A column-parallel linear on 2 simulated ranks saves one shared (S*B, H) copy of its
    replicated input (a view without the lead axis); every rank holds it whole, as one
    rank running plain F.linear on its weight slice keeps its whole input.  It was divided
    by its first dimension (S*B): 2048 -> 128 bytes in fp32 (4096 -> 256 in bf16)."""
    mesh = wb.Mesh.grid(2, ["tp"])
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 32, generator=g, dtype=dtype), torch.randn(64, 32, generator=g, dtype=dtype)
    dx = wb.shard_tensor(x, mesh, ["R"]).requires_grad_()
    dw = wb.shard_tensor(w, mesh, ["S(0)"]).requires_grad_()
    _, rep = saved_activation_bytes(F.linear, dx, dw, params=(dw,), lead_dims=1)
    # one rank, plain torch: its weight slice is a parameter, its input is kept whole
    xr, wr = x.clone().requires_grad_(), w[:32].clone().requires_grad_()
    _, want = saved_activation_bytes(F.linear, xr, wr, params=(wr,))
    assert want.bytes == 16 * 32 * x.element_size()
    assert rep.bytes == want.bytes, rep.items


def test_sharded_input_still_split_and_bad_lead_dims_raise():
    """A row-sharded stacked input is still counted as one rank's shard; lead_dims that do
    not match the mesh, or no mesh at all, raise naming the argument."""
    mesh = wb.Mesh.grid(2, ["tp"])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    dx = wb.shard_tensor(x, mesh, ["S(0)"]).requires_grad_()
    _, rep = saved_activation_bytes(lambda t: t * t, dx, lead_dims=1)
    assert rep.bytes == 8 * 32 * 4, rep.items
    with pytest.raises(ValueError, match="lead_dims=2"):
        saved_activation_bytes(lambda t: t * t, dx, lead_dims=2)
    with pytest.raises(ValueError, match="mesh="):
        saved_activation_bytes(lambda t: t * t, x.clone().requires_grad_(), lead_dims=1)
