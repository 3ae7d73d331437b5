"""FP8 GEMMs as NVIDIA Transformer Engine runs them on an H100 (``estimate(..., fp8=True)``).

What changes in a layer (Transformer Engine's ``Linear`` / ``LayerNormLinear`` with
``fp8_autocast``; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"):

- every GEMM of the layer's linears (not the attention core) runs on the FP8 tensor
  cores: its compute term at the profile's ``peak_flops["float8"]`` (H100 datasheet:
  1,979 TFLOP/s dense) times the same matmul efficiency as 16-bit GEMMs (an ASSUMPTION
  the profile states: no FP8 GEMM benchmark taken); its bytes are left as the 16-bit
  GEMM's (these GEMMs are compute-bound: an upper bound on their traffic);
- before a forward GEMM its activation input is cast to FP8 and transposed for the
  weight gradient (TE's ``cast_transpose``: read 16 bits, write 8 twice), and before
  a backward input-gradient GEMM the output gradient likewise: one memory-bound kernel
  each, priced by its bytes;
- the weights' FP8 copies are cast once per step (TE caches them across micro-batches):
  not priced; the 16-bit master weights, the optimizer and the activations the layer
  keeps are unchanged (memory as without FP8).

MFU stays relative to the model dtype's (16-bit) peak, as published FP8 runs report it.
"""
from __future__ import annotations

__all__ = ["with_fp8_casts", "FP8", "check_framework"]

FP8 = "float8"


def check_framework(layout) -> None:
    """Refuse ``fp8=True`` for this library's recipe (framework "workbench"), which has no
    FP8 path: its models' linears run in the model's 16-bit dtype (``models.gpt``,
    ``models.llama``), so the dry run could not hold such an estimate."""
    if layout.engine == "workbench":
        raise ValueError("fp8=True with framework='workbench': this library's recipe runs "
                         "its GEMMs in the model's 16-bit dtype (no FP8 path); use "
                         "framework='megatron' (Transformer Engine's FP8) or fp8=False")


def _is_layer_gemm(op) -> bool:
    """A linear's GEMM: op class matmul, a GEMM output shape, no measured kernel (the
    attention core's batched GEMMs name theirs)."""
    extra = op[5:]
    return op[1] == "matmul" and any(isinstance(x, tuple) for x in extra) and \
        not any(isinstance(x, str) for x in extra)


def with_fp8_casts(ops, e: int) -> list:
    """``ops`` (``layer_cost``'s op tuples, one phase) with TE's cast-transpose kernel
    before each forward GEMM (its input, M x K) and each input-gradient GEMM (its output
    gradient, M x N): read e bytes, write 1 byte twice, per element."""
    out = []
    for op in ops:
        if _is_layer_gemm(op) and (op[0].endswith("_gemm") or op[0].endswith("_dgrad")):
            flops = op[2]
            _, rows, cols = next(x for x in op[5:] if isinstance(x, tuple))
            # forward y[M, N] = x[M, K] w: M K = flops / 2N; dgrad dx[M, K]: M N = flops / 2K
            elements = flops / (2 * cols)
            tag = op[0].split(":")[-1]
            prefix = "recompute:" if op[0].startswith("recompute:") else ""
            out.append((f"{prefix}fp8_cast_{tag}", "elementwise", elements,
                        (e + 2) * elements, 1))
        out.append(op)
    return out
