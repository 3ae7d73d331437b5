"""All-reduce bus bandwidth at scale: 2 to 1,024 ranks, 1 KiB to 1 GiB, per profile.

    python benchmarks/comm_scale.py [--out comm_scale.png] [--profiles a100 h100 ...]

For every built-in profile (``workbench.list_profiles()``), every group of p = 2, 4, ...,
1,024 ranks packed node by node (``devices_per_node`` per node) and every message of
1 KiB ... 1 GiB (nccl-tests' "size": the buffer each rank all-reduces), the clock prices
the all-reduce the profile's library runs (``cost.choose``: NCCL ring / tree with its
LL / LL128 / Simple protocols; HCCL mesh / ring / halving-doubling / hierarchical /
pipelined) and the script reports nccl-tests' bus bandwidth, busbw = size / time x
2(p-1)/p (``cost.bus_bandwidth``; nccl-tests doc/PERFORMANCE.md).

Beside each curve, the textbook formula (alpha-beta, no protocols, no algorithm choice):

- one node: a ring on the fast link, 2(p-1) alpha + 2 (p-1)/p n / B_intra (NVSwitch);
  HCCL's Mesh on a full mesh, 2 alpha + 2 n/p / B_link (one HCCS link's rate);
- several nodes: the hierarchical all-reduce (intra reduce-scatter, inter all-reduce of
  n / k on each rank's NIC, intra all-gather), ``cost.hierarchical_time`` with
  B_intra = the fast link's effective rate and B_nic = the NIC's,

and published figures where we found them (each with its source; none for HCCL; the
table marks the two a profile's efficiency was fitted to, #212 and #119, which the clock
matches by construction: only the others test the model):

- A100, 8 GPUs in one node: 232.5 GB/s all_reduce busbw at large sizes, 8 x
  A100-SXM4-80GB (nccl-tests issue #175, as cited in profiles/a100.json); a user's 8 x
  A100-SXM4-80GB: "a busbw of ~200 GB/s" (nccl-tests issue #149, 2023-06-27);
- H100, 8 GPUs in one node, NCCL_ALGO=RING: about 370 GB/s busbw ("NCCL can get an
  effective NVLink bandwidth of 370GB/s, which you can observe as BusBw ... when running
  with NCCL_ALGO=RING", S. Jeaugey, nccl-tests issue #212, 2024-05-06); NVLS reaches
  ~480 GB/s (same comment), not modeled;
- H100, 2 nodes of 8 with 8 x 400G CX7 NICs each: "around 48GB/s from each CX7 NIC ...
  aggregated to achieve up to ~396GB/s with the RING protocol" (A. Ladd, nccl-tests issue
  #319, 2025-06-11);
- across nodes, per NIC: "24GB/s is the peak performance per 200G NIC" (S. Jeaugey,
  nccl-tests issue #119, 2022-11-17) and 46-48 GB/s per 400 Gb/s NDR NIC (A. Ladd,
  nccl-tests issue #290, 2025-03-03), shown beside the model's per-NIC rate (multi-node
  busbw is bounded by ranks-per-node x that rate);
- Ascend 910B / HCCL: no published all-reduce bus-bandwidth figure was found (HCCL's
  Performance Tester reports alg_bandwidth only: CANN HCCL tool guide, "Result
  Description", HCCLpertest_16_0006); nothing is shown.

Then, per profile, the pipelined hierarchical all-reduce of 1 GiB over 4 nodes x 8
(``sim_mesh.hierarchical``: fill/drain + (c-1) x the slowest phase, against the flat
ring) and a 256 MiB tensor-parallel all-reduce over 8 ranks with a share of its bytes on
the idle NICs (``sim_mesh.nic_assist``).

Prints a table (busbw in GB/s, per profile, for a few rank counts and sizes) and saves the
figure.  Pricing only: a few thousand cached clock calls, about a second.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workbench as wb  # noqa: E402
from workbench.sim_mesh import cost  # noqa: E402
from workbench.sim_mesh.hierarchical import plan_pipelined_all_reduce  # noqa: E402
from workbench.sim_mesh.nic_assist import nic_assisted  # noqa: E402
from workbench.sim_mesh.profiles import Link, get_profile  # noqa: E402

RANKS = [2 ** i for i in range(1, 11)]                 # 2 .. 1,024
SIZES = [2 ** i for i in range(10, 31)]                # 1 KiB .. 1 GiB
GB = 1e9

# (profile, ranks, what, busbw GB/s low, high, source); ranks None: per NIC across nodes
PUBLISHED = [
    ("a100", 8, "all_reduce busbw, 8 x A100-SXM4-80GB, large sizes", 232.5, 232.5,
     "nccl-tests issue #175 (as cited in profiles/a100.json)"),
    ("a100", 8, "all_reduce busbw, a user's 8 x A100-SXM4-80GB (HPE Apollo 6500), 'about'",
     200.0, 200.0, "nccl-tests issue #149, 2023-06-27"),
    ("h100", 8, "all_reduce busbw with NCCL_ALGO=RING, 8 x H100", 370.0, 370.0,
     "nccl-tests issue #212, S. Jeaugey (NVIDIA), 2024-05-06"),
    ("h100", 16, "all_reduce busbw, 2 nodes x 8 H100, 8 x 400G CX7 each, ring, 'up to'",
     396.0, 396.0, "nccl-tests issue #319, A. Ladd (NVIDIA), 2025-06-11"),
    ("a100", None, "per 200 Gb/s HDR NIC across nodes ('the peak')", 24.0, 24.0,
     "nccl-tests issue #119, S. Jeaugey (NVIDIA), 2022-11-17"),
    ("h100", None, "per 400 Gb/s NDR NIC across nodes", 46.0, 48.0,
     "nccl-tests issue #290, A. Ladd (NVIDIA), 2025-03-03"),
]
# Published figures a profile's efficiency was fitted to (its JSON's "intra_node.efficiency"
# / "inter_node.efficiency" notes): the clock agrees with them by construction, so they
# check the arithmetic, not the model.  The others are independent of the profiles.
FITTED = {("h100", 8): "h100.json intra_node.efficiency = 370 / 450 (issue #212)",
          ("a100", None): "a100.json inter_node.efficiency = 24 / 25 (issue #119)"}
NOT_FOUND = {"ascend-910b": "no published HCCL all-reduce bus bandwidth found (the HCCL "
                            "Performance Tester reports alg_bandwidth only, CANN HCCL tool "
                            "guide HCCLpertest_16_0006)"}


def nic_rate(prof) -> float:
    return (prof.inter_node.effective_bandwidth * prof.topology.nics_per_node
            / prof.devices_per_node)


def formula_seconds(n: int, p: int, prof) -> float:
    """The textbook alpha-beta all-reduce (module docstring)."""
    d = prof.devices_per_node
    intra = Link("intra", prof.intra_node.effective_bandwidth, prof.intra_node.latency)
    if p <= d and prof.topology.intra_fabric == "full_mesh":
        # HCCL Mesh (HCCL user guide, "Mesh"): 2 alpha + 2 n/p beta, beta per HCCS link
        link = prof.intra_node.effective_bandwidth / prof.topology.intra_links
        return 2 * prof.intra_node.latency + 2 * n / p / link
    if p <= d:
        return cost.collective_time("all_reduce", n, p, intra, "ring")
    inter = Link("nic", nic_rate(prof), prof.inter_node.latency)
    return cost.hierarchical_time("all_reduce", n, d, p // d, intra, inter, "ring")


def sweep(profiles, ranks=RANKS, sizes=SIZES):
    """{profile: {p: [(n, busbw clock, busbw formula, algorithm), ...]}}."""
    out = {}
    for name in profiles:
        prof = get_profile(name)
        out[name] = {}
        for p in ranks:
            rows = []
            for n in sizes:
                pick = cost.choose("all_reduce", n, range(p), prof)
                rows.append((n, cost.bus_bandwidth("all_reduce", n, p, pick.seconds),
                             cost.bus_bandwidth("all_reduce", n, p, formula_seconds(n, p, prof)),
                             pick.algorithm))
            out[name][p] = rows
    return out


def _size(n: int) -> str:
    for unit, f in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= f:
            return f"{n // f} {unit}"
    return f"{n} B"


def table(data, show_ranks=(2, 8, 16, 128, 1024), show_sizes=(2 ** 10, 2 ** 20, 2 ** 26,
                                                               2 ** 30)) -> str:
    lines = []
    for name, by_p in data.items():
        prof = get_profile(name)
        lines.append(f"\n{name} ({prof.topology.library}, {prof.devices_per_node} per node): "
                     f"all_reduce busbw GB/s, clock [formula] (algorithm)")
        lines.append("  ranks " + "".join(f"{_size(n):>28}" for n in show_sizes))
        for p in show_ranks:
            rows = {n: r for n, *r in by_p[p]}
            cells = "".join(f"{rows[n][0] / GB:>10.1f} [{rows[n][1] / GB:6.1f}] "
                            f"({rows[n][2][:5]:>5})" for n in show_sizes)
            lines.append(f"  {p:>5} {cells}")
        for pname, p, what, lo, hi, src in PUBLISHED:
            if pname != name:
                continue
            fig = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
            at = dict((n, r) for n, *r in by_p.get(p, ()))
            if p is None:
                model = f"model's NIC rate {nic_rate(prof) / GB:.1f} GB/s"
            elif 2 ** 30 in at:
                model = f"clock at p={p}, 1 GiB: {at[2 ** 30][0] / GB:.1f}"
            else:
                model = f"p={p} at 1 GiB not in this sweep"
            fit = FITTED.get((name, p))
            check = (f"; FITTED: {fit}, agrees by construction" if fit else
                     "; independent of the profile")
            lines.append(f"  published: {what}: {fig} GB/s ({src}); {model}{check}")
        if name in NOT_FOUND:
            lines.append(f"  published: {NOT_FOUND[name]}")
    return "\n".join(lines)


def plot(data, path, curves=(2, 8, 16, 128, 1024)):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4.5), squeeze=False)
    for ax, (name, by_p) in zip(axes[0], data.items()):
        for i, p in enumerate(curves):
            rows = by_p[p]
            xs = [n for n, *_ in rows]
            line, = ax.plot(xs, [r[1] / GB for r in rows], label=f"p={p} clock")
            ax.plot(xs, [r[2] / GB for r in rows], "--", color=line.get_color(), alpha=0.6,
                    label="formula" if i == 0 else None)
        for pname, p, what, lo, hi, src in PUBLISHED:
            if pname == name and p is not None:
                ax.errorbar([2 ** 30], [(lo + hi) / 2], yerr=[[(hi - lo) / 2], [(hi - lo) / 2]],
                            fmt="k*" if (name, p) not in FITTED else "kx", ms=10,
                            label=f"published p={p} ({src.split(',')[0]})"
                            + (", profile fitted to it" if (name, p) in FITTED else ""))
        if name in NOT_FOUND:
            ax.text(0.02, 0.95, "no published HCCL busbw found", transform=ax.transAxes,
                    fontsize=8, va="top")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size per rank (bytes)")
        ax.set_ylabel("all_reduce bus bandwidth (GB/s)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=wb.list_profiles())
    ap.add_argument("--out", default="comm_scale.png", help="where to save the figure")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = sweep(args.profiles)
    took = time.perf_counter() - t0
    print(f"all_reduce over 2..1,024 ranks x 1 KiB..1 GiB on {', '.join(args.profiles)}: "
          f"{sum(len(r) for d in data.values() for r in d.values())} prices in {took:.2f} s")
    print(table(data))
    print("\nthe pipelined hierarchical all-reduce (4 nodes x 8) and TP over idle NICs (8 ranks):")
    for name in args.profiles:
        print(" ", plan_pipelined_all_reduce(2 ** 30, range(32), name))
        print(" ", nic_assisted("all_reduce", 2 ** 28, range(8), name))
    if not args.no_plot:
        plot(data, args.out)
        print(f"\nfigure: {args.out}")
    return data


if __name__ == "__main__":
    main()
