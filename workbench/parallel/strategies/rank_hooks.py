"""A user's module hooks under the data-parallel wrappers on simulated ranks.

On simulated ranks :class:`~.ddp.DistributedDataParallel` (and ZeRO beside it),
:class:`~.fsdp.FullyShardedDataParallel` and ``fully_shard`` run the module's forward once
per rank (:func:`.ranks.run_per_rank`, ``FullyShardedDataParallel.forward``), so a hook on
the module or on one of its submodules fires once per rank and per call, each time with
that rank's tensors, as the hook of each process of a torchrun job fires once with its own
local tensors.  That is PyTorch's own single-process answer: ``torch.nn.DataParallel``
documents that "forward and backward hooks defined on module and its submodules will be
invoked ``len(device_ids)`` times, each with inputs located on a particular device" (torch
2.13 ``torch/nn/parallel/data_parallel.py``).  Per hook kind:

* ``register_forward_pre_hook`` / ``register_forward_hook`` (and the global
  ``register_module_forward_pre_hook`` / ``register_module_forward_hook``): N calls a
  forward, each with rank k's inputs and output; a returned value (or an in-place change)
  is rank k's, exactly as that process's hook changes its own forward, so the step stays
  one device's;
* ``register_full_backward_hook`` / ``_pre_hook`` (and the global
  ``register_module_full_backward_hook`` / ``_pre_hook``): N calls a backward, each with rank k's
  gradients (over the global batch's loss: one device's gradient rows of rank k's shard);
* ``Tensor.register_hook`` on an activation inside ``forward``: registered, and so
  called, once per rank, each with its rank's gradient;
* a hook on the wrapper itself (``ddp.register_forward_hook``) and every hook where the
  module runs once over DistTensors (DDP / FSDP / fully_shard / ZeRO over tensor
  parallelism, the hybrid recipe): one call with the global tensors, one device's view.

A hook that counts or logs takes one rank's view as a torchrun script does with
``if dist.get_rank() == 0``: :func:`simulated_rank` tells which rank's forward (or, for a
module backward hook, which rank's backward) is running, and is None where no simulated
rank is (one device, the DistTensor modes, torchrun processes: there,
``torch.distributed.get_rank()``), so ``if wb.simulated_rank() in (None, 0)`` reads what
rank 0 of a torchrun job reads, and the same hook on one device.
"""
from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["simulated_rank", "as_rank"]

_RANKS: list = []           # the simulated ranks whose forward runs, innermost last


def simulated_rank():
    """The data-parallel rank (0 .. N-1) whose forward a wrapper on simulated ranks is
    running now (inside a module backward hook: whose backward), or None outside one
    (one device, the DistTensor modes, torchrun processes)."""
    return _RANKS[-1] if _RANKS else None


def _tagged(hook, k: int):
    """``hook`` called as rank ``k`` (:func:`simulated_rank` answers ``k`` inside it)."""
    @functools.wraps(hook)
    def call(*args, **kwargs):
        _RANKS.append(k)
        try:
            return hook(*args, **kwargs)
        finally:
            _RANKS.pop()
    return call


@contextlib.contextmanager
def as_rank(module: nn.Module, k: int):
    """Run rank ``k``'s forward of ``module``: :func:`simulated_rank` answers ``k``, and
    the module backward hooks torch captures during it (``Module._call_impl`` reads
    ``_backward_hooks`` / ``_backward_pre_hooks`` when the module is called) answer ``k``
    too when backward calls them.  The hook dicts hold the user's own hooks again after."""
    swapped = []
    dicts = [d for m in module.modules() for d in (m._backward_hooks, m._backward_pre_hooks)]
    # register_module_full_backward_hook / _pre_hook's (torch.nn.modules.module globals)
    dicts += [_module._global_backward_hooks, _module._global_backward_pre_hooks]
    for d in dicts:
        if d:
            for key, hook in list(d.items()):
                d[key] = _tagged(hook, k)
                swapped.append((d, key, hook))
    _RANKS.append(k)
    try:
        yield
    finally:
        _RANKS.pop()
        for d, key, hook in swapped:
            if key in d:            # a hook the forward removed stays removed
                d[key] = hook
