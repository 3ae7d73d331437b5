"""PyTorch habits for the random programs of ``tests/random_programs.py`` that its other
kinds never exercised (the fourth sweep, issue sweep4): in-place ops on views of a
DistTensor that is not a copy (``x[:, 1:].add_(y)``, ``x.transpose(0, 1).mul_(2)``: a leaf
that requires grad must refuse them as torch does), ``out=`` forms (resized, cast, or
refused as torch), type promotion (int + float, bf16 + fp32, bool + int, 0-d operands),
reductions over dim tuples / negative dims / all dims, ``torch.where`` and masked ops
with broadcast masks and 0-d values, indexing with several index tensors, a DistTensor
index, and registered ops never drawn before (fmod, le, logical_or / xor, bitwise ops,
expand_as, conv1d, pooling, group / instance / batch norm, nanmedian, masked_select,
nonzero, unique, view_as_real...).

Builders as in ``tests/random_programs_more.py``: ``b(p, cur, k) -> (text, f) | None``;
``f`` may raise where torch raises (``run_program`` then holds the DistTensor call to
torch's exception type and its inputs untouched)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import workbench as wb
from workbench.parallel.placement import Replicate
from workbench.parallel.validate import distribute


def _pick(t, d, r):
    return d if isinstance(t, wb.DistTensor) else r


def _suffix(rng, shape):
    """A shape that broadcasts against ``shape``: a suffix, some dims set to 1."""
    ys = list(shape)
    if ys and rng.random() < 0.5:
        ys = ys[rng.randrange(len(ys) + 1):]
    return tuple(1 if rng.random() < 0.25 else s for s in ys)


def _view(rng, shape):
    """A view-making function of ``shape`` and its text: a slice, transpose, narrow,
    select, diagonal or unsqueeze (``None`` when the shape allows none)."""
    nd = len(shape)
    kinds = ["unsqueeze"]
    if nd:
        kinds += ["slice", "narrow", "select"]
    if nd >= 2:
        kinds += ["transpose", "diagonal", "slice2"]
    k = rng.choice(kinds)
    if k == "unsqueeze":
        d = rng.randint(-nd - 1, nd)
        return f".unsqueeze({d})", lambda v: v.unsqueeze(d)
    dim = rng.randrange(nd)
    n = shape[dim]
    if k == "slice":
        a = rng.randint(0, n)
        ix = (slice(None),) * dim + (slice(a, None),)
        return f"[{':, ' * dim}{a}:]", lambda v: v[ix]
    if k == "slice2":                      # a stepped slice
        ix = (slice(None),) * dim + (slice(None, None, 2),)
        return f"[{':, ' * dim}::2]", lambda v: v[ix]
    if k == "narrow":
        a = rng.randint(0, n)
        ln = rng.randint(0, n - a)
        return f".narrow({dim}, {a}, {ln})", lambda v: v.narrow(dim, a, ln)
    if k == "select":
        if not n:
            return None
        i = rng.randrange(-n, n)
        return f".select({dim}, {i})", lambda v: v.select(dim, i)
    a, b = rng.sample(range(nd), 2)
    if k == "transpose":
        return f".transpose({a}, {b})", lambda v: v.transpose(a, b)
    o = rng.randint(-1, 1)
    return f".diagonal({o}, {a}, {b})", lambda v: v.diagonal(o, a, b)


def _inplace_view(p, cur, k):
    """An in-place op on a view: of a copy (``iv_copy``), or of the tensor itself
    (``iv_self``: torch refuses it on a leaf that requires grad; on a result, the
    result and its graph change)."""
    rng = p.rng
    nm, d, r = cur
    drawn = _view(rng, tuple(r.shape))
    if drawn is None:
        return None
    vt, view = drawn
    vshape = tuple(view(torch.empty(r.shape)).shape)
    op = rng.choice(["add_", "mul_", "sub_", "copy_", "mul_s", "fill_", "clamp_", "div_s",
                     "addcmul_", "lerp_"])
    if op in ("mul_s", "div_s", "fill_", "clamp_"):
        c = round(rng.uniform(0.5, 2), 2)
        call = {"mul_s": ("mul_", (c,)), "div_s": ("div_", (c,)), "fill_": ("fill_", (c,)),
                "clamp_": ("clamp_", (-c, c))}[op]
        on, args = call
        at = ", ".join(map(str, args))

        def g(v, t):
            getattr(view(v), on)(*args)
    else:
        dtype = rng.choice([torch.float64, torch.float64, torch.float32, torch.int64])
        yn, yd, yr = p.leaf(_suffix(rng, vshape), dtype=dtype)
        on, at = op, yn
        if op == "addcmul_":
            at = f"{yn}, {yn}, value=0.5"

        def g(v, t):
            y = _pick(t, yd, yr)
            if op == "addcmul_":
                view(v).addcmul_(y, y, value=0.5)
            elif op == "lerp_":
                view(v).lerp_(y.to(v.dtype) if y.dtype != v.dtype else y, 0.25)
            else:
                getattr(view(v), op)(y)
    if k == "iv_copy":
        def f(t):
            v = t.clone()
            g(v, t)
            return v
        return f"v = {nm}.clone(); v{vt}.{on}({at}); v", f

    def f2(t):
        g(t, t)
        return t
    return f"{nm}{vt}.{on}({at}); {nm}", f2


def _out(p, cur, k):
    """``torch.op(..., out=z)``: z exact, empty (resized), of another shape (resized with
    a warning) or another dtype (cast, or torch's error); the inputs detached (torch
    refuses out= when an input requires grad: ``out_grad`` keeps them attached)."""
    rng = p.rng
    nm, d, r = cur
    shape = tuple(r.shape)
    op = rng.choice(["add", "mul", "maximum", "sum", "neg", "matmul", "cat", "exp", "where"])
    yn = None
    if op in ("add", "mul", "maximum", "where"):
        yn, yd, yr = p.leaf(_suffix(rng, shape), dtype=rng.choice([torch.float64,
                                                                   torch.float32]))
    if op == "matmul":
        if not shape:
            return None
        yn, yd, yr = p.leaf((shape[-1], rng.randint(1, 3)))
    if op == "cat":
        if not shape:
            return None
        yn, yd, yr = p.leaf((rng.randint(0, 3),) + shape[1:])
    dim = rng.randrange(-len(shape), len(shape)) if shape else None

    def call(t, z):
        y = _pick(t, yd, yr) if yn else None
        if op in ("add", "mul", "maximum", "matmul"):
            return getattr(torch, op)(t, y, out=z)
        if op == "where":
            return torch.where(t > 0, t, y, out=z)
        if op == "cat":
            return torch.cat([t, y], 0, out=z)
        if op == "sum":
            return torch.sum(t, dim, out=z) if dim is not None else torch.sum(t, out=z)
        return getattr(torch, op)(t, out=z)
    # the result's shape (the out tensor is drawn of it, of none, or of another)
    try:
        rs = tuple(call(r.detach(), torch.empty(0, dtype=torch.float64)).shape)
    except Exception:          # noqa: BLE001 - torch refuses the call itself: skip
        return None
    zk = rng.random()
    zs = rs if zk < 0.6 else (0,) if zk < 0.8 else tuple(max(1, s - 1) for s in rs) + (2,)
    zdt = rng.choice([torch.float64, torch.float64, torch.float32, torch.int64])
    zps = p.placements(zs, zdt)
    zseed = rng.randrange(1000)
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    z0 = torch.randn(zs, generator=g, dtype=torch.float64).to(zdt)
    keep = k == "out_grad"

    def f(t):
        z = distribute(z0, p.mesh, zps, seed=zseed) if isinstance(t, wb.DistTensor) \
            else z0.clone()
        res = call(t if keep else t.detach(), z)
        if res is not z:
            raise AssertionError("out= did not return its out tensor")
        return z
    txt = f"z = distribute(<{list(zs)} {zdt}>, mesh, {[str(q) for q in zps]}); " \
          f"torch.{op}({nm}{'' if keep else '.detach()'}{', ' + yn if yn else ''}" \
          f"{f', {dim}' if op == 'sum' and dim is not None else ''}, out=z); z"
    return txt, f


def _promote(p, cur, k):
    """Type promotion across categories and widths (torch's promotion rules)."""
    rng = p.rng
    nm, d, r = cur
    shape = tuple(r.shape)
    if k == "int_plus_float":         # an int tensor + a float tensor (of the other side)
        yn, yd, yr = p.leaf(_suffix(rng, shape), dtype=torch.int64)
        if rng.random() < 0.5:
            return f"{yn} + {nm}", lambda t: _pick(t, yd, yr) + t
        return f"{nm} - {yn}", lambda t: t - _pick(t, yd, yr)
    if k == "int_times_pyfloat":      # -> the default dtype (float32)
        c = rng.choice([1.5, -0.25, 3.0])
        return f"({nm} > 0).long() * {c} + {nm}.float()", \
            lambda t: (t > 0).long() * c + t.float()
    if k == "bool_plus_int":
        return f"({nm} > 0) + 2 + ({nm} < 0).int()", lambda t: (t > 0) + 2 + (t < 0).int()
    if k == "bf16_plus_f32":
        yn, yd, yr = p.leaf(_suffix(rng, shape), dtype=torch.float32)
        return f"{nm}.to(torch.bfloat16) + {yn}", lambda t: t.to(torch.bfloat16) + _pick(t, yd, yr)
    if k == "half_times_bf16":        # float16 * bfloat16 -> float32
        return f"{nm}.half() * {nm}.bfloat16()", lambda t: t.half() * t.bfloat16()
    if k == "int_div_int":            # true division of ints: the default dtype
        yn, yd, yr = p.leaf(_suffix(rng, shape), positive=True, dtype=torch.int64)
        return f"({nm} * 4).long() / {yn}", lambda t: (t * 4).long() / _pick(t, yd, yr)
    if k == "f32_plus_0d_f64":        # a 0-d float64 does not widen a float32 tensor
        yn, yd, yr = p.leaf((), dtype=torch.float64)
        return f"{nm}.float() + {yn}", lambda t: t.float() + _pick(t, yd, yr)
    if k == "int_plus_0d_float":      # ...but lifts an int tensor to its category
        yn, yd, yr = p.leaf((), dtype=torch.float64)
        return f"({nm} * 3).long() + {yn}", lambda t: (t * 3).long() + _pick(t, yd, yr)
    if k == "int_iadd_float":         # in place: torch refuses float into int
        return f"v = ({nm} * 3).long(); v += 0.5; v", lambda t: (t * 3).long().__iadd__(0.5)
    if k == "where_promote":          # where(cond, int tensor, float scalar)
        return f"torch.where({nm} > 0, ({nm} * 2).long(), 0.5)", \
            lambda t: torch.where(t > 0, (t * 2).long(), 0.5)
    return None


def _reduce(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    nd = r.dim()
    if k == "sum_all_dims":           # a tuple of every dim, negative and out of order
        dims = list(range(-nd, 0)) if nd else [0]
        rng.shuffle(dims)
        keep = rng.random() < 0.5
        return f"{nm}.sum({tuple(dims)}, keepdim={keep})", \
            lambda t: t.sum(tuple(dims), keepdim=keep)
    if k == "mean_empty_dims":        # dim=[]: torch reduces over every dim
        return f"{nm}.mean([])", lambda t: t.mean([])
    if k == "var_mean":
        if not nd:
            return None
        dims = tuple(rng.sample(range(-nd, nd), 1))
        cor, j = rng.choice([0, 1]), rng.randint(0, 1)
        return f"torch.var_mean({nm}, {dims}, correction={cor})[{j}]", \
            lambda t: torch.var_mean(t, dims, correction=cor)[j]
    if k == "aminmax":
        dim = rng.randrange(-nd, nd) if nd else None
        j = rng.randint(0, 1)
        return f"torch.aminmax({nm}, dim={dim})[{j}]", lambda t: torch.aminmax(t, dim=dim)[j]
    if k == "max_all":
        return f"{nm}.max() - {nm}.min()", lambda t: t.max() - t.min()
    if k == "norm_ord":
        o = rng.choice([1, float("inf"), float("-inf"), 0, 3])
        dims = tuple(rng.sample(range(-nd, nd), rng.randint(1, nd))) if nd else None
        return f"torch.linalg.vector_norm({nm}, {o}, {dims})", \
            lambda t: torch.linalg.vector_norm(t, o, dims)
    if k == "nanmedian":
        if not nd:
            return None
        dim, j = rng.randrange(-nd, nd), rng.randint(0, 1)
        return f"{nm}.nanmedian({dim})[{j}]", lambda t: t.nanmedian(dim)[j]
    if k == "prod_keep":
        dim = rng.randrange(-nd, nd) if nd else 0
        return f"{nm}.prod({dim}, keepdim=True)", lambda t: t.prod(dim, keepdim=True)
    return None


def _masked(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape = tuple(r.shape)
    cn, cd, cr = p.leaf(_suffix(rng, shape))
    if k == "where_bc":               # cond, x and y of three broadcast shapes
        yn, yd, yr = p.leaf(_suffix(rng, shape))
        return f"torch.where({cn} > 0, {nm}, {yn})", \
            lambda t: torch.where(_pick(t, cd, cr) > 0, t, _pick(t, yd, yr))
    if k == "masked_fill_bc":         # a broadcast mask, a 0-d tensor value
        if not (r.is_floating_point() or r.is_complex()):
            return None               # -0.75 as a uint8 / int tensor: the generator's own
        v = torch.tensor(-0.75, dtype=r.dtype)      # RuntimeError (seed 2011180 wide)
        return f"{nm}.masked_fill({cn} > 0, torch.tensor(-0.75))", \
            lambda t: t.masked_fill(_pick(t, cd, cr) > 0, v)
    if k == "where_cond_only_scalar":
        return f"torch.where({cn} > 0, {nm}, -{nm})", \
            lambda t: torch.where(_pick(t, cd, cr) > 0, t, -t)
    if k == "masked_fill_":           # in place on a copy, a broadcast mask
        return f"{nm}.clone().masked_fill_({cn} < 0, 2.0)", \
            lambda t: t.clone().masked_fill_(_pick(t, cd, cr) < 0, 2.0)
    if k == "masked_select_bc":
        return f"torch.masked_select({nm}, {cn} > 0)", \
            lambda t: torch.masked_select(t, _pick(t, cd, cr) > 0)
    return None


def _index(p, cur, k):
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if not nd or 0 in shape:
        return None
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    if k == "adv_two":                # two index tensors broadcast together
        if nd < 2:
            return None
        a, b = sorted(rng.sample(range(nd), 2))
        n = rng.randint(1, 3)
        i1 = torch.randint(-shape[a], shape[a], (n, 1), generator=g)
        i2 = torch.randint(-shape[b], shape[b], (rng.choice([1, 2]),), generator=g)
        ix = tuple(i1 if j == a else i2 if j == b else slice(None) for j in range(b + 1))
        return f"{nm}[<{ix}>]", lambda t: t[ix]
    if k == "adv_neg":                # negative indices, a 2-d index tensor
        dim = rng.randrange(nd)
        idx = torch.randint(-shape[dim], shape[dim], (2, rng.randint(1, 2)), generator=g)
        ix = (slice(None),) * dim + (idx,)
        return f"{nm}[{':, ' * dim}torch.tensor({idx.tolist()})]", lambda t: t[ix]
    if k == "dist_index":             # the index itself a DistTensor
        dim = rng.randrange(nd)
        ish = (rng.randint(1, 4),) if rng.random() < 0.7 else (2, rng.randint(1, 3))
        idx = torch.randint(0, shape[dim], ish, generator=g)
        ips = [Replicate() if q.is_partial() else q     # an index is not a sum of parts
               for q in p.placements(ish, torch.int64)]
        di = distribute(idx, p.mesh, ips)
        if rng.random() < 0.5:
            return f"torch.index_select({nm}, {dim}, <DistTensor {idx.tolist()} " \
                   f"{[str(q) for q in ips]}>)", \
                lambda t: torch.index_select(t, dim, _pick(t, di, idx).reshape(-1))
        ix = (slice(None),) * dim
        return f"{nm}[{':, ' * dim}<DistTensor {idx.tolist()} {[str(q) for q in ips]}>]", \
            lambda t: t[ix + (_pick(t, di, idx),)]
    if k == "index_put_t":            # v[idx] = y (accumulate or not)
        dim0 = shape[0]
        idx = torch.randint(0, dim0, (rng.randint(1, 3),), generator=g)
        acc = rng.random() < 0.5
        yn, yd, yr = p.leaf(_suffix(rng, (len(idx),) + shape[1:]))

        def f(t):
            v = t.clone()
            v.index_put_((idx,), _pick(t, yd, yr), accumulate=acc)
            return v
        return f"{nm}.clone().index_put_((torch.tensor({idx.tolist()}),), {yn}, " \
               f"accumulate={acc})", f
    if k == "bool_dim_index":         # a 1-d mask on one dim
        dim = rng.randrange(nd)
        m = torch.rand(shape[dim], generator=g) > 0.4
        ix = (slice(None),) * dim + (m,)
        return f"{nm}[{':, ' * dim}torch.tensor({m.tolist()})]", lambda t: t[ix]
    return None


def _ops(p, cur, k):
    """Registered ops the generator never drew."""
    rng = p.rng
    nm, d, r = cur
    shape, nd = tuple(r.shape), r.dim()
    if k in ("fmod", "le", "logical_or", "logical_xor", "ne", "gt"):
        yn, yd, yr = p.leaf(_suffix(rng, shape), positive=k == "fmod",
                            dtype=rng.choice([torch.float64, torch.float32]))
        f = getattr(torch, k)
        return f"torch.{k}({nm}, {yn})", lambda t: f(t, _pick(t, yd, yr))
    if k in ("bitwise_and", "bitwise_or", "bitwise_xor", "shift"):
        yn, yd, yr = p.leaf(_suffix(rng, shape), dtype=torch.int64)
        if k == "shift":
            return f"({nm} * 4).long() << {yn}.abs() >> 1", \
                lambda t: (t * 4).long() << _pick(t, yd, yr).abs() >> 1
        f = getattr(torch, k)
        return f"torch.{k}(({nm} * 4).long(), {yn})", \
            lambda t: f((t * 4).long(), _pick(t, yd, yr))
    if k in ("isposinf", "isreal"):
        f = getattr(torch, k)
        return f"torch.{k}({nm}.exp())", lambda t: f(t.exp())
    if k == "expand_as" and nd:
        tgt = tuple(rng.randint(1, 3) if s == 1 else s for s in shape)
        yn, yd, yr = p.leaf(tgt)
        return f"{nm}.expand_as({yn}) * {yn}", \
            lambda t: t.expand_as(_pick(t, yd, yr)) * _pick(t, yd, yr)
    if k == "conv1d" and nd == 3 and shape[2] >= 2 and shape[1]:
        co, kw = rng.randint(1, 3), rng.randint(1, min(3, shape[2]))
        wn, wd, wr = p.leaf((co, shape[1], kw))
        pad = rng.randint(0, 1)
        return f"F.conv1d({nm}, {wn}, padding={pad})", \
            lambda t: F.conv1d(t, _pick(t, wd, wr), padding=pad)
    if k in ("max_pool1d", "avg_pool1d", "adaptive_avg_pool1d") and nd in (2, 3) \
            and shape[-1] >= 2:
        kw = rng.randint(1, 2)
        f = getattr(F, k)
        a = rng.randint(1, 3) if k.startswith("adaptive") else kw
        return f"F.{k}({nm}, {a})", lambda t: f(t, a)
    if k in ("group_norm", "instance_norm", "batch_norm") and nd >= 3 and shape[1] \
            and all(shape):
        if k == "group_norm":
            gs = [x for x in range(1, shape[1] + 1) if shape[1] % x == 0]
            ng = rng.choice(gs)
            return f"F.group_norm({nm}, {ng})", lambda t: F.group_norm(t, ng)
        if k == "instance_norm":
            return f"F.instance_norm({nm})", lambda t: F.instance_norm(t)
        return f"F.batch_norm({nm}, None, None, training=True)", \
            lambda t: F.batch_norm(t, None, None, training=True)
    if k == "nonzero":
        return f"torch.nonzero({nm} > 0)", lambda t: torch.nonzero(t > 0)
    if k == "unique":
        return f"torch.unique(({nm} * 2).round())", lambda t: torch.unique((t * 2).round())
    if k == "view_as_real" and nd:
        return f"torch.view_as_real(torch.complex({nm}, -{nm})) * 1", \
            lambda t: torch.view_as_real(torch.complex(t, -t)) * 1
    if k == "unflatten_neg" and nd and shape[-1] and shape[-1] % 2 == 0:
        return f"{nm}.unflatten(-1, (-1, 2))", lambda t: t.unflatten(-1, (-1, 2))
    return None


def _errors(p, cur, k):
    """Calls torch refuses: the DistTensor call must raise torch's type, inputs untouched."""
    rng = p.rng
    nm, d, r = cur
    shape = tuple(r.shape)
    if k == "err_shape":              # a mismatched operand (no broadcast)
        ys = tuple(s + 2 for s in shape) or (3,)
        yn, yd, yr = p.leaf(ys)
        op = rng.choice(["add", "mul", "maximum", "add_", "copy_"])
        if op.endswith("_"):
            return f"{nm}.clone().{op}({yn})", lambda t: getattr(t.clone(), op)(_pick(t, yd, yr))
        return f"torch.{op}({nm}, {yn})", lambda t: getattr(torch, op)(t, _pick(t, yd, yr))
    if k == "err_matmul":
        yn, yd, yr = p.leaf(((shape[-1] if shape else 1) + 1, 2))
        return f"{nm} @ {yn}", lambda t: t @ _pick(t, yd, yr)
    if k == "err_cat":
        if not shape:
            return None
        yn, yd, yr = p.leaf(tuple(s + 1 for s in shape))
        dim = rng.randrange(len(shape))
        return f"torch.cat([{nm}, {yn}], {dim})", lambda t: torch.cat([t, _pick(t, yd, yr)], dim)
    if k == "err_view":               # more elements than the tensor has
        return f"{nm}.view({r.numel() + 1})", lambda t: t.view(r.numel() + 1)
    if k == "err_inplace_leaf":       # an in-place op on a leaf that requires grad
        yn, yd, yr = p.leaf(shape)
        return f"{yn}.mul_(2)", lambda t: _pick(t, yd, yr).mul_(2)
    if k == "err_index":              # an index out of range
        if not shape:
            return None
        n = shape[0]
        return f"{nm}[torch.tensor([{n}])]", lambda t: t[torch.tensor([n])]
    return None


INPLACE_VIEWS = ("iv_copy", "iv_self")
OUT = ("out", "out_grad")
PROMOTE = ("int_plus_float", "int_times_pyfloat", "bool_plus_int", "bf16_plus_f32",
           "half_times_bf16", "int_div_int", "f32_plus_0d_f64", "int_plus_0d_float",
           "int_iadd_float", "where_promote")
REDUCE = ("sum_all_dims", "mean_empty_dims", "var_mean", "aminmax", "max_all", "norm_ord",
          "nanmedian", "prod_keep")
MASKED = ("where_bc", "masked_fill_bc", "where_cond_only_scalar", "masked_fill_",
          "masked_select_bc")
INDEX = ("adv_two", "adv_neg", "dist_index", "index_put_t", "bool_dim_index")
OPS = ("fmod", "le", "logical_or", "logical_xor", "ne", "gt", "bitwise_and", "bitwise_or",
       "bitwise_xor", "shift", "isposinf", "isreal", "expand_as", "conv1d", "max_pool1d",
       "avg_pool1d", "adaptive_avg_pool1d", "group_norm", "instance_norm", "batch_norm",
       "nonzero", "unique", "view_as_real", "unflatten_neg")
ERRORS = ("err_shape", "err_matmul", "err_cat", "err_view", "err_inplace_leaf", "err_index")
HABITS = INPLACE_VIEWS + OUT + PROMOTE + REDUCE + MASKED + INDEX + OPS + ERRORS


def build(p, cur, k):
    """``(text, f)`` for habit kind ``k`` on ``cur``, or None (the kind does not fit)."""
    for kinds, b in ((INPLACE_VIEWS, _inplace_view), (OUT, _out), (PROMOTE, _promote),
                     (REDUCE, _reduce), (MASKED, _masked), (INDEX, _index), (OPS, _ops),
                     (ERRORS, _errors)):
        if k in kinds:
            return b(p, cur, k)
    return None
