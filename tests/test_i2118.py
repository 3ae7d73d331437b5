"""NCCL at cluster scale (issue 21, helper i2118): each sourced collective figure of
``benchmarks/nccl_scale_audit.py`` held to what the planner's NCCL model gives for the same
collective.

No bus bandwidth was found for A100 over HDR InfiniBand at 48-420 nodes (the audit's
docstring lists the sources checked), so nothing in the model changes: these tests pin the
comparison itself.  Two at-scale figures agree with the model (NVIDIA/nccl #652's tree
latency on 32 A100 nodes, #1229's H100 reduce-scatter at 32 and 128 nodes); three ring
figures on other fabrics fall below it (#1218: H100 over RoCE, all_gather of 2 GiB at 32
nodes, 0.64; nccl-tests #169: A100 over 100G RoCE, all_reduce 8 GiB at 3 / 4 / 6 nodes,
0.73 / 0.61 / 0.42; the Ultra-Scale Playbook's all_gather fall at 8 / 32 / 64 nodes, 0.34 /
0.20 / 0.11): KNOWN GAPS, not one figure, none on Selene's fabric."""
import importlib.util
import io
import pathlib
import sys
from contextlib import redirect_stdout

import pytest

from workbench.sim_mesh import nccl_tuning as NT
from workbench.sim_mesh import topology as topo

_PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "nccl_scale_audit.py"
GIB = 1 << 30


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("benchmarks_nccl_scale_audit", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return mod


def _busbw(coll, size, nodes, prof, ppn=8):
    g = topo.Group((ppn,) * nodes)
    c = topo.choose(coll, float(size), g, prof)
    f = 2 * (g.p - 1) / g.p if coll == "all_reduce" else (g.p - 1) / g.p
    return f * size / c.seconds / 1e9, c.algorithm


def _row(audit, key):
    (r,) = [r for r in audit.rows() if r["figure"].key == key]
    return r


@pytest.mark.parametrize("version", ["2.20.5", "2.21.5"])
def test_1218_ring_all_gather_at_32_h100_nodes_is_below_the_model(version):
    """NVIDIA/nccl #1218 (2024-03-12): all_gather_perf -b 2G on 32 nodes of 8 H100 over
    RoCE reaches 200 GB/s.  NCCL's tuning model (the clock) gives the ring 312 GB/s: the
    NVLink-bound bandwidth term (flat beyond two nodes) less 255 steps of latency.  KNOWN
    GAP: measured 0.64 of the model."""
    prof = NT.with_nccl("h100", version)
    bw32, algo = _busbw("all_gather", 2 * GIB, 32, prof)
    assert algo == "ring" and bw32 == pytest.approx(312.3, rel=0.005)
    assert 0.62 < 200.0 / bw32 < 0.66
    # the model's fall from 2 to 32 nodes is its latency alone: under 15%
    bw2, _ = _busbw("all_gather", 2 * GIB, 2, prof)
    assert 0.85 < bw32 / bw2 < 0.9
    # the same month, the same node count, another cluster's ring (#1229, reduce-scatter
    # at 32 nodes: 300 GB/s) sits on the model: the fabric, not the algorithm, decides
    rs32, algo = _busbw("reduce_scatter", 2 * GIB, 32, prof)
    assert algo == "ring" and 300.0 / rs32 == pytest.approx(0.96, abs=0.01)


def test_169_a100_all_reduce_over_100g_roce_falls_where_the_model_is_flat(audit):
    """NVIDIA/nccl-tests #169 (2023-10-12): 8 A100 a node, 8 x 100G RoCE NICs on PCIe,
    all_reduce_perf -b 1G -e 8G: about 100 GB/s on 2 nodes (the tree, which may exceed the
    NICs: AddyLaddy's reply), 70 on 3, about 58 on 4-5, 40 on 6.  The a100 profile with its
    NICs at 100 Gb/s gives a flat ring of 8 x 12 GB/s = 96 GB/s at 3-6 nodes: measured 0.73 /
    0.61 / 0.42 of it, falling with the nodes.  KNOWN GAP (RoCE over PCIe, not HDR IB)."""
    got = {}
    for n in (3, 4, 6):
        r = _row(audit, f"nccl-tests169@{n}")
        prof = audit.profile_for(r["figure"])
        assert prof.inter_node.effective_bandwidth == pytest.approx(12e9)
        assert r["algorithm"] == "ring"
        assert r["model"] == pytest.approx(96.0, rel=0.005)
        got[n] = r["ratio"]
    assert got[3] == pytest.approx(0.73, abs=0.01)
    assert got[4] == pytest.approx(0.61, abs=0.01)
    assert got[6] == pytest.approx(0.42, abs=0.01)
    # the bandwidth term is the NICs' alone: 8 GiB at 96 GB/s, latency under 0.5%
    p = audit.profile_for(_row(audit, "nccl-tests169@6")["figure"])
    assert topo.flat_link(p, topo.Group((8,) * 6)).bandwidth == pytest.approx(96e9)


def test_the_agreeing_rows_652_and_1229(audit):
    """#652 (A100, 32 nodes, all_reduce of 8-128 B: 63.5 us) against the double binary
    tree's 67.5 us; #1229 (H100, reduce-scatter at 32 / 128 nodes, 300 / 260 GB/s; its
    size not stated, 2 GiB ASSUMED) within 5%."""
    r = _row(audit, "nccl652")
    assert r["algorithm"] == "tree" and r["model"] == pytest.approx(67.5, rel=1e-3)
    assert r["ratio"] == pytest.approx(0.94, abs=0.01)
    for key in ("nccl1229@32", "nccl1229@128"):
        r = _row(audit, key)
        assert r["algorithm"] == "ring" and abs(r["ratio"] - 1) < 0.05, (key, r["ratio"])


@pytest.mark.parametrize("gpu,model", [("a100", 191.1), ("h100", 367.6)])
def test_nvidia_reference_figure_at_32_gpus_is_the_profiles_rate(audit, gpu, model):
    """NVIDIA GTC25 S72583 slide 12: NCCL tests all_reduce bus bandwidth over 32 GPUs, 192
    GB/s for DGX A100 (8 x 200Gb RDMA), 370 for DGX H100 (8 x 400Gb, no SHARP).  The model
    at 4 nodes of 8 (a large message: the slide shows peaks) is within 1%: the per-NIC
    rate the profiles price at every node count is NVIDIA's own 4-node figure."""
    r = _row(audit, f"gtc25-{gpu}@4")
    assert r["figure"].nodes * r["figure"].ppn == 32
    assert r["algorithm"] == "ring" and r["model"] == pytest.approx(model, abs=0.1)
    assert abs(r["ratio"] - 1) < 0.01


def test_the_playbook_fall_against_the_model(audit):
    """The Ultra-Scale Playbook's all_gather of 256 MB, normalised to its one-node figure,
    falls to 0.28 / 0.11 / 0.044 at 8 / 32 / 64 nodes; the model's ring to 0.81 / 0.56 /
    0.40: 0.34 / 0.20 / 0.11 of it (tests/test_nccl15.py holds the whole curve)."""
    got = [_row(audit, f"playbook@{n}")["ratio"] for n in (8, 32, 64)]
    assert got == pytest.approx([0.34, 0.20, 0.11], abs=0.01)
    assert got == sorted(got, reverse=True)


def test_every_figure_states_what_the_brief_asks_and_is_at_scale(audit):
    """Cluster, GPU, NCCL release, message size, algorithm, measured and modeled figure for
    every row; all at three nodes or more (where NCCL's bandwidth stops following the
    node count); the release each row is priced at is one nccl_tuning has read."""
    for f in audit.FIGURES:
        assert f.source and f.cluster and f.gpu and f.fabric and f.nccl and f.algo
        assert f.size > 0 and f.measured > 0 and f.nodes >= 3 and f.ppn == 8
        assert f.version in NT.VERSIONS
        assert f.metric in ("busbw", "time_us", "fall")
        assert (f.ref_nodes > 0) == (f.metric == "fall")
    buf = io.StringIO()
    with redirect_stdout(buf):
        audit.main()
    out = buf.getvalue()
    assert "no measurement found" in out and "nothing changed" in out and "MT-NLG" in out
    for f in audit.FIGURES:
        assert f.key in out


def test_the_measured_ratios_are_not_one_figure(audit):
    """What the ZeRO-3 530B rows would need, 0.27-0.40 of the priced rate
    (benchmarks/zero3_audit.py; tests/test_nccl15.py recomputes it), lies inside the span
    the other fabrics measured, and so does 1 (#1229): no figure to transfer."""
    ratios = {r["figure"].key: r["ratio"] for r in audit.rows()}
    below = [v for k, v in ratios.items()
             if not k.startswith(("nccl652", "nccl1229", "gtc25"))]
    assert min(below) < 0.27 and max(below) > 0.40
    assert min(ratios["nccl1229@32"], ratios["nccl1229@128"]) > 0.9
    # the rows' fc1 gather as priced: a ring at 80-280 nodes, 140-167 GB/s
    needs = audit.row_needs()
    assert [n["algorithm"] for n in needs] == ["ring"] * 3
    assert [n["busbw"] for n in needs] == pytest.approx([166.5, 156.6, 140.7], abs=0.1)


def test_scale_assumption_names_the_audit_and_keeps_its_line():
    doc = " ".join(NT.scale_assumption.__doc__.split())
    for s in ("benchmarks/nccl_scale_audit.py", "#1218", "nccl-tests #169", "#1649",
              "tests/test_i2118.py"):
        assert s in doc, s
    (line,) = NT.scale_assumption(NT.with_nccl("a100", "2.8.3"), 80)
    assert "no bus bandwidth measured at that scale on A100" in " ".join(line.split())
