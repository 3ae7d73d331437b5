"""One Llama block, op by op, for ``layer_cost``; its parameters and activations for ``memory``.

The block is the course's ``models.llama.Block`` (Touvron et al. 2023, "Llama 2", sec. 2.2
and Touvron et al. 2023, "LLaMA", sec. 2.2: pre-norm RMSNorm, SwiGLU, rotary positions;
grouped-query attention for Llama 2 70B and Llama 3, Ainslie et al. 2023), as it runs
under Megatron's tensor parallelism (the course's ``TP_PLAN``: q, k, v, gate, up
column-parallel, o and down row-parallel; Shoeybi et al. 2019):

    x = x + o(attn(rope(q(n)), rope(k(n)), v(n)))      n = RMSNorm(x); no biases anywhere
    x = x + w2(silu(w1 n) * w3 n)                       n = RMSNorm(x); d_ff = f

On one of t tensor-parallel ranks, with T = s b tokens (T_n = T / t on the norms and the
residual adds with sequence parallelism), h the hidden size, a query heads and g
key/value heads of head dim d = h / a (hq = a d / t and hk = g d / t on the rank), e bytes
per 16-bit value, the kernels and what they move (reads + writes):

- RMSNorm (Zhang & Sennrich 2019): y = x / rms(x) w: 4 FLOPs per element; reads x and w,
  writes y and the fp32 1 / rms per token (kept for backward): 2 e T_n h + e h + 4 T_n.
  Backward 8 FLOPs per element, reads x, dy, w and 1 / rms, writes dx and dw:
  3 e T_n h + 2 e h + 4 T_n;
- q, k, v, o, w1, w3, w2: GEMMs, 2 M K N FLOPs each (Narayanan et al. 2021, the derivation
  of eq. 3): q [T, h] x [h, hq], k and v [T, h] x [h, hk], o [T, hq] x [hq, h], w1 and w3
  [T, h] x [h, f / t], w2 [T, f / t] x [f / t, h]; backward an input-gradient and a
  weight-gradient GEMM each, as ``layer_cost`` prices the GPT's;
- RoPE (Su et al. 2021) on q and k: x cos + rotate_half(x) sin, 3 FLOPs per element;
  reads x, cos and sin (s x d each), writes y: 2 e T hq + 2 e s d (k: hk); backward the
  same rotation by -theta: reads dy, cos, sin, writes dx: 2 e T hq + 4 e s d;
- attention: the fused causal kernel (``wb.ops.flash_attention``, Dao 2023), FLOPs from
  ``wb.ops.cost`` (the pairs attended), GQA's k and v of g / t heads read as they are:
  forward reads q, k, v, writes o and the fp32 log-sum-exp (4 b a s / t);
  backward reads q, k, v, o, dO and the log-sum-exp, writes dQ, dK, dV; its output goes
  to o as laid out (no permute kernel: a fused kernel writes [b, s, a, d]);
- SwiGLU (Shazeer 2020): silu(w1 n), 4 FLOPs per element, reads and writes T f / t;
  backward 8 per element, reads the gate and dy, writes dx; the product with w3 n,
  1 FLOP, reads two and writes one; backward reads dy and both factors, writes both
  gradients (5 e T f / t);
- the residual adds: 1 FLOP per element, read 2 write 1 (3 e T_n h); backward the
  residual stream's two gradients summed (read 2, write 1);
- dropout (``cfg.dropout > 0`` only; Llama trains without): x * mask on the residual
  branches as ``layer_cost`` prices Megatron's.

Collectives: as Megatron's GPT (``layer_cost``): the row-parallel o and w2 end in an
all-reduce (sequence parallel: reduce-scatter; the column-parallel inputs all-gathered),
and in backward the input gradient of each column-parallel group (q, k, v; w1, w3: one
all-reduce for the summed gradient of their shared input) runs beside the group's last
weight-gradient GEMM (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``);
with sequence parallelism each group's input is all-gathered again in backward beside
the first input-gradient GEMM autograd runs (v's, w3's: :func:`backward_ops`), except
where DTensor keeps the gathered input (torchtitan: ``regather=False``).

Activations kept for backward (16-bit unless said; the accounting of Korthikanti et al.
2022 sec. 4.1 applied to these ops, and what the dry run measures of the course's
model): inside the TP region q (after RoPE) 2 T hq, k and v 2 T hk each, the attention
output (the o GEMM's input) 2 T hq, the log-sum-exp 4 b a s / t, silu's input, w3's
output, silu's output (the product's factors) and the product (w2's input) 2 T f / t
each; outside (split by t with sequence parallelism) the two norms' inputs and outputs
2 T h each and their fp32 1 / rms 4 T each.

``recompute="op"``: torchtitan's op-level selective activation checkpointing (its Llama
3 configs' ``selective_ac_option = 'op'``; ``torchtitan/parallelisms/parallelize_llama.py``
at 9dec370ad2, ``_save_list`` and ``_custom_policy``): the block is a checkpoint region
in which the outputs of ``aten.mm`` are saved except every second one (counted from 1
in the block: q 1, k 2, v 3, o 4, w1 5, w3 6, w2 7, so q, v, w1 and w2 are kept, k, o
and w3 recomputed), the flash (or memory-efficient) attention kernel's outputs and the
sequence-parallel reduce-scatters' outputs are saved, and every other op is recomputed
in the backward (up to w2's GEMM: PyTorch's non-reentrant checkpoint stops its recompute
once the tensors the backward needs are regenerated, :func:`op_sac_recompute`).  Kept:
the block's input 2 T_n h, q's and v's GEMM outputs 2 T hq and
2 T hk, the attention output 2 T hq with its log-sum-exp, w1's 2 T f / t, w2's (the
row-parallel partial sum, full width) 2 T h, and with sequence parallelism the two
reduce-scattered branch outputs 2 T_n h each.  The backward first re-runs the norms,
k, RoPE, o, the first residual add, silu, w3 and the product (and the sequence-parallel
all-gathers: ``all_gather_into_tensor`` is not on the save list; without sequence
parallelism the attention branch's all-reduce).
"""
from __future__ import annotations

from ..sim_mesh.kernel_cost import AttentionShape

__all__ = ["forward_ops", "backward_ops", "layer_params", "activation_bytes", "zero3_layer",
           "weight_matrices", "op_sac_recompute", "op_sac_recomputed_flops", "full_recompute"]

# torchtitan's op-level SAC keeps these forward ops' outputs (module docstring)
OP_SAC_SAVED = ("q_gemm", "v_gemm", "flash_attention", "w1_gemm", "w2_gemm")


def _flash(b, ah, gh, s, d, e):
    """(forward FLOPs, forward bytes, backward FLOPs, backward bytes) of the fused causal
    kernel with ah query and gh key/value heads on one rank (module docstring).  FLOPs as
    ``wb.ops.cost("flash_attention", ...)`` counts them, over the pairs attended, which
    causal attention makes s (s + 1) / 2 per head: 2 pairs (d + d) forward (Q K^T, P V),
    2 pairs (3 d + 2 d) backward (dV, dP, dS recomputed P, dQ, dK; Dao 2023 alg. 2); in
    closed form, not by building the s x s mask as that function does."""
    pairs = b * ah * s * (s + 1) // 2
    nq, nk, lse = b * ah * s * d, b * gh * s * d, 4 * b * ah * s
    return 4 * pairs * d, e * (2 * nq + 2 * nk) + lse, 10 * pairs * d, \
        e * (4 * nq + 4 * nk) + lse


def _dims(h, a, g, s, b, t, sp, f):
    T = s * b
    return T, (T // t if sp else T), a // t, g // t, h // a, f // t


def forward_ops(h, a, g, s, b, t, sp, f, e, drop):
    """Forward kernels and collectives of one block on one TP rank, in ``layer_cost``'s
    tuple form (name, class, FLOPs, bytes, launches[, gemm output])."""
    T, Tn, ah, gh, d, ft = _dims(h, a, g, s, b, t, sp, f)
    hq, hk = ah * d, gh * d

    def gemm(n, M, K, N):
        return n, "matmul", 2 * M * K * N, e * (M * K + K * N + M * N), 1, (1, M, N)

    def norm(n):
        return n, "norm", 4 * Tn * h, 2 * e * Tn * h + e * h + 4 * Tn, 1

    def rope(n, w):
        return n, "elementwise", 3 * T * w, 2 * e * T * w + 2 * e * s * d, 1

    def residual(n):
        out = [(n + "_dropout", "elementwise", Tn * h, 2 * e * Tn * h + Tn * h, 1)] if drop \
            else []
        return out + [(n, "elementwise", Tn * h, 3 * e * Tn * h, 1)]

    gather = [("sp_all_gather", "all_gather", T * h * e)] if sp else []
    out = ("reduce_scatter" if sp else "all_reduce", T * h * e)
    ff, fb, _, _ = _flash(b, ah, gh, s, d, e)
    ops = [norm("attn_norm")] + [(o[0] + "_1",) + o[1:] for o in gather]
    ops += [gemm("q_gemm", T, h, hq), gemm("k_gemm", T, h, hk), gemm("v_gemm", T, h, hk),
            rope("rope_q", hq), rope("rope_k", hk),
            ("flash_attention", "attention", ff, fb, 1, AttentionShape(b * ah, s, d, True, False)),
            gemm("o_gemm", T, hq, h), ("tp_out_1", *out)] + residual("residual_add_1")
    ops += [norm("mlp_norm")] + [(o[0] + "_2",) + o[1:] for o in gather]
    ops += [gemm("w1_gemm", T, h, ft), ("silu", "elementwise", 4 * T * ft, 2 * e * T * ft, 1),
            gemm("w3_gemm", T, h, ft), ("swiglu_mul", "elementwise", T * ft, 3 * e * T * ft, 1),
            gemm("w2_gemm", T, ft, h), ("tp_out_2", *out)] + residual("residual_add_2")
    return ops


def backward_ops(h, a, g, s, b, t, sp, f, e, drop, recompute, async_allreduce=True,
                 main_grad=True, regather=True):
    """Backward kernels and collectives in execution order (a collective's fourth field
    names the GEMM it runs beside); selective recompute re-runs the attention kernel.
    ``async_allreduce=False``: a column-parallel group's input-gradient all-reduce after
    its GEMMs, on the critical path, as ``layer_cost``'s GPT layer (Megatron-DeepSpeed
    under DeepSpeed: ``plan.megatron_2021``).

    With sequence parallelism, ``regather=True`` (Megatron-LM and this library's recipe,
    ``parallel.ops_table.linear_regather``): each column-parallel group's input is
    all-gathered again in backward, issued when the group's first linear starts its
    backward (``trace_regather``, called from the first ``RegatheredLinear.backward``
    autograd runs) and so beside the first input-gradient GEMM: autograd runs the
    linears reading one input last-created first, v before k and q, w3 before w1, so
    the attention's re-gather runs beside ``v_dgrad`` and the MLP's beside ``w3_dgrad``
    (the input gradient's reduce-scatter waits for the group's last dgrad, beside its
    last wgrad, q's and w1's).  ``regather=False`` (PyTorch DTensor's
    ``SequenceParallel`` + ``ColwiseParallel``, torchtitan; torch 2.13.0
    ``torch/distributed/tensor/parallel/style.py:116`` redistributes the input to
    Replicate through the ``Redistribute`` autograd function, ``_redistribute.py:1876``,
    whose backward only redistributes the gradient, and ``aten.mm`` saves the gathered
    input): no all-gather in backward (measured with ``CommDebugMode`` on a 2-rank fake
    process group: 2 reduce-scatters, 0 all-gathers for two ColwiseParallel linears on
    a SequenceParallel norm); :func:`activation_bytes` keeps the gathered inputs."""
    T, Tn, ah, gh, d, ft = _dims(h, a, g, s, b, t, sp, f)
    hq, hk = ah * d, gh * d

    def dgrad(n, M, K, N):     # dx[M, K] = dy[M, N] @ w[K, N]^T
        return n, "matmul", 2 * M * K * N, e * (M * N + K * N + M * K), 1, (1, M, K)

    def wgrad(n, M, K, N):     # dw[K, N] = x^T dy, into fp32 main_grad (as layer_cost)
        return n, "matmul", 2 * M * K * N, e * (M * N + M * K) + gb * K * N, 1, (1, K, N)

    gb = 8 if main_grad else e      # main_grad=False: the 16-bit param.grad (layer_cost)

    def linear(n, M, K, N):
        return [dgrad(n + "_dgrad", M, K, N), wgrad(n + "_wgrad", M, K, N)]

    def norm(n):
        return [(n + "_grad", "norm", 8 * Tn * h, 3 * e * Tn * h + 2 * e * h + 4 * Tn, 1),
                (n + "_residual_grad_add", "elementwise", Tn * h, 3 * e * Tn * h, 1)]

    def rope(n, w):
        return n + "_grad", "elementwise", 3 * T * w, 2 * e * T * w + 4 * e * s * d, 1

    def branch_out(n):
        out = [(n + "_dropout_grad", "elementwise", Tn * h, 2 * e * Tn * h + Tn * h, 1)] \
            if drop else []
        return out + ([("sp_grad_all_gather_" + n, "all_gather", T * h * e, "")] if sp else [])

    def column(n, dgrad_name, wgrad_name):
        comm = [("sp_regather_" + n, "all_gather", T * h * e, dgrad_name)] \
            if sp and regather else []
        return comm + [("tp_grad_" + n, "reduce_scatter" if sp else "all_reduce", T * h * e,
                        wgrad_name if sp or async_allreduce else "")]

    ff, fb, bf, bb = _flash(b, ah, gh, s, d, e)
    ops = branch_out("mlp") + linear("w2", T, ft, h)
    ops += [("swiglu_mul_grad", "elementwise", 2 * T * ft, 5 * e * T * ft, 1)]
    ops += linear("w3", T, h, ft)
    ops += [("silu_grad", "elementwise", 8 * T * ft, 3 * e * T * ft, 1)]
    ops += linear("w1", T, h, ft) + column("mlp", "w3_dgrad", "w1_wgrad") + norm("mlp_norm")
    ops += branch_out("attn") + linear("o", T, hq, h)
    if recompute == "selective":
        ops += [("recompute:flash_attention", "attention", ff, fb, 1,
                 AttentionShape(b * ah, s, d, True, False))]
    ops += [("flash_attention_grad", "attention", bf, bb, 1,
             AttentionShape(b * ah, s, d, True, True)), rope("rope_k", hk),
            rope("rope_q", hq)]
    ops += linear("v", T, h, hk) + linear("k", T, h, hk) + linear("q", T, h, hq)
    return ops + column("attn", "v_dgrad", "q_wgrad") + norm("attn_norm")


def op_sac_recompute(fwd_ops) -> list:
    """The forward ops torchtitan's op-level SAC re-runs before a block's backward
    (module docstring): all but the saved GEMMs, the attention kernel and the
    reduce-scattered branch outputs, in forward order, up to the last op whose tensors
    the backward needs.  torchtitan (9dec370ad2) checkpoints with
    ``torch.utils.checkpoint``'s non-reentrant default, early stop: the recompute ends
    as soon as every tensor saved for the backward has been regenerated
    (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default).  The w2 GEMM's
    inputs are the last such tensors without dropout (its all-reduce or reduce-scatter
    and the residual add keep none), the residual dropout's mask with it."""
    end = max(i for i, op in enumerate(fwd_ops)
              if op[0] in ("w2_gemm", "residual_add_2_dropout"))
    return [op for op in fwd_ops[:end + 1] if op[0] not in OP_SAC_SAVED
            and not (op[0].startswith("tp_out") and op[1] == "reduce_scatter")]


def full_recompute(fwd_ops) -> list:
    """The forward ops a full recompute by PyTorch's non-reentrant checkpoint re-runs
    (this library's recipe: ``models.llama``'s block under ``torch.utils.checkpoint``,
    ``use_reentrant=False``; torchtitan's full AC, ``ptd_checkpoint_wrapper`` with
    ``CheckpointImpl.NO_REENTRANT``, pytorch/torchtitan eb6aa6389
    ``parallelize_llama.py``:73-80): all, in order, up to the last whose output the
    backward needs, w2's input (the SwiGLU product) without dropout, the residual
    dropout's mask with it (early stop, as :func:`op_sac_recompute`); the dry run's trace
    re-runs no w2 GEMM, nor does torchtitan's block (``tests/test_i21rel.py`` counts its
    backward's GEMMs).  Megatron-LM's ``CheckpointFunction`` re-runs the whole forward."""
    last = "residual_add_2_dropout" if any(op[0] == "residual_add_2_dropout"
                                           for op in fwd_ops) else "swiglu_mul"
    end = next(i for i, op in enumerate(fwd_ops) if op[0] == last)
    return list(fwd_ops[:end + 1])


def op_sac_recomputed_flops(cfg, batch: int) -> float:
    """FLOPs op-level SAC adds per block and step of ``batch`` sequences: the forward of
    its k, o and w3 GEMMs (element-wise FLOPs are not counted, as in the model's)."""
    h, f, s = cfg.d_model, cfg.d_ff, cfg.seq_len
    hk = cfg.n_kv_head * cfg.head_dim
    return 2 * batch * s * (h * hk + h * h + h * f)


def weight_matrices(cfg, tp: int) -> list[float]:
    """Elements of each weight matrix of one block on one TP rank, forward order:
    q, k, v, o, w1, w3, w2."""
    h, f, hk = cfg.d_model, cfg.d_ff, cfg.n_kv_head * cfg.head_dim
    return [h * h / tp, h * hk / tp, h * hk / tp, h * h / tp, h * f / tp, h * f / tp,
            f * h / tp]


def layer_params(cfg, tp: int) -> float:
    """Parameters of one Llama block on one TP rank: the seven matrices split by t (no
    biases), the two RMSNorm weights whole."""
    return sum(weight_matrices(cfg, tp)) + 2 * cfg.d_model


def zero3_layer(cfg, tp: int) -> list[int]:
    """Elements of each module of a block ZeRO-3 gathers, forward order: norm, q, k, v,
    o, norm, w1, w3, w2 (``memory.zero3_modules``)."""
    q, k, v, o, w1, w3, w2 = (int(n) for n in weight_matrices(cfg, tp))
    h = cfg.d_model
    return [h, q, k, v, o, h, w1, w3, w2]


def activation_bytes(cfg, b: int, tp: int, sp: bool, recompute: str,
                     regather: bool = True) -> float:
    """Bytes one block keeps for backward on one rank (module docstring); full recompute
    keeps the block's input, 2 s b h (/ t with sequence parallelism).  ``regather=False``
    (DTensor's sequence parallelism, torchtitan: :func:`backward_ops`): without
    checkpointing ("none", "selective") the column-parallel linears keep their
    all-gathered inputs, the two norms' outputs whole, 2 T h each, not their 2 T h / t
    shards; op-level SAC and full recompute re-run the all-gather (it is not on
    torchtitan's save list), so they keep what they kept."""
    s, h, a, f = cfg.seq_len, cfg.d_model, cfg.n_head, cfg.d_ff
    hk = cfg.n_kv_head * cfg.head_dim
    T, t_sp = s * b, (tp if sp else 1)
    if recompute == "full":
        return 2 * T * h / t_sp
    hq, hkt, ft = h / tp, hk / tp, f / tp
    if recompute == "op":
        kept = 2 * T * (2 * hq + hkt + ft) + 4 * b * a * s / tp + 2 * T * h
        return kept + (2 * T * h / t_sp) * (3 if sp and tp > 1 else 1)
    inside = 2 * T * (2 * h + 2 * hk) + 8 * T * f     # q, o; k, v; SwiGLU's four
    lse = 0.0 if recompute == "selective" else 4 * b * a * s
    outside = 8 * T * h + 8 * T                        # norms' inputs and outputs, 1 / rms
    if cfg.dropout > 0:
        outside += 2 * T * h                           # two one-byte dropout masks
    gathered = 0.0
    if sp and tp > 1 and not regather:                 # the norms' outputs kept gathered
        outside -= 4 * T * h
        gathered = 4 * T * h
    return (inside + lse) / tp + outside / t_sp + gathered
