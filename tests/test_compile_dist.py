"""wb.compile on the real engine: a compiled program runs on torch.distributed (gloo, one
process per rank, launched by torchrun) with eager's loss and gradients."""
import os
import sys

import pytest

from tests.torchrun_support import json_rows, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "compile_check.py")


def test_compiled_tiny_llama_on_four_gloo_processes_gives_eagers_loss_and_grads():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=4", SCRIPT]
    out = run_job(cmd, timeout=300, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(out.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert r["O2"] == pytest.approx(r["eager"], rel=1e-6)
        assert r["O2_grad_diff"] < 1e-6
