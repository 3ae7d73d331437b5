"""`python -m workbench train --moe-experts E --moe-topk k --ep N`: one device's losses on
simulated ranks and under torchrun (gloo, 4 processes); bad flags refused with the fix."""
import json

import pytest

from tests.torchrun_support import four_proc, json_rows
from workbench.cli import main

MOE = ["--preset", "tiny", "--steps", "2", "--moe-experts", "4", "--moe-topk", "2"]


def _losses(capsys, *flags):
    assert main(["train", *MOE, *flags]) == 0
    return [json.loads(s)["loss"] for s in capsys.readouterr().out.splitlines()]


def test_ep_flags_print_one_devices_losses(capsys):
    one = _losses(capsys)
    assert len(one) == 2
    for flags in (["--ep", "2", "--dp", "2"], ["--ep", "2", "--tp", "2"]):
        assert _losses(capsys, *flags) == pytest.approx(one, rel=1e-6), flags


@pytest.mark.parametrize("flags,msg", [
    (["--moe-topk", "5"], "moe_topk=5 > moe_experts=4"),
    (["--ep", "3", "--batch-size", "6"], "ep=3 does not divide moe_experts=4"),
    (["--ep", "2", "--zero", "3"], "use zero=1 or 2"),
    (["--ep", "2", "--moe-experts", "0"], "ep=2 needs a mixture-of-experts model"),
    (["--ep", "4", "--dp", "4"], "batch_size=8 over dp=4 x ep=4 = 16 data-parallel ranks"),
    (["--moe-experts", "0", "--moe-gating", "sigmoid"], "--moe-gating applies to a "
                                                         "mixture-of-experts model")])
def test_bad_moe_flags_are_refused_with_the_fix(flags, msg, capsys):
    assert main(["train", *MOE, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


def test_torchrun_ep_prints_one_devices_losses(capsys, tmp_path_factory):
    """...and the simulated ranks' modeled step and bytes: under torchrun the expert GEMMs
    were missing from the modeled clock (each process knew its own rows only), 0.173 ms a
    step for the simulator's 0.193 (auditmoe); with tp, f's input-gradient all-reduce was
    recorded blocking after the wgrad, not beside it as on the simulated ranks: ep 2 x tp 2
    0.2056 ms for 0.2035 (tdclock; failed before)."""
    one = _losses(capsys)
    assert main(["train", *MOE, "--seed", "0", "--ep", "2", "--tp", "2"]) == 0
    sim = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    # one launch: every 4-process part (torchrun_support.FOUR_PROC)
    out, text = four_proc(tmp_path_factory, " ".join(
        ["-m", "workbench", "train", *MOE, "--seed", "0", "--backend", "torch", "--ep", "2",
         "--tp", "2"]))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["loss"] for r in rows] == pytest.approx(one, rel=1e-6)
    for key in ("modeled_ms", "comm_bytes"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in sim], rel=1e-9), key


def test_step_records_report_aux_loss_and_drops_on_every_layout():
    from workbench.models import build_model, get_config
    from workbench.models.data import get_batch
    from workbench.recipes import Hybrid
    from workbench.train import train
    cfg = get_config("tiny", moe_experts=4, moe_topk=2, moe_capacity_factor=0.5)
    one = train(cfg, steps=1, timing=False)[0]
    # the first step's routing, by hand: the model as initialised, batch 0
    model = build_model(cfg)
    model(*get_batch(cfg, 8, 0, 0))
    stats = [b.mlp.last_stats for b in model.layers]
    assert one["moe_dropped"] == sum(s["dropped"] for s in stats) > 0
    assert one["moe_aux_loss"] == pytest.approx(sum(s["aux_loss"] for s in stats), rel=1e-6)
    ep = train(cfg, steps=1, timing=False, strategy=Hybrid(ep=2, dp=2))[0]
    assert ep["moe_dropped"] == one["moe_dropped"]
    assert ep["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], rel=1e-5)
    pp = train(cfg, steps=1, timing=False, strategy=Hybrid(pp=2))[0]   # every micro-batch
    assert pp["moe_dropped"] == one["moe_dropped"]                       # (moepp11)
    assert pp["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], rel=1e-5)
