"""One pipeline stage, a tied GPT head: after training under Hybrid, ``model(idx)`` (which
calls ``lm_head``) gives one device's logits; the head once kept the plain parameter,
untrained, while ``stage_forward`` read the embedding's table."""
import pytest
import torch

import workbench as wb
from workbench.recipes.hybrid import Hybrid
from workbench.train import SingleDevice, train

IDX = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(0))


def trained(strategy, steps=2):
    build = strategy.build_model

    def keep(cfg, seed):
        strategy._model = build(cfg, seed)
        return strategy._model
    strategy.build_model = keep
    train("gpt-tiny", steps=steps, seed=0, batch_size=4, timing=False, strategy=strategy)
    return strategy._model


@pytest.fixture(scope="module")
def one_device_logits():
    model = trained(SingleDevice())
    with torch.no_grad():
        return model(IDX)[0]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2, zero=1), dict(dp=2, tp=2),
                                    dict(dp=2, zero=3)],
                         ids=["tp2", "dp2-zero1", "dp2-tp2", "dp2-zero3"])
def test_model_forward_after_hybrid_gives_one_devices_logits(one_device_logits, layout):
    h = Hybrid(**layout)
    model = trained(h)
    if h.zero != 3:         # (ZeRO-3's hooks swap gathered copies into the modules)
        assert model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        out = model(wb.shard_tensor(IDX, h.meshes[0], [wb.Shard(0), wb.Replicate()]))[0]
    torch.testing.assert_close(out.full(), one_device_logits, rtol=1e-4, atol=1e-5)
