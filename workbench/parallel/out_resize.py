"""``op(..., out=d)`` where ``d`` has another shape than the result: torch resizes ``out``
(``at::native::resize_output``): silently when it has no elements (``out=torch.empty(0)``,
the common idiom), with a UserWarning when it has some (deprecated there).  A DistTensor
``out`` is resized alike: it takes the result's shape, laid out as it was where its
placements still fit (a ``Shard(d)`` beyond the new dims becomes ``Replicate()``), then
the result is written into it (:func:`.inplace.out_call`).

Not resized (refused, naming the fix): an ``out`` that is a view of another DistTensor or
has views (torch's resize would move it to new memory, its views keeping the old values;
here views follow their base), or a parameter."""
from __future__ import annotations

import warnings

import torch

from .dist_tensor import DistTensor, shard_tensor
from .placement import Replicate

__all__ = ["resize_out"]


def resize_out(out: DistTensor, shape, name: str) -> None:
    """Give ``out`` the shape ``shape`` (its values undefined, as torch's resize's)."""
    from .views import _VIEWS
    shape = tuple(shape)
    viewed = any(r() is not None for r in _VIEWS.get(id(out), ()))
    if out._view is not None or viewed or getattr(out, "_is_param", False):
        what = "a view" if out._view is not None else "a parameter" if not viewed else \
            "a tensor with views"
        raise NotImplementedError(
            f"{name}(out=...): the result has shape {shape} but out has {tuple(out.shape)}, "
            f"and out is {what}: torch would resize it, a DistTensor that is {what} is not "
            "resized; give an out of the result's shape, or assign the result")
    if out.numel():
        warnings.warn(
            f"An output with one or more elements was resized since it had shape "
            f"{list(out.shape)}, which does not match the required output shape "
            f"{list(shape)}. This behavior is deprecated, and in a future PyTorch release "
            "outputs will not be resized unless they have zero elements. You can explicitly "
            "reuse an out tensor t by resizing it, inplace, to zero elements with "
            "t.resize_(0).", UserWarning, stacklevel=4)
    ps = [Replicate() if p.is_shard() and p.dim >= len(shape) else p
          for p in out.placements]
    fresh = shard_tensor(torch.zeros(shape, dtype=out.dtype, device=out.device), out.mesh,
                         ps, src_data_rank=None)
    out.shape, out.placements, out._local = fresh.shape, fresh.placements, fresh._local
    out._spec, out.names, out._gstride = None, None, fresh._gstride
