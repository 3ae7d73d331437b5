"""NCCL's protocols inside a node and the SMs a collective takes from an overlapped
GEMM (sim_mesh/topology.py, cost.overlap), held to the cited figures."""
import dataclasses

import pytest

from workbench.plan.layer_cost import layer_ops
from workbench.sim_mesh import cost
from workbench.sim_mesh import topology as topo
from workbench.sim_mesh.profiles import Topology, get_profile

A100 = get_profile("a100")
BUS = 0.783 * 300e9  # NCCL tuning.cc: sm80 bus bandwidth capped at 235 GB/s


def _nccl(kind, n, base, step, factor, p=8):
    """NCCL tuning.cc: base + nsteps x step + n x nsteps / p / (busbw x factor)."""
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    return base + steps * step + n * steps / p / (BUS * factor)


@pytest.mark.parametrize("n, proto, base, step, factor", [
    (2 ** 10, "LL", 3.6e-6, 0.47e-6, 0.25),
    (2 ** 23, "LL128", 10.0e-6, 1.9e-6, 0.92),
    (2 ** 28, "Simple", 8.4e-6, 3.4e-6, 1.0),
])
def test_all_reduce_protocol_by_size(n, proto, base, step, factor):
    pick = cost.choose("all_reduce", n, range(8), A100)
    assert pick.algorithm == "ring" and f"protocol {proto}" in pick.reason
    assert topo.protocol_of("all_reduce", n, topo.group_of(range(8), A100), A100) == proto
    assert pick.seconds == pytest.approx(_nccl("all_reduce", n, base, step, factor))


def test_all_gather_uses_its_own_ll_factor():
    # LL carries 1/3 of the bus bandwidth for all_gather, 1/4 for all_reduce (tuning.cc)
    n = 2 ** 12
    assert cost.price("all_gather", n, range(8), A100) == pytest.approx(
        _nccl("all_gather", n, 3.6e-6, 0.47e-6, 0.333))   # 1/3 to 3 digits


def test_bus_bandwidth_grows_with_size_below_the_cap():
    sizes = [2 ** k for k in range(10, 33, 2)]
    busbw = [cost.bus_bandwidth("all_reduce", n, 8, cost.price("all_reduce", n, range(8), A100))
             for n in sizes]
    assert all(a < b for a, b in zip(busbw, busbw[1:]))
    assert busbw[-1] < BUS and busbw[-1] > 0.99 * BUS   # 4 GiB: within 1% of 235 GB/s
    # 100 MB (Megatron's TP all-reduce of Table 4) is still 7% below it: latency counts
    n = 2048 * 4 * 6144 * 2
    t = cost.price("all_reduce", n, range(8), A100)
    assert cost.bus_bandwidth("all_reduce", n, 8, t) == pytest.approx(0.93 * BUS, rel=0.01)


def test_h100_protocols_from_the_current_tuning_model():
    # NCCL master's constants: LL 6.6 + 0.6 us/step, capped at 141 GB/s on Hopper
    h100, bus = get_profile("h100"), 0.822 * 450e9
    n = 2 ** 10
    assert cost.price("all_reduce", n, range(8), h100) == pytest.approx(
        6.6e-6 + 14 * 0.6e-6 + 14 / 8 * n / (bus * 0.381))
    n = 2 ** 30
    assert cost.price("all_reduce", n, range(8), h100) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 14 / 8 * n / bus)


def test_profiles_without_protocols_keep_the_alpha_beta_ring():
    bare = dataclasses.replace(A100, name="bare", topology=Topology())
    n = 2 ** 28
    link = bare.intra_node
    assert not bare.topology.protocols
    assert cost.price("all_reduce", n, range(8), bare) == pytest.approx(
        14 * link.latency + 14 / 8 * n / link.effective_bandwidth)
    # across nodes: no net protocols, the alpha-beta ring on NCCL's rails
    assert topo.protocol_of("all_reduce", n, topo.group_of(range(16), bare), bare) == ""
    rails = 8 * bare.inter_node.effective_bandwidth
    assert cost.price("all_gather", n, range(16), bare) == pytest.approx(
        15 * bare.inter_node.latency + 15 / 16 * n / rails)


# NCCL 2.12.7's tuning model across nodes (src/graph/tuning.cc, commit 3c223c10), by hand
_RING_NET = {   # protocol: base, intra step, inter step, factor (ppn >= 2), cap
    "LL": (3.6e-6, 0.47e-6 * 1.8, 2.7e-6, 0.25, 19.0e9),
    "LL128": (10e-6, 1.9e-6, 4.0e-6, 0.92, float("inf")),
    "Simple": (8.4e-6, 3.4e-6, 28e-6, 1.0, float("inf"))}


def _ring_net(kind, n, p, nodes, proto, rate):
    base, intra, inter, f, cap = _RING_NET[proto]
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    cross = 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
    share = (2 if kind == "all_reduce" else 1) * (p - 1) / p
    return base + (steps - cross) * intra + cross * inter + share * n / min(rate * f, cap)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("n, nodes", [(2 ** 12, 4), (2 ** 20, 32), (2 ** 30, 192)])
def test_ring_across_nodes_by_the_tuning_model(kind, n, nodes):
    p, rate = 8 * nodes, 8 * 24e9                 # 8 rails of NCCL's 24 GB/s per node
    want = min(_ring_net(kind, n, p, nodes, proto, rate) for proto in _RING_NET)
    assert cost.price(kind, n, range(p), A100, "ring") == pytest.approx(want)
    g = topo.group_of(range(p), A100)
    times = {pr: _ring_net(kind, n, p, nodes, pr, rate) for pr in _RING_NET}
    assert topo.protocol_of(kind, n, g, A100) == min(times, key=times.get)


def test_ring_latency_grows_with_ranks_at_scale():
    # 1,536 ranks on 192 DGX A100: a 1 MB all_gather is latency-bound: 1,344 NVLink steps
    # and 191 network steps of LL (3.6 + 1344 x 0.846 + 191 x 2.7 us = 1.66 ms) against
    # 1 MB / 19 GB/s (LL's cap) = 55 us of bandwidth
    t = cost.price("all_gather", 2 ** 20, range(1536), A100)
    assert t == pytest.approx(3.6e-6 + 1344 * 0.846e-6 + 191 * 2.7e-6
                              + 1535 / 1536 * 2 ** 20 / 19.0e9)
    assert cost.choose("all_gather", 2 ** 20, range(1536), A100).reason.endswith(
        "protocol LL (the fastest by the library's tuning model)")
    # doubling the ranks doubles it; the bandwidth term stays
    assert cost.price("all_gather", 2 ** 20, range(3072), A100) > 1.9 * t


def test_tree_all_reduce_by_the_tuning_model():
    # one rank on each of 64 nodes, 4 KiB: LL tree, 4.4 + 2 (0 + 6 x 5.0) us + 2n / bw
    ranks, n = range(0, 8 * 64, 8), 2 ** 12
    pick = cost.choose("all_reduce", n, ranks, A100)
    assert pick.algorithm == "tree" and "protocol LL" in pick.reason
    bw = min(24e9 * 0.2421, 19.0e9)
    assert pick.seconds == pytest.approx(4.4e-6 + 2 * 6 * 5.0e-6 + 2 * n / bw)
    # 8 ranks on each of 16 nodes, 1 GiB: Simple; tree 0 + 2 (7 x 28 + 4 x 28) us + 2n /
    # (0.92 x 192 GB/s) loses to the ring's 2(p-1)/p n / 192 GB/s
    n = 2 ** 30
    tree = cost.price("all_reduce", n, range(128), A100, "tree")
    assert tree == pytest.approx(2 * (7 + 4) * 28e-6 + 2 * n / (0.92 * 192e9))
    assert cost.choose("all_reduce", n, range(128), A100).algorithm == "ring"


def test_overlap_takes_the_collectives_sms():
    r = (108 - 16) / 108                       # NCCL's 16 SMs of the A100's 108
    g, c = 1e-3, 0.5e-3                        # GEMM longer than the collective
    assert cost.overlap(g, c, A100) == pytest.approx((g + (1 - r) * c, 0.0))
    g, c = 0.2e-3, 1e-3                        # collective longer: the GEMM ends at g / r
    assert cost.overlap(g, c, A100) == pytest.approx((g / r, c - g / r))
    assert cost.overlap(g, 0.0, A100) == (g, 0.0)
    # the H100: NCCL's 16 SMs (ASSUMPTION, as the A100's) of its 132 (whitepaper)
    r = (132 - 16) / 132
    assert cost.overlap(1e-3, 0.4e-3, "h100") == pytest.approx((1e-3 + (1 - r) * 0.4e-3, 0.0))
    # no SM figures (910B: not cited): the plain max
    assert cost.overlap(1e-3, 1.5e-3, "ascend-910b") == pytest.approx((1e-3, 0.5e-3))


def test_layer_gemms_beside_collectives_are_stretched():
    kw = dict(h=6144, a=64, s=2048, b=4, tp=8, dtype="float16", profile="a100")
    ops = {(o.phase, o.name): o for o in layer_ops(**kw)}
    # weight gradients [h, 4h/t] and [h, 3h/t]: their tiles run in more waves on the SMs
    # NCCL leaves (cost.overlap with the GEMM's output shape and the tp group, ranks 0..7
    # inside one node: 24 SMs)
    for gemm, comm, out in (("fc1_wgrad", "tp_grad_fc1", (1, 6144, 3072)),
                            ("qkv_wgrad", "tp_grad_qkv", (1, 6144, 2304))):
        g, c = ops["backward", gemm], ops["backward", comm]
        alone = cost.compute_time(g.flops, g.bytes, A100, "float16", "matmul", gemm=out)
        assert (g.seconds, c.exposed) == pytest.approx(
            cost.overlap(alone, c.seconds, A100, gemm=out, ranks=range(8)))
        assert g.seconds > alone
    fwd = ops["forward", "fc1_gemm"]
    assert fwd.seconds == cost.compute_time(fwd.flops, fwd.bytes, A100, "float16", "matmul",
                                            gemm=(1, 4 * 2048, 3072))


@pytest.mark.parametrize("kw, match", [
    (dict(protocols={"LL": {"base_latency": 1e-6}}), r"protocols\['LL'\] must hold exactly"),
    (dict(protocols={"LL": {"base_latency": 2.0, "step_latency": 0, "bandwidth_factor": 1,
                            "all_reduce_bandwidth_factor": 1}}), r"base_latency'\]=2.0"),
    (dict(protocols={"LL": {"base_latency": 0, "step_latency": 0, "bandwidth_factor": 1.5,
                            "all_reduce_bandwidth_factor": 1}}), r"bandwidth_factor'\]=1.5"),
    (dict(sm_count=108, collective_sms=108), r"collective_sms=108 must be fewer"),
    (dict(sm_count=-1), r"sm_count=-1"),
])
def test_topology_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kw)


def test_overlap_errors_and_round_trip():
    with pytest.raises(ValueError, match=r"comm_seconds=-1"):
        cost.overlap(1.0, -1, A100)
    back = type(A100).from_dict(A100.to_dict())
    assert back.topology == A100.topology and dict(back.topology.protocols) == dict(
        A100.topology.protocols)
    assert dataclasses.replace(A100).topology.sm_count == 108


def test_all_to_all_inside_a_node_pays_protocol_steps():
    # ASSUMPTION (topology.py): p - 1 steps like all_gather, on (p-1)/p of the bytes,
    # so it never costs more than the all_gather of the same buffer
    for n in (2 ** 8, 2 ** 20, 2 ** 28):
        a2a = cost.choose("all_to_all", n, range(8), A100)
        assert a2a.algorithm == "pairwise" and "protocol" in a2a.reason
        assert a2a.seconds == pytest.approx(cost.price("all_gather", n, range(8), A100))
    n = 2 ** 28
    assert cost.price("all_to_all", n, range(8), A100) == pytest.approx(
        _nccl("all_gather", n, 8.4e-6, 3.4e-6, 1.0))
