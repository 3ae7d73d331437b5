"""torchtitan's eager Llama block (``plan.titan_eager``) against its source, counted by hand.

The bytes each eager kernel moves, from torchtitan 9dec370ad2's code and PyTorch's
autograd formulas (derivatives.yaml), per element of the (tokens, h) activation:

- ``RMSNorm`` forward, ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x)
  * w``: cast r2 w4 (6), pow r4 w4 (8), mean r4 (4), product r4 w4 (8), cast r4 w2 (6),
  weight r2 w2 (4): 36 bytes in 8 kernels (with the rows' add and rsqrt);
- its backward: the weight product's two gradients (4, 6) and the weight's sum (2), the
  cast (6), the x * rsqrt product's two gradients (8, 12) and their row sum (4), mean's
  expand-divide (4), pow's 2 x^1 (8 + 8) times the gradient (12), the two x gradients
  added (12), the cast back (6): 92 bytes;
- RoPE on q (or k): cast r2 w4, complex product r4 w4, cast back r4 w2: 20 bytes per
  element, plus complex64 ``freqs_cis`` read once;
- ``repeat_kv`` (n_rep > 1): one copy reading k (2 bytes x kv heads) and writing n_rep x it.
"""
import pytest

import workbench as wb
from workbench.plan import titan_eager as E
from workbench.sim_mesh.cost import compute_time
from workbench.sim_mesh.profiles import get_profile

H100 = get_profile("h100")
T, H, A, G, D = 4096, 4096, 32, 8, 128


def _sum(ops):
    return sum(b for _, b in ops)


def test_rmsnorm_bytes_and_kernels_match_the_source():
    k = E.kernels("norm", T, H, A, G, D)
    assert len(k["forward"]) == 8
    assert _sum(k["forward"]) == pytest.approx(36 * T * H, rel=0.01)
    assert _sum(k["backward"]) == pytest.approx(92 * T * H, rel=0.01)


def test_rope_and_repeat_kv_bytes_match_the_source():
    k = E.kernels("pre_attention", T, H, A, G, D)
    names = [n for n, _ in k["forward"]]
    assert names.count("clone") == 2                # repeat_kv on k and v
    rope = 20 * T * (A + G) * D + 2 * 8 * T * D // 2     # + freqs (complex64) read twice
    copies = 2 * T * (2 * G * D + 2 * A * D)        # read k, write n_rep x k; v alike
    assert _sum(k["forward"]) == pytest.approx(rope + copies, rel=0.01)
    # backward: RoPE's three kernels again and repeat_kv's sum (read n_rep x, write 1 x)
    assert any(n == "sum" for n, _ in k["backward"])
    # without grouped-query attention, no copy
    mha = E.kernels("pre_attention", T, H, A, A, D)
    assert "clone" not in [n for n, _ in mha["forward"]]


def test_bytes_scale_linearly_with_tokens():
    a, b = E.kernels("norm", 1000, H, A, G, D), E.kernels("norm", 3000, H, A, G, D)
    assert _sum(b["forward"]) == pytest.approx(3 * _sum(a["forward"]), rel=0.01)


def _cfg(**kw):
    return wb.plan.presets.get_config("llama3-8b", seq_len=2048, **kw)


def test_extra_is_eager_minus_the_fused_ops_it_replaces():
    """fused_rmsnorm with one micro-batch, op-level SAC: forward extra = the eager RoPE,
    repeat_kv and SwiGLU kernels' seconds - the fused block's two RoPE ops' and SwiGLU's
    seconds; backward = their backward (with autograd's input-gradient sums) less the
    fused RoPE and SwiGLU gradients, plus the forward again (recompute)."""
    cfg = _cfg()
    lay = wb.plan.Layout(dp=8, zero=3, recompute="op", micro_batch=1, framework="fsdp")
    x = E.extra_seconds(cfg, lay, H100, "fused_rmsnorm")
    t, f = 2048, cfg.d_ff
    # RoPE and repeat_kv at the eager RoPE rates the profile carries (plan.eager_rates),
    # SwiGLU and the gradient sums at the plain memory rate
    ks = [("eager_rope", E.kernels("pre_attention", t, 4096, 32, 8, 128)),
          (None, E.kernels("swiglu", t, f, 32, 8, 128)),
          (None, E.kernels("input_grads", t, 4096, 32, 8, 128))]
    eager_f = sum(compute_time(0, b, H100, "float32", "elementwise", 1,
                               kernel=n and n + "_forward")
                  for n, k in ks for _, b in k["forward"])
    eager_b = sum(compute_time(0, b, H100, "float32", "elementwise", 1,
                               kernel=n and n + "_backward")
                  for n, k in ks for _, b in k["backward"])
    # the fused block's RoPE (plan.llama_layer): read + write e bytes, + cos/sin 2 e s d
    def rope(w, back):
        return compute_time(3 * t * w, 2 * 2 * t * w + (4 if back else 2) * 2 * t * 128,
                            H100, "bfloat16", "elementwise", 1)

    def ew(flops, nbytes):       # the fused block's silu / product (plan.llama_layer)
        return compute_time(flops * t * f, nbytes * 2 * t * f, H100, "bfloat16",
                            "elementwise", 1)
    fused_f = rope(4096, False) + rope(1024, False) + ew(4, 2) + ew(1, 3)
    fused_b = rope(4096, True) + rope(1024, True) + ew(8, 3) + ew(2, 5)
    assert x["forward"] == pytest.approx(eager_f - fused_f, rel=1e-9)
    assert x["backward"] == pytest.approx(eager_b - fused_b + x["forward"], rel=1e-9)
    assert x["forward"] > 0


def test_recompute_adds_the_forward_again_only_when_it_reruns():
    cfg = wb.plan.presets.get_config("llama2-13b", seq_len=2048)     # MHA: no repeat_kv
    got = {}
    for rc in ("none", "op", "full"):
        lay = wb.plan.Layout(dp=8, zero=3, recompute=rc, micro_batch=1, framework="fsdp")
        got[rc] = E.extra_seconds(cfg, lay, H100, "fused_rmsnorm")
    assert got["op"]["backward"] == pytest.approx(got["none"]["backward"] + got["op"]["forward"])
    assert got["full"]["backward"] == pytest.approx(got["op"]["backward"])


def test_estimate_adds_it_to_each_block_and_says_so():
    cfg = _cfg()
    lay = wb.plan.Layout(dp=8, zero=3, recompute="op", micro_batch=1, framework="fsdp")
    cl = wb.plan.Cluster("h100", 8)
    base = wb.plan.estimate(cfg, lay, cl)
    same = wb.plan.estimate(cfg, lay, cl, torchtitan_eager=None)
    assert same.step_time == base.step_time
    e = wb.plan.estimate(cfg, lay, cl, torchtitan_eager="rmsnorm")
    x = e.details["torchtitan_eager"]
    added = cfg.n_layer * (x["forward"] + x["backward"])
    assert e.breakdown["compute"] == pytest.approx(base.breakdown["compute"] + added,
                                                   rel=1e-6)
    # FSDP2's exposed communication can only shrink behind longer blocks
    assert base.step_time < e.step_time <= base.step_time + added + 1e-12
    assert e.memory == base.memory
    assert any("titan_eager" in a and "norm_type=rmsnorm" in a for a in e.assumptions())
    r = wb.plan.estimate_range(cfg, lay, cl, torchtitan_eager="rmsnorm")
    assert r.estimate.step_time == e.step_time


@pytest.mark.parametrize("bad, match", [("layernorm", "norm_type"), (True, "norm_type")])
def test_bad_norm_type_refused(bad, match):
    lay = wb.plan.Layout(dp=8, zero=3, recompute="op", micro_batch=1, framework="fsdp")
    with pytest.raises(ValueError, match=match):
        wb.plan.estimate(_cfg(), lay, wb.plan.Cluster("h100", 8), torchtitan_eager=bad)


def test_gpt_refused():
    cfg = wb.models.ModelConfig(arch="gpt", d_model=256, n_layer=2, n_head=4,
                                vocab_size=512, seq_len=128, dtype="bfloat16")
    lay = wb.plan.Layout(dp=8, zero=3, recompute="full", micro_batch=1, framework="fsdp")
    with pytest.raises(ValueError, match="arch='gpt'"):
        wb.plan.estimate(cfg, lay, wb.plan.Cluster("h100", 8), torchtitan_eager="rmsnorm")


@pytest.mark.parametrize("preset, norm", [("llama3-8b", "fused_rmsnorm"),
                                          ("llama2-13b", "rmsnorm")])
def test_uncounted_memory_refused_without_checkpointing(preset, norm):
    """Without checkpointing the eager block keeps what the memory model does not count
    (repeat_kv's copies; the norm's fp32 input): refused, naming the fix."""
    cfg = wb.plan.presets.get_config(preset, seq_len=2048)
    lay = wb.plan.Layout(dp=8, zero=3, recompute="none", micro_batch=1, framework="fsdp")
    with pytest.raises(ValueError, match="recompute 'op' or 'full'"):
        wb.plan.estimate(cfg, lay, wb.plan.Cluster("h100", 8), torchtitan_eager=norm)
    # MHA with the fused norm keeps what the fused block keeps
    ok = wb.plan.presets.get_config("llama2-13b", seq_len=2048)
    wb.plan.estimate(ok, lay, wb.plan.Cluster("h100", 8), torchtitan_eager="fused_rmsnorm")


def test_counting_leaves_torchs_rng_alone():
    import torch
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    E._measure.cache_clear()
    E.kernels.cache_clear()
    E.kernels("norm", 64, 256, 4, 2, 64)
    assert torch.equal(torch.rand(3), want)


def test_counts_the_same_under_no_grad_and_inference_mode():
    import torch
    want = E.kernels("norm", 64, 256, 4, 2, 64)
    for ctx in (torch.no_grad, torch.inference_mode):
        E._measure.cache_clear()
        E.kernels.cache_clear()
        with ctx():
            assert E.kernels("norm", 64, 256, 4, 2, 64) == want
