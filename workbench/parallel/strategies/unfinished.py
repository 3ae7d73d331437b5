"""torch DDP's error for a backward that left trainable parameters without a gradient under
``find_unused_parameters=False`` (``Reducer::ensure_prior_reduction_finished``,
``torch/csrc/distributed/c10d/reducer.cpp``; torch 2.13 raises it at the next forward with
grad enabled, measured on 2 gloo processes: tests/test_fixlist2.py).

torch's reducer waits for every parameter's hook before it finishes a backward; one that
gets no gradient keeps it waiting, and the next forward finds the reduction unfinished.
Both DDP modes (:mod:`.ddp_reducer`, :mod:`.grad_replicas`) keep the parameters no hook
marked and raise this before the next forward, with torch's text and the parameters'
names (torch prints indices, names only under ``TORCH_DISTRIBUTED_DEBUG``).
"""
from __future__ import annotations

__all__ = ["prior_reduction_error"]


def prior_reduction_error(left, rank=None) -> RuntimeError:
    """``left``: (index in the wrapper's trainable parameters, name) of each parameter no
    hook marked; ``rank``: this process's rank (torch.distributed), or None (simulated
    ranks: none of them marked it)."""
    where = "any rank" if rank is None else f"rank {rank}"
    return RuntimeError(
        "DistributedDataParallel: Expected to have finished reduction in the prior iteration "
        "before starting a new one. This error indicates that your module has parameters "
        "that were not used in producing loss. You can enable unused parameter detection by "
        "passing the keyword argument `find_unused_parameters=True` to "
        "DistributedDataParallel, and by making sure all `forward` function outputs "
        "participate in calculating loss.\n"
        f"Parameter indices which did not receive grad for {where}: "
        f"{' '.join(str(i) for i, _ in left)} ({', '.join(repr(n) for _, n in left[:6])}"
        f"{', ...' if len(left) > 6 else ''})")
