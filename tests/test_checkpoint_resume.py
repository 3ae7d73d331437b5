"""Resume: 3 steps, save, then 2 more steps (``--resume``) give the losses of 5 steps in
one run: bitwise on the same layout, to float rounding on another (dp2 x tp2 to tp 2,
pp 2, one device; ZeRO-1 and ZeRO-3 optimizer states carried over); the model and
optimizer states after resuming equal the uninterrupted run's."""
import json

import pytest
import torch

import workbench as wb
from workbench.checkpoint.training import optimizer_states
from workbench.cli import main
from workbench.recipes.hybrid import Hybrid
from workbench.train import SingleDevice, train

KW = dict(seed=0, batch_size=8, timing=False)


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def five():
    """The uninterrupted 5-step run at dp 2 x tp 2 (ZeRO-1)."""
    return losses(train("tiny", steps=5, strategy=Hybrid(dp=2, tp=2, zero=1), **KW))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "step3"
    first = train("tiny", steps=3, strategy=Hybrid(dp=2, tp=2, zero=1), save=str(d), **KW)
    return d, losses(first)


def test_resume_on_the_same_layout_gives_the_same_losses_bitwise(saved, five):
    d, first = saved
    rest = train("tiny", steps=5, strategy=Hybrid(dp=2, tp=2, zero=1), resume=str(d), **KW)
    assert [r["step"] for r in rest] == [3, 4]
    assert first + losses(rest) == five


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2, zero=3, dp=2), None],
                         ids=["tp2", "dp2-pp2-zero3", "one-device"])
def test_resume_on_another_layout_gives_the_same_losses(saved, five, layout):
    d, first = saved
    strategy = SingleDevice() if layout is None else Hybrid(**layout)
    rest = train("tiny", steps=5, strategy=strategy, resume=str(d), **KW)
    got = first + losses(rest)
    assert got[:3] == five[:3]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(five), rtol=1e-6, atol=0)
    assert got[3:] != [0.0, 0.0]


def states_after(strategy, steps, **kw):
    """The model's full parameters and the optimizer's states after ``steps`` steps."""
    out = {}

    def grab(model, opt):
        sd = {k: (v.full() if isinstance(v, wb.DistTensor) else v).clone()
              for k, v in model.state_dict().items()}
        st = {k: {s: (v.full() if isinstance(v, wb.DistTensor) else v)
                  for s, v in d.items()} for k, d in optimizer_states(strategy, model,
                                                                      opt).items()}
        out.update(model=sd, optim=st)
    real = strategy.optimizer_step

    def step_and_grab(opt):
        real(opt)
        grab(strategy._model, opt)
    build = strategy.build_model

    def keep(cfg, seed):
        strategy._model = build(cfg, seed)
        return strategy._model
    strategy.build_model, strategy.optimizer_step = keep, step_and_grab
    train("tiny", steps=steps, strategy=strategy, **KW, **kw)
    return out


def test_resumed_states_equal_the_uninterrupted_runs(saved):
    d, _ = saved
    a = states_after(Hybrid(dp=2, tp=2, zero=1), 5)
    b = states_after(Hybrid(tp=2, zero=0), 5, resume=str(d))
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-5, atol=1e-6, msg=k)
    assert a["optim"].keys() == b["optim"].keys() and len(a["optim"]) > 5
    for k in a["optim"]:
        assert b["optim"][k]["step"] == a["optim"][k]["step"] == 5
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b["optim"][k][s], a["optim"][k][s], rtol=1e-4,
                                       atol=1e-9, msg=f"{k} {s}")


def test_a_dp2_tp2_pp2_model_loads_into_tp2_reading_only_its_shards(tmp_path):
    from workbench.models.config import get_config
    cfg = get_config("tiny")
    big = Hybrid(dp=2, tp=2, pp=2)
    wb.checkpoint.save(tmp_path, {"model": big.build_model(cfg, 0).state_dict()})
    small = Hybrid(tp=2)
    model = small.build_model(cfg, 1)
    sd = model.state_dict()
    rep = wb.checkpoint.load(tmp_path, {"model": sd})
    ref = big.build_model(cfg, 0).state_dict()
    for k, v in sd.items():
        assert torch.equal(v.full() if isinstance(v, wb.DistTensor) else v,
                           ref[k].full() if isinstance(ref[k], wb.DistTensor) else ref[k]), k
    # a column-parallel weight: tp rank k reads the pieces the ranks with tp index k wrote
    for key, stage in (("layers.0.attn.wq.weight", 0), ("layers.1.mlp.w1.weight", 1)):
        assert sd[key].placements == (wb.Replicate(), wb.Shard(0))
        for r in (0, 1):        # stage s of dp2 x tp2 x pp2: ranks 4s + (dp, tp) = 4s + 2dp + tp
            assert rep.files(r) >= {f"__{4 * stage + r}_g0.distcp"}
            assert [f for f, _ in rep.pieces(r, "model." + key)] == \
                [f"__{4 * stage + r}_g0.distcp"], (key, r)
    assert rep.bytes(0) < sum(v.numel() * 4 for v in ref.values()
                              if isinstance(v, wb.DistTensor))


def cli(argv, capsys):
    assert main(argv) == 0, capsys.readouterr().err
    return [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]


def test_cli_save_and_resume(tmp_path, capsys):
    base = ["train", "--preset", "tiny", "--seed", "1"]
    whole = cli(base + ["--steps", "4", "--tp", "2"], capsys)
    first = cli(base + ["--steps", "2", "--tp", "2", "--save", str(tmp_path)], capsys)
    rest = cli(base + ["--steps", "4", "--tp", "2", "--resume", str(tmp_path)], capsys)
    assert first + rest == whole


def test_cli_refuses_a_resume_that_would_not_continue_the_run(tmp_path, capsys):
    train("tiny", steps=1, save=str(tmp_path), **KW)
    assert main(["train", "--steps", "2", "--seed", "3", "--resume", str(tmp_path)]) == 2
    assert "saved with --seed 0, this one has 3" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--resume", str(tmp_path / "none")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_under_torchrun_on_another_layout(tmp_path_factory):
    """2 gloo processes: dp 2 (ZeRO-1) saved, resumed on tp 2; pp 2 (each process saves
    its stage) resumed on dp 2 with ZeRO-2; dp 2 (ZeRO-3) resumed on tp 2; all give the
    uninterrupted run's losses."""
    from tests.torchrun_support import json_rows, two_proc
    out, text = two_proc(tmp_path_factory, "resume_check.py {dir}")   # one launch: 2-process parts
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json_rows(text)
    assert len(row["whole"]) == 4
    assert row["dp2_then_tp2"][:2] == row["whole"][:2]       # the same layout: bitwise
    for key in ("dp2_then_tp2", "pp2_then_zero2", "zero3_then_tp2"):
        torch.testing.assert_close(torch.tensor(row[key]), torch.tensor(row["whole"]),
                                   rtol=1e-6, atol=0, msg=key)


def test_resume_refuses_another_lr_or_weight_decay(tmp_path, capsys):
    """As Megatron-LM's scheduler asserts the class and checkpoint values agree (torch's
    optimizer.load_state_dict would silently keep the saved lr, a fresh one the new)."""
    train("tiny", steps=1, save=str(tmp_path), lr=1e-3, **KW)
    for kw, name in ((dict(lr=2e-3), "lr=0.001"), (dict(lr=1e-3, weight_decay=0.1),
                                                   "weight_decay=0.01")):
        with pytest.raises(ValueError, match=f"saved with {name}.*start a new run"):
            train("tiny", steps=2, resume=str(tmp_path), **kw, **KW)
    assert len(train("tiny", steps=2, resume=str(tmp_path), lr=1e-3, **KW)) == 1
    assert main(["train", "--steps", "2", "--lr", "0.002", "--resume", str(tmp_path)]) == 2
    assert "saved with --lr 0.001, this one has 0.002" in capsys.readouterr().err
