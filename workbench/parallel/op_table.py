"""The table from torch functions to SPMD ops: how to parse each call and how to run
it on stacked local tensors (one leading axis per mesh dim, ``nd`` of them).

A local function receives ``nd`` (0 when computing output shapes on the meta
device) and a :class:`dispatch.Ctx`, then the local inputs; it must treat the
first ``nd`` dims as the device grid: dims given by the user are shifted by ``nd``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import OpDef, register_op

T = torch.Tensor


def _shift(d, ndim_local, nd):
    """A user dim of a local tensor with ``ndim_local`` dims -> the stacked dim."""
    if d is None:
        return None
    if isinstance(d, (tuple, list)):
        return tuple(_shift(x, ndim_local, nd) for x in d)
    return (d % ndim_local) + nd if ndim_local else nd


def _align(nd, *xs):
    """Insert size-1 dims after the lead so all local tensors have the same rank
    (broadcasting then lines up the local dims, not the device axes)."""
    ts = [x for x in xs if isinstance(x, torch.Tensor)]
    if not ts:
        return xs
    target = max(t.dim() for t in ts)
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.dim() < target:
            x = x.reshape(tuple(x.shape[:nd]) + (1,) * (target - x.dim()) + tuple(x.shape[nd:]))
        out.append(x)
    return out


# ---- pointwise ------------------------------------------------------------------------------

def _pw_parse(*args, **kwargs):
    return tuple(args), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}


def _pointwise(name, fn, swap=False):
    def local(nd, ctx, *xs, **kw):
        xs = _align(nd, *xs)
        return fn(*xs, **kw)

    def parse(*args, **kwargs):
        if kwargs.pop("inplace", False):
            raise NotImplementedError(
                f"{name}(inplace=True) on a DistTensor: in-place ops are not supported; "
                "use the out-of-place form (inplace=False)")
        if swap:
            args = (args[1], args[0]) + tuple(args[2:])
        return tuple(args), dict(kwargs)
    return OpDef(name, parse, local)


_BIN = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
        "maximum": torch.maximum, "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne,
        "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}
# (no __eq__ / __ne__ on DistTensor: they would break hashing and `in`; use torch.eq)
for _n, _f in _BIN.items():
    _od = _pointwise(_n, _f)
    register_op([_f, getattr(T, _n), getattr(T, f"__{_n}__", None) or getattr(T, _n)], _od)
register_op([T.__truediv__], _pointwise("div", torch.div))
register_op([T.__radd__], _pointwise("add", torch.add, swap=True))
register_op([T.__rmul__], _pointwise("mul", torch.mul, swap=True))
register_op([T.__rsub__], _pointwise("sub", torch.sub, swap=True))
register_op([T.__rtruediv__], _pointwise("div", torch.div, swap=True))

_UN = {"relu": (torch.relu, F.relu, T.relu), "gelu": (F.gelu,), "silu": (F.silu,),
       "sigmoid": (torch.sigmoid, T.sigmoid, F.sigmoid), "tanh": (torch.tanh, T.tanh, F.tanh),
       "exp": (torch.exp, T.exp), "log": (torch.log, T.log), "sqrt": (torch.sqrt, T.sqrt),
       "rsqrt": (torch.rsqrt, T.rsqrt), "abs": (torch.abs, T.abs, T.__abs__),
       "neg": (torch.neg, T.neg, T.__neg__), "square": (torch.square, T.square),
       "sin": (torch.sin, T.sin), "cos": (torch.cos, T.cos), "erf": (torch.erf, T.erf),
       "reciprocal": (torch.reciprocal, T.reciprocal), "clone": (torch.clone, T.clone),
       "contiguous": (T.contiguous,), "float": (T.float,), "half": (T.half,),
       "bfloat16": (T.bfloat16,), "pow": (torch.pow, T.pow, T.__pow__)}
for _n, _fs in _UN.items():
    _od = _pointwise(_n, _fs[0])
    register_op(_fs, _od)


def _where_local(nd, ctx, cond, x, y):
    cond, x, y = _align(nd, cond, x, y)
    return torch.where(cond, x, y)


register_op([torch.where], OpDef("where", lambda c, x, y: ((c, x, y), {}), _where_local))


# ---- contractions ---------------------------------------------------------------------------

def _matmul_local(nd, ctx, a, b):
    if a.dim() - nd >= 2 and b.dim() - nd >= 2:
        a, b = _align(nd, a, b)
        return torch.matmul(a, b)
    eq = {(1, 1): "...k,...k->...", (1, 2): "...k,...kn->...n", (2, 1): "...mk,...k->...m"}
    key = (min(a.dim() - nd, 2), min(b.dim() - nd, 2))
    if key in eq and (a.dim() - nd <= 2 and b.dim() - nd <= 2):
        return torch.einsum(eq[key], a, b)
    return torch.matmul(*_align(nd, a, b))


_MM = OpDef("matmul", lambda a, b: ((a, b), {}), _matmul_local)
register_op([torch.matmul, T.matmul, T.__matmul__], _MM)
register_op([torch.mm, T.mm], OpDef("mm", lambda a, b: ((a, b), {}), _matmul_local))
register_op([torch.bmm, T.bmm], OpDef("bmm", lambda a, b: ((a, b), {}), _matmul_local))
register_op([T.__rmatmul__], OpDef("matmul", lambda a, b: ((b, a), {}), _matmul_local))


def _same_on_every_rank(x, nd) -> bool:
    """The stacked x holds one tensor for all ranks (lead dims of size 1 or stride 0)."""
    return all(x.shape[i] == 1 or x.stride(i) == 0 for i in range(nd))


def _linear_local(nd, ctx, x, w, b=None):
    if nd and _same_on_every_rank(x, nd) and not _same_on_every_rank(w, nd) and x.dim() > nd:
        # Column-parallel with a replicated input: every rank multiplies the same x by its
        # slice of the weight. One GEMM with all the slices side by side does exactly that
        # arithmetic at single-device speed; autograd still sends the input gradient through
        # x's per-rank views (their traced all-reduce).
        x0 = x[(slice(0, 1),) * nd].reshape(x.shape[nd:])                   # (*batch, k)
        lead = tuple(w.shape[:nd])
        n, k = w.shape[-2], w.shape[-1]
        y = x0 @ w.reshape(-1, k).transpose(0, 1)                           # (*batch, L*n)
        nb = y.dim() - 1
        y = y.unflatten(-1, lead + (n,))                                    # (*batch, *lead, n)
        y = y.movedim(tuple(range(nb, nb + nd)), tuple(range(nd)))          # (*lead, *batch, n)
        if b is not None:
            y, b = _align(nd, y, b)
            y = y + b
        return y
    x, w2 = _align(nd, x, w.transpose(-1, -2))
    y = torch.matmul(x, w2)
    if b is not None:
        y, b = _align(nd, y, b)
        y = y + b
    return y


register_op([F.linear], OpDef("linear", lambda x, w, b=None: ((x, w, b), {}), _linear_local))


def _einsum_parse(eq, *ops):
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    return tuple(ops), {"equation": eq.replace(" ", "")}


def _einsum_local(nd, ctx, *ops, equation):
    lhs, rhs = equation.split("->")
    return torch.einsum(",".join("..." + t for t in lhs.split(",")) + "->..." + rhs, *ops)


register_op([torch.einsum], OpDef("einsum", _einsum_parse, _einsum_local))


# ---- reductions -----------------------------------------------------------------------------

def _red_parse(x, dim=None, keepdim=False, *, dtype=None):
    if isinstance(dim, list):
        dim = tuple(dim)
    return (x,), {"dim": dim, "keepdim": keepdim}


def _reduction(kind):
    def local(nd, ctx, x, dim=None, keepdim=False):
        ln = x.dim() - nd
        dims = tuple(range(nd, x.dim())) if dim is None else _shift(dim, ln, nd)
        if isinstance(dims, int):
            dims = (dims,)
        if not dims:                  # a 0-d tensor: reducing it is the identity
            return x
        if kind == "sum":
            return x.sum(dims, keepdim=keepdim)
        if kind == "mean":
            # divide by the GLOBAL count: a shard's sum / N is a correct partial mean,
            # even for uneven shards
            if ctx is None:
                return x.mean(dims, keepdim=keepdim)
            spec = ctx.in_specs[0]
            n = 1
            for d in (range(ln) if dim is None else
                      ([dim] if isinstance(dim, int) else dim)):
                n *= spec.shape[d % ln]
            return x.sum(dims, keepdim=keepdim) / n
        if any(x.shape[d] == 0 for d in dims):       # an empty shard: max's identity
            shape = x.sum(dims, keepdim=keepdim).shape
            return x.new_full(shape, float("-inf") if kind == "amax" else float("inf"))
        if kind == "amax":
            return x.amax(dims, keepdim=keepdim)
        return x.amin(dims, keepdim=keepdim)
    return OpDef(kind, _red_parse, local)


register_op([torch.sum, T.sum], _reduction("sum"))
register_op([torch.mean, T.mean], _reduction("mean"))
register_op([torch.amax, T.amax], _reduction("amax"))
register_op([torch.amin, T.amin], _reduction("amin"))


def _softmax(name, fn):
    def parse(x, dim, *a, **k):
        return (x,), {"dim": dim}

    def local(nd, ctx, x, dim):
        return fn(x, _shift(dim, x.dim() - nd, nd))
    return OpDef(name, parse, local)


register_op([torch.softmax, T.softmax, F.softmax], _softmax("softmax", torch.softmax))
register_op([torch.log_softmax, T.log_softmax, F.log_softmax],
            _softmax("log_softmax", torch.log_softmax))


# ---- wiring DistTensor to the table -----------------------------------------------------------

_DUNDERS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
            "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__", "__neg__", "__pow__",
            "__abs__", "__gt__", "__lt__", "__ge__", "__le__", "__getitem__")


def install(cls):
    """Give ``cls`` (DistTensor) torch-function dispatch, operators and tensor methods."""
    from .dispatch import dispatch

    @classmethod
    def __torch_function__(c, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs)
    cls.__torch_function__ = __torch_function__

    def make(f):
        def op(self, *args, **kwargs):
            return dispatch(f, (self,) + args, kwargs)
        op.__name__ = f.__name__
        return op
    for name in _DUNDERS:
        setattr(cls, name, make(getattr(T, name)))

    def __getattr__(self, name):
        f = getattr(T, name, None)
        if f is None or name.startswith("_") or not callable(f):
            raise AttributeError(f"'DistTensor' object has no attribute {name!r}")

        def method(*args, **kwargs):
            return dispatch(f, (self,) + args, kwargs)
        return method
    cls.__getattr__ = __getattr__
    cls.T = property(lambda self: dispatch(T.permute, (self, tuple(reversed(range(self.ndim)))),
                                           None))
    cls.mT = property(lambda self: dispatch(T.transpose, (self, -2, -1), None))
