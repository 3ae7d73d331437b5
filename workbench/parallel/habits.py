"""What a torch.Tensor user expects of a DistTensor beyond its ops: ``x in d``,
``bool(d)``, ``float(d)``, ``d.item()``, ``d.tolist()``, ``f"{d:.3f}"``, iteration,
``numpy.asarray(d)``, ``d.data`` and ``d.requires_grad = ...``. Each gives PyTorch's
answer for the full tensor (a value read out of a DistTensor is gathered first: a
traced all-gather / all-reduce), or PyTorch's error.

``==`` / ``!=`` are ops (``ops_table/tensor_habits.py``): a DistTensor of bools, so a
DistTensor hashes by identity, as a torch.Tensor does.
"""
from __future__ import annotations

import numbers
import os
import sys

import torch

from . import storage
from .autograd import AUTOGRAD
from .ops_table.composites import COMPOSITES
from .dist_tensor import DistTensor

__all__ = ["install", "FACTORIES"]

T = torch.Tensor


def _contains(self, element) -> bool:
    """``element in d``: torch's ``(element == t).any()`` on the full tensor."""
    if not isinstance(element, (torch.Tensor, DistTensor, numbers.Number, torch.SymInt,
                                torch.SymFloat, torch.SymBool)):
        raise RuntimeError(f"Tensor.__contains__ only supports Tensor or scalar, but you "
                           f"passed in a {type(element)}.")
    from .dispatch import dispatch
    eq = dispatch(T.eq, (self, element), None)
    return bool(eq.full().any().item())


def _one(self, what: str) -> torch.Tensor:
    if self.numel() != 1:
        raise RuntimeError(f"{what} of a DistTensor with {self.numel()} elements is ambiguous "
                           "(as for a tensor: only one element converts); use .full() or a "
                           "reduction such as .any() / .all()")
    return self.full()


def _item(self):
    if self.numel() != 1:
        raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to "
                           "Scalar (item() of a DistTensor reads one element; use .full())")
    return self.full().item()


def _format(self, spec: str) -> str:
    if self.ndim == 0:
        return self.full().item().__format__(spec)
    return object.__format__(self, spec)


def _iter(self):
    # torch.amp.GradScaler.scale(outputs) multiplies a torch.Tensor and iterates anything
    # else (torch/amp/grad_scaler.py apply_scale): a DistTensor loss failed with "iteration
    # over a 0-d tensor", naming nothing (torch's DTensor is a torch.Tensor)
    caller = sys._getframe(1).f_code.co_filename
    if caller.endswith(os.path.join("amp", "grad_scaler.py")):
        raise TypeError("torch.amp.GradScaler.scale(loss) with a DistTensor loss: the scaler "
                        "multiplies torch.Tensors only; pass the loss as one: "
                        "scaler.scale(loss.full()).backward() (the gradients are the same)")
    if self.ndim == 0:
        raise TypeError("iteration over a 0-d tensor")
    return (self[i] for i in range(self.shape[0]))


def _array(self, dtype=None, copy=None):
    a = self.full().detach().cpu().numpy()
    return a if dtype is None else a.astype(dtype, copy=False)


def _get_data(self) -> DistTensor:
    """A detached alias (as ``Tensor.data``): writes into it reach ``self``."""
    from .inplace import _writable
    for t in storage.tensors(self._local):
        of = getattr(t, "_wb_data_of", None)    # a ZeRO-3 forward's gathered copy: the
        if of is not None:                      # parameter's data (fsdp_dist._gather)
            return _get_data(of)
    if not _writable(self._local):
        # several elements share one memory location (a stride-0 copy): give self its
        # own memory first, so that the alias can be written
        keep_leaf = self.requires_grad and self.is_leaf
        loc = storage.map_tensors(self._local, lambda t: t.clone())
        if keep_leaf:
            loc = storage.map_tensors(loc, lambda t: t.detach().requires_grad_())
        self._local = loc
    from .dist_tensor import alias
    loc = storage.map_tensors(self._local, lambda t: _alias(t))
    out = DistTensor(loc, self.mesh, self.placements, self.shape, self.dtype, self.names)
    out._gstride = getattr(self, "_gstride", None)      # torch's .data keeps strides
    out._ring_order = getattr(self, "_ring_order", None)
    out._ring_also = getattr(self, "_ring_also", ())
    alias(out, self)
    return out


def _alias(t: torch.Tensor) -> torch.Tensor:
    # torch's ``.data``: the memory, under a version counter of its own (a write through
    # it does not bump t's: a value an op saved stays usable, with the new values).  A
    # ``detach()`` shares t's counter: ``a.data.mul_(2)`` after ``z = a * x`` raised at
    # backward where torch passes (inplace17: 45 of 45 programs x layouts)
    out = t.data
    from .versions import data_of
    data_of(out, t)
    if t.__dict__.get("_wb_data_stale"):        # a torch.distributed ZeRO-3 template: its
        out._wb_stale = t._wb_stale             # storage is not the shards' (writes raise)
    return out


def _set_data(self, value) -> None:
    """``d.data = other``: ``d`` takes ``other``'s data (its mesh, layout, shape and
    dtype; an alias, as torch), keeping its own ``requires_grad``."""
    if not isinstance(value, DistTensor):
        # (torch.nn.utils.vector_to_parameters sets p.data to a slice of its vector: torch
        # DTensor 2.13 takes it and leaves the parameter unchanged, silently, measured on a
        # 1-rank gloo mesh; here refused before anything is written, naming the copy)
        raise TypeError(f"DistTensor.data = {type(value).__name__}: give a DistTensor (its data "
                        "is laid out over ranks), e.g. d.data = wb.shard_tensor(t, d.mesh, "
                        "d.placements), or write values with d.copy_(t). For "
                        "torch.nn.utils.vector_to_parameters(vec, params) write the slices: "
                        "with torch.no_grad(): for p in params: p.copy_(vec[i:i + p.numel()]"
                        ".view(p.shape)); i += p.numel()")
    for t in storage.tensors(self._local):
        stale = getattr(t, "_wb_stale", None)   # a ZeRO-3 template or gathered copy
        if stale:                               # (fsdp_dist_habits): new data would not
            raise RuntimeError(f"DistTensor.data = ...: {stale}")   # reach the shards
    held = [t for t in storage.tensors(self._local) if getattr(t, "_wb_full", None) is not None]
    if held:        # DDP's replica storage over DistTensors (strategies/laid_out_replicas)
        # new local tensors would leave the storage DDP reduces and the optimizer steps:
        # the gradient norm 4.33 for one device's 1.68 after d.data = t before forward
        # (fsdpdata18), silently
        raise RuntimeError(
            "DistTensor.data = ... on a parameter a wrapper holds as its own storage "
            f"(DistributedDataParallel's replicas, shape {tuple(self.shape)}): new data would "
            "not reach that storage (its gradient and the optimizer's step would miss it). "
            "Write the values instead: p.data.copy_(value) or, under torch.no_grad(), "
            "p.copy_(value), before forward or after backward (a write between them changes "
            "what backward reads, as on one device)")
    keep = self.requires_grad
    if _same_form(self, value):
        # torch's assignment on each local tensor (set_data: the same tensor object, its
        # storage replaced, its version counter kept): a leaf keeps its gradient edge and
        # hooks, so a backward of a forward before the assignment still accumulates into
        # this parameter (new leaves left the DistTensor parameter with no gradient,
        # silently: 0.43 off the total norm for a Linear weight, fsdpdata18), a view saved
        # in forward keeps the old storage and the tensor saved itself reads the new one,
        # as one device's
        with torch.no_grad():
            for t, v in zip(storage.tensors(self._local), storage.tensors(value._local)):
                torch.Tensor.data.__set__(t, v.detach())
        self._gstride = getattr(value, "_gstride", None)
        return
    loc = storage.map_tensors(value._local, lambda t: t.detach())
    if keep:
        loc = storage.map_tensors(loc, lambda t: t.requires_grad_())
    self._local, self.mesh, self.placements = loc, value.mesh, value.placements
    self.shape, self.dtype, self.names, self._spec = value.shape, value.dtype, value.names, None
    self._gstride = getattr(value, "_gstride", None)


def _same_form(d, value) -> bool:
    """Whether ``value``'s local tensors match ``d``'s one for one (mesh, layout, shape,
    dtype and form): ``d.data = value`` then sets each of ``d``'s local tensors' data."""
    if (value.mesh, tuple(value.placements), tuple(value.shape), value.dtype) != \
            (d.mesh, tuple(d.placements), tuple(d.shape), d.dtype):
        return False
    a, b = d._local, value._local
    if type(a) is not type(b) or getattr(a, "lead", None) != getattr(b, "lead", None):
        return False
    mine, theirs = storage.tensors(a), storage.tensors(b)
    return len(mine) == len(theirs) and all(
        type(t) is torch.Tensor and t.shape == v.shape and t.dtype == v.dtype
        for t, v in zip(mine, theirs))


def _set_requires_grad(self, flag) -> None:
    if not self.is_leaf:
        raise RuntimeError("you can only change requires_grad flags of leaf variables. If you "
                           "want to use a computed variable in a subgraph that doesn't require "
                           "differentiation use var_no_grad = var.detach().")
    self.requires_grad_(bool(flag))


# ---- facts PyTorch keeps on a tensor (no data read) -------------------------------------

def _numpy(self, *, force=False):
    if self.requires_grad and not force:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                           "tensor.detach().numpy() instead.")
    return self.full().detach().cpu().numpy()


def _cpu(self, memory_format=None):
    if self.device.type != "cpu":
        raise NotImplementedError(f"cpu() on a DistTensor on {self.device}: every simulated "
                                  "rank lives on one device; gather with .full().cpu()")
    return self


_FACTS = {
    "is_floating_point": lambda self: self.dtype.is_floating_point,
    "is_complex": lambda self: self.dtype.is_complex,
    "is_signed": lambda self: self.dtype.is_signed,
    # torch's lazy conjugate / negative bits (ops_table/complex.py: z.conj() sets it on
    # every rank's local alike)
    "is_conj": lambda self: storage.tensors(self._local)[0].is_conj(),
    "is_neg": lambda self: storage.tensors(self._local)[0].is_neg(),
    "element_size": lambda self: torch.empty((), dtype=self.dtype).element_size(),
    "nelement": lambda self: self.numel(),
    "ndimension": lambda self: self.ndim,
    "get_device": lambda self: self.device.index if self.device.type != "cpu" else -1,
    # made under torch.inference_mode(): every shard is an inference tensor
    "is_inference": lambda self: all(t.is_inference() for t in storage.tensors(self._local)),
    "numpy": _numpy,
    "cpu": _cpu,
}
_PROPS = {
    "is_cuda": lambda self: self.device.type == "cuda",
    "is_cpu": lambda self: self.device.type == "cpu",
    "is_meta": lambda self: self.device.type == "meta",
    "is_sparse": lambda self: False,
    "layout": lambda self: torch.strided,
    "itemsize": lambda self: torch.empty((), dtype=self.dtype).element_size(),
    "nbytes": lambda self: self.numel() * torch.empty((), dtype=self.dtype).element_size(),
}


# ---- new tensors shaped like a DistTensor ----------------------------------------------------

def _placements_for(d, dtype):
    """``d``'s placements, or Replicate where a Partial cannot hold ``dtype``."""
    from .placement import Replicate, check_partial_dtype
    try:
        check_partial_dtype(d.placements, dtype)
        return d.placements
    except (TypeError, ValueError):
        return tuple(Replicate() if p.is_partial() else p for p in d.placements)


def _like(fn):
    """``torch.zeros_like(d)``, ``torch.randn_like(d)``...: the tensor torch makes for the
    global shape (one device's draw for the random ones), laid out as ``d`` (no
    communication: a Partial(sum) holds it on the first rank of its group)."""
    def like(d, *args, **kwargs):
        from .dist_tensor import shard_tensor
        rg = kwargs.pop("requires_grad", False)
        kwargs.pop("memory_format", None)
        kwargs.setdefault("dtype", d.dtype)
        g = fn(torch.empty(tuple(d.shape), dtype=d.dtype, device=d.device), *args, **kwargs)
        out = shard_tensor(g, d.mesh, _placements_for(d, g.dtype), src_data_rank=None)
        if fn in _ONE_VALUE:      # one value everywhere: in d's sequence order too, so an
            out._ring_order = getattr(d, "_ring_order", None)   # op on it knows (seq_order)
            out._ring_also = getattr(d, "_ring_also", ())
        return out.requires_grad_() if rg else out
    return like


_ONE_VALUE = (torch.zeros_like, torch.ones_like, torch.full_like)


def _new(fn):
    """``d.new_zeros(size)``...: a replicated DistTensor on ``d``'s mesh, of ``d``'s dtype
    unless given (as DTensor's new_* factories, which replicate)."""
    def new(d, *args, **kwargs):
        from .dispatch_local import as_dist
        rg = kwargs.pop("requires_grad", False)
        kwargs.setdefault("dtype", d.dtype)
        kwargs.setdefault("device", d.device)
        t = fn(torch.empty((), dtype=d.dtype, device=d.device), *args, **kwargs)
        out = as_dist(t.clone(), d.mesh)
        return out.requires_grad_() if rg else out
    return new


FACTORIES = {f: _like(f) for f in (torch.zeros_like, torch.ones_like, torch.full_like,
                                   torch.empty_like, torch.rand_like, torch.randn_like,
                                   torch.randint_like)}
FACTORIES.update({f: _new(f) for f in (T.new_zeros, T.new_ones, T.new_full, T.new_empty,
                                        T.new_tensor)})


# ---- comparisons that give a Python bool (the answer read from the full tensors) ----------

def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """``torch.allclose(d, y)``: ``isclose(d, y).all()`` (an op on DistTensors), read out;
    ``other`` must be a tensor, as torch's."""
    from .dispatch import dispatch
    if not isinstance(other, (torch.Tensor, DistTensor)):
        raise TypeError(f"allclose(): argument 'other' (position 2) must be Tensor, not "
                        f"{type(other).__name__}")
    close = dispatch(torch.isclose, (input, other),
                     {"rtol": rtol, "atol": atol, "equal_nan": equal_nan})
    return bool(dispatch(torch.all, (close,), None))


def _equal(input, other) -> bool:
    """``torch.equal(d, y)``: the same shape and the same values (dtypes may differ)."""
    from .dispatch import dispatch
    for k, v in (("input", input), ("other", other)):
        if not isinstance(v, (torch.Tensor, DistTensor)):
            raise TypeError(f"equal(): argument '{k}' must be Tensor, not {type(v).__name__}")
    if tuple(input.shape) != tuple(other.shape):
        return False
    # torch's CPU kernel's dtype check, after its size check (a complex32 raises
    # NotImplementedError '"equal_cpu" not implemented for ComplexHalf': wide seed 2015490
    # returned a bool): on stand-ins cut to one element a dim (ops_table/blas.cpu_check)
    from .ops_table.blas import cpu_check
    cpu_check(torch.equal, input, other)
    return bool(dispatch(torch.all, (dispatch(torch.eq, (input, other), None),), None))


def _extremum(kind):
    """``torch.max`` / ``torch.min`` on DistTensors, composed of ops in the table as torch
    overloads them: ``max(x)`` is ``amax`` over every dim (its gradient torch's ``max()``'s,
    ``ops_table/extreme_grad.py``); ``max(x, other)`` is
    ``maximum``; ``max(x, dim, keepdim)`` is ``(values, indices)`` with the indices of
    ``argmax`` (the first extreme, as torch's) and the values gathered at them, so that
    the gradient goes to that one element, as torch's."""
    red, arg, pair = ((torch.amax, torch.argmax, torch.maximum) if kind == "max" else
                      (torch.amin, torch.argmin, torch.minimum))
    result = getattr(torch.return_types, kind)

    def extremum(input, dim=None, keepdim=False, *, other=None, out=None):
        from .dispatch import dispatch
        if out is not None:
            raise TypeError(f"{kind}(out=...) on a DistTensor: assign the result instead")
        if isinstance(dim, (torch.Tensor, DistTensor)) or other is not None:
            return dispatch(pair, (input, dim if other is None else other), None)
        if dim is None:
            if keepdim:
                raise TypeError(f"{kind}(keepdim=True) needs a dim")
            if input.numel() == 0:          # torch's error (amax's would be an IndexError)
                raise RuntimeError(f"{kind}(): Expected reduction dim to be specified for "
                                   "input.numel() == 0. Specify the reduction dim with the "
                                   "'dim' argument.")
            if input.requires_grad and torch.is_grad_enabled():   # torch's gradient:
                from .ops_table.extreme_grad import even_extreme     # NaN's, even ties
                return even_extreme(input, (), False, red.__name__, nan=True)
            return dispatch(red, (input, tuple(range(input.ndim))), None)
        if type(dim) is not int:
            raise TypeError(f"{kind}(dim={dim!r}): give an int dim")
        n = max(input.ndim, 1)
        if not -n <= dim < n:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, "
                             f"{n - 1}], but got {dim})")
        if input.dtype.is_complex or input.numel() == 0:
            # torch's kernel checks first (an empty dim's IndexError before the complex
            # RuntimeError; argmax's would name argmax: seed 2006934 wide)
            from .ops_table.blas import cpu_check
            cpu_check(getattr(torch, kind), input, dim, keepdim)
        # torch.max(bool, dim) is defined, argmax(bool) is not: the indices of its 0 / 1
        key = dispatch(T.to, (input, torch.uint8), None) if input.dtype == torch.bool else input
        if input.ndim == 0:
            idx = dispatch(torch.argmax, (key,), None)
            return result((dispatch(T.clone, (input,), None), idx))
        idx = dispatch(arg, (key, dim, True), None)
        values = dispatch(torch.gather, (input, dim, idx), None)
        if not keepdim:
            values = dispatch(T.squeeze, (values, dim), None)
            idx = dispatch(T.squeeze, (idx, dim), None)
        return result((values, idx))
    return extremum


COMPOSED = {torch.allclose: _allclose, T.allclose: _allclose, torch.equal: _equal,
            T.equal: _equal}
for _k in ("max", "min"):
    COMPOSED[getattr(torch, _k)] = COMPOSED[getattr(T, _k)] = _extremum(_k)
COMPOSED.update(AUTOGRAD)        # torch.autograd.backward / grad (autograd.py)
COMPOSED.update(COMPOSITES)      # var, std, mse_loss, nll_loss (ops_table/composites.py)


def _index_put(*args, **kwargs):
    from .inplace import index_put
    return index_put(*args, **kwargs)


COMPOSED[torch.index_put] = COMPOSED[T.index_put] = _index_put


# ---- DTensor's names for what DistTensor calls full / reshard / mesh ----------------------

def _redistribute(self, device_mesh=None, placements=None, *, async_op=False,
                  forward_dtype=None, backward_dtype=None):
    """``d.redistribute(mesh, placements)``: :func:`workbench.reshard` under DTensor's name
    (traced and differentiable alike)."""
    from .reshard import reshard
    if forward_dtype is not None or backward_dtype is not None:
        raise NotImplementedError("redistribute(forward_dtype=/backward_dtype=) on a "
                                  "DistTensor: cast with .to(dtype) before or after instead")
    if placements is None:
        raise RuntimeError("redistribute(placements=None): placements is needed for "
                           "redistribute, e.g. [Replicate()]")
    return reshard(self, device_mesh if device_mesh is not None else self.mesh, placements)


def _full_tensor(self, *, grad_placements=None):
    """``d.full_tensor()``: DTensor's name for :meth:`DistTensor.full` (differentiable;
    ``grad_placements``: Replicate, the full tensor's own, or raises, see
    :func:`.dtensor_api.check_grad_placements`)."""
    from .dtensor_api import check_grad_placements
    from .placement import Replicate
    check_grad_placements(self, grad_placements, "full_tensor", [Replicate()] * self.mesh.ndim)
    return self.full()


def _no_hook(name):
    def refuse(self, hook):
        # torch DTensor: a hook of the DTensor gradient.  Here the dispatcher's error
        # advised allow_replicate_fallback, under which the hook went on a gathered copy
        # and never ran (habits9b)
        raise NotImplementedError(
            f"DistTensor.{name}(hook) is not built: the gradient accumulates in the "
            "DistTensor's local shards, which this hook would not see.  Read or change the "
            "gradient after loss.backward() through p.grad (a DistTensor), before "
            "optimizer.step()")
    refuse.__name__ = name
    return refuse


def install(cls) -> None:
    cls.register_hook = _no_hook("register_hook")
    cls.register_post_accumulate_grad_hook = _no_hook("register_post_accumulate_grad_hook")
    cls.redistribute = _redistribute
    cls.full_tensor = _full_tensor
    cls.device_mesh = property(lambda self: self.mesh)
    for name, f in _FACTS.items():
        setattr(cls, name, f)
    for name, f in _PROPS.items():
        setattr(cls, name, property(f))
    cls.__contains__ = _contains
    cls.__bool__ = lambda self: bool(_one(self, "bool()").item())
    cls.__float__ = lambda self: float(_one(self, "float()").item())
    cls.__int__ = lambda self: int(_one(self, "int()").item())
    cls.__complex__ = lambda self: complex(_one(self, "complex()").item())
    cls.__index__ = lambda self: _one(self, "index").__index__()
    cls.__format__ = _format
    cls.__iter__ = _iter
    from .dcp_interop import install as _dcp
    _dcp(cls)                   # torch.distributed.checkpoint: refused, naming the fix
    cls.__array__ = _array
    cls.item = _item
    cls.tolist = lambda self: self.full().tolist()
    cls.data = property(_get_data, _set_data)
    cls.requires_grad = property(cls.requires_grad.fget, _set_requires_grad)
