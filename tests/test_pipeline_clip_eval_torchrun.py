"""``Hybrid.clip_grad_norm_`` / ``clip_grad_value_`` / ``evaluate`` with pp > 1 on
torch.distributed (gloo, one process per rank, launched by torchrun): a user's loop that
clips and evaluates gives the simulated mesh's and one device's norms, parameters, loss
and logits (tests/dist_scripts/pipeline_clip_eval_check.py)."""
import importlib.util
import os

import pytest
import torch

from tests.torchrun_support import FOUR_PROC, TWO_PROC, part_dir, shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "pipeline_clip_eval_check.py")
PART = "pipeline_clip_eval_check.py {dir}"


def _script():
    spec = importlib.util.spec_from_file_location("pipeline_clip_eval_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_clip_and_evaluate_under_torchrun_give_the_simulations_and_one_devices(
        n, tmp_path_factory):
    # one launch: the 2-process parts (TWO_PROC) or the 4-process ones (FOUR_PROC, this
    # script first: its simulated step before any real mesh, as in a launch of its own)
    group = {2: TWO_PROC, 4: FOUR_PROC}[n]
    out, _ = shared(group, tmp_path_factory, PART)
    assert out.returncode == 0, out.stderr[-3000:]
    tmp_path = part_dir(group, tmp_path_factory, PART)
    assert "FutureWarning" not in out.stderr and "deprecated" not in out.stderr
    ranks = [torch.load(tmp_path / f"rank{k}.pt") for k in range(n)]
    mod = _script()
    cfg = mod.get_config("tiny")
    ref_norms, ref_loss, ref_logits, ref_params = mod.one_device(cfg)
    sim = mod.run(False, n)
    # 2 processes (pp only): every sum in the simulator's order, bitwise; 4: gloo's
    # all-reduce over dp (or tp) adds in another order than the simulator's
    exact = 0.0 if n == 2 else 5e-6
    for name in mod.LAYOUTS[n]:
        want = sim[name]
        # the simulation is one device's (the reference of the simulated path's tests)
        assert want["norms"] == pytest.approx(ref_norms, rel=1e-5)
        seen = set()
        for k, got in enumerate(r[name] for r in ranks):
            # every rank returns the one total norm (clipping engaged: max_norm below it),
            # the one loss and the whole logits, as the simulation and one device
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-6), (name, k)
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), (name, k)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (name, k)
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-5), (name, k)
            torch.testing.assert_close(got["logits"], want["logits"], atol=exact, rtol=0)
            torch.testing.assert_close(got["logits"], ref_logits, atol=1e-5, rtol=0)
            # this rank's stage after three clipped steps (2-norm, inf-norm, value)
            for pname, p in got["params"].items():
                torch.testing.assert_close(p, want["params"][pname], atol=exact, rtol=0)
                torch.testing.assert_close(p, ref_params[pname], atol=1e-5, rtol=0)
                seen.add(pname)
        assert seen == set(ref_params), (name, set(ref_params) - seen)   # every stage
