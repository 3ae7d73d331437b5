"""The data-parallel wrappers on torch.distributed (gloo, one process per rank, launched
by torchrun): one device's parameters, the simulation's parameters, no deprecation
warnings; a dead or frozen rank ends the job within the timeout."""
import os
import sys

import pytest

from tests.torchrun_support import four_proc, json_rows, run_job, two_proc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "dist_scripts")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# PYTHONPATH: the processes import this checkout's workbench, not an installed one
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)



def torchrun(n, script, *args, timeout=240):
    cmd = TORCHRUN + [f"--nproc-per-node={n}", os.path.join(SCRIPTS, script), *args]
    return run_job(cmd, timeout=timeout, env=ENV, cwd=ROOT)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """This file's 2-process scripts' stdout from the session's one launch of the
    2-process checks (torchrun_support.TWO_PROC): the job and each script's text."""
    texts = {}
    for s in ("zero_grads_check.py", "wrappers_check.py", "replicas_check.py"):
        out, texts[s] = two_proc(tmp_path_factory, s)
        assert out.returncode == 0, out.stderr[-3000:]
    return out, texts


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_wrappers_on_gloo_give_one_devices_and_the_simulations_parameters(n, request):
    if n == 2:
        out, texts = request.getfixturevalue("two_processes")
        text = texts["wrappers_check.py"]
    else:       # one launch: the 4-process parts (torchrun_support.FOUR_PROC)
        out, text = four_proc(request.getfixturevalue("tmp_path_factory"), "wrappers_check.py")
        assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert rows[-1] == {"drift_found": True}
    # FSDP with one unit per block: per process, root (emb + head) plus one block forward;
    # in backward the root still whole (kept gathered from forward to the end of backward,
    # as torch's FSDP keeps the root: fsdproot) plus one block's re-gathered weight (what
    # it saved); all freed after.  (Before fsdproot: the head's re-gathered weight only.)
    pad = (-16 * 16) % n + 16 * 16, (-10 * 16) % n + 10 * 16
    assert rows[-2] == {"memory": [4 * (2 * pad[1] + pad[0]), 4 * (2 * pad[1] + pad[0]), 0]}
    rows = rows[:-2]
    assert len(rows) == 10
    for r in rows:
        kind, opt, dtype, bucket = r["case"]
        low = dtype != "None"
        assert r["one_device"] < (1e-4 if low else 1e-6), r
        # 2 ranks: the same two-term sums as the simulation, bitwise; 4: gloo's ring adds
        # in another order than the simulator's row-by-row sum.  fp16: the simulator's
        # gradients carry the 1/N of the global mean from the start, and fp16's
        # subnormals (below 6e-5) round them where gloo's later division does not
        exact = n == 2 and dtype != "torch.float16"
        assert r["simulated"] <= (0.0 if exact else 1e-5 if low else 1e-6), r
        assert r["frozen_kept"] and r["unused_kept"], r
    assert "FutureWarning" not in out.stderr and "deprecated" not in out.stderr


@pytest.mark.slow
def test_shard_tensor_broadcasts_and_from_local_checks_replicas_on_gloo(two_processes):
    rows = sorted(json_rows(two_processes[1]["replicas_check.py"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1]
    zeros, ones = [[0.0] * 3] * 2, [[1.0] * 3] * 2      # rank k's own x is full of k
    for k, r in enumerate(rows):
        assert r["replicate"] == zeros and r["shard"] == [[0.0] * 3]   # rank 0's x
        assert r["src1"] == ones                                       # src_data_rank=1
        assert r["own"] == (zeros if k == 0 else ones)                 # None: no broadcast
        assert r["x_untouched"] and r["grad"] == [[3.0] * 3] * 2
        assert "src_data_rank=2" in r["bad_src"]
        assert "different shapes" in r["bad_shape"] and f"rank {k}: ({2 + k},)" in r["bad_shape"]
        assert r["equal_ok"] == [1.0] * 3
        # every process raises (none hangs in a later collective), naming rank 1
        assert r["differ"].startswith("from_local(check_replicas=True): rank 1 holds")
        assert "different shapes" in r["differ_shape"]
        assert r["unchecked"] == (zeros if k == 0 else ones)
        assert r["partial"] == ones and r["sharded"] == zeros + ones


def test_bad_src_data_rank_is_named_on_simulated_ranks_too():
    import torch

    import workbench as wb
    mesh = wb.Mesh.grid((2, 3), ("dp", "tp"))
    for bad in (2, -1, True, 0.0):
        with pytest.raises(ValueError, match=f"src_data_rank={bad!r}"):
            wb.shard_tensor(torch.ones(4), mesh, ["R", "R"], src_data_rank=bad)
    x = torch.arange(6.0)
    assert torch.equal(wb.shard_tensor(x, mesh, ["S(0)", "R"], src_data_rank=None).full(), x)


@pytest.mark.slow
def test_zero_gradients_on_gloo_equal_the_simulations(two_processes):
    """One step of tiny at dp 2 under ZeRO-1, 2, 3: the sum of squares of Adam's first
    moments (0.1 times the gradient shards, over the whole model) equals the simulator's,
    layout by layout; ZeRO-3's were once 4 times it (every gradient doubled: the gathered
    parameter's backward reduced over dp twice) where the losses could not show it."""
    import importlib.util
    (got,) = json_rows(two_processes[1]["zero_grads_check.py"])
    # the script's simulated run, here (it ran as a process of its own: one more start-up)
    spec = importlib.util.spec_from_file_location("zero_grads_check",
                                                  os.path.join(SCRIPTS, "zero_grads_check.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    want = {k: sim.moments_sumsq(False, **v) for k, v in sim.LAYOUTS.items()}
    assert got.keys() == want.keys() == {"zero1", "zero2", "zero3"}
    for k in want:
        assert want[k] > 0 and abs(got[k] - want[k]) <= 1e-6 * want[k], (k, got, want)
