"""Adversarial pipeline-parallel checks (pipe7): each held to one device's training loop."""
import pytest
import torch

import workbench as wb
from workbench.models import build_model, get_batch, get_config
from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh import rng

LR = 3e-3


def _full(model):
    return {k: (v.full() if isinstance(v, wb.DistTensor) else v).detach()
            for k, v in model.state_dict().items()}


def _steps(cfg, batch, steps, strategy=None):
    """Losses and parameters after ``steps`` AdamW steps: one device (``strategy`` None,
    plain torch) or ``strategy``'s; dropout masks keyed per step as ``wb.train`` keys them."""
    torch.manual_seed(0)
    if strategy is None:
        model = build_model(cfg, seed=0).train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    else:
        model = strategy.build_model(cfg, 0)
        opt = strategy.build_optimizer(model, LR, 0.01)
    losses = []
    for step in range(steps):
        x, y = get_batch(cfg, batch, 0, step)
        with rng.keyed(1000 + step):
            if strategy is None:
                loss = model(x, y)[1]
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                loss = strategy.forward_backward(model, x, y)
                strategy.optimizer_step(opt)
        losses.append(float(loss))
    return losses, _full(model)


@pytest.mark.parametrize("kw", [dict(pp=3), dict(pp=3, dp=2, zero=3, microbatches=3),
                                dict(pp=3, dp=2, zero=1, microbatches=3, schedule="zb-h1")],
                         ids=["1f1b", "dp2-zero3", "dp2-zero1-zbh1"])
def test_an_empty_middle_stage_trains_as_one_device(kw):
    # stage_sizes=[2, 0, 2]: the middle stage holds no layer and no parameter; its
    # optimizer_step raised "DataParallel.step(): no parameter has a gradient" (ZeRO-3:
    # "the module has none") on every step, though its forward passed the activations on
    cfg = get_config("tiny").replace(n_layer=4, dropout=0.1)
    want_losses, want = _steps(cfg, 6, 2)
    got_losses, got = _steps(cfg, 6, 2, Hybrid(stage_sizes=[2, 0, 2], **kw))
    assert got_losses == pytest.approx(want_losses, abs=1e-5)
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, atol=1e-4, rtol=0, msg=name)


def test_dualpipe_with_too_few_micro_batches_given_names_microbatches_not_the_batch():
    # was: "use a batch_size that divides by dp x 2 pp = 4 (got batch_size=8)": 8 does
    with pytest.raises(ValueError, match=r"Hybrid\(microbatches=2\).*needs an even number "
                       r">= 2 pp = 4; give Hybrid\(microbatches=4\)") as e:
        Hybrid(pp=2, schedule="dualpipe", microbatches=2).check(get_config("tiny"), 8)
    assert "batch_size" not in str(e.value)


def test_tied_embeddings_in_virtual_stages_on_one_rank_do_not_advise_pp1():
    # pp=1 with the interleaved schedule (2 chunks): was "tie_embeddings=True with pp > 1
    # ... use pp=1", with pp already 1
    cfg = get_config("tiny").replace(tie_embeddings=True)
    with pytest.raises(NotImplementedError, match=r"schedule='interleaved' and 2 model chunks "
                       r"on one rank \(pp=1\).*schedule='1f1b'") as e:
        Hybrid(pp=1, schedule="interleaved").check(cfg, 8)
    assert "use pp=1" not in str(e.value)


def test_an_empty_middle_stage_saves_and_resumes_its_neighbours_optimizers(tmp_path):
    # ZeRO-3 with stage_sizes=[2, 0, 2]: the checkpoint paired the stages with the
    # optimizers in order, so the empty stage took the last stage's (IndexError on its
    # modules); resumed on one device and on the same layout, the losses are one device's
    from workbench.train import train
    cfg = get_config("tiny").replace(n_layer=4)
    want = [r["loss"] for r in train(cfg, steps=2, timing=False, batch_size=6)]
    lay = dict(pp=3, stage_sizes=[2, 0, 2], dp=2, zero=3, microbatches=3)
    first = train(cfg, steps=1, timing=False, batch_size=6, strategy=Hybrid(**lay),
                  save=str(tmp_path / "ck"))
    for strategy in (None, Hybrid(**lay)):
        then = train(cfg, steps=2, timing=False, batch_size=6, strategy=strategy,
                     resume=str(tmp_path / "ck"))
        assert [first[0]["loss"], then[0]["loss"]] == pytest.approx(want, abs=1e-5)


def test_zb_v_with_fewer_micro_batches_than_ranks_is_refused_by_check_naming_microbatches():
    # was raised from inside forward_backward as "zb_v(p=2, m=1): ... use m >= p"
    with pytest.raises(ValueError, match=r"Hybrid\(microbatches=1\) with schedule='zb-v' and "
                       r"pp=2: .*give Hybrid\(microbatches=2\)"):
        Hybrid(pp=2, schedule="zb-v", microbatches=1).check(
            get_config("tiny").replace(n_layer=4), 8)
