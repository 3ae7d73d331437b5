"""The multi-copy layer's kernels, priced, and the order its backward runs them in.

Modeled costs (per rank, per copy; ``cost.compute_time`` of each kernel with its op
class and one launch, summed into one event per step below): matmuls 2mkn FLOPs reading
inputs and writing outputs once; attention scores are computed in full (S x S, masked
causally, as ``overlap_multicopy._attention_partial`` writes it; a causal FlashAttention
kernel would skip half); softmax and GeLU count their memory traffic; residual adds are
not priced.

What the input gradient's all-reduce hides behind (``wgrad``):

* ``"per_linear"`` (the default): Megatron-LM's rule.  Autograd runs a block's backward
  linear by linear, last first.  The row-parallel linear (wo, w2) communicates nothing in
  backward: its input gradient (dgrad) and its weight gradient (wgrad) run back to back.
  Then the attention core's (GeLU's) backward, then the column-parallel linear (wqkv, w1):
  ``LinearWithGradAccumulationAndAsyncCommunication.backward`` computes the dgrad,
  launches the all-reduce of that input gradient with ``async_op=True`` (with sequence
  parallelism a reduce-scatter), runs the wgrad GEMM, then ``handle.wait()``
  (NVIDIA/Megatron-LM ``megatron/core/tensor_parallel/layers.py`` at d98e8a64dd; the
  same order since ``ColumnParallelLinearWithAsyncAllreduce`` of 16c90445e7, 2021-09-02,
  ``megatron/mpu/layers.py``; ``CUDA_DEVICE_MAX_CONNECTIONS=1`` so the collective is
  queued before the GEMM).  So the all-reduce can hide only behind THAT linear's wgrad;
  the row-parallel linear's wgrad ran before it was issued, and the next block's
  backward waits for it (it needs the all-reduced gradient on the residual stream).
  ``plan.layer_cost`` prices Megatron's layer by the same rule, as does the DistTensor
  path (``tensor_parallel``, ``ops_table.pricing.wgrad_overlap``).
* ``"block"``: every weight gradient of the block deferred until its input gradient's
  all-reduce is issued (dgrad of wo, core, dgrad of wqkv; all-reduce; both wgrads beside
  it).  Not what Megatron-LM's tensor-parallel layer does: a schedule that splits the
  weight gradients out and runs them later (as zero-bubble pipelines' W pass does,
  ``schedules``) could; an upper bound on what one copy's backward can hide.
"""
from __future__ import annotations

from ...sim_mesh import cost as _cost

__all__ = ["WGRAD", "kernels", "backward_steps", "record_compute"]

WGRAD = ("per_linear", "block")
_LINEARS = {"attention": ("wqkv", "wo", "core"), "ffn": ("w1", "w2", "gelu")}


def _mm(m, k, n, e):
    return 2 * m * k * n, (m * k + k * n + m * n) * e, "matmul", (1, m, n)


def kernels(b, S, H, a, d, Fl, e) -> dict[str, list[tuple]]:
    """(flops, bytes, op class[, GEMM output]) of each kernel, per rank and copy, keyed by
    block and step; a = local heads, Fl = F/p.  The attention core runs unfused (as
    written in ``_attention_partial``): two batched GEMMs (class "matmul") around a
    softmax (class "norm", as the op table classes it); GeLU is "elementwise"."""
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
        # backward, linear by linear: dX[T, in] = dY[T, out] W^T, dW[in, out] = X^T dY
        "attention wo dX": [_mm(T, H, Hl, e)],
        "attention wo dW": [_mm(Hl, T, H, e)],
        "attention core dX": [scores, context, (5 * SS, 3 * SS * e, "norm"), context, context],
        "attention wqkv dX": [_mm(T, 3 * Hl, H, e)],
        "attention wqkv dW": [_mm(H, T, 3 * Hl, e)],
        "ffn w2 dX": [_mm(T, H, Fl, e)],
        "ffn w2 dW": [_mm(Fl, T, H, e)],
        "ffn gelu dX": [(10 * T * Fl, 3 * T * Fl * e, "elementwise")],
        "ffn w1 dX": [_mm(T, Fl, H, e)],
        "ffn w1 dW": [_mm(H, T, Fl, e)],
    }


def backward_steps(block: str, wgrad: str) -> tuple[list, list]:
    """One copy's backward of ``block`` as (before, after): the compute events before its
    input gradient's all-reduce is issued and those beside it, each (label, kernel keys)
    (module docstring)."""
    col, row, mid = _LINEARS[block]
    k = {s: f"{block} {s}" for s in (f"{row} dX", f"{row} dW", f"{mid} dX", f"{col} dX",
                                      f"{col} dW")}
    if wgrad == "per_linear":
        return ([(f"{row} dX dW", (k[f"{row} dX"], k[f"{row} dW"])),
                 (f"{block} dX", (k[f"{mid} dX"], k[f"{col} dX"]))],
                [(f"{col} dW", (k[f"{col} dW"],))])
    return ([(f"{block} dX", (k[f"{row} dX"], k[f"{mid} dX"], k[f"{col} dX"]))],
            [(f"{block} dW", (k[f"{row} dW"], k[f"{col} dW"]))])


def record_compute(tr, mesh, name, keys, table, dtype, label, phase):
    """One compute event ``name``: the sum of the kernels under ``keys``, each priced on
    the roofline at its class's efficiency (a GEMM with its shape: tile and wave
    quantization, or the device's measured rate) plus one launch."""
    ks = [k for key in keys for k in table[key]]
    dur = sum(_cost.compute_time(k[0], k[1], tr.profile, dtype, op_class=k[2], launches=1,
                                 gemm=k[3] if len(k) > 3 else None) for k in ks)
    tr.record_compute(mesh.ranks, name, dur, flops=sum(k[0] for k in ks),
                      bytes=sum(k[1] for k in ks), label=label,
                      args={"phase": phase, "kernels": len(ks)})
