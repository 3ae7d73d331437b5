"""``model.state_dict(keep_vars=True)``: the parameters themselves, as torch gives them.

torch's ``nn.Module._save_to_state_dict`` puts each parameter itself in the dict when
``keep_vars=True`` (torch 2.13 ``torch/nn/modules/module.py``: ``param if keep_vars else
param.detach()``), and FSDP2 puts its sharded parameters back on the module first, so the
values are the very objects ``parameters()`` gives (``_fsdp_param_group.py``
``_to_sharded``).  A user's code leans on that: LoRA / PEFT save only what trains
(``{k: v for k, v in sd.items() if v.requires_grad}``), a logger reads ``sd[k].grad``, an
EMA or a loader writes the values in place, a mapping ``id(v) -> name`` names the
optimizer's parameters.

Over tensor parallelism the wrappers' ``state_dict(keep_vars=True)`` gave other objects
(habits10, measured on ``Linear(3, 6), GELU, Linear(6, 3)`` on 2 x 2): the module's
DistTensors, or copies gathered from the flat shards of FSDP / Zero3 / ``fully_shard``,
whose ``requires_grad`` read False (the LoRA filter kept nothing) and ``.grad`` None, for
parameters whose ``requires_grad`` is True and whose gradient is there.

:func:`as_parameters` (called by each wrapper's ``state_dict`` for a user's own call)
gives the objects ``named_parameters()`` gives under those names.  The module inside
``FullyShardedDataParallel`` / ``Zero3`` over tensor parallelism keeps only templates of
the parameters it moved into flat shards (their writes raise, their gradients are the
shards'), so its ``keep_vars=True`` raises naming the wrapper's, nothing returned.  The
wrappers' own calls (their load checks, their full state dicts) keep the module's values.

Such a dict loads as torch's does (``load_state_dict`` copies each parameter's value):
:func:`module_values` reads each laid-out parameter in it as its module value first (it
failed the size check, the storage's shape ``(2, 2, 5)`` for ``(6, 3)``).
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict

import torch

from . import storage

__all__ = ["as_parameters", "module_values"]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_WORKBENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODELS = _WORKBENCH + "models" + os.sep


def _users_call(depth: int) -> bool:
    name = sys._getframe(depth + 1).f_code.co_filename
    return not name.startswith(_TORCH) and (not name.startswith(_WORKBENCH) or
                                            name.startswith(_MODELS))


def _template(v) -> bool:
    """Is ``v`` a DistTensor that FSDP / Zero3 over tensor parallelism left as the template
    of a parameter it moved into flat shards (its in-place writes refused)?"""
    loc = getattr(v, "_local", None)
    return loc is not None and any(getattr(t, "_wb_stale", None)
                                   for t in storage.tensors(loc))


def as_parameters(module, sd, prefix: str = "", keep_vars: bool = False, depth: int = 1):
    """``sd`` (``module.state_dict(keep_vars=keep_vars)``'s result) with each parameter's
    value the object ``module.named_parameters()`` gives (module docstring), where
    ``keep_vars`` and the call (``depth`` frames above the caller of this function) is a
    user's; else ``sd`` as it is."""
    if not keep_vars or not _users_call(depth + 1):
        return sd
    params = dict(module.named_parameters(prefix=prefix, remove_duplicate=False))
    for k in list(sd):
        p = params.get(k)
        if p is None or sd[k] is p:
            continue
        if _template(p):
            raise NotImplementedError(
                f"{type(module).__name__}.state_dict(keep_vars=True) of the module inside "
                "FullyShardedDataParallel / Zero3 over tensor parallelism: its parameters "
                f"({k!r}) are templates of the flat shards the optimizer steps, so no value "
                "here is a parameter that trains (requires_grad, .grad, in-place writes).  "
                "Call state_dict(keep_vars=True) on the wrapper (its values are its "
                "parameters, the shards), or state_dict() for the values")
        sd[k] = p
    return sd


def module_values(state_dict):
    """``state_dict`` with each laid-out parameter in it (a wrapper's keep_vars value: a
    storage of another shape than its module's, ``_wb_full`` its read-back) as its module
    value, a copy; the same dict where there is none."""
    out = None
    for k, v in state_dict.items():
        full, shape = getattr(v, "_wb_full", None), getattr(v, "_wb_shape", None)
        if full is None or shape is None or not isinstance(v, torch.Tensor):
            continue
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            if tuple(v.shape) == tuple(shape):
                continue
            if out is None:
                out = OrderedDict(state_dict)
                meta = getattr(state_dict, "_metadata", None)
                if meta is not None:
                    out._metadata = meta
            out[k] = full(v.detach()).clone()
    return state_dict if out is None else out
