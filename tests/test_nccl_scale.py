"""NCCL across many nodes, held to the collective measurements at that scale that were
found (``nccl_tuning.scale_assumption`` names them in every estimate beyond two nodes).

Searched for nccl-tests bus bandwidth against message size at tens to hundreds of A100 /
H100 nodes: the NVIDIA/nccl and NVIDIA/nccl-tests issue trackers, NVIDIA's DGX SuperPOD
and dgxc-benchmarking material, Azure's AI-benchmarking-guide (ND A100 v4: one node only)
and NDv4 / interconnect posts, the NCCL 2.4 tree blog.  Two posts give numbers at scale,
and both agree with the clock as it is (NCCL's tuning model, ``topology._net_protocols``):

- NVIDIA/nccl issue #652 (2022-03-18, "NCCL performance on 32 node cluster"): all_reduce
  of 8 to 128 bytes on 32 nodes of 8 A100-SXM4 takes 62.9 .. 65.5 us: the latency of the
  double binary tree across 32 nodes (log2 32 = 5 network steps up and down, a chain of
  the 8 GPUs inside);
- NVIDIA/nccl issue #1229 (2024-03-16, "question of Reduce-scatter"): on an H100 cluster
  the reduce-scatter bus bandwidth falls 360, 345, 320, 300, 280, 260 GB/s from 4 to 8,
  16, 32, 64, 128 nodes; the issue gives no message size.  The clock's ring, whose
  bandwidth term does not fall with the node count, falls the same way through its
  per-step latency (about 1,000 steps at 128 nodes) for one nccl-tests size.

Neither is an A100 ring at 48 to 280 nodes (the ZeRO-3 rows): that bus bandwidth stays
UNCERTAIN in the estimate."""
import pytest

from workbench.sim_mesh import nccl_tuning as NT
from workbench.sim_mesh import topology as topo

# NVIDIA/nccl #652, the post's all_reduce_perf table: size (B) -> out-of-place time (us).
# ASSUMED: all 8 GPUs of each node ran (the post says "a 32 node 8xA100-SXM4 cluster"; its
# rank list is not quoted); NCCL version not given (2.8.3 .. 2.13.4 share the tree LL
# constants, checked below).  Its nodes have 4 HDR NICs, the a100 profile 8: at 128 bytes
# the bandwidth term is below 0.1% of the time (checked below).
NCCL652 = {8: 62.99, 16: 62.85, 32: 65.46, 64: 63.54, 128: 63.94}

# NVIDIA/nccl #1229: nodes -> reduce-scatter bus bandwidth (GB/s), H100 nodes of 8.
# NCCL version not given (the issue is of 2024-03): 2.19.3 .. 2.21.5 share the ring's
# baseLat, hwLat and LL128 factor (NVIDIA/nccl src/graph/tuning.cc:57, :67, :75 and :181
# (:182 in 2.20.5) at v2.19.3-1, v2.20.5-1, v2.21.5-1; 2.21 changes only the LL factor,
# not run at these sizes), so 2.20.5 and 2.21.5 (nccl_tuning.VERSIONS) stand for them.
# ASSUMED: 8 x 400G NICs per node as the h100 profile (the 4-node figure, 360, is its
# NVLink-bound 370 less 3%).
NCCL1229 = {4: 360.0, 8: 345.0, 16: 320.0, 32: 300.0, 64: 280.0, 128: 260.0}
GIB = 1 << 30


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


@pytest.mark.parametrize("version", ["2.8.3", "2.10.3", "2.12.7"])
def test_tree_latency_at_32_a100_nodes(version):
    prof = NT.with_nccl("a100", version)
    g = topo.Group((8,) * 32)
    measured = _median(NCCL652.values()) * 1e-6
    for n in NCCL652:
        c = topo.choose("all_reduce", float(n), g, prof)
        assert c.algorithm == "tree" and topo.protocol_of("all_reduce", float(n), g, prof,
                                                          "tree") == "LL"
        # tuning.cc: baseLat 4.4 + 2 (7 x 0.52 x 1.8 + log2(32) x 5.0) = 67.5 us
        assert c.seconds == pytest.approx(67.5e-6, rel=1e-3)
        assert c.seconds == pytest.approx(measured, rel=0.10), (n, c.seconds, measured)
        # a flat ring would pay 2 (256 - 1) steps: nine times the measurement
        assert c.candidates["ring"] > 5 * measured
    t8, t128 = (topo.choose("all_reduce", float(n), g, prof).seconds for n in (8, 128))
    assert (t128 - t8) / t128 < 1e-3          # the NIC count does not enter at these sizes


def _rs_busbw(prof, nodes, size):
    g = topo.Group((8,) * nodes)
    c = topo.choose("reduce_scatter", float(size), g, prof)
    assert c.algorithm == "ring"
    return (g.p - 1) / g.p * size / c.seconds / 1e9


@pytest.mark.parametrize("version", ["2.20.5", "2.21.5"])
def test_reduce_scatter_falls_with_the_nodes_as_the_ring_latency_says(version):
    prof = NT.with_nccl("h100", version)
    # nccl-tests sizes are powers of two; the issue names none: the clock must match all
    # six node counts with one of them
    errors = {}
    for size in (GIB, 2 * GIB, 4 * GIB, 8 * GIB, 16 * GIB):
        errors[size] = max(abs(_rs_busbw(prof, nodes, size) / m - 1)
                           for nodes, m in NCCL1229.items())
    best = min(errors, key=errors.get)
    assert errors[best] < 0.05 and best == 2 * GIB, errors
    # the decline is the latency's: the bandwidth term alone (time of 2n less that of n)
    # is flat (NVLink-bound x the protocol's factor) and 30% above the 128-node measurement
    g = topo.Group((8,) * 128)
    n = float(best)
    t1, t2 = (topo.choose("reduce_scatter", x, g, prof).seconds for x in (n, 2 * n))
    flat = (g.p - 1) / g.p * n / (t2 - t1) / 1e9
    assert flat > 1.3 * NCCL1229[128]
    proto = topo.protocol_of("reduce_scatter", n, g, prof)
    factor = prof.topology.net_protocols[proto]["bandwidth_factor"]
    assert flat == pytest.approx(prof.intra_node.effective_bandwidth / 1e9 * factor, rel=1e-6)


def test_a_dgx_a100_ring_beyond_two_nodes_runs_at_the_measured_192_gbs():
    """NVIDIA/nccl issue #812 (2023-03-31, an NVIDIA engineer on scaling out beyond two
    nodes): "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure
    192GB/s AllReduce BusBW" (node count not given): the a100 profile's flat ring, 8 NICs
    at 24 GB/s each, gives that bus bandwidth (at more nodes less its growing latency)."""
    for version in ("2.8.3", "2.12.7"):
        prof = NT.with_nccl("a100", version)
        assert topo.flat_link(prof, topo.Group((8,) * 4)).bandwidth == pytest.approx(192e9)
        g = topo.Group((8,) * 4)
        n = float(8 * GIB)                  # large: the latency is under 1% at 4 nodes
        c = topo.choose("all_reduce", n, g, prof)
        busbw = 2 * (g.p - 1) / g.p * n / c.seconds / 1e9
        assert c.algorithm == "ring" and busbw == pytest.approx(192, rel=0.01), busbw


def test_the_estimate_names_the_measurements():
    (line,) = NT.scale_assumption(NT.with_nccl("a100", "2.8.3"), 192)
    assert line.startswith("UNCERTAIN") and "192 nodes" in line
    assert "#652" in line and "#1229" in line and "tests/test_nccl_scale.py" in line
