"""The planner's per-layer activation bytes against what autograd really saves in one
block of the real GPT model (models/gpt.py), on one device, in bfloat16."""
import pytest
import torch

from workbench.models import get_config
from workbench.models.gpt import GPTBlock
from workbench.parallel.strategies.memory import saved_activation_bytes
from workbench.plan.memory import layer_activation_bytes


@pytest.mark.parametrize("dropout, recompute", [
    (0.0, "none"), (0.0, "selective"), (0.0, "full"), (0.1, "selective"), (0.1, "full")])
def test_block_saves_what_the_planner_counts(dropout, recompute):
    cfg = get_config("gpt-tiny", dtype="bfloat16", dropout=dropout, recompute=recompute)
    s, b, h = cfg.seq_len, 2, cfg.d_model
    block = GPTBlock(cfg).train()
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    _, rep = saved_activation_bytes(block, x, params=[*block.parameters(), x])
    # x is the block's input, excluded above as a model input; the planner (Table 2)
    # counts it as the first LayerNorm's input (or, under full recompute, the checkpoint)
    measured = rep.bytes + 2 * s * b * h
    # What the planner leaves out, each exactly: LayerNorm's saved mean and 1/std (two
    # LayerNorms, s b values each, in bfloat16), and torch's dropout masks, which take 2
    # bytes per element where Table 2 counts 1 (two residual dropouts of s b h).
    extra = 0
    if recompute != "full":
        extra += 2 * 2 * s * b * 2
        extra += 2 * s * b * h if dropout else 0
    want = layer_activation_bytes(cfg, b, 1, False, recompute, attention="flash")
    assert measured == want + extra, (rep.items, want, extra)
