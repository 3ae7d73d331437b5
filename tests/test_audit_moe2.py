"""Second user-trial audit of mixture of experts, expert parallelism and context
parallelism: every result held to one device's plain PyTorch (values, gradients, dtypes),
and what is not supported refused with the fix rather than computed differently."""
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.strategies import context_parallel as cp

R, S = wb.Replicate(), wb.Shard


def _full(t):
    return t.full() if hasattr(t, "full") else t


# ---- ring attention: causal SDPA exactly ------------------------------------------------------

@pytest.mark.parametrize("p,balanced,causal,hkv,via", [
    (1, True, True, 2, "ring"), (2, True, True, 1, "sdpa"), (3, False, True, 2, "ring"),
    (4, True, False, 2, "sdpa")])
def test_ring_attention_in_float64_is_float64_sdpa(p, balanced, causal, hkv, via):
    """The running output was merged in float32 and flash_attention's log-sum-exp was
    float32 whatever the inputs: float64 ring attention was 3e-7 off float64 SDPA (what
    float32 gives), where torch computes float64 in float64."""
    mesh = wb.Mesh(list(range(p)), ["cp"])
    g = torch.Generator().manual_seed(0)
    n = 4 * p * (2 if balanced else 1)
    q = torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hkv, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=hkv != 4)
    (ref * go).sum().backward()
    dist = [wb.shard_tensor(cp.ring_order(t, p, 2, balanced), mesh, [S(2)]).requires_grad_()
            for t in (q, k, v)]
    if via == "ring":
        out = cp.ring_attention(*dist, "cp", causal=causal, balanced=balanced)
    else:
        with cp.context_parallel(mesh, "cp", balanced=balanced):
            out = F.scaled_dot_product_attention(*dist, is_causal=causal, enable_gqa=True)
    (out * wb.shard_tensor(cp.ring_order(go, p, 2, balanced), mesh, [S(2)])).sum().backward()
    inv = torch.argsort(cp.slot_positions(n, p, balanced))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.full()[:, :, inv], ref, rtol=1e-12, atol=1e-12)
    for d, r in zip(dist, ref_in):
        assert d.grad.dtype == torch.float64
        torch.testing.assert_close(d.grad.full()[:, :, inv], r.grad, rtol=1e-12, atol=1e-12)


def test_flash_attention_log_sum_exp_is_float64_for_float64_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    _, lse = wb.ops.flash_attention(q, k, v, causal=True, return_lse=True)
    s = (q @ k.transpose(-2, -1)) / 2
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-13, atol=1e-13)
