"""Sequence parallelism runs Megatron-LM's program on both executors (task sptorchrun):
the norms' weight gradients stay partial per tp rank through the micro-batches and are
summed over tp ONCE per step (``_allreduce_layernorm_grads`` in megatron/core/distributed/
finalize_model_grads.py), before the dp reduce and the clip.  Under torchrun
``sequence_parallel_norms`` gave nothing and every norm's gradient was all-reduced over tp
in backward, every micro-batch: another program, another modeled step (tiny dp 2 x tp 2
sp: 0.2571 ms for the simulator's 0.2389; the program of tests/dist_scripts/
sp_norms_model.py, 2 micro-batches and a clip per step: 0.3147 ms for 0.2874, six
'rms_norm input' all-reduces a step for one 'sequence-parallel norm grads').  And the
simulated clip did not record Megatron's scalar all-reduce of the norm over the
model-parallel group that torchrun's records (4.54 us at tp 2)."""
import pytest
import torch

import workbench as wb
from tests.dist_scripts.sp_norms_model import MICRO, STEPS, run, run_no_sync
from tests.torchrun_support import FOUR_PROC, four_proc, part_dir
from workbench.recipes.hybrid import Hybrid

PART = "sp_norms_check.py {dir}/torchrun.pt"


@pytest.fixture(scope="module")
def one():
    return run()


@pytest.fixture(scope="module")
def sim():
    return run(Hybrid(dp=2, tp=2, sp=True))


@pytest.fixture(scope="module")
def no_sync():
    return run_no_sync(), run_no_sync(wb.Mesh.grid((2, 2), ["dp", "tp"]))


def _close(got, want, what, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=f"{what} {k}")


def _held_to_one_device(r, one):
    """Gradients after the clip, total norms and parameters after the steps: one device's
    (the clip binds at every step: max_norm far under the norms)."""
    assert r["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert min(one["norms"]) > 10 * 0.05
    for s in range(STEPS):
        _close(r["grads"][s], one["grads"][s], f"step {s} grad", atol=1e-7)
    _close(r["params"], one["params"], "param", atol=2e-5)


def test_simulated_sp_step_is_one_devices_and_sums_the_norms_once(sim, one):
    _held_to_one_device(sim, one)
    for counts in sim["collectives"]:
        labels = {lab: n for kind, lab, n in counts}
        assert labels["sequence-parallel norm grads"] == 1          # once per step
        assert "rms_norm input" not in labels                       # none in backward
        assert labels["f: all-gather"] == 3 * MICRO                 # 3 per micro-batch


def test_simulated_clip_records_the_norms_all_reduce_over_the_model_parallel_group(sim):
    """Megatron-LM's get_grad_norm_fp32 all-reduces the ranks' sum |g|^2 over tp x pp;
    at pp = 1 the simulated clip recorded nothing (torchrun's recorded it).  Failed
    before: no such collective."""
    for counts in sim["collectives"]:
        assert ["all_reduce", "clip_grad norm over tp x pp", 1] in counts


def _no_sync_held(r, one):
    """DDP, the first micro-batch in no_sync(), SGD after wb.clip_grad_norm_: one device's
    norms and parameters (the LayerNorm's weight and bias included), one sum over tp of
    the norms' gradients a step."""
    assert r["norms"] == pytest.approx(one["norms"], rel=1e-6)
    assert min(one["norms"]) > 10 * 0.05
    _close(r["params"], one["params"], "param", atol=1e-7)
    for counts in r["collectives"]:
        labels = {lab: n for kind, lab, n in counts}
        assert labels["sequence-parallel norm grads"] == 1 and labels["dp bucket"] == 1


def test_simulated_ddp_no_sync_accumulates_the_partial_norm_gradients(no_sync):
    _no_sync_held(no_sync[1], no_sync[0])


@pytest.mark.slow
def test_torchrun_runs_the_simulators_program(sim, one, no_sync, tmp_path_factory):
    """4 gloo processes: the same gradients, norms and parameters as the simulated ranks
    and one device, the same collectives of rank 0, the same modeled step; and DDP's
    no_sync() accumulation (run_no_sync) the same on both.  Failed
    before: 6 'rms_norm input' all-reduces a step where the simulator has one
    'sequence-parallel norm grads'; 0.3147 ms for the simulator's 0.2874."""
    # one launch: every 4-process part (torchrun_support.FOUR_PROC)
    out, _ = four_proc(tmp_path_factory, PART)
    assert out.returncode == 0, out.stderr[-3000:]
    path = part_dir(FOUR_PROC, tmp_path_factory, PART) / "torchrun.pt"
    got = torch.load(path)
    _held_to_one_device(got, one)
    assert got["norms"] == pytest.approx(sim["norms"], rel=1e-6)
    for s in range(STEPS):
        _close(got["grads"][s], sim["grads"][s], f"step {s} grad vs simulator", atol=1e-8)
    _close(got["params"], sim["params"], "param vs simulator", atol=5e-6)
    assert got["collectives"] == sim["collectives"]
    assert got["modeled_ms"] == pytest.approx(sim["modeled_ms"], rel=1e-9)
    _no_sync_held(got["no_sync"], no_sync[0])
    assert got["no_sync"]["collectives"] == no_sync[1]["collectives"]
