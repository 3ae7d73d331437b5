"""Seconds and FLOPs of the pieces of a GPT training step on one rank.

Per transformer layer and micro-batch of b sequences, on one of t tensor-parallel ranks:

- FLOPs (Narayanan et al. 2021, the derivation of eq. 3): forward 2 b s (4 h^2 + 2 h f)
  for the q, k, v, o and MLP matrices plus 4 b s^2 h for q k^T and softmax(.) v, over t;
  backward twice the forward; full recompute repeats the forward in backward, selective
  recompute the 4 b s^2 h attention core (Korthikanti et al. 2022, sec. 5).  With
  f = 4h, 3 x (24 b s h^2 + 4 b s^2 h) per layer plus 6 b s h V for the head is eq. 7.
  A Llama block (``arch="llama"``, ``plan.llama_layer``): the same count over its own
  matrices, q and o h^2, k and v h kv (kv = key/value heads x head dim, GQA), and
  SwiGLU's three h f: forward 2 b s (2 h^2 + 2 h kv + 3 h f) + 4 b s^2 h (the
  PaLM / Chinchilla convention of 6 N per token plus attention, Chowdhery et al. 2022
  app. B, which Llama 3's MFU figures follow).
- Time: ``workbench.plan.layer_cost.layer_times``, the layer op by op on the profile
  (checked against Korthikanti et al.'s Table 4, not fitted to it).
- Tensor-parallel communication (Shoeybi et al. 2019; Korthikanti et al. 2022 sec. 4.2.2):
  per layer two all-reduces of e s b h bytes (e bytes an element) forward and two
  backward; with sequence parallelism two all-gathers and two reduce-scatters of e s b h
  each way instead, and in backward two more all-gathers that re-gather the
  column-parallel inputs (Megatron-LM; none where PyTorch DTensor keeps the gathered
  input, ``regather=False``); full recompute repeats the forward's in backward.  The
  bytes sent are those of the collectives ``layer_times`` prices.  Priced with
  ``sim_mesh.cost.price`` on the TP group's ranks (consecutive: see ``layout``).  The forward's block the compute
  stream (Megatron-LM issues them synchronously) unless ``tp_comm_overlap``
  (Megatron-LM's ``--tp-comm-overlap``: ``plan.tp_overlap``); in backward the all-reduce
  (SP: reduce-scatter) of a column-parallel linear's input gradient runs beside THAT
  linear's weight-gradient GEMM (Megatron-LM since 16c90445e7, 2021-09:
  ``LinearWithGradAccumulationAndAsyncCommunication``; ``layer_cost``), and SP's
  re-gathering of its input beside its input-gradient GEMM.  A ``LayerCost``'s comm is
  what the collectives leave exposed, op by op, its compute the rest of the layer's time
  (as ``plan.ep_cp`` splits a layer with experts or context parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..sim_mesh.cost import KINDS as _KINDS, compute_time, price, wire_bytes
from ..sim_mesh.grid import gather_sent as _gather_sent
from .layer_cost import layer_times as _layer_times

__all__ = ["LayerCost", "layer_cost", "head_cost", "layer_flops", "model_and_hardware_flops",
           "group_price", "crossing_price", "padded_flat", "LAYER_TIME_SOURCE",
           "LLAMA_LAYER_TIME_SOURCE"]

LAYER_TIME_SOURCE = "layer_cost.layer_times (op by op; checked against Korthikanti Table 4)"
LLAMA_LAYER_TIME_SOURCE = ("layer_cost.layer_times with llama_layer's ops (op by op; held to the "
                           "dry run of the course's Llama)")


@lru_cache(maxsize=None)
def group_price(kind: str, nbytes: float, ranks: tuple, profile) -> float:
    """``price`` of a collective over ``ranks`` (cached: the planner asks it often)."""
    return price(kind, nbytes, list(ranks), profile)


def padded_flat(numel: int, p: int, elem: int, multiple: int | None = None) -> tuple[int, int]:
    """(elements, bytes the busiest rank sends) of the all-gather or reduce-scatter a
    framework runs on a flat buffer of ``numel`` elements over ``p`` ranks: the buffer
    padded to a multiple of ``multiple`` (default ``p``) and cut into p equal pieces, each
    rank sending p-1 of them (``sim_mesh.grid.gather_sent``, the rule the simulator and
    torch.distributed record): the planner's twin of that rule, from sizes.  DeepSpeed
    pads so (v0.3.13, 12a53b4383, ``deepspeed/runtime/zero/partition_parameters.py``
    ``:466-471`` ``_aligned_size`` / ``_padding_size``: a parameter to a multiple of the
    world size; ``:596-634`` ``_allgather_param``: ``torch.zeros(aligned_param_size)``
    gathered as ``world_size`` partitions of ``ds_tensor.numel()``; ``:733-755``
    ``_reduce_scatter_gradient``: ``world_size`` inputs of that size, the last
    zero-padded), as this library's flat ZeRO chunks (``strategies.flat_shards.
    flat_padded``).  A parameter of 10 elements over 4 ranks: 12 elements, 3 x 3 x 2 =
    18 B of 16-bit values, where (p-1)/p of the 20 B buffer, floored, is 15 B."""
    if isinstance(numel, bool) or not isinstance(numel, (int, float)) or numel < 0 or \
            not float(numel).is_integer():
        raise ValueError(f"padded_flat: numel={numel!r} must be a whole number >= 0 "
                         "(elements)")
    numel = int(numel)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"padded_flat: p={p!r} must be the number of ranks, an int >= 1")
    m = p if multiple is None else multiple
    if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m % p:
        raise ValueError(f"padded_flat: multiple={multiple!r} must be a positive multiple of "
                         f"p={p} (the padded buffer is cut into p equal pieces)")
    padded = -(-numel // m) * m
    return padded, _gather_sent([padded // p] * p, elem)


def crossing_price(nbytes, pairs, profile) -> float:
    """Seconds of a pipeline stage crossing whose ``pairs`` of ranks (``Layout.
    crossing_pairs``: every TP, CP and DP rank to its peer) all send at once, ``nbytes``
    each (a tuple: sends one after the other): the slowest pair's, as the dry run's trace
    times them (``schedules.execute._send``: each pair on its own link; was one pair,
    t = d = c = 0, for all, an intra-node pair for a stage that straddles two nodes).
    ``price`` of a send reads only whether its two ranks share a node
    (``topology.group_of``), so one pair of each kind is priced."""
    per_node = profile.devices_per_node
    kinds = {}
    for a, b in pairs:
        kinds.setdefault(a // per_node == b // per_node, (a, b))
    sizes = nbytes if isinstance(nbytes, tuple) else (nbytes,)
    return max((sum(group_price("send_recv", n, pair, profile) for n in sizes)
                for pair in kinds.values()), default=0.0)


def layer_flops(cfg, b: int) -> tuple[float, float]:
    """(matrix FLOPs, attention-core FLOPs) of one layer's forward for b sequences."""
    s, h, f = cfg.seq_len, cfg.d_model, cfg.d_ff
    if getattr(cfg, "moe_experts", 0):            # the active experts (plan.moe_cost)
        from .moe_cost import layer_flops as moe_flops
        return moe_flops(cfg, b)
    if cfg.arch == "llama":
        kv = cfg.n_kv_head * cfg.head_dim
        return 2 * b * s * (2 * h * h + 2 * h * kv + 3 * h * f), 4 * b * s * s * h
    return 2 * b * s * (4 * h * h + 2 * h * f), 4 * b * s * s * h


def model_and_hardware_flops(cfg, batch: int, recompute: str) -> tuple[float, float]:
    """Model FLOPs of one step of ``batch`` sequences (eq. 7 generalised to d_ff = f; no
    recompute) and hardware FLOPs (with the recomputed forward, for HFU).

    The attention core counts the whole s x s product, 4 b s^2 h forward, for the GPT and
    the Llama alike, although a causal kernel computes half of it: the convention of the
    published figures this planner is held to (Narayanan et al. 2021 eq. 3; Korthikanti
    et al. 2022 eq. 7; Megatron-LM's ``num_floating_point_operations`` behind its 2024
    H100 table, ``megatron/training/training.py`` at f2e5db402c: ``seq_length /
    hidden_size``; PaLM's 6N + 12 L H Q T, Chowdhery et al. 2022 App. B).  Megatron-LM
    counts half since commit 8873b55d6a (2025-03-06, "Only half of the attention matrix
    is non-zero"): ``Estimate.details["mfu_causal"]`` gives the MFU so counted."""
    mat, core = layer_flops(cfg, batch)
    head = 2 * batch * cfg.seq_len * cfg.d_model * cfg.vocab_size
    model = 3 * (cfg.n_layer * (mat + core) + head)
    if recompute == "op":     # torchtitan's op SAC re-runs k, o and w3 (plan.llama_layer)
        from .llama_layer import op_sac_recomputed_flops
        extra = op_sac_recomputed_flops(cfg, batch)
    else:
        extra = {"none": 0.0, "selective": core, "full": mat + core}[recompute]
    return model, model + cfg.n_layer * extra


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch, one TP rank: seconds and bytes sent."""
    fwd_compute: float          # the compute stream's seconds (GEMMs stretched beside
    fwd_comm: float             # a collective included); comm: what the collectives
    bwd_compute: float          # leave on the critical path (exposed); backward: with
    bwd_comm: float             # its recompute
    comm_bytes: float           # bytes this rank sends, forward + backward

    @property
    def total(self) -> float:
        return self.fwd_compute + self.fwd_comm + self.bwd_compute + self.bwd_comm


@lru_cache(maxsize=None)
def layer_cost(cfg, b: int, tp: int, sp: bool, recompute: str, profile,
               attention: str = "materialized", fp8: bool = False,
               tp_comm_overlap: bool = False, async_allreduce: bool = True,
               main_grad: bool = True, early_stop: bool = False,
               split_qkv: bool = False, regather: bool = True,
               transformer_engine: bool = False) -> LayerCost:
    """Cost of one transformer layer for one micro-batch (module docstring);
    ``attention="flash"`` prices a fused attention kernel (``layer_cost``); ``fp8`` the
    linears' GEMMs in FP8 (``plan.fp8``); ``tp_comm_overlap``: the TP collectives
    overlapped as Megatron-LM's ``--tp-comm-overlap`` (``plan.tp_overlap``); the
    communication is the collectives' exposed seconds; ``async_allreduce=False``: the
    backward input-gradient all-reduces on the critical path, as Megatron-LM of 2021 and
    Megatron-DeepSpeed run them (``layer_cost``, ``plan.megatron_2021``);
    ``main_grad=False``: weight gradients written in 16 bits; ``early_stop``: a Llama
    block's full recompute as PyTorch's non-reentrant checkpoint stops it
    (``layer_cost``); ``split_qkv``: a GPT layer's query, key and value projections as
    three GEMMs, as this library's GPT runs them (``layer_cost._forward``);
    ``regather=False``: with ``sp``, no backward all-gather of the column-parallel inputs
    (PyTorch DTensor keeps the gathered input: torchtitan, ``llama_layer.backward_ops``);
    ``transformer_engine``: Megatron-LM's Transformer Engine spec
    (``layer_cost.TE_SOURCES``)."""
    s, h = cfg.seq_len, cfg.d_model
    extra = {} if attention == "materialized" else {"attention": attention}
    if fp8:
        extra["fp8"] = True
    if cfg.arch == "llama":
        extra["kv_heads"] = cfg.n_kv_head
    extra["dropout"] = cfg.dropout > 0          # a GPT layer at p = 0: no dropout kernels
    if tp_comm_overlap:
        extra["tp_comm_overlap"] = True
    if not async_allreduce:
        extra["async_allreduce"] = False
    if not main_grad:
        extra["main_grad"] = False
    if early_stop:
        extra["early_stop"] = True
    if split_qkv and cfg.arch == "gpt":
        extra["split_qkv"] = True
    if not regather:
        extra["regather"] = False
    if transformer_engine:
        extra["transformer_engine"] = True
    lt = _layer_times(h, cfg.n_head, s, b, tp, sp=sp, recompute=recompute, ffn=cfg.d_ff,
                      dtype=cfg.dtype, profile=profile, tp_ranks=list(range(tp)), **extra)
    # bytes sent: every collective the layer runs, where it runs (forward, recompute,
    # backward), in the activations' dtype: with sp and ``regather`` the backward's two
    # all-gathers of the column-parallel inputs too (Megatron-LM, the course's recipe:
    # ``parallel.ops_table.linear_regather``), and an early-stopped recompute without
    # its closing all-reduce (``llama_layer.full_recompute``)
    sent = sum(wire_bytes(o["op_class"], int(o["bytes"]), tp) for o in lt.ops
               if o["op_class"] in _KINDS)
    # what the collectives leave exposed, forward and after (module docstring): the
    # backward's input-gradient collectives hidden beside their linear's weight gradient
    # (all of it on the critical path with async_allreduce=False), the recompute's as run
    comm_f, comm_b = (sum(o["exposed"] for o in lt.ops if o["op_class"] in _KINDS
                          and (o["phase"] == "forward") == fwd) for fwd in (True, False))
    return LayerCost(max(lt.forward - comm_f, 0.0), min(comm_f, lt.forward),
                     max(lt.backward - comm_b, 0.0), min(comm_b, lt.backward), sent)


@lru_cache(maxsize=None)
def head_cost(cfg, b: int, tp: int, sp: bool, profile) -> LayerCost:
    """The lm head and loss for one micro-batch on the last stage, with the first
    stage's embedding collective folded in by the caller.  Head: 2 b s h V / t FLOPs
    forward, twice that backward (vocabulary-parallel, Megatron), priced as matmuls
    (op class "matmul", ``cost.compute_time``'s tile and wave quantization); the loss
    kernels are the edge costs' (``edge_cost.py``); communication: the
    head input's all-reduce in backward (with sequence parallelism: all-gather forward,
    and in backward the re-gather of the kept sequence shard for the weight gradient,
    issued beside the input-gradient GEMM, and the input gradient's reduce-scatter:
    Megatron-LM's output layer is a ``ColumnParallelLinear`` (megatron/core/models/gpt/
    gpt_model.py) whose ``LinearWithGradAccumulationAndAsyncCommunication`` saves the
    shard under ``sequence_parallel`` and all-gathers it again asynchronously before the
    dgrad GEMM, as ``parallel/ops_table/linear_regather.py`` reads it; only the part of
    that gather longer than the dgrad GEMM is exposed) and vocab-parallel
    cross-entropy's three all-reduces of s b fp32 values (max, sum of exp, target logit;
    Megatron's ``vocab_parallel_cross_entropy``)."""
    s, h, V = cfg.seq_len, cfg.d_model, cfg.vocab_size
    T, Vt = s * b, V // tp
    flops = 2 * T * h * Vt
    e = cfg.torch_dtype.itemsize                               # bytes per element
    # GEMMs priced as the layer's are (op class "matmul", tile and wave quantization):
    # logits [T, V/t] = x [T, h] @ w^T; backward dx [T, h] = dlogits @ w, dw [V/t, h]
    fwd = compute_time(flops, e * (T * h + Vt * h + T * Vt), profile, cfg.dtype, "matmul",
                       gemm=(1, T, Vt))
    dgrad = compute_time(flops, e * (T * Vt + Vt * h + T * h), profile, cfg.dtype, "matmul",
                         gemm=(1, T, h))
    bwd = dgrad + \
        compute_time(flops, e * (T * Vt + T * h + Vt * h), profile, cfg.dtype, "matmul",
                     gemm=(1, Vt, h))
    ranks, n = tuple(range(tp)), e * s * b * h      # the head's input, in the model's dtype
    ce = 3 * group_price("all_reduce", 4 * s * b, ranks, profile)
    ce_sent = 3 * (wire_bytes("all_reduce", 4 * s * b, tp) if tp > 1 else 0)
    if tp == 1:
        return LayerCost(fwd, 0.0, bwd, 0.0, 0.0)
    if sp:
        f_c = group_price("all_gather", n, ranks, profile)
        b_c = group_price("reduce_scatter", n, ranks, profile) + max(0.0, f_c - dgrad)
        sent = 2 * wire_bytes("all_gather", n, tp) + wire_bytes("reduce_scatter", n, tp)
    else:
        f_c, b_c = 0.0, group_price("all_reduce", n, ranks, profile)
        sent = wire_bytes("all_reduce", n, tp)
    return LayerCost(fwd, f_c + ce, bwd, b_c, sent + ce_sent)


def embedding_comm(cfg, b: int, tp: int, sp: bool, profile) -> tuple[float, float]:
    """(seconds, bytes sent) of the vocabulary-parallel embedding's forward collective:
    an all-reduce of its e s b h output, e bytes an element of the model's dtype (a
    reduce-scatter with sequence parallelism)."""
    if tp == 1:
        return 0.0, 0.0
    kind = "reduce_scatter" if sp else "all_reduce"
    n = cfg.torch_dtype.itemsize * cfg.seq_len * b * cfg.d_model
    return group_price(kind, n, tuple(range(tp)), profile), wire_bytes(kind, n, tp)
