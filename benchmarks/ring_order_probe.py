"""Order-sensitive ops on a sequence in recorded ring order: each one's answer held to one
device's on the sequence in its own order.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.ring_order_probe

A case runs ``fn`` on the natural-order global tensors (the reference) and on their
``to_ring_layout`` DistTensors (cp 2 and 4). The DistTensor answer is read back in the
sequence's own order: ``from_ring_layout`` along the dim its record names, else
``full()`` as it is. Outcomes: "equal", "refused" (an error), "differed" (a silent wrong
answer; "differed-ring" where it equals the reference laid out in ring order but carries
no record saying so).

Measured (48 cases x cp 2 and 4 = 96): at 386a0d57 differed 70, differed-ring 6, equal 20;
with ``seq_order.check_op`` refused 82, equal 14, differed 0. Of the 20 equal before, 8
are refused now: max(dim) / sort / topk values (order-free values, but the same call's
indices are not) and ``x[:, 0]`` (equal only because ring slot 0 starts with chunk 0);
softmax along the sequence (the rule gathers it) now keeps the order (``_ring_also``).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.seq_order import ring_order_of
from workbench.parallel.strategies import context_parallel as cp

B, H, D = 2, 2, 4


def _attn_tail(scores, v):
    return torch.softmax(scores, -1) @ v


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def _causal_cases(S, mesh, v_nat):
    """Hand-written causal attention on (q, k, v) of shape (B, H, S, D)."""
    mask = torch.triu(torch.ones(S, S), 1).bool()
    pad = (torch.arange(S) >= S - 2).view(1, 1, 1, S)      # the last two keys masked
    neg = torch.triu(torch.full((S, S), float("-inf")), 1)
    keep = torch.tril(torch.ones(S, S))

    def inplace(q, k, v):
        s = _scores(q, k)
        s.masked_fill_(mask, float("-inf"))
        return _attn_tail(s, v)

    def tril_probs(q, k, v):
        w = torch.tril(torch.exp(_scores(q, k)))
        return (w / w.sum(-1, keepdim=True)) @ v

    def triu_scores(q, k, v):
        s = _scores(q, k) - 1e9 * torch.triu(torch.ones_like(_scores(q, k)), 1)
        return _attn_tail(s, v)

    def rows_laid(q, k, v):       # the mask's rows laid out on the ring, its keys not
        m = mask
        if isinstance(q, wb.DistTensor):
            m = cp.to_ring_layout(wb.distribute_tensor(mask, mesh, [wb.Replicate()]), "cp", 0)
        return _attn_tail(_scores(q, k).masked_fill(m, float("-inf")), v)

    return {
        "attn mask rows laid on ring": rows_laid,
        "attn key-padding mask (natural)": lambda q, k, v: _attn_tail(
            _scores(q, k).masked_fill(pad, float("-inf")), v),
        "attn softmax(s) @ plain v": lambda q, k, v: _attn_tail(_scores(q, k), v_nat),
        "attn masked_fill(triu bool)": lambda q, k, v: _attn_tail(
            _scores(q, k).masked_fill(mask, float("-inf")), v),
        "attn + triu(-inf)": lambda q, k, v: _attn_tail(_scores(q, k) + neg, v),
        "attn where(mask, -inf, s)": lambda q, k, v: _attn_tail(
            torch.where(mask, float("-inf"), _scores(q, k)), v),
        "attn masked_fill(tril==0)": lambda q, k, v: _attn_tail(
            _scores(q, k).masked_fill(keep == 0, float("-inf")), v),
        "attn masked_fill_ in place": inplace,
        "attn tril(exp(s)) normalised": tril_probs,
        "attn triu(ones_like(s))": triu_scores,
        "attn no mask (order-free)": lambda q, k, v: _attn_tail(_scores(q, k), v),
        "sdpa is_causal, no context": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True),
        "sdpa attn_mask natural": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=~mask),
        "sdpa no mask (order-free)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    }


def _rope_cases(S, mesh):
    """RoPE with tables of positions 0..S-1 on q (B, H, S, D)."""
    cos, sin = wb.ops.rope_cos_sin(S, D)
    long_cos, long_sin = wb.ops.rope_cos_sin(2 * S, D)
    half = D // 2

    def rot(x):
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    def laid(t):                 # the fix: the table laid out on the ring, recorded
        if isinstance(t, torch.Tensor) and mesh is not None:
            return cp.to_ring_layout(wb.distribute_tensor(t, mesh, [wb.Replicate()]),
                                     "cp", 0)
        return t

    return {
        "rope q*cos + rot(q)*sin": lambda q, k, v: q * cos + rot(q) * sin,
        "rope tables [:S] of 2S": lambda q, k, v: q * long_cos[:S] + rot(q) * long_sin[:S],
        "rope wb.ops.rotary_embedding": lambda q, k, v: wb.ops.rotary_embedding(q, cos, sin),
        "rope ones table (order-free)": lambda q, k, v: q * torch.ones(S, D),
        "rope tables to_ring_layout": lambda q, k, v: q * laid(cos) + rot(q) * laid(sin),
    }


def _seq_cases(S):
    """Ops along the sequence, dim 1 of x (B, S, H)."""
    idx = torch.arange(0, S, 2)
    w = torch.randn(H, H, 3, generator=torch.Generator().manual_seed(1))
    return {
        "cumsum": lambda x: torch.cumsum(x, 1),
        "cumprod": lambda x: torch.cumprod(x, 1),
        "logcumsumexp": lambda x: torch.logcumsumexp(x, 1),
        "cummax values": lambda x: torch.cummax(x, 1).values,
        "flip": lambda x: torch.flip(x, [1]),
        "roll": lambda x: torch.roll(x, 1, 1),
        "diff": lambda x: torch.diff(x, dim=1),
        "narrow": lambda x: x.narrow(1, 1, S // 2),
        "slice x[:, 2:S-2]": lambda x: x[:, 2:S - 2],
        "slice x[:, :S] (whole)": lambda x: x[:, :S],
        "select x[:, 0]": lambda x: x[:, 0],
        "index_select natural idx": lambda x: torch.index_select(x, 1, idx),
        "gather along seq": lambda x: torch.gather(x, 1, idx.view(1, -1, 1).expand(B, -1, H)),
        "argmax along seq": lambda x: torch.argmax(x, 1),
        "max(dim) indices": lambda x: torch.max(x, 1).indices,
        "max(dim) values": lambda x: torch.max(x, 1).values,
        "sort values": lambda x: torch.sort(x, 1).values,
        "sort indices": lambda x: torch.sort(x, 1).indices,
        "argsort": lambda x: torch.argsort(x, 1),
        "topk values": lambda x: torch.topk(x, 2, 1).values,
        "topk indices": lambda x: torch.topk(x, 2, 1).indices,
        "F.pad along seq": lambda x: F.pad(x, (0, 0, 1, 0)),
        "conv1d along seq": lambda x: F.conv1d(x.transpose(1, 2), w, padding=1),
        "avg_pool1d along seq": lambda x: F.avg_pool1d(x.transpose(1, 2), 2),
        "chunk along seq [0]": lambda x: torch.chunk(x, 2, 1)[0],
        "cat along seq": lambda x: torch.cat([x, x[:, :1]], 1),
        "sum along seq (order-free)": lambda x: x.sum(1),
        "softmax along seq (order-free)": lambda x: torch.softmax(x, 1),
        "tril of (S, S) x @ x^T": lambda x: torch.tril(x @ x.transpose(1, 2)),
    }


def _read_back(out, p):
    """``out`` as a plain tensor in the sequence's own order."""
    if not isinstance(out, wb.DistTensor):
        return out
    o = ring_order_of(out) or next(iter(getattr(out, "_ring_also", ())), None)
    if o is None:
        return out.full()
    return cp.from_ring_layout(out, "cp", o.dim, o.balanced).full()


def _judge(fn, plain, dist, p, seq_dim):
    ref = fn(*plain)
    try:
        out = fn(*dist)
    except (ValueError, RuntimeError, NotImplementedError, TypeError) as e:
        return "refused", f"{type(e).__name__}: {str(e)[:160]}"
    got = _read_back(out, p)
    if got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-5,
                                                 equal_nan=True):
        return "equal", ""
    if ref.ndim > seq_dim and ref.shape[seq_dim] % (2 * p) == 0 and got.shape == ref.shape:
        rr = cp.ring_order(ref, p, seq_dim)
        if torch.allclose(got, rr, rtol=1e-4, atol=1e-5, equal_nan=True):
            return "differed-ring", "values in ring order, no record"
    err = (got - ref).abs().max().item() if got.shape == ref.shape else \
        f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    return "differed", f"max |err| {err}"


def run(ps=(2, 4), verbose=True):
    """{(case, p): outcome}; prints one line per case."""
    res = {}
    for p in ps:
        S = 4 * p
        mesh = wb.Mesh(list(range(p)), dim_names=["cp"])
        g = torch.Generator().manual_seed(p)
        qkv = [torch.randn(B, H, S, D, generator=g) for _ in range(3)]
        x = torch.rand(B, S, H, generator=g) + 0.5
        rq = [cp.to_ring_layout(wb.distribute_tensor(t, mesh, [wb.Replicate()]), "cp", 2)
              for t in qkv]
        rx = cp.to_ring_layout(wb.distribute_tensor(x, mesh, [wb.Replicate()]), "cp", 1)
        cases = [(n, f, qkv, rq, 2) for n, f in _causal_cases(S, mesh, qkv[2]).items()]
        rope_plain = _rope_cases(S, None)
        cases += [(n, rope_plain[n] if "to_ring" not in n else _rope_cases(S, None)[n],
                   qkv, rq, 2) for n in rope_plain]
        # the fix case: the tables are laid out for the DistTensor run only
        rope_dist = _rope_cases(S, mesh)
        cases = [(n, f, pl, di, sd) if "to_ring" not in n else
                 (n, (f, rope_dist[n]), pl, di, sd) for n, f, pl, di, sd in cases]
        cases += [(n, f, [x], [rx], 1) for n, f in _seq_cases(S).items()]
        for name, f, plain, dist, sd in cases:
            if isinstance(f, tuple):
                f_plain, f_dist = f
                def fn(*a, _fp=f_plain, _fd=f_dist):
                    return (_fd if isinstance(a[0], wb.DistTensor) else _fp)(*a)
            else:
                fn = f
            out, why = _judge(fn, plain, dist, p, sd)
            res[(name, p)] = out
            if verbose:
                print(f"cp {p} {name:<32} {out:<13} {why}")
    return res


if __name__ == "__main__":
    r = run()
    print(dict(Counter(r.values())))
