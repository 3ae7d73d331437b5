"""The step tail of DeepSpeed's bf16 pipeline engine (``plan.bf16_optimizer``,
``plan.deepspeed_step``) term by term, as the audit ``benchmarks/mtnlg_audit.py`` read it
from DeepSpeed 56c522386 and PyTorch's ProcessGroupNCCL:

- ``BF16_Optimizer.step``'s gradient norm is all-reduced (4 bytes) over the model-parallel
  group, every tp x pp rank of one replica (``get_global_norm_of_tensors(mpu=...)``,
  ``runtime/utils.py:923-930``): was not priced for bf16 (only FP16_Optimizer's norm was);
- ``all_gather_dp_groups`` gathers the updated bf16 partition in shards of
  ``zero_allgather_bucket_size`` (5e8 elements by default) into a LIST of views, which
  ``ProcessGroupNCCL::allgather`` fills by copying its flat buffer out (read 2 + write 2
  bytes per parameter): was one all-gather with no copy.

Both failed before the change (the collectives were the broadcast and the loss's
all-reduce alone; ``dp_sync`` was the all-reduce, its copies and one all-gather)."""
import importlib.util
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.plan import bf16_optimizer as BF
from workbench.plan import deepspeed_step as DS
from workbench.plan.memory import stage_params
from workbench.sim_mesh.cost import compute_time, price
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bf16_small(**kw):
    cfg = wb.models.get_config("gpt3-175b", n_layer=8, d_model=1024, n_head=8, seq_len=512,
                               dtype="bfloat16")
    lay = wb.plan.Layout(**{**dict(dp=2, tp=8, pp=4, zero=1, recompute="full",
                                   global_batch=16, framework="deepspeed"), **kw})
    return cfg, lay, wb.plan.Cluster("a100", 64)


def test_bf16_step_collectives_add_the_norm_over_the_model_parallel_group():
    cfg, lay, cl = _bf16_small()
    ds = wb.plan.estimate(cfg, lay, cl).details["deepspeed_pipe"]
    assert ds["bf16"] and not ds["fp16"]
    mp = [lay.rank(t, 0, s) for s in range(4) for t in range(8)]      # 32 ranks, 4 nodes
    base = price("broadcast", 8, [lay.rank(0, 0, s) for s in range(4)], A100) \
        + price("all_reduce", 4, lay.dp_ranks(0, 3), A100)
    norm = price("all_reduce", 4, mp, A100)
    assert norm > 0
    assert ds["collectives"] == pytest.approx(base + norm, rel=1e-12)
    assert DS.step_collectives(lay, A100, fp16=False) == pytest.approx(base, rel=1e-12)


def test_step_collectives_refuses_both_optimizers():
    _, lay, _ = _bf16_small()
    with pytest.raises(ValueError, match="fp16=True and bf16=True"):
        DS.step_collectives(lay, A100, fp16=True, bf16=True)


def test_allgather_shards_by_hand():
    # max(1, (psi / dp) x dp // 5e8): DeepSpeed 56c522386 runtime/utils.py:990-993
    assert BF.ALLGATHER_BUCKET == 500_000_000 and BF.ALLGATHER_COPY_BYTES == 4
    assert BF.allgather_shards(4.0e8) == 1
    assert BF.allgather_shards(5.0e8) == 1
    assert BF.allgather_shards(2.02e9) == 4           # an MT-NLG first stage
    assert BF.allgather_shards(3.7e9) == 7


def test_dp_sync_by_hand_with_shards_and_copy_out():
    cfg, lay, cl = _bf16_small(dp=2)
    psi = 2.02e9                      # above the bucket: 4 shards
    ranks = lay.dp_ranks(0, 1)
    k = 4
    want = (price("all_reduce", 2 * psi, ranks, A100)
            + compute_time(0.0, 16 * psi, A100, "float32", launches=3)
            + k * price("all_gather", 2 * psi / k, ranks, A100)
            + compute_time(0.0, 4 * psi, A100, "bfloat16", launches=k * 2))
    assert BF.dp_sync(psi, lay, A100, 1) == pytest.approx(want, rel=1e-12)
    one_gather = price("all_reduce", 2 * psi, ranks, A100) \
        + compute_time(0.0, 16 * psi, A100, "float32", launches=3) \
        + price("all_gather", 2 * psi, ranks, A100)
    assert BF.dp_sync(psi, lay, A100, 1) > one_gather     # what was priced before
    assert BF.dp_sync(psi, lay.replace(dp=1, global_batch=8), A100, 1) == 0.0


def test_estimate_charges_the_stage_dp_sync():
    cfg, lay, cl = _bf16_small()
    est = wb.plan.estimate(cfg, lay, cl)
    ds = est.details["deepspeed_pipe"]
    psi = stage_params(cfg, 8, 4, 1)
    assert ds["stages"][1]["dp"] == pytest.approx(BF.dp_sync(psi, lay, cl.profile, 1),
                                                  rel=1e-12)
    assert est.step_time == pytest.approx(ds["step"], rel=1e-12)


@pytest.fixture(scope="module")
def audit_mod():
    sys.path.insert(0, str(_BENCH))
    spec = importlib.util.spec_from_file_location("benchmarks_mtnlg_audit",
                                                  _BENCH / "mtnlg_audit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_audit_phases_add_up_to_the_estimate(audit_mod):
    out = audit_mod.audit(audit_mod.row("mt_nlg", "MT-NLG 530B", 2240))
    assert out["listed"] == pytest.approx(out["predicted"], rel=1e-9)
    assert all(v >= 0 for v in out["phases"].values())
    # stage 0's tail terms are the estimate's (dp_sync's four terms and the tied one)
    assert sum(v for k, v in out["tail"].items() if not k.startswith("ReduceTied")) \
        == pytest.approx(out["dp_stage0"], rel=1e-12)


def test_fit_slots_by_hand(audit_mod):
    rows = [dict(m=m, p=3, published=0.5 * (m + 2) + 4.0) for m in (4, 8, 16)]
    a, c = audit_mod.fit_slots(rows)
    assert a == pytest.approx(0.5, rel=1e-12) and c == pytest.approx(4.0, rel=1e-12)


def test_data_load_by_hand():
    # get_batch_pipe per micro-batch (Megatron-DeepSpeed acc3e9b5): the mask's ones (4),
    # tril (4 + 4), < 0.5 (4 + 1) per s^2 element; per token two contiguous() slices
    # (8 + 8 each) and the loss mask's ones (4); the first stage's clones; two
    # broadcasts over the TP group (the 8 int64 sizes, then b (s + 1) int64 tokens)
    assert DS.MASK_BYTES == 17 and DS.TOKEN_BYTES == 36
    cfg, lay, cl = _bf16_small()
    s, b = 512, lay.micro_batch
    tp = lay.tp_ranks()
    comm = price("broadcast", 64, tp, A100) + price("broadcast", 8 * b * (s + 1), tp, A100)
    last = DS.data_load(cfg, lay, A100, first=False)
    assert last[0] == pytest.approx(compute_time(0.0, 17 * s * s + 36 * b * s, A100,
                                                 "bfloat16", launches=7), rel=1e-12)
    assert last[1] == pytest.approx(comm, rel=1e-12) and last[2] == 64 + 8 * b * (s + 1)
    first = DS.data_load(cfg, lay, A100, first=True)
    assert first[0] == pytest.approx(compute_time(0.0, 19 * s * s + 68 * b * s, A100,
                                                  "bfloat16", launches=10), rel=1e-12)
    assert DS.data_load(cfg, lay.replace(tp=1, dp=16), A100, first=True)[1:] == (0.0, 0)


def test_estimate_charges_the_load_on_the_first_and_last_stage_only(monkeypatch):
    cfg, lay, cl = _bf16_small()
    with_load = wb.plan.estimate(cfg, lay, cl).details["deepspeed_pipe"]["stages"]
    monkeypatch.setattr(DS, "data_load", lambda *a, **k: (0.0, 0.0, 0))
    without = wb.plan.estimate(cfg, lay, cl).details["deepspeed_pipe"]["stages"]
    monkeypatch.undo()
    for s in range(4):
        c, k, sent = DS.data_load(cfg, lay, A100, s == 0) if s in (0, 3) else (0.0, 0.0, 0)
        assert with_load[s]["forward"] - without[s]["forward"] == pytest.approx(
            c + k, rel=1e-9, abs=1e-15)
        assert with_load[s]["compute"] - without[s]["compute"] == pytest.approx(
            c, rel=1e-9, abs=1e-15)
        assert with_load[s]["sent"] - without[s]["sent"] == sent
        assert (c + k > 0) == (s in (0, 3))
