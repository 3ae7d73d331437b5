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
from workbench.plan.edge_cost import edge_times

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _audit_module():
    sys.path.insert(0, str(_BENCH))
    spec = importlib.util.spec_from_file_location("zero3_audit", _BENCH / "zero3_audit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(h=4096, layers=2, mb=1):
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=51200, seq_len=2048,
                                tie_embeddings=True, dropout=0.1, d_model=h,
                                n_layer=layers, n_head=h // 128, dtype="float16")
    prof = wb.plan.Cluster("a100", 8).profile
    layer = C.layer_cost(cfg, mb, 1, False, "full", prof, "materialized", False)
    head = C.head_cost(cfg, mb, 1, False, prof)
    return Z.gpt_trace(cfg, layer, head, edge_times(cfg, mb, 1, False, prof), "full")


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
