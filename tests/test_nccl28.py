"""NCCL's tuning model per release (sim_mesh/nccl_tuning.py), held to the source lines of
NVIDIA/nccl at each release tag and to NCCL's own algorithm / protocol selection."""
import dataclasses
import math
import re
import subprocess
from pathlib import Path

import pytest

from workbench.sim_mesh import nccl_tuning as NT
from workbench.sim_mesh import topology as topo
from workbench.sim_mesh.profiles import Profile, get_profile

A100, H100 = get_profile("a100"), get_profile("h100")

# src/graph/tuning.cc at each tag, quoted (file:line in nccl_tuning.VERSIONS' lines)
SOURCE = {
    "2.8.3": {
        56: "static const float baseLat  [NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS] = "
            "{ { 4.4, 4.4,  0 }, { 3.6, 10.0, 8.4 }, { 4.4, 4.4,  0 } };",
        65: "  { /* Tree (LL/LL128/Simple)*/ { .52, 1.25, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ .47, 1.9, 3.4 }, /* CollNet (LL/LL128/Simple)*/ {  .5, 1.2, 4.0 } },",
        69: "  { /* Tree (LL/LL128/Simple)*/ { 5.0, 8.5, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ 2.7, 4.0, 9.6 }, /* CollNet (LL/LL128/Simple)*/ { 5.0, 5.0, 10.7 } }",
        120: "        float speed = nNodes <= 2 || a == NCCL_ALGO_COLLNET ? "
             "graphs[a]->speedIntra : graphs[a]->speedInter;",
        121: "        float busBw = graphs[a]->nChannels * speed;",
        129: "        if (a == NCCL_ALGO_TREE && p == NCCL_PROTO_LL128) busBw = std::min(busBw "
             "* (nNodes == 1 ? 7.0/9.0 : 0.915 /*120.0/128.0*/), "
             "ll128MaxBwPerCh[coll]*graphs[a]->nChannels);",
    },
    "2.10.3": {
        69: "  { /* Tree (LL/LL128/Simple)*/ { 5.0, 8.5, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ 2.7, 4.0, 9.6 }, /* CollNet (LL/LL128/Simple)*/ { 5.0, 5.0, 10.7 } }",
    },
    "2.12.7": {
        122: "        float speed = nNodes <= 2 || a == NCCL_ALGO_COLLNET ? "
             "graphs[a]->speedIntra : graphs[a]->speedInter;",
        69: "  { /* Tree (LL/LL128/Simple)*/ { 5.0, 8.5, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ 2.7, 4.0, 28 }, /* CollNet (LL/LL128/Simple)*/ { 5.0, 5.0, 10.7 } }",
    },
    "2.21.5": {
        57: "       {  6.8, 14.0,    0 }, {  6.6, 14.0,  8.4 },  // Tree, Ring",
        67: "  { /* Tree (LL/LL128/Simple)*/ { .6, 1.25, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ .6, 1.9, 3.4 },",
        75: "  { /* Tree (LL/LL128/Simple)*/ { 5.0, 8.5, 28 }, /* Ring (LL/LL128/Simple)*/ "
            "{ 2.7, 4.0, 14.0 },",
        89: "  /* Hopper-N1/AMD-N2/AMD-N4) */ {141.0, 45.0 /*avg of ring & tree*/, 35.0}",
        116: "  if (cpuArch == NCCL_TOPO_CPU_ARCH_X86 && cpuVendor == NCCL_TOPO_CPU_VENDOR_AMD) "
             "return 2.0;",
        174: "        float bw = nNodes <= 2 || collnet ? graphs[a]->bwIntra : "
             "graphs[a]->bwInter;",
        180: "        if (a == NCCL_ALGO_RING && p == NCCL_PROTO_LL) { busBw = std::min(llMaxBw, "
             "busBw * .5); }",
    },
}
_MIRROR = Path("/work/.mirror/NVIDIA+nccl/repo")


def _nums(line):
    return [float(x) for x in re.findall(r"(?<![\w.])(\d*\.\d+|\d+)(?![\w.])", line)]


@pytest.mark.skipif(not _MIRROR.exists(), reason="no NVIDIA/nccl mirror on this machine")
@pytest.mark.parametrize("version", sorted(SOURCE))
def test_quoted_lines_are_the_tags(version):
    c = NT.constants(version)
    text = subprocess.run(["git", "-C", str(_MIRROR), "show", f"{c.tag}:src/graph/tuning.cc"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    for line, quoted in SOURCE[version].items():
        assert text[line - 1] == quoted, (version, line)


def test_constants_are_the_quoted_lines():
    c = NT.constants("2.8.3")
    base = _nums(SOURCE["2.8.3"][56])
    assert tuple(base[0:3]) == c.base_tree and tuple(base[3:6]) == c.base_ring
    nvl, net = _nums(SOURCE["2.8.3"][65]), _nums(SOURCE["2.8.3"][69])
    assert tuple(nvl[0:3]) == c.nvlink_tree and tuple(nvl[3:6]) == c.nvlink_ring
    assert tuple(net[0:3]) == c.net_tree and tuple(net[3:6]) == c.net_ring
    assert "0.915" in SOURCE["2.8.3"][129] and c.tree_ll128 == 0.915
    assert tuple(_nums(SOURCE["2.10.3"][69])[3:6]) == NT.constants("2.10.3").net_ring
    assert tuple(_nums(SOURCE["2.12.7"][69])[3:6]) == NT.constants("2.12.7").net_ring
    d = NT.constants("2.21.5")
    b = _nums(SOURCE["2.21.5"][57])
    assert tuple(b[0:3]) == d.base_tree and tuple(b[3:6]) == d.base_ring
    assert tuple(_nums(SOURCE["2.21.5"][67])[3:6]) == d.nvlink_ring
    assert tuple(_nums(SOURCE["2.21.5"][75])[3:6]) == d.net_ring
    assert _nums(SOURCE["2.21.5"][89])[-3] == d.ll_max_one_node["hopper"] == 141.0
    assert _nums(SOURCE["2.21.5"][116])[-1] == d.net_overhead["amd"] == 2.0
    assert d.ring_ll == (0.5, 0.5) and "busBw * .5" in SOURCE["2.21.5"][180]
    # the inter-node Simple ring step: 9.6 us (2.8-2.11), 28 us (2.12-2.13), 14 us (2.18 on)
    assert [NT.constants(v).net_ring[2] for v in ("2.8.4", "2.9.9", "2.11.4", "2.13.4",
                                                   "2.20.5")] == [9.6, 9.6, 9.6, 28.0, 14.0]


def test_2_12_7_reproduces_the_a100_profile():
    # the a100 profile's tables are NCCL 2.12.7's (its citations), to their 3-4 digits
    assert A100.topology.nccl_version == "2.12.7"
    protos, net = NT.tables("2.12.7", "ampere", "amd", A100.intra_node.effective_bandwidth)
    for name in NT.PROTOCOLS:
        for k, v in A100.topology.protocols[name].items():
            assert protos[name][k] == pytest.approx(v, rel=2e-3), (name, k)
        for k, v in A100.topology.net_protocols[name].items():
            assert net[name][k] == pytest.approx(v, rel=2e-3, abs=1e-15), (name, k)


def test_2_8_3_differs_from_2_12_7_where_the_source_does():
    p, q = NT.with_nccl(A100, "2.8.3"), NT.with_nccl(A100, "2.12.7")
    diff = {(n, k) for n in NT.PROTOCOLS for k, v in p.topology.net_protocols[n].items()
            if v != q.topology.net_protocols[n][k]}
    assert diff == {("Simple", "inter_step_latency"),
                    ("Simple", "inter_step_latency_one_per_node"),
                    ("LL128", "tree_bandwidth_factor")}
    assert p.topology.net_protocols["Simple"]["inter_step_latency"] == pytest.approx(9.6e-6)
    assert p.topology.net_protocols["LL128"]["tree_bandwidth_factor"] == pytest.approx(
        0.92 * 0.915)
    assert p.topology.protocols == q.topology.protocols


def test_2_21_5_on_ampere_and_hopper():
    a = NT.with_nccl(A100, "2.21.5").topology
    # ring LL 0.5, capped at llMaxBws[Ampere][N1] = 87.7 GB/s of the 235 GB/s NVLink rate
    assert a.protocols["LL"]["bandwidth_factor"] == pytest.approx(87.7e9 / (0.783 * 300e9))
    # across nodes every ring step is at least the AMD host's 2 us network overhead (x3 Simple)
    assert a.net_protocols["LL"]["intra_step_latency"] == pytest.approx(2e-6)
    assert a.net_protocols["Simple"]["intra_step_latency"] == pytest.approx(6e-6)
    assert a.net_protocols["LL"]["max_bandwidth"] == 19.0e9
    h = NT.with_nccl(H100, "2.21.5").topology
    assert h.protocols["LL"]["bandwidth_factor"] == pytest.approx(141e9 / (0.822 * 450e9))
    assert h.net_protocols["LL"]["intra_step_latency"] == pytest.approx(1e-6)   # Intel 1 us
    assert h.net_protocols["LL128"]["bandwidth_factor_one_per_node"] == 0.7     # ppn < 2
    assert h.net_protocols["Simple"]["tree_inter_latency"] == pytest.approx(28e-6)
    assert h.nccl_version == "2.21.5" and H100.topology.nccl_version == "master@5067397c"


def test_with_nccl_changes_only_the_collective_tables():
    p = NT.with_nccl("a100", "v2.8.3-1")
    assert p.topology.nccl_version == "2.8.3"
    for f in dataclasses.fields(Profile):
        if f.name not in ("topology", "citations"):
            assert getattr(p, f.name) == getattr(A100, f.name), f.name
    assert p.citations["topology.net_protocols.Simple.inter_step_latency"].startswith(
        "NVIDIA/nccl v2.8.3-1 (920dbe5b35, 2020-11-17) src/graph/tuning.cc:69")
    assert Profile.from_dict(p.to_dict()) == p            # the version survives the JSON


@pytest.mark.parametrize("bad", ["2.7.8", "2.12", "latest", 2.8, None])
def test_unknown_version_raises(bad):
    with pytest.raises(ValueError, match="nccl_version"):
        NT.with_nccl(A100, bad)


def test_other_profiles_raise():
    with pytest.raises(ValueError, match="hccl"):
        NT.with_nccl("ascend-910b", "2.8.3")
    odd = dataclasses.replace(A100, name="mine")
    with pytest.raises(ValueError, match="'mine'"):
        NT.with_nccl(odd, "2.8.3")


def test_estimate_states_the_version():
    import workbench as wb
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=128, n_layer=2,
                                n_head=4, d_model=256, dtype="bfloat16")
    lay = wb.plan.Layout(dp=16, tp=1, pp=1)
    est = wb.plan.estimate(cfg, lay, wb.plan.Cluster(NT.with_nccl("a100", "2.8.3"), 16))
    assert any("NCCL 2.8.3's tuning model" in a for a in est.assumptions())
    base = wb.plan.estimate(cfg, lay, wb.plan.Cluster("a100", 16))
    assert any("NCCL 2.12.7's tuning model" in a for a in base.assumptions())


def test_scale_assumption_follows_the_source_and_the_clock():
    """Beyond two nodes NCCL's tuning model takes the graph's inter-node speed x channels
    whatever the node count (the quoted lines: ``nNodes <= 2`` .. ``speedInter``), and so
    does the clock: a ring's bus bandwidth (from the time of 2n bytes less that of n) is
    the same over 3 and over 280 DGX A100 nodes, only its latency grows.  The estimate says so
    (UNCERTAIN) from three nodes on, naming the node count and the per-NIC rate."""
    for version, line in (("2.8.3", 120), ("2.12.7", 122), ("2.21.5", 174)):
        assert "nNodes <= 2" in SOURCE[version][line] and "Inter" in SOURCE[version][line]
    prof = NT.with_nccl("a100", "2.8.3")
    n = 4e9
    busbw = []
    for nodes in (3, 280):          # per protocol: the choice itself moves with the latency
        g = topo.Group((8,) * nodes)
        t1, t2 = (topo._net_protocols("all_gather", x, g, prof) for x in (n, 2 * n))
        busbw.append({p: (g.p - 1) / g.p * n / (t2[p] - t1[p]) for p in t1})
    for p in NT.PROTOCOLS:
        assert busbw[0][p] == pytest.approx(busbw[1][p], rel=1e-9), p
    assert NT.scale_assumption(prof, 2) == () and NT.scale_assumption(prof, 1) == ()
    (line,) = NT.scale_assumption(prof, 3)
    assert line.startswith("UNCERTAIN") and "3 nodes" in line and "24 GB/s per NIC" in line
    assert NT.scale_assumption(get_profile("ascend-910b"), 64) == ()
    import workbench as wb
    cfg = wb.models.ModelConfig(arch="gpt", vocab_size=512, seq_len=128, n_layer=2,
                                n_head=4, d_model=256, dtype="bfloat16")

    def lines(dp):
        est = wb.plan.estimate(cfg, wb.plan.Layout(dp=dp, tp=1, pp=1),
                               wb.plan.Cluster(prof, dp))
        return [a for a in est.assumptions() if a.startswith("UNCERTAIN: NCCL across")]
    assert lines(16) == [] and lines(24) == list(NT.scale_assumption(prof, 3))


# NCCL's own selection (ncclTopoTuneModel + ncclTopoGetAlgoTime), written from the
# source for a DGX A100 (AMD hosts), busBw the profile's flat-ring rate; with the tree's
# correction factors and the ring's plateau, which the clock leaves out (cases below are
# away from the crossovers those move)
_TREE_CORR = {"LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7,
                     .8, .9, 1.0, 1.0, 1.0, 1.0),
              "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6,
                        .7, .7, .8, .9, .9, .92, .92),
              "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7,
                         .8, .7, .7, .8, .9, .9)}   # 2.8.3 tuning.cc:265-268 (the same to 2.13.4)


def _nccl_choice(version, coll, nbytes, nranks, nnodes, busbw):
    c = NT.constants(version)
    ppn = nranks / nnodes
    nsteps = 2 * (nranks - 1) if coll == "all_reduce" else nranks - 1
    old = tuple(map(int, version.split("."))) < (2, 12)
    inter = (2 * (nnodes - 1) if old else 2 * nnodes if nnodes > 1 else 0) \
        if coll == "all_reduce" else nnodes - 1
    llmax = 19.0 if nnodes > 2 else 87.7 if nnodes == 1 else 22.5
    best = None
    for algo in ("tree", "ring") if coll == "all_reduce" and nnodes > 1 else ("ring",):
        for i, p in enumerate(NT.PROTOCOLS):
            bw = busbw
            if algo == "ring" and p == "LL":
                bw = min(llmax, bw * (0.25 if nnodes > 1 or coll == "all_reduce" else 1 / 3))
            if algo == "ring" and p == "LL128":
                bw *= 0.7 if ppn < 2 else 0.92
            if algo == "tree":
                bw *= 0.92
                bw = min(bw / 3.8, llmax) if p == "LL" else bw * c.tree_ll128 \
                    if p == "LL128" else bw
            alg_bw = bw * (0.5 if algo == "tree" else nranks / nsteps)
            intra = (c.nvlink_tree if algo == "tree" else c.nvlink_ring)[i]
            intra *= 1.8 if nnodes > 1 and p == "LL" else 1
            if algo == "ring":
                hw = c.net_ring[i] if nnodes > 1 else c.nvlink_ring[i]
                lat = c.base_ring[i] + ((nsteps - inter) * intra + inter * c.net_ring[i]
                                        if nnodes > 1 else nsteps * hw)
            else:
                lat = c.base_tree[i] + 2 * ((nranks // nnodes - 1) * intra
                                            + int(math.log2(nnodes)) * c.net_tree[i])
            log = int(math.log2(max(nbytes // 64, 1)))
            if algo == "tree" and log < 23:
                alg_bw *= _TREE_CORR[p][log]
            if algo == "ring" and p == "Simple" and nnodes > 1 and coll == "all_reduce" \
                    and nbytes >= nranks / 16 * 65536:
                lat *= 1.9
            t = lat + nbytes / (1000 * alg_bw)
            if best is None or t < best[0]:
                best = (t, algo, p)
    return best[1:]


@pytest.mark.parametrize("version", ["2.8.3", "2.12.7"])
@pytest.mark.parametrize("coll, nbytes, nranks", [
    ("all_reduce", 2 ** 10, 8), ("all_reduce", 2 ** 21, 8), ("all_reduce", 2 ** 30, 8),
    ("all_gather", 2 ** 12, 8), ("all_gather", 2 ** 30, 8),
    ("all_reduce", 2 ** 12, 128), ("all_reduce", 2 ** 32, 64),
    ("all_gather", 2 ** 16, 256), ("reduce_scatter", 2 ** 33, 32),
    ("all_reduce", 2 ** 24, 128), ("all_reduce", 2 ** 20, 256), ("all_gather", 2 ** 26, 512),
])
def test_choice_agrees_with_nccl(version, coll, nbytes, nranks):
    prof = NT.with_nccl(A100, version)
    g = topo.group_of(range(nranks), prof)
    pick = topo.choose(coll, nbytes, g, prof)
    algo = pick.algorithm
    proto = topo.protocol_of(coll, nbytes, g, prof, "tree" if algo == "tree" else "ring")
    busbw = topo._flat_link(prof, g).bandwidth / 1e9
    assert (algo, proto) == _nccl_choice(version, coll, nbytes, nranks, g.nodes, busbw)


def test_the_release_changes_the_choice_as_nccl_does():
    # a 128 MiB all_gather over 4 DGX A100s: Simple under 2.8.3 (9.6 us per network step),
    # LL128 under 2.12.7 (28 us): NCCL's own rule picks the same at each release
    picks = {}
    for v in ("2.8.3", "2.12.7"):
        prof = NT.with_nccl(A100, v)
        g = topo.group_of(range(32), prof)
        picks[v] = topo.protocol_of("all_gather", 2 ** 27, g, prof)
        busbw = topo._flat_link(prof, g).bandwidth / 1e9
        assert ("ring", picks[v]) == _nccl_choice(v, "all_gather", 2 ** 27, 32, 4, busbw)
    assert picks == {"2.8.3": "Simple", "2.12.7": "LL128"}


def test_known_gap_ring_plateau_not_modeled():
    # NCCL multiplies a multi-node ring Simple all_reduce's latency by 1.9 (2.8.3
    # tuning.cc:281, "Plateau effect of ring"); the clock does not, so near the Simple /
    # LL128 crossover it picks Simple where NCCL picks LL128 (module docstring)
    prof = NT.with_nccl(A100, "2.8.3")
    g = topo.group_of(range(32), prof)
    busbw = topo._flat_link(prof, g).bandwidth / 1e9
    assert topo.protocol_of("all_reduce", 2 ** 27, g, prof) == "Simple"
    assert _nccl_choice("2.8.3", "all_reduce", 2 ** 27, 32, 4, busbw) == ("ring", "LL128")
