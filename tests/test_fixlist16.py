"""Defects fixed by helper fixlist16: the tied head's gradient under sequence parallelism
with one pipeline stage."""
import pytest
import torch

import workbench as wb
from tests.test_fixlist13 import assert_one_devices_step, one_adamw_step


# ---- 1. the TIED head's tp-partial gradient under SP with ONE pipeline stage -----------------

@pytest.mark.parametrize("m,dp", [(1, 1), (2, 1), (2, 2)])
def test_one_stage_sp_sums_the_tied_embeddings_gradient_with_the_norms(m, dp):
    """gpt-tiny (tied embeddings; vocabulary 75, which tp 2 does not divide: the word
    embedding is replicated over tp, and the head reads it after the final norm's sequence
    shards), Hybrid(tp=2, sp=True) with one pipeline stage. Was: the tied weight's partial
    gradient (19,200 B) all-reduced over tp by autograd's replica sum, apart from the norms'
    once-per-step all-reduce (fixlist15 joined only the untied head). Megatron-LM sums sequence-parallel gradients once per step
    (finalize_model_grads). Now one all-reduce per step and tp group holding the embedding
    and the norms; its gradient one device's, and so the parameters after the step."""
    from workbench.models.config import get_config
    from workbench.recipes.hybrid import Hybrid
    cfg = get_config("gpt-tiny")
    ref, x, y = one_adamw_step(cfg, 8)
    torch.manual_seed(0)
    want = build_ref_grad(cfg, x, y)
    s = Hybrid(dp=dp, tp=2, sp=True, microbatches=m)
    s.check(cfg, 8)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, 1e-2, 0.1)
    with wb.trace("a100") as tr:
        s.forward_backward(model, x, y)
        opts[0].finish_gradient_synchronization()        # what step() does first
    grads = [(e.label, e.args["buffer_bytes"], tuple(e.ranks)) for e in tr.events
             if e.name == "all_reduce" and e.label in (
                 "sequence-parallel norm grads", "grad of a replicated input P(sum)->R on tp")]
    emb = cfg.vocab_size * cfg.d_model * 4
    norms = (2 * cfg.n_layer + 1) * 2 * cfg.d_model * 4     # LayerNorms: weight and bias
    tp_groups = [(0, 1), (2, 3)][:dp]
    assert grads == [("sequence-parallel norm grads", emb + norms, g) for g in tp_groups], grads
    w = model.tok_emb.weight
    assert model.lm_head.weight is w                           # still tied
    torch.testing.assert_close(w.grad.full(), want, rtol=1e-5, atol=1e-7)
    s.optimizer_step(opts)
    assert_one_devices_step(ref, model)
    torch.testing.assert_close(w.full(), ref.tok_emb.weight.detach(), rtol=2e-5, atol=5e-6)


def build_ref_grad(cfg, x, y):
    """The tied weight's gradient on one device (the model of one_adamw_step, before it)."""
    from workbench.models.config import build_model
    ref = build_model(cfg, seed=0).train()
    ref(x, y)[1].backward()
    return ref.tok_emb.weight.grad
