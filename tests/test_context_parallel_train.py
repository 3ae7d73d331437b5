"""`python -m workbench train --cp N`: the sequence sharded over cp ranks (ring attention,
causal load balancing, positions following each rank's chunks) gives one device's
losses, on simulated ranks and under torchrun (gloo); bad combinations are refused."""
import contextlib
import json
import os

import pytest
import torch

from tests.torchrun_support import four_proc, json_rows
from workbench.cli import main
from workbench.models.config import build_model, get_config
from workbench.models.data import get_batch
from workbench.parallel.strategies.context_parallel import slot_positions
from workbench.recipes.context_parallel import ContextParallel
from workbench.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device(preset, steps=2):
    return [r["loss"] for r in train(preset, steps=steps, seed=0, timing=False)]


def cli_losses(capsys, *flags):
    assert main(["train", "--steps", "2", "--seed", "0", *flags]) == 0
    return [json.loads(s)["loss"] for s in capsys.readouterr().out.splitlines()
            if s.startswith("{")]


@pytest.mark.parametrize("preset,flags", [
    ("tiny", ["--cp", "2", "--tp", "2"]),           # Llama: RoPE in ring order, GQA-ready
    ("tiny", ["--cp", "4"]),
    ("gpt-tiny", ["--cp", "2", "--dp", "2"]),       # GPT: learned positions, MHA
    ("tiny", ["--cp", "2", "--zero", "2"])])        # optimizer states sharded over cp
def test_cp_gives_one_devices_losses(preset, flags, capsys):
    got = cli_losses(capsys, "--preset", preset, *flags)
    assert got == pytest.approx(one_device(preset), rel=1e-6)


def test_contiguous_slots_give_the_same_losses_and_cp_bytes_are_counted():
    recs = train("tiny", steps=1, seed=0, timing=False,
                 strategy=ContextParallel(cp=2, balanced=False))
    assert recs[0]["loss"] == pytest.approx(one_device("tiny", 1)[0], rel=1e-5)
    assert recs[0]["comm_bytes"] > 0


@pytest.mark.parametrize("preset", ["tiny", "gpt-tiny"])
def test_logits_equal_one_device_and_the_positions_follow_the_chunks(preset, monkeypatch):
    """Every token's logits as one device's (fp32, 1e-5); without the Llama's RoPE tables
    laid out on the ring they are refused (were: silently off; seq_order.check_op)."""
    cfg = get_config(preset)
    s = ContextParallel(cp=2, tp=2)
    model, mesh = s.build_model(cfg, 0), s.meshes[0]
    x, _ = get_batch(cfg, 2, 0, 0)
    ref, _ = build_model(cfg, seed=0)(x)
    inv = torch.argsort(slot_positions(x.shape[1], 2))
    got = s._stage(model, 0, s._batch(x, mesh)).full()[:, inv]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if preset == "tiny":
        monkeypatch.setattr(ContextParallel, "_ring_positions",
                            lambda self, model, S: contextlib.nullcontext())
        with pytest.raises(ValueError, match=r"rotary_embedding: input 1, a plain tensor.*"
                                             r"to_ring_layout"):
            s._stage(model, 0, s._batch(x, mesh))


@pytest.mark.parametrize("flags,msg", [
    (["--cp", "3"], "does not divide by 6: causal load balancing cuts the sequence into "
                    "2 x cp = 6 equal chunks"),
    (["--cp", "0"], "cp=0"),
    (["--cp", "2", "--pp", "2"], "use pp=1"),
    (["--cp", "2", "--sp"], "give tp > 1 or leave sp off"),
    (["--cp", "2", "--preset", "small"], "dropout=0.1"),
    (["--cp", "2", "--device", "auto"], "--device auto with --cp")])
def test_bad_cp_combinations_are_refused_with_the_fix(flags, msg, capsys):
    assert main(["train", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


TORCHRUN_CP = [("tiny", ["--tp", "2"]),
               ("gpt-tiny", ["--dp", "2"])]     # gradients over one dp x cp process group


@pytest.fixture(scope="module")
def torchrun_cp(tmp_path_factory):
    """Both 4-process runs, in the session's one launch of every 4-process part
    (torchrun_support.FOUR_PROC, tests/dist_scripts/several.py: each process's start-up,
    most of a launch's time, paid once): each run's stdout."""
    texts = []
    for preset, flags in TORCHRUN_CP:
        out, text = four_proc(tmp_path_factory, " ".join(
            ["-m", "workbench", "train", "--preset", preset, "--seed", "0", "--steps", "2",
             "--backend", "torch", "--cp", "2", *flags]))
        assert out.returncode == 0, out.stderr[-3000:]
        texts.append(text)
    return texts


@pytest.mark.parametrize("preset,flags", TORCHRUN_CP)
def test_torchrun_cp_prints_one_devices_losses(preset, flags, torchrun_cp):
    rows = json_rows(torchrun_cp[TORCHRUN_CP.index((preset, flags))])
    assert [r["step"] for r in rows] == [0, 1]                  # rank 0 prints
    assert [r["loss"] for r in rows] == pytest.approx(one_device(preset), rel=1e-6)


def test_the_recipe_runs_on_the_meta_device_as_the_dry_run_does():
    """What ``plan.dryrun`` runs (no data): the ring's sends recorded, 2 layers x (K/V
    forward + K/V again and 2 dK/dV backward, torch's ring) x 2 rings (one per tp rank)."""
    import workbench as wb
    from workbench.parallel.module import dist_parameters
    from workbench.plan.meta_run import run_stage
    cfg = get_config("tiny")
    h = ContextParallel(cp=2, tp=2)
    h.device = torch.device("meta")
    h.check(cfg, 8)
    model = h.build_model(cfg, 0)
    with wb.trace("a100") as tr:
        r = run_stage(h, model, 0, cfg, 2, tr, [p for _, p in dist_parameters(model)])
    assert tr.counts()["send_recv"] == 2 * (1 + 1 + 2) * 2
    assert r["forward"] > 0 and r["backward"] > 0 and r["activation_bytes"] > 0


def test_dp_x_cp_gradients_are_summed_by_one_bucketed_all_reduce():
    """Megatron-Core's convention: the weights are replicas over dp x cp and their
    gradients are summed by one all-reduce over that group (one buffer), not by an
    all-reduce over cp per use of a weight; the losses stay one device's."""
    import workbench as wb
    cfg = get_config("gpt-tiny")
    s = ContextParallel(cp=2, dp=2)
    s.check(cfg, 8)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    with wb.trace("a100") as tr:
        s.forward_backward(model, x, y)
        s.optimizer_step(opts)
    grads = [e for e in tr.events if e.name == "all_reduce" and e.label.startswith("dp ")]
    mesh = s.meshes[0]
    assert [(e.ranks, e.args["mesh_dim"]) for e in grads] == [((0, 1, 2, 3), "dp_cp")]
    n_params = sum(p._local[(0,) * mesh.ndim].numel() for _, p in wb.dist_parameters(model))
    assert grads[0].args["buffer_bytes"] == 4 * n_params           # every gradient, fp32
    per_use = [e for e in tr.events if e.name == "all_reduce" and e.args["mesh_dim"] == "cp"
               and "input" in e.label]
    assert per_use == []
    recs = train("gpt-tiny", steps=2, seed=0, timing=False, strategy=ContextParallel(cp=2, dp=2))
    assert [r["loss"] for r in recs] == pytest.approx(one_device("gpt-tiny"), rel=1e-6)


def test_cp_with_sequence_parallelism_gives_one_devices_losses():
    """--cp 2 --tp 2 --sp: each cp rank's tokens sharded over tp (Megatron SP's
    all-gathers and reduce-scatters on tp, the ring on cp), the norms' partial gradients
    summed over tp once, then every gradient over cp."""
    import workbench as wb
    recs = train("tiny", steps=2, seed=0, timing=False,
                 strategy=ContextParallel(cp=2, tp=2, sp=True))
    assert [r["loss"] for r in recs] == pytest.approx(one_device("tiny"), rel=1e-6)
    cfg = get_config("tiny")
    s = ContextParallel(cp=2, tp=2, sp=True)
    s.check(cfg, 8)
    model = s.build_model(cfg, 0)
    opts = s.build_optimizer(model, 1e-3, 0.0)
    x, y = get_batch(cfg, 8, 0, 0)
    with wb.trace("a100") as tr:
        s.forward_backward(model, x, y)
        s.optimizer_step(opts)
    on = {(e.name, e.args.get("mesh_dim")) for e in tr.events if e.stream != "compute"}
    assert {("reduce_scatter", "tp"), ("all_gather", "tp"), ("send_recv", "cp"),
            ("all_reduce", "cp")} <= on
    labels = {e.label for e in tr.events}
    assert "sequence-parallel norm grads" in labels
    with pytest.raises(ValueError, match="each cp rank's 6 tokens do not divide by tp.*"
                                         "multiple of 16"):
        ContextParallel(cp=2, tp=4, sp=True).check(get_config("tiny").replace(seq_len=12), 8)
