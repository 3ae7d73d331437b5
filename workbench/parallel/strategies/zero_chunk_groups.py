"""Parameter groups of :class:`~.zero_optimizer_dist.ChunkedZeroOptimizer`, as torch.optim
takes them: read from ``params``, and their hyperparameters copied between the optimizer
and its inner one."""
from __future__ import annotations

import torch


def _param_groups(params) -> list:
    """``params`` as torch.optim takes them (tensors, or dicts with ``"params"`` and a
    group's hyperparameters) -> [(hyperparameters, [params])]."""
    params = list(params)
    if not any(isinstance(p, dict) for p in params):
        return [({}, params)]
    if not all(isinstance(p, dict) for p in params):
        raise TypeError("ZeroRedundancyOptimizer(params=...): give DistTensor parameters or "
                        "parameter groups (dicts with 'params'), not a mix of both")
    spec, seen = [], set()
    for i, grp in enumerate(params):
        if "params" not in grp:
            raise ValueError(f"ZeroRedundancyOptimizer: parameter group {i} has no 'params' "
                             "key; give {'params': [...], 'lr': ...}")
        ps = grp["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if seen & {id(p) for p in ps}:
            raise ValueError("some parameters appear in more than one parameter group")
        seen |= {id(p) for p in ps}
        spec.append(({k: v for k, v in grp.items() if k != "params"}, ps))
    return spec


def _copy_hyper(src, dst) -> None:
    """Each group's hyperparameters (lr, betas, ...; not its params) from ``src`` to ``dst``."""
    for a, b in zip(src, dst):
        b.update({k: v for k, v in a.items() if k != "params"})
