"""Expert parallelism on the modeled clock: one MoE layer's exchanges and expert GEMMs,
chunked and overlapped (the CANN article's fused all-to-all with expert compute;
DeepSpeed-TED, Singh et al. 2023; Tutel, Hwang et al. 2023).

``record_layer`` puts one layer on a trace, per ep group: the count exchange (forward
only), each rank's permutation, then the dispatch all-to-all, each rank's expert GEMMs and
their SwiGLU (per rank: a rank that receives more tokens is the straggler the combine waits
for), the combine all-to-all, each rank's un-permutation; the kernels around the GEMMs are
the planner's (:mod:`.expert_parallel_kernels`, listed by ``plan.moe_cost``).  With ``chunks``
n > 1 the exchange runs in n pieces as a two-stage pipeline: the dispatch of piece c+1
and the combine of piece c-1 on the comm stream while the experts compute piece c.
``exchange_report`` records one layer from a matrix of token counts into a fresh trace
and returns its :class:`~.overlap.OverlapReport` (``wb.viz`` draws it).
"""
from __future__ import annotations

import torch

from ...sim_mesh import collectives as C
from ...sim_mesh import cost as _cost
from ...sim_mesh.backward_pass import in_weight_pass
from ...sim_mesh.trace import current_trace
from . import expert_parallel_kernels as K

__all__ = ["record_layer", "exchange_report"]


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, y):
        ctx.fn = fn
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        if current_trace() is not None and not (getattr(ctx, "recorded", False)
                                                and in_weight_pass()):   # (W: B's, again)
            ctx.recorded = True
            ctx.fn()
        return None, g


def _experts_time(flops, nbytes, rows, per_expert, w_bytes, row_bytes, dtype, gemms, mult,
                  profile) -> float:
    """A rank's expert GEMMs on one piece: ``gemms`` x ``mult`` (forward 1, backward 2)
    products per local expert, each of its share of the ``rows`` tokens (spread evenly
    over the local experts) by one weight matrix of h x ffn, equal in FLOPs, each priced
    with its own output shape (``cost.compute_time``'s ``gemm``: tile and wave
    quantization, or a device's measured rate for that product): forward the up (and
    gate) projections [per, ffn] and the down projection [per, h]; backward each
    matrix's input gradient and weight gradient (up: [per, h] and [h, ffn]; down:
    [per, ffn] and [ffn, h]); ``gemms`` launches in all as before."""
    item = torch.empty((), dtype=dtype).element_size()
    h = max(1, row_bytes // item)
    local = max(1, w_bytes // max(1, per_expert * item))          # experts on this rank
    ffn = max(1, per_expert // (gemms * h))
    per = max(1, -(-rows // local))                                # tokens per expert
    up = gemms - 1                                                 # up (and gate) matrices
    if mult == 1:
        shapes = [(1, per, ffn)] * up + [(1, per, h)]
    else:
        shapes = [(1, per, h), (1, h, ffn)] * up + [(1, per, ffn), (1, ffn, h)]
    k = len(shapes) * local                                        # products in all
    one = sum(_cost.compute_time(flops / k, nbytes / k, profile, dtype, op_class="matmul",
                                 launches=0, gemm=shape) for shape in shapes)
    # one launch per kernel: forward ``gemms``, backward each matrix's input-gradient and
    # weight-gradient GEMM, 2 x ``gemms`` (the planner's ``moe_cost.backward_ops``, one
    # launch each; was ``gemms`` in backward too)
    return local * one + gemms * mult * _cost.compute_time(0, 0, profile, dtype, launches=1)


def record_layer(tr, plan, per_expert: int, w_bytes: int, row_bytes: int, dtype,
                 chunks: int, phase: str, gemms: int = 3) -> None:
    """One MoE layer's exchange on the clock, per ep group: the counts, then dispatch,
    each rank's expert GEMMs, combine, in ``chunks`` pieces pipelined (dispatch of the
    next piece and combine of the last beside the experts' compute).  Backward: the
    same exchanges (the gradients' way back) and twice the GEMM FLOPs (dgrad, wgrad).

    ``plan``: per group (ranks, send bytes matrix, rows each rank receives[, tokens each
    rank holds]); ``per_expert``: weights a token multiplies (2 FLOPs each); ``w_bytes``:
    a rank's expert weights, read once per piece; ``gemms``: kernels per expert (SwiGLU 3,
    GeLU MLP 2).

    With the tokens each rank holds (the layer's ``_record_forward``), the kernels around
    the GEMMs too, the planner's own tuples (:mod:`.expert_parallel_kernels`, which
    ``plan.moe_cost`` lists): each rank's permutation before the dispatch and its
    un-permutation after the combine (backward: their gradients, and the input's gradient
    added to the router's), and with SwiGLU experts their silu and product beside each
    piece's GEMMs (backward: their gradients and the sum of the input's two gradients).
    Not priced: a GeLU expert's bias adds and GeLU (no planner formula: the planner prices
    SwiGLU experts only, ``moe_cost.check_moe``); without the tokens (``exchange_report``)
    the GEMMs alone, as before.

    The counts go first in the forward only: each rank's E int64 row counts per expert
    (the dispatcher's ``per_expert``, which the distributed path sends; Megatron-LM
    gathers the same ``num_local_tokens_per_expert`` before its all-to-all, NVIDIA/
    Megatron-LM d98e8a64dd megatron/core/transformer/moe/token_dispatcher.py:543-575).
    The backward exchanges reuse the forward's split sizes, reversed, and send no counts
    (Megatron-LM's ``_AllToAll.backward``, megatron/core/tensor_parallel/mappings.py:
    469-480; torch's ``all_to_all_single`` autograd likewise)."""
    mult = 2 if phase == "backward" else 1
    item = torch.empty((), dtype=dtype).element_size()
    for g, matrix, got, *held in plan:
        p = len(g)
        around = _Around(held[0] if held else None, matrix, got, row_bytes, per_expert,
                         gemms, item, phase, tr.profile, dtype)
        around.before(tr, g)
        if phase != "backward":
            experts = p * max(1, w_bytes // max(1, per_expert * item))    # E = ep x local
            C.record_collective("all_to_all", None, None, 8 * experts,
                                f"EP counts ({phase})", groups=[g])
        # each entry's rows split over the pieces as evenly as whole rows go (its bytes
        # when they are not whole rows), so that the pieces add up to what was routed
        pieces = [[[_share(b, row_bytes, c, chunks) for b in row] for row in matrix]
                  for c in range(chunks)]
        comp = []                               # comp[c][r]: rank r's experts on piece c
        for c in range(chunks):
            comp.append([])
            for n in got:
                rows = n * (c + 1) // chunks - n * c // chunks
                flops = mult * 2 * rows * per_expert
                # backward: each matrix's input-gradient GEMM reads the output gradient and
                # the weights and writes the input gradient, its weight-gradient GEMM reads
                # the activations and the output gradient and writes the weight gradient
                # (the weights' size, 16-bit in this library's recipe): twice the forward's
                # traffic, weights included (moe_cost.backward_ops' grads(): dgrad
                # e (MN + bKN + MK), wgrad e (MN + MK) + g bKN; was the forward's bytes,
                # which left out the weight gradients written and the second GEMM's reads)
                nbytes = mult * (w_bytes + 2 * rows * row_bytes)
                comp[c].append((flops, nbytes, _experts_time(
                    flops, nbytes, rows, per_expert, w_bytes, row_bytes, dtype, gemms, mult,
                    tr.profile)))
        ov = chunks > 1
        nxt = C.record_all_to_all_v(pieces[0], g, f"EP dispatch ({phase})", overlap=ov)
        combines = []
        for c in range(chunks):
            h_now = nxt
            if c + 1 < chunks:                  # next piece's dispatch beside this compute
                nxt = C.record_all_to_all_v(pieces[c + 1], g, f"EP dispatch ({phase})",
                                            overlap=True)
            if h_now is not None and ov:
                tr.wait(h_now)
            for i, (r, (flops, nbytes, dur)) in enumerate(zip(g, comp[c])):
                tr.record_compute([r], f"experts {phase}", dur, flops=flops, bytes=nbytes,
                                  label=f"chunk {c + 1}/{chunks}",
                                  args={"op_class": "matmul", "phase": phase})
                around.activation(tr, r, got[i] * (c + 1) // chunks - got[i] * c // chunks,
                                  f"chunk {c + 1}/{chunks}")
            back = [list(r) for r in zip(*pieces[c])]
            combines.append(C.record_all_to_all_v(back, g, f"EP combine ({phase})",
                                                  overlap=ov))
        for hc in combines:
            if hc is not None and ov:
                tr.wait(hc)
        around.after(tr, g)


class _Around:
    """The kernels around one group's expert GEMMs (``record_layer``'s docstring), priced
    by :mod:`.expert_parallel_kernels`; records nothing without the tokens."""

    def __init__(self, tokens, matrix, got, row_bytes, per_expert, gemms, item, phase,
                 profile, dtype):
        self.tokens, self.phase, self.profile, self.dtype = tokens, phase, profile, dtype
        h = max(1, row_bytes // item)
        self.h, self.e = h, item
        self.sent = [sum(row) // max(1, row_bytes) for row in matrix]    # R of each rank
        self.ffn = per_expert // (gemms * h) if gemms == 3 else None    # SwiGLU's width

    def _record(self, tr, r, op, label=""):
        name, cls, flops, nbytes, _ = op
        tr.record_compute([r], name, K.price(op, self.profile, self.dtype), flops=flops,
                          bytes=nbytes, label=label or self.phase,
                          args={"op_class": cls, "phase": self.phase})

    def before(self, tr, g):
        """Forward: each rank's permutation; backward: its un-permutation's gradient."""
        if self.tokens is None:
            return
        op = K.permute if self.phase != "backward" else K.unpermute_grad
        for r, tn, R in zip(g, self.tokens, self.sent):
            self._record(tr, r, op(tn, R, self.h, self.e))

    def activation(self, tr, r, rows, label):
        """Rank r's SwiGLU on ``rows`` rows of one piece, after the piece's GEMMs (one
        compute stream: the order within the piece does not change its time); backward
        the product's and silu's gradients and the sum of the input's two gradients."""
        if self.tokens is None or self.ffn is None:
            return
        ops = K.swiglu(rows, self.ffn, self.e) if self.phase != "backward" else \
            [*K.swiglu_grad(rows, self.ffn, self.e), K.dgrad_add(rows, self.h, self.e)]
        for op in ops:
            self._record(tr, r, op, label)

    def after(self, tr, g):
        """Forward: each rank's un-permutation; backward: the permutation's gradient and
        the input's gradient added to the router's."""
        if self.tokens is None:
            return
        for r, tn, R in zip(g, self.tokens, self.sent):
            if self.phase != "backward":
                self._record(tr, r, K.unpermute(tn, R, self.h, self.e))
            else:
                self._record(tr, r, K.permute_grad(tn, R, self.h, self.e))
                self._record(tr, r, K.input_grad_add(tn, self.h, self.e))


def _count(v, lo: int) -> bool:
    """``v`` is an int >= ``lo`` (not a bool; a numpy or torch integer counts)."""
    import numbers
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= lo


def _share(nbytes: int, row_bytes: int, c: int, chunks: int) -> int:
    """Bytes of piece c of ``chunks`` of an exchange of ``nbytes``: whole rows, split as
    evenly as they go (the first pieces one row fewer), or the bytes themselves when they
    are not whole rows; the pieces add up to ``nbytes``."""
    unit = row_bytes if row_bytes > 0 and nbytes % row_bytes == 0 else 1
    n = nbytes // unit
    return unit * (n * (c + 1) // chunks - n * c // chunks)


def exchange_report(rows, row_bytes: int, per_expert: int, experts_per_rank: int,
                    chunks: int = 1, profile=None, dtype=torch.bfloat16, phase="forward"):
    """One MoE layer's exchange and expert GEMMs on the modeled clock of ``profile``, as an
    :class:`~workbench.parallel.strategies.overlap.OverlapReport` (``wb.viz`` draws it:
    ``draw_timeline(report)``, ``render_text(report)``).

    ``rows[i][j]``: tokens rank i sends rank j (an ep x ep matrix, uneven as a router
    makes it); ``row_bytes``: bytes of one token (h x element size); ``per_expert``: weights
    one token multiplies in its expert (3 h d_ff for SwiGLU); ``experts_per_rank``: E / ep.
    The ranks are 0 .. ep-1 of one node of the profile."""
    from ...sim_mesh.trace import trace
    from .overlap import OverlapReport
    ep = len(rows)
    if ep < 1 or any(len(r) != ep for r in rows):
        raise ValueError(f"exchange_report: rows must be an ep x ep matrix of token counts; "
                         f"got {rows!r:.80}")
    # (was: 2.5 tokens silently counted as 2 by int(), chunks=0 an IndexError, no expert
    # or no weight priced as launches alone)
    bad = [n for r in rows for n in r if not _count(n, 0)]
    if bad:
        raise ValueError(f"exchange_report: rows hold {bad[0]!r}; give whole token counts "
                         "(ints >= 0), rows[i][j] the tokens rank i sends rank j")
    for name, v in (("row_bytes", row_bytes), ("per_expert", per_expert),
                    ("experts_per_rank", experts_per_rank), ("chunks", chunks)):
        if not _count(v, 1):
            raise ValueError(f"exchange_report: {name}={v!r}; give an int >= 1 (row_bytes: h x "
                             "element size; per_expert: the weights a token multiplies; "
                             "experts_per_rank: E / ep; chunks: pieces of the exchange)")
    item = torch.empty((), dtype=dtype).element_size()
    matrix = [[int(n) * row_bytes for n in r] for r in rows]
    got = [sum(int(rows[i][r]) for i in range(ep)) for r in range(ep)]
    with trace(profile) as tr:
        record_layer(tr, [(tuple(range(ep)), matrix, got)], per_expert,
                     per_expert * experts_per_rank * item, row_bytes, dtype, chunks, phase)
    return OverlapReport.from_events(tr.events, f"EP {phase}", chunks, tr.profile.name)
