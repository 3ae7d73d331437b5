"""Contractions generated from einsum strings: matmul, mm, bmm, linear, einsum.

For ``"mk,kn->mn"`` and one mesh dim, the valid layouts are (the scaling book's
numbered cases):

    A[M_x, K] . B[K, N]   -> C[M_x, N]      shard a free dim of one operand
    A[M, K] . B[K, N_x]   -> C[M, N_x]
    A[B_x..] . B[B_x..]   -> C[B_x..]       shard a batch dim of both
    A[M, K_x] . B[K_x, N] -> C[M, N]{U_x}   shard the contraction: a partial sum
    A{U_x} . B            -> C{U_x}         linear in each operand
    A . B                 -> C              replicate

Rules for every mesh dim are combined (:func:`registry.combine`).
"""
from __future__ import annotations

import string

from ..placement import Partial, Replicate, Shard
from .registry import combine

R = Replicate()
P = Partial("sum")


def einsum_options(eq: str, specs) -> list[tuple]:
    """Per-mesh-dim options for an einsum ``eq`` over ``specs`` (one per operand)."""
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    sizes = {}
    for term, s in zip(ins, specs):
        for ch, n in zip(term, s.shape):
            sizes[ch] = max(sizes.get(ch, 1), n)
    opts = [(tuple(R for _ in ins), (R,), "replicated")]
    # a letter twice in one operand ("ii->i", a diagonal) pairs two dims: never sharded
    diag = {ch for t in ins for ch in t if t.count(ch) > 1}
    for ch in out:                                   # batch or free dims: shard them
        if sizes.get(ch, 1) <= 1 or ch in diag:
            continue
        req = []
        for term, s in zip(ins, specs):
            if ch in term and s.shape[term.index(ch)] > 1:
                req.append(Shard(term.index(ch)))
            else:
                req.append(R)
        kind = "batch" if sum(ch in t for t in ins) > 1 else "free"
        opts.append((tuple(req), (Shard(out.index(ch)),), f"{kind} dim {ch!r} sharded"))
    for ch in sizes:                                 # contracted dims: partial sums
        if ch in out or sizes[ch] <= 1 or ch in diag:
            continue
        req = tuple(Shard(t.index(ch)) if ch in t else R for t in ins)
        if any(ch in t and s.shape[t.index(ch)] <= 1 for t, s in zip(ins, specs)):
            continue
        opts.append((req, (P,), f"contraction dim {ch!r} sharded: partial sums"))
    for k in range(len(ins)):                        # linearity in each operand
        req = tuple(P if j == k else R for j in range(len(ins)))
        opts.append((req, (P,), f"linear in operand {k}: partial stays partial"))
    return opts


def matmul_equation(a_shape, b_shape) -> str:
    """The einsum equation of torch.matmul for these shapes (broadcast batch dims)."""
    letters = iter(string.ascii_lowercase)          # batch letters; m, k, n are taken
    if len(a_shape) == 1 and len(b_shape) == 1:
        return "k,k->"
    if len(a_shape) == 1:
        bb = "".join(_take(letters, len(b_shape) - 2))
        return f"k,{bb}kn->{bb}n"
    if len(b_shape) == 1:
        ab = "".join(_take(letters, len(a_shape) - 2))
        return f"{ab}mk,k->{ab}m"
    na, nb = len(a_shape) - 2, len(b_shape) - 2
    nbatch = max(na, nb)
    batch = _take(letters, nbatch)
    ab, bb = [], []
    for i in range(nbatch):
        ia, ib = i - (nbatch - na), i - (nbatch - nb)
        sa = a_shape[ia] if ia >= 0 else None
        sb = b_shape[ib] if ib >= 0 else None
        if sa is not None and sb is not None and sa == sb:
            ab.append(batch[i]); bb.append(batch[i])
        else:           # broadcast: only the operand that really has it may shard it
            if sa is not None:
                ab.append(batch[i] if (sb is None or sb == 1) else batch[i].upper())
            if sb is not None:
                bb.append(batch[i] if (sa is None or sa == 1) and sb != 1 else batch[i].upper())
    outb = batch
    return f"{''.join(ab)}mk,{''.join(bb)}kn->{''.join(outb)}mn"


def _take(it, n):
    out = []
    while len(out) < n:
        ch = next(it)
        if ch not in "mkn":
            out.append(ch)
    return out


def einsum_rule(*specs, equation: str):
    """Any one- or two-operand einsum (a permutation, diagonal or sum of one operand)."""
    opts = einsum_options(equation, specs)
    return combine(specs[0].mesh.ndim, [opts] * specs[0].mesh.ndim, len(specs))


def matmul_rule(a, b):
    """torch.matmul / mm / bmm: the einsum rule of ``matmul_equation``."""
    return einsum_rule(a, b, equation=matmul_equation(a.shape, b.shape))


def linear_rule(x, w, b=None):
    """F.linear(x, w, b) = x @ w.T + b: "...k,nk->...n"; the bias follows the output
    (sharded with n, partial only with the weight's first operand... replicated
    otherwise: adding a replicated bias to a partial sum would add it n times)."""
    batch = "".join(_take(iter(string.ascii_lowercase), x.ndim - 1))
    eq = f"{batch}k,nk->{batch}n"
    opts = einsum_options(eq, (x, w))
    out = []
    for ins, outs, note in opts:
        o = outs[0]
        if b is None:
            out.append((ins + (None,), outs, note))
            continue
        if isinstance(o, Shard) and o.dim == x.ndim - 1:
            bias = Shard(0)
        elif isinstance(o, Partial):
            # x @ w.T is partial: the bias must be added on one rank only (a partial bias)
            bias = Partial("sum")
        else:
            bias = R
        out.append((ins + (bias,), outs, note))
    return combine(x.mesh.ndim, [out] * x.mesh.ndim, 3)
