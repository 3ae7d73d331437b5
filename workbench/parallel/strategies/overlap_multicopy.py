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

Backward runs the blocks in reverse, copy by copy, each block as Megatron-LM runs
it (``wgrad="per_linear"``, ``overlap_multicopy_kernels``): the row-parallel linear's
input and weight gradients, the core's backward, the column-parallel linear's input
gradient (dX); then that dX's all-reduce starts and the same linear's weight gradient
(dW) runs beside it, as Megatron-LM's async tensor-parallel all-reduce does; the copy's
next block waits for it.  While it runs the other copy computes as well.
``wgrad="block"``: the idealization that defers all of the block's dW beside the
all-reduce (not Megatron-LM's; an upper bound).  Forward can hide at most 3 of 4
all-reduces (the last waits for the layer's end); backward also hides the last one
behind B's dW of wqkv.

Values are exact: each copy is a slice of the batch and every sample's math is
the same, so the output and the input gradient equal the single-copy layer's
bit for bit.  Weight gradients are the sum of the copies' gradients, a
different order of summing the batch than one matmul over it: equal up to
floating-point rounding.

Modeled costs: ``overlap_multicopy_kernels``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...sim_mesh.collectives import all_reduce, expand_replicas, record_collective
from .overlap import OverlapReport, _quiet, _recording
from .overlap_multicopy_kernels import WGRAD, backward_steps, kernels, record_compute

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


# ---- modeled costs (overlap_multicopy_kernels) -----------------------------------------

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
    wgrad: str = "per_linear"    # what the backward all-reduce hides behind (WGRAD)


def multi_copy_layer(x, params: LayerParams, mesh, axis, *, copies: int = 2, grad_out=None,
                     profile=None, wgrad: str = "per_linear") -> MultiCopyResult:
    """Forward and backward of :func:`tp_layer` with the batch cut in ``copies``.

    ``grad_out`` is dL/d(out) (ones when omitted).  The events go to the current
    trace, or to a fresh one on ``profile``; ``copies=1`` is the baseline whose
    forward hides nothing.  ``wgrad``: what each backward all-reduce hides behind,
    "per_linear" (Megatron-LM: the column-parallel linear's own weight gradient) or
    "block" (the idealization: the whole block's; ``overlap_multicopy_kernels``)."""
    if wgrad not in WGRAD:
        raise ValueError(f"multi_copy_layer: wgrad={wgrad!r}: use 'per_linear' (Megatron-LM: "
                         f"the all-reduce beside its own linear's weight gradient) or 'block' "
                         f"(the whole block's weight gradients beside it, an idealization)")
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
    kern = [kernels(c.shape[nd], S, H, a, d, Fl, e) for c in xs]
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
                record_compute(tr, mesh, name, (name,), kern[c], x.dtype,
                               f"{name} {_copy(c)}", "forward")
                pending[c] = _all_reduce_async(tr, mesh, ax, part, f"{name} {_copy(c)}")
                saved[name, c] = inp, part                         # for the backward
                h[c] = h[c] + _quiet(all_reduce, part.detach(), mesh, ax)
        for hs in pending:
            for hd in hs:
                tr.wait(hd)
        n1 = len(tr.events)
        # ---- backward: blocks reversed; per copy the steps up to dX, its all-reduce, dW ---
        g = list(grad_out.tensor_split(copies, dim=nd))
        grads = {}
        pending = [[] for _ in xs]
        for name in reversed(BLOCKS):
            for c in range(copies):
                inp, part = saved[name, c]
                for hd in pending[c]:
                    tr.wait(hd)
                gi, *gw = torch.autograd.grad(part, [inp, *leaves[name]], g[c].expand_as(part))
                before, beside = backward_steps(name, wgrad)
                for step, keys in before:
                    record_compute(tr, mesh, step, keys, kern[c], x.dtype,
                                   f"{step} {_copy(c)}", "backward")
                pending[c] = _all_reduce_async(tr, mesh, ax, gi, f"{name} dX {_copy(c)}")
                for step, keys in beside:
                    record_compute(tr, mesh, step, keys, kern[c], x.dtype,
                                   f"{step} {_copy(c)}", "backward")
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
                           {n: grads[n] for n in LayerParams.NAMES}, fwd, bwd, copies, wgrad)


def _copy(c: int) -> str:
    """Copies are called A, B, C, ... (MindSpore's figures say copy 1, copy 2)."""
    return chr(ord("A") + c) if c < 26 else str(c)


def _names(block):
    return ("wqkv", "wo") if block == "attention" else ("w1", "w2")


def multi_copy_estimate(batch: int, seq: int, hidden: int, heads: int, ffn: int, mesh, axis,
                        *, copies: int = 2, profile=None, dtype=torch.bfloat16,
                        wgrad: str = "per_linear") -> MultiCopyResult:
    """:func:`multi_copy_layer` on meta tensors: the modeled timeline of a layer of any
    size, at no cost (the result's tensors hold shapes only)."""
    ax = mesh.dim(axis)
    params = init_layer(hidden, heads, ffn, mesh, ax, dtype=dtype, device="meta")
    x = torch.empty(*[1] * mesh.ndim, batch, seq, hidden, dtype=dtype, device="meta")
    return multi_copy_layer(x, params, mesh, ax, copies=copies, profile=profile, wgrad=wgrad)
