"""Contractions: matmul, mm, bmm, linear, einsum. Rules: ``rules/matmul.py``. All are
priced by one formula (:func:`costs.einsum_flops`, 2 FLOPs per multiply-add) except
``F.linear``, priced by ``workbench.ops.cost("linear")`` (the same 2MNK plus the bias)."""
from __future__ import annotations



import torch
import torch.nn.functional as F

from ..rules import matmul as rm
from . import costs
from ._util import align
from .table import register

T = torch.Tensor


def _matmul_parse(a, b):
    if a.dim() == 0 or b.dim() == 0:
        raise RuntimeError(f"both arguments to matmul need to be at least 1D, but they are "
                           f"{a.dim()}D and {b.dim()}D. Fix: use * (torch.mul) to scale by a "
                           "0-d tensor")
    return (a, b), {}


def _mm_parse(name, ndim):
    def parse(a, b):
        if a.dim() != ndim or b.dim() != ndim:
            raise RuntimeError(f"{name}: expected {ndim}-D tensors, got {a.dim()}-D and "
                               f"{b.dim()}-D; torch.matmul broadcasts any shapes")
        return (a, b), {}
    return parse


def _dense_grad(y, nd):
    """A product batched over the ranks (``nd`` lead dims) gets its gradient contiguous: a
    gradient that arrives expanded (stride 0, e.g. from ``sum``) makes torch's CPU bmm
    copy it one matrix at a time (8 ranks, toy TP step: 24 us against 12 us per bmm,
    benchmarks/sim_overhead.py); one copy of the whole gradient is cheaper.  Values are
    unchanged."""
    if nd and y.requires_grad:
        y.register_hook(torch.Tensor.contiguous)
    return y


def _batched(a, b):
    """torch.matmul; two 3-d operands with one batch size go straight to bmm, which is what
    matmul runs for them, without matmul's expand and reshape nodes in the autograd graph
    (8 ranks, toy TP step: ~14 us less per product, forward and backward)."""
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    return torch.matmul(a, b)


def _matmul_local(nd, ctx, a, b):
    """torch.matmul on stacked tensors: a 1-d operand gets a size-1 dim that is dropped
    afterwards, as torch.matmul does (so (3,1,1) @ (1,) is (3, 1), (4,) @ (2,4,3) is (2, 3))."""
    la, lb = a.dim() - nd, b.dim() - nd
    if la == 1:
        a = a.unsqueeze(nd)                       # (lead, 1, k)
    if lb == 1:
        b = b.unsqueeze(-1)                       # (lead, k, 1)
    y = _dense_grad(_batched(*align(nd, a, b)), nd)
    if lb == 1:
        y = y.squeeze(-1)
    if la == 1:
        y = y.squeeze(-1 if lb == 1 else -2)
    return y


def _matmul_eq(ins, attrs):
    return rm.matmul_equation(tuple(ins[0].shape), tuple(ins[1].shape))


_MM_COST = costs.contraction(_matmul_eq)
register("matmul", [torch.matmul, T.matmul, T.__matmul__], parse=_matmul_parse,
         rule=rm.matmul_rule, local=_matmul_local, cost=_MM_COST, op_class="matmul")
from .table import add_funcs  # noqa: E402
add_funcs("matmul", [(T.__rmatmul__, lambda a, b: _matmul_parse(b, a))])
register("mm", [torch.mm, T.mm], parse=_mm_parse("mm", 2), rule=rm.matmul_rule,
         local=_matmul_local, cost=_MM_COST, op_class="matmul")
register("bmm", [torch.bmm, T.bmm], parse=_mm_parse("bmm", 3), rule=rm.matmul_rule,
         local=_matmul_local, cost=_MM_COST, op_class="matmul")


def _same_on_every_rank(x, nd) -> bool:
    """The stacked x holds one tensor for all ranks (lead dims of size 1 or stride 0)."""
    return all(x.shape[i] == 1 or x.stride(i) == 0 for i in range(nd))


def _linear_local(nd, ctx, x, w, b=None):
    if nd and _same_on_every_rank(x, nd) and not _same_on_every_rank(w, nd) and x.dim() > nd:
        # Column-parallel with a replicated input: every rank multiplies the same x by its
        # slice of the weight. One GEMM with all the slices side by side does exactly that
        # arithmetic at single-device speed; autograd still sends the input gradient through
        # x's per-rank views (their traced all-reduce).
        x0 = x[(0,) * nd]                                                    # (*batch, k)
        lead = tuple(w.shape[:nd])
        n, k = w.shape[-2], w.shape[-1]
        y = x0 @ w.reshape(-1, k).transpose(0, 1)                           # (*batch, L*n)
        nb = y.dim() - 1
        y = y.view(y.shape[:-1] + lead + (n,))                              # (*batch, *lead, n)
        y = y.movedim(tuple(range(nb, nb + nd)), tuple(range(nd)))          # (*lead, *batch, n)
        if b is not None:
            y, b = align(nd, y, b)
            y = y + b
        return y
    x, w2 = align(nd, x, w.transpose(-1, -2))
    y = _dense_grad(_batched(x, w2), nd)
    if b is not None:
        y, b = align(nd, y, b)
        y = y + b
    return y


def _linear_parse(x, w, b=None):
    if w.dim() != 2 or x.dim() == 0:
        raise RuntimeError(f"linear: weight must be 2-D (out, in) and input at least 1-D; "
                           f"got input {tuple(x.shape)}, weight {tuple(w.shape)}")
    return (x, w, b), {}


register("linear", [F.linear], parse=_linear_parse, rule=rm.linear_rule, local=_linear_local,
         cost=costs.from_ops("linear", lambda ins, outs: (ins, {})), op_class="matmul")


def _einsum_parse(eq, *ops):
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if len(ops) != 2:
        raise NotImplementedError(f"einsum of {len(ops)} operands on DistTensors: write it as "
                                  "two-operand einsums (the rule is for contractions of two)")
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq:
        raise NotImplementedError(f"einsum({eq!r}) on DistTensors: write the output explicitly "
                                  "and name every dim (no '...'), e.g. 'bij,bjk->bik'")
    return tuple(ops), {"equation": eq}


def _einsum_local(nd, ctx, *ops, equation):
    lhs, rhs = equation.split("->")
    return torch.einsum(",".join("..." + t for t in lhs.split(",")) + "->..." + rhs, *ops)


register("einsum", [torch.einsum], parse=_einsum_parse, rule=rm.einsum_rule,
         local=_einsum_local, cost=costs.contraction(lambda ins, a: a["equation"]),
         op_class="matmul")


