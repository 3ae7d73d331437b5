"""Elementwise ops with broadcasting: unary, binary, comparisons.

Which placements pass through an elementwise op, per mesh dim (the identity each
row relies on is the comment):

    R    -> R        every rank computes the same thing
    S(d) -> S(d)     elementwise ops act on each shard alone; an input whose dim d is
                     broadcast (size 1, or absent) meets every shard whole: R
    P(sum) -> P(sum) only for ops linear in that input:
        neg, mul/div by a replicated factor   # sum(a_i) * c = sum(a_i * c)
        add/sub of two TENSOR partials         # sum(a_i) + sum(b_i) = sum(a_i + b_i)
    P + 1, relu(P), exp(P), P * P            not linear: reduce first (a constant added
                                             on every rank would be added p times)
    P(float32) + bfloat16 -> bfloat16        reduce first: each part would round alone
    P(bf16) + P(bf16), P(bf16) * c           reduce first: each part would round to 16 bits at
                                             its own size (``rounds``; exact copies pass)
    P(max) -> P(max), P(min) -> P(min) for non-decreasing ops of one input (relu, exp,
                     clamp...)                 # max_i f(a_i) = f(max_i a_i)

A partial input broadcast to a bigger output (x (1, 32, 1) P * y (16, 32, 64)) gives a
partial output as big as y: valid, but the reduction it defers is that big. Such a
strategy carries the deferred reduce-scatter in its ranking (``Strategy.deferred``),
so reducing the small input first wins when it is cheaper.

Unary and binary ops here; casts in ``casts.py``; clamp, where, masked_fill, triu and
tril in ``select.py`` (all with :func:`pointwise_options`). FLOPs per element beside
each name: the formula as PyTorch documents it (``costs.py`` states the convention).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import layout
from ..placement import Partial, Replicate, Shard
from . import costs
from ._util import align, is_tensor
from .samples import Sample
from ..strides import canonical_contiguous
from .strategy import Strategy, combine
from .table import TABLE, register

__all__ = ["pointwise_options", "reduced_in_place", "pointwise_rule", "add_rule", "mul_rule",
           "copy_rule", "linear_rule", "div_rule", "nonlinear_rule", "monotone_rule",
           "with_deferred", "pointwise_local"]

T = torch.Tensor
R = Replicate()
P = Partial("sum")


def _aligned_dim(out_ndim: int, in_shape, d_out: int):
    """Which dim of an input (right-aligned broadcasting) meets output dim d_out, or None."""
    d = d_out - (out_ndim - len(in_shape))
    if d < 0 or in_shape[d] == 1:
        return None
    return d


def _broadcast_shape(specs):
    nd = max(len(s.shape) for s in specs if s is not None)
    out = [1] * nd
    for s in specs:
        if s is None:
            continue
        for i, n in enumerate(s.shape):
            j = nd - len(s.shape) + i
            out[j] = n if out[j] == 1 else out[j]
    return tuple(out)


def pointwise_options(specs, partial_inputs: str = "none", monotone=False, rounds=False):
    """Per-mesh-dim options for an elementwise op.

    partial_inputs: "all" (linear in all inputs jointly: add/sub; only when every input
    is a tensor), "one" (linear in each input separately: mul by a replicated factor),
    "first" (linear in the first input only: div), "none". ``monotone``: P(max) and
    P(min) of the first input pass (the others replicated).  ``rounds``: the op rounds
    its result (add, mul...; not neg or a copy), so with a 16-bit float result no P(sum)
    passes (:func:`_sixteen_bit_result`)."""
    if rounds and partial_inputs != "none" and _sixteen_bit_result(specs):
        partial_inputs = "none"
    shape = _broadcast_shape(specs)
    n = len(specs)
    opts = [(tuple(None if s is None else R for s in specs), (R,), "replicated")]
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        req = tuple(None if s is None else
                    (Shard(_aligned_dim(len(shape), s.shape, d))
                     if _aligned_dim(len(shape), s.shape, d) is not None else R)
                    for s in specs)
        opts.append((req, (Shard(d),), f"elementwise: dim {d} sharded passes through"))
    narrowed = _narrowed(specs) if partial_inputs != "none" else ()
    if partial_inputs == "all" and all(s is not None for s in specs) and not narrowed:
        opts.append((tuple(P for _ in specs), (P,), "linear: P(sum) + P(sum) -> P(sum)"))
    elif partial_inputs in ("one", "first"):
        for k in range(n if partial_inputs == "one" else 1):
            if specs[k] is None or k in narrowed:
                continue
            req = tuple(None if s is None else (P if j == k else R) for j, s in enumerate(specs))
            opts.append((req, (P,), f"linear in input {k}: P(sum) * R -> P(sum)"))
    if monotone and specs[0] is not None:
        for op in ("max", "min"):
            req = tuple(None if s is None else (Partial(op) if j == 0 else R)
                        for j, s in enumerate(specs))
            opts.append((req, (Partial(op),), f"non-decreasing: f(P({op})) = P({op}) of f"))
    return opts


def _narrowed(specs) -> tuple:
    """The inputs whose floating dtype is wider than the one the op computes its result in
    (float32 P(sum) + bfloat16 -> bfloat16): their parts would each be rounded to the
    narrow dtype and summed there, errors as large as the parts (seed 991342: 1 bf16 ulp
    off one device's single rounding), as a narrowing cast of P(sum) would (casts.py)."""
    real = [s for s in specs if s is not None]
    if len({s.dtype for s in real}) < 2:
        return ()
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    try:
        _, out = elementwise_dtypes(
            *[torch.empty((1,) if s.ndim else (), dtype=s.dtype, device="meta") for s in real],
            type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except (RuntimeError, TypeError, ValueError):
        return ()
    if not out.is_floating_point:
        return ()
    return tuple(k for k, s in enumerate(specs) if s is not None and s.dtype.is_floating_point
                 and torch.finfo(s.dtype).bits > torch.finfo(out).bits)


_SIXTEEN = (torch.bfloat16, torch.float16)


def _sixteen_bit_result(specs) -> bool:
    """Is the op's result a bfloat16 / float16 tensor?  Then a partial sum kept partial
    through it has each rank's part rounded to 16 bits at the part's own size, and the
    parts summed after: with cancelling parts (``x @ w1 + x @ w2``, x Shard(1), w Shard(0))
    the error is the parts' rounding, far above the sum's.  One device rounds each product
    once (its matmul accumulates in float32) and adds the two rounded products: reducing
    each partial first (torch.sum of the ranks' 16-bit parts accumulates in float32, one
    rounding) gives that.  Measured (habits12), softmax(x @ w1 + x @ w2), 16 x 64 on 4
    ranks: bfloat16 0.150 off one device kept partial, 0.0010 reduced first; float16
    0.0068 -> 0.0002.  wb.compile's O1 search leaves out the same candidates
    (``compile/search.py`` ``_narrow_partial_sum``)."""
    real = [s for s in specs if s is not None]
    dtypes = {s.dtype for s in real}
    if not dtypes & set(_SIXTEEN):
        return False
    if len(dtypes) == 1:
        return True
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    try:
        _, out = elementwise_dtypes(
            *[torch.empty((1,) if s.ndim else (), dtype=s.dtype, device="meta") for s in real],
            type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except (RuntimeError, TypeError, ValueError):
        return False
    return out in _SIXTEEN


def with_deferred(specs, strategies):
    """Attach to each strategy the reductions its partial output defers beyond those of
    its partial inputs: a partial input broadcast to a bigger output (see the module
    docstring). Bytes: the output's local size on the busiest rank."""
    real = [s for s in specs if s is not None]
    mesh = real[0].mesh
    shape = _broadcast_shape(specs)
    numel = math.prod(shape)
    esize = max(_esize(s.dtype) for s in real)
    out = []
    for st in strategies:
        o = st.outputs[0]
        dims = []
        for i, p in enumerate(o):
            if not p.is_partial():
                continue
            grown = [s for s, req in zip(specs, st.inputs)
                     if s is not None and req is not None and req[i].is_partial()
                     and math.prod(s.shape) < numel]
            if grown:
                local = layout.local_numel_max(shape, mesh, tuple(
                    R if q.is_partial() else q for q in o))
                dims.append((i, local * esize))
        out.append(Strategy(st.inputs, st.outputs, st.note, tuple(dims)) if dims else st)
    return out


def _esize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def reduced_in_place(specs, opts, mesh_ndim: int, partial_inputs: str, rounds: bool) -> list:
    """Per mesh dim, the options of :func:`pointwise_options` (``opts``), but where a 16-bit
    rounding op (``rounds``) cannot keep a P(sum) input partial (:func:`_sixteen_bit_result`)
    that input is reduced once into the layout the op needs: Replicate (one all-reduce, as
    Megatron's ``VocabParallelEmbedding.forward`` before the position add,
    NVIDIA/Megatron-LM@000c4ac2:megatron/core/tensor_parallel/layers.py
    ``reduce_from_tensor_model_parallel_region``; torch's ``RowwiseParallel``, output_layouts
    Replicate by default, pytorch/pytorch@8ed74138:torch/distributed/tensor/parallel/style.py),
    or the Shard(d) another tensor input already has on that mesh dim (one reduce-scatter).  The
    other Shard options are left out: the op alone prices a reduce-scatter below the
    all-reduce, and the next op that needs the value whole pays an all-gather on top (the
    GPT dry run's token embedding + position embedding at tp 2 in bf16: reduce-scatter +
    all-gather forward and backward where one all-reduce was, fixemb12)."""
    per_dim = [opts] * mesh_ndim
    if not rounds or partial_inputs == "none" or not _sixteen_bit_result(specs) or not any(
            o[1][0] == P for o in pointwise_options(specs, partial_inputs)):
        return per_dim          # (P + 1: not linear in any dtype, the options unchanged)
    for i in range(mesh_ndim):
        here = [None if s is None else s.placements[i] for s in specs]
        if not any(p is not None and p.is_partial() and p.reduce_op in ("sum", "avg")
                   for p in here):
            continue
        per_dim[i] = [o for o in opts if not o[1][0].is_shard() or any(
            q is not None and q.is_shard() and q == h for q, h in zip(o[0], here))]
    return per_dim


def pointwise_rule(partial_inputs="none", monotone=False, rounds=False):
    def rule(*specs, **attrs):
        real = [s for s in specs if s is not None]
        mesh = real[0].mesh
        opts = pointwise_options(specs, partial_inputs, monotone, rounds)
        sts = combine(mesh.ndim, reduced_in_place(specs, opts, mesh.ndim, partial_inputs,
                                                  rounds), len(specs))
        return with_deferred(specs, sts) if partial_inputs != "none" else sts
    rule.__doc__ = (f"elementwise: S passes; P(sum) passes {partial_inputs!s} linear inputs"
                    + ("; P(max/min) pass (non-decreasing)" if monotone else ""))
    return rule


add_rule = pointwise_rule("all", rounds=True)
mul_rule = pointwise_rule("one", rounds=True)
linear_rule = pointwise_rule("one")      # neg: exact, P(sum) passes any dtype (not P(max/min))


def copy_rule(*specs, **attrs):
    """A copy (clone, contiguous, detach, positive): the values as they are, so every
    placement passes, each Partial as it is (a copy of each part is a part of the copy:
    P(max) / P(min) / P(avg) too), as DTensor's ``propagate_single_input_strategy`` for
    aten.clone / contiguous / detach (pytorch v2.13.0
    torch/distributed/tensor/_ops/_tensor_ops.py:50-101).  Before, a P(min) clone was
    reduce-scattered in eager and all-reduced at O1, a P(min) detach kept in eager and
    reduce-scattered compiled (compile18)."""
    opts = pointwise_options(specs, "one", monotone=True)
    opts = opts + [((Partial("avg"),), (Partial("avg"),), "a copy: P(avg) as it is")]
    return combine(specs[0].mesh.ndim, [opts] * specs[0].mesh.ndim, len(specs))


nonlinear_rule = pointwise_rule("none")
monotone_rule = pointwise_rule("none", monotone=True)
_div_first = pointwise_rule("first", rounds=True)


def div_rule(*specs, rounding_mode=None, **attrs):
    """div: linear in the dividend (P(sum) / R -> P(sum)) unless it rounds."""
    return (_div_first if rounding_mode is None else nonlinear_rule)(*specs)


# ---- parse, local implementation, registration ----------------------------------------

def _parse(*args, **kwargs):
    if kwargs.pop("inplace", False):
        raise NotImplementedError("inplace=True on a DistTensor: in-place ops are not "
                                  "supported; use the out-of-place form (inplace=False)")
    for k, v in kwargs.items():
        if is_tensor(v):
            raise TypeError(f"{k}= given a tensor: pass tensor arguments positionally")
    return tuple(args), kwargs


def _swapped(*args, **kwargs):           # Tensor.__rsub__(x, c) is sub(c, x)
    return _parse(args[1], args[0], *args[2:], **kwargs)


def _zero_dims(nd, ctx, xs):
    """Type promotion: a 0-d tensor does not promote a dimensioned one of the same
    category (bf16 tensor * f32 0-d tensor is bf16), but stacked, every local tensor has
    device axes. A 0-d input that is the same on every rank is given to torch as the 0-d
    tensor it is, so the op promotes (and rounds) exactly as on one device. A 0-d input
    that differs per rank (a partial) is cast to the common dtype torch computes in."""
    if not any(s is not None and s.ndim > 0 for s in ctx.in_specs):
        return xs                  # only 0-d tensors: nothing to promote differently
    out = None
    for k, s in enumerate(ctx.in_specs):
        x = xs[k]
        if s is None or s.ndim != 0 or not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue
        out = out or list(xs)
        if all(x.shape[i] == 1 or x.stride(i) == 0 for i in range(nd)):
            out[k] = x[(0,) * nd]
        else:
            wide = [t.dtype for t in ctx.in_specs if t is not None and t.ndim > 0]
            if wide:
                dim_dtype = wide[0]
                for d in wide[1:]:
                    dim_dtype = torch.promote_types(dim_dtype, d)
                out[k] = x.to(torch.result_type(
                    torch.empty(1, dtype=dim_dtype, device="meta"),
                    torch.empty((), dtype=s.dtype, device="meta")))
    return out or xs


def _promotes_zero_dims(ctx) -> bool:
    """:func:`_zero_dims` has work: a 0-d input beside a dimensioned one (of the input
    specs alone: memoized on the Ctx)."""
    z = ctx.memo.get("zero_dims")
    if z is None:
        nds = [s.ndim for s in ctx.in_specs if s is not None]
        z = ctx.memo["zero_dims"] = 0 in nds and any(n > 0 for n in nds)
    return z


def _local(fn):
    def local(nd, ctx, *xs, **kw):
        if len(xs) == 1:
            # one input: align has nothing to line up, nor _zero_dims to promote (the
            # same call, without theirs: relu of the toy TP step, benchmarks/sim_instr.py)
            return fn(xs[0], **kw) if kw else fn(xs[0])
        if ctx is not None and _promotes_zero_dims(ctx):
            xs = _zero_dims(nd, ctx, xs)
        return fn(*align(nd, *xs), **kw)
    return local


def _register(name, funcs, rule, flops, op_class="elementwise", swapped=(), local=None, **kw):
    cost = costs.elementwise(flops) if flops is not None else costs.movement
    register(name, list(funcs) + [(f, _swapped) for f in swapped if f is not None],
             parse=_parse, rule=rule, local=local or _local(funcs[0]), cost=cost,
             op_class=op_class, **kw)


def _scaled_local(fn, divides: bool):
    """mul / div: a partial sum scaled part by part is exact only by finite factors (and
    nonzero divisors); a factor tensor with inf (or a 0 divisor) there raises, as the sum
    of the parts' +-inf would be nan (a nan factor gives nan either way).  The dispatcher
    reduces the partial sum first where it sees them (dispatch._unsafe_scale /
    _unsafe_factor): this is the guard behind it."""
    base = _local(fn)

    def local(nd, ctx, *xs, **kw):
        out = base(nd, ctx, *xs, **kw)
        if ctx is None or not any(p.is_partial() and p.reduce_op in ("sum", "avg")
                                  for ps in ctx.out_placements for p in ps):
            return out
        for k, (x, s) in enumerate(zip(xs, ctx.in_specs)):
            if s is None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or \
                    any(p.is_partial() for p in s.placements) or divides and k == 0:
                continue
            if (bool((x == 0).any()) if divides else bool(torch.isinf(x).any())):
                what = "divided by a tensor holding 0" if divides else \
                    "times a tensor holding inf"
                raise NotImplementedError(
                    f"{'div' if divides else 'mul'}: a partial sum {what}: part by part the result would be nan where the sum's is +-inf; reduce "
                    "the partial input first (.redistribute to Replicate) or mask with "
                    "torch.where")
        return out
    return local


pointwise_local = _local          # the local implementation of an elementwise torch function


# ---- validator samples (``samples.py``): input makers of a unary op's first callable --------
X = lambda g: [(g.rn(5, 6),)]                                            # noqa: E731
POS = lambda g: [(g.pos(5, 6),)]                     # log, sqrt, 1/x     # noqa: E731


def _ties(f):
    """``f(a, b)`` on values of a 1/16 grid equal in about half the places (comparisons)."""
    def sample(g):
        a = g.grid(5, 6)
        return [Sample(f, (a, g.ties(a, g.grid(5, 6))))]
    return sample


# ---- unary: name -> (callables, FLOPs per element, rule, sample inputs) ---------------------
# non-decreasing (P(max), P(min) pass): relu, exp, sigmoid, tanh, erf, softplus, hardtanh,
# floor, ceil, round, sign; log/sqrt are not over parts that may be negative (nan).
UNARY = {
    "relu": ((torch.relu, F.relu, T.relu), 1, monotone_rule, X),              # max(x, 0)
    "gelu": ((F.gelu,), 5, nonlinear_rule, X),       # x/2 (1 + erf(x/sqrt2)); tanh form 9
    "silu": ((F.silu,), 4, nonlinear_rule, X),       # x / (1 + exp(-x))
    "sigmoid": ((torch.sigmoid, T.sigmoid, F.sigmoid), 3, monotone_rule, X),  # 1/(1+exp(-x))
    "tanh": ((torch.tanh, T.tanh, F.tanh), 1, monotone_rule, X),
    "exp": ((torch.exp, T.exp), 1, monotone_rule, X),
    "log": ((torch.log, T.log), 1, nonlinear_rule, POS),
    "sqrt": ((torch.sqrt, T.sqrt), 1, nonlinear_rule, POS),
    "rsqrt": ((torch.rsqrt, T.rsqrt), 1, nonlinear_rule, POS),
    "abs": ((torch.abs, T.abs, T.__abs__), 1, nonlinear_rule, X),
    "neg": ((torch.neg, T.neg, T.__neg__), 1, linear_rule,                     # linear
            lambda g: [(g.rn(5, 6),), (g.ints(7, 2),)]),
    "square": ((torch.square, T.square), 1, nonlinear_rule, X),
    "sin": ((torch.sin, T.sin), 1, nonlinear_rule, X),
    "cos": ((torch.cos, T.cos), 1, nonlinear_rule, X),
    "erf": ((torch.erf, T.erf), 1, monotone_rule, X),
    "expm1": ((torch.expm1, T.expm1), 1, monotone_rule, X),                  # exp(x) - 1
    "log1p": ((torch.log1p, T.log1p), 1, nonlinear_rule, POS),               # log(1 + x)
    "reciprocal": ((torch.reciprocal, T.reciprocal), 1, nonlinear_rule, POS),
    "softplus": ((F.softplus,), 6, monotone_rule, None),  # log(1 + exp(b x)) / b; x b > threshold
    "leaky_relu": ((F.leaky_relu,), 2, nonlinear_rule, None),   # compare, multiply
    "elu": ((F.elu,), 4, nonlinear_rule, None),                 # x > 0 ? x : a (exp(x) - 1)
    "mish": ((F.mish,), 5, nonlinear_rule, None),               # x tanh(log(1 + exp(x)))
    "hardtanh": ((F.hardtanh,), 2, monotone_rule, None),        # clamp(x, lo, hi)
    "floor": ((torch.floor, T.floor), 1, monotone_rule, None),
    "ceil": ((torch.ceil, T.ceil), 1, monotone_rule, None),
    "round": ((torch.round, T.round), 1, monotone_rule, None),
    "sign": ((torch.sign, T.sign), 1, monotone_rule, None),
    "isnan": ((torch.isnan, T.isnan), 1, nonlinear_rule, None),
    "isfinite": ((torch.isfinite, T.isfinite), 1, nonlinear_rule, None),
    "logical_not": ((torch.logical_not, T.logical_not), 1, nonlinear_rule, None),
    "clone": ((torch.clone, T.clone), None, copy_rule,                         # a copy
              lambda g: [(g.rn(7, 3, dtype=torch.float64),)]),
    "contiguous": ((T.contiguous,), None, copy_rule, X),
}
# contiguous: shards with a contiguous tensor's strides, size-1 dims too (d.stride(), .strides)
_LOCALS = {"contiguous": lambda nd, ctx, x, **kw: canonical_contiguous(x, **kw)}
for _n, (_fs, _fl, _rule, _args) in UNARY.items():
    _register(_n, _fs, _rule, _fl, op_class="data_movement" if _fl is None else "elementwise",
              sample=_args and (lambda g, f=_fs[0], a=_args: [Sample(f, x) for x in a(g)]),
              local=_LOCALS.get(_n))

register("positive", [torch.positive, T.positive], parse=_parse, rule=copy_rule,
         local=_local(torch.positive), cost=costs.view, op_class="view")
# detach: the same values on the same storage, cut from autograd: every placement passes
# (R, S and P alike: no value changes) and no kernel runs.  Reached through the op table
# by ``torch.detach(d)`` and by a compiled program (``wb.compile`` captures ``x.detach()``);
# ``d.detach()`` on a DistTensor is its own method (the in-place init idioms it keeps).
register("detach", [torch.detach, T.detach], parse=_parse, rule=copy_rule,
         local=_local(torch.detach), cost=costs.view, op_class="view",
         sample=lambda g: [Sample(torch.detach, (g.rn(5, 6),))])


# kept_copy: a compiled program's ``t.redistribute(mesh, placements)`` (wb.compile's tracer,
# compile/tracer.py): a copy of ``t`` in the layout ``t`` has (the only candidate: no
# reshard before it, whatever the search), its output pinned to the call's placements, so
# the program reshards there as eager's call does.  Not an op eager dispatches itself.
def kept_copy(input):
    """The values of ``input``, a new tensor (the table's callable for a captured
    ``redistribute``; its layout is the input's)."""
    return input.clone()


def _as_it_is(x, **_):
    return combine(x.mesh.ndim, [[((p,), (p,), "as it is: the redistribute reshards after")]
                                 for p in x.placements], 1)


register("kept_copy", [kept_copy], parse=_parse, rule=_as_it_is, local=_local(torch.clone),
         cost=costs.view, op_class="view",
         sample=lambda g: [Sample(kept_copy, (g.rn(5, 6),))])


# reduced_copy: a composite's own ``reshard`` of its partial value to Replicate (vector_norm's
# power sum before the root, F.normalize's input: ops_table/vector_norm._reduced), as a
# compiled program records it: capture's stand-ins are plain meta tensors with no
# placements, so the reshard itself cannot run there (it was a no-op, and O0 kept the power
# sum partial through ``where`` and all-reduced it again before sqrt: wide probe seeds 308,
# 325, compile18).  Its one candidate reads the input with every Partial mesh dim
# Replicate (the others as they are), so the program reshards it there, as eager's call.
def reduced_copy(input):
    """The values of ``input``, a new tensor (the table's callable for a captured
    ``_reduced``; its layout is the input's with the partial mesh dims reduced)."""
    return input.clone()


def _partials_replicated(x, **_):
    return combine(x.mesh.ndim, [[((q,), (q,), "partial reduced first, as eager's reshard")]
                                 for q in (R if p.is_partial() else p for p in x.placements)],
                   1)


register("reduced_copy", [reduced_copy], parse=_parse, rule=_partials_replicated,
         local=_local(torch.clone), cost=costs.view, op_class="view",
         sample=lambda g: [Sample(reduced_copy, (g.rn(5, 6),))])


def _detach_as_method(args, kwargs):
    """``torch.detach(d)`` and a compiled program's ``x.detach()`` as ``d.detach()``: torch's
    detach is no view to autograd, so a write into it is allowed where a view of a leaf that
    requires grad refuses it (was: RuntimeError 'a view of a leaf Variable that requires
    grad is being used in an in-place operation' for ``torch.detach(p).add_(1)`` and the
    compiled ``x.detach()``'s result, where torch and ``p.detach()`` write ``p``)."""
    from ..dist_tensor import DistTensor
    if len(args) == 1 and not kwargs and type(args[0]) is DistTensor:
        return args[0].detach()
    return NotImplemented


TABLE["detach"].extra["other_form"] = _detach_as_method

# ---- binary: name -> (callables, reversed dunder, FLOPs per element, rule, sample) ----------
_BUG10 = "issue 10: P(sum) + scalar adds the scalar on every rank"
BINARY = {
    "add": ((torch.add, T.add, T.__add__), T.__radd__, 1, add_rule, lambda g: [
        Sample(torch.add, (g.rn(5, 6), g.rn(5, 6))), Sample(torch.add, (g.rn(5, 6), g.rn(6))),
        Sample(torch.add, (g.ints(7, 3), g.ints(3))),
        Sample(T.__add__, (g.rn(5, 6), 1.5), known_bug=_BUG10),
        Sample(T.__radd__, (g.rn(6), 2), known_bug=_BUG10)]),
    "sub": ((torch.sub, T.sub, T.__sub__), T.__rsub__, 1, add_rule, lambda g: [
        Sample(torch.sub, (g.rn(5, 6), g.rn(1, 6))), Sample(torch.sub, (g.rn(6), g.rn(5, 6))),
        Sample(T.__sub__, (g.rn(5, 6), 0.5), known_bug=_BUG10),
        Sample(T.__rsub__, (g.rn(5, 6), 1.0), known_bug=_BUG10)]),
    "mul": ((torch.mul, T.mul, T.__mul__), T.__rmul__, 1, mul_rule, lambda g: [
        Sample(torch.mul, (g.rn(5, 6), g.rn(5, 6))), Sample(torch.mul, (g.rn(5, 1), g.rn(6))),
        Sample(T.__mul__, (g.rn(5, 6), 2.5))]),
    "div": ((torch.div, T.div, T.__truediv__), T.__rtruediv__, 1, div_rule, lambda g: [
        Sample(torch.div, (g.rn(5, 6), g.pos(5, 6))), Sample(torch.div, (g.rn(5, 6), g.pos(6)))]),
    "pow": ((torch.pow, T.pow, T.__pow__), T.__rpow__, 1, nonlinear_rule, lambda g: [
        Sample(torch.pow, (g.rn(5, 6), 2)), Sample(torch.pow, (g.pos(5, 6), 0.5))]),
    "maximum": ((torch.maximum, T.maximum), None, 1, nonlinear_rule, _ties(torch.maximum)),
    "minimum": ((torch.minimum, T.minimum), None, 1, nonlinear_rule,
                lambda g: [Sample(torch.minimum, (g.rn(5, 6), g.rn(6)))]),
    "atan2": ((torch.atan2, T.atan2), None, 1, nonlinear_rule, None),
    "remainder": ((torch.remainder, T.remainder, T.__mod__), None, 4, nonlinear_rule, None),
    "fmod": ((torch.fmod, T.fmod), None, 4, nonlinear_rule, None),   # x - trunc(x / y) y
    "logical_and": ((torch.logical_and, T.logical_and), None, 1, nonlinear_rule, None),
    "logical_or": ((torch.logical_or, T.logical_or), None, 1, nonlinear_rule, None),
}
for _c in ("eq", "ne", "lt", "le", "gt", "ge"):
    # (__eq__ / __ne__ are added in tensor_habits.py; a DistTensor hashes by id)
    _d = getattr(T, f"__{_c}__") if _c not in ("eq", "ne") else None
    BINARY[_c] = ((getattr(torch, _c), getattr(T, _c), _d), None, 1, nonlinear_rule,
                  _ties(getattr(torch, _c)))
for _n, (_fs, _rev, _fl, _rule, _sample) in BINARY.items():
    _register(_n, [f for f in _fs if f is not None], _rule, _fl, swapped=(_rev,), sample=_sample,
              local=_scaled_local(_fs[0], _n == "div") if _n in ("mul", "div") else None)
