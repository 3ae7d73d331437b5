"""In-place writes under capture: a write into a tensor the program made is captured as the
new value it gives, as torch's functionalization turns ``x.mul_(2)`` into
``x_1 = mul(x, 2)`` with every later read of ``x`` reading ``x_1`` (``torch.export``'s
graphs are functional so: capture's export path gets no in-place op; the tracer works on
torch calls, so it rebinds the Python tensor to the new value itself).

``v = x.clone(); v.mul_(2)``, ``v.clamp_(-1, 1)``, ``v += y``, ``v.masked_fill_(m, 0)``,
``v[1:, 0] = 2.5``, ``v.copy_(y)``, ``v.zero_()``, ``F.relu(v, inplace=True)``,
``v.unsqueeze_(0)``: each is recorded as eager DistTensors run it
(``parallel/inplace.py``): the out-of-place op (``x.mul_`` is ``x.mul``; ``x[i] = c`` is
``where(mask, values, x)`` with the constant mask and values eager builds; ``zero_`` /
``fill_`` / ``copy_``: the value, expanded and cast, over ``x`` by the table's
``overwrite``, which gives the old value eager's zero gradient and reads no layout), cast
to ``x``'s dtype, then laid out as ``x`` is
(``keep_layout``: eager's ``assign`` reshards the result into ``x``'s placements, so the
collectives at O0 are eager's).  ``squeeze_`` / ``unsqueeze_`` / ``t_`` / ``transpose_``
are the view they make.  torch's own verdict comes first: the real in-place op runs on meta
stand-ins (its errors: a result that broadcasts bigger, a float into an int tensor).

Writes that a graph of values cannot hold stay graph breaks, each saying why:

* into an input, a parameter or a constant (the caller's tensor would have to be
  written back after each call);
* into memory another tensor of the program shares (a view ``x[0].add_(1)``, or a tensor
  with views): the write reaches the other tensors too, which one new value does not;
* under ``torch.no_grad()`` into a value with history (torch keeps that history: the
  gradient passes the write, where a recorded op would cut it);
* ``x[i] = y`` / ``index_put_`` with a value or an index the program computes, ``out=``,
  random fills, and ops with no out-of-place form.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..parallel.dist_tensor import DistTensor
from ..parallel.inplace import _judge
from .saved import check_saved, own_saves

__all__ = ["NOT_A_WRITE", "write"]

T = torch.Tensor
NOT_A_WRITE = object()

# (parallel/inplace.py's lists: the view-making ones and those no layout holds)
_VIEWS = ("squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_")
_IDUNDERS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_",
             "__itruediv__": "div_", "__ifloordiv__": "floor_divide_",
             "__imod__": "remainder_", "__ipow__": "pow_", "__iand__": "bitwise_and_",
             "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
             "__ilshift__": "bitwise_left_shift_", "__irshift__": "bitwise_right_shift_"}
_NOT_WRITES = ("requires_grad_", "share_memory_", "retain_grad")


class Refused(Exception):
    """The write cannot be captured; the message says why (the tracer raises it as a
    CaptureError at the user's line)."""


def _target(func, name, args, kwargs):
    """(the tensor written, the in-place op's name) of a call that writes, or None."""
    if name in _NOT_WRITES:
        return None
    if kwargs.get("inplace") is True:
        x = args[0] if args else kwargs.get("input")
        return (x, "inplace=True") if isinstance(x, torch.Tensor) else None
    if name == "__setitem__":
        return (args[0], name) if args else None
    name = _IDUNDERS.get(name, name)
    if name.endswith("_") and not name.startswith("_") and args and \
            isinstance(args[0], torch.Tensor):
        return args[0], name
    return None


def write(tracer, func, name, args, kwargs):
    """The result of the write ``func(*args, **kwargs)`` captured as a new value (the
    tensor written is rebound to it), or :data:`NOT_A_WRITE` where the call writes nothing
    the tracer follows; raises :class:`Refused` where it cannot be captured."""
    if kwargs.get("out") is not None:
        return NOT_A_WRITE                 # (the tracer's own refusal names it)
    hit = _target(func, name, args, kwargs)
    if hit is None:
        return NOT_A_WRITE
    x, op = hit
    vid = tracer.ids.get(id(x))
    if vid is None:
        return NOT_A_WRITE
    value = tracer.g.values[vid]
    if value.kind in ("input", "param", "const"):
        what = {"input": f"an input of the program ({value.name})",
                "param": f"the parameter {value.name}",
                "const": "a tensor the program did not make (a buffer, a global)"}
        raise Refused(f"{op} writes into {what[value.kind]}: a captured graph computes new "
                      "values and would not write the caller's tensor back on each call; "
                      "the program runs eagerly (write into a clone, or return the new value)")
    if x.requires_grad and not torch.is_grad_enabled():
        raise Refused(f"{op} under torch.no_grad() writes into a value with history: torch "
                      "keeps the history (the gradient passes the write), which a captured "
                      "op would cut; the program runs eagerly")
    if op in _VIEWS:
        # torch's in-place view ops bump the version counter too: a value an op of the
        # program saved raises at backward (eager's, parallel/inplace._view_inplace)
        check_saved(tracer, x, op)
        return _view_op(tracer, x, op, args[1:], kwargs)
    if x._base is not None or any(t is not x and _storage(t) == _storage(x)
                                  for t in tracer.keep if isinstance(t, torch.Tensor)
                                  and t.is_meta):
        raise Refused(f"{op} writes into memory that another tensor of the program shares (a "
                      "view, or a tensor with views): torch's write reaches them too, which "
                      "one captured value does not; the program runs eagerly (write into a "
                      "clone, or compute the new value with torch.where / torch.cat)")
    before = check_saved(tracer, x, op)
    # in-place ops are not autocast (torch.amp's docs; parallel/inplace.method): the new
    # value's ops are recorded with the caller's autocast off, and run so
    with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") \
            else contextlib.nullcontext():
        new = _new_value(tracer, func, x, op, args, kwargs)
    own_saves(tracer, x, new, before)
    with tracer:
        from ..parallel.ops_table.layout_hooks import keep_layout
        new = keep_layout(new, x)          # laid out as x (eager's assign)
    _rebind(tracer, x, new)
    return None if op == "__setitem__" else x


def _storage(t):
    return t.untyped_storage()._cdata


def _traced(tracer, tree) -> bool:
    from .capture import _leaves
    return any(id(t) in tracer.ids for t in _leaves(tree, []))


def _meta(tracer, tree):
    """Meta stand-ins of ``tree``'s tensors (traced ones as the tracer sees them, others as
    meta copies of their shapes), for torch's verdict."""
    from .capture import _swap

    def one(t):
        if t.is_meta:
            return t
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    return _swap(tree, one)


def _stand_in(x):
    """A fresh meta ``x`` with its autograd standing (parallel.inplace._meta_self)."""
    m = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if x.requires_grad:
        with torch.enable_grad():
            m = m.requires_grad_().clone()
    return m


def _view_op(tracer, x, op, rest, kwargs):
    with tracer:
        new = getattr(T, op[:-1])(x, *rest, **kwargs)
    getattr(x, op)(*rest, **kwargs)       # (the stand-in takes the view's shape)
    tracer.ids[id(x)] = tracer.ids[id(new)]
    return x


def _rebind(tracer, x, new):
    """``x`` reads ``new`` from now on; the meta stand-in takes its autograd standing."""
    if new.requires_grad and not x.requires_grad:
        x.copy_(new)                       # (a non-leaf that requires grad, as torch's)
    tracer.ids[id(x)] = tracer.ids[id(new)]


def _new_value(tracer, func, x, op, args, kwargs):
    rest = tuple(args[1:])
    if op == "inplace=True":
        _judge(lambda: func(*_meta(tracer, (_stand_in(x),) + rest),
                            **_meta(tracer, kwargs)))
        with tracer:
            return func(*args, **dict(kwargs, inplace=False))
    if op == "__setitem__":
        index, val = rest
        return _setitem(tracer, x, index, val)
    if func is not getattr(T, op, None) and func is not getattr(torch, op, None) and \
            func is not getattr(F, op, None):
        # (nn.init.zeros_(x) and other functions named like an in-place method)
        raise Refused(f"{getattr(func, '__module__', '')}.{op} is not torch's in-place "
                      "method: its out-of-place form is not known; the program runs eagerly")
    _judge(lambda: getattr(_stand_in(x), op)(*_meta(tracer, rest), **_meta(tracer, kwargs)))
    if op == "index_put_":
        names = ("indices", "values", "accumulate")
        got = dict(zip(names, rest), **kwargs)
        idx, val, acc = tuple(got["indices"]), got["values"], bool(got.get("accumulate"))
        if not acc:
            return _setitem(tracer, x, idx, val)
        if _traced(tracer, (idx, val)):
            raise Refused("index_put_(accumulate=True) with indices or values the program "
                          "computes: eager adds a delta built from their values; the "
                          "program runs eagerly")
        val = val if isinstance(val, torch.Tensor) else torch.as_tensor(val, dtype=x.dtype)
        delta = torch.zeros(tuple(x.shape), dtype=x.dtype).index_put(idx, val,
                                                                    accumulate=True)
        with tracer:
            return _cast(T.add(x, delta), x, op)
    if op in ("zero_", "fill_", "copy_"):
        if op == "zero_":
            v = torch.zeros((), dtype=x.dtype)
        elif op == "fill_":
            v = rest[0] if rest else kwargs["value"]
            if _traced(tracer, v):
                raise Refused("fill_ with a value the program computes: eager reads its "
                              "value; the program runs eagerly (use torch.where)")
            v = torch.full((), v, dtype=x.dtype) if not isinstance(v, torch.Tensor) else v
        else:
            v = rest[0] if rest else kwargs["src"]
            v = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
        with tracer:
            if tuple(v.shape) != tuple(x.shape):
                v = v.expand(tuple(x.shape))
            if v.dtype != x.dtype:
                v = v.to(x.dtype)
            if x.requires_grad or id(v) not in tracer.ids:
                # over a value with history: eager's _Overwrite (the old value's gradient
                # zero, its layout unread); a constant written: a value of the program
                from ..parallel.ops_table.overwrite import overwrite
                return overwrite(v, x)
            return v
    if op in ("normal_", "uniform_", "bernoulli_", "exponential_", "geometric_",
              "log_normal_", "cauchy_", "random_"):
        raise Refused(f"{op} draws random numbers inside the program: a captured graph "
                      "would keep one draw for every call; pass the random tensor in")
    base = getattr(T, op[:-1], None) if func is getattr(T, op, None) else \
        getattr(torch, op[:-1], None) if func is getattr(torch, op, None) else \
        getattr(F, op[:-1], None)
    if base is None or not callable(base):
        raise Refused(f"{op} has no out-of-place form ({op[:-1]}) to capture it by; the "
                      "program runs eagerly")
    with tracer:
        y = base(x, *rest, **kwargs)
        if not isinstance(y, torch.Tensor):
            raise Refused(f"{op[:-1]} gives a {type(y).__name__}, not a tensor")
        return _cast(y, x, op)


def _cast(y, x, op):
    """``y`` as written into ``x``: x's dtype (torch's can_cast check first)."""
    if not torch.can_cast(y.dtype, x.dtype):
        raise RuntimeError(f"{op}(): result type {y.dtype} can't be cast to the desired "
                           f"output type {x.dtype}")
    return y.to(x.dtype) if y.dtype != x.dtype else y


def _setitem(tracer, x, index, val):
    """``x[index] = val`` as eager composes it (``parallel.inplace.setitem``):
    ``where(mask, values, x)``, the mask and values constants built from the index and a
    value the program does not compute."""
    if _traced(tracer, index) or isinstance(index, DistTensor):
        raise Refused("x[index] = v with an index the program computes: eager builds its "
                      "mask from the index's values; the program runs eagerly")
    if _traced(tracer, val):
        raise Refused("x[index] = v with a value v the program computes: eager writes "
                      "v's values into a constant it builds; the program runs eagerly "
                      "(use torch.where, torch.cat or index_put)")
    from ..parallel.inplace import _bool_masks
    vals = torch.zeros(tuple(x.shape), dtype=x.dtype)
    vals[index] = val                       # (torch's checks, in torch's order)
    mask = torch.zeros(tuple(x.shape), dtype=torch.bool)
    mask[_bool_masks(index)] = True

    def judge():
        m = _stand_in(x)
        m[_meta(tracer, index)] = _meta(tracer, val) if isinstance(val, torch.Tensor) \
            else val
    _judge(judge)
    with tracer:
        return torch.where(mask, vals, x)
