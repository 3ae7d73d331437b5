"""``torch.optim.<Optimizer>(model.parameters())`` over DistTensor parameters
(``wb.parallelize_module`` / ``wb.parallelize`` alone): refused naming the way that works.

A DistTensor is not a ``torch.Tensor``, so torch's ``Optimizer.add_param_group`` raised
"optimizer can only optimize Tensors, but one of the params is
workbench.parallel.dist_tensor.DistTensor", which names no fix (task tp7; PyTorch's own
DTensor is a Tensor subclass and steps there).  The optimizers that step DistTensor
parameters here are those the wrappers hand out: ``wb.DistributedDataParallel(model,
mesh, dim="dp")`` over a mesh with a data-parallel dim (of size 1 for tensor parallelism
alone: ``wb.Mesh.grid((1, tp), ["dp", "tp"])``) gives parameters ``torch.optim`` takes,
and on such a mesh ``wb.ZeroRedundancyOptimizer(params, torch.optim.AdamW, mesh, "dp",
partition="chunks")`` takes the DistTensors themselves.  :func:`install` wraps ``add_param_group`` to say so;
every other parameter goes on to torch's own check unchanged.
"""
from __future__ import annotations

import torch

__all__ = ["install", "MESSAGE"]

MESSAGE = ("{cls}(params): parameter {i} is a DistTensor ({where}), which torch.optim "
           "cannot step (it is not a torch.Tensor).  Wrap the parallelized model in "
           "wb.DistributedDataParallel(model, mesh, dim='dp') over a mesh with a dp dim (of "
           "size 1 for tensor parallelism alone: wb.Mesh.grid((1, tp), ['dp', 'tp'])) and "
           "give its .parameters() to the optimizer (on a mesh with a dp dim, "
           "wb.ZeroRedundancyOptimizer(params, torch.optim.{cls}, mesh, 'dp', "
           "partition='chunks') also takes DistTensors and shards the states)")


def _wrap(orig):
    def add_param_group(self, param_group):
        from .dist_tensor import DistTensor
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if isinstance(params, DistTensor):
            params = [params]
        if isinstance(params, (list, tuple)):
            for i, p in enumerate(params):
                if isinstance(p, tuple) and len(p) == 2:    # named: (name, parameter)
                    p = p[1]
                if isinstance(p, DistTensor):
                    raise TypeError(MESSAGE.format(cls=type(self).__name__, i=i,
                                                   where=p.notation()))
        return orig(self, param_group)
    add_param_group._wb_torch = orig
    add_param_group.__doc__ = orig.__doc__
    return add_param_group


def install() -> None:
    """Wrap ``torch.optim.Optimizer.add_param_group`` (idempotent)."""
    orig = torch.optim.Optimizer.add_param_group
    if not hasattr(orig, "_wb_torch"):
        torch.optim.Optimizer.add_param_group = _wrap(orig)
