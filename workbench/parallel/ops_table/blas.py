"""BLAS-style updates, composed of ops in the table (each keeps its own rule, cost and
trace event): ``out = beta * input + alpha * product``.

    addmm(input, m1, m2)      product = m1 @ m2                  (n, k) @ (k, m)
    addmv(input, m, v)        product = m @ v                    (n, k) @ (k,)
    addr(input, v1, v2)       product = outer(v1, v2)            (n,) x (m,)
    baddbmm(input, b1, b2)    product = bmm(b1, b2)              (b, n, k) @ (b, k, m)
    addbmm(input, b1, b2)     product = bmm(b1, b2).sum(0)       summed over the batch
    mv(m, v)                  m @ v
    addcmul(input, t1, t2)    input + value * t1 * t2            elementwise
    addcdiv(input, t1, t2)    input + value * t1 / t2            elementwise

The placements are the parts' own: a row-parallel product (``m1`` S(1), ``m2`` S(0))
is P(sum); ``beta * input`` (replicated) then meets it in ``add``, which reduces the
partial first (a bias is added once, as Megatron-LM's row-parallel linear adds its bias
after the all-reduce). As torch documents, ``beta=0`` ignores ``input`` (its nan and
inf are not propagated). torch's own checks (shapes, dtypes, integer alpha) run first
on meta tensors of the global shapes. The value is that of the composition, equal to
torch's fused kernel up to rounding (in float16 / bfloat16 the product and the sum round
separately, where torch's kernel rounds once: one more unit in the last place at most,
as the library's ``F.linear`` with a bias).
"""
from __future__ import annotations

import math

import torch

__all__ = ["BLAS"]

T = torch.Tensor


def _meta(x):
    if hasattr(x, "placements") or isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(a) for a in x)
    return x


def torch_check(fn, *args, **kwargs):
    """``fn`` on meta tensors of the global shapes: torch's errors, and its output."""
    return fn(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})


def _cut(x):
    if hasattr(x, "placements") or isinstance(x, torch.Tensor):
        return torch.zeros(tuple(min(int(s), 1) for s in x.shape), dtype=x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cut(a) for a in x)
    return x


def cpu_check(fn, *args, **kwargs):
    """``fn`` on CPU stand-ins: zeros of each tensor's dtype, every dim cut to at most one
    element (an empty dim stays empty, so shapes that fit still fit). torch's CPU kernels
    check dtypes that its meta kernels do not (``kthvalue`` / ``median`` of a bool,
    ``smooth_l1_loss`` of a complex, ``cdist`` of two dtypes: found by the wide random
    sweep, tests/test_sweep11.py); the output gives the CPU kernel's dtype where it
    differs (``cdist`` of no row: the first input's dtype). Size arguments must fit the
    cut shapes (``kthvalue``: pass k=1). Its warnings are muted (the meta check warns once,
    as torch)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*[_cut(a) for a in args], **{k: _cut(v) for k, v in kwargs.items()})


def _update(input, product, beta, alpha):
    """``beta * input + alpha * product`` (beta=0: input ignored; 1s not multiplied)."""
    if not isinstance(alpha, bool) and alpha == 1:
        out = product
    else:
        out = product * alpha
    if beta == 0:
        if getattr(input, "requires_grad", False) and torch.is_grad_enabled():
            # torch's input gradient is grad * beta (derivatives.yaml, addmm / addmv /
            # addbmm / baddbmm: maybe_multiply(grad, beta)): zeros, not None; input's values
            # are not read (a NaN there stays out), and out - (+0) keeps out's bits (-0.0)
            return out - _zeros_of(input)
        return out
    return out + (input if beta == 1 else input * beta)


def _zeros_of(input):
    """+0 in ``input``'s shape and dtype, still a function of it (gradient zeros): not
    ``input * 0``, NaN for an inf or a NaN."""
    return torch.where(torch.zeros((), dtype=torch.bool), input,
                       torch.zeros((), dtype=input.dtype))


def same_dtype(name, **tensors):
    """torch's matrix products take one dtype (its CPU / CUDA kernels raise; its meta
    kernels do not check): raise as they do."""
    dts = {k: t.dtype for k, t in tensors.items() if hasattr(t, "dtype")}
    if len(set(dts.values())) > 1:
        got = ", ".join(f"{k} {str(d).replace('torch.', '')}" for k, d in dts.items())
        raise RuntimeError(f"{name}: input dtypes must be the same, got: {got}; cast with "
                           ".to(dtype) first")


def _input_fits(name, input, product, a, b) -> None:
    """torch's CPU / CUDA kernels expand ``input`` to the product's shape and raise where
    it does not fit; its meta kernels of addmm / addmv do not check (torch 2.13: a (5, 5)
    input and a (1, 1) product give a (5, 5) meta result): raise as the kernels do."""
    try:
        torch.empty(tuple(input.shape), device="meta").expand(tuple(product.shape))
    except RuntimeError as e:
        if name == "addmv":
            raise RuntimeError(f"size mismatch, got input ({', '.join(map(str, input.shape))}), "
                               f"mat ({'x'.join(map(str, a.shape))}), vec "
                               f"({', '.join(map(str, b.shape))})") from None
        raise RuntimeError(str(e)) from None


def _checked(fn, product_fn, promotes=False):
    def composed(input, a, b, *, beta=1, alpha=1, out=None):
        if out is not None:
            raise TypeError(f"{fn.__name__}(out=...) on a DistTensor: assign the result")
        # torch's CPU kernel on stand-ins first: its dtype and scalar checks (an empty
        # product takes another path there: see _no_batch)
        no_batch = fn in (torch.addbmm, torch.baddbmm) and len(a.shape) == 3 and \
            not a.shape[0]
        if not promotes and not no_batch:
            same_dtype(fn.__name__, input=input, mat1=a, mat2=b)
        cpu = cpu_check(fn, input, a, b, beta=beta, alpha=alpha)
        if no_batch:
            # the shapes on meta tensors of the CPU result's dtype (the meta kernel asks
            # one dtype where the CPU kernel of no batch does not)
            ref = fn(*[torch.empty(tuple(t.shape), dtype=cpu.dtype, device="meta")
                       for t in (input, a, b)], beta=beta, alpha=alpha)
            return _no_batch(fn, input, beta, ref)
        ref = torch_check(fn, input, a, b, beta=beta, alpha=alpha)
        _input_fits(fn.__name__, input, torch_check(product_fn, a, b), a, b)
        if cpu is not None:
            ref = ref.to(cpu.dtype)
        if fn is torch.addmv and math.prod(a.shape) == 0 and beta != 0:
            # torch 2.13's CPU addmv of a matrix of no element: input * beta in input's own
            # shape, not broadcast to (n,) (a 0-d input gives a 0-d result; its meta kernel
            # says (n,)); was (n,) (seed 2013627 wide)
            return (input * beta).to(ref.dtype)
        if not (ref.dtype.is_floating_point or ref.dtype.is_complex):
            beta, alpha = int(beta), int(alpha)       # torch truncates them for integers
        res = _update(input, product_fn(a, b), beta, alpha)
        if tuple(res.shape) != tuple(ref.shape):       # a 1-element input broadcast only
            res = res.expand(tuple(ref.shape))
        return res.to(ref.dtype)
    composed.__name__ = fn.__name__
    composed.__doc__ = f"``torch.{fn.__name__}``: beta * input + alpha * product."
    return composed


def _no_batch(fn, input, beta, ref):
    """``addbmm`` / ``baddbmm`` of no batch: torch's CPU kernels multiply nothing and check
    no dtype of the batches (``addbmm_impl_``, aten/src/ATen/native/LinearAlgebra.cpp,
    2.13: ``result`` is ``self`` times ``beta``, zeroed for ``beta == 0``, in ``self``'s
    dtype; baddbmm's output, of no element, comes in batch2's dtype on torch 2.13's CPU);
    before, our one-dtype check refused what torch computes (sweep wide seed 2003330)."""
    if fn is torch.addbmm:
        # beta 0: zeros (not input * 0: NaN for an inf), still input's function (torch's
        # result has a grad_fn, input's gradient grad * 0)
        res = input * beta if beta != 0 else _zeros_of(input)
    else:
        res = input
    if tuple(res.shape) != tuple(ref.shape):
        res = res.expand(tuple(ref.shape))
    return res.to(ref.dtype)


addmm = _checked(torch.addmm, torch.matmul)
addmv = _checked(torch.addmv, torch.matmul)
addr = _checked(torch.addr, torch.outer, promotes=True)
baddbmm = _checked(torch.baddbmm, torch.bmm)
addbmm = _checked(torch.addbmm, lambda b1, b2: torch.bmm(b1, b2).sum(0))


def mv(input, vec, *, out=None):
    """``torch.mv``: a matrix times a vector."""
    if out is not None:
        raise TypeError("mv(out=...) on a DistTensor: assign the result")
    same_dtype("mv", input=input, vec=vec)
    torch_check(torch.mv, input, vec)
    return torch.matmul(input, vec)


def _pointwise(fn, combine):
    def composed(input, tensor1, tensor2, *, value=1, out=None):
        if out is not None:
            raise TypeError(f"{fn.__name__}(out=...) on a DistTensor: assign the result")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.item()        # a Scalar, as torch reads it (torch.optim's tensor lr)
        ref = torch_check(fn, input, tensor1, tensor2, value=value)
        # torch's CPU kernels refuse what its meta kernels let pass: addcmul of three bools
        # (NotImplementedError), addcdiv of a bool divisor (RuntimeError)
        cpu_check(fn, input, tensor1, tensor2, value=value)
        if not (ref.dtype.is_floating_point or ref.dtype.is_complex):
            value = int(value)                        # torch truncates it for integers
        prod = combine(tensor1, tensor2)
        if isinstance(value, bool) or value != 1:
            prod = prod * value
        res = input + prod
        if tuple(res.shape) != tuple(ref.shape):
            res = res.expand(tuple(ref.shape))
        return res.to(ref.dtype)
    composed.__name__ = fn.__name__
    composed.__doc__ = f"``torch.{fn.__name__}``: input + value * (tensor1 op tensor2)."
    return composed


addcmul = _pointwise(torch.addcmul, lambda a, b: a * b)
addcdiv = _pointwise(torch.addcdiv, lambda a, b: a / b)

BLAS = {}
for _f in (addmm, addmv, addr, baddbmm, addbmm, mv, addcmul, addcdiv):
    BLAS[getattr(torch, _f.__name__)] = BLAS[getattr(T, _f.__name__)] = _f
