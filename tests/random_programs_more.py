"""More op kinds for the random programs of ``tests/random_programs.py``: the registered
ops (``workbench/parallel/ops_table``) its first 33 kinds never drew.

Each builder ``b(p, cur) -> (text, f) | None`` draws its arguments from ``p.rng`` (and new
leaves from ``p.leaf``) for ``cur = (name, dist, ref)``; ``f`` runs on the DistTensor and
on the plain tensor alike (``_pick`` chooses a leaf's side).  Kinds: unary and binary
pointwise ops (type promotion with float32 / int64 / 0-d operands), reductions over dims
and dim tuples, scans, order statistics (sort, topk, quantile, searchsorted), shape ops,
indexing (gather, scatter, index_*, masked_*, boolean masks), nn ops (norms, linear,
einsum, embedding, cross entropy), casts, and in-place writes: ``clone().op_()``,
``x[idx] = v``, and an in-place op on a view of a copy (the copy is the result)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import workbench as wb


def _pick(t, d, r):
    """The DistTensor side ``d`` for a DistTensor ``t``, else the plain side ``r``."""
    return d if isinstance(t, wb.DistTensor) else r


def _dims(rng, nd):
    """A tuple of distinct dims (1..nd of them), some negative."""
    k = rng.randint(1, nd)
    ds = rng.sample(range(nd), k)
    return tuple(d - nd if rng.random() < 0.3 else d for d in ds)


def vwrite(t, index, op, *args):
    """``v = t.clone(); getattr(v[index], op)(*args); return v``: an in-place op on a view."""
    v = t.clone()
    getattr(v[index], op)(*args)
    return v


def setitem(t, index, value):
    """``v = t.clone(); v[index] = value; return v``."""
    v = t.clone()
    v[index] = value
    return v


def _idx_text(idx):
    return "(" + ", ".join(f"slice({s.start}, {s.stop})" if isinstance(s, slice) else repr(s)
                           for s in idx) + ",)"


def _basic_index(rng, shape):
    """A basic index of ``shape``: an int, or a slice on each of the first dims."""
    idx = []
    for s in shape[:rng.randint(1, len(shape))]:
        if s and rng.random() < 0.3:
            idx.append(rng.randrange(s))
        else:
            a = rng.randint(0, s)
            idx.append(slice(a, rng.randint(a, s)))
    return tuple(idx)


UNARY = {
    "sin": torch.sin, "cos": torch.cos, "atan": torch.atan, "asinh": torch.asinh,
    "erf": torch.erf, "expm1": torch.expm1, "silu": F.silu, "gelu": F.gelu,
    "softplus": F.softplus, "mish": F.mish, "square": torch.square, "sign": torch.sign,
    "floor": torch.floor, "round": torch.round, "frac": torch.frac, "logsigmoid": F.logsigmoid,
    "elu": F.elu, "hardtanh": F.hardtanh, "sinc": torch.sinc, "hardswish": F.hardswish,
    "relu6": F.relu6, "selu": F.selu, "softsign": F.softsign, "tanhshrink": F.tanhshrink,
    "hardshrink": F.hardshrink, "rad2deg": torch.rad2deg, "positive": torch.positive,
    "signbit": torch.signbit, "isnan": torch.isnan, "isinf": torch.isinf,
    "reciprocal": torch.reciprocal, "rsqrt": torch.rsqrt, "log1p": torch.log1p,
    "log": torch.log, "sqrt": torch.sqrt, "digamma": torch.digamma, "logit": torch.logit,
}
BINARY = {
    "minimum": torch.minimum, "atan2": torch.atan2, "fmax": torch.fmax, "fmin": torch.fmin,
    "hypot": torch.hypot, "copysign": torch.copysign, "remainder": torch.remainder,
    "floor_divide": torch.floor_divide, "xlogy": torch.xlogy, "eq": torch.eq, "lt": torch.lt,
    "ge": torch.ge, "logical_and": torch.logical_and, "heaviside": torch.heaviside,
    "float_power": torch.float_power, "isclose": torch.isclose,
}
REDUCE = {  # name -> text template over x (the tensor), d (dims), k (keepdim)
    "prod": "torch.prod(x, {d0}, keepdim={k})", "amin": "torch.amin(x, {d}, keepdim={k})",
    "argmax": "torch.argmax(x, {d0}, keepdim={k})", "argmin": "x.argmin({d0})",
    "max_dim": "x.max({d0}, keepdim={k})[0]", "max_idx": "x.max({d0})[1]",
    "min_dim": "x.min({d0}, keepdim={k})[0]", "sum_dims": "x.sum({d}, keepdim={k})",
    "mean_dims": "x.mean({d}, keepdim={k})", "var": "torch.var(x, {d}, keepdim={k})",
    "std": "x.std({d0}, correction=0)", "logsumexp": "torch.logsumexp(x, {d}, keepdim={k})",
    "norm": "torch.linalg.vector_norm(x, 2, {d}, keepdim={k})", "nansum": "torch.nansum(x, {d})",
    "count_nonzero": "torch.count_nonzero(x, {d0})", "all": "torch.all(x > 0, {d0})",
    "any": "(x > 0).any({d0}, keepdim={k})", "cumsum": "torch.cumsum(x, {d0})",
    "cumprod": "x.cumprod({d0})", "logcumsumexp": "torch.logcumsumexp(x, {d0})",
    "cummax": "torch.cummax(x, {d0})[0]", "cummin": "torch.cummin(x, {d0})[1]",
    "sort": "torch.sort(x, {d0}, descending={k})[0]", "sort_idx": "x.sort({d0})[1]",
    "argsort": "torch.argsort(x, {d0})", "msort": "torch.msort(x)",
    "quantile": "torch.quantile(x, {q}, {d0}, keepdim={k})",
    "quantile_all": "torch.quantile(x, {q})",
    "nanquantile": "torch.nanquantile(x, torch.tensor([0.1, {q}], dtype=x.dtype), {d0})",
    "flip": "torch.flip(x, {d})", "roll": "torch.roll(x, {s}, {d0})",
    "softmax_neg": "F.softmax(x, {d0})", "diff": "torch.diff(x, dim={d0})",
    "cumsum_int": "torch.cumsum(x, {d0}, dtype=torch.float32)",
    "amax_tuple": "x.amax({d}, keepdim={k})",
    "sum_dtype": "x.sum({d0}, dtype=torch.float32)",
    "layer_norm": "F.layer_norm(x, x.shape[-1:])", "rms_norm": "F.rms_norm(x, x.shape[-1:])",
    "normalize": "F.normalize(x, dim={d0})", "glu2": "F.glu(torch.cat([x, x], {d0}), {d0})",
}
SHAPE = {  # nd >= 2 unless noted
    "tril": "torch.tril(x, {o})", "triu": "x.triu({o})",
    "diagonal": "torch.diagonal(x, {o}, {a}, {b})", "mT": "x.mT", "swapaxes": "x.swapaxes({a}, {b})",
    "movedim": "torch.movedim(x, {a}, {b})",
}
CASTS = {
    "float": "x.float()", "to32": "x.to(torch.float32)", "double": "x.double()",
    "bf16_rt": "x.to(torch.bfloat16).double()", "half_rt": "x.half().to(torch.float64)",
    "long": "x.long()", "bool": "x.bool()", "int_rt": "x.int().double()",
    "contiguous": "x.contiguous()", "clone": "x.clone()", "detach": "x.detach() * 1",
    "neg_int_scalar": "x * 2", "int_div": "x / 3", "pow2": "x ** 2", "pow3": "torch.pow(x, 3)",
    "clamp": "torch.clamp(x, -0.5, 0.7)", "clamp_min": "x.clamp(min=0.1)",
    "nan_to_num": "torch.nan_to_num(x.log(), neginf=-3.0)", "leaky": "F.leaky_relu(x, 0.2)",
    "threshold": "F.threshold(x, 0.1, 2.0)", "softshrink": "F.softshrink(x, 0.3)",
    "celu": "F.celu(x)", "hardsigmoid": "F.hardsigmoid(x)", "trunc": "torch.trunc(x * 3)",
    "exp2": "torch.exp2(x)", "log2abs": "torch.log2(x.abs() + 0.5)",
    "erfinv": "torch.erfinv(x.tanh() * 0.9)", "lgamma": "torch.lgamma(x.abs() + 0.5)",
    "ceil": "x.ceil()", "deg2rad": "torch.deg2rad(x)", "sgn": "torch.sgn(x)",
    "isfinite": "torch.isfinite(x)", "logical_not": "torch.logical_not(x > 0)",
    "bitwise_not": "~(x > 0)", "isneginf": "torch.isneginf(x.log())",
    "tan": "torch.tan(x * 0.5)", "cosh": "torch.cosh(x)", "sinh": "x.sinh()",
    "acos": "torch.acos(x.tanh() * 0.9)", "asin": "x.tanh().asin()", "erfc": "torch.erfc(x)",
    "log10": "torch.log10(x.abs() + 0.1)", "sqrt_abs": "(x.abs() + 0.5).sqrt()",
}
INPLACE = {  # the copy's in-place op (a leaf that requires grad refuses in-place ops)
    "add_": "x.clone().add_({c})", "mul_": "x.clone().mul_({c})", "relu_": "x.clone().relu_()",
    "clamp_": "x.clone().clamp_({c}, 1.5)", "exp_": "x.clone().exp_()",
    "zero_": "x.clone().zero_()", "fill_": "x.clone().fill_({c})", "neg_": "x.clone().neg_()",
    "sigmoid_": "x.clone().sigmoid_()", "iadd": "x.clone().__iadd__({c})",
    "imul_t": "x.clone().__imul__(x)", "div_": "x.clone().div_({c})",
    "detach_mul_": "x.detach().clone().mul_({c})", "F_relu_inplace": "F.relu(x.clone(), inplace=True)",
    "unsqueeze_": "x.clone().unsqueeze_(0)",
}


def _unary(p, cur, k):
    nm, d, r = cur
    f = UNARY[k]
    mod = "F" if f.__module__ == "torch.nn.functional" else "torch"
    return f"{mod}.{k}({nm})", f


def _binary(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    ys = list(r.shape)
    if ys and rng.random() < 0.5:
        ys = ys[rng.randrange(len(ys) + 1):]
    ys = [1 if rng.random() < 0.2 else s for s in ys]
    dtype = rng.choice([torch.float64, torch.float64, torch.float32, torch.int64])
    if k in ("atan2", "hypot", "copysign", "xlogy", "heaviside", "float_power", "isclose",
             "remainder", "floor_divide") and dtype == torch.int64:
        dtype = torch.float64
    yn, yd, yr = p.leaf(tuple(ys), positive=k in ("remainder", "floor_divide"), dtype=dtype)
    f = BINARY[k]
    if rng.random() < 0.3:       # the other order
        return f"torch.{k}({yn}, {nm})", lambda t: f(_pick(t, yd, yr), t)
    return f"torch.{k}({nm}, {yn})", lambda t: f(t, _pick(t, yd, yr))


def _template(p, cur, k, table):
    rng = p.rng
    nm, d, r = cur
    nd = r.dim()
    if nd == 0 and any(s in table[k] for s in ("{a", "{o")):
        return None
    if table is SHAPE and nd < 2:
        return None
    args = dict(k=rng.random() < 0.3, q=round(rng.random(), 2), c=round(rng.uniform(-2, 2), 2),
                s=rng.randint(-3, 3), o=rng.randint(-2, 2))
    if not nd:                   # a 0-d tensor takes dim 0 / -1 (its one element)
        args["d0"] = rng.choice([0, -1])
        args["d"] = (args["d0"],)
    else:
        args["d0"] = rng.randrange(-nd, nd)
        args["d"] = _dims(rng, nd)
        a, b = rng.sample(range(nd), 2) if nd >= 2 else (0, 0)
        args["a"], args["b"] = a, b
    src = table[k].format(**args)
    code = compile(src, "<random program>", "eval")
    return re.sub(r"\bx\b", nm, src), (lambda t: eval(code, {"torch": torch, "F": F, "x": t}))


def _matmuls(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k == "linear" and nd >= 1:
        wn, wd, wr = p.leaf((rng.randint(1, 5), shape[-1]))
        bn, bd, br = p.leaf((wr.shape[0],))
        return f"F.linear({nm}, {wn}, {bn})", \
            lambda t: F.linear(t, _pick(t, wd, wr), _pick(t, bd, br))
    if k == "mm" and nd == 2:
        wn, wd, wr = p.leaf((shape[1], rng.randint(1, 4)))
        return f"torch.mm({nm}, {wn})", lambda t: torch.mm(t, _pick(t, wd, wr))
    if k == "bmm" and nd == 3:
        wn, wd, wr = p.leaf((shape[0], shape[2], rng.randint(1, 4)))
        return f"torch.bmm({nm}, {wn})", lambda t: torch.bmm(t, _pick(t, wd, wr))
    if k == "einsum" and nd >= 2:
        wn, wd, wr = p.leaf((shape[-1], rng.randint(1, 4)))
        return f"torch.einsum('...ij,jk->...ik', {nm}, {wn})", \
            lambda t: torch.einsum("...ij,jk->...ik", t, _pick(t, wd, wr))
    if k == "matmul_vec" and nd >= 1:
        wn, wd, wr = p.leaf((shape[-1],))
        return f"{nm} @ {wn}", lambda t: t @ _pick(t, wd, wr)
    return None


def _indexing(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if not nd or 0 in shape:
        return None
    dim = rng.randrange(nd)
    n = shape[dim]
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    if k == "index_select":
        idx = torch.randint(0, n, (rng.randint(0, 5),), generator=g)
        return f"torch.index_select({nm}, {dim}, torch.tensor({idx.tolist()}, dtype=torch.long))", \
            lambda t: torch.index_select(t, dim, idx)
    if k == "gather":
        ish = list(shape)
        ish[dim] = rng.randint(1, 4)
        idx = torch.randint(0, n, ish, generator=g)
        return f"torch.gather({nm}, {dim}, <index {ish}>)", lambda t: torch.gather(t, dim, idx)
    if k == "take":
        idx = torch.randint(0, r.numel(), (rng.randint(1, 5),), generator=g)
        return f"torch.take({nm}, torch.tensor({idx.tolist()}))", lambda t: torch.take(t, idx)
    if k == "adv_index":
        idx = torch.randint(0, n, (rng.randint(1, 4),), generator=g)
        ix = (slice(None),) * dim + (idx,)
        return f"{nm}[{':, ' * dim}torch.tensor({idx.tolist()})]", lambda t: t[ix]
    if k == "int_index":
        i = rng.randrange(-n, n)
        ix = (slice(None),) * dim + (i,)
        return f"{nm}[{':, ' * dim}{i}]", lambda t: t[ix]
    if k == "none_index":
        return f"{nm}[..., None]", lambda t: t[..., None]
    if k == "bool_mask":
        return f"{nm}[{nm} > 0]", lambda t: t[t > 0]
    if k == "masked_fill":
        return f"{nm}.masked_fill({nm} < 0, 0.5)", lambda t: t.masked_fill(t < 0, 0.5)
    if k == "where":
        yn, yd, yr = p.leaf(shape[rng.randrange(nd + 1):])
        return f"torch.where({nm} > 0, {nm}, {yn})", \
            lambda t: torch.where(t > 0, t, _pick(t, yd, yr))
    if k == "where_s":
        return f"torch.where({nm} > 0, {nm}, 0.0)", lambda t: torch.where(t > 0, t, 0.0)
    if k in ("scatter", "scatter_add"):
        ish = list(shape)
        ish[dim] = rng.randint(1, n)
        idx = torch.stack([torch.randperm(n, generator=g)[:ish[dim]]
                           for _ in range(max(1, torch.Size(ish[:dim] + ish[dim + 1:]).numel()))],
                          -1).reshape([ish[dim]] + ish[:dim] + ish[dim + 1:]).movedim(0, dim)
        sn, sd, sr = p.leaf(tuple(ish))
        f = getattr(torch, k)
        return f"torch.{k}({nm}, {dim}, <index {ish}>, {sn})", \
            lambda t: f(t, dim, idx.contiguous(), _pick(t, sd, sr))
    if k in ("index_add", "index_fill"):
        idx = torch.randint(0, n, (rng.randint(1, 4),), generator=g)
        if k == "index_fill":
            return f"{nm}.index_fill({dim}, torch.tensor({idx.tolist()}), -1.5)", \
                lambda t: t.index_fill(dim, idx, -1.5)
        sh = list(shape)
        sh[dim] = len(idx)
        sn, sd, sr = p.leaf(tuple(sh))
        return f"torch.index_add({nm}, {dim}, torch.tensor({idx.tolist()}), {sn})", \
            lambda t: torch.index_add(t, dim, idx, _pick(t, sd, sr))
    if k == "setitem":
        ix = _basic_index(rng, shape)
        c = round(rng.uniform(-2, 2), 2)
        return f"setitem({nm}, {_idx_text(ix)}, {c})", lambda t: setitem(t, ix, c)
    if k == "setitem_t":
        ix = _basic_index(rng, shape)
        vs = tuple(torch.empty(shape)[ix].shape)
        vs = vs[rng.randrange(len(vs) + 1):]
        vn, vd, vr = p.leaf(vs)
        return f"setitem({nm}, {_idx_text(ix)}, {vn})", lambda t: setitem(t, ix, _pick(t, vd, vr))
    if k == "vwrite":
        ix = _basic_index(rng, shape)
        op, *args = rng.choice([("mul_", 2.5), ("add_", -1.25), ("zero_",), ("fill_", 0.5),
                                ("relu_",), ("clamp_", -0.2, 0.3), ("exp_",)])
        return f"vwrite({nm}, {_idx_text(ix)}, {op!r}, *{args})", \
            lambda t: vwrite(t, ix, op, *args)
    if k == "vwrite_t":        # a transposed view of a copy, written in place
        if nd < 2:
            return None
        a, b = rng.sample(range(nd), 2)
        ys = tuple(r.transpose(a, b).shape)[rng.randrange(nd + 1):]
        yn, yd, yr = p.leaf(ys)

        def f(t):
            v = t.clone()
            v.transpose(a, b).add_(_pick(t, yd, yr))
            return v
        return f"v = {nm}.clone(); v.transpose({a}, {b}).add_({yn}); v", f
    if k == "copy_":
        yn, yd, yr = p.leaf(shape[rng.randrange(nd + 1):],
                            dtype=rng.choice([torch.float64, torch.float32]))
        return f"{nm}.clone().copy_({yn})", lambda t: t.clone().copy_(_pick(t, yd, yr))
    if k == "index_put_acc":
        idx = torch.randint(0, shape[0], (rng.randint(1, 4),), generator=g)
        return f"{nm}.clone().index_put_((torch.tensor({idx.tolist()}),), " \
               f"torch.tensor(1.0, dtype={nm}.dtype), accumulate=True)", \
            lambda t: t.clone().index_put_((idx,), torch.tensor(1.0, dtype=t.dtype),
                                           accumulate=True)
    return None


def _misc(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k == "repeat":
        reps = [rng.randint(1, 2) for _ in range(nd + rng.randint(0, 1))]
        return f"{nm}.repeat({reps})", lambda t: t.repeat(reps)
    if k == "expand" and nd:
        tgt = [rng.randint(1, 3) if s == 1 else s for s in shape]
        return f"{nm}.expand({tgt})", lambda t: t.expand(tgt)
    if k == "repeat_interleave" and nd:
        dim, rep = rng.randrange(nd), rng.randint(1, 3)
        return f"{nm}.repeat_interleave({rep}, {dim})", lambda t: t.repeat_interleave(rep, dim)
    if k == "unflatten" and nd and shape[0] and shape[0] % 2 == 0:
        return f"{nm}.unflatten(0, (2, -1))", lambda t: t.unflatten(0, (2, -1))
    if k == "chunk" and nd:
        dim, c = rng.randrange(nd), rng.randint(1, 3)
        n_out = len(torch.empty(shape).chunk(c, dim))
        i = rng.randrange(n_out) if n_out else 0
        if not n_out:
            return None
        return f"{nm}.chunk({c}, {dim})[{i}]", lambda t: t.chunk(c, dim)[i]
    if k == "unbind" and nd and shape[0]:
        i = rng.randrange(shape[0])
        return f"{nm}.unbind(0)[{i}]", lambda t: t.unbind(0)[i]
    if k == "pad" and nd:
        pads = [rng.randint(0, 2) for _ in range(2 * rng.randint(1, min(nd, 2)))]
        return f"F.pad({nm}, {pads}, value=0.5)", lambda t: F.pad(t, pads, value=0.5)
    if k == "tile" and nd:
        reps = tuple(rng.randint(1, 2) for _ in range(nd))
        return f"torch.tile({nm}, {reps})", lambda t: torch.tile(t, reps)
    if k == "lerp":
        yn, yd, yr = p.leaf(shape)
        w = round(rng.random(), 2)
        return f"torch.lerp({nm}, {yn}, {w})", lambda t: torch.lerp(t, _pick(t, yd, yr), w)
    if k == "searchsorted" and nd:
        vs = shape[:-1] + (rng.randint(1, 4),)
        vn, vd, vr = p.leaf(vs)
        right = rng.random() < 0.5
        return f"torch.searchsorted({nm}.sort(-1)[0], {vn}, right={right})", \
            lambda t: torch.searchsorted(t.sort(-1)[0], _pick(t, vd, vr), right=right)
    if k == "bucketize" and nd == 1:
        vn, vd, vr = p.leaf(p.shape())
        return f"torch.bucketize({vn}, {nm}.sort()[0])", \
            lambda t: torch.bucketize(_pick(t, vd, vr), t.sort()[0])
    if k == "topk" and nd and shape[-1]:
        kk = rng.randint(1, shape[-1])
        j = rng.randint(0, 1)
        return f"torch.topk({nm}, {kk})[{j}]", lambda t: torch.topk(t, kk)[j]
    if k == "one_hot" and nd:
        return f"F.one_hot(({nm} > 0).long(), 3)", lambda t: F.one_hot((t > 0).long(), 3)
    if k == "embedding" and nd:
        wn, wd, wr = p.leaf((3, rng.randint(1, 4)))
        return f"F.embedding(({nm} > 0).long() + ({nm} > 1).long(), {wn})", \
            lambda t: F.embedding((t > 0).long() + (t > 1).long(), _pick(t, wd, wr))
    if k == "cross_entropy" and nd == 2 and shape[1]:
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        tgt = torch.randint(0, shape[1], (shape[0],), generator=g)
        red = rng.choice(["mean", "sum", "none"])
        return f"F.cross_entropy({nm}, torch.tensor({tgt.tolist()}), reduction={red!r})", \
            lambda t: F.cross_entropy(t, tgt, reduction=red)
    if k == "mse_loss" and nd:
        yn, yd, yr = p.leaf(shape)
        return f"F.mse_loss({nm}, {yn})", lambda t: F.mse_loss(t, _pick(t, yd, yr))
    if k == "dropout0":
        return f"F.dropout({nm}, 0.0)", lambda t: F.dropout(t, 0.0)
    if k == "type_as":
        yn, yd, yr = p.leaf((), dtype=torch.float32)
        return f"{nm}.type_as({yn})", lambda t: t.type_as(_pick(t, yd, yr))
    if k == "scalar0d":          # a 0-d operand: torch's promotion treats it apart
        yn, yd, yr = p.leaf((), dtype=rng.choice([torch.float32, torch.float64, torch.int64]))
        return f"{nm} * {yn}", lambda t: t * _pick(t, yd, yr)
    return None


def build(p, cur, k):
    """``(text, f)`` for kind ``k`` on ``cur``, or None (the kind does not fit)."""
    if k in UNARY:
        return _unary(p, cur, k)
    if k in BINARY:
        return _binary(p, cur, k)
    for table in (REDUCE, SHAPE, CASTS, INPLACE):
        if k in table:
            return _template(p, cur, k, table)
    return _matmuls(p, cur, k) or _indexing(p, cur, k) or _misc(p, cur, k)


MATMULS = ("linear", "mm", "bmm", "einsum", "matmul_vec")
INDEXING = ("index_select", "gather", "take", "adv_index", "int_index", "none_index",
            "bool_mask", "masked_fill", "where", "where_s", "scatter", "scatter_add",
            "index_add", "index_fill", "setitem", "setitem_t", "vwrite", "vwrite_t", "copy_",
            "index_put_acc")
MISC = ("repeat", "expand", "repeat_interleave", "unflatten", "chunk", "unbind", "pad", "tile",
        "lerp", "searchsorted", "bucketize", "topk", "one_hot", "embedding", "cross_entropy",
        "mse_loss", "dropout0", "type_as", "scalar0d")
MORE = tuple(UNARY) + tuple(BINARY) + tuple(REDUCE) + tuple(SHAPE) + tuple(CASTS) + \
    tuple(INPLACE) + MATMULS + INDEXING + MISC
