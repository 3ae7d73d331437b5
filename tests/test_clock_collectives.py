"""Collectives on the topology with the vendor's algorithm (sim_mesh/topology.py)."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from workbench.sim_mesh import cost
from workbench.sim_mesh.profiles import Topology, get_profile

FEW = settings(max_examples=40, deadline=None)
NPU = get_profile("ascend-910b")
A100 = get_profile("a100")
GiB = 2 ** 30


def test_hccl_mesh_formula_and_links():
    # HCCL user guide, "Mesh": AllReduce 2 alpha + 2 n/p beta, beta per HCCS link
    link = NPU.intra_node.bandwidth / 7
    assert link == pytest.approx(28e9)
    a, n = NPU.intra_node.latency, GiB
    assert cost.price("all_reduce", n, range(8), NPU, "mesh") == pytest.approx(
        2 * a + 2 * n / 8 / link)
    assert cost.price("reduce_scatter", n, range(8), NPU, "mesh") == pytest.approx(
        a + n / 8 / link)
    # four NPUs of the server: three links each
    assert cost.price("all_gather", n, range(4), NPU, "mesh") == pytest.approx(a + n / 4 / link)


def test_mesh_beats_ring_on_hccs():
    # a ring uses one HCCS link per direction; the mesh uses all seven at once
    n = GiB
    ring = cost.price("all_reduce", n, range(8), NPU, "ring")
    mesh = cost.price("all_reduce", n, range(8), NPU, "mesh")
    assert ring == pytest.approx(2 * 7 * 3e-6 + 2 * 7 / 8 * n / 28e9)
    assert ring / mesh == pytest.approx(7, rel=0.01)
    pick = cost.choose("all_reduce", n, range(8), NPU)
    assert pick.algorithm == "mesh" and pick.library == "hccl" and "HCCS" in pick.reason
    assert cost.price("all_reduce", n, range(8), NPU) == mesh
    assert "all 7 HCCS links" in pick.reason
    # four NPUs of the server use the three links to their peers, as they are priced above
    assert "3 of its 7 HCCS links" in cost.choose("all_reduce", n, range(4), NPU).reason


@pytest.mark.parametrize("kind, nodes, want", [
    ("all_reduce", 1, "ring"), ("all_gather", 1, "ring"), ("reduce_scatter", 1, "ring"),
    ("all_to_all", 1, "pairwise"), ("broadcast", 1, "ring"),
    ("all_gather", 4, "ring"), ("reduce_scatter", 4, "ring"), ("all_to_all", 4, "pairwise")])
def test_nccl_algorithm_per_collective(kind, nodes, want):
    pick = cost.choose(kind, 64 * 2 ** 20, range(8 * nodes), A100)
    assert pick.library == "nccl" and pick.algorithm == want
    assert list(pick.candidates) == [want]


def test_nccl_all_reduce_ring_or_tree_across_nodes():
    ranks = range(0, 8 * 64, 8)                   # one GPU on each of 64 nodes
    small = cost.choose("all_reduce", 2 ** 12, ranks, A100)
    big = cost.choose("all_reduce", 4 * GiB, ranks, A100)
    assert set(small.candidates) == set(big.candidates) == {"ring", "tree"}
    assert small.algorithm == "tree"              # log-depth latency wins for small messages
    assert big.algorithm == "ring"                # bandwidth-optimal ring wins for large ones
    one_node = cost.choose("all_reduce", 2 ** 12, range(8), A100)
    assert list(one_node.candidates) == ["ring"]  # NCCL's tree spans nodes


def test_rails_between_nodes():
    # 2 DGX A100: a flat ring crosses the node boundary on 8 rails of 200 Gb/s, each
    # at NCCL's 24 GB/s, still slower than NVLink at NCCL's 0.783 x 300 GB/s
    n = GiB
    # NCCL's tuning model (2.12.7), Simple: 8.4 us + 14 NVLink steps of 3.4 us + the one
    # step that crosses nodes, 28 us
    two_nodes = cost.price("all_gather", n, range(16), A100, "ring")
    assert two_nodes == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 28e-6 + 15 / 16 * n / (8 * 24e9))
    one_per_node = cost.price("all_gather", n, [0, 8], A100, "ring")
    assert one_per_node == pytest.approx(8.4e-6 + 28e-6 + n / 2 / 24e9)  # one NIC
    inside = cost.price("all_gather", n, range(8), A100, "ring")
    # inside a node: NCCL's Simple protocol (tuning.cc: 8.4 us + 3.4 us per ring step)
    assert inside == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 7 / 8 * n / (0.783 * 300e9))


@FEW
@given(kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                             "broadcast"]),
       n=st.integers(1, 2 ** 34), local=st.sampled_from([2, 4, 8]), nodes=st.integers(2, 16),
       name=st.sampled_from(["a100", "h100", "ascend-910b"]))
def test_pipelined_never_slower_than_sequential(kind, n, local, nodes, name):
    p = get_profile(name)
    ranks = [node * 8 + i for node in range(nodes) for i in range(local)]
    seq = cost.price(kind, n, ranks, p, "hierarchical")
    pipe = cost.price(kind, n, ranks, p, "pipelined")
    assert 0 < pipe <= seq * (1 + 1e-12)


def test_pipelined_overlaps_intra_and_inter_phases():
    # large all-reduce over 4 Atlas servers: the intra (HCCS) and inter (RoCE) phases
    # run at once, so the time approaches the slower phase alone
    ranks, n = range(32), 4 * GiB
    seq = cost.price("all_reduce", n, ranks, NPU, "hierarchical")
    pipe = cost.price("all_reduce", n, ranks, NPU, "pipelined")
    link = NPU.intra_node.bandwidth / 7
    intra = 2 * n / 8 / link                             # mesh reduce-scatter + all-gather
    inter = 2 * 3 / 4 * (n / 8) / NPU.inter_node.bandwidth  # ring all-reduce of n/8
    assert seq == pytest.approx(intra + inter, rel=0.01)
    assert pipe < 0.8 * seq and pipe >= max(intra, inter)
    pick = cost.choose("all_reduce", n, ranks, NPU)
    assert pick.algorithm == "pipelined" and set(pick.candidates) == {"hierarchical", "pipelined"}


def test_hccl_between_servers_one_npu_each():
    pick = cost.choose("all_reduce", 2 ** 10, range(0, 8 * 16, 8), NPU)
    assert set(pick.candidates) == {"ring", "halving_doubling"}
    assert pick.algorithm == "halving_doubling"  # log steps win at small sizes (H-D_R)


def test_default_topology_for_a_custom_profile():
    t = A100.topology
    p = dataclasses.replace(A100, name="custom", topology=Topology(
        protocols=t.protocols, sm_count=t.sm_count, collective_sms=t.collective_sms))
    assert p.topology.nics_per_node == p.devices_per_node
    assert cost.price("all_reduce", GiB, range(8), p) == cost.price("all_reduce", GiB, range(8),
                                                                    A100)
    # a bare Topology lists no protocols: the ring is the alpha-beta ring of the link
    bare = dataclasses.replace(A100, name="bare", topology=Topology())
    assert not bare.topology.protocols and bare.topology.sm_count == 0
    assert cost.price("all_reduce", GiB, range(8), bare) == pytest.approx(
        14 * 3e-6 + 14 / 8 * GiB / (0.783 * 300e9))


@pytest.mark.parametrize("call, match", [
    (lambda: cost.price("all_reduce", 1, range(8), "a100", "mesh"), r"'mesh' needs.*switch"),
    (lambda: cost.price("all_reduce", 1, range(16), "ascend-910b", "mesh"), r"spans 2 node"),
    (lambda: cost.price("all_gather", 1, range(16), "a100", "tree"), r"all_reduce only"),
    (lambda: cost.price("all_reduce", 1, range(8), "a100", "pairwise"), r"all_to_all algorithm"),
    (lambda: cost.price("all_reduce", 1, [0, 1, 8], "a100", "pipelined"), r"\[2, 1\]"),
    (lambda: cost.price("all_reduce", 1, range(8), "a100", "nvls"), r"algorithm='nvls'.*auto"),
    (lambda: Topology(library="mpi"), r"library='mpi'"),
    (lambda: Topology(intra_fabric="torus"), r"intra_fabric='torus'"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
