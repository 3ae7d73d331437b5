"""A range on an estimate where its inputs are uncertain.

A profile figure its citation marks ASSUMPTION or UNCERTAIN is a guess; where the
citation itself states how far off it may be, the planner re-prices the step with every
such figure at its slow end and at its fast end (``estimate_range``): the step time,
throughput and MFU are then a range, and the figures varied are named with the source of
each bound.  Bounds are read from the profiles' own citations, never fitted:

- ``h100`` ``measured.attention_backend``: the fused attention kernel, both ends measured
  on an H100 (``sim_mesh.measured``): cuDNN's fused attention (Transformer Engine's
  FusedAttention on Hopper; the profile's choice, the fast end) and FlashAttention-2 as
  PyTorch ships it (the slow end).  Which kernel a run uses decides; FlashAttention-3
  (Shah et al. 2024) was not measured.
- ``h100-hbm2e`` (torchtitan's benchmark H100: HBM2e, 500 W) ``measured.compute_scale``:
  "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
  value" (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md): the measured SXM
  card's GEMM and attention rates at the NVL's 835 / 989 of them (slow end) .. the SXM's
  own (fast end), the profile's point the midpoint; its other peaks (fp32, fp64, tf32,
  FP8: the SXM's x the same ratio, one clock ASSUMED) move with it; the attention kernels
  as on ``h100``.
- ``a100`` ``kernel_bandwidth.*``: Megatron's unfused attention core and dropout,
  measured on the A100 40GB (1,555 GB/s) and scaled to the 80GB part's 2,039 GB/s as the
  ASSUMPTION says: the slow end keeps the measured rate unscaled (the kernels may not
  speed up with the faster memory); apex's LayerNorm, measured on a GA100 and kept as
  is on the 80GB part (ASSUMPTION): the fast end scales it by 2,039 / 1,555.
- ``a100-jeanzay`` ``inter_node.efficiency`` (MEASURED on 4 A100 nodes in January 2022,
  UNCERTAIN for later runs): the measured 0.405 of one Omni-Path adapter is the slow end,
  the 0.846 the same NCCL reached on one adapter of the cluster's V100 nodes the same day
  the fast end; the A100 kernels' bounds as on ``a100``.
- ``ascend-910b`` ``intra_node.bandwidth`` (UNCERTAIN: "if 56 GB/s is per direction,
  double it"): the fast end doubles it; ``efficiency.matmul`` (ASSUMPTION 0.8, between
  the A100's and H100's best-shape bursts, MAMF 0.86 / 0.80): 0.80 .. 0.86.

- ``h100``, ``a100`` and the profiles built on them: ``topology.collective_hbm_factor``,
  the HBM bytes an NCCL collective moves per byte on its link, which the kernels beside
  it lose (``sim_mesh.kernel_cost.hbm_share``): 3 at the slow end (NCCL's maintainer: "it
  can be 3x", NVIDIA/nccl #1428) .. 0, the point and the fast end (the SMs NCCL holds
  alone): the component measurements found need factors from about 0 (Korthikanti et al.
  Table 4's tensor-parallel backward on the A100) to 2.6 (#1428's A100 kernels), so none
  is the point (the profiles' citation; tests/test_i21c11.py).

The A100 profiles' slow end also paces the job's device work by the slowest of its
devices (``plan.variability``: the expected maximum of a per-device slowdown measured on
219 A100 40GB GPUs, an ASSUMPTION for the 80GB SXM parts, never in the point estimate).

Memory: the communication library's buffers (``plan.comm_memory``) are a range, from
NCCL 2.22+'s lazily connected algorithms to everything connected at init as before
(``EstimateRange.memory``).

Figures marked ASSUMPTION without a stated bound (latencies, NCCL's SMs, the runtime
context, fragmentation...) are listed as ``unbounded``: the range does not cover them.
A profile loaded by the user (``load_profile``) has no bounds here: its range is the
point estimate, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..sim_mesh.profiles import Profile, get_profile
from . import variability as VAR
from .text_width import wrap

__all__ = ["BOUNDS", "EstimateRange", "estimate_range", "profile_at", "ranking_ranges"]

_A100_40GB = 1555e9 / 2039e9      # the 40GB part's HBM over the 80GB part's (datasheets)
_MEASURED_40GB = ("measured on the A100 40GB and scaled to 2,039 GB/s (ASSUMPTION); slow "
                  "end: the measured rate unscaled")

_LN_GA100 = ("apex's LayerNorm rate measured on a GA100, kept on the 80GB part (ASSUMPTION); "
             "fast end: scaled by 2,039 / 1,555 GB/s as if measured on the 40GB part")

_HBM = ("HBM bytes an NCCL collective moves per link byte, taken from the kernels beside it "
        "(kernel_cost.hbm_share): 3, its maintainer's 'it can be 3x' (NVIDIA/nccl #1428) .. "
        "0, the point: the SMs NCCL holds alone; component measurements need 0 .. 2.6")
_HBM_BOUND = (("topology.collective_hbm_factor", 3.0, 0.0, "value", _HBM),)

# profile name -> ((field, slow value or factor, fast value or factor, kind, why), ...);
# kind "value": absolute figures; "scale": factors of the profile's own figure
BOUNDS = {
    "h100": (("measured.attention_backend", "flash", "cudnn", "value",
              "FlashAttention-2 as PyTorch ships it .. cuDNN's fused attention, both measured "
              "on an H100 (sim_mesh/measurements/h100-sxm-80gb.json: 170-241 .. 320-455 "
              "TFLOP/s forward + backward, causal, sequence 4096)"),) + _HBM_BOUND,
    "a100": tuple((f"kernel_bandwidth.{k}", _A100_40GB, 1.0, "scale", _MEASURED_40GB)
                  for k in ("attention_core_forward", "attention_core_backward",
                            "dropout_forward", "dropout_backward"))
    + tuple((f"kernel_bandwidth.{k}", 1.0, 1 / _A100_40GB, "scale", _LN_GA100)
            for k in ("layer_norm_forward", "layer_norm_backward")) + _HBM_BOUND,
    "a100-jeanzay": (("inter_node.efficiency", 0.405, 0.846, "value",
                      "NCCL 2.10.3 over one Jean Zay Omni-Path adapter as the cluster's own "
                      "all-reduce benchmarks measured it in January 2022: 5.07 of 12.5 GB/s "
                      "on the A100 nodes (2 ring channels) .. 10.57 on the V100 nodes (4 "
                      "channels; experiments/bandwidth/all_reduce_bench-32gb-n4.txt)"),),
    "ascend-910b": (("intra_node.bandwidth", 1.0, 2.0, "scale",
                     "56 GB/s read as both directions .. as one direction (UNCERTAIN in "
                     "the profile: 'double it')"),
                    ("efficiency.matmul", 0.80, 0.86, "value",
                     "the H100 .. A100 best-shape GEMM bursts (MAMF) the ASSUMPTION cites")),
}
BOUNDS["a100-jeanzay"] = BOUNDS["a100"] + BOUNDS["a100-jeanzay"]   # the same GPU's kernels
# torchtitan's H100 (HBM2e, 500 W): "the actual peak TFLOPs number is between SXM and NVL"
_TT_PEAK = ("the H100 NVL's .. the H100 SXM's dense BF16 peak (835 .. 989 TFLOP/s, NVIDIA's "
            "H100 page as torchtitan's get_peak_flops encodes it), the bounds torchtitan's "
            "benchmark text puts on its card's peak; the measured SXM rates scaled alike")
_TT_CLOCK = ("the profile's other peaks are the h100 (SXM) profile's x the bf16 peak's ratio "
             "(ASSUMPTION: one clock scales every unit): at the NVL's 835 / 989 of them .. "
             "the SXM's own (the H100 datasheet), with the bf16 peak")
BOUNDS["h100-hbm2e"] = BOUNDS["h100"] + tuple(
    (f, 835e12 / 989e12 * x, x, "value", _TT_PEAK)
    for f, x in (("measured.compute_scale", 1.0), ("peak_flops.bfloat16", 989e12),
                 ("peak_flops.float16", 989e12))) + tuple(
    (f, 835e12 / 989e12 * x, x, "value", _TT_CLOCK)      # the h100 profile's SXM figures
    for f, x in (("peak_flops.float32", 67e12), ("peak_flops.float64", 67e12),
                 ("peak_flops.tf32", 494.5e12), ("peak_flops.float8", 1979e12)))


def _get(d: dict, path: str):
    for k in path.split("."):
        d = d[k]
    return d


def _set(d: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        d = d[k]
    d[last] = value


def _check_pinned(profile: Profile, pinned) -> dict:
    """``pinned`` as a dict: bounded fields of ``profile`` (``BOUNDS``) held at a value."""
    try:
        pins = dict(pinned or ())
    except (TypeError, ValueError):
        raise ValueError(f"pinned={pinned!r}: give a dict {{field: value}} of bounded "
                         f"figures, e.g. {{'measured.attention_backend': 'flash'}}, or None")
    named = {f for f, *_ in BOUNDS.get(profile.name, ())}
    for f in pins:
        if f not in named:
            raise ValueError(f"pinned={dict(pins)!r}: {f!r} is not a bounded figure of "
                             f"profile {profile.name!r} (its bounds: {sorted(named)}); pin "
                             f"only those, or give pinned=None")
    return pins


@lru_cache(maxsize=None)
def profile_at(profile: Profile, end: str, pinned: tuple = ()) -> Profile:
    """``profile`` with every bounded figure (``BOUNDS``) at its ``end``, "slow" or
    "fast" (the profile itself where it has no bounds); ``pinned``: ((field, value),
    ...), bounded figures held at that value at both ends (what a run is known to have
    used, e.g. the attention kernel of a pinned PyTorch release)."""
    if end not in ("slow", "fast"):
        raise ValueError(f"profile_at: end={end!r}; use 'slow' or 'fast'")
    pins = _check_pinned(profile, pinned)
    bounds = BOUNDS.get(profile.name, ())
    if not bounds:
        return profile
    data = profile.to_dict()
    for field, slow, fast, kind, _ in bounds:
        x = slow if end == "slow" else fast
        if field in pins:
            _set(data, field, pins[field])
            continue
        _set(data, field, x if kind == "value" else _get(data, field) * x)
    data["name"] = f"{profile.name} ({end} end)"
    return Profile.from_dict(data)


@dataclass(frozen=True)
class EstimateRange:
    """An estimate with its range: ``slow`` and ``fast`` re-price the step with every
    bounded uncertain figure at that end; ``varied`` names them and their bounds'
    sources; ``unbounded`` the profile's other ASSUMPTION / UNCERTAIN figures."""
    estimate: object
    slow: object
    fast: object
    varied: tuple
    unbounded: tuple

    @property
    def step_time(self) -> tuple[float, float]:
        """(fastest, slowest) seconds per step; the point estimate lies between."""
        ts = (self.fast.step_time, self.slow.step_time, self.estimate.step_time)
        return min(ts), max(ts)

    @property
    def memory(self) -> tuple[float, float]:
        """(lowest, highest) bytes on the busiest rank: the point estimate's total with
        the communication library's buffers at their low and high ends
        (``plan.comm_memory``: NCCL's version, topology and algorithms); the bounded
        profile figures move time, not memory."""
        e = self.estimate
        c, t = e.details["comm_buffers"], e.memory["total"]
        return t - c["point"] + c["low"], t - c["point"] + c["high"]

    @property
    def mfu(self) -> tuple[float, float]:
        ms = (self.fast.mfu, self.slow.mfu, self.estimate.mfu)
        return min(ms), max(ms)

    @property
    def tflops_per_device(self) -> tuple[float, float]:
        ts = (self.fast.tflops_per_device, self.slow.tflops_per_device,
              self.estimate.tflops_per_device)
        return min(ts), max(ts)

    def __str__(self):
        lo, hi = self.step_time
        m0, m1 = self.mfu
        e = self.estimate
        head = (f"{e.layout.short()}: {e.step_time:.3f} s/step (range {lo:.3f} .. {hi:.3f}), "
                f"MFU {e.mfu:.1%} ({m0:.1%} .. {m1:.1%})")
        if not self.varied:
            head += "; no bounded uncertain input on this profile: the range is the point"
        g0, g1 = self.memory
        lines = [head] + [f"  varied: {v}" for v in self.varied] + [
            f"  memory {e.memory['total'] / 1e9:.1f} GB (range {g0 / 1e9:.1f} .. "
            f"{g1 / 1e9:.1f}: {e.details['comm_buffers']['library']}'s buffers, "
            f"plan/comm_memory.py)"]
        if self.unbounded:
            lines.append(f"  not in the range (ASSUMED, no bound stated): "
                         f"{', '.join(self.unbounded)}")
        return wrap("\n".join(lines))      # at text_width.WIDTH, continuations indented


def estimate_range(model, layout, cluster, pinned: "dict | None" = None,
                   **kwargs) -> EstimateRange:
    """``estimate(model, layout, cluster, **kwargs)`` with its range (module docstring).
    ``pinned``: {field: value} of bounded figures a run is known to have used, held at
    that value at both ends and not varied (e.g. ``{"measured.attention_backend":
    "flash"}`` for an FSDP run on a PyTorch release whose SDPA ran FlashAttention-2):
    pin the value the point estimate prices (for ``framework="fsdp"`` the attention
    kernel is SDPA's, ``plan.fsdp2_cost.sdpa_profile``), or the range may not hold it."""
    from .estimate import estimate
    from .layout import Cluster
    if not isinstance(cluster, Cluster):    # as estimate's check_layout, before reading it
        raise ValueError(f"estimate_range: cluster={cluster!r} must be a "
                         f"workbench.plan.Cluster, e.g. Cluster('a100', 8)")
    prof = get_profile(cluster.profile)
    pins = _check_pinned(prof, pinned)
    point = estimate(model, layout, cluster, **kwargs)
    ends = {end: estimate(model, layout, Cluster(profile_at(prof, end, tuple(
        sorted(pins.items()))), cluster.devices), **kwargs) for end in ("slow", "fast")}
    bounds = tuple(b for b in BOUNDS.get(prof.name, ()) if b[0] not in pins)
    by_why = {}
    for f, s, q, k, why in bounds:     # one line per source, its fields together
        by_why.setdefault(why, []).append(f"{f} {_fmt(prof, f, s, k)} .. {_fmt(prof, f, q, k)}")
    varied = tuple(f"{', '.join(fs)} ({why})" for why, fs in by_why.items())
    if prof.name in VAR.PROFILES:      # the slowest device paces the job (plan.variability)
        ends["slow"] = VAR.stretch(ends["slow"], cluster.devices)
        varied += (VAR.range_line(cluster.devices, ends["slow"].details["straggler"]["factor"]),)
    named = {f for f, *_ in bounds} | set(pins)      # pinned: known, not a guess
    unbounded = tuple(sorted(k for k, v in prof.citations.items()
                             if ("ASSUMPTION" in v or "UNCERTAIN" in v) and k not in named))
    return EstimateRange(point, ends["slow"], ends["fast"], varied, unbounded)


def _fmt(prof, field, x, kind) -> str:
    v = x if kind == "value" else _get(prof.to_dict(), field) * x
    return v if isinstance(v, str) else f"{v:.3g}"


def ranking_ranges(ranking, model, **kwargs) -> str:
    """The ranges of a ``search`` ranking's layouts (``estimate_range`` on each; the
    ``kwargs`` the search was given: ``attention``, ``overlap``...), then what the range
    varied, what it leaves out, and what the first layout's estimate assumed: the lines
    ``python -m workbench plan`` prints under its table."""
    if not ranking:
        return ""
    rows = [f"{'#':>2} {'step s':>8} {'range':>19} {'MFU':>6} {'range':>15}"]
    first = None
    for i, (lay, _) in enumerate(ranking, 1):
        r = estimate_range(model, lay, ranking.cluster, **kwargs)
        first = first or r
        (lo, hi), (m0, m1) = r.step_time, r.mfu
        rows.append(f"{i:>2} {r.estimate.step_time:>8.3f} {lo:>8.3f} .. {hi:<8.3f} "
                    f"{r.estimate.mfu:>6.1%} {m0:>6.1%} .. {m1:<6.1%}")
    head = "range: every profile figure with a stated bound at its slow and its fast end"
    flat = all(r.split()[2] == r.split()[4] for r in rows[1:])
    lines = [head, *rows]
    lines += [f"varied: {v}" + (" (no effect on these layouts)" if flat else "")
              for v in first.varied] or \
        ["varied: nothing (no bounded uncertain figure on this profile)"]
    if first.unbounded:
        lines.append(f"not in the range (ASSUMED, no bound stated): "
                     f"{', '.join(first.unbounded)}")
    lines.append(f"#1 assumes: {'; '.join(first.estimate.assumptions())}")
    return wrap("\n".join(lines))          # at text_width.WIDTH, continuations indented
