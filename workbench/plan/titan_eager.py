"""torchtitan's Llama block in eager mode: the kernels its source runs where the planner's
Llama block (``plan.llama_layer``, the course's fused operators) prices one.

``estimate(..., torchtitan_eager="rmsnorm" | "fused_rmsnorm")`` prices a Llama block as
torchtitan runs it without ``torch.compile`` (``training.compile = false``), its model
code at 9dec370ad2 (pytorch/torchtitan, ``torchtitan/models/llama/model.py`` and
``torchtitan/models/norms.py``; the April 2024 code the same for these functions):

- ``RMSNorm`` (``norm_type = "rmsnorm"``): ``output = self._norm(x.float()).type_as(x);
  return output * self.weight`` with ``_norm(x) = x * torch.rsqrt(x.pow(2).mean(-1,
  keepdim=True) + self.eps)``: a cast to fp32, a square, a mean, an add and a rsqrt of
  the row statistics, a product, a cast back and the weight's product, each its own
  kernel over the fp32 (or bf16) activation, and autograd's backward of each (the
  casts, the products' two gradients, the weight gradient's reduction, ``pow``'s and
  ``mean``'s backward), where the fused block prices one read of x and one write of y
  forward and one pass backward.  ``"fused_rmsnorm"`` (torchtitan's Triton kernel, one
  pass each way): its kernels (:func:`triton_norm_kernels`: the forward, the backward's
  per-SM loop and the reduction of its (sm_count, h) fp32 weight-gradient rows, the cast
  to the weight's dtype) at the rates Liger-Kernel's kernel of the same design reached on
  the A100 (``plan.eager_rates``, ``profile.kernel_bandwidth["triton_rms_norm_forward"]``
  / ``"_backward"``); a profile without them prices it as the fused block prices it (one
  pass each way at the plain memory rate), as before 2026-11-29;
- ``apply_rotary_emb``: q and k cast to fp32 (``xq.float()``), viewed as complex,
  multiplied by ``freqs_cis`` (complex64) and cast back (``type_as``): three kernels each
  forward and backward, where the fused block prices one;
- ``repeat_kv``: with grouped-query attention (n_rep = heads / kv heads > 1), keys and
  values expanded and reshaped to the query heads, a copy of n_rep x their size
  (``expand(...).reshape(...)`` of a non-contiguous expand), summed back in the
  backward; not priced by the fused block;
- ``FeedForward``: ``self.w2(F.silu(self.w1(x)) * self.w3(x))``: silu and the product
  forward as the fused block prices them, but the product's backward is two kernels
  (``mul`` by each factor, the gradient read twice) where the fused block prices one;
- autograd's sums of input gradients: q, k and v are three ``nn.Linear`` on one input,
  w1 and w3 two on another, so the backward adds their input gradients (two and one
  ``add`` over (tokens, h)), where the fused block (Megatron's fused QKV and gate/up
  GEMMs) has one input-gradient GEMM each: not priced by it;
- not a kernel: the transposes around ``F.scaled_dot_product_attention`` (its flash
  kernel takes and returns (batch, sequence, heads, dim) in memory, the (b, heads, s, d)
  tensors being transposed views: ``output.transpose(1, 2).contiguous()`` copies
  nothing).

What each of these reads and writes is not estimated by hand: :func:`kernels` runs the
same eager code on small CPU tensors under a dispatch mode and records every aten kernel
(views excluded) and the bytes it reads (each input's storage, at most its size) and
writes, forward and backward (the autograd formulas, ``derivatives.yaml``, are the same
on every device), then scales them linearly with the sequence length at the
micro-batch's batch (two lengths measured: the bytes are a + c x length exactly; RoPE's
``freqs_cis`` is per position, broadcast over the batch).  Each kernel is priced as a memory-bound kernel on
the profile (``compute_time``, one launch), beside the fused ops it replaces priced the
same way; the difference is added to the block's forward and backward (recompute
included: with torchtitan's op-level SAC these kernels all re-run, none is on its save
list; with full recompute the whole forward does).  The final norm before the output
layer is left as priced (one norm of 2 n_layer + 1).

ASSUMPTION: the GPU runs each aten op as one kernel moving what its inputs and outputs
hold (no kernel fuses two ops in eager mode; a broadcast input is read once).

The rate each kernel moves its bytes at (``plan.eager_rates``): the norm's kernels (casts,
broadcast products, reductions) at the rate Hugging Face's eager RMSNorm reached on the
profile's card in Liger-Kernel's benchmarks, RoPE's and repeat_kv's (broadcasts over
transposed head views) at the rate its eager rotary embedding reached, forward and
backward apart, counted the same way (``profile.kernel_bandwidth["eager_rms_norm_forward"]``
etc.; on the A100 0.65 / 0.75 and 0.44 / 0.58 of the datasheet bandwidth where a plain
copy reaches 0.88); SwiGLU's and the gradient sums' kernels (contiguous operands of one
dtype: PyTorch's vectorized path) at the plain memory rate.  A profile without those
rates prices every kernel at the plain rate.  Before the rates (2026-11-29) every kernel
was priced at the plain rate: 1.3-2.0x faster than the A100 ran them.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..sim_mesh.cost import compute_time
from .eager_rates import PHASES as _PHASES, TRITON_KIND, kernel_name

__all__ = ["NORM_TYPES", "kernels", "scaled", "extra_seconds", "check", "assumption",
           "triton_norm_kernels"]

NORM_TYPES = ("rmsnorm", "fused_rmsnorm")
PARTS = ("norm", "pre_attention", "swiglu", "input_grads")


def _storage(t):
    return t.untyped_storage().data_ptr()


class _Kernels(TorchDispatchMode):
    """Every aten op that runs a kernel: (name, bytes read + written).  Not kernels:
    views, ops whose outputs alias their inputs without mutating them
    (``_unsafe_view``), allocations (``empty*``: nothing written)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        mutates = func._schema.is_mutable
        if func.is_view or "empty" in name or (not mutates and outs and all(
                any(_storage(o) == _storage(i) for i in ins) for o in outs)):
            return out
        if name == "copy_":             # writes its destination, reads the source only
            ins = ins[1:]
        read = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                   for t in ins)
        wrote = sum(t.numel() * t.element_size() for t in outs)
        if read + wrote:
            self.ops.append((name, read + wrote))
        return out


# torchtitan's eager functions (module docstring), the same aten ops, written out here
def _rms_norm(x, w, eps=1e-5):
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y.type_as(x) * w


def _rope(x, freqs):                      # x: (b, s, heads, d); freqs: (s, d / 2) complex
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    f = freqs.view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * f).flatten(3).type_as(x)


def _repeat_kv(x, n_rep):
    b, s, g, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(b, s, g, n_rep, d).reshape(b, s, g * n_rep, d)


def _pre_attention(q, k, v, freqs, n_rep):
    q, k = _rope(q, freqs), _rope(k, freqs)
    return (q.transpose(1, 2), _repeat_kv(k, n_rep).transpose(1, 2),
            _repeat_kv(v, n_rep).transpose(1, 2))


def _count(fn, inputs):
    """(forward kernels, backward kernels) of ``fn`` on ``inputs`` (leaf tensors)."""
    with _Kernels() as m:
        out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.ones_like(o) for o in outs]
    with _Kernels() as mb:
        torch.autograd.backward(outs, grads)
    return tuple(m.ops), tuple(mb.ops)


def _leaf(*shape, dtype=torch.bfloat16):
    # values do not matter (bytes are sizes); a private generator leaves torch's RNG alone
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")
    return x.to(dtype).requires_grad_(True)


@lru_cache(maxsize=None)
def _measure(part: str, rows: int, h: int, heads: int, kv_heads: int, d: int,
             batch: int = 1):
    # real CPU tensors with autograd on, whatever the caller's mode (no_grad, a default
    # device): the counts are of the eager code's own kernels
    with torch.inference_mode(False), torch.enable_grad():
        return _measure_part(part, rows, h, heads, kv_heads, d, batch)


def _fan_out(n1, n2, *w):
    # q, k, v (w[:3]) on one input, w1, w3 (w[3:]) on another: autograd sums the input
    # gradients of each group (GEMMs thin: theirs are priced by the fused block)
    return tuple(n1 @ x for x in w[:3]) + tuple(n2 @ x for x in w[3:])


def _measure_part(part, rows, h, heads, kv_heads, d, batch=1):
    if part != "pre_attention":            # (tokens, h): the batch is rows like others
        rows, batch = rows * batch, 1
    if part == "norm":
        return _count(_rms_norm, (_leaf(rows, h), _leaf(h)))
    if part == "swiglu":                   # h: the MLP's width on the rank
        return _count(lambda a, b: torch.nn.functional.silu(a) * b,
                      (_leaf(rows, h), _leaf(rows, h)))
    if part == "input_grads":
        f, b = _count(_fan_out, (_leaf(rows, h), _leaf(rows, h),
                                 *(_leaf(h, 1) for _ in range(5))))
        return (tuple(o for o in f if o[0] != "mm"), tuple(o for o in b if o[0] != "mm"))
    # complex64 as torchtitan's freqs_cis, whatever torch's default dtype (float64 would
    # give complex128 and promote RoPE's products)
    f32 = dict(dtype=torch.float32, device="cpu")
    freqs = torch.polar(torch.ones(rows, d // 2, **f32),
                        torch.linspace(0, 1, rows * (d // 2), **f32).view(rows, d // 2))
    return _count(lambda q, k, v: _pre_attention(q, k, v, freqs, heads // kv_heads),
                  (_leaf(batch, rows, heads, d), _leaf(batch, rows, kv_heads, d),
                   _leaf(batch, rows, kv_heads, d)))


@lru_cache(maxsize=None)
def kernels(part: str, tokens: int, h: int, heads: int, kv_heads: int, d: int,
            batch: int = 1) -> dict:
    """The eager kernels of ``part`` ("norm": ``RMSNorm`` over (tokens, h); "pre_attention":
    RoPE on q and k, ``repeat_kv`` on k and v, the transposes; "swiglu": silu and the
    product over (tokens, h), h the MLP's width; "input_grads": the backward's sums of
    q, k, v's and w1, w3's input gradients over (tokens, h), GEMMs left out), for
    ``tokens`` tokens of
    ``heads`` query and ``kv_heads`` key/value heads of dimension ``d`` on one rank:
    ``{"forward":
    ((name, bytes), ...), "backward": ...}``, measured at 8 and 16 tokens per sequence of
    ``batch`` sequences (``tokens`` of them in all: RoPE's ``freqs_cis``, one row per
    position, is read once per position, broadcast over the batch) and scaled linearly
    (module docstring)."""
    if part not in PARTS:
        raise ValueError(f"kernels: part={part!r}; use one of {list(PARTS)}")
    for name, v in (("tokens", tokens), ("h", h), ("heads", heads), ("kv_heads", kv_heads),
                    ("d", d), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"kernels: {name}={v!r} must be an int >= 1")
    if tokens % batch:
        raise ValueError(f"kernels: tokens={tokens} must be batch={batch} sequences of "
                         f"equal length; give a multiple of batch")
    if heads % kv_heads or d % 2:
        raise ValueError(f"kernels: heads={heads} must be a multiple of kv_heads={kv_heads} "
                         f"and d={d} even (RoPE pairs)")
    s = tokens // batch
    a, b = (_measure(part, r, h, heads, kv_heads, d, batch) for r in (8, 16))
    return scaled(a, b, s, f"kernels: {part}")


def scaled(a, b, n, who: str) -> dict:
    """Per phase, each kernel's bytes at size ``n``, linear through its counts at sizes 8
    (``a``) and 16 (``b``) (forward and backward lists of (name, bytes)); the two runs must
    have launched the same kernels."""
    out = {}
    for i, phase in enumerate(("forward", "backward")):
        if [k for k, _ in a[i]] != [k for k, _ in b[i]]:
            raise RuntimeError(f"{who} {phase} ran other kernels at 8 and 16; cannot scale")
        out[phase] = tuple((k, x + (y - x) * (n - 8) / 8)
                           for (k, x), (_, y) in zip(a[i], b[i]))
    return out


def triton_norm_kernels(tokens: int, h: int, sms: int, e: int = 2) -> dict:
    """The kernels torchtitan's Triton ``FusedRMSNorm`` runs over ``tokens`` rows of ``h``
    (pytorch/torchtitan@eb6aa6389 ``torchtitan/models/norms.py``, the same at 1ea476e9f),
    ``e`` bytes per element of the input and of the weight (bf16 under FSDP2's
    ``param_dtype``), on a GPU of ``sms`` SMs: ``{"forward": ((name, bytes read + written),
    ...), "backward": ...}``.  Forward, ``_rms_norm_fwd_kernel`` (:120, one program per
    row): x and the weight read, y (``empty_like(x)``, :229) and the row's fp32 rstd
    (:230) written.  Backward, ``_rms_norm_bwd_kernel_sm`` (:168, ``sms`` programs, :284):
    x, dy, the weight and rstd read, dx (``empty_like(x)``, :271) written and its
    program's fp32 weight-gradient row of the (sms, h) buffer (:275); then ``_dw.sum(0)``
    (fp32) and ``.to(weight.dtype)`` (:301)."""
    for name, v in (("tokens", tokens), ("h", h), ("sms", sms), ("e", e)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"triton_norm_kernels: {name}={v!r} must be an int >= 1")
    x, w, r = e * tokens * h, e * h, 4 * tokens
    return {"forward": (("_rms_norm_fwd_kernel", 2 * x + w + r),),
            "backward": (("_rms_norm_bwd_kernel_sm", 3 * x + w + r + 4 * sms * h),
                         ("sum", 4 * sms * h + 4 * h),
                         ("_to_copy", 4 * h + e * h))}


def _triton_rates(prof) -> bool:
    """Whether ``prof`` carries the measured rates of torchtitan's Triton RMSNorm."""
    return all(kernel_name(TRITON_KIND, ph) in prof.kernel_bandwidth for ph in _PHASES)


def _seconds(ops, prof, kind=None, phase="forward") -> float:
    """Seconds of eager kernels ``ops`` on ``prof``: each one launch moving its bytes at
    the rate the profile measured for ``kind``'s eager kernels (``eager_rates``:
    "rms_norm", "rope"; a profile without it, or ``kind=None``, at its plain memory
    rate)."""
    kernel = None if kind is None else kernel_name(kind, phase)
    return sum(compute_time(0.0, nbytes, prof, "float32", "elementwise", 1, kernel=kernel)
               for _, nbytes in ops)


def _fused(names, fwd_ops, bwd_ops, prof) -> tuple[float, float]:
    """Seconds of the fused block's ops named ``names`` (forward, backward) as
    ``layer_cost`` prices them."""
    f = sum(compute_time(o[2], o[3], prof, "bfloat16", o[1], o[4])
            for o in fwd_ops if o[0] in names)
    b = sum(compute_time(o[2], o[3], prof, "bfloat16", o[1], o[4])
            for o in bwd_ops if o[0] in names)
    return f, b


def check(cfg, norm_type, lay=None) -> None:
    """``torchtitan_eager`` is a norm type of torchtitan's config and needs a Llama; a
    block whose eager code saves more for backward than the fused one (RMSNorm's fp32
    input; SDPA's inputs after ``repeat_kv``, n_rep x the keys and values) is refused
    where that memory is kept, without checkpointing (``recompute`` "none" or
    "selective"): the memory model counts the fused block's."""
    if norm_type is None:
        return
    if norm_type not in NORM_TYPES:
        raise ValueError(f"torchtitan_eager={norm_type!r}: give torchtitan's norm_type, one "
                         f"of {list(NORM_TYPES)}, or None (the fused Llama block)")
    if cfg.arch != "llama" or getattr(cfg, "moe_experts", 0):
        raise ValueError(f"torchtitan_eager={norm_type!r} prices torchtitan's dense Llama "
                         f"block; the model is arch={cfg.arch!r}"
                         f"{' with experts' if getattr(cfg, 'moe_experts', 0) else ''}: "
                         f"leave it None")
    kept = (["an fp32 copy of each norm input"] if norm_type == "rmsnorm" else []) + (
        ["the repeated keys and values"] if (cfg.n_kv_head or cfg.n_head) != cfg.n_head
        else [])
    if lay is not None and lay.recompute in ("none", "selective") and kept:
        raise ValueError(f"torchtitan_eager={norm_type!r} with recompute={lay.recompute!r}: "
                         f"its eager block keeps {' and '.join(kept)} for backward, which "
                         f"the memory model does not count; use recompute 'op' or 'full' "
                         f"(torchtitan's checkpointing re-runs them)")
    if cfg.dtype != "bfloat16":
        raise ValueError(f"torchtitan_eager={norm_type!r}: torchtitan trains in bf16 "
                         f"(MixedPrecisionPolicy param_dtype); the model's dtype is "
                         f"{cfg.dtype!r}: give the model dtype='bfloat16'")


def extra_seconds(cfg, lay, prof, norm_type: str) -> dict:
    """Seconds one block's eager kernels add beyond the fused block's ops they replace,
    for one micro-batch on one rank of ``lay``: ``{"forward", "backward" (with the
    recompute), "kernels" (forward kernels per block), "bytes" (forward, read +
    written)}``."""
    from . import llama_layer as L
    check(cfg, norm_type, lay)
    t, sp, b, s = lay.tp, lay.sp, lay.micro_batch, cfg.seq_len // lay.cp
    h, a, g, d = cfg.d_model, cfg.n_head, cfg.n_kv_head or cfg.n_head, cfg.head_dim
    T, Tn = b * s, (b * s) // t if sp else b * s
    e = 2
    fwd_ops = L.forward_ops(h, a, g, s, b, t, sp, cfg.d_ff, e, False)
    # torchtitan's DTensor TP keeps the gathered input: no backward re-gather
    # (llama_layer.backward_ops; only the replaced ops below are read from this list)
    bwd_ops = L.backward_ops(h, a, g, s, b, t, sp, cfg.d_ff, e, False, "none",
                             regather=False)
    # (the rate kind of ``eager_rates`` each part's kernels run at, its kernels): RoPE and
    # repeat_kv broadcast over transposed head views, the norm's casts, broadcasts and
    # reductions; SwiGLU's and the gradient sums' operands contiguous (the plain rate)
    parts = [("rope", kernels("pre_attention", T, h, a // t, g // t, d, b)),
             (None, kernels("swiglu", T, cfg.d_ff // t, a // t, g // t, d)),
             (None, kernels("input_grads", T, h, a // t, g // t, d))]
    replaced = {"rope_q", "rope_k", "rope_q_grad", "rope_k_grad",
                "silu", "swiglu_mul", "silu_grad", "swiglu_mul_grad"}
    norms = {"attn_norm", "mlp_norm", "attn_norm_grad", "mlp_norm_grad"}
    if norm_type == "rmsnorm":
        parts += [("rms_norm", kernels("norm", Tn, h, a // t, g // t, d))] * 2
        replaced |= norms
    elif _triton_rates(prof):
        sms = prof.topology.sm_count          # the backward's programs (one per SM)
        if not sms:
            raise ValueError(f"torchtitan_eager='fused_rmsnorm' on profile {prof.name!r}: "
                             f"it carries the Triton RMSNorm's rates but not "
                             f"topology.sm_count, the kernel's backward programs; give it")
        parts += [(TRITON_KIND, triton_norm_kernels(Tn, h, sms, e))] * 2
        replaced |= norms
    ef = sum(_seconds(p["forward"], prof, k, "forward") for k, p in parts)
    eb = sum(_seconds(p["backward"], prof, k, "backward") for k, p in parts)
    ff, fb = _fused(replaced, fwd_ops, bwd_ops, prof)
    again = {"none": 0.0, "selective": 0.0, "op": 1.0, "full": 1.0}[lay.recompute]
    fwd = ef - ff
    return {"forward": fwd, "backward": eb - fb + again * fwd,
            "kernels": sum(len(p["forward"]) for _, p in parts),
            "bytes": sum(x for _, p in parts for _, x in p["forward"]),
            "measured_rates": sorted({kernel_name(k, ph) for k, _ in parts if k
                                      for ph in ("forward", "backward")}
                                     & set(prof.kernel_bandwidth))}


def assumption(norm_type: str, extra: dict, layers: int) -> str:
    """The line ``Estimate.assumptions`` adds."""
    ms = 1e3 * (extra["forward"] + extra["backward"])
    norm = "RMSNorm's casts, square, mean, rsqrt and products, " \
        if norm_type == "rmsnorm" else ""
    got = extra.get("measured_rates", ())
    triton = [k for k in got if k.startswith(TRITON_KIND)]
    eager = [k for k in got if k not in triton]
    rates = ((f"{'the norm' if norm_type == 'rmsnorm' else ''}"
              f"{' and ' if norm_type == 'rmsnorm' else ''}RoPE / repeat_kv kernels at "
              f"the rates eager RMSNorm and RoPE reached in Liger-Kernel's benchmarks "
              f"(plan/eager_rates.py: {', '.join(eager)}), the others at the plain memory "
              f"rate") if eager else "every kernel at the profile's plain memory rate "
             "(no measured eager rates: plan/eager_rates.py)")
    if norm_type == "fused_rmsnorm":
        rates += ("; the Triton RMSNorm at the rates Liger-Kernel's kernel of its design "
                  f"reached on the A100 ({', '.join(triton)}; ASSUMPTION: the same rate "
                  "for torchtitan's)") if triton else \
            "; the Triton RMSNorm as the fused block's (no measured rate for it)"
    return (f"torchtitan's eager Llama block (plan/titan_eager.py, norm_type={norm_type}): "
            f"{extra['kernels']} forward kernels per block ({norm}RoPE in fp32 complex, "
            f"repeat_kv copies, silu and the product; backward: the product's two "
            f"gradients, autograd's sums of q, k, v's and w1, w3's input gradients) "
            f"counted from the eager code's aten ops, priced memory-bound "
            f"(one kernel per op ASSUMED), {rates}: +{ms:.1f} ms per block and "
            f"micro-batch (with backward and recompute) x {layers} blocks")
