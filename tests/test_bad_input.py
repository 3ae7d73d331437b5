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


# ---- the recipes' and strategies' constructors --------------------------------------------

from torch import nn  # noqa: E402

from workbench.models.config import get_config  # noqa: E402
from workbench.ops import AdamW as WbAdamW  # noqa: E402
from workbench.parallel.strategies.data_parallel import DataParallel  # noqa: E402
from workbench.parallel.strategies.zero3 import Zero3  # noqa: E402
from workbench.recipes.hybrid import Hybrid  # noqa: E402
from workbench.sim_mesh.mesh import MAX_RANKS  # noqa: E402


@pytest.mark.parametrize("kw,err,msg", [
    (dict(dp=True), ValueError, "Hybrid(dp=True): give an int >= 1"),
    (dict(tp=2.0), ValueError, "Hybrid(tp=2.0): give an int >= 1"),
    (dict(pp=0), ValueError, "Hybrid(pp=0): give an int >= 1"),
    (dict(zero=7), ValueError, "Hybrid(zero=7): give the ZeRO stage, 0"),
    (dict(zero=True), ValueError, "Hybrid(zero=True): give the ZeRO stage"),
    (dict(microbatches=0), ValueError, "Hybrid(microbatches=0): give an int >= 1, or None"),
    (dict(microbatches=True), ValueError, "Hybrid(microbatches=True): give an int >= 1"),
    (dict(virtual=0), ValueError, "Hybrid(virtual=0): give an int >= 1, or None"),
    (dict(pp=2, virtual=2), ValueError, "Hybrid(virtual=2) with schedule='1f1b': model "
                                        "chunks per rank need the interleaved schedule"),
    (dict(tp=2, sp="yes"), TypeError, "Hybrid(sp='yes'): give True or False"),
    (dict(sp=True), ValueError, "sp=True needs tp > 1"),
    (dict(distributed=1), TypeError, "Hybrid(distributed=1): give True or False"),
    (dict(schedule=["1f1b"]), ValueError, "Hybrid(schedule=['1f1b']): use one of"),
    (dict(dp=10**9), ValueError, "Hybrid(dp=1000000000, tp=1, pp=1): 1,000,000,000 ranks, "
                                 "over the limit of 131,072"),
    (dict(tp=10**9), ValueError, "Hybrid(dp=1, tp=1000000000, pp=1): 1,000,000,000 ranks"),
    (dict(pp=10**9), ValueError, "Hybrid(dp=1, tp=1, pp=1000000000): 1,000,000,000 ranks"),
    (dict(dp=2**9, tp=2**9), ValueError, "Hybrid(dp=512, tp=512, pp=1): 262,144 ranks")])
def test_hybrid_refuses_bad_arguments_before_building_a_mesh(kw, err, msg):
    """dp=10**9 hung building the meshes; the rest were accepted silently (microbatches=0
    and virtual=0 fell back to the defaults, zero=7 trained as zero=0)."""
    with pytest.raises(err, match=re.escape(msg)):
        Hybrid(**kw)


def test_hybrid_takes_the_largest_world_the_mesh_takes(monkeypatch):
    assert MAX_RANKS == 2**17
    monkeypatch.setattr(mesh_mod, "MAX_RANKS", 8)      # the bound is read when checked
    assert sum(m.size for m in Hybrid(dp=2, tp=2, pp=2).meshes) == 8
    with pytest.raises(ValueError, match=re.escape("Hybrid(dp=3, tp=3, pp=1): 9 ranks, over "
                                                   "the limit of 8")):
        Hybrid(dp=3, tp=3)


@pytest.mark.parametrize("kw,msg", [
    (dict(dp=16), "dp=16: at most 8 (batch_size=8: every data-parallel rank takes at least "
                  "one sequence); raise batch_size or lower dp"),
    (dict(tp=8), "tp=8: at most 4 (4 heads in the model: tensor parallelism splits the heads)"),
    (dict(pp=4), "pp=4: at most 2 (2 layers in the model"),
    (dict(dp=2, pp=2, microbatches=8), "microbatches=8: at most batch_size // dp = 4")])
def test_hybrid_check_bounds_the_sizes_by_the_model_and_batch(kw, msg):
    """The same bounds as the train command line's (train_checks.check_sizes)."""
    with pytest.raises(ValueError, match=re.escape(msg)):
        Hybrid(**kw).check(get_config("tiny"), 8)


def test_train_with_a_hybrid_too_wide_for_the_batch_is_refused_before_any_step():
    seen = []
    with pytest.raises(ValueError, match=re.escape("dp=16: at most 8")):
        train("tiny", steps=1, batch_size=8, strategy=Hybrid(dp=16), timing=False,
              on_step=seen.append)
    assert seen == []


def test_dry_run_refuses_more_ranks_than_a_mesh_holds(capsys):
    err = _refused(["train", "--preset", "tiny", "--dry-run", "--batch-size", "1000000",
                    "--dp", "200000"], capsys)
    assert "--dp 200000 --tp 1 --pp 1: 200,000 ranks, over the limit of 131,072" in err


def _dp_mesh():
    return wb.Mesh.grid((2, 2), ["dp", "tp"])


def _tp_linear(mesh):
    torch.manual_seed(0)
    return wb.parallelize(nn.Linear(4, 4), mesh, {}, mesh_dim="tp")


@pytest.mark.parametrize("kw,msg", [
    (dict(zero=True), "zero=True: use 0 (plain data parallel), 1, 2 or 3"),
    (dict(zero=1.0), "zero=1.0: use 0"),
    (dict(bucket_bytes="8"), "bucket_bytes='8': give a size > 0 in bytes"),
    (dict(lr=-1.0), "AdamW(lr=-1.0): give a real number finite and >= 0"),
    (dict(lr=NAN), "AdamW(lr=nan)"), (dict(lr="0.1"), "AdamW(lr='0.1')"),
    (dict(betas=(1.0, 0.9)), "AdamW(betas[0]=1.0): give a real number in [0, 1)"),
    (dict(eps=-1e-8), "AdamW(eps=-1e-08)"), (dict(weight_decay=INF), "AdamW(weight_decay=inf)")])
def test_data_parallel_refuses_bad_arguments(kw, msg):
    """zero=True and zero=1.0 ran as ZeRO-1 (True == 1.0 == 1); a string bucket size was a
    bare TypeError from '>'; AdamW's hyper-parameters were taken whatever they were."""
    mesh = _dp_mesh()
    with pytest.raises(ValueError, match=re.escape(msg)):
        DataParallel(list(dict(wb.dist_parameters(_tp_linear(mesh))).values()),
                     mesh, "dp", **kw)


def test_zero3_refuses_bad_adamw_arguments():
    mesh = _dp_mesh()
    with pytest.raises(ValueError, match=re.escape("AdamW(weight_decay=nan)")):
        Zero3(_tp_linear(mesh), mesh, "dp", weight_decay=NAN)


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(eps=-1.0), dict(weight_decay=-0.1),
                                dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.5)),
                                dict(lr=NAN)])
def test_wb_adamw_refuses_what_torch_adamw_refuses(kw):
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError):
        torch.optim.AdamW(p, **kw)
    with pytest.raises(ValueError, match=r"^AdamW\("):
        WbAdamW(p, **kw)


def test_wb_adamw_takes_what_torch_adamw_takes():
    p = [nn.Parameter(torch.zeros(2))]
    for kw in (dict(lr=0), dict(lr=torch.tensor(0.1)), dict(betas=(0.0, 0.0)),
               dict(eps=0.0, weight_decay=0)):
        torch.optim.AdamW(p, **kw)
        WbAdamW(p, **kw)


@pytest.mark.parametrize("dist_params", [False, True])
def test_ddp_refuses_a_bool_rank(dist_params):
    """broadcast_from=True broadcast rank 1's parameters (True == 1)."""
    mesh = _dp_mesh() if dist_params else wb.Mesh.grid((2,), ["dp"])
    module = _tp_linear(mesh) if dist_params else nn.Linear(2, 2)
    with pytest.raises(ValueError, match=re.escape("broadcast_from=True: give a rank index")):
        wb.DistributedDataParallel(module, mesh, "dp", broadcast_from=True)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(overlap_grad_reduce="no"), TypeError,
     "DistributedDataParallel(overlap_grad_reduce='no'): give True or False"),
    (dict(bucket_bytes="8"), ValueError, "bucket_bytes='8': give a size > 0 in bytes"),
    (dict(broadcast_from=0.0), ValueError, "broadcast_from=0.0: give a rank index")])
def test_ddp_over_dist_tensors_refuses_bad_arguments(kw, err, msg):
    mesh = _dp_mesh()
    with pytest.raises(err, match=re.escape(msg)):
        wb.DistributedDataParallel(_tp_linear(mesh), mesh, "dp", **kw)
