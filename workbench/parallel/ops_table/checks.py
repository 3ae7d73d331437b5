"""PyTorch as the judge of shapes, dtypes and errors: the first call of an op on a new
layout runs the real torch callable on meta tensors of the GLOBAL shapes. Its errors are
PyTorch's own (a bad dim, mismatched shapes, an integer mean...) and its output shapes
and dtypes (type promotion included) must be the ones the op table's local
implementation gives, or the table has a bug (raised, never a silent wrong result).

A meta kernel is a decomposition (``torch._refs``) and may raise where the eager kernel
does otherwise: ``log_softmax`` of a bool tensor raises "Subtraction ... with two bool
tensors" on meta, where eager returns an empty bool tensor for an empty input and raises
``NotImplementedError: "log_softmax_lastdim_kernel_impl" not implemented for 'Bool'``
otherwise.  Eager is what the user's program runs, so a meta error is checked again on
eager zeros of the same shapes (stride-0 views: no memory), and eager's answer stands."""
from __future__ import annotations

import torch

__all__ = ["torch_meta_outputs", "check_outputs", "on_meta"]


def _to_meta(x):
    from ..dist_tensor import DistTensor, TensorSpec
    if isinstance(x, (DistTensor, TensorSpec, torch.Tensor)):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_meta(y) for y in x)
    return x


def _to_zeros(x):
    """``x`` as eager zeros of its global shape, one stored element expanded (a fresh
    tensor: an in-place op writes no input of the user's)."""
    from ..dist_tensor import DistTensor, TensorSpec
    if isinstance(x, (DistTensor, TensorSpec, torch.Tensor)):
        dev = getattr(x, "device", None) if not isinstance(x, TensorSpec) else None
        return torch.zeros((), dtype=x.dtype, device=dev or "cpu").expand(tuple(x.shape))
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_zeros(y) for y in x)
    return x


def on_meta(fn, args, kwargs=None):
    """``fn(*args, **kwargs)`` with every tensor (DistTensor, TensorSpec) as a meta tensor
    of its global shape.  A meta error is judged again by eager (module docstring):
    eager's error is raised, or eager's result returned where it succeeds; an eager error
    that only the expanded zeros cause (an in-place write into a stride-0 view) leaves
    the meta error standing."""
    kwargs = kwargs or {}
    try:
        return fn(*_to_meta(tuple(args)), **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception as meta_error:
        try:
            return fn(*_to_zeros(tuple(args)), **{k: _to_zeros(v) for k, v in kwargs.items()})
        except Exception as eager_error:
            if "single memory location" in str(eager_error):
                raise meta_error from None
            raise eager_error.with_traceback(None) from None


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


ATOMS = _ATOMS = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype,
          torch.device, torch.layout, torch.memory_format)


def signature(x, tensors: bool = True):
    """A hashable key of everything :func:`_to_meta` keeps of ``x`` (a tensor's shape and
    dtype, the type and value of anything else, lists and tuples element by element), or
    None where ``x`` holds something else (then nothing is memoized).  ``tensors=False``:
    None where it holds a tensor."""
    from ..dist_tensor import DistTensor
    if isinstance(x, (DistTensor, torch.Tensor)):
        return (0, tuple(x.shape), x.dtype) if tensors else None
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        out = [type(x)]
        for y in x:
            s = signature(y, tensors)
            if s is None:
                return None
            out.append(s)
        return tuple(out)
    if type(x) in _ATOMS or type(x) is torch.Size:
        return (type(x), x)
    if type(x) is slice:
        parts = (signature(x.start, tensors), signature(x.stop, tensors),
                 signature(x.step, tensors))
        return None if None in parts else (slice, parts)
    return None


def call_key(func, args, kwargs):
    """The key of a meta call of ``func`` on ``args`` and ``kwargs`` (None: not
    memoizable): their signatures, and the global state a meta call reads (the default
    dtype a Python float becomes; grad mode)."""
    sa = signature(tuple(args))
    sk = signature(tuple(sorted(kwargs.items()))) if kwargs else ()
    if sa is None or sk is None:
        return None
    return (func, sa, sk, torch.get_default_dtype(), torch.is_grad_enabled())


_MEMO: dict = {}        # call_key -> torch's (shape, dtype) per output (successes only)


def torch_meta_outputs(func, args, kwargs):
    """(shape, dtype) of every tensor ``func`` returns on meta inputs (torch's errors
    propagate unchanged; a meta error judged again by eager: :func:`on_meta`).  Memoized on :func:`call_key` (a meta call depends on nothing
    else): every placement of the same global shapes asks again.  A call that raised is
    not kept, so it raises again."""
    try:
        key = call_key(func, args, kwargs)
        hit = _MEMO.get(key) if key is not None else None
    except TypeError:           # an unhashable value after all
        key = hit = None
    if hit is not None:
        return list(hit)
    out = on_meta(func, args, kwargs)
    res = [(tuple(t.shape), t.dtype) for t in _flat(out)]
    if key is not None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        _MEMO[key] = tuple(res)
    return res


def check_outputs(name, ours, theirs):
    """Our (shape, dtype) per output against torch's."""
    if [tuple(s) for s, _ in ours] != [s for s, _ in theirs] or \
            [d for _, d in ours] != [d for _, d in theirs]:
        raise AssertionError(
            f"op table bug in {name!r}: the local implementation gives "
            f"{[(tuple(s), str(d)) for s, d in ours]} where torch gives "
            f"{[(s, str(d)) for s, d in theirs]}; please report it")
