"""When context parallelism beats sequence parallelism: communication per layer, as data.

Both shard a sequence of S tokens over p ranks. Per transformer layer, forward, with
b sequences, hidden size h, K/V width h_kv = h * n_kv_head / n_head, e bytes per element:

* Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", sec. 4.2.2): tensor parallelism's two
  all-reduces become two all-gathers and two reduce-scatters of the (b, S, h)
  activation; each moves (p-1)/p b S h e bytes per rank, so 4 (p-1)/p b S h e per
  layer, whatever the attention costs. They sit on the critical path (the next GEMM
  needs the gathered input) unless TP communication overlap is configured; here they
  are counted exposed (Megatron-LM's default, ``--tp-comm-overlap`` off).
* Context parallelism, ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with
  Blockwise Transformers", sec. 3): p-1 steps, each sending one K/V block of
  2 b (S/p) h_kv e bytes to the next rank while the rank computes its current block, so
  2 (p-1) b (S/p) h_kv e bytes per rank per layer. A step's block is 4 b (S/p)^2 h FLOPs
  (Q K^T and P V; half of it under the causal mask with load balancing), so the exchange
  hides entirely when the block computes longer than it sends: S/p >= e F h_kv / (2 B h)
  for full attention, twice that for a causal half block (F: attention FLOP/s, B: the
  rate a step's send is priced at, the link's effective bandwidth; Liu et al. 2023 state it as block size >= FLOPS / bandwidth). The exposed
  time is what each step's send takes beyond its block.

Over a training step (forward and backward): SP's backward mirrors its forward (2x), and
all-gathers the two column-parallel inputs again, whose sequence shards the linears kept
for their weight gradients (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
with ``sequence_parallel``; this library's ``ops_table/linear_regather.py``): 2 more
all-gathers, ``regather_bytes_per_rank``;
CP's backward, as PyTorch's ring runs it (torch 2.13, ``_templated_ring_attention_backward``,
and this library's, ``context_parallel_backward.py``), keeps only its own K/V block,
passes the K/V blocks round again (p-1 sends) and sends each block's dK/dV along with it
in float32 (p sends, back to the owner): ``step_bytes_per_rank`` = the forward's
(p-1) blocks + (p-1) blocks + p float32 blocks (4p-2 blocks in 16 bits, 3p-2 in float32),
what the simulator counts; TransformerEngine's ``AttnFuncWithCPAndKVP2P`` is counted as
3x the forward (``step_bytes_per_rank_te``: K/V again and dK/dV in the input dtype, p-1
sends each: NVIDIA/TransformerEngine d0067d0d,
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``:2397-2399,
the backward's p2p buffers in kv's dtype, and :2487-2495, K/V alone at step 0, dK/dV alone
at step p-1, both between, outside fp8). Per layer CP sends
2 (p-1)/p b S h_kv e against SP's 4 (p-1)/p b S h e: never more, and hidden behind
attention once S/p passes the threshold above.

CP's volume grows with S/p and shrinks with GQA (h_kv < h); SP's grows with S. CP also
keeps every weight whole on each rank (it is data parallelism for the weights) where SP
comes with tensor parallelism's weight sharding: the comparison below is of
communication only, and says so.
"""
from __future__ import annotations

from ...sim_mesh import cost as _cost
from ..ops_table.ring_attention import check_ring
from ...sim_mesh.profiles import get_profile

__all__ = ["cp_vs_sp", "cp_vs_sp_sweep"]


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"cp_vs_sp: {name}={v!r}; give an int >= 1")


def cp_vs_sp(S: int, h: int, p: int, profile="a100", *, n_head: int = 32,
             n_kv_head: int | None = None, batch: int = 1, dtype: str = "bfloat16",
             causal: bool = True) -> dict:
    """CP's K/V ring against Megatron SP's all-gathers / reduce-scatters for one layer's
    forward over ranks 0 .. p-1 of ``profile`` (see the module docstring for the formulas).

    Returns plain data: ``{"cp": {...}, "sp": {...}, "winner", "why", "assumed"}``; each side
    has ``bytes_per_rank`` (what one rank sends), ``comm_s`` (modeled seconds of it) and
    ``exposed_s`` (the part not hidden behind compute), ``step_bytes_per_rank`` (forward
    and backward; CP's also as TransformerEngine sends it, ``step_bytes_per_rank_te``);
    CP also ``step_comm_s``, ``step_compute_s`` and
    ``min_tokens_per_rank`` (S/p above which the ring hides, at peak FLOP/s and the
    effective rate the ring's sends are priced at, ``cost.send_link``)."""
    for name, v in (("S", S), ("h", h), ("p", p), ("n_head", n_head), ("batch", batch)):
        _positive(name, v)
    if not isinstance(causal, bool):
        raise TypeError(f"cp_vs_sp: causal={causal!r}; give True or False")
    kv = n_head if n_kv_head is None else n_kv_head
    _positive("n_kv_head", kv)
    if n_head % kv or h % n_head:
        raise ValueError(f"cp_vs_sp: n_head={n_head}, n_kv_head={kv}, h={h}: n_head must "
                         "divide h and n_kv_head divide n_head")
    if S % p:
        raise ValueError(f"cp_vs_sp: S={S} does not divide by p={p}; give a multiple of p")
    if causal:                          # the balanced ring the causal figures assume
        check_ring(S, p, True, f"cp_vs_sp(S={S}, p={p}, causal=True)")
    prof = get_profile(profile)
    e = 2 if dtype in ("bfloat16", "float16", "bf16", "fp16") else 4 if dtype in (
        "float32", "fp32") else None
    if e is None:
        raise ValueError(f"cp_vs_sp: dtype={dtype!r}; use 'bfloat16', 'float16' or 'float32'")
    ranks = tuple(range(p))
    h_kv = h * kv // n_head
    c = S // p                                              # tokens per rank

    # ---- CP: p-1 ring steps, each a K/V block overlapped with one block's attention
    block = 2 * batch * c * h_kv * e                        # K and V of one rank
    step_comm = max(_cost.price("send_recv", block, (i, (i + 1) % p), prof)
                    for i in range(p)) if p > 1 else 0.0    # the slowest link paces the ring
    work = 0.5 if causal else 1.0                           # balanced causal: half a block
    flops = work * 4 * batch * c * c * h
    io = batch * c * (2 * h + 2 * h_kv) * e                 # q, o and the K/V block
    step_compute = _cost.compute_time(flops, io, prof, dtype, "attention")
    exposed_step = max(0.0, step_comm - step_compute)
    attn_fraction = 1.0 / work                              # F / B threshold, in tokens
    peak = prof.peak(dtype)
    # the rate the step's send is priced at (the slowest pair of the ring, as step_comm):
    # the library's effective rate, not the line rate link_for gives (it read 300 GB/s on
    # an A100 node where the sends run at 0.783 of it)
    bw = min(_cost.send_link((i, (i + 1) % p), prof).bandwidth for i in range(p)) \
        if p > 1 else _cost.send_link((0, 1), prof).bandwidth
    min_c = e * peak * h_kv / (2 * bw * h) * attn_fraction
    grad_block = block // e * max(e, 4)                     # dK/dV in float32
    back = (p - 1) * block + p * grad_block if p > 1 else 0
    cp = {"bytes_per_rank": (p - 1) * block, "step_bytes_per_rank": (p - 1) * block + back,
          "step_bytes_per_rank_te": 3 * (p - 1) * block,
          "comm_s": (p - 1) * step_comm,
          "exposed_s": (p - 1) * exposed_step, "step_comm_s": step_comm,
          "step_compute_s": step_compute, "min_tokens_per_rank": min_c}

    # ---- SP: 2 all-gathers + 2 reduce-scatters of the (b, S, h) activation, exposed
    act = batch * S * h * e
    ag = _cost.price("all_gather", act, ranks, prof)
    rs = _cost.price("reduce_scatter", act, ranks, prof)
    sp_bytes = 2 * _cost.wire_bytes("all_gather", act, p) + \
        2 * _cost.wire_bytes("reduce_scatter", act, p)
    regather = 2 * _cost.wire_bytes("all_gather", act, p)   # backward: the kept shards
    sp = {"bytes_per_rank": sp_bytes, "step_bytes_per_rank": 2 * sp_bytes + regather,
          "regather_bytes_per_rank": regather,
          "comm_s": 2 * ag + 2 * rs, "exposed_s": 2 * ag + 2 * rs}

    winner = "cp" if cp["exposed_s"] < sp["exposed_s"] else "sp"
    why = (f"CP sends {cp['bytes_per_rank']:,} B per rank and exposes "
           f"{cp['exposed_s'] * 1e6:.1f} us (each of {p - 1} steps: send "
           f"{step_comm * 1e6:.1f} us beside {step_compute * 1e6:.1f} us of attention; hidden "
           f"once S/p >= {min_c:,.0f} tokens); SP sends {sp_bytes:,} B and exposes "
           f"{sp['exposed_s'] * 1e6:.1f} us")
    return {"S": S, "h": h, "p": p, "profile": prof.name, "cp": cp, "sp": sp,
            "winner": winner, "why": why,
            "assumed": "one layer's forward; communication only (SP also shards the weights "
                       "with TP, CP keeps them whole); SP without TP comm overlap; attention "
                       "priced on the profile's roofline for the attention op class"}


def cp_vs_sp_sweep(seq_lens, h: int, p: int, profile="a100", **kw) -> list[dict]:
    """:func:`cp_vs_sp` for each sequence length: rows for a table or a plot."""
    return [cp_vs_sp(S, h, p, profile, **kw) for S in seq_lens]
