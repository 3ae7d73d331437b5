"""NCCL collectives at cluster scale: every component figure found, measured against what
the planner's NCCL model gives for the same collective (issue 21; helper i2118).

    PYTHONPATH=$PWD python -m benchmarks.nccl_scale_audit        # ~2 s

The question (issue 21's communication-bound rows: ZeRO-3 GPT 530B at 640 / 1,120 / 2,240
A100s 1.341 / 1.364 / 1.352, MT-NLG 530B at 2,240-3,360 A100s 1.20-1.26, ZeRO-3 175B at 384
/ 768 1.17 / 1.19): the one input these rows share that is marked UNCERTAIN is NCCL's bus
bandwidth across 48-420 DGX A100 nodes over HDR InfiniBand, priced by NCCL's own tuning
model (``sim_mesh.nccl_tuning``: speedInter x nChannels beyond two nodes, whatever the node
count; only the ring / tree latency grows) at the profiles' few-node per-NIC rate
(``nccl_tuning.scale_assumption``).  Is there a component-level measurement (nccl-tests
bus bandwidth against message size and node count) at that scale on A100 / HDR, and what
does the model give for it?

Each row below is one sourced figure: the cluster, the GPU and fabric, the NCCL release
(as stated, or the one the date implies: ASSUMED), the collective, the message size (as
nccl-tests counts it: the whole buffer), the nodes x GPUs, the algorithm, the measured bus
bandwidth (GB/s) or time (us), and the planner's figure for the same collective
(``topology.choose`` on ``nccl_tuning.with_nccl(profile, release)``: the algorithm and
protocol NCCL's tuning model picks, or the one the run forced).  ``fall`` rows compare a
curve's fall with the node count, normalised to its own reference node count, where the
cluster's absolute rate is not the profile's (other NICs, unstated fabric).

Sources checked (2026-11-30, this branch; the ``search`` corpora issues / pages / code /
docs, on top of the searches recorded in ``nccl_tuning.scale_assumption``,
``tests/test_nccl_scale.py`` and ``tests/test_nccl15.py``):

- NVIDIA/nccl and NVIDIA/nccl-tests issues with nccl-tests output at 3+ nodes: #652
  (A100, 32 nodes: latency), #1229 (H100, 4-128 nodes, reduce-scatter), #1218 (H100 over
  RoCE, 32 nodes, all_gather 2 GiB), nccl-tests #169 (A100 over RoCE, 2-6 nodes,
  all_reduce 1-8 GiB), #812 (DGX A100, nodes not given: 192 GB/s all_reduce), nccl-tests
  #119 (A100, 3 nodes, 4 HDR NICs: 96 GB/s peak, 24 GB/s a NIC: the profile's own source),
  #1211 (512 H100: the figure is an image, not readable here), #1712 (A100 with one GPU a
  node, ring all_reduce against nodes: an image), #1649 and #1123 (maintainers' words, no
  figure; quoted below);
- the Ultra-Scale Playbook's 256 MB curve over 1-64 nodes (``tests/test_nccl15.py``);
- Azure NDv4 / ND A100 v4 (the 2021 "Performance considerations for large scale deep
  learning training on Azure NDv4" post and the 2025 "Performance at scale: the role of
  interconnects" post): only their openings are stored here, no bus-bandwidth figure
  reachable; Azure's AI-benchmarking-guide runs all_reduce_perf on one host only (its
  issue #7);
- NVIDIA Selene / DGX SuperPOD material (a SuperPOD reference-architecture deck: MLPerf
  gains from 8 HCAs against 1 at 128-230 nodes, no collective figure); NVIDIA's GTC24
  S62129 and GTC25 S72583 "Collective Communication Bandwidth" slides (as reproduced in
  stas00/ml-engineering): DGX A100 / H100 all_reduce across nodes at 32 GPUs (rows
  below), nothing at more nodes;
- MegaScale (ByteDance 2024), Alibaba HPN (SIGCOMM 2024: its published notes, no
  figure), Meta's RoCE paper (SIGCOMM 2024: summaries only), Llama 3: no collective figure
  reachable;
- De Sensi et al. (SC24, arXiv 2408.14090; its published summaries): Leonardo (A100, HDR,
  Dragonfly+) loses "up to 50%" of NCCL allreduce goodput to other jobs at 1,024 GPUs;
- Singh et al., "The Big Send-off" (arXiv 2504.18658, its abstract): on Perlmutter (A100
  over Slingshot-11, not InfiniBand) a hierarchical library beats NCCL's all-gather /
  reduce-scatter / all-reduce by up to 5.7x at up to 2,048 GPUs: NCCL's flat rings fall
  at that scale there, by a factor the abstract does not split by collective and size.

Maintainers' words (NVIDIA/nccl): "NVLSTree can achieve peak bandwidth much quicker than
e.g. rings at scale ... Rings degrade at scale" (S. Jeaugey, #1649, 2025-03-20); to a user
"struggling to scale a large FSDP LLM model training to ~1000 ranks ... limited by the
all-gather performance": a SHARP-based allgather / reduce_scatter in 2.20 "should
substantially help performance at your scale" (J. Bachan, #1123, 2023-12-22).

Reading (the script's table, 2026-11-30).  NVIDIA's own reference figure for a DGX A100
across nodes is a 32-GPU one: GTC25 S72583 slide 12, "NCCL Tests Allreduce Bus Bandwidth in
GB/s, 32 GPUs", 192 GB/s for "NVL3 + 8x 200Gb RDMA (DGX A100)" (370 for DGX H100), which
the model gives within 1% at 4 nodes: the profiles' per-NIC rate is that few-node figure,
as the estimate's UNCERTAIN line says.  For A100 over HDR InfiniBand at 48-420 nodes no
bus bandwidth against the node count was found: the figure the rows turn on is still
unmeasured.  At scale elsewhere the figures split by algorithm and fabric:

- they AGREE with the model where the tree's or the ring's latency decides: #652's 32-node A100
  all_reduce of 8-128 B (0.94 of the model's time) and #1229's H100 reduce-scatter over
  4-128 nodes (within 5% at every node count, but only at 2 GiB, the one of five sizes
  that fits: the issue gives none, so that agreement is weak);
- they DISAGREE, measured below the model, for rings on three other clusters: #1218's H100
  all_gather of 2 GiB over 32 RoCE nodes at 200 GB/s, 0.64 of the model's 312 (NCCL's
  all_gather is ring-only: no tree to hide behind; one iteration, ``-n 1``, 16 channels
  forced, one QP a connection on RoCE, where ECMP collisions are likely); nccl-tests
  #169's A100 all_reduce of 1-8 GiB over 8 x 100G RoCE NICs a node at 3 / 4 / 6 nodes,
  0.73 / 0.61 / 0.42 of the model's rate for those NICs (flat at 96 GB/s); the Playbook's
  all_gather of 256 MB at 8 / 32 / 64 nodes, normalised to one node, 0.34 / 0.20 / 0.11
  of the model's fall.  Their falls are not one figure (0.64 at 32 nodes on one cluster,
  0.20 at 32 on another, 0.42 already at 6 nodes on a third), and #1229's ring at 32
  H100 nodes, the same month as #1218's, is at 0.96: the fabric and its routing decide,
  and none of these is Selene's HDR fat tree.

What the rows would need (``benchmarks/zero3_audit.py``): the ZeRO-3 530B rows 0.27-0.40 of
the priced ring rate at 80-280 nodes.  That lies inside the span measured on other
fabrics (0.11 .. 0.73 of the model), as does the model itself (#1229, 0.96-1.03): a fall
of that size is possible, not measured where the rows ran.  So NOTHING IS CHANGED: no figure
transfers to the a100 profile, and a bound from other fabrics would be a guess.  The
MT-NLG rows are not this question's: their data-parallel sync is a ring of one rank a node
over 8-12 nodes, 0.50-0.52 s a step, and their 6.4 s a step left unexplained would need
it about 14x slower than priced at nccl-tests' HDR rate (``benchmarks/mtnlg_audit.py``),
beyond the lowest ratio measured here (0.11, 9x): no collective figure found explains
them.  The estimate's UNCERTAIN line stays (``nccl_tuning.scale_assumption``; notebook
17 stores it); its docstring names this audit.  Published summary unchanged: 46 rows,
median 1.078, 32 within 15%, 3 beyond 30%.

Nothing here feeds the planner; ``tests/test_i2118.py`` holds each row to the model.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workbench.sim_mesh import nccl_tuning as NT  # noqa: E402
from workbench.sim_mesh import topology as topo  # noqa: E402

GIB = 1 << 30
MB256 = 256 * 2 ** 20


@dataclass(frozen=True)
class Figure:
    key: str
    source: str
    cluster: str
    gpu: str
    fabric: str
    nccl: str            # as stated, or "ASSUMED ..." from the date
    version: str         # the release whose tuning model prices it (nccl_tuning.VERSIONS)
    coll: str
    size: float          # bytes, nccl-tests' "size" (the whole buffer)
    nodes: int
    ppn: int
    algo: str            # "model's choice" or the forced one
    metric: str          # "busbw" (GB/s), "time_us", or "fall" (busbw / busbw at ref)
    measured: float
    profile: str
    ref_nodes: int = 0   # "fall" rows: the node count the curve is normalised to
    nic_gbps: float = 0  # per-GPU NIC line rate (Gb/s) where it is not the profile's
    note: str = ""


# NVIDIA/nccl #652 (2022-03-18): all_reduce_perf out-of-place times (us), 8..128 B
NCCL652 = {8: 62.99, 16: 62.85, 32: 65.46, 64: 63.54, 128: 63.94}
# Ultra-Scale Playbook, pp_comm_bandwidth.html (vinjn/nanotron-ultrascale-playbook@
# e3bcfc5c0b; tests/test_nccl15.py): all_gather median GB/s at 256 MB by nodes
PLAYBOOK_AG = {1: 249.8, 8: 69.0, 32: 28.0, 64: 11.0}
# nccl-tests #169 (2023-10-12): A100 80G, 8 x 100G RoCE NICs a node on PCIe, all_reduce
# -b 1G -e 8G: busbw by nodes as the post states it ("around 100", 70, "about 58", 40)
NCCLT169 = {2: 100.0, 3: 70.0, 4: 58.0, 5: 58.0, 6: 40.0}

# NVIDIA GTC25 session S72583, slide 12 "Collective Communication Bandwidth" (NCCL Tests
# Allreduce Bus Bandwidth in GB/s, 32 GPUs; the slide as stas00/ml-engineering@744d01e
# network/images/all-reduce-bw-2025.png reproduces it, its README citing the session)
GTC25 = {"a100": 192.0, "h100": 370.0}

FIGURES = (
    Figure("gtc25-a100@4", "NVIDIA GTC25 S72583 slide 12", "NVIDIA reference (32 GPUs)",
           "A100 x8 (DGX A100)", "NVL3 + 8 x 200Gb RDMA (IB/RoCE)",
           "not stated (ASSUMED 2.21.5; at 8 GiB the release does not matter)", "2.21.5",
           "all_reduce", 8.0 * GIB, 4, 8, "model's choice", "busbw", GTC25["a100"], "a100",
           note="the few-node anchor: size not stated (a peak figure: 8 GiB ASSUMED)"),
    Figure("gtc25-h100@4", "NVIDIA GTC25 S72583 slide 12", "NVIDIA reference (32 GPUs)",
           "H100 x8 (DGX H100)", "NVL4 + 8 x 400Gb RDMA (IB/RoCE), no SHARP",
           "not stated (ASSUMED 2.21.5)", "2.21.5", "all_reduce", 8.0 * GIB, 4, 8,
           "model's choice", "busbw", GTC25["h100"], "h100",
           note="as the row above; with SHARP the slide gives 480 (not modeled)"),
    Figure("nccl652", "NVIDIA/nccl #652 (2022-03-18)", "32-node cluster", "A100-SXM4 x8",
           "4 HDR NICs a node", "not stated (2.8.3 .. 2.13.4 price it alike)", "2.12.7",
           "all_reduce", 64.0, 32, 8, "model's choice", "time_us",
           sorted(NCCL652.values())[len(NCCL652) // 2], "a100",
           note="median of 8-128 B; the NIC count does not enter at these sizes"),
    Figure("nccl1229@32", "NVIDIA/nccl #1229 (2024-03-16)", "H100 cluster", "H100 x8",
           "not stated", "not stated (ASSUMED 2.20.5)", "2.20.5", "reduce_scatter",
           2.0 * GIB, 32, 8, "model's choice", "busbw", 300.0, "h100",
           note="size not stated: 2 GiB is the one of 1-16 GiB that fits all six node "
                "counts (tests/test_nccl_scale.py): a weak agreement"),
    Figure("nccl1229@128", "NVIDIA/nccl #1229 (2024-03-16)", "H100 cluster", "H100 x8",
           "not stated", "not stated (ASSUMED 2.20.5)", "2.20.5", "reduce_scatter",
           2.0 * GIB, 128, 8, "model's choice", "busbw", 260.0, "h100",
           note="as the row above"),
    Figure("nccl1218", "NVIDIA/nccl #1218 (2024-03-12)", "32-node H100 cluster", "H100 x8",
           "RoCE (NCCL_IB_GID_INDEX=3), 8 NICs a node, 1 QP a connection",
           "not stated (ASSUMED 2.20.5; 2.21.5 prices it alike)", "2.20.5", "all_gather",
           2.0 * GIB, 32, 8, "ring (all_gather's only)", "busbw", 200.0, "h100",
           note="all_gather_perf -b 2G -e 2G -n 1 -c 0, NCCL_MIN/MAX_NCHANNELS=16: one "
                "iteration; the title's figure"),
    Figure("nccl-tests169@3", "NVIDIA/nccl-tests #169 (2023-10-12)", "6 x 8 A100 80G",
           "A100 x8", "RoCE, 8 x 100G NICs a node on PCIe", "not stated (ASSUMED 2.12.7: "
           "at 8 GiB the release does not matter)", "2.12.7", "all_reduce", 8.0 * GIB, 3, 8,
           "model's choice", "busbw", NCCLT169[3], "a100", nic_gbps=100.0,
           note="-b 1G -e 8G, the post's one figure a node count; the a100 profile with "
                "its NICs at 100 Gb/s (24 -> 12 GB/s each)"),
    Figure("nccl-tests169@4", "NVIDIA/nccl-tests #169 (2023-10-12)", "6 x 8 A100 80G",
           "A100 x8", "RoCE, 8 x 100G NICs a node on PCIe", "not stated (ASSUMED 2.12.7)",
           "2.12.7", "all_reduce", 8.0 * GIB, 4, 8, "model's choice", "busbw",
           NCCLT169[4], "a100", nic_gbps=100.0, note="as the row above"),
    Figure("nccl-tests169@6", "NVIDIA/nccl-tests #169 (2023-10-12)", "6 x 8 A100 80G",
           "A100 x8", "RoCE, 8 x 100G NICs a node on PCIe", "not stated (ASSUMED 2.12.7)",
           "2.12.7", "all_reduce", 8.0 * GIB, 6, 8, "model's choice", "busbw",
           NCCLT169[6], "a100", nic_gbps=100.0, note="as the row above"),
) + tuple(
    Figure(f"playbook@{n}", "Ultra-Scale Playbook (Hugging Face 2025), 256 MB curve",
           "not stated", "H100 x8 (ASSUMED)", "not stated",
           "not stated (ASSUMED 2.21.5)", "2.21.5", "all_gather", float(MB256), n, 8,
           "model's choice", "fall", PLAYBOOK_AG[n] / PLAYBOOK_AG[1], "h100", ref_nodes=1,
           note="normalised to its one-node 249.8 GB/s (0.71 of nccl-tests' NVLink ring)")
    for n in (8, 32, 64))


def profile_for(fig: Figure):
    """The profile that prices ``fig``: NCCL ``fig.version``'s tables on ``fig.profile``,
    its NICs at ``fig.nic_gbps`` when the cluster's differ (the profile's efficiency kept)."""
    prof = NT.with_nccl(fig.profile, fig.version)
    if fig.nic_gbps:
        nic = dataclasses.replace(prof.inter_node, bandwidth=fig.nic_gbps / 8 * 1e9)
        prof = dataclasses.replace(prof, inter_node=nic)
    return prof


def _price(fig: Figure, nodes: int):
    prof = profile_for(fig)
    g = topo.Group((fig.ppn,) * nodes)
    c = topo.choose(fig.coll, float(fig.size), g, prof)
    factor = 2 * (g.p - 1) / g.p if fig.coll == "all_reduce" else (g.p - 1) / g.p
    return c.algorithm, c.seconds, factor * fig.size / c.seconds / 1e9


def model(fig: Figure) -> tuple[str, float]:
    """(algorithm, the model's figure in ``fig.metric``'s unit) for ``fig``'s collective."""
    algo, seconds, busbw = _price(fig, fig.nodes)
    if fig.metric == "time_us":
        return algo, seconds * 1e6
    if fig.metric == "busbw":
        return algo, busbw
    return algo, busbw / _price(fig, fig.ref_nodes)[2]


def rows() -> list[dict]:
    out = []
    for f in FIGURES:
        algo, m = model(f)
        out.append({"figure": f, "algorithm": algo, "model": m,
                    "ratio": f.measured / m})        # measured / modeled
    return out


def row_needs() -> list[dict]:
    """The ZeRO-3 530B rows' largest gather as NCCL 2.8.3's model prices it over the row's
    data-parallel ranks (fc1's 4h x h fp16 weight, h 20,480, 3.36 GB): the rate the other
    clusters' ratios would scale (read, not applied)."""
    prof = NT.with_nccl("a100", "2.8.3")
    size = 4 * 20480 * 20480 * 2.0
    out = []
    for gpus in (640, 1120, 2240):
        g = topo.Group((8,) * (gpus // 8))
        c = topo.choose("all_gather", size, g, prof)
        out.append({"gpus": gpus, "nodes": gpus // 8, "algorithm": c.algorithm,
                    "busbw": (g.p - 1) / g.p * size / c.seconds / 1e9})
    return out


def _fmt(x: float, metric: str) -> str:
    return f"{x:8.1f} us" if metric == "time_us" else \
        (f"{x:8.3f}   " if metric == "fall" else f"{x:7.1f} GB/s")


def main() -> None:
    print("NCCL at scale: sourced measurements against the planner's NCCL model "
          "(measured / model < 1: the model is optimistic)\n")
    hdr = (f"{'figure':17} {'GPU':12} {'NCCL':7} {'collective':14} {'size':>9} "
           f"{'nodes':>9} {'algorithm':9} {'measured':>12} {'model':>12} {'meas/model':>10}")
    print(hdr)
    for r in rows():
        f = r["figure"]
        size = f"{f.size / GIB:.2f} GiB" if f.size >= GIB / 4 else f"{f.size:.0f} B"
        nodes = f"{f.nodes}x{f.ppn}" + (f"/{f.ref_nodes}" if f.metric == "fall" else "")
        print(f"{f.key:17} {f.gpu.split()[0]:12} {f.version:7} {f.coll:14} {size:>9} "
              f"{nodes:>9} {r['algorithm']:9} {_fmt(f.measured, f.metric):>12} "
              f"{_fmt(r['model'], f.metric):>12} {r['ratio']:10.2f}")
    print("\nper figure: source; fabric; NCCL release; notes")
    for f in FIGURES:
        print(f"  {f.key}: {f.source}; {f.cluster}, {f.fabric}; NCCL {f.nccl}"
              + (f"; {f.note}" if f.note else ""))
    print("\nA100 over HDR InfiniBand at 48-420 nodes (the ZeRO-3 / MT-NLG rows): no "
          "measurement found (sources: this module's docstring)")
    print("the ZeRO-3 530B rows' fc1 all_gather (3.36 GB) as NCCL 2.8.3's model prices it, "
          "and at the other clusters' measured / model ratios (read, not applied):")
    ratios = {r["figure"].key: r["ratio"] for r in rows()}
    for n in row_needs():
        print(f"  {n['gpus']:5} GPUs ({n['nodes']:3} nodes): {n['algorithm']} "
              f"{n['busbw']:6.1f} GB/s; x #1218's {ratios['nccl1218']:.2f}: "
              f"{n['busbw'] * ratios['nccl1218']:5.1f}; x #169's (6 nodes) "
              f"{ratios['nccl-tests169@6']:.2f}: {n['busbw'] * ratios['nccl-tests169@6']:5.1f}"
              f"; x #1229's (128 nodes) {ratios['nccl1229@128']:.2f}: "
              f"{n['busbw'] * ratios['nccl1229@128']:5.1f}")
    print("  the rows would need 0.27-0.40 of the priced rate (benchmarks/zero3_audit.py): "
          "inside the measured span, not one figure; nothing changed")
    low = min(ratios.values())
    print(f"MT-NLG: its DP sync (8-12 nodes, one rank a node, 0.50-0.52 s a step) would need "
          f"x14 (benchmarks/mtnlg_audit.py); the lowest measured ratio here, {low:.2f}, "
          f"gives x{1 / low:.1f}")


if __name__ == "__main__":
    main()
