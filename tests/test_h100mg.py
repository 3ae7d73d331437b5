"""The H100's measured fused attention (``sim_mesh/measurements/h100-sxm-80gb.json``, 2026)
held to a benchmark of the attention kernels the 2024 Megatron-LM H100 table ran:
Transformer Engine's own (NVIDIA/TransformerEngine 88c0c9143, 2024-08-13,
docs/examples/attention/attention.ipynb, output of benchmarks/attention/
benchmark_attention.py: "As of Transformer Engine 1.10, cuDNN 9.3 and flash-attn 2.4.2",
"NVIDIA H100 80GB HBM3"; bf16, causal, head dim 128, forward + backward):

- test_1, batch 2, 16 heads, sequence 2048: cuDNN 0.3664 ms, flash-attn 0.5850 ms;
- test_3, batch 2, 32 heads (4 key/value groups), sequence 8192: cuDNN 7.4875 ms,
  flash-attn 11.8879 ms.

FLOPs as the file counts them (FlashAttention-2's convention: 4 s^2 d h / 2 forward,
backward 2.5x).  The cuDNN rows of 2024 (cuDNN 9.3) and 2026 (9.19) agree within 4%: the
rate the H100 rows of benchmarks/published.py are priced at is what TE's cuDNN attention
ran in mid-2024 (TE on Hopper prefers it: the same notebook's selection table, "sm90:
cuDNN attention > flash-attention").  The slow end of their range (PyTorch's
FlashAttention-2) is 12-13% slower than flash-attn 2.4.2 as TE ran it."""
import pytest

from workbench.sim_mesh import measured as M
from workbench.sim_mesh.profiles import get_profile

FILE = get_profile("h100").measured["file"]
TE_2024 = {  # (batch, heads, seq): (cuDNN ms, flash-attn ms), TE 88c0c9143
    (2, 16, 2048): (0.3664, 0.5850),
    (2, 32, 8192): (7.4875, 11.8879),
}


def _ms(backend, b, h, s, d=128):
    fwd = 4 * b * h * s * s * d / 2
    return 1e3 * (fwd / M.attention_rate(FILE, backend, b * h, s, d, True, False)
                  + 2.5 * fwd / M.attention_rate(FILE, backend, b * h, s, d, True, True))


@pytest.mark.parametrize("shape", sorted(TE_2024))
def test_measured_cudnn_attention_is_te_2024s(shape):
    cudnn, _ = TE_2024[shape]
    assert _ms("cudnn", *shape) == pytest.approx(cudnn, rel=0.05)


@pytest.mark.parametrize("shape", sorted(TE_2024))
def test_measured_flash_attention_is_slower_than_te_2024s_flash_attn(shape):
    _, flash = TE_2024[shape]
    got = _ms("flash", *shape)
    assert 1.05 * flash < got < 1.2 * flash       # 1.131 and 1.117 measured
