"""Review revM (the planfit and fa2rates merges): regression tests for what it fixed."""
import pytest

from workbench.sim_mesh import cost, fa2_a100 as fa2
from workbench.sim_mesh.kernel_cost import AttentionShape
from workbench.sim_mesh.profiles import get_profile


def test_jeanzay_prices_flash_attention_from_the_same_a100_table():
    # a100-jeanzay is the same A100 SXM4 80GB as a100 (tests/test_published_bloom.py holds
    # its kernels equal): the fa2rates merge gave only a100 the per-shape table, so the
    # same 16-bit FlashAttention-2 kernel was priced at the one 0.73 efficiency there
    jz, a = get_profile("a100-jeanzay"), get_profile("a100")
    assert jz.attention_table == a.attention_table == fa2.NAME
    assert "attention_table" in jz.citations and "ASSUMPTION" in jz.citations["attention_table"]
    for shape in (AttentionShape(32, 2048, 128, True, False),
                  AttentionShape(16, 512, 64, False, True)):
        want = cost.compute_time(4e12, 1e9, a, "bfloat16", "attention", gemm=shape)
        got = cost.compute_time(4e12, 1e9, jz, "bfloat16", "attention", gemm=shape)
        assert got == pytest.approx(want, rel=1e-12)
        assert 4e12 / (got - jz.launch_overhead) == pytest.approx(
            fa2.rate(shape.seq, shape.head_dim, shape.causal, shape.backward), rel=1e-9)
