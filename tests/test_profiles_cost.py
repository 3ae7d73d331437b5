"""Profiles, the alpha-beta cost model and the paper estimates, held to the
figures in shared/reference/published.md."""
import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from workbench.sim_mesh import cost, estimates
from workbench.sim_mesh.profiles import (Link, get_profile, list_profiles,
                                         load_profile)

LINK = Link("test", bandwidth=1e9, latency=1e-6)  # beta = 1 ns/byte, alpha = 1 us
FEW = settings(max_examples=40, deadline=None)
ranks_p = st.integers(1, 64)
sizes = st.integers(0, 2**34)


# ---- profiles --------------------------------------------------------------

def test_builtin_profiles_load_with_sources():
    names = list_profiles()
    assert {"a100", "h100", "ascend-910b"} <= set(names)
    for name in names:
        p = get_profile(name)
        assert p.name == name and p.sources and all(isinstance(s, str) for s in p.sources)
        assert "assumption" in p.notes.lower()  # latencies are assumed, and say so
        assert {"float32", "bfloat16", "float16"} <= set(p.peak_flops)


def test_datasheet_numbers():
    a, h, n = get_profile("a100"), get_profile("h100"), get_profile("ascend-910b")
    assert a.peak("bfloat16") == 312e12 and a.memory_bandwidth == 2.039e12
    assert a.intra_node.bandwidth == 300e9 and a.inter_node.bandwidth == 200e9 / 8
    assert a.devices_per_node == h.devices_per_node == n.devices_per_node == 8
    assert h.peak(torch.bfloat16) == 989e12 and h.memory_bandwidth == 3.35e12
    assert h.intra_node.bandwidth == 450e9 and h.inter_node.bandwidth == 400e9 / 8
    assert 313e12 <= n.peak("fp16") <= 376e12 and n.inter_node.bandwidth == 200e9 / 8
    assert n.memory_bytes == 64e9
    assert "uncertain" in n.notes.lower() and "third" in " ".join(n.sources).lower()
    assert 7 * 56e9 / 2 <= n.intra_node.bandwidth <= 7 * 56e9


def test_get_profile_default_identity_and_errors():
    assert get_profile().name == get_profile(None).name == "a100"
    p = get_profile("H100")
    assert get_profile(p) is p and get_profile(" h100 ") is p
    with pytest.raises(ValueError, match=r"'tpu'.*a100.*ascend-910b.*h100"):
        get_profile("tpu")
    with pytest.raises(TypeError, match="profile name"):
        get_profile(3)


def test_dtype_spellings_and_missing_peak():
    a = get_profile("a100")
    assert a.peak(torch.float16) == a.peak("half") == a.peak("fp16") == 312e12
    assert a.peak(torch.float32) == 19.5e12 and a.peak("tf32") == 156e12
    with pytest.raises(ValueError, match="dtype=.*int8"):
        a.peak("int8")
    with pytest.raises(ValueError, match="has no peak for dtype='tf32'"):
        get_profile("ascend-910b").peak("tf32")


def test_load_profile_round_trip_and_errors(tmp_path):
    data = get_profile("h100").to_dict()
    data.update(name="my-h100", devices_per_node=4)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    mine = load_profile(path)
    assert mine.name == "my-h100" and mine.devices_per_node == 4
    assert mine.to_dict() == data and hash(mine) == hash(load_profile(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    del data["peak_flops"]["bfloat16"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks.*bfloat16"):
        load_profile(path)
    with pytest.raises(ValueError, match="bandwidth=-1"):
        Link("bad", bandwidth=-1, latency=0)


def test_profile_is_frozen():
    p = get_profile("a100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.devices_per_node = 4
    with pytest.raises(TypeError):
        p.peak_flops["float32"] = 1.0


# ---- alpha-beta formulas (published.md, "Collectives") ---------------------

@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_ring_formulas(p):
    a, b, n = LINK.latency, 1 / LINK.bandwidth, 2**20 * 3

    def t(kind, alg="ring"):
        return cost.collective_time(kind, n, p, LINK, alg)
    assert t("all_gather") == pytest.approx((p - 1) * a + (p - 1) / p * n * b)
    assert t("reduce_scatter") == pytest.approx((p - 1) * a + (p - 1) / p * n * b)
    assert t("all_reduce") == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * n * b)
    assert t("all_to_all") == pytest.approx((p - 1) * a + (p - 1) / p * n * b)
    assert t("broadcast") == t("send_recv") == pytest.approx(a + n * b)
    L = math.ceil(math.log2(p))
    assert t("all_reduce", "tree") == pytest.approx(2 * L * a + 2 * (p - 1) / p * n * b)
    assert t("broadcast", "tree") == pytest.approx(L * (a + n * b))


def test_wire_bytes_integer_exact():
    n = 8 * 1000
    assert cost.wire_bytes("all_reduce", n, 8) == 14000
    assert cost.wire_bytes("all_gather", n, 8) == cost.wire_bytes("reduce_scatter", n, 8) == 7000
    assert cost.wire_bytes("all_to_all", n, 8) == 7000
    assert cost.wire_bytes("broadcast", n, 8) == cost.wire_bytes("send_recv", n, 2) == n
    assert cost.wire_bytes("all_gather", 10, 4) == 7  # mean 7.5 rounded down
    assert all(cost.wire_bytes(k, n, 1) == 0 for k in cost.KINDS)


@FEW
@given(kind=st.sampled_from(cost.KINDS), n=sizes, p=ranks_p)
def test_trivial_groups_cost_nothing(kind, n, p):
    assert cost.collective_time(kind, n, 1, LINK) == 0.0
    assert cost.collective_time(kind, 0, p, LINK) == 0.0
    assert isinstance(cost.wire_bytes(kind, n, p), int)


@FEW
@given(kind=st.sampled_from(cost.KINDS), n=st.integers(1, 2**34), p=st.integers(2, 64))
def test_ring_busbw_equals_link_bandwidth_without_latency(kind, n, p):
    # nccl-tests' busbw is defined so that a bandwidth-optimal ring reads the link.
    link = Link("no-latency", bandwidth=12.5e9, latency=0.0)
    seconds = cost.collective_time(kind, n, p, link)
    assert cost.bus_bandwidth(kind, n, p, seconds) == pytest.approx(12.5e9)
    assert cost.alg_bandwidth(n, seconds) == pytest.approx(n / seconds)


def test_busbw_factors():
    n, s, p = 1e9, 0.5, 8
    algbw = n / s
    assert cost.bus_bandwidth("all_reduce", n, p, s) == pytest.approx(algbw * 14 / 8)
    for k in ("all_gather", "reduce_scatter", "all_to_all"):
        assert cost.bus_bandwidth(k, n, p, s) == pytest.approx(algbw * 7 / 8)
    assert cost.bus_bandwidth("broadcast", n, p, s) == pytest.approx(algbw)


# ---- hierarchical and the group-to-link mapping ----------------------------

def test_hierarchical_all_reduce_decomposition():
    a = get_profile("a100")
    intra, inter, n = a.intra_node, a.inter_node, 2**30
    expect = (cost.collective_time("reduce_scatter", n, 8, intra)
              + cost.collective_time("all_reduce", n / 8, 4, inter)
              + cost.collective_time("all_gather", n, 8, intra))
    assert cost.hierarchical_time("all_reduce", n, 8, 4, intra, inter) == pytest.approx(expect)
    flat = cost.collective_time("all_reduce", n, 32, inter)
    assert cost.hierarchical_time("all_reduce", n, 8, 4, intra, inter) < flat / 4
    # one node: the hierarchical form is the intra-node ring
    assert cost.hierarchical_time("all_reduce", n, 8, 1, intra, inter) == pytest.approx(
        cost.collective_time("all_reduce", n, 8, intra))


@FEW
@given(kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]),
       pl=st.integers(1, 8), pg=st.integers(1, 8), k=st.integers(1, 1000))
def test_hierarchical_moves_no_extra_bytes(kind, pl, pg, k):
    n = k * pl * pl * pg  # divisible so that every phase is integer-exact
    share = {"all_reduce": [("reduce_scatter", n, pl), ("all_reduce", n // pl, pg),
                            ("all_gather", n, pl)],
             "all_gather": [("all_gather", n // pl, pg), ("all_gather", n, pl)],
             "reduce_scatter": [("reduce_scatter", n, pl), ("reduce_scatter", n // pl, pg)]}
    phases = sum(cost.wire_bytes(kk, nn, pp) for kk, nn, pp in share[kind])
    assert phases == cost.wire_bytes(kind, n, pl * pg)


def test_link_for_and_price_mapping():
    a = get_profile("a100")
    assert cost.link_for(range(8), a) is a.intra_node
    assert cost.link_for([0, 8], a) is a.inter_node
    assert cost.link_for([8, 15], a) is a.intra_node
    n = 2**28
    # collectives run at the links' effective rate (line rate x NCCL's efficiency)
    intra, inter = (Link(l.name, l.effective_bandwidth, l.latency) for l in
                    (a.intra_node, a.inter_node))
    assert intra.bandwidth == pytest.approx(300e9 * 0.783) and inter.bandwidth == 24e9
    # inside a node NCCL's protocols replace the link's alpha (topology.Topology.protocols):
    # 256 MiB runs Simple, 8.4 us + 3.4 us per step (NCCL tuning.cc)
    assert cost.price("all_reduce", n, range(8), a, "ring") == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 14 / 8 * n / intra.bandwidth)
    # across nodes NCCL's tuning model with its network figures (2.12.7, Simple): one
    # rank on each of 3 nodes, all 4 steps cross nodes at 28 us, on one NIC
    assert cost.price("all_reduce", n, [0, 8, 16], a, "ring") == pytest.approx(
        8.4e-6 + 4 * 28e-6 + 4 / 3 * n / inter.bandwidth)
    assert cost.price("all_reduce", n, range(16), a, "hierarchical") == pytest.approx(
        cost.price("reduce_scatter", n, range(8), a) + cost.collective_time(
            "all_reduce", n / 8, 2, inter) + cost.price("all_gather", n, range(8), a))
    # NCCL runs a flat ring over both nodes: 8 rails of 24 GB/s carry it at 192 GB/s,
    # faster than the hierarchical phases (which put only n/8 on one NIC each)
    auto = cost.price("all_reduce", n, range(16), a)
    ring = cost.price("all_reduce", n, range(16), a, "ring")
    # 8 x 24 GB/s; 28 NVLink steps and 2 network steps (Simple)
    assert ring == pytest.approx(8.4e-6 + 28 * 3.4e-6 + 2 * 28e-6 + 2 * 15 / 16 * n / 192e9)
    tree = cost.price("all_reduce", n, range(16), a, "tree")  # 2 nodes: depth 1, chain of 8
    # LL128's tree: 4.4 + 2 (7 x 1.25 + 1 x 8.5) us + 2n / (0.8625 x 192 GB/s) beats
    # Simple's 2 (7 + 1) x 28 us + 2n / (0.92 x 192 GB/s)
    assert tree == pytest.approx(4.4e-6 + 2 * (7 * 1.25e-6 + 8.5e-6) + 2 * n / (0.8625 * 192e9))
    assert auto == min(ring, tree)
    assert auto < cost.price("all_reduce", n, range(16), a, "hierarchical")
    assert cost.price("all_reduce", n, [3], a) == cost.price("all_reduce", 0, range(8), a) == 0.0


@FEW
@given(kind=st.sampled_from(cost.KINDS), n=st.integers(1, 2**32),
       ranks=st.sets(st.integers(0, 31), min_size=2, max_size=32),
       profile=st.sampled_from(["a100", "h100", "ascend-910b"]))
def test_auto_is_the_cheapest(kind, n, ranks, profile):
    ranks = sorted(ranks)
    auto = cost.price(kind, n, ranks, profile)
    pick = cost.choose(kind, n, ranks, profile)
    # auto is what the library runs: the cheapest of the algorithms it chooses from
    assert auto == pick.seconds == min(pick.candidates.values())
    assert all(cost.price(kind, n, ranks, profile, a) == t for a, t in pick.candidates.items())
    assert auto == cost.price(kind, n, list(reversed(ranks)), profile)  # order-free
    assert auto > 0


def test_compute_time_roofline():
    # a profile without efficiencies or launch cost is the ideal roofline
    ideal = dataclasses.replace(get_profile("a100"), name="ideal", efficiency={},
                                memory_efficiency=1.0, launch_overhead=0.0)
    assert cost.compute_time(312e12, 0, ideal, torch.bfloat16) == pytest.approx(1.0)
    assert cost.compute_time(1, 2.039e12, ideal, "bf16") == pytest.approx(1.0)
    assert cost.compute_time(19.5e12, 1e9, ideal, torch.float32) == pytest.approx(1.0)
    # the built-in A100: measured efficiencies (GEMM 0.827, HBM 0.88) and 1 us per launch
    a = get_profile("a100")
    assert cost.compute_time(312e12, 0, a, torch.bfloat16, "matmul") == pytest.approx(
        1 / 0.827 + 1e-6)
    assert cost.compute_time(1, 2.039e12, "a100", "bf16") == pytest.approx(1 / 0.88 + 1e-6)
    assert cost.compute_time(1, 2.039e12, "a100", "bf16", launches=0) == pytest.approx(1 / 0.88)


@pytest.mark.parametrize("call, match", [
    (lambda: cost.collective_time("allreduce", 1, 2, LINK), r"kind='allreduce'.*all_reduce"),
    (lambda: cost.collective_time("all_reduce", -1, 2, LINK), r"nbytes=-1.*>= 0"),
    (lambda: cost.collective_time("all_reduce", 1, 0, LINK), r"p=0.*>= 1"),
    (lambda: cost.collective_time("all_reduce", 1, 2, LINK, "mesh"), r"algorithm='mesh'"),
    (lambda: cost.wire_bytes("gather", 1, 2), r"kind='gather'"),
    (lambda: cost.price("all_reduce", 1, [0, 0], "a100"), r"holds a rank twice"),
    (lambda: cost.price("all_reduce", 1, [], "a100"), r"ranks=\[\]"),
    (lambda: cost.price("all_reduce", 1, [0, 1, 8], "a100", "hierarchical"), r"\[2, 1\]"),
    (lambda: cost.hierarchical_time("send_recv", 1, 2, 2, LINK, LINK), r"point-to-point"),
    (lambda: cost.compute_time(-1, 0, "a100", "bf16"), r"flops=-1"),
    (lambda: cost.bus_bandwidth("all_reduce", 1, 2, 0), r"seconds=0"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- estimates (published.md, "Compute" and "Memory") ----------------------

def test_gpt3_parameters_and_flops():
    assert round(estimates.megatron_params(96, 12288, 51200, 2048) / 1e9, 1) == 174.6
    assert round(estimates.megatron_params(80, 12288, 51200, 2048) / 1e9, 1) == 145.6
    assert f"{estimates.training_flops(174.6e9, 300e9):.2e}" == "3.14e+23"


def test_gpt3_training_days_on_a100():
    # 3.14e23 FLOPs on 1000 A100 (312e12) at 50% is 23.3 days, not 22; the quoted
    # "about 22 days" corresponds to 53% of peak. We keep the arithmetic honest.
    days = estimates.training_days(3.14e23, 1000, get_profile("a100").peak("bf16"), 0.5)
    assert round(days, 1) == 23.3
    assert round(estimates.utilization_for_days(3.14e23, 1000, 312e12, 22), 2) == 0.53
    with pytest.raises(ValueError, match="utilization=1.5"):
        estimates.training_days(1e20, 8, 312e12, 1.5)


def test_megatron_and_model_flops():
    B, s, l, h, V = 1, 2048, 96, 12288, 51200
    # eq. 3 (with recompute) is 4/3 of eq. 7 (without) up to the logit term.
    ratio = estimates.megatron_flops(B, s, l, h, V) / estimates.model_flops(B, s, l, h, V)
    assert 1.3 < ratio < 4 / 3
    assert estimates.model_flops(B, s, l, h, V) == pytest.approx(
        72 * B * l * s * h**2 * (1 + s / (6 * h) + V / (12 * h * l)))
    assert estimates.mfu(312e12 * 8 * 0.5, 1.0, 312e12, 8) == pytest.approx(0.5)


def test_zero_figure_1():
    gb = [estimates.zero_model_state_bytes(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    with pytest.raises(ValueError, match="stage=4"):
        estimates.zero_model_state_bytes(1e9, 8, 4)


def test_activation_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h

    def f(case, tp=t):
        return estimates.activation_bytes_per_layer(s, b, h, a, tp, case)
    assert f("none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert f("tp", 1) == pytest.approx(f("none"))  # t = 1 is no parallelism
    assert f("tp+sp") == pytest.approx(f("none") / t)
    assert f("tp+selective") == pytest.approx(sbh * (10 + 24 / t))
    assert f("tp+sp+selective") == pytest.approx(34 * sbh / t)
    assert f("full") == 2 * sbh
    with pytest.raises(ValueError, match="case='sp'"):
        f("sp")
