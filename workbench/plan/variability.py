"""The slowest device of a synchronous group: per-device performance variability.

Devices of one model and SKU do not sustain the same speed (silicon, power and thermal
management).  A synchronous step waits, at every collective, for the slowest rank; where
each device's slowdown is persistent (the same device is slow every time), every rank of
a data-, tensor- or pipeline-parallel job ends up pacing its work to the slowest device
of the whole job: the step's device work stretches by the expected maximum of the
per-device slowdowns over the ``N`` devices that synchronise every step (the job's
devices).  This module gives that order statistic from a measured distribution and
stretches an estimate by it.  It is applied at the range's SLOW END ONLY
(``plan.ranges.estimate_range``), never to the point estimate: see "Why only the range".

The measured distribution (the only per-device A100 distribution found; module data
below): Jain et al., "PAL: A Variability-Aware Policy for Scheduling ML Workloads in GPU
Clusters", SC'24 (arXiv 2408.11919), artifact hal-uw/blox-pal (1a26bbfc31, 2024-02-15)
``aggregated_data/ls6/resnet-ls6-agg.csv``: ResNet-50 training on 219 A100 40GB GPUs of
TACC's Lonestar6 (73 nodes x 3 GPUs in 11 cabinets, c302..c317), one row per GPU:
``perf`` (its iteration time, seconds), ``norm_perf`` = ``perf`` / the median over the
219 GPUs (checked: the file's median ``perf`` 0.02528 s reproduces ``norm_perf`` on
every row): above 1 is slower than the median GPU.  Two whole nodes (c316-8: 2.14,
2.20, 2.17; c317-12: 2.16, 2.16, 2.17) run at about twice the median, every GPU alike: a
node fault, which an operator drains before a long run, so they are left out
(ASSUMPTION); kept, any group of more than a few dozen GPUs would be paced at 2.2x.  The other 213 GPUs (71 nodes): mean
1.0014, population standard deviation 0.0211, minimum 0.9490, median 0.9993, maximum
1.0915; their quantiles are ``QUANTILES``.

Context, not used as figures: stas00/ml-engineering (744d01e)
compute/accelerator/README.md, "Not all accelerators are created equal": "I have seen 5%
and higher differences on an 8-gpu node" and "on the same 8-GPU node you can see 5%+ MAMF
spread between GPUs" (no distribution, no count); its advice, "pick the value of the
slowest accelerator", is the model here.  Sinha et al., SC'22 ("Not All GPUs Are Created
Equal", arXiv 2208.11035): V100 (Summit, Vortex, Longhorn, Frontera) and MI60 (Corona)
clusters, "8% (max 22%) average performance variation ... outliers up to 1.5X slower than
the median GPU" (arXiv abstract): no A100 or H100.  Llama 3 (arXiv 2407.21783, sec.
3.3.4): "a diurnal 1-2% throughput variation based on time-of-day" of the whole H100
job (temporal, not a per-device distribution): not priced, no H100 bound here.

Why only the range (ASSUMPTION, stated in the range's ``varied`` line): the measured
GPUs are A100 40GB on Lonestar6, the published A100 rows ran A100 SXM4 80GB (400 W) in
DGX-class nodes: another board, power limit and cooling; and the measured figure is a
whole ResNet-50 iteration, not a GEMM or a kernel: which script produced the file is not
stated, and both training scripts of the two artifacts (hal-uw/gpu_variability_sc22_artifact
sec5a_resnet/cnn_utils/engine.py, hal-uw/blox-pal blox_exp/profilers/imagenet_ddp.py)
time an iteration on the host without synchronising the GPU (the latter with the data
loader's wait inside), so host and node effects are in the spread beside the GPU's own.

The model: ``slowest_expected(n)`` = E[max of n independent draws] of the slowdown whose
quantile function ``Q`` is ``QUANTILES`` interpolated linearly:
E = integral over u in (0, 1) of Q(u) d(u^n).  With ``n`` above the sample's 213 GPUs
the tail is not extrapolated: the bound is the slowest measured GPU, 1.0915
(ASSUMPTION).  Computed exactly from the file's 213 values (the discrete order
statistic), E = 1.0338 / 1.0654 / 1.0903 at n = 8 / 64 / 512; the quantile table gives
1.0339 / 1.0614 / 1.0863 (tests/test_straggle.py).  ``stretch`` lengthens the step's
device work, compute (with the optimizer step) and the bubble's compute share, by that
factor; communication, bound by links and not by the slow device's clock, is left as is
(ASSUMPTION: the source timed one GPU's whole iteration, so all its local work is held to
the spread).
"""
from __future__ import annotations

from dataclasses import replace

__all__ = ["QUANTILES", "SOURCE", "PROFILES", "slowest_expected", "stretch", "range_line"]

SOURCE = ("Jain et al. SC'24 (PAL), artifact hal-uw/blox-pal 1a26bbfc31 "
          "aggregated_data/ls6/resnet-ls6-agg.csv: ResNet-50 iteration time of 219 A100 "
          "40GB GPUs on TACC Lonestar6 over their median (2 faulty nodes at 2.1-2.2x left "
          "out: 213 GPUs, 0.949 .. 1.092, sd 0.021)")

# (cumulative probability, slowdown over the median GPU): the quantiles of the 213 GPUs'
# norm_perf (SOURCE; linear interpolation between order statistics, numpy's default)
QUANTILES = ((0.0, 0.9490), (0.01, 0.9585), (0.05, 0.9707), (0.10, 0.9771),
             (0.25, 0.9874), (0.50, 0.9993), (0.75, 1.0140), (0.90, 1.0291),
             (0.95, 1.0375), (0.97, 1.0443), (0.98, 1.0462), (0.99, 1.0547),
             (0.995, 1.0790), (1.0, 1.0915))
SAMPLE = 213            # GPUs behind QUANTILES

# profiles whose devices are the measured part's model (A100); the H100 profiles have no
# measured per-device distribution (module docstring)
PROFILES = ("a100", "a100-jeanzay")

_STEPS = 4000           # midpoint rule on u: error < 1e-4 on the slowdown at n <= 10^4


def _q(u: float) -> float:
    for (p0, x0), (p1, x1) in zip(QUANTILES, QUANTILES[1:]):
        if u <= p1:
            return x0 + (x1 - x0) * (u - p0) / (p1 - p0)
    return QUANTILES[-1][1]


def slowest_expected(n: int) -> float:
    """Expected slowdown of the slowest of ``n`` devices over the median device: the
    expected maximum of ``n`` draws of the measured per-device slowdown (module
    docstring).  n = 1 gives the distribution's mean (about 1.0016)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"slowest_expected(n={n!r}): n is the number of devices that "
                         f"synchronise every step, an int >= 1")
    # integral of Q(u) d(u^n): the weight u^n concentrates near u = 1 as n grows, so
    # integrate in v = u^n (u = v^(1/n)), where the weights are uniform
    total = 0.0
    for i in range(_STEPS):
        v = (i + 0.5) / _STEPS
        total += _q(v ** (1.0 / n))
    return total / _STEPS


def stretch(est, n: int):
    """``est`` (an ``Estimate``) with its device work paced by the slowest of ``n``
    devices: ``slowest_expected(n) - 1`` more seconds of compute (the optimizer step
    included) and of the bubble's compute share (the slowest stage's compute over its
    time), communication unchanged; step time, throughputs and MFU follow, and the
    assumption is appended to ``details["assumptions"]``."""
    f = slowest_expected(n)
    b, d = est.breakdown, est.details
    slow = d["per_rank"][d["slowest_stage"]]
    share = slow["compute"] / slow["time"] if slow["time"] > 0 else 1.0
    extra_compute = (f - 1.0) * b["compute"]
    extra_bubble = (f - 1.0) * b["bubble"] * share
    step = est.step_time + extra_compute + extra_bubble
    k = est.step_time / step                  # rates scale with 1 / step
    details = dict(d, straggler=dict(devices=n, factor=f, extra_compute=extra_compute,
                                     extra_bubble=extra_bubble, source=SOURCE),
                   tokens_per_second=d["tokens_per_second"] * k,
                   mfu_causal=d["mfu_causal"] * k,
                   assumptions=tuple(d["assumptions"]) + (range_line(n, f),))
    return replace(est, step_time=step, tflops_per_device=est.tflops_per_device * k,
                   mfu=est.mfu * k, hfu=est.hfu * k,
                   breakdown=dict(b, compute=b["compute"] + extra_compute,
                                  bubble=b["bubble"] + extra_bubble),
                   details=details)


def range_line(n: int, f: "float | None" = None) -> str:
    """The slow end's line: what is varied, by how much, and its source."""
    f = slowest_expected(n) if f is None else f
    return (f"slow end only: the slowest of the {n} synchronised devices paces their work, "
            f"x{f:.3f} on compute and the bubble's compute share (ASSUMPTION: expected "
            f"maximum of the per-device slowdown measured on another A100 part, "
            f"{SOURCE}; beyond {SAMPLE} devices the slowest measured GPU is the bound; "
            f"not in the point estimate, plan/variability.py)")
