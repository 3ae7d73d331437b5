"""The checks of notebook 14: right answers pass, common mistakes get their hint, the
value shows only from the third try, and the checks' hand formulas (which must not call
the library) agree with the library's own numbers."""
import math

import pytest

import workbench as wb
from workbench.exercises import checks_experts as C
from workbench.exercises.feedback import CheckError, REVEAL_AFTER, reset_tries
from workbench.plan import Cluster, Layout
from workbench.plan.context_cost import kv_block_bytes, ring_times
from workbench.plan.ep_cp import layer_detail
from workbench.plan.presets import get_config
from workbench.sim_mesh.cost import wire_bytes

from .exercise_helpers import fails, passes

LOADS = [90, 40, 70, 50, 80, 60, 55, 67]          # 512 token-slots: 256 tokens, k = 2


@pytest.fixture(autouse=True)
def _fresh():
    reset_tries()
    yield
    reset_tries()


def test_every_check_is_exported():
    assert set(C.__all__) == {"check_dropped_slots", "check_ep_tp_mb", "check_ring_kv_mb",
                              "check_a2a_mb"}
    assert all(getattr(wb.exercises, name) is getattr(C, name) for name in C.__all__)


def test_dropped_slots(capsys):
    # capacity ceil(1.0 x 256 x 2 / 8) = 64: 26 + 6 + 16 + 3 over it
    out = passes(capsys, C.check_dropped_slots, 51, LOADS)
    assert "capacity 64" in out
    passes(capsys, C.check_dropped_slots, 10, LOADS, capacity_factor=1.25)    # C = 80
    fails("leaves out k", C.check_dropped_slots, sum(max(0, n - 32) for n in LOADS), LOADS)
    # the capacity factor kept but k left out: C = ceil(1.25 x 256 / 8) = 40, not 80
    fails(r"leaves out k.*ceil\(1.25 x tokens x k / E\)", C.check_dropped_slots,
          sum(max(0, n - 40) for n in LOADS), LOADS, capacity_factor=1.25)
    fails("dropped share of the 512 token-slots", C.check_dropped_slots, 10 / 512, LOADS,
          capacity_factor=1.25)
    fails("counts the experts over capacity", C.check_dropped_slots, 4, LOADS)
    fails("do not divide by k", C.check_dropped_slots, 25, LOADS)
    fails("do not divide by k", C.check_dropped_slots, 51 / 2, LOADS)      # 25.5: true division
    fails("unused capacity", C.check_dropped_slots, 40 + 10 + 30 + 20 + 25 + 13, LOADS,
          capacity_factor=1.25)
    fails("too high", C.check_dropped_slots, 200, LOADS)
    # the count at capacity factor 1.0 (C = 64) when the layer's is 1.25 (C = 80)
    fails("count at capacity factor 1.0", C.check_dropped_slots,
          sum(max(0, n - 64) for n in LOADS), LOADS, capacity_factor=1.25)
    with pytest.raises(ValueError, match="add up to 10, not tokens x k = 512"):
        C.check_dropped_slots(0, [5, 5])


def test_dropped_slots_round_up(capsys):
    # 100 tokens, k 2, 8 experts, factor 1.0: 25 exactly; factor 1.1: 27.5 -> 28
    loads = [40, 30, 25, 25, 20, 20, 20, 20]
    passes(capsys, C.check_dropped_slots, 12 + 2, loads, tokens=100, capacity_factor=1.1)
    fails("round the capacity up", C.check_dropped_slots, 13 + 3, loads, tokens=100,
          capacity_factor=1.1)


def test_ep_tp_mb(capsys):
    tokens, h, k, p, e = 4096, 4096, 2, 8, 2
    ep = 2 * tokens * k * h * e * 7 / 8 / 1e6
    tp = 2 * 8 * tokens * h * e * 7 / 8 / 1e6
    passes(capsys, C.check_ep_tp_mb, ep, tp)
    assert ep / tp == k / p                       # EP sends k / p of TP's bytes
    fails("two per layer forward", C.check_ep_tp_mb, ep / 2, tp)
    fails("k rows of h", C.check_ep_tp_mb, ep / k, tp)          # k = 2: also half
    fails("k rows of h", C.check_ep_tp_mb, ep / 2, tp, k=4)      # 2x the rows, / k
    fails(r"\(p-1\)/p", C.check_ep_tp_mb, ep * 8 / 7, tp)
    fails("two collectives", C.check_ep_tp_mb, ep, tp / 2)
    # bf16: half the bytes is also the count of values; named beside the other causes
    fails("count values, not bytes", C.check_ep_tp_mb, ep / 2, tp)
    fails("count values, not bytes", C.check_ep_tp_mb, ep, tp / 2)
    with pytest.raises(CheckError) as err:                  # fp32: no such coincidence
        reset_tries()
        C.check_ep_tp_mb(ep, tp, bytes_per_value=4)
    assert "count values" not in str(err.value) and "two per layer forward" in str(err.value)
    fails("whole group's p x tokens", C.check_ep_tp_mb, ep, tp / 8)
    fails("does not copy a token per expert", C.check_ep_tp_mb, ep, tp * 2)
    # k = 2: twice TP's is also four collectives (the attention's too): both named
    fails(r"copy a token per expert.*or did you count four collectives", C.check_ep_tp_mb,
          ep, tp * 2)
    fails(r"^(?!.*copy a token).*did you count four collectives", C.check_ep_tp_mb,
          ep * 2, tp * 2, k=4)                       # k = 4: four collectives alone
    fails("backward's two all-to-alls", C.check_ep_tp_mb, 2 * ep, tp)
    fails("swap the two answers", C.check_ep_tp_mb, tp, ep)
    fails("in MiB", C.check_ep_tp_mb, ep * 1e6 / 2 ** 20, tp)
    fails("in MiB", C.check_ep_tp_mb, ep, tp * 1e6 / 2 ** 20)


def test_ring_kv_mb(capsys):
    # Llama 3 8B at 128K on cp = 16 (Dubey et al. 2024, Table 4's CP for 128K tokens)
    block = 2 * (131072 // 16) * 8 * 128 * 2
    passes(capsys, C.check_ring_kv_mb, 15 * block / 1e6)
    fails("cp - 1 steps pass", C.check_ring_kv_mb, 16 * block / 1e6)
    fails("that is one step", C.check_ring_kv_mb, block / 1e6)
    fails("both K and V", C.check_ring_kv_mb, 15 * block / 2e6)
    fails("count values, not bytes", C.check_ring_kv_mb, 15 * block / 2e6)   # bf16: 2 bytes
    fails("kv_heads heads, not the query heads", C.check_ring_kv_mb, 15 * block * 4 / 1e6)
    fails("s / cp tokens", C.check_ring_kv_mb, 15 * block * 16 / 1e6)
    fails("in MiB", C.check_ring_kv_mb, 15 * block / 2 ** 20)
    fails("all 32 layers", C.check_ring_kv_mb, 32 * 15 * block / 1e6)
    fails("a backward too", C.check_ring_kv_mb, 2 * 15 * block / 1e6)
    passes(capsys, C.check_ring_kv_mb, 7 * block * 2 / 1e6, cp=8)


def test_three_digit_rounding_passes(capsys):
    """The notebook prints 117.4, 469.8 and 503.3 MB; a student's 117, 470 and 503 are
    right (3 significant digits: at most 0.5% off).  Before, 117 MB read "too low: compare
    each factor with the formula", sending a right answer hunting for a wrong factor."""
    passes(capsys, C.check_ep_tp_mb, 117, 470)
    passes(capsys, C.check_ep_tp_mb, 117.4, 469)
    passes(capsys, C.check_ring_kv_mb, 503)
    # rounded further (2 digits), or a little off: rounding named first, then the formula
    fails("rounded too far", C.check_ep_tp_mb, 120, 470)
    fails("rounded too far", C.check_ep_tp_mb, 117, 460)
    fails("rounded too far", C.check_ring_kv_mb, 500 * 0.99)
    # a known mistake is still named where it matches (within 2%), inside the 3% band too
    fails("in MiB", C.check_ep_tp_mb, 112, 470)
    fails("cp - 1 steps pass", C.check_ring_kv_mb, 536.9)


def test_value_only_from_the_third_try():
    for n in range(1, REVEAL_AFTER + 1):
        with pytest.raises(CheckError) as err:
            C.check_ring_kv_mb(1.0)
        assert ("expected 503.3 MB" in str(err.value)) == (n >= REVEAL_AFTER)
    assert "MB" in wb.exercises.reveal("check_ring_kv_mb")


# ---- the hand formulas against the library -------------------------------------------------

def test_ep_tp_formula_is_the_planners():
    cfg = get_config("mixtral-8x7b", n_layer=2, seq_len=4096)
    lay = Layout(dp=8, ep=8, global_batch=8)
    d = layer_detail(cfg, lay, Cluster("h100", 8).profile, "flash")
    ep_bytes, tp_bytes = C._ep_tp_bytes(4096, 4096, 2, 8, 2)
    counts = wire_bytes("all_to_all", 8 * 8, 8)      # the forward's 8 int64 counts (moetp)
    assert d["a2a_bytes"] - counts == pytest.approx(2 * ep_bytes, abs=4)   # fwd and bwd
    n = 8 * 4096 * 4096 * 2
    assert tp_bytes == wire_bytes("all_gather", n, 8) + wire_bytes("reduce_scatter", n, 8)


def test_ring_formula_is_the_planners():
    cfg = get_config("llama3-8b-128k")
    lay = Layout(dp=1, cp=16)
    r = ring_times(cfg, lay, Cluster("a100", 16).profile)
    want = 15 * 2 * (131072 // 16) * 8 * 128 * 2
    assert r.sent_forward == want == 15 * kv_block_bytes(cfg, lay)
    assert math.isclose(floats_mb(C, r.sent_forward), r.sent_forward / 1e6, rel_tol=1e-3)


def floats_mb(C, sent):
    """What check_ring_kv_mb expects, read from its message (MB)."""
    reset_tries()
    try:
        C.check_ring_kv_mb(-1.0)
    except CheckError as err:
        return float(err.expected.split()[0])
    finally:
        reset_tries()


def test_capacity_formula_is_the_layers():
    from workbench.ops.moe import capacity
    assert C._capacity(256, 8, 2, 1.0) == 64
    assert C._capacity(100, 8, 2, 1.1) == math.ceil(27.5) == 28
    for tokens, E, k, f in ((256, 8, 2, 1.0), (100, 8, 2, 1.1), (64, 4, 1, 1.25), (7, 3, 2, 0.5)):
        assert C._capacity(tokens, E, k, f) == capacity(tokens, E, k, f)


def test_dropped_slots_are_the_layers():
    # the count the check derives from the loads is what the MoE layer drops
    import torch
    from workbench.models.moe import moe_layers
    cfg = wb.models.get_config("tiny", moe_experts=8, moe_topk=2, moe_capacity_factor=1.0)
    layer = moe_layers(wb.models.build_model(cfg, seed=0))[0]
    torch.manual_seed(3)
    with torch.no_grad():
        layer(torch.randn(1, 256, cfg.d_model) * 3)
    st = layer.last_stats
    loads = st["tokens_per_expert"].tolist()
    C_ = C._capacity(256, 8, 2, 1.0)
    assert st["dropped"] == sum(max(0, n - C_) for n in loads) > 0
