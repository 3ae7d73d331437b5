"""par9: expert, context and pipeline parallelism probed against one device (values and
gradients in float32), for silent wrong answers and unclear errors.  Each test here
failed before its fix."""
import pytest
import torch

from workbench.models import build_model, get_batch, get_config
from workbench.ops.moe import router_topk
from workbench.recipes import Hybrid
from workbench.train import train


# ---- MoE: a renormalised top-1 gate is exactly 1, its gradient exactly 0 ----------------------

@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_top1_renormalised_gate_has_torchs_exactly_zero_gradient(gating):
    """p_i / sum of the k chosen is softmax over the chosen logits (Mixtral; Megatron-LM's
    topk then softmax): torch's softmax of one element gives a gate of 1 and a gradient of
    exactly 0.  ``top / top.sum()`` left rounding (6e-8 on these logits), the only
    gradient the router of a top-1 layer without aux loss gets."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, 4, generator=g, requires_grad=True)
    w, e, _, _ = router_topk(z, 1, gating)
    (w * torch.randn(w.shape, generator=g)).sum().backward()
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(z.grad, torch.zeros_like(z))
    # k = 2 still the renormalised probabilities (the same numbers as before, to rounding)
    w2, e2, _, _ = router_topk(z.detach(), 2, gating)
    score = torch.softmax(z.detach(), -1) if gating == "softmax" else torch.sigmoid(z.detach())
    top = score.gather(-1, e2)
    torch.testing.assert_close(w2, top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_top1_router_without_aux_loss_gets_no_gradient_and_layouts_agree():
    """A top-1 MoE model with no aux loss: the router's gradient is exactly zero on one
    device (was 3e-11 of rounding, which AdamW's normalised step made into router moves of
    ~lr/300 a step, different on each layout: one device and Hybrid(dp=4) or
    Hybrid(ep=4) 1e-4 apart in the second step's loss)."""
    cfg = get_config("tiny").replace(n_layer=2, dropout=0.1, moe_experts=4, moe_topk=1,
                                     moe_capacity_factor=None, moe_aux_loss_coef=0.0)
    model = build_model(cfg, seed=0).train()
    x, y = get_batch(cfg, 8, 0, 0)
    model(x, y)[1].backward()
    for block in model.layers:
        assert torch.equal(block.mlp.router.weight.grad,
                           torch.zeros_like(block.mlp.router.weight))
    ref = [r["loss"] for r in train(cfg, steps=2, timing=False)]
    got = [r["loss"] for r in train(cfg, steps=2, timing=False, strategy=Hybrid(ep=4))]
    assert got == pytest.approx(ref, abs=2e-6)
