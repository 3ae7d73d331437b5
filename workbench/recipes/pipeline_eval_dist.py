"""``Hybrid.evaluate(model, x)`` (the logits) on torch.distributed: every process gets them.

The simulated path returns the last stage's logits (B, S, V) as one tensor.  Under
torchrun only the last stage's processes computed them; as the loss is (the executor
broadcasts it from the last stage: :mod:`workbench.parallel.schedules.execute_dist`),
the logits are gathered on the last stage's mesh and broadcast from its first rank to
every process, so a user's ``logits = strategy.evaluate(model, x)`` reads the same
tensor on every rank, as on one device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..sim_mesh import backends as _B

__all__ = ["broadcast_outputs"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_HEADER = 10        # dtype code, ndim, then the shape


def broadcast_outputs(outputs, last_mesh) -> torch.Tensor:
    """The last stage's micro-batch outputs (DistTensors on ``last_mesh``, None on the
    other processes), gathered and concatenated on the batch dim, on every process."""
    src = last_mesh.ranks[0]
    head = torch.zeros(_HEADER, dtype=torch.long)
    full = None
    if _B.rank() in last_mesh:          # a collective over the last mesh (its reshard)
        full = torch.cat([o.full() for o in outputs]).detach().contiguous()
        if full.dtype not in _DTYPES or full.dim() > _HEADER - 2:
            raise NotImplementedError(f"Hybrid.evaluate logits of dtype {full.dtype}, "
                                      f"{full.dim()} dims: not sendable")
        head[0], head[1] = _DTYPES.index(full.dtype), full.dim()
        head[2:2 + full.dim()] = torch.tensor(full.shape)
    dist.broadcast(head, src=src)
    if full is None:
        nd = int(head[1])
        full = torch.empty(tuple(int(v) for v in head[2:2 + nd]), dtype=_DTYPES[int(head[0])])
    dist.broadcast(full, src=src)
    return full
