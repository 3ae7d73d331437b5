"""Multi-copy parallelism: two halves of a micro-batch hide each other's communication.

A Megatron tensor-parallel transformer layer (Shoeybi et al. 2019) has two
blocks, attention and FFN, each a column-parallel matmul, local work, and a
row-parallel matmul whose partial sums are all-reduced (Megatron's ``g``)::

    h   = x + all_reduce(attention_partial(x))        # forward: 2 all-reduces
    out = h + all_reduce(ffn_partial(h))              # backward: 2 (Megatron's ``f``)

Every all-reduce blocks the next block.  MindSpore's multi-copy parallel
("fine-grained dual-copy") cuts the micro-batch in two copies A and B that share
the weights: while A's all-reduce runs, B computes, and the other way round::

    compute | A.attn | B.attn | A.ffn  | B.ffn  |
    comm             | A.ar   | B.ar   | A.ar   | B.ar  <- only the last one shows

Backward runs the blocks in reverse; each copy computes its input gradient
(dX), starts that all-reduce, then computes its weight gradients (dW) while it
runs (as Megatron-LM's async tensor-parallel all-reduce does), then the other
copy follows.  Forward can hide at most 3 of 4 all-reduces (the last waits for
the layer's end); backward also hides the last one behind B's attention dW.

Values are exact: each copy is a slice of the batch and every sample's math is
the same, so the output and the input gradient equal the single-copy layer's
bit for bit.  Weight gradients are the sum of the copies' gradients, a
different order of summing the batch than one matmul over it: equal up to
floating-point rounding.

Modeled costs (per rank, per copy; ``cost.compute_time`` of each kernel with its op
class and one launch, summed): matmuls
2mkn FLOPs reading inputs and writing outputs once; attention scores are
computed in full (S x S, masked causally, as written here; a causal
FlashAttention kernel would skip half); softmax and GeLU count their memory
traffic; residual adds are not priced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...sim_mesh import cost as _cost
from ...sim_mesh.collectives import all_reduce, expand_replicas, record_collective
from .overlap import OverlapReport, _quiet, _recording

__all__ = ["LayerParams", "init_layer", "tp_layer", "MultiCopyResult", "multi_copy_layer",
           "multi_copy_estimate"]

BLOCKS = ("attention", "ffn")


@dataclass(frozen=True)
class LayerParams:
    """Stacked local weights of a tensor-parallel layer: leading mesh axes, p at the tp axis."""
    wqkv: torch.Tensor   # (*lead, H, 3H/p)  column-parallel: [q | k | v] of this rank's heads
    wo: torch.Tensor     # (*lead, H/p, H)   row-parallel
    w1: torch.Tensor     # (*lead, H, F/p)   column-parallel
    w2: torch.Tensor     # (*lead, F/p, H)   row-parallel
    heads: int           # attention heads of the whole layer

    NAMES = ("wqkv", "wo", "w1", "w2")

    def weights(self, block: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.wqkv, self.wo) if block == "attention" else (self.w1, self.w2)


def init_layer(hidden: int, heads: int, ffn: int, mesh, axis, *, dtype=torch.float32,
               device="cpu", seed: int = 0) -> LayerParams:
    """Random weights (std 1/sqrt(fan_in)), split over mesh dim ``axis``."""
    ax = mesh.dim(axis)
    p = mesh.shape[ax]
    for name, v in (("heads", heads), ("ffn", ffn)):
        if v % p:
            raise ValueError(f"init_layer: {name}={v} is not divisible by the {p} ranks "
                             f"of mesh dim {mesh.dim_names[ax]!r}")
    if hidden % heads:
        raise ValueError(f"init_layer: hidden={hidden} is not divisible by heads={heads}")
    lead = [1] * mesh.ndim
    lead[ax] = p
    gen = torch.Generator().manual_seed(seed) if device != "meta" else None

    def w(rows, cols):
        if device == "meta":
            return torch.empty(*lead, rows, cols, dtype=dtype, device="meta")
        t = torch.randn(*lead, rows, cols, generator=gen) / math.sqrt(rows)
        return t.to(dtype=dtype, device=device)
    return LayerParams(w(hidden, 3 * hidden // p), w(hidden // p, hidden),
                       w(hidden, ffn // p), w(ffn // p, hidden), heads)


# ---- the per-rank math of a block (partial sums, before the all-reduce) ------------------

def _attention_partial(x, wqkv, wo, heads_local: int):
    """x: (*lead, b, S, H), a copy per rank -> (*lead, b, S, H) partial sums over tp."""
    qkv = x @ wqkv.unsqueeze(-3)                                   # (*lead, b, S, 3 H/p)
    S, d = x.shape[-2], qkv.shape[-1] // 3 // heads_local
    q, k, v = (t.unflatten(-1, (heads_local, d)).transpose(-2, -3)  # (*lead, b, a/p, S, d)
               for t in qkv.chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)                # (*lead, b, a/p, S, S)
    causal = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
    o = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v  # (*lead, b, a/p, S, d)
    return o.transpose(-2, -3).flatten(-2) @ wo.unsqueeze(-3)      # (*lead, b, S, H)


def _ffn_partial(h, w1, w2):
    """h: (*lead, b, S, H), a copy per rank -> (*lead, b, S, H) partial sums over tp."""
    return F.gelu(h @ w1.unsqueeze(-3)) @ w2.unsqueeze(-3)


def _block(name, x, wa, wb, heads_local):
    if name == "attention":
        return _attention_partial(x, wa, wb, heads_local)
    return _ffn_partial(x, wa, wb)


def tp_layer(x, params: LayerParams, mesh, axis):
    """The single-copy reference: Megatron's layer with plain autograd.

    x: (*lead, B, S, H), replicated along ``axis`` (size 1 there).  ``f`` is the
    library's ``expand_replicas`` (identity forward, all-reduce backward), ``g`` its
    ``all_reduce``; both block, and both are traced when a trace is recorded."""
    ax = mesh.dim(axis)
    p = mesh.shape[ax]
    h = x
    for name in BLOCKS:
        partial = _block(name, expand_replicas(h, mesh, [ax]), *params.weights(name),
                         params.heads // p)
        h = h + all_reduce(partial, mesh, ax)
    return h


# ---- modeled costs -----------------------------------------------------------------------

def _mm(m, k, n, e):
    return 2 * m * k * n, (m * k + k * n + m * n) * e, "matmul", (1, m, n)


def _kernels(b, S, H, a, d, Fl, e) -> dict[str, list[tuple[int, int, str]]]:
    """(flops, bytes, op class) of each kernel, per rank and copy; a = local heads,
    Fl = F/p. The attention core runs unfused (as written in ``_attention_partial``):
    two batched GEMMs (class "matmul") around a softmax (class "norm", as the op
    table classes it); GeLU is "elementwise"."""
    T, Hl, SS = b * S, a * d, b * a * S * S
    # the batched GEMMs with their output shapes (batch x heads, rows, columns), as
    # plan.layer_cost prices Megatron's unfused core: scores (S x S; q k^T and, in the
    # backward, dP) or a head's context / gradient (S x d; p v, dV, dQ, dK)
    scores = (2 * SS * d, (2 * T * Hl + SS) * e, "matmul", (b * a, S, S))
    context = (2 * SS * d, (2 * T * Hl + SS) * e, "matmul", (b * a, S, d))
    return {
        "attention": [_mm(T, H, 3 * Hl, e), scores, (5 * SS, 2 * SS * e, "norm"), context,
                      _mm(T, Hl, H, e)],
        "ffn": [_mm(T, H, Fl, e), (8 * T * Fl, 2 * T * Fl * e, "elementwise"), _mm(T, Fl, H, e)],
        "attention dX": [_mm(T, H, Hl, e), scores, context, (5 * SS, 3 * SS * e, "norm"),
                         context, context, _mm(T, 3 * Hl, H, e)],
        "attention dW": [_mm(Hl, T, H, e), _mm(H, T, 3 * Hl, e)],
        "ffn dX": [_mm(T, H, Fl, e), (10 * T * Fl, 3 * T * Fl * e, "elementwise"),
                   _mm(T, Fl, H, e)],
        "ffn dW": [_mm(Fl, T, H, e), _mm(H, T, Fl, e)],
    }


def _compute(tr, mesh, what, kernels, dtype, label):
    """One compute event per block phase: the sum of its kernels, each priced on the
    roofline at its class's efficiency (a GEMM with its shape: tile and wave
    quantization, or the device's measured rate) plus one launch."""
    ks = kernels[what]
    dur = sum(_cost.compute_time(k[0], k[1], tr.profile, dtype, op_class=k[2], launches=1,
                                 gemm=k[3] if len(k) > 3 else None) for k in ks)
    phase = "backward" if what.endswith(("dX", "dW")) else "forward"
    tr.record_compute(mesh.ranks, what, dur, flops=sum(k[0] for k in ks),
                      bytes=sum(k[1] for k in ks), label=label,
                      args={"phase": phase, "kernels": len(ks)})


def _all_reduce_async(tr, mesh, ax, t, label):
    nd = mesh.ndim
    nbytes = math.prod(t.shape[nd:]) * t.element_size()
    return record_collective("all_reduce", mesh, ax, nbytes, label, overlap=True)


# ---- the multi-copy layer ----------------------------------------------------------------

@dataclass(frozen=True)
class MultiCopyResult:
    out: torch.Tensor            # (*lead, B, S, H)
    grad_x: torch.Tensor         # (*lead, B, S, H)
    grads: dict                  # weight name -> stacked local gradient
    forward: OverlapReport
    backward: OverlapReport
    copies: int


def multi_copy_layer(x, params: LayerParams, mesh, axis, *, copies: int = 2, grad_out=None,
                     profile=None) -> MultiCopyResult:
    """Forward and backward of :func:`tp_layer` with the batch cut in ``copies``.

    ``grad_out`` is dL/d(out) (ones when omitted).  The events go to the current
    trace, or to a fresh one on ``profile``; ``copies=1`` is the baseline whose
    forward hides nothing."""
    ax = mesh.dim(axis)
    nd, p = mesh.ndim, mesh.shape[ax]
    if x.dim() != nd + 3 or x.shape[ax] != 1:
        raise ValueError(f"multi_copy_layer: x must be stacked (*lead, B, S, H) with size 1 "
                         f"along mesh dim {mesh.dim_names[ax]!r} (replicated); got "
                         f"{tuple(x.shape)}")
    B, S, H = x.shape[nd:]
    if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= B:
        hint = ("; a micro-batch of 1 sample cannot be cut in copies (attention mixes the "
                "tokens of a sample): use copies=1, a micro-batch >= 2, or hide the "
                "all-reduce by chunking the tokens of the row-parallel matmul "
                "(overlap.matmul_all_reduce(..., chunks=k))") if B == 1 else ""
        raise ValueError(f"multi_copy_layer: copies={copies!r} must be an int in [1, {B}] "
                         f"(each copy needs at least one sample of the micro-batch){hint}")
    grad_out = torch.ones_like(x) if grad_out is None else grad_out
    rep_shape = list(x.shape)
    rep_shape[ax] = p
    a, d = params.heads // p, H // params.heads
    Fl, e = params.w1.shape[-1], x.element_size()
    xs = x.detach().tensor_split(copies, dim=nd)                   # (*lead, b_c, S, H)
    kern = [_kernels(c.shape[nd], S, H, a, d, Fl, e) for c in xs]
    with _recording(profile) as tr:
        # ---- forward: block by block, copy by copy --------------------------------------
        n0, h, pending, saved = len(tr.events), list(xs), [[] for _ in xs], {}
        leaves = {n: [w.detach().requires_grad_() for w in params.weights(n)] for n in BLOCKS}
        for name in BLOCKS:
            wa, wb = leaves[name]
            for c in range(copies):
                for hd in pending[c]:                              # the input must have arrived
                    tr.wait(hd)
                with torch.enable_grad():
                    inp = h[c].expand(rep_shape[:nd] + list(h[c].shape[nd:])).requires_grad_()
                    part = _block(name, inp, wa, wb, a)                 # (*lead, b_c, S, H)
                _compute(tr, mesh, name, kern[c], x.dtype, f"{name} {_copy(c)}")
                pending[c] = _all_reduce_async(tr, mesh, ax, part, f"{name} {_copy(c)}")
                saved[name, c] = inp, part                         # for the backward
                h[c] = h[c] + _quiet(all_reduce, part.detach(), mesh, ax)
        for hs in pending:
            for hd in hs:
                tr.wait(hd)
        n1 = len(tr.events)
        # ---- backward: blocks reversed; per copy dX, start its all-reduce, then dW -------
        g = list(grad_out.tensor_split(copies, dim=nd))
        grads = {}
        pending = [[] for _ in xs]
        for name in reversed(BLOCKS):
            for c in range(copies):
                inp, part = saved[name, c]
                for hd in pending[c]:
                    tr.wait(hd)
                gi, *gw = torch.autograd.grad(part, [inp, *leaves[name]], g[c].expand_as(part))
                _compute(tr, mesh, f"{name} dX", kern[c], x.dtype, f"{name} dX {_copy(c)}")
                pending[c] = _all_reduce_async(tr, mesh, ax, gi, f"{name} dX {_copy(c)}")
                _compute(tr, mesh, f"{name} dW", kern[c], x.dtype, f"{name} dW {_copy(c)}")
                g[c] = g[c] + _quiet(all_reduce, gi, mesh, ax)     # residual + all-reduced dX
                for wname, gv in zip(_names(name), gw):
                    grads[wname] = gv if wname not in grads else grads[wname] + gv
        for hs in pending:
            for hd in hs:
                tr.wait(hd)
        fwd = OverlapReport.from_events(tr.events[n0:n1], "multi-copy forward", copies,
                                        tr.profile.name)
        bwd = OverlapReport.from_events(tr.events[n1:], "multi-copy backward", copies,
                                        tr.profile.name)
    return MultiCopyResult(torch.cat(h, nd), torch.cat(g, nd),
                           {n: grads[n] for n in LayerParams.NAMES}, fwd, bwd, copies)


def _copy(c: int) -> str:
    """Copies are called A, B, C, ... (MindSpore's figures say copy 1, copy 2)."""
    return chr(ord("A") + c) if c < 26 else str(c)


def _names(block):
    return ("wqkv", "wo") if block == "attention" else ("w1", "w2")


def multi_copy_estimate(batch: int, seq: int, hidden: int, heads: int, ffn: int, mesh, axis,
                        *, copies: int = 2, profile=None,
                        dtype=torch.bfloat16) -> MultiCopyResult:
    """:func:`multi_copy_layer` on meta tensors: the modeled timeline of a layer of any
    size, at no cost (the result's tensors hold shapes only)."""
    ax = mesh.dim(axis)
    params = init_layer(hidden, heads, ffn, mesh, ax, dtype=dtype, device="meta")
    x = torch.empty(*[1] * mesh.ndim, batch, seq, hidden, dtype=dtype, device="meta")
    return multi_copy_layer(x, params, mesh, ax, copies=copies, profile=profile)
