"""mtn14: the DeepSpeed pipeline rows at tp 8 (MT-NLG 530B, BLOOM's 02-28 tp 8 rows) read
phase by phase (``benchmarks/mtnlg_audit.py``, ``main_tp`` and its docstring's "Checked
(mtn14)"): what the planner charges a BLOOM layer pass at tp 8 against tp 4, and the gap
per layer and micro-batch the audit prints, bounded so that a change of the clock that
moves it fails here and the note is updated."""

import pytest

from tests.test_i21mtnlg import audit_mod  # noqa: F401  (the loader fixture)

from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import get_profile

JZ = get_profile("a100-jeanzay")


@pytest.fixture(scope="module")
def audit(audit_mod):
    return audit_mod        # benchmarks/mtnlg_audit.py, loaded as test_i21mtnlg loads it


@pytest.fixture(scope="module")
def pair(audit):
    return [audit.audit(audit.row(*k)) for k in audit.TP_PAIR]


def test_the_pair_is_tp8_against_tp4_at_one_shape(audit):
    (a, b) = [audit.P.build(audit.row(*k)) for k in audit.TP_PAIR]
    assert (a[1].tp, a[1].dp, b[1].tp, b[1].dp) == (8, 4, 4, 8)
    assert a[0] == b[0]                                  # the same model
    assert a[1].pp == b[1].pp == 12 and a[1].micro_batch == b[1].micro_batch == 2


def test_the_pairs_phases_add_up_to_the_estimate(pair):
    for x in pair:
        assert sum(x["phases"].values()) == pytest.approx(x["predicted"], rel=1e-9)


def test_bloom_tp_collectives_are_six_ring_all_reduces_per_layer_pass(audit, pair):
    """The family "their TP collectives" of the slowest stage is, per micro-batch, exactly
    six all-reduces of the [s, b, h] bf16 activation per layer (2021 Megatron under full
    recompute: 2 forward, 2 recomputed, 2 backward, none overlapped) at NCCL's price on
    the TP group (``cost.price``, NCCL 2.10.3's tuning model on the node's NVSwitch)."""
    for k, x in zip(audit.TP_PAIR, pair):
        cfg, lay, _ = audit.P.build(audit.row(*k))
        layers = lay.stage_layers(cfg.n_layer)[x["slowest"]]
        n = 2 * cfg.seq_len * lay.micro_batch * cfg.d_model
        fam = x["phases"][f"per micro-batch x {lay.m}: their TP collectives"] / lay.m
        ar = cost.price("all_reduce", n, lay.tp_ranks(0, x["slowest"]), JZ)
        assert fam == pytest.approx(audit.TP_ALL_REDUCES_PER_LAYER * layers * ar, rel=1e-9)


def test_tp8_all_reduce_over_tp4_is_the_rings_byte_ratio():
    """A ring all-reduce moves 2 (p - 1) / p of the buffer per rank: 1.75 / 1.5 = 1.167
    more at 8 ranks than at 4 on one NVSwitch node; the 117 MB all-reduce (BLOOM, micro-batch
    2) is bandwidth-bound, so its price follows within 3% (the ring's latency steps grow
    with p: the rest)."""
    n = 2 * 2048 * 2 * 14336
    r = cost.price("all_reduce", n, range(8), JZ) / cost.price("all_reduce", n, range(4), JZ)
    assert r == pytest.approx(1.75 / 1.5, rel=0.03), r


@pytest.fixture(scope="module")
def gaps(audit):
    return [audit.per_layer_gap(r) for r in audit.gap_rows()]


def test_gap_rows_cover_every_deepspeed_pipeline_row_with_a_time(gaps):
    assert len(gaps) == 3 + 6 + 12
    assert all(g["pp"] > 1 for g in gaps)


def test_per_layer_gap_reproduces_the_ratio(audit):
    """The gap spread over (m + p - 1) x layers, times them again, plus the estimate, is the
    published step (the ratio x the estimate): the reading loses nothing."""
    r = audit.row("mt_nlg", "MT-NLG 530B", 2240)
    g = audit.per_layer_gap(r)
    cfg, lay, _ = audit.P.build(r)
    est = audit.P.predict(r)["estimate"]
    back = est.step_time + g["gap"] * (lay.m + lay.pp - 1) * g["layers"]
    assert back / est.step_time == pytest.approx(g["ratio"], rel=1e-9)


def test_tp8_gap_per_layer_bounded(gaps):
    """KNOWN GAP (``mtnlg_audit`` docstring, "Checked (mtn14)"): at tp 8 and micro-batch 1-2
    every DeepSpeed-pipeline row leaves 12-16 ms per layer and micro-batch unpriced (MT-NLG
    on Selene, BLOOM 176B and 184B on Jean Zay); at tp 4 and micro-batch 2, 6-9 ms (the
    178B with 104 heads, 24 ms, set aside).  No source was found for it; the bound fails
    the day the clock moves it, so that the note is updated."""
    tp8 = [g["gap"] for g in gaps if g["tp"] == 8 and g["mb"] <= 2]
    tp4 = [g["gap"] for g in gaps if g["tp"] == 4 and g["mb"] == 2 and "a104" not in g["name"]]
    assert len(tp8) == 5 and len(tp4) == 10
    assert all(0.012 <= x <= 0.016 for x in tp8), tp8
    assert all(0.006 <= x <= 0.009 for x in tp4), tp4


def test_whole_gap_in_the_tp_all_reduces_would_need_a_bus_bandwidth_never_measured(gaps):
    """Were the tp 8 gap all in the six TP all-reduces, they would run at 45-70 GB/s bus
    bandwidth inside an NVSwitch node, where nccl-tests measured 167-174 GB/s at 64-128 MiB
    on 8 A100s (tests/test_clock10.py AZ_A100, the clock's KNOWN GAP) and the clock
    prices 216-221."""
    tp8 = [g for g in gaps if g["tp"] == 8 and g["mb"] <= 2]
    assert all(40e9 <= g["busbw_needed"] <= 70e9 for g in tp8), [g["busbw_needed"] for g in tp8]
    assert all(g["busbw"] > 210e9 for g in tp8)


def test_same_530b_shape_leaves_megatron_lm_far_less_than_mt_nlg(audit):
    """KNOWN GAP, bounded: per layer and micro-batch (over m x layers per GPU) Megatron-LM's
    530B runs on Selene leave 1-5 ms unpriced, MT-NLG's 14-19 ms: the term is in the
    DeepSpeed path at tp 8, not the 530B layer's kernels (``mtnlg_audit`` docstring)."""
    got = {(src, n): gap for src, _, n, _, gap in audit.same_shape_gap()}
    assert set(got) == {("narayanan", 2520), ("korthikanti", 280), ("mt_nlg", 2240),
                        ("mt_nlg", 2800), ("mt_nlg", 3360)}
    assert got["narayanan", 2520] <= 0.006 and got["korthikanti", 280] <= 0.006
    assert all(0.013 <= got["mt_nlg", n] <= 0.020 for n in (2240, 2800, 3360))
