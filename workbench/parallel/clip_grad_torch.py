"""``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``, ``get_total_norm``,
``clip_grads_with_norm_``) on a model whose parameters are DistTensors.

    wb.parallelize(model, mesh, plan)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)    # one device's norm and grads

torch's functions take no ``__torch_function__`` override (torch 2.13,
``torch/nn/utils/clip_grad.py``: they group the gradients with
``torch._C._group_tensors_by_device_and_dtype``, a C++ function that takes only
``torch.Tensor`` s and raised a TypeError that named no fix).  :func:`install` puts a
thin wrapper in their place, in ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``
(where ``clip_grad_norm_`` looks up ``_get_total_norm`` / ``_clip_grads_with_norm_``):
given any DistTensor (parameter, or gradient for ``get_total_norm``) it runs
:mod:`.clip_grad`'s version (the same algorithm, norms taken where the shards live),
otherwise torch's own function, unchanged, with the same arguments.
``torch._foreach_norm`` of DistTensors (which reaches ``DistTensor.__torch_function__``)
gives each one's global norm as a replicated DistTensor.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.utils as _nnu
import torch.nn.utils.clip_grad as _cg

from . import clip_grad as _wb
from .dist_tensor import DistTensor

__all__ = ["install"]

# (torch.nn.utils.clip_grad's name, torch.nn.utils' name or None, ours)
_TARGETS = (("clip_grad_norm_", "clip_grad_norm_", _wb.clip_grad_norm_),
            ("clip_grad_value_", "clip_grad_value_", _wb.clip_grad_value_),
            ("_get_total_norm", "get_total_norm", _wb.get_total_norm),
            ("_clip_grads_with_norm_", "clip_grads_with_norm_", _wb.clip_grads_with_norm_))


def _wrap(orig, ours):
    @functools.wraps(orig)
    def f(parameters, *args, **kwargs):
        if isinstance(parameters, (torch.Tensor, DistTensor)):
            items, again = [parameters], parameters
        else:
            gen = isinstance(parameters, types.GeneratorType)
            items = list(parameters)                # a generator is read once: pass it on
            again = (x for x in items) if gen else items    # torch warns on an empty generator
        if any(isinstance(x, DistTensor) for x in items):
            return ours(items, *args, **kwargs)
        return orig(again, *args, **kwargs)
    f._wb_torch = orig
    return f


def _foreach_norm(tensors, ord=2, dtype=None):
    """``torch._foreach_norm`` of a list holding DistTensors: each one's norm over the
    global tensor (taken where its shards live, :mod:`.clip_grad`), a replicated 0-d
    DistTensor (as DTensor's, after its ``_NormPartial`` is reduced); plain tensors' as
    torch's."""
    from .dtensor_api import dtensor_from_local
    from .placement import Replicate
    out = []
    for t in tensors:
        if isinstance(t, DistTensor) and (
                t.requires_grad and torch.is_grad_enabled() or not t.dtype.is_floating_point
                or any(pl.is_partial() for pl in t.placements)):
            # torch's _foreach_norm is vector_norm per tensor: differentiable (its
            # ForeachNormBackward), real for a complex input, the norm of a Partial's sum.
            # The op table's vector_norm computes all three (the gradients' path below
            # detached the result, kept a complex dtype and refused a Partial; seeds
            # 2004270 / 2004489 of the wide random sweep)
            out.append(torch.linalg.vector_norm(t, ord, dtype=dtype))
        elif isinstance(t, DistTensor):
            n = _wb._norm_of(t, float(ord)).to(dtype or t.dtype)
            out.append(dtensor_from_local(n, t.mesh, [Replicate()] * t.mesh.ndim))
        else:
            out.append(torch.linalg.vector_norm(t, ord, dtype=dtype).to(dtype or t.dtype))
    from .foreach_ops import on_graph
    return on_graph(out, (tensors,))


def install() -> None:
    """Route torch's gradient clipping to :mod:`.clip_grad` for DistTensors (idempotent)."""
    from .habits import COMPOSED
    COMPOSED.setdefault(torch._foreach_norm, _foreach_norm)
    for cg_name, nnu_name, ours in _TARGETS:
        orig = getattr(_cg, cg_name, None)
        if orig is None or hasattr(orig, "_wb_torch"):
            continue
        f = _wrap(orig, ours)
        setattr(_cg, cg_name, f)
        if getattr(_nnu, nnu_name, None) is orig:
            setattr(_nnu, nnu_name, f)
