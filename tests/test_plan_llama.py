"""The planner for ``arch="llama"`` (``plan.llama_layer``): held to the dry run of the
course's Llama (``models.llama`` under the Hybrid recipe on meta tensors), to the
published parameter counts of Llama 2 and Llama 3, and to its own closed forms.
"""
from functools import lru_cache

import pytest

import workbench as wb
from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, dry_run, estimate, search
from workbench.plan.costs import layer_flops
from workbench.plan.layer_cost import layer_ops
from workbench.plan.memory import stage_params

# two blocks with grouped-query attention (16 query heads, 4 key/value heads), SwiGLU of
# 2816 (Llama's 8/3 h rounded), Llama 2's vocabulary: h = 1024, s = 1024 as
# test_dryrun.py's GPT, so the roofline is in the regimes it is at scale
CFG = get_config("llama2-7b", n_layer=2, d_model=1024, n_head=16, n_kv_head=4, d_ff=2816,
                 seq_len=1024)

LAYOUTS = [
    Layout(dp=1, tp=1, pp=1, global_batch=1),
    Layout(dp=2, tp=1, pp=1, global_batch=4, recompute="selective"),
    Layout(dp=1, tp=1, pp=2, global_batch=8),
    # micro-batches of 2: full recompute keeps 2 s b h per block, and the RoPE tables the
    # dry run also counts (cos, sin: s x head dim, 0.13 MB each here, not in the planner's
    # count, negligible at scale) would be 6% of one sequence's 4 MB
    Layout(dp=2, tp=1, pp=2, global_batch=16, micro_batch=2, recompute="full", zero=1),
    Layout(dp=1, tp=1, pp=2, global_batch=8, schedule="gpipe"),
    Layout(dp=2, tp=2, pp=1, global_batch=4),
    Layout(dp=1, tp=4, pp=1, global_batch=2, sp=True),
    Layout(dp=1, tp=2, pp=2, global_batch=8, schedule="interleaved_1f1b", v=2,
           recompute="full"),
    Layout(dp=2, tp=1, pp=1, global_batch=4, zero=2),
    Layout(dp=2, tp=1, pp=1, global_batch=4, zero=3),
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=2, sp=True),
    # uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers):
    # the recipe split so (Hybrid(stage_sizes=...)), every stage run
    Layout(dp=1, tp=1, pp=2, global_batch=8, stages=(1, 3)),
    Layout(dp=1, tp=2, pp=3, global_batch=6, stages=(1, 2, 1), schedule="gpipe"),
    Layout(dp=2, tp=1, pp=3, global_batch=12, stages=(2, 2, 0), recompute="full", zero=1),
    # torchtitan's op-level selective checkpointing (models/op_sac.py, the dry run running
    # PyTorch's create_selective_checkpoint_contexts): one device, FSDP-like ZeRO-3 with
    # TP, sequence parallel, interleaved, uneven stages
    Layout(dp=1, tp=1, pp=1, global_batch=1, recompute="op"),
    Layout(dp=2, tp=2, pp=1, global_batch=4, zero=3, recompute="op"),
    Layout(dp=1, tp=4, pp=1, global_batch=2, sp=True, recompute="op"),
    Layout(dp=1, tp=2, pp=2, global_batch=8, schedule="interleaved_1f1b", v=2,
           recompute="op"),
    Layout(dp=1, tp=2, pp=3, global_batch=6, stages=(1, 2, 1), schedule="gpipe",
           recompute="op"),
]
# ZeRO-3 with TP: the dry run's forward is 0.40 ms longer than with ZeRO-0: the
# cross-entropy's all-reduce of the global target count runs on the dp group's stream,
# queued behind the 0.36 ms of ZeRO-3 gathers the recipe issues at the end of the forward
# to prefetch the backward (the untied head's 16 MB first); DeepSpeed's loss is local to
# the rank and needs no such collective.  The estimate of framework="workbench" now waits
# for them too (zero_cost's ``loss_waits``): dry run / estimate 1.115 -> 1.042 (and
# 1.053 -> 1.019 without TP)
ZERO3_TP = Layout(dp=2, tp=2, pp=1, global_batch=4, zero=3)


@lru_cache(maxsize=None)
def _pair(lay):
    cl = Cluster("a100", lay.world)
    cfg = CFG.replace(n_layer=2 * lay.pp * lay.v) if lay.v > 1 else CFG   # whole chunks
    if lay.stages is not None:
        cfg = CFG.replace(n_layer=sum(lay.stages))
    return cfg, dry_run(cfg, lay, cl), estimate(cfg, lay.replace(framework="workbench"), cl)


def _estimated_stage(est, s):
    """The estimate's memory of pipeline stage s (one middle stage stands for the others
    when the stages are even)."""
    st = est.details["stages"].values()
    return next((v for v in st if v["stage"] == s), None) or \
        next(v for v in st if v["stage"] == 1)


@pytest.mark.parametrize("lay", LAYOUTS + [ZERO3_TP], ids=lambda l: l.short())
def test_memory_agrees_with_dry_run(lay):
    _, dr, est = _pair(lay)
    assert set(dr.memory) == set(est.memory)
    for k in ("params", "grads", "optimizer", "buffers"):
        assert dr.memory[k] == pytest.approx(est.memory[k], rel=0.05), k
    for s, got in enumerate(dr.per_rank):                  # every pipeline rank
        want = _estimated_stage(est, s)["memory"]
        assert got["activations"] == pytest.approx(want["activations"], rel=0.05), s
        assert got["total"] == pytest.approx(want["total"], rel=0.05), s


@pytest.mark.parametrize("lay", LAYOUTS + [ZERO3_TP], ids=lambda l: l.short())
def test_step_time_agrees_with_dry_run(lay):
    _, dr, est = _pair(lay)
    assert dr.step_time == pytest.approx(est.step_time, rel=0.10)


def test_model_states_are_the_module_parameters():
    """Every parameter of the course's Llama on one rank, by the planner's count: the
    module built on meta (tp = 1), and the dry run's shards (tp = 2: q, k, v, o, w1, w3,
    w2, embedding and head split, RMSNorm weights whole)."""
    n = wb.models.param_count(CFG).module
    assert stage_params(CFG, 1, 1, 0) == n
    _, dr, est = _pair(LAYOUTS[5])
    h = CFG.d_model
    whole = (2 * CFG.n_layer + 1) * h
    assert dr.memory["params"] == 2 * ((n - whole) // 2 + whole) == est.memory["params"]


# Parameters of the released checkpoints (the Hugging Face model cards' safetensors
# totals, meta-llama/Llama-2-7b-hf etc.; the papers round them: "7B", "13B", "70B",
# Touvron et al. 2023 Table 1; "8B", "70B", Dubey et al. 2024 Table 3)
PUBLISHED = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320,
             "llama2-70b": 68_976_648_192, "llama3-8b": 8_030_261_248,
             "llama3-70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    cfg = get_config(name)
    pc = wb.models.param_count(cfg)
    assert pc.module == PUBLISHED[name]
    assert stage_params(cfg, 1, 1, 0) == PUBLISHED[name]        # the planner's count
    tp, pp = 8, 4                                                # and split over tp x pp
    ranks = sum(stage_params(cfg, tp, pp, s) for s in range(pp))
    whole = (2 * cfg.n_layer + 1) * cfg.d_model                  # RMSNorm weights
    assert ranks * tp == pytest.approx(PUBLISHED[name] + (tp - 1) * whole)


def test_layer_flops_are_the_ops_flops():
    """The FLOPs the layer's priced ops carry (forward, one TP rank) are the closed form's
    matrix FLOPs / t plus the causal kernel's (half the 4 b s^2 h of the full count)."""
    b, tp = 2, 2
    ops = layer_ops(CFG.d_model, CFG.n_head, CFG.seq_len, b, tp, attention="flash",
                    ffn=CFG.d_ff, kv_heads=CFG.n_kv_head)
    mat, core = layer_flops(CFG, b)
    gemm = sum(o.flops for o in ops if o.phase == "forward" and o.op_class == "matmul")
    attn = sum(o.flops for o in ops if o.phase == "forward" and o.op_class == "attention")
    assert gemm == mat / tp
    assert attn == pytest.approx(core / tp / 2, rel=0.01)
    bwd = sum(o.flops for o in ops if o.phase == "backward" and o.op_class == "matmul")
    assert bwd == 2 * gemm


def test_search_plans_a_llama():
    """Llama 3 8B on 64 H100s: every layout it ranks splits whole key/value heads (8)."""
    r = search(get_config("llama3-8b"), Cluster("h100", 64), global_batch=128, top=5)
    assert r.fitting > 0 and len(r) == 5
    for lay, est in r:
        assert 8 % lay.tp == 0 and est.fits
        assert est.mfu < 1 and est.step_time > 0
    assert any("cuDNN's fused attention at the rates measured" in a
               for a in r[0][1].assumptions())
    assert "llama_layer" in r[0][1].explain()


def test_llama_errors_name_the_fix():
    cl = Cluster("a100", 8)
    cfg = get_config("llama3-8b")
    with pytest.raises(ValueError, match="n_kv_head=4"):
        estimate(cfg.replace(n_kv_head=4), Layout(tp=8), cl)
    with pytest.raises(ValueError, match="attention='flash'"):
        estimate(cfg, Layout(tp=8), cl, attention="materialized")
    with pytest.raises(ValueError, match="bfloat16"):
        estimate(cfg.replace(dtype="float32"), Layout(tp=8), cl)


def test_attention_kernel_priced_as_the_op_table_prices_it():
    """The closed-form causal GQA kernel (llama_layer._flash) against wb.ops.cost, which
    counts the attended pairs on the mask it builds: FLOPs exactly, bytes as its fused
    kernel reads q, k, v and writes o and the log-sum-exp."""
    import torch
    from workbench.ops import cost
    from workbench.plan.llama_layer import _flash
    b, ah, gh, s, d = 2, 8, 2, 48, 16
    q = torch.empty(b, ah, s, d, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(b, gh, s, d, dtype=torch.bfloat16, device="meta")
    c = cost("flash_attention", q, kv, kv, causal=True)
    ff, fb, bf, _ = _flash(b, ah, gh, s, d, 2)
    assert (ff, bf, fb) == (c.flops, c.backward_flops, c.bytes_fused)
