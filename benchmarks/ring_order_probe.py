"""Order-sensitive ops on a sequence in recorded ring order: each one's answer held to one
device's on the sequence in its own order.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.ring_order_probe

A case runs ``fn`` on the natural-order global tensors (the reference) and on their
``to_ring_layout`` DistTensors (cp 2 and 4). The DistTensor answer is read back in the
sequence's own order: ``full()`` with every dim its records name put back in order
(the sequence's and ``_ring_also``'s: an einsum's score matrix has two), else as it
is. Outcomes: "equal", "refused" (an error), "differed" (a silent wrong answer; "lost
record" where it equals the reference laid out in ring order but carries no record
saying so).

Measured (48 cases x cp 2 and 4 = 96; read back along the sequence's record only then):
at 386a0d57 differed 70, differed-ring 6, equal 20;
with ``seq_order.check_op`` refused 82, equal 14, differed 0. Of the 20 equal before, 8
are refused now: max(dim) / sort / topk values (order-free values, but the same call's
indices are not) and ``x[:, 0]`` (equal only because ring slot 0 starts with chunk 0);
softmax along the sequence (the rule gathers it) now keeps the order (``_ring_also``).

The "+" cases (``_more_cases``, 69 x cp 2 and 4 = 138: data-dependent ops, repeats,
contractions, merges of the sequence dim, writes, DistTensors sharded by hand with no
record, from_ring_layout of one): at 2aa04dc5 differed 32, lost record 8, equal 54,
refused 44; now refused 86, equal 52, differed 0, lost record 0. The two equal before and
refused now were right by luck of the assumption (a partner, and a from_ring_layout
input, put in ring order by hand with no record): stated with ``set_ring_order`` they
pass (the "stated" cases). The earlier 96 are unchanged (refused 82, equal 14).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.seq_order import RingOrder, orders_of, set_ring_order
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


class _Env:
    """What a case of :func:`_more_cases` may lay out: ``dist`` (the DistTensor run),
    ``lay(t, dim)`` (a plain tensor put in the sequence's order of that run: itself, or
    to_ring_layout of it), ``hand(t, dim)`` (a DistTensor sharded Shard(dim) by hand, no
    record: ``t`` as given), ``natural`` (x in its own order, for the hand-sharded cases)."""

    def __init__(self, mesh, p, x):
        self.mesh, self.p, self.natural = mesh, p, x
        self.dist = mesh is not None

    def lay(self, t, dim):
        if not self.dist:
            return t
        return cp.to_ring_layout(wb.distribute_tensor(t, self.mesh, [wb.Replicate()]),
                                 "cp", dim)

    def hand(self, t, dim):
        return wb.distribute_tensor(t, self.mesh, [wb.Shard(dim)]) if self.dist else t


def _set(x, index, value):
    y = x.clone()
    y[index] = value
    return y


def _more_cases(S):
    """Data-dependent ops, repeats, contractions, merges, joins and writes meeting the
    sequence (dim 1 of x (B, S, H)), hand-sharded tensors with no record, and
    from_ring_layout of one: each ``f(x, env)``."""
    g = torch.Generator().manual_seed(2)
    w_sg = torch.randn(S, 3, generator=g)           # a weight along the sequence
    w_sh = torch.randn(S, H, generator=g)
    w_shg = torch.randn(S, H, 3, generator=g)       # one matrix per position
    bounds = torch.tensor([0.75, 1.0, 1.25])
    pos_mask = (torch.arange(S) < S // 2).view(1, S, 1)
    idx_h = torch.randint(0, H, (B, S, 1), generator=g)   # indices over H, natural rows
    other = torch.randn(B, S, H, generator=g)
    sorted_seq = torch.arange(S, dtype=torch.float32).expand(B, H, S).contiguous()

    def from_hand(x, env):               # (3) an unrecorded tensor: its order not known
        return cp.from_ring_layout(env.hand(env.natural, 1), "cp", 1) if env.dist else x

    def from_hand_ring(x, env):          # (3) laid out by hand in ring order, not recorded
        if not env.dist:
            return x
        return cp.from_ring_layout(env.hand(cp.ring_order(env.natural, env.p, 1), 1), "cp", 1)

    def from_hand_stated(x, env):        # (3) the same, its order stated (set_ring_order)
        if not env.dist:
            return x
        y = env.hand(cp.ring_order(env.natural, env.p, 1), 1)
        return cp.from_ring_layout(set_ring_order(y, RingOrder(0, env.p, 1, True)), "cp", 1)

    def setitem(x, env):
        y = x.clone()
        y[:, S - 1] = 0.0
        return y

    return {
        # data-dependent
        "nonzero(x > 1)": lambda x, e: torch.nonzero(x > 1),
        "masked_select(x, x > 1)": lambda x, e: torch.masked_select(x, x > 1),
        "unique(x) sorted (order-free)": lambda x, e: torch.unique(x),
        "unique_consecutive along seq": lambda x, e: torch.unique_consecutive(
            (x > 1).float(), dim=1),
        "argmax over H (keeps order)": lambda x, e: torch.argmax(x, 2),
        "argmin along seq": lambda x, e: torch.argmin(x, 1),
        "argmax flattened": lambda x, e: torch.argmax(x),
        "max(dim=H) indices (keeps)": lambda x, e: torch.max(x, 2).indices,
        "max(dim=H) values (keeps)": lambda x, e: torch.max(x, 2).values,
        "min(dim=seq) indices": lambda x, e: torch.min(x, 1).indices,
        "min(dim=seq) values": lambda x, e: torch.min(x, 1).values,
        "index_select over H (keeps)": lambda x, e: torch.index_select(
            x, 2, torch.tensor([1, 0])),
        "gather over H, natural idx": lambda x, e: torch.gather(x, 2, idx_h),
        "gather over H, idx laid out": lambda x, e: torch.gather(x, 2, e.lay(idx_h, 1)),
        "scatter along seq": lambda x, e: x.scatter(1, torch.zeros(B, 1, H, dtype=torch.long),
                                                    0.0),
        "scatter over H, natural idx": lambda x, e: torch.zeros_like(x).scatter(2, idx_h, 1.0),
        "searchsorted(bounds, x) (keeps)": lambda x, e: torch.searchsorted(bounds, x),
        "searchsorted(seq-sorted, v)": lambda x, e: torch.searchsorted(
            e.lay(sorted_seq, 2), torch.full((B, H, 1), S / 2 + 0.5)),
        "bucketize(x, bounds) (keeps)": lambda x, e: torch.bucketize(x, bounds),
        # repeats
        "repeat along seq": lambda x, e: x.repeat(1, 2, 1),
        "repeat over batch (keeps)": lambda x, e: x.repeat(2, 1, 1),
        "repeat_interleave along seq": lambda x, e: torch.repeat_interleave(x, 2, dim=1),
        "repeat_interleave over H": lambda x, e: torch.repeat_interleave(x, 2, dim=2),
        "tile along seq": lambda x, e: torch.tile(x, (1, 2, 1)),
        # contractions and broadcasts
        "einsum bsh,bth->bst (both)": lambda x, e: torch.einsum("bsh,bth->bst", x, x),
        "einsum over seq, x.x (free)": lambda x, e: torch.einsum("bsh,bsg->bhg", x, x),
        "einsum over seq, plain w": lambda x, e: torch.einsum("bsh,sg->bhg", x, w_sg),
        "einsum broadcast plain w": lambda x, e: torch.einsum("bsh,sh->bsh", x, w_sh),
        "tensordot over seq, plain w": lambda x, e: torch.tensordot(x, w_sg, dims=([1], [0])),
        "tensordot over seq+H, x.x": lambda x, e: torch.tensordot(x, x, dims=([1, 2], [1, 2])),
        "matmul x^T @ plain w": lambda x, e: x.transpose(1, 2) @ w_sg,
        "matmul plain w^T @ x": lambda x, e: w_sg.t() @ x,
        "matmul batched over seq, plain w": lambda x, e: x.unsqueeze(2) @ w_shg,
        "matmul batched over seq, laid w": lambda x, e: x.unsqueeze(2) @ e.lay(w_shg, 0),
        # merging / splitting the sequence dim
        "reshape (B*S, H)": lambda x, e: x.reshape(B * S, H),
        "reshape (B, S*H)": lambda x, e: x.reshape(B, S * H),
        "view (B, S*H)": lambda x, e: x.view(B, S * H),
        "flatten(1)": lambda x, e: x.flatten(1),
        "flatten(0, 1)": lambda x, e: x.flatten(0, 1),
        "unflatten seq (2, S/2)": lambda x, e: x.unflatten(1, (2, S // 2)),
        "unflatten H (keeps)": lambda x, e: x.unflatten(2, (H, 1)),
        "reshape then back (B,S,H)": lambda x, e: x.reshape(B, S * H).reshape(B, S, H),
        # joins, expand, writes
        "cat x, x along seq": lambda x, e: torch.cat([x, x], 1),
        "cat along H (keeps)": lambda x, e: torch.cat([x, x], 2),
        "stack dim 1 (keeps)": lambda x, e: torch.stack([x, x], 1),
        "stack dim 0 (keeps)": lambda x, e: torch.stack([x, x]),
        "expand new dim (keeps)": lambda x, e: x.unsqueeze(0).expand(3, B, S, H),
        "diff along seq": lambda x, e: torch.diff(x, dim=1),
        "diff over H (keeps)": lambda x, e: torch.diff(x, dim=2),
        "cummax indices": lambda x, e: torch.cummax(x, 1).indices,
        "cumprod over H (keeps)": lambda x, e: torch.cumprod(x, 2),
        "logcumsumexp along seq": lambda x, e: torch.logcumsumexp(x, 1),
        "unfold along seq": lambda x, e: x.unfold(1, 2, 1),
        "unfold over H (keeps)": lambda x, e: x.unfold(2, 1, 1),
        "narrow along seq": lambda x, e: torch.narrow(x, 1, 0, S // 2),
        "index_put along seq": lambda x, e: torch.index_put(
            x, (torch.tensor([0]), torch.tensor([S - 1])), torch.tensor(9.0)),
        "setitem x[:, S-1] = 0": setitem,
        "setitem x[x > 1] = 0 (keeps)": lambda x, e: _set(x, x > 1, 0.0),
        "setitem x[:, :, 0] = plain table": lambda x, e: _set(x, (slice(None), slice(None), 0),
                                                             other[:, :, 0]),
        "where natural-order mask": lambda x, e: torch.where(pos_mask, x, 0.0),
        "where mask laid out (keeps)": lambda x, e: torch.where(e.lay(pos_mask, 1), x, 0.0),
        "where x > 1 (keeps)": lambda x, e: torch.where(x > 1, x, 0.0),
        # (1) hand-sharded, no record
        "x + hand-sharded natural": lambda x, e: x + e.hand(other, 1),
        "x + hand-sharded ring-ordered": lambda x, e: x + (e.hand(cp.ring_order(
            other, e.p, 1), 1) if e.dist else other),
        "x + hand ring-ordered, stated": lambda x, e: x + (set_ring_order(e.hand(
            cp.ring_order(other, e.p, 1), 1), RingOrder(0, e.p, 1, True)) if e.dist
            else other),
        "where(hand-sharded mask, x, 0)": lambda x, e: torch.where(
            e.hand(pos_mask.expand(B, S, H).contiguous(), 1), x, 0.0),
        # (3) from_ring_layout of a tensor with no record
        "from_ring_layout(hand, natural)": from_hand,
        "from_ring_layout(hand, ring)": from_hand_ring,
        "from_ring_layout(hand, stated)": from_hand_stated,
    }


def _read_back(out, p):
    """``out`` as a plain tensor in the sequence's own order."""
    if not isinstance(out, wb.DistTensor):
        return out
    got = out.full()
    for o in orders_of(out):             # each dim in a recorded order, put back
        inv = torch.argsort(cp.slot_positions(got.shape[o.dim], o.ring, o.balanced))
        got = got.index_select(o.dim, inv)
    return got


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
            return "lost record", "values in ring order, no record"
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
        env_plain, env_dist = _Env(None, p, x), _Env(mesh, p, x)
        for n, f in _more_cases(S).items():
            def fm(a, _f=f):
                return _f(a, env_dist if isinstance(a, wb.DistTensor) else env_plain)
            cases.append(("+ " + n, fm, [x], [rx], 1))
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
                print(f"cp {p} {name:<34} {out:<13} {why}")
    return res


if __name__ == "__main__":
    r = run()
    print("earlier cases:", dict(Counter(v for (n, _), v in r.items() if n[:2] != "+ ")))
    print("new cases (+):", dict(Counter(v for (n, _), v in r.items() if n[:2] == "+ ")))
    print("all:", dict(Counter(r.values())))
