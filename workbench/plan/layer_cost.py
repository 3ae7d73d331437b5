"""One Megatron GPT layer, op by op, priced on a hardware profile.

The layer is Megatron-LM's ``ParallelTransformerLayer`` as Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") ran it: pre-norm
LayerNorm with bias, a column-parallel QKV GEMM whose bias is added by a separate
kernel, the unfused attention core (``baddbmm`` for Q K^T with the 1/sqrt(d) scale
folded in, Megatron's fused scale-mask-softmax kernel, ``torch`` dropout writing a
one-byte mask, ``bmm`` for P V, the context permuted back to [s, b, h/t]), a
row-parallel projection whose bias goes to the fused bias-dropout-add kernel, then
the MLP: column-parallel h -> ffn GEMM, fused bias-GeLU, row-parallel ffn -> h
GEMM, bias-dropout-add. Tensor parallelism (Megatron-LM, Shoeybi et al. 2019)
adds an all-reduce after each row-parallel GEMM in forward and one after each
column-parallel GEMM's input gradient in backward; sequence parallelism
(Korthikanti et al. sec. 4.2.2) replaces them by an all-gather before and a
reduce-scatter after, and runs LayerNorm and dropout on s/t tokens.

What overlaps (Megatron-LM 2022, ``LinearWithGradAccumulationAndAsyncCommunication``):
the backward all-reduce (or SP reduce-scatter) of a column-parallel layer's input
gradient runs beside its weight-gradient GEMM, and SP's re-gathering of that
layer's input runs beside its input-gradient GEMM.  ``async_allreduce=False``: the
layer as Megatron-LM ran it before ``--async-tensor-model-parallel-allreduce``
(NVIDIA/Megatron-LM 16c90445e7, merged 2021-09-02; not in 50a4b5fa02 nor de7dc40f88,
Narayanan et al.'s code) and as Megatron-DeepSpeed runs it (microsoft acc3e9b5 of
2021-11-12, bigscience 497aa1bf of 2022-03-11): ``ColumnParallelLinear`` passes its
input through ``copy_to_tensor_model_parallel_region``, whose backward all-reduces the
input gradient once autograd has run the linear's backward (both GEMMs), on the
critical path (``plan.megatron_2021``). While they overlap, the
collective's kernel holds some of the SMs (``cost.overlap`` with the tensor-parallel
group's ranks: NCCL's 24 of the A100's 108 for a group inside one node, 16 for one
spanning nodes, ``cost.collective_sms``), so the GEMM is stretched and the pair costs more than
max(GEMM, collective). Every other collective is on the critical path.  The rule is per
linear: the row-parallel linear's weight gradient runs before the collective is issued
and hides none of it, and the LayerNorm backward after it waits for it (as the
DistTensor recipe's clock, ``ops_table.pricing.wgrad_overlap``, and the multi-copy
layer, ``overlap_multicopy_kernels``, run it).  Left out: Megatron-LM's linear also sums
its bias gradient (``grad_output.sum(dim=0)``, QKV's: fc1's comes from the fused
bias-GeLU) after the weight-gradient GEMM and before ``handle.wait()``; it is priced here
before the GEMMs, on the critical path, so it hides nothing (at most its own time: 22 us
of Table 4's 19.4 ms layer, whose collectives are hidden anyway).

Recompute: "selective" re-runs the attention core (Q K^T, softmax, dropout, P V,
permute: Megatron's checkpointed ``CoreAttention``) before its backward; "full"
re-runs the whole layer forward, collectives included, before the backward.

Transformer Engine (``transformer_engine=True``; Megatron-LM's default
``--transformer-impl transformer_engine`` with its mcore GPT spec, as of 2024: the
H100 rows): TE's ``LayerNormLinear`` / ``Linear`` run the linears and its
``DotProductAttention`` (cuDNN's fused kernel on the H100) the core; Megatron keeps its own
fused bias-GeLU and bias-dropout-add.  What that changes, term by term, is ``TE_SOURCES``
(each with its source); what it leaves is listed there too.

Every op carries its FLOPs and bytes (by dtype), its op class and launches, and is
priced with ``cost.compute_time``; collectives with ``cost.price`` on the TP group.
FLOPs of GEMMs are exact (2 M N K); FLOPs of memory-bound kernels are approximate
per-element counts (they never bind: these kernels are priced by their bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from ..sim_mesh import cost as _cost
from ..sim_mesh.profiles import dtype_name, get_profile
from . import fp8 as _fp8
from . import llama_layer as _llama
from . import tp_overlap as _tpo

__all__ = ["OpCost", "LayerTimes", "layer_ops", "layer_times", "RECOMPUTE", "TE_SOURCES",
           "TE_ASSUMPTION"]

RECOMPUTE = ("none", "selective", "full", "op")   # "op": Llama only (llama_layer)
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

# What Megatron-LM's GPT layer runs with Transformer Engine, read at NVIDIA/Megatron-LM
# f2e5db402c (2024-07-15, the H100 README rows) and NVIDIA/TransformerEngine v1.8 (the
# NGC 24.07 container's; the run's TE release is not stated: ASSUMED); "MG" =
# megatron/core/..., "TE" = transformer_engine/... .
# term -> (what the layer prices, source)
TE_SOURCES = {
    "spec": ("Megatron's TE spec: linear_qkv and linear_fc1 are "
             "TELayerNormColumnParallelLinear, linear_proj / linear_fc2 "
             "TERowParallelLinear, the core TEDotProductAttention",
             "MG training/arguments.py:668 (--transformer-impl default "
             "'transformer_engine'); pretrain_gpt.py:52-76; MG models/gpt/"
             "gpt_layer_specs.py:46-70, 111-120"),
    "qkv_bias": ("no qkv_bias_add kernel: the bias is read by the QKV GEMM (e h / t * 3 "
                 "bytes more) and its gradient written by the weight-gradient GEMM (fp32 "
                 "main_grad's dtype), no qkv_bias_grad reduction",
                 "MG transformer/attention.py:379-390 (linear_qkv skip_bias_add=False, so "
                 "te_return_bias False: custom_layers/transformer_engine.py:219, 271); TE "
                 "pytorch/module/layernorm_linear.py:268-276 (tex.gemm bias=, use_bias=), "
                 ":636-647 (wgrad GEMM grad=True, use_bias=ctx.use_bias -> grad_bias), "
                 "cpp_extensions/gemm.py:213-216 (grad_bias in out's dtype), "
                 "common/gemm/cublaslt_gemm.cu:188-192 (CUBLASLT_EPILOGUE_BGRADB / BIAS); "
                 "FP8: base.py:705 fp8_cast_transpose_bgrad_fused (the bias gradient "
                 "inside the output gradient's cast); the epilogue's own time beyond its "
                 "bytes ASSUMED nil (no measurement)"),
    "qkv_layout": ("q, k, v copied to contiguous bshd (three copies, 2 e T 3h/t bytes) "
                   "before the fused kernel and its output returned as a transpose view; "
                   "dQ, dK, dV come back as three tensors and are still concatenated "
                   "(qkv_split_grad); the context copied to contiguous (forward: "
                   "linear_proj's input; backward: the output gradient) only where b > 1",
                   "MG custom_layers/transformer_engine.py:503-516, 552-555 (with "
                   "config.apply_rope_fusion, on by default: arguments.py:1131-1133, "
                   "--no-rope-fusion not given ASSUMED; whatever the position embedding); "
                   "TE pytorch/attention.py:2262-2364 (_get_qkv_layout: bshd_bshd_bshd), "
                   "csrc/extensions/attention.cu:887-985 (separate dQ, dK, dV), "
                   "attention.py:1919-2027 (_SplitAlongDim.backward: torch.cat unless "
                   "views of one buffer), :3719 (d_out.contiguous()), "
                   "module/base.py:564-607 (prepare_forward: inp.contiguous()); TE 1.8 "
                   "picks cuDNN's fused attention on sm90: attention.py:5158-5170"),
    "layernorm": ("unchanged: TE's layernorm_fwd writes ln_out (saved for the wgrad, "
                  "all-gathered with sp), layernorm_bwd reads it back: the same bytes as "
                  "apex's kernels, at the rate the profile measured for LayerNorm (TE's "
                  "own kernel not measured: ASSUMED alike)",
                  "TE pytorch/module/layernorm_linear.py:122-140, 673-682"),
    "bias_gelu": ("unchanged: fc1's bias is returned (skip_bias_add=True) and added with "
                  "the GeLU by Megatron's fused bias_gelu_impl; its gradient summed by "
                  "autograd (no TE epilogue, no GELU_AUX)",
                  "MG transformer/mlp.py:67-75, 98-106"),
    "bias_dropout_add": ("unchanged: proj's and fc2's biases returned (skip_bias_add=True) "
                         "to Megatron's fused bias-dropout-add",
                         "MG transformer/attention.py:106-114; mlp.py:82-90; "
                         "gpt_layer_specs.py:67-69 (get_bias_dropout_add)"),
}
TE_ASSUMPTION = ("Megatron-LM's layer with Transformer Engine (layer_cost.TE_SOURCES): QKV "
                 "bias in its GEMMs' epilogues, q, k, v copied to bshd for the fused "
                 "attention (--no-rope-fusion not given ASSUMED); TE v1.8 ASSUMED (release "
                 "not stated); TE's LayerNorm at the measured LayerNorm rate ASSUMED")


@dataclass(frozen=True)
class OpCost:
    """One kernel or collective of the layer, priced."""
    name: str
    phase: str          # "forward", "recompute" or "backward"
    op_class: str       # compute: an op class; collective: its kind ("all_reduce"...)
    flops: float
    bytes: float        # compute: bytes read + written; collective: the buffer (cost.py)
    launches: int
    seconds: float      # the op's own time
    exposed: float      # the part on the critical path
    algorithm: str = ""  # collectives: what the library runs
    overlaps: str = ""   # collectives: the GEMM it runs beside


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer's forward and backward (recompute included)."""
    forward: float
    backward: float
    combined: float
    ops: tuple          # one plain dict per OpCost, in execution order


def _check(h, a, s, b, tp, sp, recompute, ffn, tp_ranks):
    for name, v in (("h", h), ("a", a), ("s", s), ("b", b), ("tp", tp), ("ffn", ffn)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"layer_times: {name}={v!r} must be an int >= 1")
    if h % a:
        raise ValueError(f"layer_times: h={h} is not divisible by a={a} heads")
    for name, v in (("a", a), ("h", h), ("ffn", ffn)):
        if v % tp:
            raise ValueError(f"layer_times: {name}={v} is not divisible by tp={tp}; "
                             f"tensor parallelism splits it over the tp ranks")
    if sp and s * b % tp:
        raise ValueError(f"layer_times: sp=True splits s*b={s * b} tokens over tp={tp} "
                         f"ranks; it must divide")
    if recompute not in RECOMPUTE:
        raise ValueError(f"layer_times: recompute={recompute!r}: use one of {list(RECOMPUTE)}")
    if tp_ranks is not None and len(list(tp_ranks)) != tp:
        raise ValueError(f"layer_times: tp_ranks={tp_ranks!r} must list tp={tp} ranks")


@lru_cache(maxsize=1024)
def _flash(b, ah, s, d, e):
    """FlashAttention (causal, fused) on one rank, priced as the op table prices
    ``wb.ops.flash_attention``: (forward FLOPs, forward bytes, backward FLOPs, backward
    bytes), from ``wb.ops.cost`` (the pairs attended; Q, K, V, O and the fp32
    log-sum-exp kept, Dao 2023).  Cached: counting the pairs builds the s x s mask
    (28 ms at s = 2048), and a search asks the same shapes for many layouts."""
    import torch
    from ..ops import cost as _ops_cost
    dt = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[e]
    q = torch.empty(b, ah, s, d, dtype=dt, device="meta")
    c = _ops_cost("flash_attention", q, q, q, causal=True)
    io = 4 * b * ah * s * d * e                      # q, k, v read and dQ, dK, dV written
    return c.flops, c.bytes_fused, c.backward_flops, io + b * ah * s * d * e + \
        c.saved_bytes_fused


def _attention(b, ah, s, d, t, T, h, e, attention, te=False, permute=True):
    """The attention core's forward kernels (what selective recompute re-runs).  ``te``:
    Megatron-LM's ``TEDotProductAttention`` (``TE_SOURCES``): the three ``transpose(0, 1)
    .contiguous()`` copies of q, k, v into bshd before TE's fused (cuDNN) kernel, whose
    output goes back as a ``transpose`` view (no permute here: :func:`_forward`).
    ``permute=False``: the fused kernel's output needs no copy before the output
    projection (this library's GPT, ``split_qkv``: :func:`_forward`)."""
    if attention == "materialized":
        return _core(b, ah, s, d, t, T, h, e)
    ff, fb, _, _ = _flash(b, ah, s, d, e)
    # Megatron's GPT layer: attention dropout (0.1 by default) inside the fused kernel
    fa = ("flash_attention", "attention", ff, fb, 1,
          _cost.AttentionShape(b * ah, s, d, True, False, True))
    if te:   # q, k, v: each T x h / t read (strided) and written
        return [("qkv_transpose", "data_movement", 0, 2 * e * T * 3 * h // t, 3), fa]
    return [fa] + ([("context_permute", "data_movement", 0, 2 * e * T * h // t, 1)]
                   if permute else [])


def _forward(h, a, s, b, t, sp, f, e, attention="materialized", split_qkv=False, te=False,
             dropout=True):
    """Forward kernels and collectives, as (name, class, flops, bytes, launches[,
    kernel][, gemm]) with ``kernel`` naming a kernel whose bandwidth a profile measured
    and ``gemm`` a matmul's output (batch, rows, columns) for tile and wave
    quantization (``cost.gemm_efficiency``).  ``split_qkv``: the query, key and value
    projections as three GEMMs of h / t columns each, as this library's GPT runs them
    (``models.gpt.GPTAttention``: ``wq``, ``wk``, ``wv``), where Megatron-LM runs one
    fused [h, 3h / t] GEMM; the same FLOPs, but a narrower product runs at a lower rate
    where the profile measured GEMMs by shape (the H100: 3.1x the fused GEMM's time at
    h = 1024, s b = 1024).  ``te``: the layer as Megatron-LM runs it with Transformer
    Engine (``TE_SOURCES``): the QKV bias in its GEMM's epilogue, the attention core as
    :func:`_attention` says, the context copied to contiguous only where b > 1.
    ``dropout=False`` (p = 0): the residual branches' bias-dropout-add writes no mask,
    ATen's ``dropout`` returning its input at p = 0 (``Dropout.cpp``)."""
    T, Tn = s * b, (s * b // t if sp else s * b)   # tokens; tokens of norm/dropout ops
    ah, d, hq = a // t, h // a, 3 * h // t         # heads, head dim, QKV width per rank

    def gemm(n, M, K, N):      # [M, K] @ [K, N]: read both, write [M, N]
        return n, "matmul", 2 * M * K * N, e * (M * K + K * N + M * N), 1, (1, M, N)

    def ln(n):                 # Megatron's persistent LayerNorm (apex FastLayerNorm) for
        # the hidden sizes it supports: read x, write y, the bytes its measured rate
        # counts (profile kernel_bandwidth "layer_norm_forward"; without it the copy rate)
        return n, "norm", 8 * Tn * h, 2 * e * Tn * h, 1, "layer_norm_forward"

    def bda(n):                # read x, bias, residual; write y and a one-byte mask
        return n, "elementwise", 4 * Tn * h, 3 * e * Tn * h + e * h + Tn * h * dropout, 1

    comm_in = ("all_gather", T * h * e) if sp else None
    comm_out = ("reduce_scatter" if sp else "all_reduce", T * h * e)
    ops = [ln("layernorm_1")]
    if comm_in:
        ops.append(("sp_all_gather_1", *comm_in))
    if split_qkv:       # nn.Linear's bias in its GEMM's epilogue (addmm): no kernel of its own
        ops += [gemm(x + "_gemm", T, h, hq // 3) for x in "qkv"]
    elif te:            # cuBLASLt's BIAS epilogue: the GEMM reads the bias, no kernel
        n, c, fl, nb, la, sh = gemm("qkv_gemm", T, h, hq)
        ops.append((n, c, fl, nb + e * hq, la, sh))
    else:
        ops += [gemm("qkv_gemm", T, h, hq),
                ("qkv_bias_add", "elementwise", T * hq, e * (2 * T * hq + hq), 1)]
    # this library's GPT (split_qkv) calls wb.ops.flash_attention, on CUDA PyTorch's
    # scaled_dot_product_attention, whose flash kernel writes its output as [b, s, a, d]
    # and returns the [b, a, s, d] transpose of it: the model's transpose(1, 2).reshape
    # to [b, s, h] is then a view, no copy (as plan.llama_layer prices the Llama's)
    ops += _attention(b, ah, s, d, t, T, h, e, attention, te, permute=not split_qkv)
    if te and b > 1:    # linear_proj's prepare_forward: inp.contiguous() of the transposed
        # [s, b, h / t] context (a view, already contiguous where b = 1)
        ops.append(("context_permute", "data_movement", 0, 2 * e * T * h // t, 1))
    ops += [gemm("proj_gemm", T, h // t, h), ("tp_out_1", *comm_out), bda("bias_dropout_add_1"),
            ln("layernorm_2")]
    if comm_in:
        ops.append(("sp_all_gather_2", *comm_in))
    ops += [gemm("fc1_gemm", T, h, f // t),
            ("bias_gelu", "elementwise", 8 * T * f // t, e * (2 * T * f // t + f // t), 1),
            gemm("fc2_gemm", T, f // t, h), ("tp_out_2", *comm_out), bda("bias_dropout_add_2")]
    return ops


def _core(b, ah, s, d, t, T, h, e):
    """The attention core Megatron's selective recompute re-runs. Its batched GEMMs
    and softmax move their bytes at the rate measured for Megatron's unfused core
    (profile kernel_bandwidth "attention_core_forward"), torch's dropout at its own
    ("dropout_forward"): FlashAttention's benchmark of it on the A100 (profile)."""
    S = b * ah * s * s                             # attention score elements per rank
    core = "attention_core_forward"
    return [("qk_baddbmm", "matmul", 2 * S * d, e * (2 * b * ah * s * d + S), 1,
             core, (b * ah, s, s)),
            ("scale_mask_softmax", "norm", 5 * S, 2 * e * S, 1, core),
            ("attention_dropout", "elementwise", 2 * S, 2 * e * S + S, 1, "dropout_forward"),
            ("pv_bmm", "matmul", 2 * S * d, e * (S + 2 * b * ah * s * d), 1, core,
             (b * ah, s, d)),
            ("context_permute", "data_movement", 0, 2 * e * T * h // t, 1)]


def _backward(h, a, s, b, t, sp, f, e, recompute, attention="materialized",
              async_allreduce=True, main_grad=True, split_qkv=False, regather=True,
              te=False, dropout=True):
    """Backward kernels and collectives in execution order; a collective tuple's
    sixth field names the GEMM it overlaps ("" = on the critical path: the input
    gradient's all-reduce without ``async_allreduce``, module docstring).
    ``main_grad=False``: the weight gradient written in the 16-bit dtype (this library's
    recipe, autograd's ``param.grad``), not accumulated into Megatron-LM's fp32
    ``main_grad``.  ``split_qkv``: :func:`_forward`'s; autograd runs the three linears'
    backward last-created first (v, k, q), each its dgrad, its wgrad and its bias's sum,
    and the input gradient's collective waits for all three dgrads (beside q's wgrad).
    ``regather``: with ``sp``, the column-parallel inputs all-gathered again in backward
    (Megatron-LM; False: DTensor keeps the gathered input, no re-gather:
    ``llama_layer.backward_ops``).
    ``te``: :func:`_forward`'s; the QKV bias gradient out of the weight-gradient GEMM's
    epilogue (written in the weight gradient's dtype), the output gradient copied to
    contiguous only where b > 1, dQ, dK, dV still concatenated (``TE_SOURCES``)."""
    g = 8 if main_grad else e
    T, Tn = s * b, (s * b // t if sp else s * b)
    ah, d, hq = a // t, h // a, 3 * h // t
    S = b * ah * s * s

    def dgrad(n, M, K, N):     # dx[M, K] = dy[M, N] @ w[K, N]^T
        return n, "matmul", 2 * M * K * N, e * (M * N + K * N + M * K), 1, (1, M, K)

    def wgrad(n, M, K, N):     # dw[K, N] = x^T dy, accumulated into fp32 main_grad (read + write)
        return n, "matmul", 2 * M * K * N, e * (M * N + M * K) + g * K * N, 1, (1, K, N)

    def bda(n):                # dropout backward (grad, mask), then the bias gradient;
        # at p = 0 (``dropout=False``) the gradient passes through the identity: no kernel
        grad = [(n + "_grad", "elementwise", 2 * Tn * h, 2 * e * Tn * h + Tn * h, 1)]
        return grad * dropout + [(n + "_bias_grad", "reduction", Tn * h, e * Tn * h, 1)]

    def ln(n):
        # apex FastLayerNorm backward: one kernel reads x and dy once and writes dx and
        # partial dgamma/dbeta, a second finalizes them (apex PR #1037; the bytes its
        # measured rate counts); then the residual branch's gradient is added
        return [(n + "_grad", "norm", 10 * Tn * h, 3 * e * Tn * h, 2, "layer_norm_backward"),
                (n + "_residual_grad_add", "elementwise", Tn * h, 3 * e * Tn * h, 1)]

    ag = ("all_gather", T * h * e)
    out_grad = [("sp_grad_all_gather", *ag, "")] if sp else []   # backward of reduce-scatter

    # the fused QKV's gradient: dQ, dK, dV concatenated, then its bias's sum; split
    # (this library's GPT), each linear's bias gradient summed after its wgrad (autograd's
    # sum of AddmmBackward0's bias gradient to the bias's shape: ``column``)
    qkv_grads = [] if split_qkv else [
        ("qkv_split_grad", "data_movement", 0, 2 * e * T * hq, 1)]   # cat of dQ, dK, dV
    if not split_qkv and not te:     # TE: cuBLASLt's BGRADB epilogue of the wgrad GEMM
        qkv_grads.append(("qkv_bias_grad", "reduction", T * hq, e * T * hq, 1))

    def column(n, N, dgrad_name, wgrad_name):
        comm = [("sp_regather_" + n, *ag, dgrad_name)] if sp and regather else []
        comm += [("tp_grad_" + n, "reduce_scatter" if sp else "all_reduce", T * h * e,
                  wgrad_name if sp or async_allreduce else "")]
        if n == "qkv" and split_qkv:     # wq, wk, wv apart (docstring)
            comm = [c[:3] + ({"qkv_dgrad": "v_dgrad", "qkv_wgrad": "q_wgrad"}.get(c[3], c[3]),)
                    for c in comm]
            return comm, [g for x in "vkq" for g in (
                dgrad(x + "_dgrad", T, h, N // 3), wgrad(x + "_wgrad", T, h, N // 3),
                (x + "_bias_grad", "reduction", T * N // 3, e * T * N // 3, 1))]
        w = wgrad(wgrad_name, T, h, N)
        if n == "qkv" and te:            # + the bias gradient the epilogue writes
            w = w[:3] + (w[3] + (4 if main_grad else e) * N,) + w[4:]
        return comm, [dgrad(dgrad_name, T, h, N), w]

    ops = bda("bias_dropout_add_2") + out_grad
    ops += [dgrad("fc2_dgrad", T, f // t, h), wgrad("fc2_wgrad", T, f // t, h)]
    ops += [("bias_gelu_grad", "elementwise", 8 * T * f // t, 3 * e * T * f // t, 1),
            ("fc1_bias_grad", "reduction", T * f // t, e * T * f // t, 1)]
    comm, gemms = column("fc1", f // t, "fc1_dgrad", "fc1_wgrad")
    ops += gemms + comm + ln("layernorm_2") + bda("bias_dropout_add_1") + out_grad
    ops += [dgrad("proj_dgrad", T, h // t, h), wgrad("proj_wgrad", T, h // t, h)]
    if recompute == "selective":
        ops += [("recompute:" + o[0],) + o[1:]
                for o in _attention(b, ah, s, d, t, T, h, e, attention, te,
                                    permute=not split_qkv)]
    if attention == "flash":
        _, _, bf, bb = _flash(b, ah, s, d, e)
        ops += [] if (te and b == 1) or split_qkv else [      # split_qkv: _forward's
            ("context_permute_grad", "data_movement", 0, 2 * e * T * h // t, 1)]
        ops += [("flash_attention_grad", "attention", bf, bb, 1,
                 _cost.AttentionShape(b * ah, s, d, True, True, True))] + qkv_grads
        comm, gemms = column("qkv", hq, "qkv_dgrad", "qkv_wgrad")
        return ops + gemms + comm + ln("layernorm_1")
    core = "attention_core_backward"   # the measured rate of these kernels (_core)
    ops += [("context_permute_grad", "data_movement", 0, 2 * e * T * h // t, 1),
            ("pv_bmm_grad_probs", "matmul", 2 * S * d, e * (2 * b * ah * s * d + S), 1,
             core, (b * ah, s, s)),
            ("pv_bmm_grad_value", "matmul", 2 * S * d, e * (S + 2 * b * ah * s * d), 1,
             core, (b * ah, s, d)),
            ("attention_dropout_grad", "elementwise", S, 2 * e * S + S, 1, "dropout_backward"),
            ("scale_mask_softmax_grad", "norm", 4 * S, 3 * e * S, 1, core),
            ("qk_baddbmm_grad_query", "matmul", 2 * S * d, e * (S + 2 * b * ah * s * d), 1,
             core, (b * ah, s, d)),
            ("qk_baddbmm_grad_key", "matmul", 2 * S * d, e * (S + 2 * b * ah * s * d), 1,
             core, (b * ah, s, d))] + qkv_grads
    comm, gemms = column("qkv", hq, "qkv_dgrad", "qkv_wgrad")
    return ops + gemms + comm + ln("layernorm_1")


def layer_ops(h: int, a: int, s: int, b: int, tp: int, sp: bool = False,
              recompute: str = "none", ffn: "int | None" = None, dtype="bfloat16",
              profile="a100", tp_ranks=None, attention: str = "materialized",
              fp8: bool = False, kv_heads: "int | None" = None,
              dropout: "bool | None" = None,
              tp_comm_overlap: bool = False, async_allreduce: bool = True,
              main_grad: bool = True, early_stop: bool = False,
              split_qkv: bool = False, regather: bool = True,
              transformer_engine: bool = False) -> list:
    """Every op of one layer on one TP rank, priced: a list of ``OpCost``.
    ``attention="flash"``: the fused kernel instead of Megatron's unfused core;
    ``fp8``: the linears' GEMMs in FP8 with Transformer Engine's casts (``plan.fp8``).
    ``kv_heads``: a Llama block (``plan.llama_layer``) with that many key/value heads
    (fused attention only); None: Megatron's GPT layer.  ``dropout``: with dropout on
    the residual branches (None: the architecture's default, a Llama block without,
    Megatron's GPT layer with its 0.1; a GPT layer without has no dropout kernel on them,
    ATen's ``dropout`` returning its input at p = 0, and stops a recompute early).
    ``tp_comm_overlap``: the TP collectives overlapped as
    Megatron-LM's ``--tp-comm-overlap`` runs them (``plan.tp_overlap``; sp required).
    ``async_allreduce=False``: the backward all-reduce of a column-parallel layer's input
    gradient on the critical path, as Megatron-LM before 2021-09 and Megatron-DeepSpeed
    run it (module docstring; no effect with ``sp``, whose reduce-scatter Megatron-LM
    always issues beside the weight-gradient GEMM).  ``main_grad=False``: weight
    gradients written in 16 bits (this library's recipe) instead of accumulated into an
    fp32 ``main_grad`` (Megatron-LM's gradient-accumulation fusion, read and write).
    ``early_stop``: full recompute by PyTorch's non-reentrant checkpoint, which stops
    re-running a Llama block once w2's input is back (``llama_layer.full_recompute``; a
    GPT layer without dropout once fc2's input is back;
    Megatron-LM's own checkpoint re-runs the whole forward).  ``split_qkv``: a GPT
    layer's query, key and value projections as three GEMMs, as this library's GPT runs
    them (``_forward``; a Llama block's are apart already).  ``regather=False``: with
    ``sp``, no all-gather of the column-parallel inputs in backward, as PyTorch DTensor's
    sequence parallelism runs (torchtitan; ``llama_layer.backward_ops``).
    ``transformer_engine``: the GPT layer as Megatron-LM's Transformer Engine spec runs it
    (``TE_SOURCES``: fused attention, Megatron's own fused kernels around TE's linears)."""
    if not isinstance(transformer_engine, bool):
        raise ValueError(f"layer_times: transformer_engine={transformer_engine!r} must be "
                         f"True or False")
    if transformer_engine and (kv_heads is not None or attention != "flash" or split_qkv):
        raise ValueError(f"layer_times: transformer_engine=True prices Megatron-LM's GPT "
                         f"layer with Transformer Engine's fused attention (TE_SOURCES); "
                         f"got kv_heads={kv_heads!r}, attention={attention!r}, "
                         f"split_qkv={split_qkv!r}: give kv_heads=None, attention='flash', "
                         f"split_qkv=False, or transformer_engine=False")
    if not isinstance(async_allreduce, bool):
        raise ValueError(f"layer_times: async_allreduce={async_allreduce!r} must be True or "
                         f"False")
    if attention not in ("materialized", "flash"):
        raise ValueError(f"layer_times: attention={attention!r}; use 'materialized' "
                         f"(Megatron's unfused core) or 'flash'")
    ffn = 4 * h if ffn is None else ffn
    _check(h, a, s, b, tp, sp, recompute, ffn, tp_ranks)
    if kv_heads is not None:
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 \
                or a % kv_heads or kv_heads % tp:
            raise ValueError(f"layer_times: kv_heads={kv_heads!r} must be an int dividing "
                             f"a={a} and divisible by tp={tp} (each rank owns whole "
                             f"key/value heads)")
        if attention != "flash":
            raise ValueError("layer_times: a Llama block (kv_heads given) is priced with "
                             "the fused attention kernel it runs: give attention='flash'")
    dt = dtype_name(dtype)
    if dt not in _ITEMSIZE:
        raise ValueError(f"layer_times: dtype={dtype!r}: use a floating-point dtype "
                         f"{list(_ITEMSIZE)}")
    ranks = tuple(range(tp)) if tp_ranks is None else tuple(tp_ranks)
    prof = get_profile(profile)
    if tp_comm_overlap:
        _tpo.check(tp, sp, "layer_times")
        if fp8 or kv_heads is not None:
            raise ValueError("layer_times: tp_comm_overlap=True is modeled for Megatron's GPT "
                             "layer in 16 bits; give fp8=False and kv_heads=None, or "
                             "tp_comm_overlap=False")
    if fp8 and "float8" not in prof.peak_flops:
        raise ValueError(f"layer_times: fp8=True on profile {prof.name!r}, which has no FP8 "
                         f"peak (peak_flops['float8']); FP8 tensor cores are the H100's: "
                         f"use profile='h100' or fp8=False")
    return list(_priced(h, a, s, b, tp, bool(sp), recompute, ffn, dt, prof,
                        ranks, attention, bool(fp8), kv_heads,
                        kv_heads is None if dropout is None else bool(dropout),
                        bool(tp_comm_overlap), async_allreduce, bool(main_grad),
                        bool(early_stop), bool(split_qkv) and kv_heads is None,
                        bool(regather), transformer_engine))


@lru_cache(maxsize=4096)
def _priced(h, a, s, b, tp, sp, recompute, ffn, dt, prof, ranks, attention,
            fp8=False, kv_heads=None, dropout=False, tp_comm_overlap=False,
            async_allreduce=True, main_grad=True, early_stop=False,
            split_qkv=False, regather=True, te=False) -> tuple:
    e = _ITEMSIZE[dt]
    if recompute == "op" and kv_heads is None:
        raise ValueError("layer_times: recompute='op' (torchtitan's op-level selective "
                         "checkpointing) is modeled for Llama blocks (kv_heads given); use "
                         "'none', 'selective' or 'full'")
    if kv_heads is not None:
        fwd = _llama.forward_ops(h, a, kv_heads, s, b, tp, sp, ffn, e, dropout)
        bwd = _llama.backward_ops(h, a, kv_heads, s, b, tp, sp, ffn, e, dropout, recompute,
                                  async_allreduce, main_grad, regather)
    else:
        fwd = _forward(h, a, s, b, tp, sp, ffn, e, attention, split_qkv, te, dropout)
        bwd = _backward(h, a, s, b, tp, sp, ffn, e, recompute, attention, async_allreduce,
                        main_grad, split_qkv, regather, te, dropout)
    if fp8:
        fwd, bwd = _fp8.with_fp8_casts(fwd, e), _fp8.with_fp8_casts(bwd, e)
    phases = [("forward", fwd)]
    if recompute == "full" and early_stop and kv_heads is not None:
        phases.append(("recompute", _llama.full_recompute(fwd)))
    elif recompute == "full" and early_stop and not dropout:
        # this library's GPT block without dropout: the early stop comes once fc2's input
        # (the GeLU's output) is back, as a Llama block's at w2's; with dropout the
        # residual dropout's mask follows fc2, which re-runs (``zero_cost.recipe_blocks``).
        # Measured on the dry run's trace (GPT dp 2 cp 4, tests/test_zerocp5.py): the
        # recompute ends at the GeLU, no fc2 GEMM re-run; the whole forward priced before,
        # dry run / estimate 0.986 (dp 2, ZeRO-0), 0.938 (dp 2 cp 4 ZeRO-3)
        end = next(i for i, op in enumerate(fwd) if op[0] == "bias_gelu")
        phases.append(("recompute", list(fwd[:end + 1])))
    elif recompute == "full":
        phases.append(("recompute", fwd))
    elif recompute == "op":
        phases.append(("recompute", _llama.op_sac_recompute(fwd)))
    phases.append(("backward", bwd))
    out, gemms = [], {}      # gemms: (phase, name) -> output shape, for tp_overlap
    for phase, ops in phases:
        where, shapes = {}, {}   # name -> index in out, this phase; -> GEMM output
        for op in ops:
            if op[1] in _cost.KINDS:
                if len(ranks) == 1:    # Megatron issues no collective when tp == 1
                    continue
                name, kind, nbytes = op[:3]
                beside = op[3] if len(op) > 3 else ""
                pick = _cost.choose(kind, nbytes, ranks, prof)
                exposed = pick.seconds
                if beside:   # the GEMM runs on the SMs the collective leaves it
                    i = where[beside]
                    gemm, exposed = _cost.overlap(out[i].seconds, pick.seconds, prof,
                                                  shapes[beside], ranks)
                    out[i] = replace(out[i], seconds=gemm, exposed=gemm)
                out.append(OpCost(name, phase, kind, 0.0, nbytes, 0, pick.seconds,
                                  exposed, pick.algorithm, beside))
            else:
                name, cls, flops, nbytes, launches = op[:5]
                extra = op[5:]   # a measured kernel's name and / or a GEMM's output
                kernel = next((x for x in extra if isinstance(x, str)), None)
                shape = next((x for x in extra if isinstance(x, tuple)), None)
                if name.startswith("recompute:"):
                    name, ph = name[len("recompute:"):], "recompute"
                else:
                    ph = phase
                odt = _fp8.FP8 if fp8 and _fp8._is_layer_gemm(op) else dt
                t = _cost.compute_time(flops, nbytes, prof, odt, cls, launches, kernel, shape)
                shapes[name] = gemms[(ph, name)] = shape
                where[name] = len(out)
                out.append(OpCost(name, ph, cls, flops, nbytes, launches, t, t))
    if tp_comm_overlap and len(ranks) > 1:
        out = _tpo.apply(out, gemms, prof, ranks, dt)
    return tuple(out)


_FIELDS = tuple(f.name for f in fields(OpCost))


def layer_times(h: int, a: int, s: int, b: int, tp: int, sp: bool = False,
                recompute: str = "none", ffn: "int | None" = None, dtype="bfloat16",
                profile="a100", tp_ranks=None, attention: str = "materialized",
                fp8: bool = False, kv_heads: "int | None" = None,
                dropout: "bool | None" = None, tp_comm_overlap: bool = False,
                async_allreduce: bool = True, main_grad: bool = True,
                early_stop: bool = False, split_qkv: bool = False,
                regather: bool = True, transformer_engine: bool = False) -> LayerTimes:
    """Forward, backward (recompute included) and combined seconds of one GPT layer
    with hidden size h, a heads, sequence s, micro-batch b on tp tensor-parallel
    ranks (``tp_ranks``: their global ranks, default 0..tp-1), sequence parallel
    ``sp``, ``recompute`` "none" | "selective" | "full", MLP width ``ffn`` (4h).
    Priced ops are cached per (shape, layout, dtype, profile): a planner may call
    this for thousands of layouts.  ``kv_heads`` (and ``dropout``): a Llama block
    (``layer_ops``); ``tp_comm_overlap``: ``plan.tp_overlap``; ``async_allreduce=False``:
    Megatron-LM of 2021 (``layer_ops``); ``transformer_engine``: Megatron-LM's Transformer
    Engine spec (``TE_SOURCES``)."""
    ops = layer_ops(h, a, s, b, tp, sp, recompute, ffn, dtype, profile, tp_ranks, attention,
                    fp8, kv_heads, dropout, tp_comm_overlap, async_allreduce, main_grad,
                    early_stop, split_qkv, regather, transformer_engine)
    fwd = sum(o.exposed for o in ops if o.phase == "forward")
    bwd = sum(o.exposed for o in ops if o.phase != "forward")
    return LayerTimes(fwd, bwd, fwd + bwd,
                      tuple({f: getattr(o, f) for f in _FIELDS} for o in ops))
