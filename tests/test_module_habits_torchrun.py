"""An ordinary training loop's habits on the wrappers under torchrun (2 processes,
gloo): torch's own clip_grad_norm_ over DDP's, ZeroRedundancyOptimizer's and FSDP's
parameters gives one device's norm on every rank (FSDP's shards: the total norm, not
each shard's), then the step gives one device's parameters; state dicts round trip and
a plain model's loads; a summed loss the module returns is averaged as on simulated
ranks; a parallelized module clips with wb.clip_grad_norm_, loads and converts."""
import pytest

from tests.torchrun_support import json_rows, two_proc


@pytest.mark.slow
def test_clip_grad_norm_state_dicts_and_sum_losses_on_gloo(tmp_path_factory):
    out, text = two_proc(tmp_path_factory, "habits_check.py")      # one launch: 2-process checks
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json_rows(text)
    cases = [r for r in rows if "case" in r]
    assert len(cases) == 2 * 4 * 2                      # 2 ranks x 4 wrappers x 2 norms
    for r in cases:
        for got, want in r["norms"]:                    # every step, every rank
            assert abs(got - want) <= 1e-6 * want, r
        assert r["params"] < 1e-6, r
        if r["case"][0] == "zero" and r["rank"] == 0:      # consolidated on rank 0
            assert r["opt_state"] < 1e-6, r
        else:
            assert r["opt_state"] is None, r
        if "keys" in r:
            kind = r["case"][0]
            assert r["keys"][0] == ("module.emb.weight" if kind == "ddp" else "emb.weight")
            assert r["dist"] == kind.startswith("fsdp")     # FSDP2: DistTensors
            assert r["plain_loaded"] and r["round_trip"] and r["strict"], r
    # both ranks clip by the same norm (FSDP would differ by rank with each shard's own)
    for kind in ("ddp", "zero", "fsdp", "fsdp_units"):
        a, b = [r["norms"] for r in cases if r["case"] == [kind, 2.0]]
        assert a == b, kind
    sums = [r["sum_loss"] for r in rows if "sum_loss" in r]
    assert sums == [0.0, 0.0]                           # torchrun == simulated, bitwise
    # a parallelized MLP on a 2-process tp mesh: wb.clip_grad_norm_, state dict, .double()
    tps = [r for r in rows if "tp_norm" in r]
    assert len(tps) == 2 and tps[0]["tp_norm"] == tps[1]["tp_norm"]
    for r in tps:
        got, want = r["tp_norm"]
        assert abs(got - want) <= 1e-6 * want and r["tp_grads"] < 1e-6, r
        assert r["tp_loaded"] and r["tp_double"] < 1e-12, r
    # DDP's names are torch DDP's ("module." everywhere, habits4: named_parameters(),
    # named_buffers() and named_modules() gave the module's own), on the process group and
    # on simulated ranks; each one's state dict loads into the other
    names = [r for r in rows if "names_torch" in r]
    assert len(names) == 2
    for r in names:
        assert r["names_wb"] == r["names_torch"] == r["names_sim"], r
        assert r["names_torch"][0][0] == "module.0.weight", r
        assert r["into_ours"] and r["into_torch"], r
