"""Values of the module's shape written into a laid-out parameter's storage: one device's
random draw laid out into every rank's row or chunk (``nn.init.normal_(p)``), ``p.data =
t`` and ``p.copy_(t)`` with ``t`` of the module's shape; and the parameter a write through
an alias or view is a write into."""
from __future__ import annotations

import torch

from .replica_writes import after_write, before_write


def _owner(t):
    """The parameter a write through ``t`` (it, or its ``.data`` alias) is a write into:
    the replicas' checks (:mod:`.replica_writes`) keep their records by parameter."""
    return getattr(t, "_wb_param", t)


def _drawn(func, p, args, kwargs):
    before_write(_owner(p))
    out = _one_draw(func, p, args, kwargs)
    after_write(_owner(p))     # every row the draw (DDP): what is seen now
    return out


def _one_draw(func, p, args, kwargs):
    """``nn.init.normal_(p, mean, std)`` (or another of
    :data:`.laid_out_replica_init.LAID_OUT_DRAWS`) after wrapping: one draw of the
    module's shape (the random numbers one device draws, its generator advanced as far),
    written into every rank's row or chunk.  The bounds and fans ``nn.init`` computes
    first read the module's shape (:func:`.laid_out_shape.module_shape_read`)."""
    kw = {k: v for k, v in kwargs.items() if k != "tensor"}
    fresh = torch.empty(p._wb_shape, dtype=p.dtype, device=p.device)
    with torch._C.DisableTorchFunctionSubclass():
        func(fresh, *args[1:], **kw)
        if getattr(p, "_wb_same_draw", None) is not None:
            p._wb_same_draw(fresh)      # torch.distributed: rank 0's draw on every process
        with torch.no_grad():
            p.copy_(_draw_store(p)(fresh))
    return p


def _module_shaped_data(p, value) -> bool:
    """A user's ``p.data = value`` on a laid-out parameter.  torch's assignment swaps
    ``p``'s storage for ``value``'s, so a ``value`` of the module's shape (a manual weight
    load, ``p.data = w.clone()``) became the storage: DDP's ``state_dict()`` then read
    row 0 of it as the parameter (a ``(3,)`` tensor for a ``(6, 3)`` weight, saved as
    such by ``torch.save``), FSDP's forward raised torch's "shape '[4, -1]' is invalid"
    (habits7b).  Here such a ``value`` of ``p``'s dtype and device is written into every
    rank's row or chunk, as ``p.copy_(value)`` (one device's values; ``p`` keeps its own
    storage, so a later in-place write into ``value`` does not reach it, unlike torch's
    alias): True.  A ``value`` of the storage's shape (the wrappers' own swaps,
    ``Module._apply``'s casts) is torch's assignment: False.  FSDP's chunks
    (``_wb_swaps_data``) get a storage of their own laid out from ``value`` instead of the
    write, as torch's assignment (between forward and backward: one device's saved tensors'
    values, :mod:`.fsdp_kept`; the write bumped the version and backward raised).  Any other raises naming
    the fix, nothing assigned."""
    if not isinstance(value, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        stored = tuple(p.shape)
    got, shape = tuple(value.shape), getattr(p, "_wb_shape", None)
    if got == stored or shape is None:
        return False
    if got == tuple(shape) and value.dtype == p.dtype and value.device == p.device and \
            _draw_store(p) is not None:
        if getattr(p, "_wb_swaps_data", False) or getattr(p, "_wb_rows", None):
            _swap_data(p, value)
            return True
        with torch.no_grad():
            p.copy_(value.detach())     # laid out as p is (_module_shaped_operands)
        return True
    raise RuntimeError(
        f"p.data = t with t of shape {got}, dtype {value.dtype} on a parameter after "
        f"wrapping: {p._wb_layout}, so t cannot become its storage (the module's "
        f"parameter is {tuple(shape)}, {p.dtype}).  Write values of the module's shape and "
        "dtype with p.data.copy_(t) (or p.data = t of that shape and dtype), change the "
        "dtype with model.to(dtype), or load tensors with the wrapper's load_state_dict")


def _swap_data(p, value) -> None:
    """``p.data = value`` (the module's shape) as torch's assignment: ``p`` gets a storage of
    its own laid out from ``value`` (``set_data``: its version counter kept, no bump), so
    what a forward saved reads as one device's saved tensors do: a view made in forward
    (``F.linear``'s ``w.t()``) the old storage, the parameter saved itself (``h @ w``,
    LayerNorm's weight) the new values.  FSDP's chunks (``_wb_swaps_data``): its gathered
    copies are checked at backward (:mod:`.fsdp_kept`).  DDP's rows: each rank's row the
    last forward handed the module (``_wb_row_views``, weakly; alive while a graph saved
    it) gets its row of the new storage too, as one device's parameter would (before, the
    write bumped the version: backward raised)."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        new = _draw_store(p)(value.detach()).clone()
        torch.Tensor.data.__set__(p, new)
        for k, ref in enumerate(getattr(p, "_wb_row_views", ())):
            view = ref()
            if view is not None:
                torch.Tensor.data.__set__(view, new[k])


def _draw_store(p):
    """How a module-shaped value goes into ``p``'s storage for :func:`_one_draw`: its
    ``_wb_store``, or (Zero3 over DistTensors, whose shards keep the storage's optimizer
    states, so carry no ``_wb_store``) ``_wb_draw_store``; None: no draw here."""
    store = getattr(p, "_wb_store", None)
    return store if store is not None else getattr(p, "_wb_draw_store", None)


def _module_shaped_operands(func, args):
    """``p.copy_(t)`` with ``t`` of the module's shape: ``t`` laid out as ``p`` is; any
    other in-place op given such a tensor: a clear error (see the module docstring)."""
    p = args[0]
    shape = getattr(p, "_wb_shape", None)
    if shape is None:
        return args
    with torch._C.DisableTorchFunctionSubclass():
        storage = tuple(p.shape)
    if shape == storage or getattr(p, "_wb_rows", None):
        return args                 # DDP's rows: a tensor of the module's shape broadcasts
    out = list(args)
    for i, a in enumerate(args[1:], 1):
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != shape:
            continue
        store = _draw_store(p)      # (Zero3's shards: their _wb_draw_store, habits18)
        if getattr(func, "__name__", "") == "copy_" and i == 1 and store is not None:
            out[i] = store(a)
            continue
        raise RuntimeError(
            f"{func.__name__} of a parameter after wrapping with a tensor of the module's "
            f"shape {shape}: {p._wb_layout}, so the elements would not meet; compute the "
            "new value and write it with p.copy_(value) (or before wrapping, or with the "
            "wrapper's load_state_dict)")
    return out
