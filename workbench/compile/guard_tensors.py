"""The tensors a compiled program reads afresh by name on each call: its module's buffers
and plain tensor attributes (constants of the graph found by their storage), and its
parameters, each refused with the fix when its shape, dtype or layout changed."""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor


def _key(t: torch.Tensor):
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


def tensor_attributes(module: nn.Module, consts: dict) -> dict:
    """{const vid: (submodule name, attribute)} for the constants of a captured graph that
    are the module's buffers or plain tensor attributes (found by their storage)."""
    where = {}
    for mname, mod in module.named_modules():
        named = list(mod._buffers.items()) + [
            (k, v) for k, v in vars(mod).items() if not k.startswith("_")]
        for attr, t in named:
            if type(t) is torch.Tensor and not t.is_meta and t.numel():
                where.setdefault(_key(t), (mname, attr))
    out = {}
    for vid, c in consts.items():
        if type(c) is torch.Tensor and not c.is_meta and c.numel() and _key(c) in where:
            out[vid] = where[_key(c)]
    return out


def bind_attributes(module: nn.Module, table: dict, values: list) -> dict:
    """{const vid: the module's tensor now} for :func:`tensor_attributes`' ``table``."""
    out = {}
    for vid, (mname, attr) in table.items():
        t = getattr(module.get_submodule(mname), attr, None)
        v = values[vid]
        full = f"{mname}.{attr}" if mname else attr
        if isinstance(t, DistTensor) or not isinstance(t, torch.Tensor) or \
                tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype:
            got = (f"{type(t).__name__} {tuple(t.shape)} {t.dtype}"
                   if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"compiled program: module tensor {full!r} was a "
                             f"{tuple(v.shape)} {v.dtype} tensor at capture and is now "
                             f"{got}; compile the module again")
        out[vid] = t.detach()
    return out


def check_parameter(name: str, p, value, captured):
    """The module's parameter ``name`` now, if it is as captured (shape, dtype, layout)."""
    was = captured.placements if isinstance(captured, DistTensor) else \
        captured[1] if isinstance(captured, tuple) else ()
    now = tuple(p.placements) if isinstance(p, DistTensor) else ()
    if p is None or tuple(p.shape) != tuple(value.shape) or p.dtype != value.dtype or \
            tuple(now) != tuple(was):
        got = "gone" if p is None else f"{tuple(p.shape)} {p.dtype} {list(map(str, now))}"
        raise ValueError(f"compiled program: parameter {name!r} was {tuple(value.shape)} "
                         f"{value.dtype} {list(map(str, was))} at capture and is now {got}; "
                         "compile the module again")
    return p


def _module_tensors(module):
    """(name, tensor) of a module's parameters and buffers, tied ones under each name."""
    for mname, mod in module.named_modules(remove_duplicate=False):
        for where in (mod._parameters, mod._buffers):
            for n, t in where.items():
                if t is not None:
                    yield (f"{mname}.{n}" if mname else n), t


def _tensor_key(t):
    """The storage key of a plain tensor, or of a DistTensor's first local tensor (a
    constant holds ``t.detach()``: the same storage, another object)."""
    if isinstance(t, DistTensor):
        from ..parallel import storage
        ts = storage.tensors(t._local)
        t = ts[0] if ts else None
    if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():   # (a Parameter too)
        return _key(t)
    return None
