"""`python -m workbench train --moe-experts E --moe-topk k --ep N`: one device's losses on
simulated ranks and under torchrun (gloo, 4 processes); bad flags refused with the fix."""
import json
import os
import sys

import pytest

from tests.torchrun_support import run_job
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
    (["--moe-experts", "0", "--moe-gating", "sigmoid"], "--moe-gating applies to a "
                                                         "mixture-of-experts model")])
def test_bad_moe_flags_are_refused_with_the_fix(flags, msg, capsys):
    assert main(["train", *MOE, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_ep_prints_one_devices_losses(capsys):
    one = _losses(capsys)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "workbench", "train", *MOE, "--seed", "0", "--backend", "torch",
           "--ep", "2", "--dp", "2"]
    out = run_job(cmd, timeout=240, cwd=ROOT,
                  env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(s) for s in out.stdout.splitlines() if s.startswith("{")]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["loss"] for r in rows] == pytest.approx(one, rel=1e-6)
