"""Issue 21 (i21z3530): the per-phase audit of DeepSpeed v0.3.13's ZeRO-3 step
(``benchmarks/zero3_audit.py``) and the terms it found unpriced, each held to its source
line (DeepSpeed v0.3.13, 12a53b4383)."""
import importlib.util
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.plan import costs as C
from workbench.plan import zero3_2021 as Z
from tests.test_zero3_2021 import _gpt, _trace as _zero3_trace
from workbench.plan.edge_cost import edge_times

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _audit_module():
    sys.path.insert(0, str(_BENCH))
    spec = importlib.util.spec_from_file_location("zero3_audit", _BENCH / "zero3_audit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(h=4096, layers=2, mb=1):
    return _zero3_trace(_gpt(h, layers), "full", mb)


@pytest.mark.parametrize("name,devices", [("GPT 175B", 1536), ("GPT 530B", 2240)])
def test_audit_phases_sum_to_the_estimate(name, devices):
    a = _audit_module().audit(name, devices)
    assert a["listed"] == pytest.approx(a["predicted"], rel=1e-12)
    # nothing left over: the named phases alone make the step
    assert abs(a["phases"]["the estimate's other terms"]) < 1e-9 * a["predicted"]
    assert abs(a["phases"]["compute: the estimate's rest (gradient accumulation)"]) \
        < 1e-9 * a["predicted"]
    # the work counted runs beside other work, never less than the exposed part
    hidden = a["phases"]["hidden: work run beside other work (negative), compute slowed "
                         "beside NCCL"]
    assert hidden < 0
    assert a["exposed"] == pytest.approx(sum(a["work"].values()) + hidden, rel=1e-12)


def test_work_kinds_by_hand():
    # per gather: torch.zeros of the parameter (2 B/elem) + torch.cuda.synchronize,
    # c10d's chunk copies (4 B/elem); per reduce-scatter the chunk copies too; every
    # _synchronize_communication one SYNC_S; NCCL split into its two kinds
    tr = _trace()
    bw, p = 2e12, 64
    r = Z.simulate(tr, p, lambda n: 1e-3, lambda n: 2e-3, bw)
    w = r["work"]
    size = {pid: n for e in tr for pid, n in e.params}
    gathered = sum(size[pid] for e in tr for pid, _ in e.params
                   if size[pid] >= Z.PERSISTENCE_NUMEL and e.module != "root") \
        + size["wte"]             # the root's tied embedding once: held to the end
    assert r["gathers"] > 0
    assert w["nccl_ag"] == pytest.approx(r["gathers"] * 1e-3)
    assert w["nccl_rs"] == pytest.approx(r["reduce_scatters"] * 2e-3)
    assert w["nccl"] == pytest.approx(w["nccl_ag"] + w["nccl_rs"])
    grads = sum(size.values())
    assert w["chunk_copy"] == pytest.approx(4 * (w["fill"] / 2 * bw) / bw + 4 * grads / bw)
    assert w["fill"] <= 2 * gathered / bw + 1e-12
    # one synchronize per gather plus one per module that gathered or waited
    assert w["sync"] >= r["gathers"] * Z.SYNC_S


def test_partition_activation_copies_by_hand():
    # checkpointing.py v0.3.13 at one model-parallel rank: forward clone (read + write),
    # backward zeros + copy_ + the one-rank all-gather's NCCL copy and c10d's copy-out:
    # 4 and 14 bytes per 16-bit element of the layer's input, b x s x h
    from workbench.sim_mesh.kernel_cost import compute_time
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048,
                                tie_embeddings=True, dropout=0.1, d_model=20480,
                                n_layer=2, n_head=160, dtype="float16")
    prof = wb.plan.Cluster("a100", 8).profile
    fwd, bwd = Z.partition_activation_seconds(cfg, 4, prof)
    n = 4 * 2048 * 20480
    assert fwd == pytest.approx(compute_time(0.0, 4 * n, prof, "float16", launches=1))
    assert bwd == pytest.approx(compute_time(0.0, 14 * n, prof, "float16", launches=4))
    # 0.67 / 2.35 GB at the A100's copy rate (0.9 of 2,039 GB/s): 0.37 / 1.3 ms
    assert 0.33e-3 < fwd < 0.42e-3 and 1.15e-3 < bwd < 1.45e-3
    with pytest.raises(ValueError, match="micro_batch"):
        Z.partition_activation_seconds(cfg, 0, prof)


def test_checkpoint_copies_run_before_each_layer_and_its_recompute():
    tr0 = _trace()
    tr = [Z.Entry(e.module, e.params, e.compute, e.phase) for e in tr0]
    assert tr == tr0                          # no copies unless asked
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048,
                                tie_embeddings=True, dropout=0.1, d_model=4096,
                                n_layer=2, n_head=32, dtype="float16")
    prof = wb.plan.Cluster("a100", 8).profile
    layer = C.layer_cost(cfg, 1, 1, False, "full", prof, "materialized", False)
    head = C.head_cost(cfg, 1, 1, False, prof)
    edge = edge_times(cfg, 1, 1, False, prof)
    tr = Z.gpt_trace(cfg, layer, head, edge, "full", (1e-3, 3e-3))
    got = [(e.module, e.phase, e.copies) for e in tr if e.copies]
    assert got == [("0.ln1", "f", 1e-3), ("1.ln1", "f", 1e-3),
                   ("1.ln1", "r", 3e-3), ("0.ln1", "r", 3e-3)]
    # without full recompute nothing is checkpointed
    assert not any(e.copies for e in Z.gpt_trace(cfg, layer, head, edge, "none",
                                                 (1e-3, 3e-3)))
    # the copies run on the compute stream: the step is longer, the compute unchanged
    bw = 2e12
    a = Z.simulate(tr0, 8, lambda n: 1e-4, lambda n: 1e-4, bw)
    b = Z.simulate(tr, 8, lambda n: 1e-4, lambda n: 1e-4, bw)
    assert b["compute"] == pytest.approx(a["compute"])
    assert b["work"]["checkpoint_copies"] == pytest.approx(8e-3)
    assert b["seconds"] - a["seconds"] == pytest.approx(8e-3, rel=0.05)


def test_step_host_seconds_by_hand():
    tr = _trace()
    tensors = len({pid for e in tr for pid, _ in e.params})
    assert tensors == 2 * 12 + 4              # 12 a layer; wte, wpe, final norm's two
    got = Z.step_host_seconds(tr, 3, lambda b: 1e-4 * b, lambda b: 1e-3 * b)
    assert got["waits"] == pytest.approx((2 * tensors + 9 + 29 * 3) * Z.SYNC_S)
    assert got["h2d"] == pytest.approx((3 + 2 * 3) * Z.RELEASE_S)
    assert got["loops"] == pytest.approx(tensors * 2.48 * Z.NARROW_S)
    assert got["all_reduces"] == pytest.approx(1e-4 * (1 + 4) + 3 * 1e-3 * 4)
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    with pytest.raises(ValueError, match="m="):
        Z.step_host_seconds(tr, 0, lambda b: 0.0, lambda b: 0.0)


def test_estimate_charges_the_step_host_terms_and_checkpoint_copies():
    # failed before: the estimate's DP sync was the simulation and _post_step alone
    cfg = wb.models.get_config("gpt3-175b", n_layer=4, d_model=1024, n_head=8,
                               seq_len=512, dtype="float16")
    lay = wb.plan.Layout(dp=16, zero=3, recompute="full", global_batch=32,
                         framework="deepspeed-0.3")
    cl = wb.plan.Cluster("a100", 16)
    est = wb.plan.estimate(cfg, lay, cl)
    prof = cl.profile
    edge = edge_times(cfg, lay.micro_batch, 1, False, prof)
    d = Z.dp_sync_parts(cfg, lay, prof, est.details["layer"], est.details["head"], edge)
    assert d["host"]["total"] > 0 and d["first"]["work"]["checkpoint_copies"] > 0
    sims = d["first"]["seconds"] + (lay.m - 1) * d["rest"]["seconds"]
    assert d["seconds"] == pytest.approx(sims + d["post"] + d["host"]["total"], rel=1e-12)
    assert est.details["dp_sync"] == pytest.approx(d["exposed"], rel=1e-12)
