"""``torch._foreach_*`` over lists holding DistTensors, and torch's grouping of them.

``torch.optim.swa_utils.AveragedModel`` over a parallelized module (its averaged copy and
the model both DistTensor parameters: ``AveragedModel(model)`` after ``wb.parallelize``)
groups the two lists with ``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``,
a C++ function that takes only ``torch.Tensor`` s (torch 2.13 ``torch/optim/swa_utils.py``,
``update_parameters``), and its multi-tensor averages (``get_ema_multi_avg_fn``,
``get_swa_multi_avg_fn``) call ``torch.is_floating_point`` and ``torch._foreach_lerp_`` on
them: each raised (a TypeError naming no fix, habits7b; an ``avg_fn=`` ran).  Here:

* the grouping, given DistTensors, groups them in Python as torch's does (by the first
  list's device and dtype; each group's lists and indices; an empty list stays empty),
  else torch's own function; also where ``torch.optim``'s ``foreach=True`` steps call it
  (``torch/optim/optimizer.py``, over DistTensor parameters: :mod:`.optim_dist`);
* ``torch._foreach_<op>`` / ``_foreach_<op>_`` given DistTensors runs ``Tensor.<op>`` /
  ``<op>_`` on each element (the list arguments zipped, the others passed to each), as
  torch's foreach fallback loops over its tensors: the same numbers as one device's, an
  in-place one returning None, an out-of-place one the list of results (``maximum_`` /
  ``minimum_``, which torch.Tensor lacks, copy ``maximum`` / ``minimum`` in place: Adam's
  ``amsgrad`` with ``foreach=True``);
* ``torch.is_floating_point(d)`` / ``torch.is_complex(d)``: ``d``'s dtype's answer.
"""
from __future__ import annotations

import torch
import torch.utils._foreach_utils as _fu

from .dist_tensor import DistTensor

__all__ = ["install"]

_T = torch.Tensor
# torch._foreach_<name>(_) whose per-tensor Tensor method has the same arguments
_OPS = ("add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "copy", "maximum",
        "minimum", "clamp_min", "clamp_max", "pow", "sqrt", "rsqrt", "neg", "abs", "exp",
        "log", "sign", "reciprocal", "zero")


def _per_tensor(method: str, in_place: bool):
    def run(*args, **kwargs):
        n = len(args[0])
        for a in args[1:]:
            if isinstance(a, (list, tuple)) and len(a) != n:
                raise ValueError(f"torch._foreach_{method}: the lists have {n} and {len(a)} "
                                 "tensors; give lists of one length")
        outs = []
        for k in range(n):
            first, *rest = [a[k] if isinstance(a, (list, tuple)) else a for a in args]
            kw = kwargs
            if method.startswith(("addcmul", "addcdiv")) and len(rest) == 3:
                *rest, value = rest         # torch._foreach_addcdiv_(s, t1, t2, scalars)
                kw = {**kwargs, "value": value}     # Tensor.addcdiv_(t1, t2, *, value)
            if hasattr(first, method):
                outs.append(getattr(first, method)(*rest, **kw))    # a DistTensor's own
            else:               # maximum_ / minimum_: no Tensor method, torch's in place
                first.copy_(getattr(first, method[:-1])(*rest, **kw))
        return None if in_place else outs
    return run


def _foreach_table() -> dict:
    out = {}
    for name in _OPS:
        for in_place in (False, True):
            method = f"{name}{'_' if in_place else ''}"
            f = getattr(torch, f"_foreach_{method}", None)
            if f is not None and (hasattr(_T, method) or hasattr(_T, method.rstrip("_"))):
                out[f] = _per_tensor(method, in_place)
    return out


def _grouping(orig):
    def group(tensorlistlist, with_indices=False):
        if not any(isinstance(t, DistTensor) for lst in tensorlistlist for t in lst):
            return orig(tensorlistlist, with_indices)
        out = {}
        for i, t in enumerate(tensorlistlist[0]):
            lists, idx = out.setdefault((t.device, t.dtype),
                                        ([[] for _ in tensorlistlist], []))
            for lst, src in zip(lists, tensorlistlist):
                if len(src):            # an empty list stays empty (Adam's max_exp_avg_sqs
                    lst.append(src[i])  # without amsgrad), as torch's C++ grouping keeps it
            idx.append(i)
        return out
    group._wb_torch = orig
    return group


def install() -> None:
    """Route the functions above for DistTensors (idempotent)."""
    from .habits import COMPOSED
    for f, ours in _foreach_table().items():
        COMPOSED.setdefault(f, ours)
    COMPOSED.setdefault(torch.is_floating_point, lambda d: d.dtype.is_floating_point)
    COMPOSED.setdefault(torch.is_complex, lambda d: d.dtype.is_complex)
    import torch.optim.optimizer as _optimizer
    import torch.optim.swa_utils as _swa
    for mod in (_fu, _swa, _optimizer):     # optimizer: foreach=True steps (optim_dist)
        orig = getattr(mod, "_group_tensors_by_device_and_dtype", None)
        if orig is not None and not hasattr(orig, "_wb_torch"):
            mod._group_tensors_by_device_and_dtype = _grouping(orig)
