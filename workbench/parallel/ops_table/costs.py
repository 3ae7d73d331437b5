"""What one op costs on one rank: FLOPs and bytes, forward and backward.

A cost function receives the rank's local inputs and outputs as meta tensors (shape
and dtype only; non-tensor inputs as they are) and the op's attributes, and returns
a :class:`Cost`. Element sizes come from each tensor's dtype.

Conventions (the ones of ``workbench.ops.cost``, stated once):

* a multiply-add is 2 FLOPs (a (M, K) by (K, N) matmul is 2MNK); an element-wise op
  counts the arithmetic of its formula as PyTorch documents it, a transcendental
  function (exp, log, tanh, erf, sqrt) counting 1: ``silu(x) = x / (1 + exp(-x))`` is
  4 (as ``ops/swiglu.py`` counts it), ``gelu(x) = x/2 (1 + erf(x / sqrt 2))`` is 5;
* forward bytes: each input read once and each output written once (a fused kernel);
* backward: the matmuls' 2 x forward (dX = dY W^T, dW = X^T dY; Kaplan et al. 2020,
  section 2.1); element-wise and reductions likewise 2 x forward (the derivative,
  then its product with the incoming gradient); ops from ``workbench.ops.cost`` keep
  that module's own count (FlashAttention-2 recomputes the scores, ...);
* backward bytes: read the output gradients and what forward saved, write the input
  gradients (of floating-point inputs only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Cost", "TermsCost", "norm_terms", "nbytes", "elementwise", "reduction", "movement", "view", "contraction",
           "einsum_flops", "from_ops", "backward_bytes"]


@dataclass(frozen=True)
class Cost:
    """One call's work on one rank."""
    flops: int
    bytes: int                  # forward bytes read + written
    backward_flops: int
    backward_bytes: int

    @classmethod
    def zero(cls) -> "Cost":
        return cls(0, 0, 0, 0)


@dataclass(frozen=True)
class TermsCost(Cost):
    """A :class:`Cost` whose backward has per-input terms: ``terms`` is a tuple of
    ``(input index, backward FLOPs, backward bytes)``, the share of the backward that
    autograd runs only when that input needs its gradient (``ctx.needs_input_grad``,
    aten's ``output_mask``); the rest runs whenever the backward does
    (``pricing.backward_parts``)."""
    terms: tuple = ()


def norm_terms(ins, flops: int, shares: dict) -> tuple:
    """:class:`TermsCost` terms of a norm's backward of ``flops``: ``shares`` maps an
    input's index to the FLOPs of its own gradient (a weight's sum(dy * x_hat) over the
    rows is 2 an element, a bias's sum(dy) 1, a running statistic's 0: never
    differentiated); the input ``ins[0]``'s gradient is the rest. Each term writes its
    gradient (a floating input's bytes); aten's norm backwards take an ``output_mask``
    (``native_layer_norm_backward``, ``native_batch_norm_backward``,
    ``native_group_norm_backward``) and ``wb.ops.rms_norm`` checks ``needs_input_grad``."""
    terms, rest = [], flops
    for i, f in shares.items():
        p = ins[i] if i < len(ins) else None
        if isinstance(p, torch.Tensor):
            terms.append((i, f, nbytes(p) if p.dtype.is_floating_point else 0))
            rest -= f
    x = ins[0]
    return ((0, rest, nbytes(x) if x.dtype.is_floating_point else 0), *terms)


def _tensors(xs):
    return [x for x in xs if isinstance(x, torch.Tensor)]


def nbytes(x) -> int:
    """Bytes of a tensor's elements (meta tensors too); 0 for a non-tensor."""
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _numel(xs) -> int:
    return sum(t.numel() for t in _tensors(xs))


def backward_bytes(ins, outs, saved: int) -> int:
    """Read every output gradient and ``saved``, write every floating input's gradient."""
    grads_in = sum(nbytes(t) for t in _tensors(ins) if t.dtype.is_floating_point)
    return sum(nbytes(t) for t in _tensors(outs)) + saved + grads_in


def _make(flops, ins, outs, saved, bwd_flops=None):
    fwd = sum(nbytes(t) for t in _tensors(ins)) + sum(nbytes(t) for t in _tensors(outs))
    return Cost(int(flops), int(fwd), int(2 * flops if bwd_flops is None else bwd_flops),
                backward_bytes(ins, outs, saved))


def elementwise(per_element: int):
    """``per_element`` FLOPs per output element; backward saves the inputs."""
    def cost(ins, outs, **_):
        n = outs[0].numel() if outs else 0
        return _make(per_element * n, ins, outs, sum(nbytes(t) for t in _tensors(ins)))
    cost.per_element = per_element
    return cost


def reduction(per_element: int = 1):
    """``per_element`` FLOPs per INPUT element (a sum adds each element once)."""
    def cost(ins, outs, **_):
        return _make(per_element * _numel(ins[:1]), ins, outs, sum(nbytes(t) for t in _tensors(ins)))
    cost.per_element = per_element
    return cost


def movement(ins, outs, **_):
    """A copy (cat, contiguous, gather...): no arithmetic, inputs read, outputs written;
    backward moves the gradients back (nothing saved but integer indices)."""
    idx = sum(nbytes(t) for t in _tensors(ins) if not t.dtype.is_floating_point)
    return _make(0, ins, outs, idx, bwd_flops=0)


def view(ins, outs, **_):
    """A view (reshape of contiguous data, permute, expand, x[i]): no kernel runs."""
    return Cost.zero()


def einsum_flops(equation: str, shapes) -> int:
    """2 x the product of every index size of a two-operand contraction (a multiply-add
    per term of the sum), e.g. ``"mk,kn->mn"``: 2MNK."""
    lhs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs, shapes):
        for ch, n in zip(term, shape):
            sizes[ch] = max(sizes.get(ch, 1), n)
    if any(n == 0 for term, shape in zip(lhs, shapes) for n in shape):
        return 0
    return 2 * math.prod(sizes.values())


def contraction(equation_of):
    """A matmul-like op: ``equation_of(ins, attrs)`` gives the einsum of the local call.
    Backward: two contractions of the same size (dA and dB), reading dC, A and B."""
    def cost(ins, outs, **attrs):
        if len(ins) == 1:       # one operand: a permutation or diagonal (a copy), or a sum
            lhs, rhs = equation_of(ins, attrs).split("->")
            return reduction(1)(ins, outs) if set(lhs) - set(rhs) else movement(ins, outs)
        a, b = ins[0], ins[1]
        f = einsum_flops(equation_of(ins, attrs), (tuple(a.shape), tuple(b.shape)))
        return _make(f, ins, outs, nbytes(a) + nbytes(b), bwd_flops=2 * f)
    return cost


def from_ops(op: str, call):
    """Take the cost from ``workbench.ops.cost(op, *args, **kwargs)``, where
    ``call(ins, outs, **attrs) -> (args, kwargs)`` builds that op's arguments."""
    def cost(ins, outs, **attrs):
        from ... import ops
        args, kwargs = call(ins, outs, **attrs)
        c = ops.cost(op, *args, **kwargs)
        return Cost(c.flops, c.bytes_fused, c.backward_flops,
                    backward_bytes(ins, outs, c.saved_bytes_fused))
    cost.ops_name = op
    return cost
