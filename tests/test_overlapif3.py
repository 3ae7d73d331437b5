"""Each collective's group sets the SMs NCCL holds beside compute (``kernel_cost``'s
``collective_sms(profile, ranks)``: 24 for a group inside one 8-GPU NVSwitch node, 16
for one spanning nodes on an A100), in the planner (estimate's data-parallel sync,
``layer_cost``'s tensor-parallel overlap, ``context_cost``'s ring, ``ep_cp``'s ring
recompute, DeepSpeed 0.3's ZeRO-3) and in the dry run's clock (``sim_mesh.trace``).

Each caller is held to the same number priced on a copy of the profile whose
all-ranks figure (``topology.collective_sms``, used for every group) is the group's own:
equal to that copy, and apart from the copy with the other figure, so a caller that
ignored its group could not pass."""
import dataclasses

import pytest

import workbench as wb
from workbench.plan import Cluster, Layout, estimate
from workbench.plan import context_cost as X
from workbench.plan import ep_cp as EC
from workbench.plan.layer_cost import layer_ops
from workbench.plan.presets import get_config
from workbench.sim_mesh.cost import finish_beside, overlap_rate
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
INTRA, ACROSS = 24, 16          # a100.json: collective_sms_intra, collective_sms
PAIR = 2        # (0, 8): one rank per node, NCCL 2.12.7's search (sim_mesh.nccl_channels)


def _flat(sms):
    """The a100 profile with ``sms`` SMs for every group (no intra-node figure)."""
    return dataclasses.replace(A100, topology=dataclasses.replace(
        A100.topology, collective_sms=sms, collective_sms_intra=0))


def _uses_group_figure(price, own):
    """``price(profile)`` on the a100 profile equals it with ``own`` SMs for every group
    and differs from it with the other figure."""
    other = ACROSS if own == INTRA else INTRA
    got = price(A100)
    assert got == pytest.approx(price(_flat(own)), rel=1e-12)
    assert got != pytest.approx(price(_flat(other)), rel=1e-9)
    return got


def test_rates_of_a100_groups():
    assert A100.topology.collective_sms_intra == INTRA
    assert A100.topology.collective_sms == ACROSS
    assert overlap_rate(A100, (0, 1)) == pytest.approx(84 / 108)       # inside a node
    assert overlap_rate(A100, (0, 8)) == pytest.approx(106 / 108)      # one per node
    assert overlap_rate(A100, tuple(range(16))) == pytest.approx(92 / 108)  # two nodes
    assert overlap_rate(A100, (3,)) == 1.0                             # no kernel


# ---- the clock: finish_beside with each collective's rate -------------------------

def test_finish_beside_lowest_rate_in_flight():
    """Two collectives of different groups in flight: the compute runs at the lower
    rate (the SMs of the one holding most), not at the rate of their summed SMs."""
    busy = [(0.0, 4.0, 0.5), (2.0, 6.0, 0.8)]
    # [0, 2] at 0.5: 1.0 of work; [2, 4] at min(0.5, 0.8): 1.0; [4, 6] at 0.8: 1.6;
    # the last 1.4 alone from 6
    assert finish_beside(0.0, 5.0, None, busy) == pytest.approx(7.4)
    assert finish_beside(0.0, 0.5, None, busy) == pytest.approx(1.0)
    assert finish_beside(5.0, 0.4, None, busy) == pytest.approx(5.5)
    assert finish_beside(7.0, 1.0, None, busy) == 8.0
    # one rate in flight: the pairs' path, to the bit
    same = [(0.0, 4.0, 0.5), (2.0, 6.0, 0.5)]
    assert finish_beside(1.0, 3.0, None, same) == finish_beside(
        1.0, 3.0, 0.5, [(0.0, 4.0), (2.0, 6.0)])
    # a rate of 1 (a group of one rank) stretches nothing
    assert finish_beside(0.0, 2.0, None, [(0.0, 4.0, 1.0)]) == 2.0


def test_trace_tp_group_inside_node_and_dp_group_across():
    """The dry run's clock: compute beside an async collective over ranks (0, 1) (one
    node) runs on the 84 SMs of 108 NCCL's 24 leave; over (0, 8) (two nodes, one rank
    each), on 106."""
    for group, sms in (((0, 1), INTRA), ((0, 8), PAIR)):
        tr = wb.Trace("a100")
        tr.record_collective(group, "all_reduce", 3.0, overlap=True)
        ev = tr.record_compute([0], "matmul", 1.0)
        assert ev.duration == pytest.approx(108 / (108 - sms))
        assert ev.args["alone"] == 1.0
    # both in flight on rank 0: the tp group's 24 SMs set the rate; rank 8 sees the dp
    # group's only
    tr = wb.Trace("a100")
    tr.record_collective((0, 1), "all_reduce", 3.0, overlap=True)
    tr.record_collective((0, 8), "all_reduce", 3.0, overlap=True)
    assert tr.record_compute([0], "a", 1.0).duration == pytest.approx(108 / 84)
    assert tr.record_compute([8], "b", 1.0).duration == pytest.approx(108 / 106)


def test_trace_input_gradient_restretch_uses_its_group():
    """A collective recorded after the wgrad it runs beside (``ready`` earlier) stretches
    that wgrad at its own group's rate."""
    for group, sms in (((0, 1), INTRA), ((0, 8), PAIR)):
        tr = wb.Trace("a100")
        ranks = sorted(group)
        tr.record_compute(ranks, "dgrad", 1.0)
        ev = tr.record_compute(ranks, "wgrad", 1.0)
        assert ev.duration == 1.0
        tr.record_collective(group, "all_reduce", 5.0, overlap=True, ready=1.0)
        wgrad = [e for e in tr.events if e.name == "wgrad"][0]
        assert wgrad.duration == pytest.approx(108 / (108 - sms))


def test_dry_run_zero2_inside_one_node_stretches_at_24_sms():
    """The dry run of a dp 2 ZeRO-2 step (both ranks in one node): every op stretched
    beside the reduce-scatters runs at no less than 84/108 of its speed, and some at
    exactly that (none at the all-ranks 92/108 alone)."""
    from workbench.plan.agree import compare
    cfg = get_config("gpt3-175b", n_layer=1, d_model=256, n_head=4, seq_len=256)
    lay = Layout(dp=2, micro_batch=1, global_batch=2, zero=2)
    a = compare(cfg, lay, Cluster("a100", 2))
    assert a.agrees, a.problems()
    stretched = [e for e in a.dry_run.trace.events if e.stream == "compute" and "alone" in e.args]
    assert stretched
    ratios = [e.args["alone"] / e.duration for e in stretched]
    assert min(ratios) == pytest.approx(84 / 108, rel=1e-9)
    assert all(r >= 84 / 108 - 1e-12 for r in ratios)


# ---- the planner ------------------------------------------------------------------

CFG = get_config("gpt3-175b", n_layer=2, d_model=1024, n_head=16, seq_len=1024)


@pytest.mark.parametrize("world, own", [(2, INTRA), (16, ACROSS)])
def test_estimate_zero2_dp_sync_uses_dp_group(world, own):
    """estimate's ZeRO-2 sync (``_dp_sync``, the recipe's reduce-scatters beside the
    backward): dp 2 inside a node at 24 SMs, dp 16 over two nodes at 16."""
    lay = Layout(dp=world, tp=1, pp=1, global_batch=2 * world, zero=2, framework="workbench")

    def price(prof):
        return estimate(CFG, lay, Cluster(prof, world), attention="flash").details["dp_sync"]
    _uses_group_figure(price, own)


@pytest.mark.parametrize("world, own", [(2, INTRA), (16, ACROSS)])
def test_estimate_overlap_grad_reduce_uses_dp_group(world, own):
    """Megatron-LM's --overlap-grad-reduce (ZeRO-1: reduce-scatters beside the last
    backward, gathers beside the next forward) at the dp group's figure."""
    lay = Layout(dp=world, tp=1, pp=1, global_batch=2 * world, zero=1)
    # layers of 50M parameters: one Megatron-core bucket each (max(40M, 1M x dp),
    # plan.megatron_buckets), so the reduce-scatters overlap the backward (with CFG's
    # 12.6M layers the whole model is one bucket, reduced after the backward)
    cfg = get_config("gpt3-175b", n_layer=2, d_model=2048, n_head=16, seq_len=1024)

    def price(prof):
        return estimate(cfg, lay, Cluster(prof, world), attention="flash",
                        overlap_grad_reduce=True).details["dp_sync"]
    _uses_group_figure(price, own)


@pytest.mark.parametrize("world, own", [(2, INTRA), (16, ACROSS)])
def test_zero3_2021_uses_dp_group(world, own):
    """DeepSpeed v0.3's ZeRO-3 (``plan.zero3_2021``): its simulated stream at the dp
    group's figure."""
    # wide enough that compute, not the collectives, bounds the stream; v0.3: fp16 only
    cfg = get_config("gpt3-175b", n_layer=2, d_model=4096, n_head=32, seq_len=2048,
                     dtype="float16")
    lay = Layout(dp=world, tp=1, pp=1, zero=3, recompute="full", micro_batch=2,
                 global_batch=2 * world, framework="deepspeed-0.3")

    def price(prof):
        return estimate(cfg, lay, Cluster(prof, world)).details["dp_sync"]
    _uses_group_figure(price, own)


@pytest.mark.parametrize("tp_ranks, own", [((0, 1), INTRA), ((0, 8), ACROSS)])
def test_layer_cost_async_tp_all_reduce_uses_tp_group(tp_ranks, own):
    """Megatron's async input-gradient all-reduce beside the weight-gradient GEMM
    (``layer_cost``): the GEMM stretched at the tp group's figure."""
    def price(prof):
        ops = layer_ops(1024, 16, 1024, 1, 2, profile=prof, tp_ranks=tp_ranks)
        beside = {o.overlaps for o in ops if o.overlaps}
        assert beside
        return tuple(o.seconds for o in ops if o.name in beside)
    alone = price(_flat(0))
    got = _uses_group_figure(price, own)
    assert all(g > a for g, a in zip(got, alone))


LLAMA = get_config("llama3-8b", n_layer=2, seq_len=32768, vocab_size=32000)


@pytest.mark.parametrize("tp, own", [(1, INTRA), (8, ACROSS)])
def test_ring_attention_uses_cp_group(tp, own):
    """Ring attention's blocks beside their K/V hops (``context_cost.ring_times``): cp 2
    with tp 1 is ranks (0, 1), one node; with tp 8, ranks (0, 8), two nodes."""
    lay = Layout(dp=1, tp=tp, cp=2, sp=tp > 1)
    assert X.ring_ranks(lay) == ((0, 1) if tp == 1 else (0, 8))

    def price(prof):
        r = X.ring_times(LLAMA, lay, prof)
        return r.forward, r.backward
    _uses_group_figure(price, own)


@pytest.mark.parametrize("tp, own", [(1, INTRA), (8, ACROSS)])
def test_ring_op_recompute_uses_cp_group(tp, own):
    """The recipe's ring forward run again under op-level recompute
    (``ep_cp._op_sac_ring``): its merges beside the hops at the cp group's figure."""
    lay = Layout(dp=1, tp=tp, cp=2, sp=tp > 1, recompute="op", framework="workbench")

    def price(prof):
        rows = EC._op_sac_ring(lay, X.ring_times(LLAMA, lay, prof), prof)
        assert rows
        return tuple(r[3] for r in rows)
    _uses_group_figure(price, own)
