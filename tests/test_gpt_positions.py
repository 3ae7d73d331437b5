"""The GPT's learned positions looked up per token, (b, s) laid out as the ids (Megatron-LM's
``position_ids``; ``Hybrid._positions``), not as one (s,) lookup broadcast over a batch sharded
on dp, whose output was a replicated input: its gradient was all-reduced over dp in backward
(one s x h all-reduce a micro-batch, "grad of a replicated input P(sum)->R on dp" on the
trace; 13.5 us a micro-batch for the GPT of tests/test_ringfwd.py at dp 2 cp 4).  Now the
table's gradient is each rank's, summed by the data-parallel reduction with the others."""
import pytest
import torch

import workbench as wb
from workbench.models import get_batch, get_config
from workbench.recipes.context_parallel import ContextParallel
from workbench.recipes.hybrid import Hybrid
from workbench.train import train

KW = dict(steps=2, seed=0, batch_size=4, timing=False)


@pytest.mark.parametrize("strategy", [lambda: Hybrid(dp=2), lambda: Hybrid(dp=2, tp=2),
                                      lambda: ContextParallel(cp=2, dp=2)],
                         ids=["dp2", "dp2-tp2", "dp2-cp2"])
def test_no_all_reduce_of_the_position_gradient_and_one_devices_losses(strategy):
    s = strategy()
    cfg = get_config("gpt-tiny")
    model = s.build_model(cfg, seed=0)
    s.build_optimizer(model, lr=1e-3, weight_decay=0.0)    # the parameters' reduction
    tokens, targets = get_batch(cfg, 4, seed=0, step=0)
    with wb.trace("a100") as tr:
        s.forward_backward(model, tokens, targets)
    assert not [e for e in tr.collectives() if "replicated input" in e.label], \
        sorted({e.label for e in tr.collectives()})
    got = [r["loss"] for r in train("gpt-tiny", strategy=strategy(), **KW)]
    want = [r["loss"] for r in train("gpt-tiny", **KW)]
    assert got == pytest.approx(want, rel=1e-6)


def test_positions_are_laid_out_as_the_ids():
    s = Hybrid(dp=2)
    ids = s._batch(torch.zeros(4, 8, dtype=torch.long), s.meshes[0])
    pos = Hybrid._positions(ids)
    assert pos.placements == ids.placements and pos.dtype == ids.dtype
    torch.testing.assert_close(pos.full(), torch.arange(8).expand(4, 8))
    order = torch.tensor([0, 7, 1, 6, 2, 5, 3, 4])
    torch.testing.assert_close(Hybrid._positions(ids, order).full(), order.expand(4, 8))
