"""A mixture-of-experts block for the planner: its parameters, FLOPs, activations and
kernels, with its experts split over ``ep`` expert-parallel ranks.

The model config names the MoE as the issue's ``ModelConfig`` does (``moe_experts`` E,
``moe_topk`` k, ``moe_capacity_factor`` c, ``moe_shared_experts`` S) and the width of
one expert's SwiGLU as ``moe_d_ff`` (Megatron-LM's ``--moe-ffn-hidden-size``; None:
``d_ff``).  The block is a Llama block whose MLP is replaced by E SwiGLU experts, a
router (a linear h -> E, softmax, top-k: Shazeer et al. 2017; Fedus et al. 2022) and S
shared experts that every token runs (DeepSeekMoE, Dai et al. 2024): Mixtral's
(Jiang et al. 2024, sec. 2.1) when S = 0.

Parallelism as Megatron-Core runs it (``megatron/core/transformer/moe``, its alltoall
token dispatcher): the experts are split over an expert-parallel group of ``ep`` ranks,
carved out of the data-parallel ranks (E / ep experts each), and tensor-parallel inside
as the dense layers are (``--expert-tensor-parallel-size`` defaults to the TP size);
with TP, sequence parallelism is required (Megatron-LM ``arguments.py``: "When using
MoE and tensor parallelism, sequence parallelism must be used").  On one rank, with
T_n tokens entering the block (s b / (cp tp)), R = c k T_n routed rows and M = c k T
rows through its experts after the TP all-gather (T = s b / cp; c = min(1, capacity
factor), below):

    router GEMM (T_n x h x E), softmax / top-k, permute (R rows of h)
    all-to-all dispatch over ep:    R h bytes-per-element per rank
    TP all-gather of the rows:      M h  (tp > 1)
    E / ep experts: w1, w3 (M x h x f / tp), SwiGLU, w2 (M x f / tp x h), grouped GEMMs
    TP reduce-scatter:              M h  (tp > 1)
    all-to-all combine over ep:     R h
    unpermute: the k outputs of a token weighted by their router probabilities, summed

**Experts under tensor parallelism: two layouts.**  Megatron-Core (the planner's
default) splits each expert over an expert-tensor-parallel group whose size defaults to
the TP size (NVIDIA/Megatron-LM d98e8a64dd megatron/core/model_parallel_config.py:130-133,
"Default is None, which will be set to the value of tensor_model_parallel_size", set at
:506-507; megatron/training/arguments.py:587-588 likewise) and requires sequence
parallelism with MoE and TP in training (megatron/core/transformer/moe/moe_layer.py:
636-640 raises without it; megatron/training/yaml_arguments.py:336-338): the diagram
above.  This library's runtime (``recipes.hybrid``, ``models.split.tp_plan``: a MoE
block's router and experts are left out of the TP plan) keeps the whole MoE MLP on every
TP rank and refuses expert parallelism with sequence parallelism
(``recipes.moe.check_ep``): each TP rank routes the same T tokens, runs its E / ep
experts whole (f, not f / t) on the same c k T rows, and exchanges them over ep; no TP
collective in the MLP.  The planner prices that layout when asked by its name,
``Layout(framework="workbench", sp=False)`` with tp > 1 (``mlp_tp`` = 1; Megatron refuses
tp > 1 without sp for a MoE, so the two never meet), and the dry run holds it to the
runtime (tests/test_moetp.py).

**The count exchange.**  Before its dispatch each rank sends the ep group its E int64
per-expert row counts, once per MoE layer, forward only (the split sizes the all-to-alls
need; the backward reuses them): Megatron-Core gathers ``num_local_tokens_per_expert``
over its tp x ep group (NVIDIA/Megatron-LM d98e8a64dd megatron/core/transformer/moe/
token_dispatcher.py:543, 566-570); the runtime records an all-to-all of 8 E bytes per
rank over the ep group (``strategies.expert_parallel_clock.record_layer``).  Priced as
the runtime records it (``ep_counts``: 8 E bytes, all-to-all over ep, at the
collective's price, its latency at that size) for both layouts, so estimate and dry run
send the same bytes; ASSUMPTION for Megatron: its all-gather over tp x ep (E t ep int64
received) priced as that all-to-all (both latency-bound at E int64).

Each all-to-all moves (ep - 1) / ep of its buffer off the rank (``cost.wire_bytes``; the
pairwise exchange of GShard, Lepikhin et al. 2020 sec. 3.2, and DeepSpeed-MoE,
Rajbhandari et al. 2022 sec. 5): T_n k h e (ep - 1) / ep bytes per direction,
dispatch and combine forward, their gradients backward.  A capacity factor c caps each
expert at c k T / E rows and drops the rest, without padding to it (Megatron-Core's
default, ``moe_pad_expert_input_to_capacity=False``: NVIDIA/Megatron-LM d98e8a64dd
megatron/core/transformer/transformer_config.py:917-921; the runtime's dispatcher sends
the rows that kept a slot, ``parallel.strategies.expert_parallel``), so under balanced
routing an expert takes min(c, 1) k T / E rows: ``MoE.c`` = min(c, 1), 1 when dropless
(None).  ASSUMPTIONS (stated in every estimate's
assumptions): routing perfectly balanced (the load-balancing loss's aim; real routers
are not: notebook 14 shows by how much) and the all-to-alls not overlapped with the
experts (Megatron-LM's default; ``--overlap-moe-expert-parallel-comm`` came later).

The kernels around the expert GEMMs (the permutation, the experts' and the shared experts'
SwiGLU, the un-permutation, their gradients) are written once, in
``parallel.strategies.expert_parallel_kernels``, which the expert-parallel layer's clock
records too (the dry run prices the same tuples for the rows each rank holds).

**This library's runtime with ep = 1** (``dense=True``: ``dense_dispatch``) runs the
model's own dispatch, not Megatron-Core's (``models.moe``: GShard's formulation, Lepikhin
et al. 2020 sec. 2.2): per sequence, every expert over a (E, C, h) buffer of C =
``ops.moe.capacity(S, E, k, c)`` slots (S when dropless), empty slots included, as one
batched matmul per expert weight (b E GEMMs of C rows); the scatter into the buffer
(``moe_dispatch``) and the gather-and-weight out of it (``moe_combine``) priced as the op
table prices them (``parallel.ops_table.moe``); M = b E C rows through the experts, E / k
times the routed rows when dropless.  Autograd saves the gathered buffer's input (the
experts' output with one zero row per sequence: torch's ``gather`` keeps ``self``)
beside the rows above.  Was priced as routed rows only, so the estimate of
``framework="workbench"`` with ep = 1 was 0.64x the dry run's step and 0.39x its
activations on a 4-layer Llama with 8 experts, top-2, dropless (dp 4).

Model FLOPs count the active experts only: 2 (3 h f (k + S) + h E) per token forward
for the MLP part (6 N_active per token, as Mixtral's "13B active parameters").
"""
from __future__ import annotations

from dataclasses import dataclass

# the kernels around the expert GEMMs, one formula for this estimate and the runtime's clock
from ..parallel.strategies import expert_parallel_kernels as K

__all__ = ["MoE", "moe_of", "check_moe", "dense_dispatch", "dense_capacity", "expert_params", "dense_layer_params",
           "rank_expert_params", "layer_flops", "activation_bytes", "forward_ops",
           "backward_ops", "MLP_OPS", "mlp_tp", "COUNT_BYTES"]

# bytes of one per-expert row count (int64: the runtime's ``ExpertParallel._permute`` counts,
# Megatron-Core's ``routing_map.sum(dim=0).long()``, token_dispatcher.py:543)
COUNT_BYTES = 8

# the dense Llama MLP's kernels (plan.llama_layer's names), which a MoE block replaces
MLP_OPS = frozenset({
    "sp_all_gather_2", "w1_gemm", "silu", "w3_gemm", "swiglu_mul", "w2_gemm", "tp_out_2",
    "sp_grad_all_gather_mlp", "w2_dgrad", "w2_wgrad", "swiglu_mul_grad", "w3_dgrad",
    "w3_wgrad", "silu_grad", "w1_dgrad", "w1_wgrad", "sp_regather_mlp", "tp_grad_mlp"})


@dataclass(frozen=True)
class MoE:
    """The MoE fields of a model config, checked (module docstring)."""
    experts: int
    topk: int
    capacity_factor: "float | None"
    shared: int
    d_ff: int

    @property
    def c(self) -> float:
        """Rows per routed token-slot each expert processes under balanced routing: min(c,
        1) for a capacity factor c (the rows over capacity dropped, none padded: module
        docstring), 1 when dropless."""
        return 1.0 if self.capacity_factor is None else min(1.0, float(self.capacity_factor))


def moe_of(cfg) -> "MoE | None":
    """The MoE of ``cfg`` (None for a dense model: ``moe_experts`` absent, 0 or None)."""
    e = getattr(cfg, "moe_experts", 0)
    if not e:
        return None
    check_moe(cfg)
    return MoE(e, getattr(cfg, "moe_topk", 2), getattr(cfg, "moe_capacity_factor", None),
               getattr(cfg, "moe_shared_experts", 0) or 0,
               getattr(cfg, "moe_d_ff", None) or cfg.d_ff)


def _is_int(v, lo):
    return not isinstance(v, bool) and isinstance(v, int) and v >= lo


def check_moe(cfg) -> None:
    """Raise ValueError naming the field and the fix when the MoE fields are wrong."""
    e = getattr(cfg, "moe_experts", 0)
    k = getattr(cfg, "moe_topk", 2)
    c = getattr(cfg, "moe_capacity_factor", None)
    s = getattr(cfg, "moe_shared_experts", 0) or 0
    f = getattr(cfg, "moe_d_ff", None)
    if not _is_int(e, 1):
        raise ValueError(f"model: moe_experts={e!r} must be an int >= 1 (0 or None: dense)")
    if not _is_int(k, 1) or k > e:
        raise ValueError(f"model: moe_topk={k!r} must be an int in [1, moe_experts={e}]: a "
                         f"token is routed to k of the experts; use a k <= {e}")
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
        raise ValueError(f"model: moe_capacity_factor={c!r} must be a number > 0 (1.0: each "
                         f"expert takes its even share k T / E) or None (dropless)")
    if not _is_int(s, 0):
        raise ValueError(f"model: moe_shared_experts={s!r} must be an int >= 0")
    if f is not None and not _is_int(f, 1):
        raise ValueError(f"model: moe_d_ff={f!r} must be an int >= 1 (one expert's SwiGLU "
                         f"width) or None (d_ff)")
    if getattr(cfg, "arch", None) != "llama":
        raise ValueError(f"model: the planner prices MoE blocks of SwiGLU experts "
                         f"(arch='llama', as Mixtral); got arch={cfg.arch!r}: use "
                         f"arch='llama'")


def dense_dispatch(lay) -> bool:
    """True where the layout runs the model's own dispatch (module docstring): this
    library's runtime (``lay.engine`` "workbench") without expert parallelism."""
    return lay.engine == "workbench" and lay.ep == 1


def dense_capacity(cfg) -> int:
    """Slots per expert and sequence of the model's own dispatch: ``ops.moe.capacity`` of
    a sequence's S tokens (one routing group per sequence, ``models.moe.MoE.forward``)."""
    from ..ops.moe import capacity
    m = moe_of(cfg)
    return capacity(cfg.seq_len, m.experts, m.topk, m.capacity_factor)


def dense_groups(cfg, lay) -> "tuple[int, int] | None":
    """(sequences, tokens each) that the model's own dispatch routes on one rank per
    micro-batch, or None where the layout does not run it (:func:`dense_dispatch`).
    ``cfg``: the model at the rank's sequence (s / cp, ``ep_cp.token_cfg``).  Under
    context parallelism the layer takes whole sequences (``recipes.moe.
    keep_sequence_order``): b / cp of them where cp divides the micro-batch b, else all
    b, replicated over cp."""
    if not (getattr(cfg, "moe_experts", 0) and dense_dispatch(lay)):
        return None
    b, cp = lay.micro_batch, lay.cp
    return (b // cp if cp > 1 and b % cp == 0 else b, cfg.seq_len * cp)


def mlp_tp(tp: int, sp: bool = True) -> int:
    """The ranks one expert (and the shared experts) is split over: Megatron-Core's expert
    tensor-parallel size, its default the TP size, with sequence parallelism; 1 without
    (this library's runtime, the MoE MLP whole on every TP rank: module docstring)."""
    return tp if sp else 1


def expert_params(cfg) -> int:
    """Parameters of one routed expert: w1, w3 (h x f) and w2 (f x h), no biases."""
    return 3 * cfg.d_model * moe_of(cfg).d_ff


def dense_layer_params(cfg, tp: int, sp: bool = True) -> float:
    """Parameters of one MoE block on one TP rank outside the routed experts: q, k, v, o
    split by t, the two RMSNorm weights and the router (h x E) whole (Megatron-Core's
    router is not tensor-parallel), the shared experts split by ``mlp_tp``."""
    from .llama_layer import weight_matrices
    m, h = moe_of(cfg), cfg.d_model
    attn = sum(weight_matrices(cfg, tp)[:4])
    return attn + 2 * h + h * m.experts + 3 * h * m.d_ff * m.shared / mlp_tp(tp, sp)


def rank_expert_params(cfg, tp: int, ep: int, sp: bool = True) -> float:
    """Routed-expert parameters of one block on one rank: E / ep experts, each split over
    ``mlp_tp`` ranks (t with sp, Megatron-Core; whole without, this library's runtime)."""
    return moe_of(cfg).experts // ep * expert_params(cfg) / mlp_tp(tp, sp)


def layer_flops(cfg, b: int) -> tuple[float, float]:
    """(matrix FLOPs, attention-core FLOPs) of one MoE block's forward for b sequences:
    the active experts only (k routed + S shared), the router, the attention matrices."""
    s, h, m = cfg.seq_len, cfg.d_model, moe_of(cfg)
    kv = cfg.n_kv_head * cfg.head_dim
    per_token = 2 * h * h + 2 * h * kv + 3 * h * m.d_ff * (m.topk + m.shared) + h * m.experts
    return 2 * b * s * per_token, 4 * b * s * s * h


def activation_bytes(cfg, b: int, tp: int, sp: bool, recompute: str,
                     regather: bool = True, dense: "tuple[int, int] | None" = None) -> float:
    """Bytes one MoE block keeps for backward on one rank (16-bit unless said): the dense
    block's (``llama_layer.activation_bytes``) less its SwiGLU's four T f / t tensors, plus
    the router's fp32 probabilities (4 T_n E), the experts' input rows (2 M h, whole on
    each TP rank after the gather), their SwiGLU's four tensors (8 M f / t), their output
    rows kept for the probabilities' gradient (2 R h) and the shared experts' SwiGLU
    (8 T S f / t).  Full recompute keeps the block input only, as the dense block.
    ``regather=False`` (DTensor's sequence parallelism, as for the dense block): without
    checkpointing the attention's column-parallel input kept gathered, 2 T h, not its
    2 T h / t shard; the MoE's own tensors as above (ASSUMPTION: its router reads the
    sequence shard, Megatron-Core's layout, whatever the framework).  ``dense``: the
    model's own dispatch (module docstring) on (sequences, tokens each)
    (:func:`dense_groups`): M = b' E C rows, and the combine's gather keeps its input,
    the experts' output with a zero row per sequence, e (M + b') h."""
    from .llama_layer import activation_bytes as dense_block
    base = dense_block(cfg, b, tp, sp, recompute)
    if recompute == "full":
        return base
    m, h = moe_of(cfg), cfg.d_model
    T = cfg.seq_len * b
    if sp and tp > 1 and not regather and recompute != "op":
        base += 2 * T * h - 2 * T * h / tp          # the attention's norm output, whole
    Tn = T / (tp if sp else 1)
    M, R = m.c * m.topk * T, m.c * m.topk * Tn
    mt = mlp_tp(tp, sp)
    gathered, Tm = 0.0, T
    if dense:
        bm, sm = dense
        Tm = Tn = bm * sm
        M, R = bm * m.experts * dense_capacity(cfg.replace(seq_len=sm)), m.c * m.topk * Tm
        gathered = 2 * (M + bm) * h
    moe = 4 * Tn * m.experts + 2 * M * h + 8 * M * m.d_ff / mt + 2 * R * h \
        + 8 * Tm * m.shared * m.d_ff / mt + gathered
    return base - 8 * T * cfg.d_ff / tp + moe


def _dims(cfg, b, tp, ep, e, sp=True):
    m, h = moe_of(cfg), cfg.d_model
    T = cfg.seq_len * b
    mt = mlp_tp(tp, sp)
    Tn = T // mt
    El = m.experts // ep
    M, R = m.c * m.topk * T, m.c * m.topk * Tn
    ft = m.d_ff // mt
    Me = -(-int(round(M)) // El)          # rows per local expert (ceil)
    return m, h, T, Tn, El, M, R, ft, Me


def _no_tp(ops, tp, sp) -> list:
    """``ops`` without the MLP's TP collectives when the MLP is whole on every TP rank
    (``mlp_tp`` 1 with tp > 1: nothing to gather or reduce)."""
    if tp == 1 or mlp_tp(tp, sp) > 1:
        return ops
    return [o for o in ops if not (len(o) == 4 and o[3] == "tp")]


def _router(Tn, h, E, k, e) -> list:
    return [("router_gemm", "matmul", 2 * Tn * h * E, e * (Tn * h + h * E + Tn * E), 1,
             (1, Tn, E)),
            # softmax and top-k in fp32 (Megatron-Core's --moe-router-dtype fp32)
            ("router_softmax_topk", "elementwise", 6 * Tn * E, e * Tn * E + 8 * Tn * E
             + 12 * Tn * k, 1)]


def _dense_sizes(cfg, b, e):
    """(M, C, index bytes, combine's reads) of the model's own dispatch (module
    docstring): M = b E C buffer rows; the experts and slots (int64, T k each) that the
    scatter and the gather read; the combine reads k rows per token, the fp32 gates and
    those indices (``ops_table.moe._combine_cost``)."""
    m, h, T = moe_of(cfg), cfg.d_model, cfg.seq_len * b
    C = dense_capacity(cfg)
    M = b * m.experts * C
    idx = 2 * 8 * T * m.topk
    return M, C, idx, e * m.topk * T * h + 4 * T * m.topk + idx


def _dense_forward(cfg, b, e) -> list:
    """The routed experts of the model's own dispatch, forward (module docstring): the
    scatter (``moe_dispatch``: tokens read, the buffer written, zeros included), one
    batched matmul per weight over b E GEMMs of C rows, the SwiGLU, the gather and
    weighted sum (``moe_combine``), as the op table prices them."""
    m, h, T = moe_of(cfg), cfg.d_model, cfg.seq_len * b
    E, k, f = m.experts, m.topk, m.d_ff
    M, C, idx, read = _dense_sizes(cfg, b, e)
    return [("moe_dispatch", "data_movement", 0, e * T * h + idx + e * M * h, 1),
            ("expert_w1", "matmul", 2 * M * h * f, e * (M * h + E * h * f + M * f), 1,
             (b * E, C, f)),
            ("expert_w3", "matmul", 2 * M * h * f, e * (M * h + E * h * f + M * f), 1,
             (b * E, C, f)),
            *K.swiglu(M, f, e),
            ("expert_w2", "matmul", 2 * M * f * h, e * (M * f + E * f * h + M * h), 1,
             (b * E, C, h)),
            ("moe_combine", "data_movement", 2 * k * T * h, read + e * T * h, 1)]


def _dense_backward(cfg, b, e) -> list:
    """Its backward in autograd's order, as the op table prices each op's (a batched
    matmul's input gradient over the b E GEMMs, its weight gradient, 16-bit, over the E
    weights: ``ops_table.pricing``'s split); autograd's sums of the buffer's two
    gradients and of the block input's two are not kernels the runtime's clock records
    (nor the dense Llama's w1 / w3 input gradient sum), so not priced here either."""
    m, h, T = moe_of(cfg), cfg.d_model, cfg.seq_len * b
    E, k, f = m.experts, m.topk, m.d_ff
    M, C, idx, read = _dense_sizes(cfg, b, e)

    def grads(n, K_, N):                      # y[M, N] = x[M, K] @ w[E, K, N]
        return [(n + "_dgrad", "matmul", 2 * M * K_ * N, e * (M * N + E * K_ * N + M * K_),
                 1, (b * E, C, K_)),
                (n + "_wgrad", "matmul", 2 * M * K_ * N, e * (M * K_ + E * K_ * N), 1,
                 (E, K_, N))]

    mul_grad, silu_grad = K.swiglu_grad(M, f, e)
    return [("moe_combine_grad", "data_movement", 4 * k * T * h,
             e * T * h + read + e * M * h + 4 * T * k, 1),
            *grads("expert_w2", f, h), mul_grad, *grads("expert_w3", h, f), silu_grad,
            *grads("expert_w1", h, f),
            ("moe_dispatch_grad", "data_movement", 0, e * T * h + idx + e * M * h, 1)]


def forward_ops(cfg, b, tp, ep, e, sp=True, dense=False) -> list:
    """The MoE MLP's forward kernels and collectives on one rank (module docstring), as
    tuples: compute (name, class, FLOPs, bytes, launches[, gemm output]) and collective
    (name, kind, bytes, group) with group "tp" or "ep".  ``sp=False`` with tp > 1: the
    runtime's layout, the MLP whole on every TP rank (``mlp_tp``).  ``dense``: the model's
    own dispatch (this library's runtime with ep = 1: :func:`dense_dispatch`)."""
    m, h, T, Tn, El, M, R, ft, Me = _dims(cfg, b, tp, ep, e, sp)
    E, k = m.experts, m.topk
    if dense:
        ops = _router(T, h, E, k, e) + _dense_forward(cfg, b, e)
        return _no_tp(ops + _shared_forward(cfg, b, tp, e, sp), tp, sp)
    ops = [*_router(Tn, h, E, k, e),
           # the per-expert row counts (int64), forward only (module docstring)
           ("ep_counts", "all_to_all", COUNT_BYTES * E, "ep"),
           K.permute(Tn, R, h, e),
           ("ep_dispatch", "all_to_all", e * R * h, "ep"),
           ("etp_all_gather", "all_gather", e * M * h, "tp"),
           ("expert_w1", "matmul", 2 * M * h * ft, e * (M * h + El * h * ft + M * ft), 1,
            (El, Me, ft)),
           ("expert_w3", "matmul", 2 * M * h * ft, e * (M * h + El * h * ft + M * ft), 1,
            (El, Me, ft)),
           *K.swiglu(M, ft, e),
           ("expert_w2", "matmul", 2 * M * ft * h, e * (M * ft + El * ft * h + M * h), 1,
            (El, Me, h)),
           ("etp_reduce_scatter", "reduce_scatter", e * M * h, "tp"),
           ("ep_combine", "all_to_all", e * R * h, "ep"),
           K.unpermute(Tn, R, h, e)]
    return _no_tp(ops + _shared_forward(cfg, b, tp, e, sp), tp, sp)


def _shared_forward(cfg, b, tp, e, sp) -> list:
    m, h, T, Tn = moe_of(cfg), cfg.d_model, cfg.seq_len * b, cfg.seq_len * b // mlp_tp(tp, sp)
    ops = []
    if m.shared:
        fs = m.shared * m.d_ff // mlp_tp(tp, sp)
        ops += [("shared_sp_all_gather", "all_gather", e * T * h, "tp"),
                ("shared_w1", "matmul", 2 * T * h * fs, e * (T * h + h * fs + T * fs), 1,
                 (1, T, fs)),
                ("shared_w3", "matmul", 2 * T * h * fs, e * (T * h + h * fs + T * fs), 1,
                 (1, T, fs)),
                *K.swiglu(T, fs, e, "shared"),
                ("shared_w2", "matmul", 2 * T * fs * h, e * (T * fs + fs * h + T * h), 1,
                 (1, T, h)),
                ("shared_tp_out", "reduce_scatter", e * T * h, "tp"),
                ("shared_add", "elementwise", Tn * h, 3 * e * Tn * h, 1)]
    return ops


def backward_ops(cfg, b, tp, ep, e, sp=True, dense=False, main_grad=True) -> list:
    """The MoE MLP's backward kernels and collectives, in execution order: each forward
    GEMM's input and weight gradients (the weight gradient into an fp32 buffer, read and
    written, as ``layer_cost``; ``main_grad=False``: written in the 16-bit dtype, this
    library's recipe, as ``layer_cost(main_grad=False)``; was the fp32 buffer's for it
    too: the experts' backward of a 2-layer Llama at dp 4, ep 4 priced 1.12x the dry
    run's, tests/test_plan12.py), each collective's transpose (all-to-all for
    all-to-all, all-gather for reduce-scatter and back); no count exchange (the
    forward's split sizes are reused).  ``dense``: the model's own dispatch
    (:func:`forward_ops`), whose weight gradients are 16-bit."""
    g = 8 if main_grad else e
    m, h, T, Tn, El, M, R, ft, Me = _dims(cfg, b, tp, ep, e, sp)
    E = m.experts

    def grads(n, M_, K, N, batch, per):       # y[M, N] = x[M, K] @ w[K, N], per-expert rows
        return [(n + "_dgrad", "matmul", 2 * M_ * K * N, e * (M_ * N + batch * K * N + M_ * K),
                 1, (batch, per, K)),
                (n + "_wgrad", "matmul", 2 * M_ * K * N, e * (M_ * N + M_ * K)
                 + g * batch * K * N, 1, (batch, K, N))]

    ops = []
    if m.shared:
        fs = m.shared * m.d_ff // mlp_tp(tp, sp)
        ops += [("shared_sp_grad_all_gather", "all_gather", e * T * h, "tp")]
        ops += grads("shared_w2", T, fs, h, 1, T)
        mul_grad, silu_grad = K.swiglu_grad(T, fs, e, "shared")
        ops += [mul_grad]
        ops += grads("shared_w3", T, h, fs, 1, T)
        ops += [silu_grad]
        ops += grads("shared_w1", T, h, fs, 1, T)
        ops += [("shared_tp_grad", "reduce_scatter", e * T * h, "tp")]
    if dense:
        ops += _dense_backward(cfg, b, e)
        ops += [("router_softmax_grad", "elementwise", 4 * T * E, 12 * T * E, 1)]
        ops += grads("router", T, h, E, 1, T)
        return _no_tp(ops, tp, sp)
    ops += [K.unpermute_grad(Tn, R, h, e),
            ("ep_combine_grad", "all_to_all", e * R * h, "ep"),
            ("etp_reduce_scatter_grad", "all_gather", e * M * h, "tp")]
    ops += grads("expert_w2", M, ft, h, El, Me)
    mul_grad, silu_grad = K.swiglu_grad(M, ft, e)
    ops += [mul_grad]
    ops += grads("expert_w3", M, h, ft, El, Me)
    ops += [silu_grad]
    ops += grads("expert_w1", M, h, ft, El, Me)
    ops += [K.dgrad_add(M, h, e),
            ("etp_all_gather_grad", "reduce_scatter", e * M * h, "tp"),
            ("ep_dispatch_grad", "all_to_all", e * R * h, "ep"),
            K.permute_grad(Tn, R, h, e),
            ("router_softmax_grad", "elementwise", 4 * Tn * E, 12 * Tn * E, 1)]
    ops += grads("router", Tn, h, E, 1, Tn)
    ops += [K.input_grad_add(Tn, h, e)]
    return _no_tp(ops, tp, sp)
