"""How fast PyTorch's eager (unfused) elementwise kernels move their bytes on a GPU, from
published kernel benchmarks: the rates ``plan.titan_eager`` prices torchtitan's eager
RMSNorm and RoPE kernels at.

``titan_eager`` counts every aten kernel of torchtitan's eager block and the bytes it
reads and writes; it priced each at the profile's plain memory rate (bandwidth x
``memory_efficiency``, the share a streaming copy reaches: 0.88 on the A100, 0.901 on
the H100).  Eager kernels of that kind do not reach it.  Liger-Kernel's benchmarks time
Hugging Face's Llama RMSNorm and rotary embedding in plain PyTorch (provider
"huggingface": the same aten ops as torchtitan's ``RMSNorm``, a cast to fp32, ``pow``,
``mean``, ``add``, ``rsqrt``, the broadcast products and the cast back; and
``apply_rotary_pos_emb``, ``q * cos + rotate_half(q) * sin`` over transposed head views),
forward and backward apart, with ``triton.testing.do_bench`` (the median of the reps, the
L2 cache flushed between them), on an A100-SXM4-80GB (2024-09-03), an A100 80GB PCIe and
an H100 NVL (2025-01-25).  :func:`reference_ops` counts those benchmarks' own kernels the
way ``titan_eager`` counts torchtitan's (its ``_Kernels`` dispatch mode on CPU tensors at
8 and 16 rows, scaled linearly), so bytes / the measured seconds is the rate the counted
bytes moved at (:func:`achieved_rate`).  At the largest sizes (67 M elements per norm, as
an 8B block's norm at 16,384 tokens; 134 M for q's RoPE) the A100-SXM4-80GB moved the
norm's bytes at 0.65 (forward) / 0.75 (backward) of its 2,039 GB/s and the RoPE's at
0.44 / 0.58, where the profile prices 0.88: 1.3 / 1.2 and 2.0 / 1.5 times longer than
priced.  Sources and figures: ``MEASURED``.

Why, and what carries to another card: PyTorch's elementwise launcher
(pytorch/pytorch@002a5676 aten/src/ATen/native/cuda/CUDALoops.cuh, ``gpu_kernel_impl`` /
``gpu_kernel_impl_nocast``) takes ``launch_vectorized_kernel`` only when the iterator
``is_contiguous()`` and needs no dynamic cast; a broadcast operand (``x * rsqrt(mean)``,
``w * x``, ``q * cos``) or a transposed view runs ``launch_legacy_kernel`` with an offset
calculator (each element's offsets computed per dimension), mixed dtypes the unrolled
cast path, and the reductions (``mean``, the weight gradient's ``sum``) are their own
kernels.  Such kernels are bound by the SMs rather than by HBM: the A100 80GB PCIe
(1,935 GB/s) ran them within 1-4% of the SXM's time (2,039 GB/s; the same 108 SMs), and
the H100 NVL (3,900 GB/s, 1.91x the SXM A100's; 132 SMs) only 1.46-1.66x faster than the
A100-SXM4: about its SMs' advantage (132 / 108 = 1.22, times a higher clock), not its
bandwidth's (``tests/test_titan12.py``).  So:

- the a100 profile takes the A100-SXM4-80GB's rates (the profile's card);
- the h100 profiles take the H100 NVL's rates in bytes per second (the same GH100 with
  132 SMs; ASSUMPTION: the issue-bound rate carries, the SXM's higher boost clock not
  priced), capped at the profile's plain memory rate (an eager kernel is no faster than
  a copy): on the 2.4 TB/s HBM2e part the norm's backward is then memory-bound as
  before, its forward and the RoPE's kernels slower than priced.  If the HBM2e part
  reached only the NVL's share of its datasheet bandwidth (the ratio the sibling
  profile uses for memory-bound kernels), they would be slower still: not priced.

Kernels on contiguous operands of one dtype (SwiGLU's silu and product, the backward's
sums of input gradients) take the vectorized path and stay at the plain memory rate
(the H100 file measured ``add`` and ``gelu`` at [4096, h] at 0.91-0.99 of its copy);
``repeat_kv``'s copy of an expanded view and its backward's sum are priced at the RoPE's
rate (ASSUMPTION: the same class of broadcast, non-contiguous kernels; not measured).
torchtitan's RMSNorm multiplies by a bf16 weight where the benchmark's is fp32 (an fp32
product; counted as it ran); its RoPE multiplies complex64 views where the benchmark's
rotates halves (ASSUMPTION: the same rate per counted byte).
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["MEASURED", "KINDS", "reference_ops", "achieved_rate", "profile_rate",
           "kernel_name"]

_LIGER = "linkedin/Liger-Kernel"
# medians (y_value_50, ms) of the "huggingface" provider's speed rows: rms_norm at M = 2048
# rows of H (bf16, eps 1e-6; benchmark/scripts/benchmark_rms_norm.py: the weight an fp32
# nn.Parameter, dy bf16, x.grad reset each rep, y.backward(dy, retain_graph=True)); rope
# over T positions at hidden 8192, 32 query and 8 key/value heads (head dim 256, bf16;
# benchmark_rope.py: q, k (1, T, heads, d) transposed to (1, heads, T, d), cos and sin from
# LlamaRotaryEmbedding, backward torch.autograd.grad of both outputs)
MEASURED = {
    "A100-SXM4-80GB": {
        "source": f"{_LIGER}@2120862ba5:benchmark/data/all_benchmark_data.csv, rows of "
                  f"2024-09-03 (liger 0.2.1; scripts at b5672a153b: benchmark/scripts/"
                  f"benchmark_rms_norm.py, benchmark_rope.py)",
        "rms_norm": {4096: (0.2799, 0.7404), 8192: (0.5190, 1.3516),
                     16384: (0.9856, 2.5696), 32768: (1.9191, 5.0147)},
        "rope": {2048: (0.5161, 0.6214), 4096: (0.9948, 1.1873),
                 8192: (1.9333, 2.3213), 16384: (3.8170, 4.5572)},
    },
    "A100 80GB PCIe": {
        "source": f"{_LIGER}@bdbfeadf99:benchmark/data/a100_all_benchmark_data.csv, "
                  f"rows of 2025-01-25 (liger 0.5.2, the same benchmark)",
        "rms_norm": {4096: (0.2826, 0.7526), 8192: (0.5233, 1.3763),
                     16384: (0.9923, 2.6245), 32768: (1.9333, 5.1190)},
        "rope": {2048: (0.5192, 0.6257), 4096: (1.0086, 1.2001),
                 8192: (1.9927, 2.3736), 16384: (3.9639, 4.6582)},
    },
    "H100 NVL": {
        "source": f"{_LIGER}@3534d4461c:benchmark/data/h100_all_benchmark_data.csv, "
                  f"rows of 2025-01-25 (liger 0.5.2, the same benchmark)",
        "rms_norm": {4096: (0.1795, 0.4433), 8192: (0.3261, 0.8100),
                     16384: (0.6095, 1.5802), 32768: (1.2193, 3.0291)},
        "rope": {2048: (0.3436, 0.4265), 4096: (0.6494, 0.8025),
                 8192: (1.3217, 1.5468), 16384: (2.5666, 3.1129)},
    },
}
KINDS = ("rms_norm", "rope")
PHASES = ("forward", "backward")
# the size each profile's rate is read at: the largest measured (the rows' sizes)
RATE_SIZE = {"rms_norm": 32768, "rope": 16384}
_ROWS, _HIDDEN, _HQ, _HK = 2048, 8192, 32, 8       # the benchmarks' fixed dimensions


def kernel_name(kind: str, phase: str) -> str:
    """The profile's ``kernel_bandwidth`` key of ``kind``'s eager kernels in ``phase``."""
    if kind not in KINDS or phase not in PHASES:
        raise ValueError(f"kernel_name: kind={kind!r}, phase={phase!r}; use one of "
                         f"{list(KINDS)} and {list(PHASES)}")
    return f"eager_{kind}_{phase}"


def _hf_rms_norm(x, w, eps=1e-6):
    # the benchmark's LlamaRMSNorm: fp32 statistics, the cast back, the fp32 weight's product
    dt = x.dtype
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(dt)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _count(kind, n, size):
    from .titan_eager import _Kernels
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.bfloat16, grad=False):
        x = torch.randn(*shape, generator=g).to(dtype)
        return x.requires_grad_(True) if grad else x
    with torch.inference_mode(False), torch.enable_grad():
        if kind == "rms_norm":                     # n rows of size H
            w = torch.nn.Parameter(torch.ones(size))
            w.grad = torch.zeros(size)             # accumulated across the reps
            ins, grads = (t(n, size, grad=True), w), [t(n, size)]
            fn = _hf_rms_norm
        else:                                      # n positions
            d = _HIDDEN // _HQ
            q = t(1, n, _HQ, d, grad=True).transpose(1, 2)
            k = t(1, n, _HK, d, grad=True).transpose(1, 2)
            ang = torch.randn(1, n, d, generator=g)
            ins = (q, k, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16))
            grads = [t(*q.shape), t(*k.shape)]
            fn = _hf_rope
        with _Kernels() as m:
            out = fn(*ins)
        outs = out if isinstance(out, tuple) else (out,)
        with _Kernels() as mb:
            torch.autograd.backward(outs, grads)
    return tuple(m.ops), tuple(mb.ops)


@lru_cache(maxsize=None)
def reference_ops(kind: str, size: int) -> dict:
    """The kernels of Liger's "huggingface" benchmark of ``kind`` at ``size`` (rms_norm:
    hidden size H over 2,048 rows; rope: T positions): ``{"forward": ((name, bytes), ...),
    "backward": ...}``, counted at 8 and 16 rows / positions and scaled linearly, as
    ``titan_eager.kernels``."""
    if kind not in KINDS:
        raise ValueError(f"reference_ops: kind={kind!r}; use one of {list(KINDS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"reference_ops: size={size!r} must be an int >= 16")
    big = _ROWS if kind == "rms_norm" else size
    from .titan_eager import scaled
    return scaled(_count(kind, 8, size), _count(kind, 16, size), big,
                  f"reference_ops: {kind}")


def achieved_rate(card: str, kind: str, phase: str, size: "int | None" = None) -> float:
    """Bytes per second the counted kernels of ``kind``'s ``phase`` moved on ``card`` (a key
    of ``MEASURED``) at ``size`` (default ``RATE_SIZE``): counted bytes / measured seconds."""
    if card not in MEASURED:
        raise ValueError(f"achieved_rate: card={card!r}; use one of {list(MEASURED)}")
    kernel_name(kind, phase)
    size = RATE_SIZE[kind] if size is None else size
    if size not in MEASURED[card][kind]:
        raise ValueError(f"achieved_rate: size={size!r} not measured for {kind!r} on "
                         f"{card!r}; use one of {sorted(MEASURED[card][kind])}")
    seconds = MEASURED[card][kind][size][PHASES.index(phase)] * 1e-3
    return sum(b for _, b in reference_ops(kind, size)[phase]) / seconds


def profile_rate(card: str, kind: str, phase: str, memory_rate: float) -> float:
    """The rate a profile carries for ``kind``'s eager kernels: ``card``'s achieved rate,
    no faster than the profile's plain memory rate ``memory_rate`` (module docstring)."""
    return min(achieved_rate(card, kind, phase), memory_rate)
