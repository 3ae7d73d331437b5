"""Megatron-LM's GPT layer with Transformer Engine, term by term against its source
(``workbench.plan.layer_cost.TE_SOURCES``: Megatron-LM f2e5db402c, TransformerEngine v1.8).

- QKV bias: added in the GEMM's cuBLASLt epilogue and its gradient written by the
  weight-gradient GEMM's (``linear_qkv`` has ``skip_bias_add=False``): no bias kernel,
  the bias's bytes on the two GEMMs.
- The attention's layout: ``TEDotProductAttention`` copies q, k, v to contiguous bshd
  (``apply_rope_fusion``, on by default), returns the context as a transpose view, which
  ``linear_proj`` copies only where it is not contiguous (b > 1); dQ, dK, dV come back as
  three tensors, still concatenated.  The contiguity facts are checked here with torch.
- LayerNorm, bias-GeLU, bias-dropout-add: unchanged (Megatron's own fused kernels; TE's
  LayerNorm writes the same output).
"""
import pytest
import torch

import workbench.plan as P
from workbench.models.config import ModelConfig
from workbench.plan import layer_cost as LC
from workbench.plan.layer_cost import layer_ops

H, A, S, TP = 2048, 16, 4096, 1


def _ops(b=1, te=True, tp=TP, **kw):
    kw.setdefault("attention", "flash")
    kw.setdefault("profile", "h100")
    return {(o.phase, o.name): o for o in layer_ops(H, A, S, b, tp, transformer_engine=te, **kw)}


def test_qkv_bias_in_the_gemm_epilogues():
    """FAILED before: layer_ops had no transformer_engine switch (TypeError), and the layer
    charged a qkv_bias_add and a qkv_bias_grad kernel that Megatron-LM with TE does not
    run (attention.py:379-390 at f2e5db402c; TE v1.8 layernorm_linear.py:268-276,
    636-647, cublaslt_gemm.cu:188-192)."""
    te, mg = _ops(te=True), _ops(te=False)
    hq, T, e = 3 * H // TP, S, 2
    assert ("forward", "qkv_bias_add") in mg and ("backward", "qkv_bias_grad") in mg
    assert ("forward", "qkv_bias_add") not in te
    assert ("backward", "qkv_bias_grad") not in te
    # the epilogue reads the bias (forward) and writes its gradient in main_grad's fp32
    # (gemm.py:213-216: grad_bias in the output's dtype); FLOPs unchanged
    g, w = te[("forward", "qkv_gemm")], mg[("forward", "qkv_gemm")]
    assert g.bytes == w.bytes + e * hq and g.flops == w.flops
    g, w = te[("backward", "qkv_wgrad")], mg[("backward", "qkv_wgrad")]
    assert g.bytes == w.bytes + 4 * hq and g.flops == w.flops
    g16 = _ops(te=True, main_grad=False)[("backward", "qkv_wgrad")]
    assert g16.bytes == _ops(te=False, main_grad=False)[("backward", "qkv_wgrad")].bytes + e * hq
    # the removed forward kernel, as the layer without TE charges it
    assert mg[("forward", "qkv_bias_add")].bytes == e * (2 * T * hq + hq)


def test_megatron_split_and_te_transpose_contiguity():
    """What the layout terms rest on, checked with torch: Megatron's interleaved q, k, v
    (attention.py:481-526) are not contiguous after ``transpose(0, 1)``, so TE's bshd path
    copies them (transformer_engine.py:515-516); the context's transpose back
    (:552-555) is contiguous only at b = 1, where linear_proj's ``inp.contiguous()`` and
    the backward's ``d_out.contiguous()`` copy nothing."""
    s, ng, hn = 8, 4, 16
    for b in (1, 2):
        mixed = torch.zeros(s, b, ng * 3 * hn).view(s, b, ng, 3 * hn)
        q, k, v = torch.split(mixed, [hn, hn, hn], dim=3)
        assert not any(x.transpose(0, 1).is_contiguous() for x in (q, k, v))
        out = torch.zeros(b, s, ng * hn)               # TE's bshd output, ...hd -> ...(hd)
        assert out.transpose(0, 1).is_contiguous() == (b == 1)
    # three separate dQ, dK, dV (attention.cu:980-983): the split's backward concatenates
    dq, dk, dv = (torch.zeros(s, 1, ng, hn) for _ in range(3))
    assert len({x.untyped_storage().data_ptr() for x in (dq, dk, dv)}) == 3


@pytest.mark.parametrize("b", [1, 2])
def test_attention_layout_terms(b):
    te, mg = _ops(b, te=True), _ops(b, te=False)
    T, e = S * b, 2
    cp = te[("forward", "qkv_transpose")]
    assert (cp.op_class, cp.bytes, cp.launches) == ("data_movement", 2 * e * T * 3 * H // TP, 3)
    assert ("backward", "qkv_split_grad") in te                       # still a cat
    assert te[("backward", "qkv_split_grad")].bytes == mg[("backward", "qkv_split_grad")].bytes
    for key in (("forward", "context_permute"), ("backward", "context_permute_grad")):
        assert (key in te) == (b > 1)
        if b > 1:
            assert te[key].bytes == mg[key].bytes
    assert te[("forward", "flash_attention")].seconds == mg[("forward", "flash_attention")].seconds


def test_selective_recompute_reruns_the_te_core():
    """Megatron's checkpointed core attention is TEDotProductAttention.forward: the q, k, v
    copies and the fused kernel; linear_proj's input copy (b > 1) is outside it."""
    te = _ops(2, te=True, recompute="selective")
    re = sorted(n for (ph, n) in te if ph == "recompute")
    assert re == ["flash_attention", "qkv_transpose"]


def test_unchanged_terms():
    """LayerNorm (TE's layernorm_fwd writes ln_out, layernorm_linear.py:122-140), Megatron's
    bias-GeLU (mlp.py:98-106) and bias-dropout-add: the same ops and bytes as without TE."""
    te, mg = _ops(te=True), _ops(te=False)
    gone = {"qkv_bias_add", "qkv_bias_grad", "context_permute", "context_permute_grad"}
    for key, o in mg.items():
        if key[1] in gone or key[1] in ("qkv_gemm", "qkv_wgrad"):
            continue
        assert key in te, key
        assert (te[key].bytes, te[key].flops, te[key].seconds) == (o.bytes, o.flops, o.seconds)
    assert set(k[1] for k in te) - set(k[1] for k in mg) == {"qkv_transpose"}


def test_te_with_tp_and_sp_keeps_the_collectives():
    te, mg = _ops(te=True, tp=4, sp=True), _ops(te=False, tp=4, sp=True)
    comm = {k: o.bytes for k, o in mg.items() if o.op_class in ("all_gather", "reduce_scatter")}
    assert comm and comm == {k: o.bytes for k, o in te.items()
                             if o.op_class in ("all_gather", "reduce_scatter")}


@pytest.mark.parametrize("kw", [dict(attention="materialized"), dict(kv_heads=4),
                                dict(split_qkv=True)])
def test_refused_where_not_modeled(kw):
    with pytest.raises(ValueError, match="transformer_engine=True"):
        layer_ops(H, A, S, 1, 1, profile="h100", transformer_engine=True,
                  **{"attention": "flash", **kw})
    with pytest.raises(ValueError, match="transformer_engine=1"):
        layer_ops(H, A, S, 1, 1, profile="h100", attention="flash", transformer_engine=1)


def test_estimate_switch():
    cfg = ModelConfig(arch="gpt", d_model=H, n_layer=2, n_head=A, seq_len=S,
                      vocab_size=32768, dtype="bfloat16")
    cl = P.Cluster("h100", 8)
    lay = P.Layout(dp=8, zero=1, micro_batch=1, global_batch=16)
    plain = P.estimate(cfg, lay, cl, attention="flash")
    te = P.estimate(cfg, lay, cl, attention="flash", transformer_engine=True)
    assert te.step_time < plain.step_time
    assert LC.TE_ASSUMPTION in te.details["assumptions"]
    assert LC.TE_ASSUMPTION not in plain.details["assumptions"]
    with pytest.raises(ValueError, match="framework='megatron'"):
        P.estimate(cfg, lay.replace(framework="deepspeed"), cl, attention="flash",
                   transformer_engine=True)
    with pytest.raises(ValueError, match="attention='flash'"):
        P.estimate(cfg, lay, cl, attention="materialized", transformer_engine=True)


def test_published_rows_with_te_are_the_readme_h100_rows():
    """Megatron-LM's README H100 rows ran its default --transformer-impl
    transformer_engine (f2e5db402c arguments.py:668); the 2021-22 Megatron, Megatron-
    DeepSpeed, BLOOM, MT-NLG and torchtitan rows did not (apex / their own kernels)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    import published
    te = {r["source"] for r in published.ROWS if r.get("transformer_engine")}
    assert te == {"megatron_h100"}
    assert all(r.get("transformer_engine") for r in published.ROWS
               if r["source"] == "megatron_h100")
