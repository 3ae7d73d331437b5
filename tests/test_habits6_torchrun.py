"""habits6 on torch.distributed (2 processes, gloo): ZeroRedundancyOptimizer.add_param_group
over DDP equals torch's own DDP + ZeroRedundancyOptimizer bitwise (it raised
NotImplementedError), and an FSDP loop with a retained graph backpropagated twice and an
inference_mode forward between steps gives one device's numbers (the forward raised
AttributeError); optimizer.zero_grad() after an FSDP no_sync() backward drops the held
gradients (they were added to the next step's)."""
import pytest

from tests.torchrun_support import json_rows, two_proc


@pytest.mark.slow
def test_zero_add_param_group_and_fsdp_inference_mode_on_gloo(tmp_path_factory):
    out, text = two_proc(tmp_path_factory, "habits6_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    assert len(rows) == 6 and not [r for r in rows if "raised" in r], rows
    for r in rows:
        if r["case"] == "zero_add_param_group":
            assert r["params"] == 0.0 and r["keys_equal"], r     # torch's, bitwise
        else:
            assert r.get("outputs", 0.0) < 1e-6 and r["params"] < 1e-6, r
