"""Rates read from a device's component measurements (``benchmarks/gpu_components.py``).

A profile whose ``measured`` names a file in ``sim_mesh/measurements/`` (or a path) is
priced from what that device did, not from its datasheet times one efficiency:

- **GEMMs**: the file's grid of ``linear(x, W)`` products, x (M, K), W (N, K), M in
  512..16,384 and N, K in 256..49,152 tokens / features, each timed back to back on
  random bf16 data (its achieved TFLOP/s, which holds the tile and wave quantization,
  the memory traffic of skinny products, and the clock the card sustained under its
  power limit).  A product's rate is the trilinear interpolation of the grid in log2
  of (M, N, K), with the output's side that lies in the grid's M range read as M
  (cuBLAS runs a product and its transpose alike: the file's dgrad and wgrad layouts
  of the same shapes agree within a few per cent); beyond the grid's edges the edge's
  rate holds (the plateau above; below, the roofline's memory term of
  ``compute_time`` bounds a product that small).
  Where the file timed the exact product (``model_gemms``: the layers of the published
  runs and of Llama 3, each in a Linear's three layouts: forward, input gradient,
  weight gradient), that measurement is used.
- **FP8 GEMMs**: the bf16 rate of the same shape times the median FP8 / bf16 ratio of
  the file's FP8 products (``torch._scaled_mm``, e4m3, per-tensor scales).
- **Attention**: the file's fused kernels (``backend``: "cudnn" = cuDNN's fused
  attention, as Transformer Engine runs it; "flash" = FlashAttention-2 as PyTorch
  ships it), forward and backward rates per (batch x heads, sequence), interpolated in
  log2 of both and held at the edges, for head dimension 128 (other head dimensions
  scaled by the file's ratio at 64 where it has one); FLOPs count the pairs attended
  (causal: half), backward 2.5x forward (FlashAttention-2's convention, Dao 2023).
- **The loss**: logits per second of the fp32 cross-entropy, forward and backward, with
  the cast of the 16-bit logits (``cross_entropy_rate``).

The grid is one card's, under one software stack (the file's ``environment``): a
different driver, library or power limit moves these figures by several per cent.
A profile of a sibling card that reuses the file says by how much it takes them to
move (``scales``): ``compute_scale`` multiplies the GEMM (16-bit and FP8) and attention
rates, ``memory_scale`` the loss's (a memory-bound kernel); both default to 1 (the
measured card itself).  The factors are the profile's assumptions, cited there.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from functools import lru_cache
from importlib import resources
from pathlib import Path

__all__ = ["load", "gemm_rate", "attention_rate", "cross_entropy_rate", "summary", "scales"]

_KEYS = ("environment", "gemm_grid")


def _path(name: str):
    if not isinstance(name, str) or not name:
        raise ValueError(f"measured={name!r} must name a file in sim_mesh/measurements/ "
                         f"or a path to benchmarks/gpu_components.py's JSON output")
    p = Path(name)
    if p.is_absolute() or p.exists():
        return p
    return resources.files(__package__).joinpath("measurements", name)


@lru_cache(maxsize=None)
def load(name: str) -> "_Tables":
    """The tables of measurement file ``name`` (cached)."""
    from .profiles import read_json
    path = _path(name)
    data = read_json(path, f"measured={name!r}", f"has no such file ({path}); run "
                     f"benchmarks/gpu_components.py --out FILE on the device")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise ValueError(f"measured={name!r} lacks {missing}: not an output of "
                         f"benchmarks/gpu_components.py")
    return _Tables(data)


def _interp(axes, values, point):
    """Multilinear interpolation of ``values`` (a dict: grid index tuple -> value) on
    ``axes`` (sorted log2 coordinates per dimension) at ``point``, clamped to the
    grid.  Missing corners take the mean of the present ones."""
    lo_hi = []
    for ax, x in zip(axes, point):
        x = min(max(x, ax[0]), ax[-1])
        j = min(max(bisect.bisect_right(ax, x) - 1, 0), len(ax) - 2) if len(ax) > 1 else 0
        if len(ax) == 1:
            lo_hi.append(((0, 1.0),))
            continue
        w = (x - ax[j]) / (ax[j + 1] - ax[j])
        lo_hi.append(((j, 1.0 - w), (j + 1, w)))
    total, weight, present = 0.0, 0.0, []
    corners = [((), 1.0)]
    for pairs in lo_hi:
        corners = [(c + (i,), cw * w) for c, cw in corners for i, w in pairs]
    for idx, w in corners:
        v = values.get(idx)
        if v is not None:
            present.append(v)
            total += w * v
            weight += w
    if not present:
        raise ValueError("measured: no grid point near this shape")
    if weight < 1.0 - 1e-9:                   # fill missing corners with the mean
        total += (1.0 - weight) * statistics.fmean(present)
    return total


class _Tables:
    def __init__(self, data):
        self.environment = dict(data["environment"])
        rows = data["gemm_grid"]
        ms = sorted({r[0] for r in rows})
        nk = sorted({r[1] for r in rows} | {r[2] for r in rows})
        self.gemm_axes = ([math.log2(v) for v in ms], [math.log2(v) for v in nk],
                          [math.log2(v) for v in nk])
        self.gemm_m_range = (ms[0], ms[-1])
        seen = {}
        for r in data.get("model_gemms", []):
            m, n, k = r["m"], r["n"], r["k"]
            # forward: (m x n) out, k reduced; dgrad: (m x k) out, n; wgrad: (n x k) out, m
            for out, red, lay in (((m, n), k, "fwd"), ((m, k), n, "dgrad"),
                                  ((n, k), m, "wgrad")):
                seen.setdefault((min(out), max(out), red), []).append(r[lay] * 1e12)
        self.exact = {key: statistics.fmean(v) for key, v in seen.items()}
        self.gemm = {(ms.index(m), nk.index(n), nk.index(k)): t * 1e12
                     for m, n, k, t in rows}
        plateau = [t for m, n, k, t in rows if 2.0 * m * n * k >= 1e13]
        # the products too large to time (flops over the script's cap) run at the plateau
        fill = statistics.median(plateau) * 1e12 if plateau else None
        if fill:
            for i in range(len(ms)):
                for j in range(len(nk)):
                    for k in range(len(nk)):
                        self.gemm.setdefault((i, j, k), fill)
        self.fp8_ratio = None
        ratios = [r["tflops"] * 1e12 / self.gemm_rate(r["m"], r["n"], r["k"])
                  for r in data.get("fp8", []) if "tflops" in r]
        if ratios:
            self.fp8_ratio = statistics.median(ratios)
        ce = [4096 * r["shape"][1] / r["seconds"] for r in data.get("memory_bound", [])
              if r["kernel"] == "cross_entropy_fwd_bwd_fp32" and r["shape"][1] >= 16384]
        self.cross_entropy = statistics.median(ce) if ce else None
        self.attention = {}
        for r in data.get("attention", []):
            if "error" in r or r.get("head_dim") != 128:
                continue
            key = (r["backend"], bool(r["causal"]))
            self.attention.setdefault(key, []).append(r)
        self.head_dim_ratio = {}
        for r in data.get("attention", []):
            if "error" in r or r.get("head_dim") == 128:
                continue
            ref = [x for x in self.attention.get((r["backend"], bool(r["causal"])), [])
                   if x["seq"] == r["seq"] and x["batch"] * x["heads"] == r["batch"] * r["heads"]]
            if ref:
                self.head_dim_ratio[(r["backend"], r["head_dim"])] = (
                    r["fwd_tflops"] / ref[0]["fwd_tflops"], r["bwd_tflops"] / ref[0]["bwd_tflops"])

    def gemm_rate(self, rows: int, cols: int, k: int) -> float:
        exact = self.exact.get((min(rows, cols), max(rows, cols), k))
        if exact is not None:
            return exact
        lo, hi = self.gemm_m_range
        if not lo <= rows <= hi and lo <= cols <= hi:
            rows, cols = cols, rows         # the side the grid's M axis covers
        pt = (math.log2(max(rows, 1)), math.log2(max(cols, 1)), math.log2(max(k, 1)))
        return _interp(self.gemm_axes, self.gemm, pt)

    def attention_rate(self, backend, bh, seq, head_dim, causal, backward) -> float:
        rows = self.attention.get((backend, bool(causal)))
        if not rows:
            have = sorted({b for b, _ in self.attention})
            raise ValueError(f"measured: no {'causal' if causal else 'full'} attention "
                             f"rows for backend={backend!r}; the file has {have}")
        seqs = sorted({r["seq"] for r in rows})
        bhs = sorted({r["batch"] * r["heads"] for r in rows})
        key = "bwd_tflops" if backward else "fwd_tflops"
        vals = {(seqs.index(r["seq"]), bhs.index(r["batch"] * r["heads"])): r[key] * 1e12
                for r in rows}
        axes = ([math.log2(v) for v in seqs], [math.log2(v) for v in bhs])
        rate = _interp(axes, vals, (math.log2(seq), math.log2(bh)))
        if head_dim != 128:
            near = min((d for b, d in self.head_dim_ratio if b == backend),
                       key=lambda d: abs(d - head_dim), default=None)
            if near is not None and head_dim < 128:
                rate *= self.head_dim_ratio[(backend, near)][1 if backward else 0]
        return rate


def gemm_rate(name: str, rows: int, cols: int, k: int, dtype: str = "bfloat16") -> float:
    """FLOP/s of a (rows x k) @ (k x cols) product on the measured device (module
    docstring); ``dtype`` "float8" scales by the file's FP8 / bf16 ratio."""
    t = load(name)
    r = t.gemm_rate(rows, cols, k)
    if dtype == "float8":
        if t.fp8_ratio is None:
            raise ValueError(f"measured={name!r} has no FP8 products")
        r *= t.fp8_ratio
    return r


def attention_rate(name: str, backend: str, bh: int, seq: int, head_dim: int,
                   causal: bool = True, backward: bool = False) -> float:
    """FLOP/s of a fused attention kernel (module docstring) on the measured device."""
    return load(name).attention_rate(backend, bh, seq, head_dim, causal, backward)


def cross_entropy_rate(name: str) -> "float | None":
    """Logits per second (tokens x vocabulary entries) of the loss, forward and backward:
    the 16-bit logits cast to fp32, ``F.cross_entropy`` and its gradient, as the file
    timed them on 4,096 tokens (the median over vocabularies of 16,384 entries and more);
    None where the file has none."""
    return load(name).cross_entropy


def summary(name: str) -> dict:
    """What a file measured, as plain data: the device and software, the sustained
    GEMM rate and clock, the GEMM grid's median, the FP8 / bf16 ratio."""
    data = json.loads(_path(name).read_text(encoding="utf-8"))
    t = load(name)
    sus = data.get("sustained", {}).get("per_second", [])
    return {"environment": t.environment,
            "sustained_tflops": statistics.median(r["tflops"] for r in sus) if sus else None,
            "sustained_clock": [r.get("clocks.sm") for r in sus][-1:] or None,
            "gemm_grid_points": len(data["gemm_grid"]),
            "gemm_plateau_tflops": statistics.median(
                r[3] for r in data["gemm_grid"] if 2.0 * r[0] * r[1] * r[2] >= 1e13),
            "fp8_over_bf16": t.fp8_ratio}


def scales(profile) -> tuple[float, float]:
    """(compute, memory) factors a profile applies to its measured file's rates:
    ``measured["compute_scale"]`` on GEMMs and attention, ``measured["memory_scale"]``
    on the loss (module docstring); (1.0, 1.0) where it gives none."""
    ms = profile.measured
    return float(ms.get("compute_scale", 1.0)), float(ms.get("memory_scale", 1.0))
