"""Context parallelism for the planner: ring attention's time, and what a rank holds.

With ``cp`` context-parallel ranks the sequence of s tokens is split in 2 cp chunks and
rank i holds chunks i and 2 cp - 1 - i (the causal load balancing of Megatron-Core's
context parallelism, ``megatron/core/transformer/dot_product_attention`` with Transformer
Engine's ``attn_forward_func_with_cp``, NVIDIA/TransformerEngine d0067d0d
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``:4924;
Brandon et al. 2023 show the imbalance it removes): s_l = s / cp tokens per rank.
Everything but attention is token-wise, so on a rank it is the model at sequence s_l: its
GEMMs, norms, collectives and activations (``token_cfg``; K and V of the other ranks are
not kept: backward sends them round again).  Attention is ring attention (Liu et al.
2023, "Ring Attention with Blockwise Transformers"): in cp steps each rank attends its
queries to one K/V block while it passes that block to its neighbour and receives the
next, and merges the partial outputs by their log-sum-exp
(``flash_attention(return_lse=True)``):

- step 0, its own block: causal, s_l (s_l + 1) / 2 query-key pairs per head (the fused
  kernel at s_l, already in the layer's ops);
- steps 1 .. cp-1: thanks to the balancing every step computes half a block,
  s_l^2 / 2 pairs (the chunk pairs below the diagonal: Megatron-Core's halves of
  q or of k/v), while K and V of one block, 2 b s_l (g / t) d e bytes, cross one hop;
  each step takes about max(compute of the half block + its merge, transfer): the
  transfer is double-buffered behind the compute (Liu et al. 2023 sec. 3); exactly, the
  block runs beside the copy on the SMs the copy leaves it (``cost.overlap``: NCCL's
  kernel holds some), so it is stretched, and whatever of the transfer outlasts it shows;
- backward, as PyTorch's ring runs it (torch 2.13, ``_templated_ring_attention_backward``;
  ``strategies.context_parallel_backward``): the rank keeps only q, k, v, o and the lse,
  so the K/V blocks go round again (cp - 1 hops), and each step's half block backward
  (Dao 2023, 2.5x the forward's FLOPs, against the merged o and lse) adds its dK/dV to
  the float32 dK/dV that arrived with the block and sends them on (cp hops of
  2 b s_l (g / t) d x 4 bytes: twice a 16-bit K/V block); the ring's one stream runs
  the previous step's dK/dV and this step's K/V beside each block, the last step's
  dK/dV alone, and the owner waits for its own block's dK/dV at the end (exposed);
  every step adds dQ, dK, dV into float32 accumulators (read two, write one).

So ring attention costs about (cp - 1) max(t_half, t_kv) beyond one causal block forward;
the exchange is hidden when t_half >= t_kv: attention grows as s_l^2 and the transfer
as s_l, so a long enough block always hides it.  The gradients of the weights, which
every cp rank holds whole, are reduced over the dp x cp ranks (``Layout.grad_ranks``),
and the optimizer states shard over them (Megatron-LM's distributed optimizer).
The ring's clock here is the one ``strategies.context_parallel`` runs on (tests/
test_plan_cp.py holds the half block and the hop to its trace, tests/test_ringbwd.py the
backward's blocks, accumulations and K/V and dK/dV hops).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..sim_mesh import cost as _cost
from ..sim_mesh.cost import wire_bytes
from . import costs as C

__all__ = ["token_cfg", "ring_ranks", "kv_block_bytes", "RingTimes", "ring_times",
           "check_cp", "A2ATimes", "a2a_times", "check_cp_comm", "a2a_saved_bytes"]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def token_cfg(cfg, cp: int):
    """The model as one of ``cp`` context-parallel ranks sees it: sequence s / cp."""
    return cfg if cp == 1 else cfg.replace(seq_len=cfg.seq_len // cp)


def check_cp(cfg, cp: int, attention: "str | None" = None, cp_comm: str = "p2p") -> None:
    """Raise ValueError naming the fix when ``cp`` cannot split ``cfg``'s sequence, or when
    ``attention`` is not the fused kernel that ``cp_comm``'s attention runs on."""
    if cp == 1:
        return
    if cfg.seq_len % (2 * cp):
        good = [c for c in range(1, 65) if cfg.seq_len % (2 * c) == 0 and c > 1][:8]
        raise ValueError(f"Layout: cp={cp} does not divide the sequence: seq_len="
                         f"{cfg.seq_len} must split in 2 x cp = {2 * cp} equal chunks (rank "
                         f"i holds chunks i and 2cp-1-i, the causal load balancing); use "
                         + (f"a cp in {good}" if good else
                            f"cp=1 (no cp > 1 splits an odd seq_len)")
                         + f" or a seq_len divisible by {2 * cp}")
    if attention is not None and attention != "flash":
        if cp_comm == "a2a":
            # Ulysses itself takes any attention (Jacobs et al. 2023 sec. 3), but what runs it
            # is fused: ulysses_attention calls ops.flash_attention, and Transformer Engine
            # disables its unfused attention under context parallelism (NVIDIA/
            # TransformerEngine d0067d0d, transformer_engine/pytorch/attention/
            # dot_product_attention/utils.py:1169-1173)
            raise ValueError(f"cp={cp} with cp_comm='a2a' runs all-to-all (DeepSpeed-Ulysses) "
                             f"attention, whose kernel over the rank's heads is the fused one "
                             f"(this library's ulysses_attention, Transformer Engine's "
                             f"context parallelism); attention={attention!r} materializes the "
                             f"scores: give attention='flash'")
        raise ValueError(f"cp={cp} with cp_comm={cp_comm!r} runs ring attention, which merges "
                         f"partial outputs by the fused kernel's log-sum-exp; attention="
                         f"{attention!r} materializes the scores: give attention='flash'")


def ring_ranks(lay, s: int = 0) -> tuple:
    """The cp ranks of one ring (TP rank 0, DP rank 0, stage ``s``)."""
    return tuple(lay.rank(0, 0, s, c) for c in range(lay.cp))


def kv_block_bytes(cfg, lay) -> int:
    """Bytes of K and V of one rank's block: 2 b s_l (g / t) d e."""
    e = _ITEMSIZE[cfg.dtype]
    s_l = cfg.seq_len // lay.cp
    return 2 * lay.micro_batch * s_l * (cfg.n_kv_head // lay.tp) * cfg.head_dim * e


@dataclass(frozen=True)
class RingTimes:
    """Ring attention beyond the causal block of step 0, per layer and micro-batch."""
    steps: int                  # cp - 1
    half_forward: float         # one half block's forward + merge (s)
    half_backward: float        # its backward + the dQ/dK/dV accumulation (s)
    hop: float                  # one K/V block over the slowest hop of the ring (s)
    forward: float              # steps x the pair's time (module docstring)
    backward: float             # the backward ring (module docstring), step 0's block aside
    forward_exposed_comm: float  # the part of ``forward`` the transfer adds
    backward_exposed_comm: float
    sent_forward: float         # bytes a rank sends per forward
    sent_backward: float
    pairs: float                # query-key pairs of one half block (all heads of the rank)
    merge: float                # of ``half_forward``: merging the step's output by its lse
    hop_grad: float = 0.0       # one float32 dK/dV block over the slowest hop (s)
    accumulate: float = 0.0     # of ``half_backward``: adding a step's dQ, dK, dV in fp32
    casts: float = 0.0          # of ``forward``: step 0's output cast to float32 and the
    #                             merged output's cast back (this library's ring, _merge_ops)


def _merge_ops(b: int, ah: int, s_l: int, d: int, e: int, prof, dtype) -> tuple:
    """(the merge of one step, step 0's cast and the final cast) as this library's ring
    runs them, op by op (``parallel/strategies/context_parallel.py`` ``_ring_forward``:
    each step's output cast to float32, ``o_t.to(acc)``; from step 1 the running output
    merged by fifteen ops, ``maximum``, ``lse - m``, ``exp``, ``lse_t - m``, ``exp``,
    ``+``, ``log``, ``m +``, ``lse - new``, ``exp``, ``out *``, ``lse_t - new``, ``exp``,
    ``o_t *``, ``+``; the merged output cast back to the inputs' dtype at the end), each
    priced as the op table prices an element-wise op (``ops_table/costs.py``: one FLOP an
    output element, each input read and the output written, float32 lses and running
    output) with its own launch, as the clock runs them; Megatron-LM's Transformer
    Engine merges in one fused kernel (``ring_times``' ``merge`` otherwise)."""
    L, nq = 4 * b * ah * s_l, 4 * b * ah * s_l * d      # float32 bytes: an lse, an output

    def op(flops, nbytes):
        return _cost.compute_time(flops, nbytes, prof, "float32", "elementwise")
    lse_ops = [op(L // 4, 3 * L)] * 7 + [op(L // 4, 2 * L)] * 5   # binary: 3 L, unary: 2 L
    out_ops = [op(nq // 4, 2 * nq + L)] * 2 + [op(nq // 4, 3 * nq)]  # the two *, the +
    cast = op(nq // 4, nq + nq // 4 * e)
    return sum(lse_ops) + sum(out_ops) + cast, 2 * cast


@lru_cache(maxsize=None)
def ring_times(cfg, lay, prof) -> RingTimes:
    """Ring attention of one layer on one rank (module docstring), priced on ``prof``:
    the half block as ``wb.ops.cost`` prices the fused kernel (4 pairs d FLOPs forward,
    10 pairs d backward, Dao 2023), the hop as a send/recv between ring neighbours on the
    topology (the slowest hop when the ring spans nodes)."""
    e = _ITEMSIZE[cfg.dtype]
    b, tp, cp = lay.micro_batch, lay.tp, lay.cp
    s_l, d = cfg.seq_len // cp, cfg.head_dim
    ah, gh = cfg.n_head // tp, cfg.n_kv_head // tp
    pairs = b * ah * s_l * s_l / 2
    nq, nk, lse = b * ah * s_l * d, b * gh * s_l * d, 4 * b * ah * s_l
    # a half block attends every pair of its two chunks (no mask inside): the fused
    # kernel's full-attention rate at the rank's s_l tokens, where the profile measured it
    shape = (b * ah, s_l, d)
    fwd = _cost.compute_time(4 * pairs * d, e * (2 * nq + 2 * nk) + lse, prof, cfg.dtype,
                             "attention", gemm=_cost.AttentionShape(*shape, False, False))
    # merging the step's output into the running one by their log-sum-exps: read both
    # outputs and lses, write the output and lse (fp32 lses)
    merge = _cost.compute_time(6 * nq, 3 * e * nq + 3 * lse, prof, cfg.dtype, "elementwise")
    casts = 0.0
    if getattr(lay, "framework", None) == "workbench":    # op by op (_merge_ops)
        merge, casts = _merge_ops(b, ah, s_l, d, e, prof, cfg.dtype)
    bwd = _cost.compute_time(10 * pairs * d, e * (4 * nq + 4 * nk) + lse, prof, cfg.dtype,
                             "attention", gemm=_cost.AttentionShape(*shape, False, True))
    # a step's dQ, dK, dV added into float32 accumulators: read two, write one
    a = max(e, 4)                                   # float32 (float64 for float64)
    acc = _cost.compute_time(nq + 2 * nk, 3 * a * (nq + 2 * nk), prof, cfg.dtype, "elementwise")
    ranks = ring_ranks(lay)
    n = kv_block_bytes(cfg, lay)
    ng = n // e * a                                 # the dK/dV block in float32

    def slowest(nbytes):
        return max(C.group_price("send_recv", nbytes, (ranks[i], ranks[(i + 1) % cp]), prof)
                   for i in range(cp))
    hop, hop_g = slowest(n), slowest(ng)
    k = cp - 1
    hf, hb = fwd + merge, bwd + acc
    # the block beside its transfer: stretched by the SMs the copy leaves it, the transfer's
    # rest exposed (cost.overlap, as the clock runs a kernel beside a collective), the
    # copy holding the SMs of a collective over the ring's ranks (the clock records each
    # step's sends as one send_recv over the cp group, ``context_parallel_comm._record``;
    # ASSUMPTION: NCCL's p2p channels for a ring step are as many as its collective
    # channels for that group, no log of them found)
    f_run, f_out = _cost.overlap(fwd, hop, prof, ranks=ranks)
    # backward: steps 1 .. k-1 beside the previous dK/dV and this step's K/V, step k beside
    # the last dK/dV but one; the owner then waits for its own block's dK/dV
    b_run, b_out = _cost.overlap(bwd, hop_g + hop, prof, ranks=ranks)
    l_run, l_out = _cost.overlap(bwd, hop_g, prof, ranks=ranks)
    if k:
        b_exposed = (k - 1) * b_out + l_out + hop_g
        backward = (k - 1) * (b_run + acc + b_out) + (l_run + acc + l_out) + acc + hop_g
    else:                                           # one rank: no ring
        b_exposed = backward = 0.0
    forward, f_exposed = k * (f_run + merge + f_out) + bool(k) * casts, k * f_out
    if k and getattr(lay, "framework", None) == "workbench":
        # this library's ring as the clock runs it (``strategies.context_parallel.
        # _ring_forward``, the order ``ep_cp.ring_program`` plays): each step but the last
        # sends the next K/V block beside its kernel AND what follows it on the stream,
        # step 0 its local kernel (priced by the layer's flash_attention op; the same
        # pairs as a half block, so priced as one here) and its cast, later steps their
        # merge (fifteen ops, _merge_ops); the last step alone; the merged output cast
        # back.  Before, each hop was set beside the half block only, the merge after it:
        # GPT 2 layers at cp 4 (256 tokens a rank), 14.0 us of hops exposed per layer
        # forward where the dry run's trace shows ~2 us (dry run / estimate 0.972)
        c0 = casts / 2
        run0, out0 = _cost.overlap(fwd + c0, hop, prof, ranks=ranks)
        run, out = _cost.overlap(fwd + merge, hop, prof, ranks=ranks)
        forward = (run0 - fwd) + out0 + (k - 1) * (run + out) + fwd + merge + c0
        f_exposed = out0 + (k - 1) * out
        # backward (``context_parallel_backward`` as the clock runs it; the dry run's
        # trace, Llama dp 2 cp 4: per step the kernel beside the previous step's dK/dV,
        # then the wait for it, then the accumulation beside the next K/V block's send,
        # issued only then; step 0's kernel (the layer's flash_attention_grad, the same
        # pairs as a half block, priced as one here) beside the first K/V send and its
        # accumulation alone; the last step's accumulation alone, then its own dK/dV
        # awaited).  Was the Megatron order (each kernel beside both transfers, the
        # accumulation after): 15.0 us of hops exposed per layer backward where the trace
        # shows ~7 (dry run / estimate 0.975 at dp 2 cp 4)
        r0, o0 = _cost.overlap(bwd, hop, prof, ranks=ranks)
        rg, og = _cost.overlap(bwd, hop_g, prof, ranks=ranks)
        ra, oa = _cost.overlap(acc, hop, prof, ranks=ranks)
        backward = (r0 - bwd) + o0 + acc + (k - 1) * (rg + og + ra + oa) + rg + og + acc \
            + hop_g
        b_exposed = o0 + (k - 1) * (og + oa) + og + hop_g
    return RingTimes(k, hf, hb, hop, forward, backward,
                     f_exposed, b_exposed,
                     k * wire_bytes("send_recv", n, 2),
                     k * wire_bytes("send_recv", n, 2)
                     + bool(k) * cp * wire_bytes("send_recv", ng, 2),
                     pairs, merge, hop_g, acc, bool(k) * casts)


# ---- cp_comm="a2a": DeepSpeed-Ulysses (strategies.context_parallel_a2a) --------------------
#
# Megatron-LM's ``--cp-comm-type a2a`` (megatron/training/arguments.py:3221 at NVIDIA/
# Megatron-LM d98e8a64) runs Transformer Engine's ``AttnFuncWithCPAndQKVOA2A``
# (NVIDIA/TransformerEngine d0067d0d, transformer_engine/pytorch/attention/
# dot_product_attention/context_parallel.py:4170): q, k, v all-to-all'd from s / cp
# tokens of every head to s tokens of (heads / tp) / cp heads (``flash_attn_a2a_communicate``,
# :387; issued back to back and each waited for before the attention kernel, :423-431 and
# :4339 before the kernel at :4400: on the critical path), the attention kernel over the
# whole sequence on the rank's heads, the output all-to-all'd back; backward the same four
# (dO in, dQ, dK, dV out). Each all-to-all is priced as the clock prices one (``cost.price``
# on the cp ranks' links, sim_mesh's NCCL model) on a rank's (b, s / cp, heads / tp, d)
# block; what a rank keeps for backward (q, k, v, o and the lse, head-sharded) has the
# elements of the ring's (b s (H / tp / cp) d = b (s / cp) (H / tp) d) (``token_cfg``),
# plus one output block: the kernel keeps its head-sharded output (``out_part``,
# context_parallel.py:4566-4576 ``save_for_backward``) and the output projection keeps
# the all-to-all'd one, where the ring's output is one tensor kept by both
# (``a2a_saved_bytes``; measured on the dry run: 1.008 blocks per layer more than the
# ring, at cp 2 and cp 4, tests/test_ulysses.py).  With tp the blocks are of the tp rank's
# heads (H / tp, H_kv / tp), the all-to-all on its cp group only (the tp groups side by
# side), as the runtime runs it (``strategies.context_parallel_a2a``: each tp rank's heads
# split further over cp): dry run / estimate step 1.032x at cp 2 tp 2, 1.037x with sp,
# the all-to-all bytes a rank sends equal (tests/test_ulysses4.py).


def check_cp_comm(cfg, lay) -> None:
    """Raise ValueError naming the heads and the fix unless ``lay.cp_comm="a2a"`` can give
    each cp rank whole heads of its tp rank (Transformer Engine: ``num_heads % cp_size``
    for q and k/v, context_parallel.py:4246)."""
    if lay.cp == 1 or lay.cp_comm != "a2a":
        return
    hq, hkv = cfg.n_head // lay.tp, (getattr(cfg, "n_kv_head", None) or cfg.n_head) // lay.tp
    if hq % lay.cp or hkv % lay.cp:
        good = [c for c in range(2, hkv + 1) if hq % c == 0 and hkv % c == 0]
        raise ValueError(f"Layout: cp_comm='a2a' with cp={lay.cp}: each tp rank's heads (query "
                         f"{hq}, key/value {hkv} at tp={lay.tp}) must divide by cp (the "
                         f"all-to-all gives each cp rank whole heads; Transformer Engine's "
                         f"condition); use cp_comm='p2p' (the ring), or a cp in {good or '[]'}")


@dataclass(frozen=True)
class A2ATimes:
    """DeepSpeed-Ulysses' four all-to-alls of one layer and micro-batch on one rank."""
    forward: float              # q, k, v in, the output back (s)
    backward: float             # dO in, dQ, dK, dV back (s)
    sent_forward: float         # bytes a rank sends per forward
    sent_backward: float
    blocks: tuple               # the four blocks' bytes (q, k, v, o) on a rank


@lru_cache(maxsize=None)
def a2a_times(cfg, lay, prof) -> A2ATimes:
    """The all-to-alls of ``cp_comm="a2a"`` (comment above), priced on ``prof`` over the
    cp ranks of one group (stride tp, Megatron-LM's rank order)."""
    e = _ITEMSIZE[cfg.dtype]
    b, tp, cp = lay.micro_batch, lay.tp, lay.cp
    s_l, d = cfg.seq_len // cp, cfg.head_dim
    ah, gh = cfg.n_head // tp, (getattr(cfg, "n_kv_head", None) or cfg.n_head) // tp
    q, kv = b * s_l * ah * d * e, b * s_l * gh * d * e
    blocks = (q, kv, kv, q)
    ranks = ring_ranks(lay)
    t = sum(C.group_price("all_to_all", n, ranks, prof) for n in blocks)
    sent = sum(wire_bytes("all_to_all", n, cp) for n in blocks)
    return A2ATimes(t, t, sent, sent, blocks)


def a2a_saved_bytes(cfg, lay) -> int:
    """Bytes a layer keeps for backward with ``cp_comm="a2a"`` beyond the ring's (comment
    above): the attention output twice, head-sharded and sequence-sharded, one block
    b (s / cp) (H / tp) d e; none where the attention core is recomputed ("selective",
    "full": the kernel's output is not kept), nor with the op-level policy ("op",
    ``models.op_sac``): the kernel's output is saved (the layer's own count) but its
    copy back into ring order is an ``index_select``, no op on the policy's save list,
    re-run in backward (measured: the dry run and a CPU run of the recipe,
    ``ContextParallel(cp=2, cp_comm="a2a")`` on the one-layer "small" Llama, keep
    970,772 B a rank alike, where this counted 768 B a token more: activations 0.931 of
    the estimate; tests/test_plan13.py)."""
    if lay.cp == 1 or lay.cp_comm != "a2a" or lay.recompute in ("selective", "full", "op"):
        return 0
    return lay.micro_batch * (cfg.seq_len // lay.cp) * (cfg.n_head // lay.tp) \
        * cfg.head_dim * _ITEMSIZE[cfg.dtype]


def rope_table_bytes(cfg, lay) -> int:
    """Bytes of the Llama's RoPE tables this library's context-parallel recipe lays out per
    micro-batch (``recipes.context_parallel._ring_positions``: ``to_ring_layout`` of the
    first s rows of cos and sin, an ``index_select``, so a fresh (s / cp, head_dim) pair
    in the model's dtype on every rank, which each block's RoPE product saves, or each
    block's checkpoint keeps as an input); with cp = 1 the tables are the model's
    buffers, sliced (views: resident, not activations).  One pair per micro-batch, shared
    by every layer of the stage.  Measured (tests/test_plan13.py): the dry run of the
    one-layer "small" Llama (head dim 48, bf16) kept 192 B a token more at cp 2 than the
    estimate with every recompute mode (ring and Ulysses), 2 x 48 x 2.  0 for a GPT
    (learned positions, counted as the ids), cp = 1, and other frameworks (Megatron-LM
    computes the rotary embedding from position ids in its kernel; torchtitan shards its
    ``freqs_cis`` buffer in place)."""
    if lay.cp == 1 or cfg.arch != "llama" or lay.engine != "workbench":
        return 0
    return 2 * (cfg.seq_len // lay.cp) * cfg.head_dim * _ITEMSIZE[cfg.dtype]


def ring_op_saved_bytes(cfg, lay) -> int:
    """Bytes a layer keeps for backward on the busiest rank beyond the layer's own count
    (``llama_layer.activation_bytes`` at s / cp tokens: the attention kernel's output and
    log-sum-exp for the rank's s / cp queries) with this library's ring under the
    op-level policy (``recompute="op"``, ``models.op_sac``): the policy saves every ring
    step's kernel outputs (each block's output, b (H / tp) (s / 2cp) d e, and fp32
    log-sum-exp), and re-runs the merges, so the merged output and log-sum-exp are not
    kept.  Rank i of the causal load-balanced ring (``strategies.context_parallel``:
    chunks i and 2 cp - 1 - i) computes cp + 1 + i blocks of s / (2 cp) query rows
    (``ops_table.ring_attention._slot_block``: two on the diagonal step; at step t, two
    where the K/V came from a rank j < i, one where j > i): the last rank 2 cp of them,
    s rows, the whole sequence's worth, where the layer's count has s / cp.  Measured
    (tests/test_plan13.py): a CPU run of the recipe and its dry run keep 1,073,172 B on
    the busiest rank of the one-layer "small" Llama at cp 2 (the estimate: 969,216 B,
    0.896 of the dry run, before this).  0 elsewhere (Ulysses keeps one kernel's output,
    ``a2a_saved_bytes``; other recompute modes keep the merged output or re-run the
    steps; other frameworks' rings are not this evidence)."""
    if lay.cp == 1 or lay.cp_comm != "p2p" or lay.recompute != "op" \
            or lay.engine != "workbench" or cfg.arch != "llama":
        return 0
    rows = lay.micro_batch * (cfg.seq_len - cfg.seq_len // lay.cp)
    return rows * (cfg.n_head // lay.tp) * (cfg.head_dim * _ITEMSIZE[cfg.dtype] + 4)
