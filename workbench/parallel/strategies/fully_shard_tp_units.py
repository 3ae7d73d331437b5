"""Each ``fully_shard`` unit's settings over DistTensors: gradient sync, resharding.

The sharded state of a ``fully_shard`` root over DistTensors is one
:class:`.fsdp_dist.DistTensorFSDP`, whose units are the modules holding parameters; each
such module follows the settings of the nearest module ``fully_shard`` was applied to
above it (or itself), read at each use, so FSDP2's setters work while training.

``reshard_after_forward`` (FSDP2's default None: True for the blocks, False for the
root): False keeps the copy a module's forward gathered alive until its backward, which
then gathers nothing (:func:`keeps_gathered`; only the clock and the gathered-bytes ledger
see it, the numbers are the same).

``set_requires_gradient_sync(False)``:
FSDP2 (torch 2.13, ``_fsdp_param_group.py``: ``reduce_grads``) skips the reduce-scatter of
a unit whose ``requires_gradient_sync`` is False: each rank keeps adding its unsharded
gradient, the sharded ``.grad`` stays as it was (None after ``zero_grad``), and the next
backward with sync reduce-scatters the sum once.  In the DistTensor mode the sum over the
dp copies of a gathered parameter is autograd's own (the reduce-scatter's math,
:meth:`.fsdp_dist.DistTensorFSDP._gather_math`), so here the shard's incoming gradient of
a backward without sync is held aside (the held tensor stands in for the ranks'
unsharded gradients) and the shard's ``.grad`` left untouched; the first backward with
sync adds what is held to its own, and only its reduce-scatter is recorded on the
clock.  Sums in another order than torch's: equal up to float rounding.
"""
from __future__ import annotations

import torch

__all__ = ["install", "skips_reduce", "keeps_gathered"]


def _unit_of(fsdp, parent, m):
    while getattr(m, "_wb_fully_shard", None) is None and id(m) in parent:
        m = parent[id(m)]
    return m._wb_fully_shard


def _unit_states(fsdp):
    """(entry index -> the ``fully_shard`` state of the nearest module above (or at) the
    module holding it; id(module) -> the same for each module holding entries)."""
    parent = {}
    for m in fsdp.module.modules():
        for c in m.children():
            parent.setdefault(id(c), m)
    by_entry = {i: _unit_of(fsdp, parent, e[0]) for i, e in enumerate(fsdp.entries)}
    by_mod = {id(m): _unit_of(fsdp, parent, m) for m in fsdp.order}
    return by_entry, by_mod


def keeps_gathered(fsdp, mod) -> bool:
    """``mod``'s unit keeps what its forward gathered for its backward
    (``reshard_after_forward`` False; None is False for the root, as FSDP2's)."""
    states = getattr(fsdp, "_wb_mod_states", None)
    if states is None or id(mod) not in states:
        return False
    st = states[id(mod)]
    v = st.reshard_after_forward
    if v is None:
        return st.top is None            # the root (nothing above it): kept
    return not v


def skips_reduce(fsdp, i: int) -> bool:
    """Entry ``i``'s gradient of this backward is held, not reduced (module docstring)."""
    states = getattr(fsdp, "_wb_sync_states", None)
    return states is not None and not states[i].requires_gradient_sync


def install(fsdp) -> None:
    """Hooks on every trainable shard of ``fsdp`` (the sharded state of a ``fully_shard``
    root over DistTensors, simulated ranks)."""
    fsdp._wb_sync_states, fsdp._wb_mod_states = _unit_states(fsdp)
    fsdp._wb_held = {}                  # entry index -> the gradient held since the last sync
    for i, e in enumerate(fsdp.entries):
        shard = e[3]
        if shard.requires_grad:
            shard.register_hook(_grad_hook(fsdp, i, shard))
            shard.register_post_accumulate_grad_hook(_after_hook(fsdp, i))


def _grad_hook(fsdp, i, shard):
    def hook(g):
        held = fsdp._wb_held
        if skips_reduce(fsdp, i):
            held[i] = g.detach().clone() if i not in held else held[i] + g.detach()
            fsdp.__dict__.setdefault("_wb_was_none", set())
            if shard.grad is None:
                fsdp._wb_was_none.add(i)
            return torch.zeros_like(g)   # the shard's .grad as it was
        if i in held:                    # the sync backward: the held sum too
            return g + held.pop(i)
        return None
    return hook


def _after_hook(fsdp, i):
    def hook(shard):
        was = fsdp.__dict__.get("_wb_was_none")
        if was and i in was:
            was.discard(i)
            shard.grad = None            # None stays None, as torch's sharded .grad
    return hook

