"""A module's own ``state_dict()`` / ``load_state_dict`` over laid-out parameters: tensors
of the module's shapes out and in (:func:`module_shaped_state_dict`), and a laid-out value
as a checkpoint holds it (:func:`module_shaped`)."""
from __future__ import annotations

import torch
from torch import nn

from ..dist_tensor import DistTensor
from ..load_back import mark
from .laid_out_draws import _owner
from .laid_out_param import _LAID_OUT


def module_shaped_state_dict(module: nn.Module) -> None:
    """Hooks on every submodule of ``module`` holding a :class:`LaidOutParameter` that
    says how: its ``state_dict()`` gives that parameter in the module's shape (a view,
    as torch's; ``keep_vars=True`` the parameter itself, which the wrappers read) and
    ``load_state_dict`` takes a tensor of that shape (into every rank's copy or chunk)."""
    for m in module.modules():
        if getattr(m, "_wb_sd_hooks", False) or not any(
                getattr(p, "_wb_full", None) for p in m._parameters.values()):
            continue
        m._wb_sd_hooks = True
        m.register_state_dict_post_hook(_state_dict_hook)
        m.register_load_state_dict_pre_hook(_load_hook)


def _laid_out_items(m, prefix):
    for name, p in m._parameters.items():
        if getattr(p, "_wb_full", None) is not None:
            yield prefix + name, p


def module_shaped(v):
    """A state-dict value as a checkpoint holds it: a :class:`LaidOutParameter` (what
    ``ddp.state_dict(keep_vars=True)`` gives, as torch's: the parameter itself) as its
    module-shaped value, marked so that a load in place writes every row or chunk
    (``wb.checkpoint``: the same values as ``state_dict()``'s); any other value as is."""
    if not isinstance(v, _LAID_OUT) or getattr(v, "_wb_full", None) is None:
        return v
    p = _owner(v)
    with torch._C.DisableTorchFunctionSubclass():
        full = p._wb_full(p.detach())
    return mark(full, lambda val, p=p: p.copy_(val.clone()))


def _state_dict_hook(m, state_dict, prefix, local_metadata) -> None:
    for key, p in _laid_out_items(m, prefix):
        v = state_dict.get(key)
        if v is not None and v is not p:       # keep_vars=False: p.detach()
            # DDP's: one replica's row; a load in place writes every row (..load_back);
            # a plain tensor as torch's (not a guarded view: a write through one row's
            # handle is the replicas' checks' business, .replica_writes)
            with torch._C.DisableTorchFunctionSubclass():
                full = p._wb_full(v)
            state_dict[key] = mark(full, lambda val, p=p: p.copy_(val.clone()))


def _load_hook(m, state_dict, prefix, local_metadata, strict, missing_keys,
               unexpected_keys, error_msgs) -> None:
    for key, p in _laid_out_items(m, prefix):
        v = state_dict.get(key)
        if isinstance(v, DistTensor) and tuple(v.shape) == p._wb_shape:
            v = v.full()                # e.g. FSDP's Shard(0) state dict: gathered
        if isinstance(v, torch.Tensor) and tuple(v.shape) == p._wb_shape:
            with torch.no_grad():
                state_dict[key] = p._wb_store(v.detach())
