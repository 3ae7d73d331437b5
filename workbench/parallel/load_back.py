"""State-dict values that are not the module's storage: how an in-place load reaches it.

``torch.distributed.checkpoint.load`` fills a state dict in place, and on one device (or
under FSDP2, whose ``state_dict()`` DTensors are the sharded parameters themselves) that
alone changes the model: the state dict's tensors are the parameters.  Some of the
wrappers' state-dict values here are not: on simulated ranks ``DistributedDataParallel``
gives rank ``broadcast_from``'s row (a view of one replica of N), ``FullyShardedDataParallel``
and ``Zero3`` give ``Shard(0)`` / template-laid DistTensors gathered from the flat shards
(copies).  A load into those alone would change one replica (the others silently keep
their values) or nothing.  So each such value carries how to write a loaded value back
(:func:`mark`), and ``wb.checkpoint.load`` calls it after filling the value
(:func:`write_back`); ``wrapper.load_state_dict(sd)`` afterwards (DCP's documented habit)
does the same work again and changes nothing more.

The callable is kept beside the value, in a table keyed weakly by the value's identity
(``torch.utils.weak.WeakIdKeyDictionary``), not as an attribute on it: a tensor's
``__dict__`` is pickled by ``torch.save``, and a function there would make
``torch.save(ddp.state_dict())`` fail.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["mark", "write_back"]

_BACK = WeakIdKeyDictionary()      # state-dict value -> {tag: how to write it back}


def mark(value, fn, tag: str = "storage"):
    """``value`` (a state-dict tensor or DistTensor) with ``fn(value)``, which writes the
    value it then holds into the module's storage; returns ``value``.  One ``fn`` per
    ``tag`` (marking again replaces it): "storage" for the wrapper's own layout, another
    tag for a second copy to keep equal (DualPipe's copy 1 of every stage)."""
    fns = _BACK.get(value)
    if fns is None:
        fns = _BACK[value] = {}
    fns[tag] = fn
    return value


@torch.no_grad()
def write_back(value) -> bool:
    """Write ``value`` (filled in place) back into the storage it was taken from, when it
    is marked; returns whether it was."""
    fns = _BACK.get(value)
    for fn in (fns or {}).values():
        fn(value)
    return bool(fns)
