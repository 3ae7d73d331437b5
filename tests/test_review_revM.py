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


@pytest.mark.parametrize("sp", [False, True])
def test_an_early_stopped_recompute_does_not_count_the_mlps_closing_collective(sp):
    # planfit's early stop (llama_layer.full_recompute) re-runs a Llama block up to w2's
    # input, so its recompute holds tp_out_1 but not tp_out_2; costs.layer_cost still
    # counted the whole forward's TP collectives again (2 x comm_f, 3 x sent_f)
    from workbench.plan import costs as C
    from workbench.plan.presets import get_config
    from workbench.sim_mesh.cost import wire_bytes
    cfg = get_config("llama3-8b").replace(seq_len=1024)
    tp, b = 4, 1
    kw = dict(cfg=cfg, b=b, tp=tp, sp=sp, recompute="full", profile="h100",
              attention="flash", main_grad=False)
    lt = C._layer_times(cfg.d_model, cfg.n_head, cfg.seq_len, b, tp, sp=sp,
                        recompute="full", ffn=cfg.d_ff, dtype=cfg.dtype, profile="h100",
                        tp_ranks=list(range(tp)), attention="flash",
                        kv_heads=cfg.n_kv_head, dropout=False, main_grad=False,
                        early_stop=True)
    rerun = [o["name"] for o in lt.ops if o["phase"] == "recompute"
             and o["op_class"] in ("all_reduce", "reduce_scatter")]
    assert rerun == ["tp_out_1"]
    whole, early = C.layer_cost(**kw), C.layer_cost(**kw, early_stop=True)
    k, n = ("reduce_scatter" if sp else "all_reduce"), 2 * cfg.seq_len * b * cfg.d_model
    one = C.group_price(k, n, tuple(range(tp)), "h100")
    assert one > 0
    assert whole.bwd_comm - early.bwd_comm == pytest.approx(one, rel=1e-9)
    assert whole.comm_bytes - early.comm_bytes == pytest.approx(wire_bytes(k, n, tp))
    # the layer's time is what its ops give: the saved collective is the compute's again
    assert early.bwd_compute + early.bwd_comm == pytest.approx(lt.backward, rel=1e-9)
