"""Dropout under every layout draws one device's mask for its slice: `train` keys each
mask by (step, call), so TP, SP, PP (any schedule), DP and ZeRO give one device's
losses with dropout on, recompute included."""
import pytest
import torch

from workbench.recipes.hybrid import Hybrid
from workbench.sim_mesh import rng
from workbench.train import train

KW = dict(n_layer=4, dropout=0.1)


@pytest.fixture(scope="module")
def one_device():
    return [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False, **KW)]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(tp=2, sp=True),
                                    dict(dp=2, tp=2, pp=2),
                                    dict(dp=2, pp=2, zero=3, schedule="zb-h1"),
                                    dict(tp=2, pp=2, schedule="interleaved")],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_every_layout_gives_one_devices_losses_with_dropout(layout, one_device):
    got = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False,
                                    strategy=Hybrid(**layout), **KW)]
    assert got == pytest.approx(one_device, rel=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_redraws_the_same_masks(mode, one_device):
    got = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False, recompute=mode,
                                    strategy=Hybrid(tp=2, pp=2), **KW)]
    assert got == pytest.approx(one_device, rel=1e-6)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2), dict(tp=2, sp=True),
                                    dict(dp=2, zero=3), dict(tp=2, recompute="full"),
                                    dict(tp=2, recompute="selective")],
                         ids=lambda d: " ".join(f"{k}={v}" for k, v in d.items()))
def test_gpt_with_dropout_gives_one_devices_losses(layout):
    """GPT's dropouts once called F.dropout without a site: under train's keyed masks every
    Hybrid layout failed ("a keyed dropout call outside `with site(k)`")."""
    layout = dict(layout)
    recompute = layout.pop("recompute", None)
    kw = dict(steps=2, seed=0, batch_size=4, timing=False, dropout=0.1, recompute=recompute)
    want = [r["loss"] for r in train("gpt-tiny", **kw)]
    got = [r["loss"] for r in train("gpt-tiny", strategy=Hybrid(**layout), **kw)]
    assert got == pytest.approx(want, rel=1e-6)
    # the masks are drawn: without dropout the losses differ
    assert [r["loss"] for r in train("gpt-tiny", **dict(kw, dropout=0.0))] != want


def test_a_keyed_mask_is_the_whole_batchs_rows():
    with rng.keyed(7), rng.site(3):
        whole = rng.draw_mask((8, 5), 0.5)
        with rng.rows(4, 8):
            part = rng.draw_mask((2, 5), 0.5)
    assert torch.equal(part, whole[4:6])
    with rng.keyed(7), rng.site(4):
        assert not torch.equal(rng.draw_mask((8, 5), 0.5), whole)      # another call
    state = torch.get_rng_state()
    with rng.keyed(7), rng.site(3):
        rng.draw_mask((8, 5), 0.5)
    assert torch.equal(torch.get_rng_state(), state)                    # global RNG untouched


def test_a_keyed_call_without_a_site_is_an_error():
    with rng.keyed(1), pytest.raises(RuntimeError, match="site"):
        rng.draw_mask((2, 2), 0.5)


@pytest.mark.slow
def test_on_torch_distributed_too(one_device, tmp_path_factory):
    import json

    from tests.torchrun_support import four_proc
    out, text = four_proc(tmp_path_factory, "dropout_check.py")   # one launch: 4-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(text.strip().splitlines()[-1])
    assert got == pytest.approx(one_device, rel=1e-6)
