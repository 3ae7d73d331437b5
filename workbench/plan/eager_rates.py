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

**torchtitan's Triton RMSNorm** (``norm_type = "fused_rmsnorm"``, the April 2024 A100
configs of the 13B and Llama 3 8B rows: pytorch/torchtitan@eb6aa6389
``train_configs/llama_13b.toml``:21, @1ea476e9f ``train_configs/llama3_8b.toml``:21; the
kernels in ``torchtitan/models/norms.py``, the same file at both commits, added by
pytorch/torchtitan#181, whose only figure is end to end: "+15% MFU with FSDP2 7B").  Its
forward ``_rms_norm_fwd_kernel`` (``norms.py``:120) runs one program per row (``grid =
(M,)``, :238): load the row and the weight, the fp32 sum of squares, store the row's
rstd and the output; its backward ``_rms_norm_bwd_kernel_sm`` (:168) runs one program per
SM (``grid = (sm_count,)``, :284), each looping over ``ceil(M / sm_count)`` rows (:196,
:279): load x and dy, store dx, accumulate the weight gradient in fp32 registers and
store it as one row of an (sm_count, N) fp32 buffer (:275), which ``_dw.sum(0).to(weight.
dtype)`` (:301) reduces.  Its own rate was never published; Liger-Kernel's RMSNorm (the
provider "liger" of the same benchmark files) is the same design: at liger 0.5.2
(linkedin/Liger-Kernel@bdbfeadf99 ``src/liger_kernel/ops/rms_norm.py``) a forward of one
program per row (:42, launched :226) and a backward of ``sm_count`` programs looping over
``rows_per_program`` rows (:114, :157, :251-263) into an (sm_count, N) fp32 buffer summed
after (:258, :293); at liger 0.2.1 (the A100-SXM4-80GB rows; b5672a153b, :205) the same
forward, but a backward of one program per row writing a full (M, N) weight-gradient
buffer: not torchtitan's design, not used.  So (``TRITON_MEASURED``):

- forward: the A100-SXM4-80GB's "liger" rows (0.2.1) and the A100 80GB PCIe's (0.5.2),
  within 0.1% of each other at H = 16,384 (95.26 / 95.23 us: not bound by HBM, whose
  bandwidth differs by 5%): 1.41 TB/s of counted bytes, 0.69 of the SXM's 2,039 GB/s
  where the fused block prices 0.88 (1.27x longer);
- backward: the A100 80GB PCIe's rows (0.5.2, torchtitan's design): 1.14 TB/s, 0.56 of
  2,039 GB/s (1.58x longer), carried in bytes per second to the SXM card as the forward
  shows it may (ASSUMPTION for the backward).  Its rows at H <= 8,192 sit on one floor
  (0.123-0.125 ms while the bytes grow eightfold: read as the host's time per call of the
  Python backward, not a kernel rate): only H = 16,384, 1.5x above that floor, is read.

The rate is read at H = 16,384 over Liger's 2,048 rows (``TRITON_RATE_SIZE``): 33.5 M
elements a launch, as many as Llama 3 8B's norm at 8,192 tokens (8,192 x 4,096; the 13B
row's 8,192 x 5,120, 41.9 M).  ASSUMPTION: torchtitan's kernel moves its bytes at the
rate Liger's reached there; its rows are shorter (4,096 / 5,120 against 16,384) and
each backward program loops over 76 rows, not 19, and it autotunes ``num_warps``
(``@triton.autotune(..., key=["N"])``, :108-117) where Liger fixes them
(``calculate_settings``): how those differences move the rate is not measured.
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["MEASURED", "KINDS", "reference_ops", "achieved_rate", "profile_rate",
           "kernel_name", "TRITON_KIND", "TRITON_MEASURED", "TRITON_RATE_SIZE",
           "triton_reference_ops", "triton_achieved_rate"]

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
# torchtitan's Triton RMSNorm (module docstring): its rate has its own kernel names
TRITON_KIND = "triton_rms_norm"
# medians (y_value_50, ms) of the "liger" provider's rms_norm speed rows, M = 2,048 rows of
# H, bf16 (benchmark_rms_norm.py: ``LigerRMSNorm(hidden_size=H)``, an fp32 weight, the
# default ``in_place=True``: dx written over dy; x.grad reset each rep, the weight's
# gradient accumulated).  Forward from both A100s; backward only where the kernel is
# torchtitan's design and above the host floor (module docstring)
TRITON_MEASURED = {
    "A100-SXM4-80GB": {
        "source": f"{_LIGER}@2120862ba5:benchmark/data/all_benchmark_data.csv, rows "
                  f"'rms_norm,liger' of 2024-09-03 (liger 0.2.1, kernel at b5672a153b "
                  f"src/liger_kernel/ops/rms_norm.py)",
        "forward": {8192: 0.0517439991235733, 16384: 0.0952640026807785,
                    32768: 0.18223999440670013},
    },
    "A100 80GB PCIe": {
        "source": f"{_LIGER}@bdbfeadf99:benchmark/data/a100_all_benchmark_data.csv, rows "
                  f"'rms_norm,liger' of 2025-01-25 (liger 0.5.2, kernel at bdbfeadf99 "
                  f"src/liger_kernel/ops/rms_norm.py)",
        "forward": {8192: 0.04915200173854828, 16384: 0.09523200243711472,
                    32768: 0.17715199291706085},
        # H = 1,024 .. 8,192: 0.1249, 0.1249, 0.1239, 0.1229 ms (the host floor)
        "backward": {16384: 0.18943999707698822},
        "host_floor": {1024: 0.12492799758911133, 2048: 0.12492799758911133,
                       4096: 0.12390399724245071, 8192: 0.1228799968957901},
    },
}
TRITON_RATE_SIZE = 16384
_A100_SMS = 108             # the A100's SMs (sm_count, the (sm_count, H) gradient buffer)
# the size each profile's rate is read at: the largest measured (the rows' sizes)
RATE_SIZE = {"rms_norm": 32768, "rope": 16384}
_ROWS, _HIDDEN, _HQ, _HK = 2048, 8192, 32, 8       # the benchmarks' fixed dimensions


def kernel_name(kind: str, phase: str) -> str:
    """The profile's ``kernel_bandwidth`` key of ``kind``'s eager kernels in ``phase``
    (``TRITON_KIND``: torchtitan's Triton RMSNorm's)."""
    if kind not in KINDS + (TRITON_KIND,) or phase not in PHASES:
        raise ValueError(f"kernel_name: kind={kind!r}, phase={phase!r}; use one of "
                         f"{list(KINDS) + [TRITON_KIND]} and {list(PHASES)}")
    return f"{kind}_{phase}" if kind == TRITON_KIND else f"eager_{kind}_{phase}"


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


def triton_reference_ops(phase: str, h: int, rows: int = _ROWS, sms: int = _A100_SMS):
    """The kernels Liger's "liger" RMSNorm benchmark runs per call (liger 0.5.2, the module
    docstring's lines), ((name, bytes read + written), ...), over ``rows`` rows of ``h``
    bf16 elements with its fp32 weight: forward, the kernel (x and the weight read, y and
    the row's fp32 rstd written); backward, the kernel (x, dy, the weight, rstd read; dx
    written over dy; its (sms, h) fp32 weight-gradient rows), their ``sum(dim=0)``, and
    autograd's accumulation into the weight's fp32 ``.grad`` (``.to(W.dtype)`` of an fp32
    sum copies nothing; x's gradient is taken, not added: ``grad_to_none=[x]``)."""
    if phase not in PHASES:
        raise ValueError(f"triton_reference_ops: phase={phase!r}; use one of {list(PHASES)}")
    for name, v in (("h", h), ("rows", rows), ("sms", sms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"triton_reference_ops: {name}={v!r} must be an int >= 1")
    x, w, r = 2 * rows * h, 4 * h, 4 * rows
    if phase == "forward":
        return (("_rms_norm_forward_kernel", 2 * x + w + r),)
    return (("_rms_norm_backward_kernel", 3 * x + w + r + 4 * sms * h),
            ("sum", 4 * sms * h + 4 * h),
            ("add_", 3 * 4 * h))


def triton_achieved_rate(card: str, phase: str, size: int = TRITON_RATE_SIZE) -> float:
    """Bytes per second Liger's Triton RMSNorm moved on ``card`` (a key of
    ``TRITON_MEASURED``) in ``phase`` at H = ``size``: counted bytes / measured seconds."""
    if card not in TRITON_MEASURED:
        raise ValueError(f"triton_achieved_rate: card={card!r}; use one of "
                         f"{list(TRITON_MEASURED)}")
    if phase not in PHASES:
        raise ValueError(f"triton_achieved_rate: phase={phase!r}; use one of {list(PHASES)}")
    got = TRITON_MEASURED[card].get(phase, {})
    if size not in got:
        raise ValueError(f"triton_achieved_rate: no {phase} of H={size!r} on {card!r} "
                         f"(measured: {sorted(got)}; the backward only where the kernel "
                         f"is torchtitan's design and above the host floor)")
    return sum(b for _, b in triton_reference_ops(phase, size)) / (got[size] * 1e-3)
