"""`python -m workbench train`: every flag value no run can take is refused up front
(`error: ...`, exit code 2); combinations that run give one device's losses."""
import pytest

from workbench.cli import main
from workbench.recipes.hybrid import Hybrid
from workbench.train import train


@pytest.mark.parametrize("flags,msg", [
    (["--steps", "-1"], "--steps -1"), (["--batch-size", "0"], "--batch-size 0"),
    (["--lr", "nan"], "--lr nan"), (["--lr", "-1"], "--lr -1"), (["--lr", "inf"], "--lr inf"),
    (["--weight-decay", "-1"], "--weight-decay -1"), (["--weight-decay", "nan"], "nan"),
    (["--dp", "0"], "--dp 0"), (["--tp", "-2"], "--tp -2"),
    (["--dp", "2", "--device", "cuda"], "--device cuda"),
    (["--sp"], "sp=True needs tp > 1"),
    (["--pp", "2", "--schedule", "interleaved"], "do not divide n_layer")])
def test_bad_flags_are_refused_with_exit_code_2(flags, msg, capsys):
    assert main(["train", "--preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


@pytest.mark.parametrize("kw", [dict(lr=float("nan")), dict(weight_decay=-0.5), dict(steps=-1),
                                dict(batch_size=0)])
def test_train_refuses_the_same_values(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        train("tiny", timing=False, **kw)


def test_zero_bubble_with_zero_3_gives_one_devices_losses():
    """zb-h1 computes weight gradients apart (W): with ZeRO-3 they are the dp shards'."""
    one = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False)]
    got = [r["loss"] for r in train("tiny", steps=2, seed=0, timing=False,
                                    strategy=Hybrid(dp=2, pp=2, zero=3, schedule="zb-h1"))]
    assert got == pytest.approx(one, rel=1e-5)
