"""Contractions generated from einsum strings: matmul, mm, bmm, linear, einsum.
All are priced by one formula (:func:`costs.einsum_flops`, 2 FLOPs per multiply-add)
except ``F.linear``, priced by ``workbench.ops.cost("linear")`` (the same 2MNK plus the
bias).

For ``"mk,kn->mn"`` and one mesh dim, the valid layouts are (the scaling book's
numbered cases):

    A[M_x, K] . B[K, N]   -> C[M_x, N]      shard a free dim of one operand
    A[M, K] . B[K, N_x]   -> C[M, N_x]
    A[B_x..] . B[B_x..]   -> C[B_x..]       shard a batch dim of both
    A[M, K_x] . B[K_x, N] -> C[M, N]{U_x}   shard the contraction: a partial sum
    A{U_x} . B            -> C{U_x}         linear in each operand
    A . B                 -> C              replicate

Rules for every mesh dim are combined (:func:`strategy.combine`).
"""
from __future__ import annotations

import math
import string

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from .. import versions
from ..placement import Partial, Replicate, Shard
from . import costs, linear_regather
from ._util import align
from .samples import Sample
from .strategy import combine
from .table import TABLE, add_funcs, register

T = torch.Tensor
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


# ---- matmul, mm, bmm -----------------------------------------------------------------

def matmul_rule(a, b):
    """torch.matmul / mm / bmm: the einsum rule of ``matmul_equation``."""
    return einsum_rule(a, b, equation=matmul_equation(a.shape, b.shape))


def _torch_outcome(fn, ts):
    """What torch's ``fn`` does for operands of ``ts``' shapes and dtypes: None when it
    returns, else its exception.  The dtypes are judged on small CPU stand-ins (every
    size clamped to 2, a 0 kept: the same broadcasting and emptiness, and the kernels
    torch picks at such sizes; stride-0 stand-ins took other paths: einsum of a bool
    raised RuntimeError there, NotImplementedError on real data); where they pass, the
    real shapes on meta tensors of one dtype (meta bmm checks dtypes where CPU's returns)."""
    try:
        fn(*_stand_ins(ts))
        fn(*[torch.empty(tuple(t.shape), device="meta") for t in ts])    # shapes only
    except Exception as e:              # noqa: BLE001 - torch's exception, handed back
        return e
    return None


def _stand_ins(ts) -> list:
    """:func:`_torch_outcome`'s CPU stand-ins, requiring grad as the operands do: torch's
    matmul of a (4, 0) and a (2, 0, 2) operand of two dtypes returns zeros, and raises
    RuntimeError when one requires grad (at::native::matmul folds by requires_grad, with
    or without grad mode: another path, through the dtype check)."""
    return [torch.zeros(tuple(min(n, 2) for n in t.shape), dtype=t.dtype).requires_grad_(
        bool(getattr(t, "requires_grad", False)
             and (t.dtype.is_floating_point or t.dtype.is_complex))) for t in ts]


def same_dtype(name, *ts, fn=None):
    """torch's products do not promote: matmul / mm / bmm / linear / einsum of a float32 and
    a float64 operand raise RuntimeError ("expected m1 and m2 to have the same dtype, but
    got: float != double", ATen's mm / addmm checks).  Their meta kernels do not check it, so
    the op table's meta check let it through: the local product promoted or raised by the
    local layout (a zero-size shard: a float64 result, silently).  ``fn``: torch's op, run on
    stand-ins to see whether torch returns anyway (an empty contraction or result: zeros of
    the dtype torch gives, the operands cast to it, as sweep9).  Returns the operands."""
    ds = [t.dtype for t in ts if getattr(t, "dtype", None) is not None]   # (Dist)Tensors
    if ds and ds.count(ds[0]) != len(ds):            # (one dtype: nothing to check)
        names = " != ".join(str(d).replace("torch.", "") for d in ds)
        err = _torch_outcome(fn, ts) if fn is not None else RuntimeError()
        if err is not None and type(err) is not RuntimeError:
            # another type (NotImplementedError: "bmm" not implemented for 'Bool'): torch's
            raise type(err)(f"{name}: {err}. Fix: cast the operands to one floating "
                            "dtype, e.g. b.to(a.dtype)") from None
        if err is None:
            # bmm (and matmul / einsum through it) returns before its dtype check when the
            # contraction or the result is empty: zeros of the SECOND operand's dtype
            # (torch 2.13: bmm(float64 (2, 4, 0), float32 (2, 0, 2)) is float32): the
            # product of the operands cast to that dtype is those zeros (the casts'
            # backward gives each operand its gradient in its dtype, as autograd casts
            # torch's; seeds 1042115, 1043049, 1043502 were refused)
            dt = fn(*_stand_ins(ts)).dtype
            return tuple(t.to(dt) for t in ts)
        raise RuntimeError(f"{name}: expected m1 and m2 to have the same dtype, but got: "
                           f"{names} (torch does not promote in a product, nor does autocast "
                           f"cast float64). Fix: cast one operand, e.g. b.to(a.dtype)")
    return ts


def _matmul_parse(a, b):
    if a.dim() == 0 or b.dim() == 0:
        raise RuntimeError(f"both arguments to matmul need to be at least 1D, but they are "
                           f"{a.dim()}D and {b.dim()}D. Fix: use * (torch.mul) to scale by a "
                           "0-d tensor")
    a, b = same_dtype("matmul", a, b, fn=torch.matmul)
    return (a, b), {}


def _mm_parse(name, ndim):
    def parse(a, b):
        if a.dim() != ndim or b.dim() != ndim:
            raise RuntimeError(f"{name}: expected {ndim}-D tensors, got {a.dim()}-D and "
                               f"{b.dim()}-D; torch.matmul broadcasts any shapes")
        a, b = same_dtype(name, a, b, fn=getattr(torch, name))
        return (a, b), {}
    return parse


def _dense_grad(y, nd, check=None):
    """A product batched over the ranks (``nd`` lead dims) gets its gradient contiguous: a
    gradient that arrives expanded (stride 0, e.g. from ``sum``) makes torch's CPU bmm
    copy it one matrix at a time (8 ranks, toy TP step: 24 us against 12 us per bmm,
    benchmarks/sim_overhead.py); one copy of the whole gradient is cheaper.  Values are
    unchanged.  ``check`` (:func:`_batched`'s): run first, by the same hook."""
    if check is not None:
        y.register_hook(lambda g: (check(), _contiguous(g) if nd else g)[1])
    elif nd and y.requires_grad:
        y.register_hook(_contiguous)
    return y


def _contiguous(g):
    # an undefined gradient reaches the hook as None (a consumer with no derivative for
    # it: vector_norm of ord 0, seed 1030754 raised "descriptor 'contiguous' ... NoneType")
    return None if g is None else g.contiguous()


def _batched(a, b, nd=0, a0=None, b0=None, ga=None, gb=None, srcs=None, op=torch.matmul):
    """torch.matmul; two 3-d operands with one batch size go straight to bmm, which is what
    matmul runs for them, without matmul's expand and reshape nodes in the autograd graph
    (8 ranks, toy TP step: ~14 us less per product, forward and backward).  ``a0``, ``b0``:
    the operands before ``align`` (``nd`` lead dims), whose one rank's matrices one device
    multiplies; ``ga``, ``gb``: their global shapes (None: unknown); ``srcs``: torch.matmul's
    own operands (before a 1-d one's unsqueeze), where ``ga``, ``gb`` are theirs.  Returns
    the product and a check for its backward (None: nothing kept), which
    :func:`_dense_grad` runs."""
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        if srcs is None or _itself(a, srcs[0]) and _itself(b, srcs[1]):
            return torch.bmm(a, b), None        # (an operand saved itself: torch's check)
        return torch.bmm(a, b), _detach_guard(srcs, nd, ga, gb, op)
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return torch.matmul(a, b), None
    # matmul may lay a stacked operand out by a copy and save that copy, where one
    # device's matmul saves the operand itself (derivatives.yaml: each operand for the
    # other's gradient): the operand is then checked by the product's hook, so that a
    # write into it raises as one device's does; and the other way round (inplace17):
    # one device's matmul saves its own copy (``a.expand(2, 4, 4) @ x`` folds the
    # expanded a by a copy: a later write into a does not raise) where this one saves a
    # view (a replicated operand's stride-0 lead dim merges): it multiplies a copy too
    # (torch's saved-variable check raised where one device passes).  Cost, ``valgrind
    # --tool=callgrind --instr-atstart=no benchmarks/sim_instr.py gpt 3`` measured here,
    # base e1d4d260^^ then inplace17: 221.75M -> 221.99M instructions (+0.1%: the key
    # reads the operands before align; no product of gpt-tiny takes a copy)
    a0 = a if a0 is None else a0
    b0 = b if b0 is None else b0
    # (inplace18) a moved operand (the dispatcher's copy: a gather) lost the expand's
    # stride 0 that decides one device's copy: its source's strides are read instead
    sa0, sb0 = versions.source_of(a0), versions.source_of(b0)
    oa0 = a0 if sa0 is None or sa0.shape[:nd] != a0.shape[:nd] else sa0
    ob0 = b0 if sb0 is None or sb0.shape[:nd] != b0.shape[:nd] else sb0
    key = (a.shape, a.stride(), b.shape, b.stride(), a.requires_grad, b.requires_grad,
           a0.shape, a0.stride(), b0.shape, b0.stride(), nd, ga, gb, oa0.stride(),
           ob0.stride())
    keep = _KEEP.get(key)
    if keep is None:
        ca, cb = _copies(a, b)
        oa, ob = _one_device_copies(oa0, ob0, nd, ga, gb) if a0.dim() - nd > 2 or \
            b0.dim() - nd > 2 else (False, False)
        keep = _KEEP[key] = (ca and not oa and b.requires_grad,
                             cb and not ob and a.requires_grad,
                             oa and not ca and b.requires_grad,
                             ob and not cb and a.requires_grad)
        if len(_KEEP) > 4096:
            _KEEP.clear()
    y = torch.matmul(a.clone() if keep[2] else a, b.clone() if keep[3] else b)
    check = None
    if keep[0] or keep[1]:
        check = versions.saved_check([t for t, k in zip((a, b), keep) if k])
    det = None if srcs is None or srcs[0].grad_fn is None and srcs[1].grad_fn is None \
        else _detach_guard(srcs, nd, ga, gb, op)
    if det is not None:
        check = det if check is None else (lambda c=check: (det(), c()))
    return y, check


def _itself(t, src):
    """``t`` (an operand bmm saves) is the DistTensor's own local tensor ``src``, or
    ``src`` has no history: torch's own saved-variable check meets a ``detach_()``."""
    return src.grad_fn is None or t is src and versions.source_of(src) is None


def _detach_guard(srcs, nd, ga, gb, op=torch.matmul):
    """One device's mm / mv / dot saves an operand itself: after ``a.detach_()`` its
    backward raises torch's "detached in-place" error, where this kernel may have saved a
    view of the operand (align's expand, matmul's reshape), which keeps its history
    (inplace17's strict xfails over R-R@2d, S(0)-R@2d, S(1)@1d: backward answered).  The
    check of the operands one device saves that have history (versions.detach_check), or
    None."""
    a, b = srcs
    key = (a.shape, a.stride(), b.shape, b.stride(), a.requires_grad, b.requires_grad,
           nd, ga, gb, op)
    saves = _SAVES.get(key)
    if saves is None:
        saves = _SAVES[key] = _one_device_saves(srcs, nd, ga, gb, op)
        if len(_SAVES) > 4096:
            _SAVES.clear()
    held = [t for t, k in zip(srcs, saves) if k and t.grad_fn is not None]
    return versions.detach_check(held) if held else None


_SAVES: dict = {}       # _detach_guard's key -> _one_device_saves


def _one_device_saves(srcs, nd, ga, gb, op=torch.matmul):
    """(a saved, b saved): whether one device's ``torch.matmul`` of operands of global
    shapes ``ga``, ``gb`` laid out as one rank's ``srcs`` (``nd`` lead dims) saves each
    operand itself for backward (``mm``, ``mv``, ``dot``; a view of it elsewhere: a 1-d
    left operand's unsqueeze, a folded or expanded stacked one): asked of torch on meta
    stand-ins by a saved-tensors hook (once per layout: :data:`_KEEP`)."""
    a, b = (t[(0,) * nd] if nd else t for t in srcs)
    a, b = _global_like(a, ga), _global_like(b, gb)
    got = []
    try:        # (outside the caller's dispatch modes, as versions._saves_itself)
        with _disable_current_modes(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: got.append(t) or t,
                                                         lambda t: t):
            a, b = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    .requires_grad_(t.requires_grad) for t in (a, b))
            op(a, b)
    except RuntimeError:        # (saved-tensor hooks disabled): as ATen's _matmul_impl
        da, db = a.dim(), b.dim()   # measured on torch 2.13: mm, mv, dot save themselves
        if op is not torch.matmul:  # mm, bmm: both
            return b.requires_grad, a.requires_grad
        return (b.requires_grad and (da == 1 and db != 2 or da == 2 and db <= 2),
                a.requires_grad and db <= 2)
    return any(t is a for t in got), any(t is b for t in got)


# (operands' sizes, strides, requires_grad, operands before align, nd, global shapes) ->
# (check a, check b, copy a, copy b): a pure function of the layouts, read once per
# layout (~27 us a product otherwise)
_KEEP: dict = {}


def _one_device_copies(a, b, nd, ga=None, gb=None):
    """(a copied, b copied) by one device's torch.matmul of one rank's operands (``nd``
    lead dims dropped): there torch saves its own copy too, and a write into the operand
    does not raise (``a.expand(2, 4, 4) @ x`` folds the expanded a by a copy).  Read from
    one rank's local matrices, whose strides are the global tensor's where no dim is
    split (an approximation for a split dim of a 3-d or larger operand).  A 1-d or 2-d
    operand is never copied (mm, mv); a larger one folded against a 2-d one is copied
    where its dims but the last do not merge (its ``mT``'s for the right operand);
    between two larger ones, as :func:`_copies`.  ``ga``, ``gb``: the global shapes, where
    known: a split dim then takes its global size (:func:`_global_like`)."""
    if nd:
        a, b = a[(0,) * nd], b[(0,) * nd]
    a, b = _global_like(a, ga), _global_like(b, gb)
    da, db = a.dim(), b.dim()
    if da <= 2 and db <= 2:
        return False, False
    if db <= 2:
        return not _merge(tuple(a.shape[:-1]), a.stride()[:-1]), False
    if da <= 2:
        n, st = b.shape, b.stride()
        return False, not _merge(tuple(n[:-2]) + (n[-1],), st[:-2] + (st[-1],))
    from ._util import align as _align
    ra, rb = (a, b) if da == db else _align(1, a.unsqueeze(0), b.unsqueeze(0))
    if da != db:
        ra, rb = ra[0], rb[0]
    if ra.dim() == 3 and ra.shape[0] == rb.shape[0]:
        return False, False                 # bmm of the operands as they are
    return _copies(ra, rb)


def _global_like(t, shape):
    """A meta stand-in of one device's operand of global ``shape`` laid out as the rank's
    local ``t``: an expanded dim (stride 0) keeps stride 0, the others the dense strides
    of the global sizes in ``t``'s dim order (:mod:`..strides`).  A split dim shows one
    element on a rank (``a.expand(2, 4, 4)`` split by rows over 4 ranks: (2, 1, 4) of
    strides (0, 4, 1), whose dims merge) where one device's do not merge: its
    ``reshape`` copies and a write into ``a`` does not raise (it raised here over S(0)@1d,
    P(max)@1d).  ``t`` itself where the shapes do not pair up."""
    if shape is None or len(shape) != t.dim() or tuple(shape) == tuple(t.shape):
        return t
    from ..strides import _order, dense_stride
    st, n = t.stride(), tuple(shape)
    free = [st[i] == 0 and n[i] > 1 for i in range(len(n))]
    order = _order(st, [t.shape[i] == 1 for i in range(len(n))], tuple(t.shape))
    dense = dense_stride(tuple(1 if f else k for f, k in zip(free, n)), order)
    gst = tuple(0 if f else s for f, s in zip(free, dense))
    return torch.empty_strided(n, gst, dtype=t.dtype, device="meta").requires_grad_(
        t.requires_grad)


def _merge(sizes, strides) -> bool:
    """True if dims of these sizes and strides can be viewed as one dim (torch's
    reshape then returns a view, not a copy): each stride is the next one's times its
    size, size-1 dims aside (ATen's computeStride)."""
    if 0 in sizes:
        return True
    want = None
    for n, s in zip(reversed(sizes), reversed(strides)):
        if n == 1:
            continue
        if want is not None and s != want:
            return False
        want = s * n
    return True


def _copies(a, b):
    """(a copied, b copied): whether torch.matmul of these two operands of one number of
    dims (>= 3, not bmm's one batch size) may save a copy of each instead of a view
    (pytorch/pytorch aten/src/ATen/native/LinearAlgebra.cpp, ``_matmul_impl``: the batched
    case expands the batch dims and reshapes them into one, a copy where they do not
    merge; two 3-d operands whose batch sizes differ, the size-1 one requiring grad, fold
    the other into a matrix instead, by ``reshape(-1, k)`` of it or of its ``mT``).  Errs
    towards True: an operand kept needlessly is checked twice, never missed
    (tests/test_inplace15.py holds it to the saved tensors of torch's graph)."""
    sa, sb = a.shape, b.shape
    if a.dim() == 3 and sa[0] != sb[0] and (sa[0] == 1 and a.requires_grad or
                                             sb[0] == 1 and b.requires_grad):
        big = b if sa[0] == 1 and a.requires_grad else a
        n, st = big.shape, big.stride()
        folds = _merge((n[0], n[1]), (st[0], st[1])) and _merge((n[0], n[2]), (st[0], st[2]))
        return (big is a and not folds, big is b and not folds)
    batch = tuple(max(x, y) for x, y in zip(sa[:-2], sb[:-2]))
    out = []
    for t in (a, b):
        st = tuple(0 if n == 1 else s for n, s in zip(t.shape[:-2], t.stride()[:-2]))
        out.append(not _merge(batch, st))
    return tuple(out)


def _mm_local(nd, ctx, a, b):
    return _matmul_local(nd, ctx, a, b, torch.mm)


def _bmm_local(nd, ctx, a, b):
    # (torch.bmm saves both operands themselves, where torch.matmul of two 3-d ones saves
    # views: the detach_() guard asks the op run, inplace18)
    return _matmul_local(nd, ctx, a, b, torch.bmm)


def _matmul_local(nd, ctx, a, b, op=torch.matmul):
    """torch.matmul on stacked tensors: a 1-d operand gets a size-1 dim that is dropped
    afterwards, as torch.matmul does (so (3,1,1) @ (1,) is (3, 1), (4,) @ (2,4,3) is (2, 3))."""
    la, lb = a.dim() - nd, b.dim() - nd
    srcs = (a, b) if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad) \
        else None
    if la == 1:
        a = a.unsqueeze(nd)                       # (lead, 1, k)
    if lb == 1:
        b = b.unsqueeze(-1)                       # (lead, k, 1)
    sa, sb = (None if s is None else tuple(s.shape) for s in ctx.in_specs[:2]) \
        if ctx is not None and len(ctx.in_specs) >= 2 else (None, None)
    y, check = _batched(*align(nd, a, b), nd, a, b, sa, sb, srcs, op)
    y = _dense_grad(y, nd, check)
    if lb == 1:
        y = y.squeeze(-1)
    if la == 1:
        y = y.squeeze(-1 if lb == 1 else -2)
    return y


def _matmul_eq(ins, attrs):
    return matmul_equation(tuple(ins[0].shape), tuple(ins[1].shape))


_MM_COST = costs.contraction(_matmul_eq)
register("matmul", [torch.matmul, T.matmul, T.__matmul__], parse=_matmul_parse,
         rule=matmul_rule, local=_matmul_local, cost=_MM_COST, op_class="matmul",
         sample=lambda g: [Sample(torch.matmul, (g.rn(5, 6), g.rn(6, 3))),
                           Sample(torch.matmul, (g.rn(2, 5, 3), g.rn(3, 4))),
                           Sample(torch.matmul, (g.rn(5, 6), g.rn(6))),
                           Sample(torch.matmul, (g.rn(5), g.rn(5, 3)))])
add_funcs("matmul", [(T.__rmatmul__, lambda a, b: _matmul_parse(b, a))])
register("mm", [torch.mm, T.mm], parse=_mm_parse("mm", 2), rule=matmul_rule,
         local=_mm_local, cost=_MM_COST, op_class="matmul",
         sample=lambda g: [Sample(torch.mm, (g.rn(5, 6), g.rn(6, 3)))])
register("bmm", [torch.bmm, T.bmm], parse=_mm_parse("bmm", 3), rule=matmul_rule,
         local=_bmm_local, cost=_MM_COST, op_class="matmul",
         sample=lambda g: [Sample(torch.bmm, (g.rn(2, 5, 3), g.rn(2, 3, 4)))])
# the kernel asks which operand one device saves (_detach_guard): the dispatcher's own
# detach_() guard of a moved input is not needed (versions.guard_detach)
for _n in ("matmul", "mm", "bmm"):
    TABLE[_n].extra["detach_guard"] = True


# ---- linear: x @ w.T + b -------------------------------------------------------------

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


def _same_on_every_rank(x, nd) -> bool:
    """The stacked x holds one tensor for all ranks (lead dims of size 1 or stride 0)."""
    if nd == 1:
        return x.size(0) == 1 or x.stride(0) == 0
    return all(x.shape[i] == 1 or x.stride(i) == 0 for i in range(nd))


class _RankLinear(torch.autograd.Function):
    """``bmm(x, w.transpose(1, 2))``: every rank's ``x_r @ w_r.T`` (x ``(L, T, k)``, w ``(L, n, k)``,
    one of each per rank: a row-parallel linear, whose output is a partial sum), with the
    backward of torch's bmm, except where the output's gradient is the same on every rank
    (stride 0 along the ranks: the gradient of a partial sum, from its all-reduce or a loss
    taken of it).  Then every rank's ``G @ w_r`` and ``G.T @ x_r`` are each one GEMM with the
    ranks' slices side by side (the column-parallel forward's trick, in backward), at
    single-device speed, and the weight's gradient comes out in the layout of a weight
    sharded on its input dim (no copy to the parameter's strides); no 8x gradient copy
    (the 1024 x 512 TP step of benchmarks/sim_overhead.py)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.wb_detach_tokens = None     # versions.guard_kernel's, checked in backward
        return torch.bmm(x, w.transpose(1, 2))

    @staticmethod
    def backward(ctx, g):
        versions.check_detached(ctx)
        x, w = ctx.saved_tensors
        gx = gw = None
        if g.stride(0) == 0:
            need_x, need_w = ctx.needs_input_grad
            G = g.select(0, 0)                                          # (T, n)
            if need_x and need_w:
                G = G.contiguous()          # one copy where both GEMMs would copy it
            L, n, k = w.shape
            T = G.size(0)
            # torch.mm: what ``@`` of two 2-d tensors runs (at::matmul's 2-d case), without
            # matmul's shape dispatch.  Where every size is above 1, each reshape below that
            # is a view, and each view-then-transpose, is one as_strided of the same sizes,
            # strides and offset (_side_by_side, _per_rank): the same tensors, in one call
            # instead of two (toy TP step, benchmarks/sim_instr.py)
            plain = T == 1 or L == 1 or n == 1 or k == 1
            if need_x:
                W = None if plain else _side_by_side(w, n, L, k)     # [w_0 | w_1 | ...]
                if W is None:
                    W = w.transpose(0, 1).reshape(n, L * k)
                gx = torch.mm(G, W)
                gx = gx.view(T, L, k).transpose(0, 1) if plain else _per_rank(gx, L, T, k)
            if need_w:
                X = None if plain else _side_by_side(x, T, L, k)     # [x_0 | x_1 | ...]
                if X is None:
                    X = x.transpose(0, 1).reshape(T, L * k)
                gw = torch.mm(G.t(), X)
                gw = gw.view(n, L, k).transpose(0, 1) if plain else _per_rank(gw, L, n, k)
            return gx, gw
        # torch's bmm backward; an expanded gradient made contiguous first in one copy
        # (torch's CPU bmm copies it one matrix at a time: 24 us against 12 us per bmm on
        # the toy TP step)
        g = g.contiguous()
        if ctx.needs_input_grad[0]:
            gx = torch.bmm(g, w)
        if ctx.needs_input_grad[1]:
            gw = torch.bmm(x.transpose(1, 2), g).transpose(1, 2)
        return gx, gw



def _side_by_side(t, m, L, k):
    """``t.transpose(0, 1).reshape(m, L * k)`` of ``t`` ``(L, m, k)`` (every size above 1)
    where that reshape is a view (the rank dim's stride ``k`` times the last dim's): the
    same view, as one as_strided (torch's view strides: the merged dims take the inner
    one's, aten/src/ATen/TensorUtils.cpp computeStride); None where the reshape would copy."""
    s0, s1, s2 = t.stride()
    if s0 != k * s2:
        return None
    return t.as_strided((m, L * k), (s1, s2), t.storage_offset())


def _per_rank(y, L, m, k):
    """``y.view(m, L, k).transpose(0, 1)`` of a fresh (contiguous) ``(m, L * k)`` product
    ``y``, every size above 1: each rank's ``(m, k)`` block, as one as_strided."""
    return y.as_strided((L, m, k), (k, L * k, 1))


# torch.autograd.Function.apply's own path for plain tensors outside functorch transforms
# (torch/autograd/function.py: ``unwrap_dead_wrappers`` then ``_C._FunctionBase.apply``),
# called directly: the row-parallel linear's operands are plain local tensors, so the
# Python layers above it (custom_function._apply's DistTensor check, torch's apply with
# its setup_context and functorch checks) decide nothing here (toy TP step,
# benchmarks/sim_overhead.py)
_C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _RankLinear)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_UNWRAP_DEAD = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _rank_linear(x, w):
    """``_RankLinear.apply(x, w)``, through torch's C entry point where that is what
    torch's ``Function.apply`` would reach (no functorch transform active)."""
    if _FUNCTORCH_ACTIVE is None or _UNWRAP_DEAD is None or _FUNCTORCH_ACTIVE() or \
            type(x) is not torch.Tensor or type(w) is not torch.Tensor:
        return _RankLinear.apply(x, w)
    return _C_APPLY(_UNWRAP_DEAD(x), _UNWRAP_DEAD(w))

def _linear_local(nd, ctx, x, w, b=None):
    y = _linear_local_run(nd, ctx, x, w, b)
    if ctx is not None and (x.grad_fn is not None or w.grad_fn is not None) and \
            torch.is_grad_enabled() and len(ctx.in_specs) >= 2:
        # x.detach_() later: raised where one device's F.linear saves x itself (a 2-d
        # input: mm(x, w.t())); _RankLinear's saved inputs, the column path's x[0] and
        # align's views keep their history (inplace18: F.linear(a, x); a.detach_() over
        # S(1)@1d answered)
        sp = ctx.in_specs
        versions.guard_kernel(y, F.linear, [(x, sp[0].shape), (w, sp[1].shape)] + (
            [] if b is None or len(sp) < 3 or sp[2] is None else [(b, sp[2].shape)]))
    return y


def _linear_local_run(nd, ctx, x, w, b=None):
    held = linear_regather.of(x)
    if held is not None and torch.is_grad_enabled():
        # sequence parallelism's gathered input: keep its shard, gather again in backward
        rg, shard = held
        return linear_regather.RegatheredLinear.apply(rg, _linear_plain, nd, ctx, shard,
                                                      x, w, b)
    return _linear_plain(nd, ctx, x, w, b)


def _linear_plain(nd, ctx, x, w, b=None):
    if nd == 1:
        # the two branches' conditions below, each size and stride read once (toy TP step,
        # benchmarks/sim_instr.py): x (and w) the same on every rank: x.size(0) == 1 or
        # x.stride(0) == 0 (_same_on_every_rank)
        xs, ws = x.shape, w.shape
        x0s, w0s = x.stride(0), w.stride(0)
        col = (xs[0] == 1 or x0s == 0) and not (ws[0] == 1 or w0s == 0) and len(xs) > 1
        row = not col and len(xs) == 3 and len(ws) == 3 and xs[0] == ws[0] > 1 and \
            b is None and x0s and w0s
    else:
        col = nd and _same_on_every_rank(x, nd) and not _same_on_every_rank(w, nd) and \
            x.dim() > nd
        row = False
    if col:
        # Column-parallel with a replicated input: every rank multiplies the same x by its
        # slice of the weight. One GEMM with all the slices side by side does exactly that
        # arithmetic at single-device speed; autograd still sends the input gradient through
        # x's per-rank views (their traced all-reduce).
        x0 = x.select(0, 0) if nd == 1 else x[(0,) * nd]                    # (*batch, k)
        ws = w.shape
        n, k = ws[-2], ws[-1]
        if nd == 1 and x0.dim() == 2:
            # one rank dim, a 2-d input (the toy TP step): the same views as below, their
            # sizes given as ints (torch parses a torch.Size or tuple argument slower than
            # ints: ~1.7 us against 1.3 us a view; movedim(1, 0) of a 3-d tensor is
            # transpose(0, 1): the same sizes, strides and offset)
            L = ws[0]
            y = F.linear(x0, w.reshape(L * n, k))                           # (T, L*n)
            y = y.view(y.shape[0], L, n).transpose(0, 1)                    # (L, T, n)
            if b is not None:
                y, b = align(nd, y, b)
                y = y + b
            return y
        y = F.linear(x0, w.reshape(math.prod(ws[:-1]), k))         # (*batch, L*n); k may be 0
        ys = y.shape
        nb = len(ys) - 1
        y = y.view(ys[:-1] + ws[:nd] + (n,))                                # (*batch, *lead, n)
        if nd == 1:
            y = y.movedim(nb, 0)                                            # (*lead, *batch, n)
        else:
            y = y.movedim(tuple(range(nb, nb + nd)), tuple(range(nd)))
        if b is not None:
            y, b = align(nd, y, b)
            y = y + b
        return y
    if row:
        # row-parallel (or any per-rank x and w): see _RankLinear
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _rank_linear(x, w)
        return torch.bmm(x, w.transpose(1, 2))
    vec = nd and x.dim() - nd == 1        # a 1-d input: torch's linear gives (n,), not (1, n)
    if vec:
        x = x.unsqueeze(nd)                                                 # (lead, 1, k)
    w2 = w.transpose(-1, -2)
    x2, w2a = align(nd, x, w2)
    y, check = _batched(x2, w2a, nd, x, w2)
    y = _dense_grad(y, nd, check)
    if vec:
        y = y.squeeze(-2)                                                   # (lead, n)
    if b is not None:
        y, b = align(nd, y, b)
        y = y + b
    return y


def _linear_parse(x, w, b=None):
    if w.dim() != 2 or x.dim() == 0:
        raise RuntimeError(f"linear: weight must be 2-D (out, in) and input at least 1-D; "
                           f"got input {tuple(x.shape)}, weight {tuple(w.shape)}")
    # one dtype (a dtype is one object): nothing for same_dtype to check (toy TP step)
    dt = getattr(x, "dtype", None)
    if dt is None or getattr(w, "dtype", None) is not dt or \
            b is not None and getattr(b, "dtype", None) not in (None, dt):
        same_dtype("linear", x, w, b)
    return (x, w, b), {}


register("linear", [F.linear], parse=_linear_parse, rule=linear_rule, local=_linear_local,
         cost=costs.from_ops("linear", lambda ins, outs: (ins, {})), op_class="matmul",
         sample=lambda g: [Sample(F.linear, (g.rn(3, 5, 6), g.rn(4, 6), g.rn(4))),
                           Sample(F.linear, (g.rn(5, 6), g.rn(3, 6)))])
TABLE["linear"].extra["detach_guard"] = True      # (versions.guard_kernel, as matmul's)


# ---- einsum --------------------------------------------------------------------------

def einsum_rule(*specs, equation: str):
    """Any one- or two-operand einsum (a permutation, diagonal or sum of one operand)."""
    opts = einsum_options(equation, specs)
    return combine(specs[0].mesh.ndim, [opts] * specs[0].mesh.ndim, len(specs))


def _einsum_parse(eq, *ops):
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if len(ops) not in (1, 2):
        raise NotImplementedError(f"einsum of {len(ops)} operands on DistTensors: write it as "
                                  "two-operand einsums (the rule is for one operand or two)")
    eq = eq.replace(" ", "")
    if len(ops) == 2 and len({o.dtype for o in ops}) > 1 and _no_contraction(eq, ops):
        pass                          # torch multiplies (einsum's sumproduct_pair): promotes
    else:
        ops = same_dtype("einsum", *ops, fn=lambda *o: torch.einsum(eq, *o))
    if "..." in eq or "->" not in eq:
        torch.einsum(eq, *[torch.empty(tuple(o.shape), dtype=o.dtype, device="meta")
                           for o in ops])            # torch's own errors first
        eq = explicit_equation(eq, [len(o.shape) for o in ops])
    return tuple(ops), {"equation": eq}


def _no_contraction(eq, ops) -> bool:
    """True when no index of the two operands of ``eq`` is summed over both (torch.einsum
    then multiplies them, promoting their dtypes, as torch.mul)."""
    try:
        full = explicit_equation(eq, [len(o.shape) for o in ops])
    except ValueError:
        return False
    lhs, out = full.split("->")
    a, b = lhs.split(",")
    return not (set(a) & set(b)) - set(out)


def explicit_equation(eq: str, ndims) -> str:
    """``eq`` with every dim named and the output written out, as torch.einsum reads it:
    each operand's ``...`` stands for its dims that no letter names, right-aligned across
    the operands (broadcast as torch.einsum broadcasts them: a size-1 dim against n); the
    output's ``...`` for all of them; no ``->``: the ``...`` dims, then the letters used
    once, in sorted order (torch.einsum's implicit mode: 'A'-'Z' before 'a'-'z').  The
    new letters are ones the equation does not use ("...ij,...jk->...ik" on a 4-d and a
    3-d operand: "abij,bjk->abik")."""
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    named = [len(t.replace("...", "")) for t in terms]
    extra = [n - k if "..." in t else 0 for t, n, k in zip(terms, ndims, named)]
    E = max(extra, default=0)
    fresh = [c for c in string.ascii_letters if c not in eq][:E]
    if len(fresh) < E:
        raise ValueError(f"einsum({eq!r}): its '...' stands for {E} dims and only "
                         f"{len(fresh)} letters are left to name them; name the dims")
    terms = [t.replace("...", "".join(fresh[E - e:])) for t, e in zip(terms, extra)]
    if arrow:
        out = rhs.replace("...", "".join(fresh))
    else:
        letters = "".join(t for t in lhs.split(",")).replace("...", "")
        out = "".join(fresh) + "".join(sorted(c for c in set(letters)
                                              if letters.count(c) == 1))
    return ",".join(terms) + "->" + out


def _einsum_local(nd, ctx, *ops, equation):
    lhs, rhs = equation.split("->")
    eq = ",".join("..." + t for t in lhs.split(",")) + "->..." + rhs
    y = torch.einsum(eq, *ops)
    if y.grad_fn is not None and len(ops) == 2:
        # torch.einsum may lay a stacked operand out by a copy (permute, then a reshape
        # that cannot be a view) and save that copy for bmm, where one device's einsum of
        # one rank's operands saves a view of the operand: a write into the operand then
        # raises there and answered silently here (inplace16: "ij,jk->ik" over
        # P(sum)-S(1)@2d, S(0)-S(1)@2d).  Such an operand is checked by the product's hook
        # (versions.saved_check, as _batched's)
        key = (eq, nd) + tuple((o.shape, o.stride(), o.requires_grad) for o in ops)
        keep = _EINSUM_KEEP.get(key)
        if keep is None:
            here = _einsum_saves_view(eq, ops)
            one = _einsum_saves_view(eq, [o[(0,) * nd] for o in ops]) if nd else here
            keep = _EINSUM_KEEP[key] = tuple(o and not h for h, o in zip(here, one))
            if len(_EINSUM_KEEP) > 4096:
                _EINSUM_KEEP.clear()
        if any(keep):
            check = versions.saved_check([o for o, k in zip(ops, keep) if k])
            y.register_hook(lambda g: (check(), g)[1])
    return y


# (equation, nd, operands' sizes, strides, requires_grad) -> (check operand 0, operand 1)
_EINSUM_KEEP: dict = {}


def _einsum_saves_view(eq, ops):
    """For each operand of ``torch.einsum(eq, *ops)``: whether its autograd graph saves a
    tensor on the operand's own memory (a view of it, which a write into the operand
    bumps).  Run on detached stand-ins sharing the operands' memory, once per layout."""
    with torch.enable_grad():
        xs = [o.detach().requires_grad_(o.requires_grad) for o in ops]
        y = torch.einsum(eq, *xs)
    mine = [x.untyped_storage()._cdata for x in xs]
    held, todo, seen = set(), [y.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen or type(f).__name__ == "AccumulateGrad":
            continue
        seen.add(f)
        for name in dir(f):
            if name.startswith("_saved_"):
                v = getattr(f, name, None)
                for t in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(t, torch.Tensor):
                        held.add(t.untyped_storage()._cdata)
        todo.extend(g for g, _ in f.next_functions)
    return [c in held for c in mine]


register("einsum", [torch.einsum], parse=_einsum_parse, rule=einsum_rule,
         local=_einsum_local, cost=costs.contraction(lambda ins, a: a["equation"]),
         op_class="matmul",
         sample=lambda g: [Sample(torch.einsum, ("bij,bjk->bik", g.rn(2, 3, 5), g.rn(2, 5, 3))),
                           Sample(torch.einsum, ("ij->ji", g.rn(5, 6))),
                           Sample(torch.einsum, ("ii->i", g.rn(5, 5))),
                           Sample(torch.einsum, ("bij->b", g.rn(3, 5, 2))),
                           Sample(torch.einsum, ("...ij,...jk->...ik", g.rn(1, 5, 3),
                                                 g.rn(3, 3, 2))),
                           Sample(torch.einsum, ("i...,i", g.rn(5, 3), g.rn(5)))])
