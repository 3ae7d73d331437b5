"""The wide space of the random programs (``run_program(rng, wide=True)``, sweep11): what
``tests/random_programs.py`` and its two kind modules never drew.

* Program shapes: explicit ``redistribute`` mid-program (to any layout, Partial too, so
  that autograd runs back through several reshards), a round trip through another mesh
  (``wb.reshard`` to a mesh of other ranks and back: send/recv), ``from_local`` of the
  locals, ops under ``torch.no_grad()`` mixed into the graph, ``detach()`` mixed in, a
  leaf written in place under ``no_grad`` (the init habit), ops under
  ``torch.autocast("cpu", bfloat16)``.
* Dtypes: the first leaf may be int64 / int32 / uint8 / bool / bfloat16 / float16 /
  complex128 (only float32 / float64 before).
* Ops of the op table and of the composed torch functions (``habits.COMPOSED``) never
  drawn: addmm / baddbmm / addbmm / addmv / addr / addcdiv / addcmul, mv / dot / outer /
  tensordot / cdist / cosine_similarity / dist, diag / trace / rot90 / tensor_split /
  hstack / vstack, kthvalue / median / nanmedian() / nanmean / softmin / std_mean /
  matrix_norm, the losses (l1, smooth_l1, huber, kl_div, nll, bce), ``_foreach`` ops,
  allclose / equal, conv2d / conv3d / 2-d pooling, argwhere, unique_consecutive, polar /
  view_as_complex, scaled_dot_product_attention, pow / clamp with tensor operands,
  topk(largest=False), round(decimals=).
* (sweep15, ``NEW15``) the registered ops no kind drew (``benchmarks/op_coverage.py``:
  convolution, gcd / lcm, igamma / igammac, ldexp, logaddexp / logaddexp2, nextafter,
  mode, multinomial on one-hot rows, renorm, unfold, special.xlog1py / zeta) and the
  compositions pairwise_distance, vdot, norm / linalg.norm, index_put, more ``_foreach``.
* Backward forms: ``out.backward(g)``, twice with ``retain_graph`` (accumulated), and
  ``torch.autograd.grad`` (see :func:`backward`).

Builders as in ``tests/random_programs_more.py``: ``b(p, cur, k) -> (text, f) | None``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import Partial, Replicate


def _pick(t, d, r):
    return d if isinstance(t, wb.DistTensor) else r


def _is_d(t):
    return isinstance(t, wb.DistTensor)


def _moves(t):
    """Whether a drawn reshard runs on ``t``: a DistTensor, or wb.compile's meta stand-in
    of one (tests/compile_probe.py).  The one-device reference (a plain tensor with data)
    skips it; the capture must see the user's call, not a program without it (wide probe
    seeds 30, 84, 116: the skipped call was eager's extra collectives at O0)."""
    return isinstance(t, wb.DistTensor) or (isinstance(t, torch.Tensor) and t.is_meta)


def _suffix(rng, shape):
    ys = list(shape)
    if ys and rng.random() < 0.5:
        ys = ys[rng.randrange(len(ys) + 1):]
    return tuple(1 if rng.random() < 0.25 else s for s in ys)


# first leaves: (dtype, weight)
DTYPES = ((torch.float64, 8), (torch.float32, 2), (torch.bfloat16, 1), (torch.float16, 1),
          (torch.int64, 2), (torch.int32, 1), (torch.uint8, 1), (torch.bool, 1),
          (torch.complex128, 1))


def dtype(rng):
    """A first leaf's dtype."""
    r = rng.random() * sum(w for _, w in DTYPES)
    for dt, w in DTYPES:
        r -= w
        if r < 0:
            return dt
    return torch.float64


def _layout(p, t):
    """Placements for ``t`` (a DistTensor): Partial with t's own reduce op when it has
    one (another op is not a reshard), none for bool, no max/min for complex."""
    ps = p.placements(tuple(t.shape), t.dtype)
    own = [q.reduce_op for q in t.placements if q.is_partial()]
    out = []
    for q in ps:
        if q.is_partial():
            if t.dtype == torch.bool or (t.is_complex() and q.reduce_op in ("max", "min")):
                q = Replicate()
            elif own:
                q = Partial(own[0])
        out.append(q)
    return out


def _program(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    if k == "redistribute":
        ps = _layout(p, d)
        return f"{nm}.redistribute(mesh, {[str(q) for q in ps]})", \
            lambda t: t.redistribute(p.mesh, ps) if _moves(t) else t
    if k == "redistribute2":          # two in a row, an op between
        ps1, ps2 = _layout(p, d), _layout(p, d)
        c = round(rng.uniform(0.5, 2), 2)
        return f"({nm}.redistribute(mesh, {[str(q) for q in ps1]}) * {c})" \
               f".redistribute(mesh, {[str(q) for q in ps2]})", \
            lambda t: (t.redistribute(p.mesh, ps1) * c).redistribute(p.mesh, ps2) \
            if _moves(t) else t * c
    if k == "reshard_mesh":           # to a mesh of other ranks and back (send / recv)
        shape = p.mesh.shape if hasattr(p.mesh, "shape") else None
        ranks = torch.tensor(p.mesh.tolist())
        perm = torch.randperm(ranks.numel(), generator=torch.Generator().manual_seed(
            rng.getrandbits(31))) + 8
        other = wb.Mesh(perm.reshape(ranks.shape).tolist())
        ps1, ps2 = _layout(p, d), _layout(p, d)
        del shape
        return f"wb.reshard(wb.reshard({nm}, wb.Mesh({other.tolist()}), " \
               f"{[str(q) for q in ps1]}), mesh, {[str(q) for q in ps2]})", \
            lambda t: wb.reshard(wb.reshard(t, other, ps1), p.mesh, ps2) if _moves(t) else t
    if k == "from_local":
        return f"DistTensor.from_local({nm}.locals(), mesh, {nm}.placements, " \
               f"shape={nm}.shape)", \
            lambda t: wb.DistTensor.from_local(t.locals(), p.mesh, t.placements,
                                               shape=t.shape) if _is_d(t) else t
    if k == "no_grad":
        g = rng.choice(["exp", "neg", "sigmoid", "abs", "square"])

        def f(t):
            with torch.no_grad():
                y = getattr(torch, g)(t)
            return t * 0.5 + y
        return f"with torch.no_grad(): y = torch.{g}({nm})\n{nm} * 0.5 + y", f
    if k == "detach_mix":
        return f"{nm} * {nm}.detach() + {nm}", lambda t: t * t.detach() + t
    if k == "nograd_leaf_inplace":    # init in place under no_grad, then used
        if not r.is_floating_point():
            return None
        yn, yd, yr = p.leaf(_suffix(rng, tuple(r.shape)), dtype=r.dtype)
        op, c = rng.choice([("mul_", 0.5), ("add_", 1.25), ("fill_", 0.75), ("zero_", None),
                            ("uniform_", None)])
        if op == "uniform_":
            op, c = "copy_", "torch.ones_like"

        def f(t):
            y = _pick(t, yd, yr)
            with torch.no_grad():
                if op == "copy_":
                    y.copy_(torch.ones_like(y) * 0.25)
                elif c is None:
                    getattr(y, op)()
                else:
                    getattr(y, op)(c)
            return t * y
        return f"with torch.no_grad(): {yn}.{op}({'' if c is None else c})\n{nm} * {yn}", f
    if k == "autocast":
        op = rng.choice(["matmul", "linear", "softmax", "cat", "prod", "mse_loss", "sum",
                         "bmm"])
        shape, nd = tuple(r.shape), r.dim()
        if not r.is_floating_point():
            return None
        y = None
        if op in ("matmul", "linear"):
            if not nd:
                return None
            ws = (shape[-1], rng.randint(1, 4)) if op == "matmul" else \
                (rng.randint(1, 4), shape[-1])
            y = p.leaf(ws, dtype=torch.float32)
        elif op == "bmm":
            if nd != 3:
                return None
            y = p.leaf((shape[0], shape[2], rng.randint(1, 3)), dtype=torch.float32)
        elif op in ("cat", "mse_loss"):
            if not nd and op == "cat":
                return None
            y = p.leaf(shape, dtype=rng.choice([torch.float32, torch.bfloat16]))
        dim = rng.randrange(nd) if nd else None
        p.half = True

        def call(t):
            x = t.float()
            w = _pick(t, y[1], y[2]) if y else None
            if op in ("matmul", "linear"):
                return getattr(torch, op)(x, w) if op == "matmul" else F.linear(x, w)
            if op == "bmm":
                return torch.bmm(x, w)
            if op == "softmax":
                return torch.softmax(x, dim if dim is not None else 0)
            if op == "cat":
                return torch.cat([x, w], dim)
            if op == "prod":
                return torch.prod(x.bfloat16(), dim) if dim is not None else torch.prod(x)
            if op == "mse_loss":
                return F.mse_loss(x.bfloat16(), w)
            return x.bfloat16().sum(dim) if dim is not None else x.sum()

        def f(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return call(t)
        return f"with torch.autocast('cpu', dtype=torch.bfloat16): {op}({nm}.float()" \
               f"{', ' + y[0] if y else ''}, dim={dim})", f
    return None


def _blas(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    a = round(rng.uniform(-1.5, 1.5), 2)
    b = round(rng.uniform(-1.5, 1.5), 2)
    if k == "addmm" and nd == 2:
        m = rng.randint(1, 4)
        wn, wd, wr = p.leaf((shape[1], m))
        cn, cd, cr = p.leaf(_suffix(rng, (shape[0], m)))
        return f"torch.addmm({cn}, {nm}, {wn}, beta={b}, alpha={a})", \
            lambda t: torch.addmm(_pick(t, cd, cr), t, _pick(t, wd, wr), beta=b, alpha=a)
    if k in ("baddbmm", "addbmm") and nd == 3:
        m = rng.randint(1, 3)
        wn, wd, wr = p.leaf((shape[0], shape[2], m))
        cs = (shape[0], shape[1], m) if k == "baddbmm" else (shape[1], m)
        cn, cd, cr = p.leaf(_suffix(rng, cs))
        f = getattr(torch, k)
        return f"torch.{k}({cn}, {nm}, {wn}, beta={b}, alpha={a})", \
            lambda t: f(_pick(t, cd, cr), t, _pick(t, wd, wr), beta=b, alpha=a)
    if k == "addmv" and nd == 2:
        vn, vd, vr = p.leaf((shape[1],))
        cn, cd, cr = p.leaf(_suffix(rng, (shape[0],)))
        return f"torch.addmv({cn}, {nm}, {vn}, beta={b}, alpha={a})", \
            lambda t: torch.addmv(_pick(t, cd, cr), t, _pick(t, vd, vr), beta=b, alpha=a)
    if k == "addr" and nd == 1:
        vn, vd, vr = p.leaf((rng.randint(0, 4),))
        cn, cd, cr = p.leaf(_suffix(rng, (shape[0], vr.shape[0])))
        return f"torch.addr({cn}, {nm}, {vn}, alpha={a})", \
            lambda t: torch.addr(_pick(t, cd, cr), t, _pick(t, vd, vr), alpha=a)
    if k in ("addcdiv", "addcmul"):
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        zn, zd, zr = p.leaf(_suffix(rng, shape), positive=True)
        f = getattr(torch, k)
        return f"torch.{k}({nm}, {yn}, {zn}, value={a})", \
            lambda t: f(t, _pick(t, yd, yr), _pick(t, zd, zr), value=a)
    if k == "mv" and nd == 2:
        vn, vd, vr = p.leaf((shape[1],))
        return f"torch.mv({nm}, {vn})", lambda t: torch.mv(t, _pick(t, vd, vr))
    if k == "dot" and nd == 1:
        vn, vd, vr = p.leaf(shape)
        return f"torch.dot({nm}, {vn})", lambda t: torch.dot(t, _pick(t, vd, vr))
    if k in ("outer", "ger") and nd == 1:
        vn, vd, vr = p.leaf((rng.randint(0, 4),))
        f = getattr(torch, k)
        return f"torch.{k}({nm}, {vn})", lambda t: f(t, _pick(t, vd, vr))
    if k == "tensordot" and nd >= 1:
        m = rng.randint(1, 3)
        wn, wd, wr = p.leaf((shape[-1], m))
        return f"torch.tensordot({nm}, {wn}, dims=1)", \
            lambda t: torch.tensordot(t, _pick(t, wd, wr), dims=1)
    if k == "cdist" and nd == 2:
        yn, yd, yr = p.leaf((rng.randint(1, 4), shape[1]))
        q = rng.choice([1.0, 2.0])
        return f"torch.cdist({nm}, {yn}, p={q})", lambda t: torch.cdist(t, _pick(t, yd, yr), p=q)
    if k == "cosine_similarity" and nd >= 1:
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        dim = rng.randrange(-nd, nd)
        return f"F.cosine_similarity({nm}, {yn}, {dim})", \
            lambda t: F.cosine_similarity(t, _pick(t, yd, yr), dim)
    if k == "dist":
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        q = rng.choice([1, 2, 3, float("inf")])
        return f"torch.dist({nm}, {yn}, {q})", lambda t: torch.dist(t, _pick(t, yd, yr), q)
    return None


def _shapes(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k == "diag" and nd in (1, 2):
        o = rng.randint(-2, 2)
        return f"torch.diag({nm}, {o})", lambda t: torch.diag(t, o)
    if k == "trace" and nd == 2:
        return f"torch.trace({nm})", lambda t: torch.trace(t)
    if k == "rot90" and nd >= 2:
        kk = rng.randint(-2, 3)
        dims = rng.sample(range(nd), 2)
        return f"torch.rot90({nm}, {kk}, {dims})", lambda t: torch.rot90(t, kk, dims)
    if k == "tensor_split" and nd:
        dim = rng.randrange(nd)
        if rng.random() < 0.5:
            n = rng.randint(1, 4)
            i = rng.randrange(n)
            return f"{nm}.tensor_split({n}, {dim})[{i}]", lambda t: t.tensor_split(n, dim)[i]
        ix = sorted(rng.randint(0, shape[dim] + 1) for _ in range(rng.randint(1, 2)))
        i = rng.randrange(len(ix) + 1)
        return f"{nm}.tensor_split({ix}, {dim})[{i}]", lambda t: t.tensor_split(ix, dim)[i]
    if k in ("hstack", "vstack"):
        yn, yd, yr = p.leaf(shape)
        f = getattr(torch, k)
        return f"torch.{k}([{nm}, {yn}])", lambda t: f([t, _pick(t, yd, yr)])
    return None


def _stats(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    dim = rng.randrange(-nd, nd) if nd else 0
    keep = rng.random() < 0.3
    if k == "kthvalue" and (not nd or shape[dim]):
        kk = rng.randint(1, shape[dim] if nd else 1)
        j = rng.randint(0, 1)
        return f"torch.kthvalue({nm}, {kk}, {dim}, keepdim={keep})[{j}]", \
            lambda t: torch.kthvalue(t, kk, dim, keepdim=keep)[j]
    if k == "median":
        if rng.random() < 0.4:
            return f"{nm}.median()", lambda t: t.median()
        j = rng.randint(0, 1)
        return f"{nm}.median({dim}, keepdim={keep})[{j}]", lambda t: t.median(dim, keepdim=keep)[j]
    if k == "nanmedian_all":
        return f"{nm}.log().nanmedian()", lambda t: t.log().nanmedian()
    if k == "nanmean":
        return f"{nm}.log().nanmean({dim}, keepdim={keep})", \
            lambda t: t.log().nanmean(dim, keepdim=keep)
    if k == "softmin":
        return f"F.softmin({nm}, {dim})", lambda t: F.softmin(t, dim)
    if k == "std_mean":
        j, cor = rng.randint(0, 1), rng.choice([0, 1])
        return f"torch.std_mean({nm}, {dim}, correction={cor}, keepdim={keep})[{j}]", \
            lambda t: torch.std_mean(t, dim, correction=cor, keepdim=keep)[j]
    if k == "matrix_norm" and nd >= 2:
        o = rng.choice(["fro", 1, -1, float("inf"), float("-inf")])
        return f"torch.linalg.matrix_norm({nm}, {o!r}, keepdim={keep})", \
            lambda t: torch.linalg.matrix_norm(t, o, keepdim=keep)
    if k == "topk_small" and nd and shape[dim]:
        kk = rng.randint(1, shape[dim])
        j = rng.randint(0, 1)
        return f"torch.topk({nm}, {kk}, {dim}, largest=False)[{j}]", \
            lambda t: torch.topk(t, kk, dim, largest=False)[j]
    if k == "round_dec":
        dec = rng.randint(-1, 2)
        return f"torch.round({nm} * 3, decimals={dec})", lambda t: torch.round(t * 3, decimals=dec)
    if k == "argwhere":
        return f"torch.argwhere({nm} > 0)", lambda t: torch.argwhere(t > 0)
    if k == "unique_consecutive":
        j = rng.randint(0, 1)
        if j:
            return f"torch.unique_consecutive(({nm} * 2).round(), return_counts=True)[1]", \
                lambda t: torch.unique_consecutive((t * 2).round(), return_counts=True)[1]
        return f"torch.unique_consecutive(({nm} * 2).round())", \
            lambda t: torch.unique_consecutive((t * 2).round())
    return None


def _losses(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    red = rng.choice(["mean", "sum", "none"])
    if k in ("l1_loss", "smooth_l1_loss", "huber_loss", "bce", "bce_logits", "kl_div"):
        yn, yd, yr = p.leaf(shape)
        if k == "l1_loss":
            return f"F.l1_loss({nm}, {yn}, reduction={red!r})", \
                lambda t: F.l1_loss(t, _pick(t, yd, yr), reduction=red)
        if k == "smooth_l1_loss":
            beta = rng.choice([0.5, 1.0])
            return f"F.smooth_l1_loss({nm}, {yn}, reduction={red!r}, beta={beta})", \
                lambda t: F.smooth_l1_loss(t, _pick(t, yd, yr), reduction=red, beta=beta)
        if k == "huber_loss":
            delta = rng.choice([0.5, 1.0])
            return f"F.huber_loss({nm}, {yn}, reduction={red!r}, delta={delta})", \
                lambda t: F.huber_loss(t, _pick(t, yd, yr), reduction=red, delta=delta)
        if k == "bce":
            return f"F.binary_cross_entropy({nm}.sigmoid(), {yn}.sigmoid(), " \
                   f"reduction={red!r})", \
                lambda t: F.binary_cross_entropy(t.sigmoid(), _pick(t, yd, yr).sigmoid(),
                                                 reduction=red)
        if k == "bce_logits":
            return f"F.binary_cross_entropy_with_logits({nm}, {yn}.sigmoid(), " \
                   f"reduction={red!r})", \
                lambda t: F.binary_cross_entropy_with_logits(t, _pick(t, yd, yr).sigmoid(),
                                                             reduction=red)
        red = rng.choice(["batchmean", "sum", "none", "mean"])
        return f"F.kl_div(F.log_softmax({nm}, -1), {yn}.softmax(-1), reduction={red!r})", \
            lambda t: F.kl_div(F.log_softmax(t, -1), _pick(t, yd, yr).softmax(-1),
                               reduction=red) if nd else F.kl_div(t, _pick(t, yd, yr),
                                                                  reduction=red)
    if k == "nll_loss" and nd == 2 and shape[1]:
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        tgt = torch.randint(0, shape[1], (shape[0],), generator=g)
        return f"F.nll_loss(F.log_softmax({nm}, 1), torch.tensor({tgt.tolist()}), " \
               f"reduction={red!r})", \
            lambda t: F.nll_loss(F.log_softmax(t, 1), tgt, reduction=red)
    return None


def _nn(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k == "conv2d" and nd in (3, 4) and shape[-3] and min(shape[-2:]) >= 1:
        co = rng.randint(1, 3)
        kh, kw = rng.randint(1, min(2, shape[-2])), rng.randint(1, min(2, shape[-1]))
        wn, wd, wr = p.leaf((co, shape[-3], kh, kw))
        st, pad = rng.randint(1, 2), rng.randint(0, 1)
        return f"F.conv2d({nm}, {wn}, stride={st}, padding={pad})", \
            lambda t: F.conv2d(t, _pick(t, wd, wr), stride=st, padding=pad)
    if k == "conv3d" and nd == 4 and shape[0] and min(shape[1:]) >= 1:
        wn, wd, wr = p.leaf((rng.randint(1, 2), shape[0], 1, min(2, shape[2]), 1))
        return f"F.conv3d({nm}, {wn})", lambda t: F.conv3d(t, _pick(t, wd, wr))
    if k in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d") and nd in (3, 4) \
            and min(shape[-2:]) >= 2:
        f = getattr(F, k)
        a = rng.randint(1, 3) if k.startswith("adaptive") else rng.randint(1, 2)
        return f"F.{k}({nm}, {a})", lambda t: f(t, a)
    if k == "sdpa" and nd in (3, 4):
        kn, kd, kr = p.leaf(shape[:-2] + (rng.randint(1, 4), shape[-1]))
        vn, vd, vr = p.leaf(tuple(kr.shape[:-1]) + (rng.randint(1, 3),))
        causal = rng.random() < 0.3
        return f"F.scaled_dot_product_attention({nm}, {kn}, {vn}, is_causal={causal})", \
            lambda t: F.scaled_dot_product_attention(t, _pick(t, kd, kr), _pick(t, vd, vr),
                                                     is_causal=causal)
    if k == "polar":
        return f"torch.view_as_real(torch.polar({nm}.abs(), {nm})) * 1", \
            lambda t: torch.view_as_real(torch.polar(t.abs(), t)) * 1
    if k == "view_as_complex" and nd and shape[-1] and shape[-1] % 2 == 0:
        return f"torch.view_as_complex({nm}.unflatten(-1, (-1, 2)).contiguous()) * 2", \
            lambda t: torch.view_as_complex(t.unflatten(-1, (-1, 2)).contiguous()) * 2
    if k == "pow_t":
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        return f"torch.pow({nm}.abs() + 0.5, {yn})", \
            lambda t: torch.pow(t.abs() + 0.5, _pick(t, yd, yr))
    if k == "clamp_t":
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        kw = rng.choice(["min", "max"])
        return f"torch.clamp({nm}, {kw}={yn})", \
            lambda t: torch.clamp(t, **{kw: _pick(t, yd, yr)})
    if k == "foreach":
        yn, yd, yr = p.leaf(shape)
        op = rng.choice(["add", "mul", "maximum", "norm", "lerp", "addcmul"])
        if op == "norm":
            return f"torch._foreach_norm([{nm}, {yn}])[0]", \
                lambda t: torch._foreach_norm([t, _pick(t, yd, yr)])[0]
        if op == "lerp":
            return f"torch._foreach_lerp([{nm}], [{yn}], 0.25)[0]", \
                lambda t: torch._foreach_lerp([t], [_pick(t, yd, yr)], 0.25)[0]
        if op == "addcmul":
            return f"torch._foreach_addcmul([{nm}], [{yn}], [{yn}], 0.5)[0]", \
                lambda t: torch._foreach_addcmul([t], [_pick(t, yd, yr)], [_pick(t, yd, yr)],
                                                 0.5)[0]
        f = getattr(torch, f"_foreach_{op}")
        return f"torch._foreach_{op}([{nm}, {yn}], [{yn}, {nm}])[1]", \
            lambda t: f([t, _pick(t, yd, yr)], [_pick(t, yd, yr), t])[1]
    if k == "allclose":
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        fn = rng.choice(["allclose", "equal"])
        if fn == "equal":
            return f"{nm} * float(torch.equal({nm}, {nm}.clone()))", \
                lambda t: t * float(torch.equal(t, t.clone()))
        return f"{nm} * float(torch.allclose({nm}, {yn}, atol=3.0))", \
            lambda t: t * float(torch.allclose(t, _pick(t, yd, yr), atol=3.0))
    return None


def _ints(p, shape, dtype=torch.int64):
    """A leaf of small integers (-4..4) of ``dtype``."""
    return p.leaf(shape, dtype=dtype)


def _new15(p, cur, k):
    """sweep15: the registered ops no kind drew before (benchmarks/op_coverage.py: 15 of
    223) and compositions of the op table never drawn (pairwise_distance, vdot, norm,
    linalg.norm, index_put, more ``_foreach`` ops), their arguments in torch's domains:
    igamma's a > 0 and x >= 0, zeta's x > 1 and q > 0, xlog1py's y > -1, gcd / lcm on
    integers, multinomial on one-hot rows (a deterministic draw); a call outside them now
    and then (a float gcd, a too-large unfold size, renorm of a 1-d tensor) is torch's
    refusal to match."""
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    fl = r.dtype.is_floating_point
    dim = rng.randrange(-nd, nd) if nd else 0
    keep = rng.random() < 0.3
    if k == "convolution" and nd in (3, 4) and shape[1] and min(shape[2:]) >= 1:
        kd, cin = nd - 2, shape[1]
        groups = rng.choice([g for g in (1, 2, cin) if cin % g == 0])
        co = groups * rng.randint(1, 2)
        kern = tuple(rng.randint(1, min(2, s)) for s in shape[2:])
        wdt = r.dtype if fl else torch.float64
        wn, wd, wr = p.leaf((co, cin // groups) + kern, dtype=wdt)
        b = p.leaf((co,), dtype=wdt) if rng.random() < 0.5 else None
        st = [rng.randint(1, 2) for _ in range(kd)]
        pad = [rng.randint(0, 1) for _ in range(kd)]
        dil = [rng.choice([1, 1, 2]) for _ in range(kd)]
        return f"torch.convolution({nm}, {wn}, {b[0] if b else None}, {st}, {pad}, {dil}, " \
               f"False, {[0] * kd}, {groups})", \
            lambda t: torch.convolution(t, _pick(t, wd, wr), _pick(t, b[1], b[2]) if b else None,
                                        st, pad, dil, False, [0] * kd, groups)
    if k == "gcd_lcm":
        fn = rng.choice(["gcd", "lcm"])
        f = getattr(torch, fn)
        yn, yd, yr = _ints(p, _suffix(rng, shape),
                           r.dtype if r.dtype in (torch.int32, torch.uint8) and
                           rng.random() < 0.5 else torch.int64)
        if r.dtype in (torch.int64, torch.int32, torch.uint8) or rng.random() < 0.1:
            return f"torch.{fn}({nm}, {yn})", lambda t: f(t, _pick(t, yd, yr))
        if r.dtype.is_complex:
            return None
        return f"torch.{fn}(({nm} * 3).long(), {yn})", \
            lambda t: f((t * 3).long(), _pick(t, yd, yr))
    if k == "igamma":
        if r.dtype == torch.bool:
            return None
        fn = rng.choice(["torch.igamma", "torch.igammac", "torch.special.gammainc",
                         "torch.special.gammaincc"])
        f = eval(fn)
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        if rng.random() < 0.8:       # cur as x (torch has a gradient for x only)
            return f"{fn}({yn}.detach().abs() + 0.5, {nm}.abs())", \
                lambda t: f(_pick(t, yd, yr).detach().abs() + 0.5, t.abs())
        return f"{fn}({nm}.abs() + 0.5, {yn}.abs())", \
            lambda t: f(t.abs() + 0.5, _pick(t, yd, yr).abs())
    if k == "ldexp":
        if rng.random() < 0.8:
            en, ed, er = _ints(p, _suffix(rng, shape))
        else:
            en, ed, er = p.leaf(_suffix(rng, shape))
        return f"torch.ldexp({nm}, {en})", lambda t: torch.ldexp(t, _pick(t, ed, er))
    if k == "logaddexp":
        fn = rng.choice(["logaddexp", "logaddexp2"])
        yn, yd, yr = p.leaf(_suffix(rng, shape),
                            dtype=r.dtype if fl and rng.random() < 0.3 else torch.float64)
        if rng.random() < 0.3:
            return f"{nm}.{fn}({yn})", lambda t: getattr(t, fn)(_pick(t, yd, yr))
        f = getattr(torch, fn)
        return f"torch.{fn}({yn}, {nm})", lambda t: f(_pick(t, yd, yr), t)
    if k == "nextafter":
        yn, yd, yr = p.leaf(_suffix(rng, shape),
                            dtype=r.dtype if fl and rng.random() < 0.8 else torch.float64)
        if not fl:
            return f"torch.nextafter({nm}, {yn})", lambda t: torch.nextafter(t, _pick(t, yd, yr))
        if rng.random() < 0.5:
            return f"{nm} * 0.5 + torch.nextafter({nm}.detach(), {yn}.detach())", \
                lambda t: t * 0.5 + torch.nextafter(t.detach(), _pick(t, yd, yr).detach())
        # the step's direction, exact (a step scaled up to be read, t + (next - t) * 2^52,
        # read a Partial t's parts' rounding instead: seed 5000120, float32 P(sum))
        return f"{nm} + torch.nextafter({nm}.detach(), {yn}.detach()).gt({nm}.detach())", \
            lambda t: t + torch.nextafter(t.detach(), _pick(t, yd, yr).detach()).gt(t.detach())
    if k == "mode":
        j = rng.randint(0, 1)
        if fl or r.dtype.is_complex:
            if r.dtype.is_complex:
                return None
            return f"torch.mode(({nm} * 2).round(), {dim}, keepdim={keep})[{j}]", \
                lambda t: torch.mode((t * 2).round(), dim, keepdim=keep)[j]
        return f"{nm}.mode({dim}, {keep})[{j}]", lambda t: t.mode(dim, keep)[j]
    if k == "multinomial" and nd in (1, 2) and shape[-1] and fl:
        n, rep = shape[-1], rng.random() < 0.7
        kk = rng.randint(1, 3) if rep else 1
        return f"torch.multinomial(F.one_hot({nm}.argmax(-1), {n}).double(), {kk}, " \
               f"replacement={rep})", \
            lambda t: torch.multinomial(F.one_hot(t.argmax(-1), n).double(), kk,
                                        replacement=rep)
    if k == "renorm" and (nd >= 2 or rng.random() < 0.1):
        q = rng.choice([1, 2, 3, 1.5])
        mx = round(rng.uniform(0.2, 3.0), 2)
        return f"torch.renorm({nm}, {q}, {dim}, {mx})", lambda t: torch.renorm(t, q, dim, mx)
    if k == "unfold":
        n = shape[dim] if nd else 1
        size = rng.randint(0, n + 1) if rng.random() < 0.15 else rng.randint(min(1, n), n)
        step = rng.randint(1, 3)
        return f"{nm}.unfold({dim}, {size}, {step})", lambda t: t.unfold(dim, size, step)
    if k == "xlog1py":
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        c = rng.random()
        if c < 0.2:
            v = round(rng.uniform(0, 2), 2)
            return f"torch.special.xlog1py({nm}, {v})", \
                lambda t: torch.special.xlog1py(t, v)
        if c < 0.6 or r.dtype == torch.bool:
            return f"torch.special.xlog1py({nm}, {yn}.abs())", \
                lambda t: torch.special.xlog1py(t, _pick(t, yd, yr).abs())
        return f"torch.special.xlog1py({yn}, {nm}.abs())", \
            lambda t: torch.special.xlog1py(_pick(t, yd, yr), t.abs())
    if k == "zeta":
        if r.dtype == torch.bool or r.dtype.is_complex:
            return None
        if rng.random() < 0.5:
            c = rng.choice([1.5, 2.0, 3.0])
            return f"torch.special.zeta({c}, {nm}.abs() + 0.5)", \
                lambda t: torch.special.zeta(c, t.abs() + 0.5)
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        return f"torch.special.zeta({yn}.detach().abs() + 1.5, {nm}.abs() + 0.5)", \
            lambda t: torch.special.zeta(_pick(t, yd, yr).detach().abs() + 1.5, t.abs() + 0.5)
    if k == "pairwise_distance" and nd:
        yn, yd, yr = p.leaf(_suffix(rng, shape), dtype=r.dtype if fl else torch.float64)
        q = rng.choice([1.0, 2.0, 3.0, float("inf")])
        eps = rng.choice([1e-6, 0.0, 0.1])
        return f"F.pairwise_distance({nm}, {yn}, p={q}, eps={eps}, keepdim={keep})", \
            lambda t: F.pairwise_distance(t, _pick(t, yd, yr), p=q, eps=eps, keepdim=keep)
    if k == "vdot" and nd == 1:
        yn, yd, yr = p.leaf(shape, dtype=r.dtype)
        return f"torch.vdot({nm}, {yn})", lambda t: torch.vdot(t, _pick(t, yd, yr))
    if k == "norm":
        q = rng.choice([1, 2, 3, float("inf"), "fro", 0.5])
        if q == "fro" or not nd or rng.random() < 0.3:
            q = 2 if q == 0.5 else q
            return f"torch.norm({nm}, {q!r})", lambda t: torch.norm(t, q)
        if rng.random() < 0.5:
            return f"torch.norm({nm}, {q!r}, {dim}, keepdim={keep})", \
                lambda t: torch.norm(t, q, dim, keep)
        return f"torch.linalg.norm({nm}, {q!r}, {dim}, keepdim={keep})", \
            lambda t: torch.linalg.norm(t, q, dim, keep)
    if k == "index_put" and nd and shape[0]:
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        idx = torch.randint(0, shape[0], (rng.randint(1, 4),), generator=g)
        acc = rng.random() < 0.5
        vn, vd, vr = p.leaf(_suffix(rng, (len(idx),) + shape[1:]),
                            dtype=r.dtype if r.dtype != torch.bool else torch.bool)
        return f"torch.index_put({nm}, (torch.tensor({idx.tolist()}),), {vn}, " \
               f"accumulate={acc})", \
            lambda t: torch.index_put(t, (idx,), _pick(t, vd, vr), accumulate=acc)
    if k == "foreach2":
        yn, yd, yr = p.leaf(shape, dtype=r.dtype if fl else torch.float64)
        op = rng.choice(["sub", "div", "minimum", "clamp_min", "clamp_max", "pow", "neg",
                         "exp", "sqrt", "abs", "sign", "reciprocal", "addcdiv", "add_",
                         "mul_", "lerp_"])
        if op in ("neg", "exp", "sqrt", "abs", "sign", "reciprocal"):
            f = getattr(torch, f"_foreach_{op}")
            return f"torch._foreach_{op}([{yn}, {nm}])[1]", lambda t: f([_pick(t, yd, yr), t])[1]
        if op == "addcdiv":
            return f"torch._foreach_addcdiv([{nm}], [{yn}], [{yn}.abs() + 1], 0.5)[0]", \
                lambda t: torch._foreach_addcdiv([t], [_pick(t, yd, yr)],
                                                 [_pick(t, yd, yr).abs() + 1], 0.5)[0]
        if op.endswith("_"):         # in place on copies: the copies are the result
            c = 0.5

            def fi(t):
                a = [t.clone(), _pick(t, yd, yr).clone()]
                if op == "lerp_":
                    torch._foreach_lerp_(a, [_pick(t, yd, yr), t], c)
                else:
                    getattr(torch, f"_foreach_{op}")(a, [_pick(t, yd, yr), t])
                return a[0] + a[1]
            return f"a = [{nm}.clone(), {yn}.clone()]; torch._foreach_{op}(a, [{yn}, {nm}]" \
                   f"{', 0.5' if op == 'lerp_' else ''}); a[0] + a[1]", fi
        if op in ("clamp_min", "clamp_max", "pow") and rng.random() < 0.5:
            c = round(rng.uniform(0.5, 2), 2)
            f = getattr(torch, f"_foreach_{op}")
            return f"torch._foreach_{op}([{nm}], {c})[0]", lambda t: f([t], c)[0]
        f = getattr(torch, f"_foreach_{op}")
        return f"torch._foreach_{op}([{nm}, {yn}], [{yn}, {nm}])[0]", \
            lambda t: f([t, _pick(t, yd, yr)], [_pick(t, yd, yr), t])[0]
    return None


def _complex18(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k == "conj":
        return f"{nm}.conj()", lambda t: t.conj()
    if k == "real_imag":
        part = "imag" if r.is_complex() and rng.random() < 0.5 else "real"
        return f"{nm}.{part}", lambda t: getattr(t, part)
    if k == "conj_physical":
        return f"torch.conj_physical({nm})", lambda t: torch.conj_physical(t)
    if k == "angle":
        return f"torch.angle({nm})", lambda t: torch.angle(t)
    if k == "resolve":
        return f"{nm}.conj().resolve_conj() * 1", lambda t: t.conj().resolve_conj() * 1
    if k == "cumsum_int" and nd:
        dim = rng.randrange(-nd, nd)
        dt = rng.choice([torch.int64, torch.int32])
        return f"{nm}.cumsum({dim}, dtype={dt})", lambda t: t.cumsum(dim, dtype=dt)
    if k == "adjoint" and nd >= 2:
        return f"{nm}.mH", lambda t: t.mH
    return None


PROGRAM = ("redistribute", "redistribute2", "reshard_mesh", "from_local", "no_grad",
           "detach_mix", "nograd_leaf_inplace", "autocast")
BLAS = ("addmm", "baddbmm", "addbmm", "addmv", "addr", "addcdiv", "addcmul", "mv", "dot",
        "outer", "ger", "tensordot", "cdist", "cosine_similarity", "dist")
SHAPES = ("diag", "trace", "rot90", "tensor_split", "hstack", "vstack")
STATS = ("kthvalue", "median", "nanmedian_all", "nanmean", "softmin", "std_mean",
         "matrix_norm", "topk_small", "round_dec", "argwhere", "unique_consecutive")
LOSSES = ("l1_loss", "smooth_l1_loss", "huber_loss", "bce", "bce_logits", "kl_div", "nll_loss")
NN = ("conv2d", "conv3d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "sdpa", "polar",
      "view_as_complex", "pow_t", "clamp_t", "foreach", "allclose")
# sweep15: benchmarks/op_coverage.py's registered ops never drawn, and compositions
NEW15 = ("convolution", "gcd_lcm", "igamma", "ldexp", "logaddexp", "nextafter", "mode",
         "multinomial", "renorm", "unfold", "xlog1py", "zeta", "pairwise_distance", "vdot",
         "norm", "index_put", "foreach2")
WIDE = PROGRAM + BLAS + SHAPES + STATS + LOSSES + NN + NEW15
# sweep18: the complex views and ops (conj's lazy bit, real / imag written in place through
# the harness's in-place kinds) and integer scans of floats; drawn only with
# ``benchmarks/random_sweep.py --focus COMPLEX18`` (not in WIDE: the pinned wide seeds of
# tests/test_sweep*.py keep the programs they were found with)
COMPLEX18 = ("conj", "real_imag", "conj_physical", "angle", "resolve", "cumsum_int", "adjoint")
# the wide space before NEW15: tests/compile_probe.py draws from it, so that the probe's
# pinned seeds (test_compile12 / 14 / 15) keep the programs they were found with
WIDE14 = PROGRAM + BLAS + SHAPES + STATS + LOSSES + NN


def build(p, cur, k):
    """``(text, f)`` for wide kind ``k`` on ``cur``, or None (the kind does not fit)."""
    for kinds, b in ((PROGRAM, _program), (BLAS, _blas), (SHAPES, _shapes), (STATS, _stats),
                     (LOSSES, _losses), (NN, _nn), (NEW15, _new15), (COMPLEX18, _complex18)):
        if k in kinds:
            return b(p, cur, k)
    return None


BACKWARDS = ("sum", "gradient", "twice", "autograd_grad")
BACKWARD_TEXT = {"sum": "({nm} * g).sum().backward()", "gradient": "{nm}.backward(g)",
                 "twice": "({nm} * g).sum().backward(retain_graph=True); "
                          "({nm} * g).sum().backward()",
                 "autograd_grad": "torch.autograd.grad(({nm} * g).sum(), leaves, "
                                  "allow_unused=True)"}


def backward(form, out, g, leaves):
    """Backpropagate ``g`` from ``out`` (a DistTensor, or one device's tensor) in ``form``:
    each leaf's gradient (``.grad``, or ``torch.autograd.grad``'s; None where none)."""
    if form == "autograd_grad":
        grads = iter(torch.autograd.grad((out * g).sum(), [x for x in leaves if x.requires_grad],
                                         allow_unused=True))
        return [next(grads) if x.requires_grad else None for x in leaves]
    if form == "gradient":
        out.backward(g)
    elif form == "twice":
        (out * g).sum().backward(retain_graph=True)
        (out * g).sum().backward()
    else:
        (out * g).sum().backward()
    return [x.grad for x in leaves]
