"""Fusion: known patterns of small ops become one ``wb.ops`` call (one kernel).

    add(linear(x, w), b)            -> linear(x, w, b)          matmul + bias
    add(matmul(x, w.t()), b)        -> linear(x, w, b)
    x * rsqrt(mean(x^2, -1) + eps) * w        -> wb.ops.rms_norm(x, w, eps)
    silu(a) * b, (a, b) = h.chunk(2, d)       -> wb.ops.swiglu(h, d)
    softmax(q @ k^T * d^-0.5 [masked causal]) @ v -> wb.ops.flash_attention(q, k, v)

A pattern matches only where its inner results are read by nothing else (else the fused
op would have to write them too).  A constant the fused op stands for (the causal mask
of attention: a buffer the user may later change) is held in ``graph.held`` and checked
on every call.  The fused op computes the same function (its
rounding may differ: fused kernels keep intermediates in float32); each fusion names
what it replaced in the node's note, and the graph is printed before and after.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import ops as _ops
from ...parallel.ops_table.table import BY_FUNC
from ..graph import Node, Ref, map_refs

__all__ = ["fuse"]


class _View:
    def __init__(self, g):
        self.g = g
        self.cons = g.consumers()
        self.outs = set(g.output_vids())
        self.by_out = {vid: n for n in g.nodes for vid in n.outs}

    def prod(self, vid, op=None):
        n = self.by_out.get(vid) if isinstance(vid, int) else None
        return n if n is not None and (op is None or n.op in (op if isinstance(op, tuple)
                                                              else (op,))) else None

    def single(self, vid) -> bool:
        return len(self.cons.get(vid, ())) == 1 and vid not in self.outs


def _ref(x):
    return x.vid if isinstance(x, Ref) else None


def _tensor_args(n):
    return [a for a in n.args if isinstance(a, Ref)]


def _scalar(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _make(g, nid, func, args, kwargs, outs, note, source):
    metas = {}

    def meta(r):
        t = metas.get(r.vid)
        if t is None:
            v = g.values[r.vid]
            t = metas[r.vid] = torch.empty(v.shape, dtype=v.dtype, device="meta")
        return t
    margs, mkw = map_refs(args, meta), map_refs(kwargs, meta)
    entry, parse = BY_FUNC[func]
    ins, attrs = parse(*margs, **mkw)
    ids = {id(t): vid for vid, t in metas.items()}
    inputs = tuple(ids.get(id(x)) if isinstance(x, torch.Tensor) else None for x in ins)
    return Node(nid, entry.name, func, args, kwargs, inputs, dict(attrs), outs,
                Ref(outs[0]), source, note,
                in_consts=tuple(None if isinstance(x, torch.Tensor) else x for x in ins))


def _bias(v: _View, n):
    if n.op != "add" or len(n.args) != 2 or n.kwargs:
        return None
    for a, b in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        ra, rb = _ref(a), _ref(b)
        if ra is None or rb is None or not v.single(ra):
            continue
        bias = v.g.values[rb]
        out = v.g.values[n.outs[0]]
        if len(bias.shape) != 1 or bias.shape[0] != out.shape[-1]:
            continue
        p = v.prod(ra, ("linear", "matmul"))
        if p is None or p.kwargs:
            continue
        if p.op == "linear" and (len(p.args) == 2 or p.args[2] is None):
            x, w = p.args[0], p.args[1]
        elif p.op == "matmul" and len(p.args) == 2:
            t = v.prod(_ref(p.args[1]), "transpose")
            w2 = v.g.values[_ref(t.args[0])] if t is not None and _ref(t.args[0]) is not None \
                else None
            if t is None or not v.single(_ref(p.args[1])) or w2 is None or len(w2.shape) != 2:
                continue
            if t.func is not torch.Tensor.t and sorted(
                    d % 2 for d in t.args[1:3] if isinstance(d, int)) != [0, 1]:
                continue
            x, w = p.args[0], t.args[0]
        else:
            continue
        return (F.linear, (x, w, b), {}, f"fused {p.op} + bias", [p])
    return None


def _rms(v: _View, n):
    if n.op != "mul" or len(n.args) != 2:
        return None
    for a, w in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        ra, rw = _ref(a), _ref(w)
        if ra is None or rw is None or not v.single(ra):
            continue
        m1 = v.prod(ra, "mul")
        if m1 is None or len(m1.args) != 2:
            continue
        for x, r in ((m1.args[0], m1.args[1]), (m1.args[1], m1.args[0])):
            rr = _ref(r)
            rs = v.prod(rr, "rsqrt") if rr is not None and v.single(rr) else None
            ad = v.prod(_ref(rs.args[0]), "add") if rs is not None and \
                v.single(_ref(rs.args[0])) else None
            # (add(m, eps, alpha=a) adds a * eps: not the pattern)
            if ad is None or len(ad.args) != 2 or not _scalar(ad.args[1]) or ad.kwargs:
                continue
            mn = v.prod(_ref(ad.args[0]), "mean") if v.single(_ref(ad.args[0])) else None
            # (a mean in another dtype, mean(..., dtype=float64), makes the result that
            # dtype: rms_norm keeps x's)
            if mn is None or mn.kwargs.get("dtype") is not None:
                continue
            dim = mn.args[1] if len(mn.args) > 1 else mn.kwargs.get("dim")
            keep = mn.args[2] if len(mn.args) > 2 else mn.kwargs.get("keepdim", False)
            dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
            xv = v.g.values[_ref(x)] if _ref(x) is not None else None
            if xv is None or not keep or dim not in (-1, len(xv.shape) - 1):
                continue
            pw = v.prod(_ref(mn.args[0]), ("pow", "square", "mul")) \
                if v.single(_ref(mn.args[0])) else None
            if pw is None:
                continue
            sq = (pw.op == "pow" and pw.args[0] == x and pw.args[1] == 2) or \
                (pw.op == "square" and pw.args[0] == x) or \
                (pw.op == "mul" and pw.args[0] == x and pw.args[1] == x)
            wv = v.g.values[rw]
            # x and w of one dtype: bfloat16 activations times a float32 weight promote
            # to float32 eagerly, and rms_norm takes one dtype
            if not sq or len(wv.shape) != 1 or wv.shape[0] != xv.shape[-1] or \
                    wv.dtype != xv.dtype:
                continue
            return (_ops.rms_norm, (x, w), {"eps": float(ad.args[1])}, "fused rms_norm",
                    [m1, rs, ad, mn, pw])
    return None


def _swiglu(v: _View, n):
    if n.op != "mul" or len(n.args) != 2:
        return None
    for a, b in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        ra, rb = _ref(a), _ref(b)
        if ra is None or rb is None or not v.single(ra):
            continue
        s = v.prod(ra, "silu")
        if s is None:
            continue
        ga = _ref(s.args[0])
        ch = v.prod(ga, "chunk")
        if ch is None or ch is not v.prod(rb) or len(ch.outs) != 2 or \
                ch.outs != (ga, rb) or not v.single(ga) or not v.single(rb):
            continue
        k = ch.args[1] if len(ch.args) > 1 else ch.kwargs.get("chunks")
        d = ch.args[2] if len(ch.args) > 2 else ch.kwargs.get("dim", 0)
        if k != 2:
            continue
        return (_ops.swiglu, (ch.args[0],), {"dim": d}, "fused swiglu", [s, ch])
    return None


def _attention(v: _View, n):
    if n.op != "matmul" or len(n.args) != 2:
        return None
    rp, vv = _ref(n.args[0]), n.args[1]
    sm = v.prod(rp, "softmax") if rp is not None and v.single(rp) else None
    if sm is None or (sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")) not in (-1, 3):
        return None
    if len(sm.args) > 2 or sm.kwargs.get("dtype") is not None:    # softmax in another dtype
        return None
    inner = [sm]
    s = _ref(sm.args[0])
    causal, held = False, {}
    mf = v.prod(s, "masked_fill")
    if mf is not None and v.single(s):
        mask = v.g.consts.get(_ref(mf.args[1]))
        val = mf.args[2] if len(mf.args) > 2 else None
        if mask is None or val != float("-inf") or mask.dim() != 2 or \
                not torch.equal(mask.bool(), torch.ones_like(mask, dtype=torch.bool).triu(1)):
            return None
        causal = True
        held = {_ref(mf.args[1]): (mask.clone(), "a causal mask at capture, which the fusion "
                                   "pass made flash_attention(causal=True)")}
        inner.append(mf)
        s = _ref(mf.args[0])
    sc = v.prod(s, ("mul", "div")) if v.single(s) else None
    if sc is None or not _scalar(sc.args[1]):
        return None
    qk = v.prod(_ref(sc.args[0]), "matmul") if v.single(_ref(sc.args[0])) else None
    if qk is None:
        return None
    kt = v.prod(_ref(qk.args[1]), "transpose") if v.single(_ref(qk.args[1])) else None
    if kt is None or sorted(d % 4 for d in kt.args[1:3] if isinstance(d, int)) != [2, 3]:
        return None
    q, k = qk.args[0], kt.args[0]
    qv = v.g.values[_ref(q)]
    if len(qv.shape) != 4 or _ref(k) is None or _ref(vv) is None or \
            len({qv.dtype, v.g.values[_ref(k)].dtype, v.g.values[_ref(vv)].dtype}) != 1:
        return None                     # flash_attention takes q, k, v of one dtype
    want = qv.shape[-1] ** -0.5
    c = sc.args[1] if sc.op == "mul" else 1 / sc.args[1]
    if not math.isclose(c, want, rel_tol=1e-6):
        return None
    return (_ops.flash_attention, (q, k, vv), {"causal": causal} if causal else {},
            "fused attention" + (" (causal)" if causal else ""), inner + [sc, qk, kt], held)


PATTERNS = (("attention", _attention), ("rms_norm", _rms), ("swiglu", _swiglu),
            ("bias", _bias))


def fuse(prog, graph):
    before = str(graph)
    g = graph.copy()
    counts = {}
    changed = True
    while changed:
        changed = False
        v = _View(g)
        for k, n in enumerate(g.nodes):
            for name, pat in PATTERNS:
                hit = pat(v, n)
                if hit is None:
                    continue
                func, args, kwargs, note, dead, *held = hit
                if any(d.grad != n.grad or d.amp != n.amp for d in dead):
                    continue            # a no_grad (or autocast) block's edge
                # a constant whose value the fused op stands for (the causal mask, a
                # module's buffer): each call checks it still holds it (program.py)
                g.held.update(held[0] if held else {})
                g.nodes[k] = _make(g, n.nid, func, args, kwargs, n.outs, note, n.source)
                g.nodes[k].grad, g.nodes[k].amp = n.grad, n.amp
                drop = {d.nid for d in dead}
                g.nodes = [m for m in g.nodes if m.nid not in drop]
                counts[name] = counts.get(name, 0) + 1
                changed = True
                break
            if changed:
                break
    # number the nodes again, in order
    for i, n in enumerate(g.nodes):
        n.nid = i
        for vid in n.outs:
            g.values[vid].producer = i
    if prog is not None:
        what = ", ".join(f"{k} x{c}" for k, c in counts.items()) or "nothing to fuse"
        prog.log.append(("fuse", before, str(g),
                         f"{what}: {len(graph.nodes)} -> {len(g.nodes)} ops"))
    return g
