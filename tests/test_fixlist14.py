"""Defects fixed by helper fixlist14: LayerNorm with per-rank weights under autocast, the
gradient way of an explicit reshard on torch.distributed, the head under cp + tp + SP, and
the MoE model under torch.export.  Each result is held to one device's (or the simulator's
program, for torch.distributed)."""
import pytest
import torch
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard
PROFILE = "a100"


# ---- 1. LayerNorm with per-rank weight views under autocast ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_with_per_rank_weights_under_autocast_keeps_a_devices_tensors(dtype):
    """test_fixlist13's LayerNorm on x sharded over dp x cp (the weight and bias given
    per-rank views), under ``torch.autocast("cpu", bfloat16)``; x float32 (the residual
    stream) or bfloat16 (a linear's output under autocast).  Was: the composition
    ``F.layer_norm(x) * w + b`` (fixlist13 kept it under autocast): 576 B a rank for one
    device's 64 (the normalized rows for w's gradient), and for a bfloat16 x a float32
    output (a device's is bfloat16, its mean and 1/std float32: torch's mixed type) 0.018
    off one device's value.  Now one device's saved bytes, dtypes, values and gradients."""
    from workbench.parallel.strategies.memory import saved_activation_bytes
    mesh = wb.Mesh.grid((2, 2), ("dp", "cp"))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 8, 16, generator=g).to(dtype)
    G = torch.randn(4, 8, 16, generator=g).to(dtype)
    ref = nn.LayerNorm(16)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.rand(16, generator=g))
        ref.bias.copy_(torch.rand(16, generator=g))
    ln = nn.LayerNorm(16)
    ln.load_state_dict(ref.state_dict())
    wb.parallelize(ln, mesh, {})
    x = wb.shard_tensor(X, mesh, [S(0), S(1)]).requires_grad_()
    params = [p for _, p in wb.dist_parameters(ln)] + [x]
    shard = X[:2, :4].clone().requires_grad_()               # rank 0's rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, rep = saved_activation_bytes(ln, x, params=params, lead_dims=2)
        one_y, one = saved_activation_bytes(ref, shard, params=[*ref.parameters(), shard])
        xs = X.clone().requires_grad_()
        want = ref(xs)
    assert rep.bytes == one.bytes == 2 * 2 * 4 * 4           # float32 mean and 1/std a row
    assert y.dtype == one_y.dtype == dtype
    (y * wb.shard_tensor(G, mesh, [S(0), S(1)])).sum().backward()
    (want * G).sum().backward()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(y.full(), want.detach(), **tol)
    gtol = tol if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.full(), xs.grad, **gtol)
    # the weights' gradients (float32) to one device's computed in float64 from the same
    # values (bfloat16 x: torch's CPU kernel's weight gradient is itself 0.055 off that,
    # of up to 13.5, measured; ours 9e-7)
    ref64 = nn.LayerNorm(16, dtype=torch.float64)
    ref64.load_state_dict(ref.state_dict())
    (ref64(X.double()) * G.double()).sum().backward()
    for name, p in wb.dist_parameters(ln):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full().double(), getattr(ref64, name).grad,
                                   rtol=1e-5, atol=1e-5, msg=name)
