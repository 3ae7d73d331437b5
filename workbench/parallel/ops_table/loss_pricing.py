"""The loss on the clock: a cross-entropy priced at the rate a device measured for it.

The H100's measurement file (``sim_mesh.measured.cross_entropy_rate``) timed the loss as
Megatron runs it: the 16-bit logits' cast to float32, ``F.cross_entropy`` and its
gradient, in logits (tokens x vocabulary entries) per second.  The roofline prices that
pair well below what the card did (it is a chain of memory-bound kernels with
reductions), so where a profile measured it, the op table's ``cross_entropy`` on
float32 logits carries a :class:`LossCost`, which the clock
(``pricing.record_forward`` and the backward event) prices with
:func:`cross_entropy_times` instead of the roofline, and the planner
(``plan.edge_cost``) prices the loss with the same function: the training clock, the
dry run and the estimate price it alike.  A profile without a measured file may carry
the pair's rate from a card that measured it (``kernel_bandwidth[KERNEL]``, cited in the
profile as the assumption it is): the A100's is the H100's rate times the ratio of their
datasheet HBM bandwidths (the pair is memory-bound; the roofline priced it about 4x
faster than the H100 ran it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .costs import Cost, reduction

__all__ = ["LossCost", "cross_entropy_cost", "cross_entropy_times", "cross_entropy_rate",
           "KERNEL"]

# the measurement file's name of the pair and its bytes per logit (gpu_components.py:
# bytes = 4 x tokens x vocabulary, the fp32 logits once); a profile without a measured
# file may carry the pair's rate as kernel_bandwidth[KERNEL] in those bytes
KERNEL = "cross_entropy_fwd_bwd_fp32"
_BYTES_PER_LOGIT = 4

# log_softmax (5 FLOPs per logit, see reduction.py) then the pick of the target;
# backward 2 x forward (the convention of costs.py)
_ROOFLINE = reduction(5)


@dataclass(frozen=True)
class LossCost(Cost):
    """``cross_entropy``'s :class:`Cost` on float32 logits, with their (rows,
    vocabulary) on the rank."""
    rows: int = 0
    vocab: int = 0

    def measured(self, profile) -> "tuple[float, float] | None":
        """(forward, backward) seconds at the profile's measured rate, or None."""
        return cross_entropy_times(self.rows, self.vocab, profile)


def cross_entropy_cost(ins, outs, **attrs) -> Cost:
    """The op table's cost of ``cross_entropy``: 5 FLOPs per logit (a reduction), as a
    :class:`LossCost` when the logits are float32 (the kernel the file measured)."""
    c = _ROOFLINE(ins, outs, **attrs)
    x = ins[0] if ins else None
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() == 0 \
            or x.numel() == 0:
        return c
    vocab = x.shape[1] if x.dim() >= 2 else x.shape[0]      # F.cross_entropy's class dim
    return LossCost(c.flops, c.bytes, c.backward_flops, c.backward_bytes,
                    x.numel() // vocab, vocab)


def cross_entropy_times(rows: int, vocab: int, profile) -> "tuple[float, float] | None":
    """(forward, backward) seconds of ``F.cross_entropy`` on float32 logits of ``rows`` x
    ``vocab`` (int64 targets) at the profile's rate of the loss (:func:`cross_entropy_rate`:
    measured, or carried from a measured card); None where it has none (the roofline
    prices it then).

    The pair (cast and cross-entropy, forward and backward) takes ``rows x vocab /
    rate`` seconds in all, split between forward and backward as the op table's
    roofline prices of the pair split; the cast's roofline price is taken off each part
    (the clock prices the cast, a plain ``to``, where it runs), so cast + cross-entropy
    take the measured time.  Never below the cross-entropy's own roofline price (launch
    included): the rate was measured on vocabularies of 16,384 entries and more, and a
    small one is launch-bound (the H100's rate gives 1.3 us for 1,024 x 75 logits, less
    than the cast's launch alone).  ASSUMPTION: Megatron's vocabulary-parallel
    cross-entropy (torch ops in float32) runs at the rate measured for PyTorch's
    ``F.cross_entropy``; a model whose logits are float32 without a cast still pays the
    pair's time less the cast's price."""
    rate = cross_entropy_rate(profile)
    return None if rate is None else _times(rows, vocab, profile, rate)


def cross_entropy_rate(profile) -> "float | None":
    """Logits per second of the pair (cast and cross-entropy, forward and backward) on
    ``profile``: its measured file's rate (times a sibling card's ``memory_scale``), else
    its ``kernel_bandwidth[KERNEL]`` (bytes per second counted as the measurement file
    counts them, 4 bytes per fp32 logit: a rate a profile carries from a measured card,
    cited there, as the A100's from the H100's file), else None (the roofline prices
    the loss)."""
    from ...sim_mesh import measured as _measured
    from ...sim_mesh.profiles import get_profile
    prof = get_profile(profile)
    ms = prof.measured
    rate = _measured.cross_entropy_rate(ms["file"]) if ms else None
    if rate:
        # a sibling card's memory factor on the measured rate (1: the measured card)
        return rate * _measured.scales(prof)[1]
    bw = prof.kernel_bandwidth.get(KERNEL)
    return bw / _BYTES_PER_LOGIT if bw else None


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _roofline(name, ins, outs, profile, dtype) -> tuple[float, float]:
    """(forward, backward) seconds of op ``name`` on meta tensors by the roofline (one
    launch each), as the clock prices it."""
    from .pricing import _time
    from .table import entry
    e = entry(name)
    c = _ROOFLINE(ins, outs) if name == "cross_entropy" else e.cost(ins, outs)
    return (_time(c.flops, c.bytes, profile, dtype, e.op_class, launches=1),
            _time(c.backward_flops, c.backward_bytes, profile, dtype, e.op_class,
                  launches=1))


@functools.lru_cache(maxsize=256)
def _times(rows, vocab, profile, rate):
    f32 = torch.float32
    logits = _meta(rows, vocab)
    cast = _roofline("to", [_meta(rows, vocab, dtype=torch.bfloat16)], [logits], profile, f32)
    ce = _roofline("cross_entropy", [logits, _meta(rows, dtype=torch.int64)], [_meta()],
                   profile, f32)
    t = rows * vocab / rate
    f, b = cast[0] + ce[0], cast[1] + ce[1]
    return (max(t * f / (f + b) - cast[0], ce[0]), max(t * b / (f + b) - cast[1], ce[1]))
