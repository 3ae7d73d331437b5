"""Bad sizes and values are refused before any work, with a message naming the argument,
the value and the fix: the schedules, the mesh, ``train`` and the command line (called
in-process: ``main(argv)`` returns 2 and prints ``error: ...``)."""
import math
import re

import pytest
import torch

import workbench as wb
from workbench.cli import main
from workbench.npu.device import is_available as npu_available
from workbench.parallel.schedules import (Schedule, formula_bubble, gpipe, interleaved_1f1b,
                                          one_f_one_b, simulate, zb_h1)
from workbench.parallel.schedules import _check
from workbench.sim_mesh import backends, mesh as mesh_mod
from workbench.train import train

NAN, INF = float("nan"), float("inf")


# ---- schedules ----------------------------------------------------------------------------

@pytest.mark.parametrize("build,text", [
    (lambda: one_f_one_b(10**9, 1), "one_f_one_b(p=1000000000, m=1)"),
    (lambda: gpipe(4, 10**12), "gpipe(p=4, m=1000000000000)"),
    (lambda: interleaved_1f1b(4, 8, 10**9), "interleaved_1f1b(p=4, m=8, v=1000000000)"),
    (lambda: zb_h1(1000, 1000), "zb_h1(p=1000, m=1000): the schedule would hold 3·p·m")])
def test_a_schedule_too_large_is_refused_before_it_is_built(build, text):
    with pytest.raises(ValueError, match="over the limit of 1,000,000") as e:
        build()
    assert text in str(e.value) and "use fewer" in str(e.value)


def test_the_action_limit_is_inclusive(monkeypatch):
    monkeypatch.setattr(_check, "MAX_ACTIONS", 24)
    assert len(one_f_one_b(3, 4)) == 24                  # 2 p m = 24: at the limit
    assert len(zb_h1(2, 4)) == 24                        # 3 p m = 24
    with pytest.raises(ValueError, match="2·p·m = 30 actions"):
        one_f_one_b(3, 5)
    with pytest.raises(ValueError, match="2·p·m·v = 48 actions"):
        interleaved_1f1b(3, 4, 2)


@pytest.mark.parametrize("kw", [dict(f=1e308, b=1e308), dict(f=[1e308, 1e308]),
                                dict(p2p=1e308), dict(b=1e200, w=1e308)])
def test_simulate_refuses_costs_whose_step_overflows(kw):
    """Each cost is finite, but the makespan would be inf and the bubble fraction NaN."""
    with pytest.raises(ValueError, match="larger unit") as e:
        simulate(one_f_one_b(2, 3), **kw)
    arg, val = next(iter(kw.items()))
    assert f"{arg}={val!r}" in str(e.value) or f"{arg}=<list of 2>" in str(e.value)


def test_simulate_keeps_large_costs_that_fit():
    r = simulate(one_f_one_b(2, 3), f=1e300, b=1e300, w=1e300)
    assert math.isfinite(r.makespan) and r.bubble_fraction == pytest.approx(0.25)


@pytest.mark.parametrize("arg", ["f", "b", "w", "p2p"])
@pytest.mark.parametrize("val", [NAN, INF, -1.0])
def test_formula_bubble_refuses_a_cost_that_is_not_finite_and_non_negative(arg, val):
    with pytest.raises(ValueError, match=rf"formula_bubble\({arg}={val!r}\).*e\.g\. {arg}="):
        formula_bubble(one_f_one_b(2, 3), **{arg: val})


def test_formula_bubble_refuses_an_overflowing_step_and_a_wrong_type():
    with pytest.raises(ValueError, match=r"f=1e\+308, b=1e\+308.*overflows"):
        formula_bubble(one_f_one_b(2, 3), f=1e308, b=1e308)
    with pytest.raises(TypeError, match=r"formula_bubble\(f='1'\)"):
        formula_bubble(one_f_one_b(2, 3), f="1")
    with pytest.raises(TypeError, match="formula_bubble.schedule=str.: pass a Schedule"):
        formula_bubble("1f1b")
    assert formula_bubble(one_f_one_b(2, 3), f=[1, 2]) is None          # per-stage: no formula


def test_a_hand_built_schedule_with_a_huge_m_gets_no_formula_at_once():
    """The formula regenerates the named schedule to compare: the size check stops that."""
    fake = Schedule(1, 10**9, 1, ((("F", 0), ("B", 0)),), name="gpipe")
    assert formula_bubble(fake) is None


@pytest.mark.parametrize("rows", [5, None, [2], "F0"])
def test_schedule_rows_that_are_not_lists_are_a_clear_type_error(rows):
    with pytest.raises(TypeError, match="give one row per rank"):
        Schedule(1, 1, 1, rows)
    if not isinstance(rows, str):
        with pytest.raises(TypeError, match=r"Schedule.from_text\(rows=.*one row per rank"):
            Schedule.from_text(rows)


# ---- the mesh -----------------------------------------------------------------------------

def test_mesh_grid_refuses_more_ranks_than_the_limit(monkeypatch):
    with pytest.raises(ValueError, match=r"Mesh.grid\(shape=\(1000000000,\)\): 1,000,000,000 "
                                         r"ranks, over the limit of 131,072"):
        wb.Mesh.grid(10**9)
    monkeypatch.setattr(mesh_mod, "MAX_RANKS", 8)
    assert wb.Mesh.grid((2, 4)).size == 8                # at the limit
    with pytest.raises(ValueError, match="9 ranks"):
        wb.Mesh.grid((3, 3))


def test_mesh_grid_refuses_more_dims_than_the_limit():
    with pytest.raises(ValueError, match=r"Mesh.grid\(shape=<5000 dims>\): at most 64"):
        wb.Mesh.grid((1,) * 5000)
    assert wb.Mesh.grid((1,) * 64).ndim == 64


@pytest.mark.parametrize("start", [True, 2.0, -1, "0"])
def test_mesh_grid_refuses_a_bad_start(start):
    with pytest.raises(ValueError, match=rf"Mesh.grid\(start={start!r}\)"):
        wb.Mesh.grid(4, start=start)


# ---- train() ------------------------------------------------------------------------------

def test_seeds_past_32_bits_repeat_smaller_ones_in_torch():
    """Why --seed stops at 2**32: torch's CPU generator keeps the low 32 bits."""
    draws = []
    for s in (0, 2**32):
        torch.manual_seed(s)
        draws.append(torch.randn(4))
    assert torch.equal(*draws)


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70, True, 1.0])
def test_train_refuses_a_seed_outside_32_bits(seed):
    with pytest.raises(ValueError, match=rf"train: seed={seed!r}: give an int in \[0, 2\*\*32"):
        train("tiny", seed=seed, timing=False)


@pytest.mark.parametrize("kw,given", [
    (dict(batch_size=10**9), "train('tiny', batch_size=1000000000)"),
    (dict(n_layer=10**9), "train('tiny', batch_size=8, n_layer=1000000000)"),
    (dict(seq_len=10**9), "train('tiny', batch_size=8, seq_len=1000000000)"),
    (dict(d_model=10**9), "train('tiny', batch_size=8, d_model=1000000000)")])
def test_train_refuses_a_step_no_machine_holds(kw, given):
    """A closed-form lower bound (no model is built): n_layer=10**9 used to hang."""
    with pytest.raises(ValueError, match="GB of RAM") as e:
        train("tiny", timing=False, **kw)
    assert str(e.value).startswith(given + ": one step needs at least")


def test_min_bytes_is_a_lower_bound_on_the_parameters():
    from workbench.models.config import get_config, param_count
    from workbench.train_checks import min_bytes
    for name in ("tiny", "small", "gpt-tiny", "gpt3-175b"):
        cfg = get_config(name)
        item = torch.empty((), dtype=cfg.torch_dtype).element_size()
        assert 0.6 < min_bytes(cfg, 0) / (4 * item * param_count(cfg).module) <= 1, name


@pytest.mark.parametrize("kw,msg", [(dict(strategy="x"), "train(strategy='x'): give a Strategy"),
                                    (dict(on_step=5), "train(on_step=5): give a function")])
def test_train_refuses_a_strategy_or_callback_of_the_wrong_type(kw, msg):
    with pytest.raises(TypeError, match=re.escape(msg)):
        train("tiny", steps=1, timing=False, **kw)


# ---- the command line ---------------------------------------------------------------------

def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    return err


@pytest.mark.parametrize("flags,msg", [
    (["--seed", str(2**70)], "--seed 1180591620717411303424: give an int in [0, 2**32 - 1]"),
    (["--seed", "-1"], "--seed -1: give an int"),
    (["--seed", str(2**32)], "--seed 4294967296"),
    (["--device", "bogus"], "--device bogus: unknown device; use cpu, cuda"),
    (["--device", "cuda:x"], "--device cuda:x: unknown device"),
    (["--dp", "1000000000"], "--dp 1000000000: at most 8 (--batch-size 8"),
    (["--tp", "5"], "--tp 5: at most 4 (4 heads"),
    (["--pp", "3"], "--pp 3: at most 2 (2 layers"),
    (["--batch-size", "1000000000"], "--batch-size 1000000000: one step needs at least"),
    (["--timeout", "30"], "--timeout 30.0: the collectives' timeout applies to --backend torch"),
    (["--backend", "torch", "--timeout", "0"], "--timeout 0.0: give seconds in (0, 604800]"),
    (["--backend", "torch", "--timeout", "nan"], "--timeout nan: give seconds"),
    (["--backend", "torch", "--timeout", "1e300"], "--timeout 1e+300: give seconds"),
    (["--dry-run", "--seed", "-1"], "--seed -1"),
    (["--dry-run", "--dp", "1000000000"], "--dp 1000000000: at most 8"),
])
def test_train_flags_are_refused_before_any_work(flags, msg, capsys):
    assert msg in _refused(["train", "--preset", "tiny", *flags], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(capsys):
    err = _refused(["train", "--device", "cuda"], capsys)
    assert "--device cuda: torch.cuda.is_available() is False" in err and "--device cpu" in err


@pytest.mark.skipif(npu_available(), reason="this machine has an Ascend NPU")
def test_device_npu_without_torch_npu(capsys):
    err = _refused(["train", "--device", "npu"], capsys)
    assert "--device npu: torch_npu" in err and "--device cpu" in err


def test_timeout_reaches_the_process_group(monkeypatch, capsys):
    """--timeout SECONDS is wb.distributed.init's timeout_s (checked up to init; a real
    2-process torchrun gave both ranks' groups 0:00:30)."""
    seen = []

    def init(**kw):
        seen.append(kw)
        raise RuntimeError("stopped before torch.distributed")
    monkeypatch.setattr(backends, "init", init)
    _refused(["train", "--backend", "torch", "--timeout", "30"], capsys)
    _refused(["train", "--backend", "torch"], capsys)
    assert seen == [{"timeout_s": 30.0}, {}]


@pytest.mark.parametrize("t", [True, 0, -1, NAN, INF, 1e300])
def test_distributed_init_refuses_a_bad_timeout(t):
    with pytest.raises(ValueError, match=re.escape(f"init(timeout_s={t!r}): give a number of")):
        backends.init(timeout_s=t)


@pytest.mark.parametrize("flags,msg", [
    (["--devices", str(10**12)], "--devices 1000000000000: give an int in [1, 131,072]"),
    (["--global-batch", str(10**12)], "--global-batch 1000000000000: give an int in [1, "),
    (["--global-batch", "0"], "--global-batch 0"), (["--top", "0"], "--top 0"),
    (["--max-micro-batch", str(10**9)], "--max-micro-batch 1000000000")])
def test_plan_sizes_are_refused_before_the_search(flags, msg, capsys):
    assert msg in _refused(["plan", *flags], capsys)


def test_course_without_its_notebooks_folder(capsys, tmp_path):
    err = _refused(["course", "student", "--notebooks", str(tmp_path / "none"),
                    "--out", str(tmp_path / "out")], capsys)
    assert "--notebooks" in err and "no such folder" in err
    assert not (tmp_path / "out").exists()
