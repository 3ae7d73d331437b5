"""Defects fixed by helper fixlist15: LayerNorm's per-rank-weights path accepting a dtype mix
torch's kernel refuses."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.test_fixlist13 import assert_one_devices_step, one_adamw_step

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


# ---- 2. the head's tp-partial gradient under SP with ONE pipeline stage ----------------------

@pytest.mark.parametrize("m", [1, 2])
def test_one_stage_sp_sums_the_replicated_heads_gradient_with_the_norms(m):
    """The tiny Llama (untied; vocabulary 75, which tp 2 does not divide: the head is
    replicated over tp and reads the final norm's sequence shards), Hybrid(tp=2, sp=True)
    with one pipeline stage. Was: the head weight's partial gradient (19,200 B) all-reduced
    over tp by autograd's replica sum in every micro-batch's backward, apart from the
    norms' once-per-step all-reduce (fixlist13's fix required more than one stage).
    Megatron-LM sums sequence-parallel gradients once per step (finalize_model_grads).
    Now one all-reduce per step holding the head and the norms; parameters after the step
    are one device's."""
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("tiny")
    ref, x, y = one_adamw_step(cfg, 8)
    torch.manual_seed(0)
    s = Hybrid(tp=2, sp=True, microbatches=m)
    s.check(cfg, 8)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, 1e-2, 0.1)
    with wb.trace("a100") as tr:
        s.forward_backward(model, x, y)
        s.optimizer_step(opts)
    grads = [(e.label, e.args["buffer_bytes"]) for e in tr.events
             if e.name == "all_reduce" and not e.label.startswith("P(sum)->R")]
    head = cfg.vocab_size * cfg.d_model * 4
    norms = (2 * cfg.n_layer + 1) * cfg.d_model * 4          # every layer's two, the final
    assert grads == [("sequence-parallel norm grads", head + norms)], grads
    assert_one_devices_step(ref, model)


# ---- 3. (MoE with expert parallelism under wb.compile ran eagerly, one break, pinned
# here; compiled since fixlist16: tests/test_fixlist16.py::
# test_tiny_moe_with_ep_compiles_and_runs_as_eager)
