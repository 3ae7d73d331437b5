"""Defects fixed by helper fixlist15: LayerNorm's per-rank-weights path accepting a dtype mix
torch's kernel refuses."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

R, S = wb.Replicate, wb.Shard


# ---- 1. LayerNorm with per-rank weight views: torch's dtype check ----------------------------

@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.float64, torch.float32)])
def test_layer_norm_per_rank_weights_refuses_torchs_mixed_dtypes(x_dtype, w_dtype):
    """x sharded over dp x cp (the weight and bias given per-rank views: the composed path).
    Was: a float32 x with bfloat16 weights (or float64 with float32) computed silently, a
    float32 result, where torch raises RuntimeError 'mixed dtype (CPU): ...'. Now the same
    error type, naming the dtypes and the fix; x and the weights untouched."""
    mesh = wb.Mesh.grid((2, 2), ("dp", "cp"))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 8, 16, generator=g).to(x_dtype)
    ref = nn.LayerNorm(16).to(w_dtype)
    with pytest.raises(RuntimeError, match="mixed dtype"):
        ref(X)                                                   # torch refuses it
    ln = nn.LayerNorm(16).to(w_dtype)
    wb.parallelize(ln, mesh, {})
    before = {n: p.full().clone() for n, p in wb.dist_parameters(ln)}
    x = wb.shard_tensor(X, mesh, [S(0), S(1)])
    with pytest.raises(RuntimeError, match=r"mixed dtype.*input torch\.float.*weight torch\."
                                           r".*cast the input or the weight"):
        ln(x)
    assert torch.equal(x.full(), X)
    for n, p in wb.dist_parameters(ln):
        assert p.dtype == w_dtype and torch.equal(p.full(), before[n])


def test_layer_norm_per_rank_weights_allowed_mix_still_matches_torch():
    """bfloat16 x with float32 weights (torch's mixed type) still runs, as one device."""
    mesh = wb.Mesh.grid((2, 2), ("dp", "cp"))
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4, 8, 16, generator=g).to(torch.bfloat16)
    ref = nn.LayerNorm(16)
    ln = nn.LayerNorm(16)
    ln.load_state_dict(ref.state_dict())
    wb.parallelize(ln, mesh, {})
    y = ln(wb.shard_tensor(X, mesh, [S(0), S(1)]))
    want = ref(X)
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y.full(), want.detach(), rtol=0, atol=0)
