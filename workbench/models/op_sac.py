"""``recompute="op"``: torchtitan's op-level selective activation checkpointing of a block.

    checkpoint(block_fn, x, ..., use_reentrant=False, context_fn=op_sac.context_fn)

The block is one ``torch.utils.checkpoint`` region (non-reentrant), and PyTorch's
selective checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
decides, op by op, what the forward keeps for the backward and what the backward re-runs,
with the policy of torchtitan's Llama (``torchtitan/parallelisms/parallelize_llama.py`` at
9dec370ad2, ``_save_list`` and ``_custom_policy``; its Llama 3 configs'
``selective_ac_option = 'op'``):

- the outputs of every ``aten.mm`` are saved except every second one, counted from 1 in
  the block's forward (the Llama block runs seven: q 1, k 2, v 3, o 4, w1 5, w3 6, w2 7,
  so q, v, w1 and w2 are saved, k, o and w3 re-run);
- the outputs of the fused attention kernels (``_scaled_dot_product_flash_attention`` and
  ``_scaled_dot_product_efficient_attention``; on a CPU PyTorch runs the same kernel as
  ``_scaled_dot_product_flash_attention_for_cpu``, saved alike), of the reduce-scatter
  (``_c10d_functional.reduce_scatter_tensor``) and of ``abs`` and ``max`` (kept for FP8
  scales) are saved;
- every other op is re-run in the backward (``CheckpointPolicy.PREFER_RECOMPUTE``), and
  the region's inputs (the block's input) are kept by the checkpoint.

Three adaptations, so that the policy sees the block's ops and only those:

- on the simulated mesh (``DistTensor``, dispatched at the torch-function level above the
  aten ops a dispatch mode sees), a linear runs as ONE GEMM for every rank: ``aten.mm``
  (a replicated input times the ranks' weight slices side by side) or ``aten.bmm`` (the
  ranks' operands stacked on a leading axis).  Such a ``bmm`` is counted as the linear's
  ``mm``, as torchtitan's policy counts a DTensor linear's (DTensor dispatches below the
  mode, so the mode sees one ``aten.mm`` per linear);
- the simulator's reduce-scatter (sequence parallelism's ``g``: a Partial -> Shard
  redistribution) is the operator ``torch.ops.workbench.reduce_scatter``
  (:mod:`workbench.sim_mesh.reduce_scatter_op`), saved beside PyTorch's functional one:
  its output is kept, the backward's recompute takes it from the cache, and the collective
  layer, seeing that the operator did not run, records no second reduce-scatter (only
  uneven shards, whose reduce-scatter runs per rank, and max/min reductions re-run it);
- GEMMs inside the attention core (:func:`attention_core`: the unfused or reference
  backends, attention dropout's explicit weights) are neither counted nor saved, as
  torchtitan's policy leaves an attention's ``bmm`` (not on its save list) to be re-run.

References: Chen et al. 2016 (recomputation); Korthikanti et al. 2022 (selective
recomputation); PyTorch's ``torch.utils.checkpoint`` selective checkpointing
(``create_selective_checkpoint_contexts``, ``CheckpointPolicy``).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..sim_mesh import reduce_scatter_op

__all__ = ["SAVE_LIST", "GEMMS", "policy", "context_fn", "attention_core", "saved_outputs"]

_aten = torch.ops.aten

# torchtitan's _save_list (9dec370ad2), with the CPU build's name of the flash kernel
SAVE_LIST = frozenset({
    _aten.mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    reduce_scatter_op.OVERLOAD,             # the simulator's (module docstring)
    _aten.abs.default,
    _aten.max.default,
})
# the GEMMs a linear runs as (module docstring): counted, every second one re-run
GEMMS = frozenset({_aten.mm.default, _aten.bmm.default})
# the reduce-scatters saved (the simulator's is traced by the collective layer, not
# priced as a kernel): the rest of the list and the GEMMs are the kernels _Ran counts
_COLLECTIVES = frozenset({torch.ops._c10d_functional.reduce_scatter_tensor.default,
                          reduce_scatter_op.OVERLOAD})
_KERNELS = (SAVE_LIST | GEMMS) - _COLLECTIVES

_IN_CORE = [0]          # > 0 inside an attention core (its GEMMs are not the linears')


@contextlib.contextmanager
def attention_core():
    """Mark the attention core: GEMMs run inside are neither counted nor saved."""
    _IN_CORE[0] += 1
    try:
        yield
    finally:
        _IN_CORE[0] -= 1


def policy():
    """A fresh policy for one region's forward (torchtitan's ``_custom_policy`` with its
    own ``meta`` counts): ``policy()(ctx, func, *args, **kwargs) -> CheckpointPolicy``."""
    count = {"forward": 0, "recompute": 0}     # (torch 2.13 asks in the forward only)

    def _policy(ctx, func, *args, **kwargs):
        if func in GEMMS:
            if _IN_CORE[0]:
                return CheckpointPolicy.PREFER_RECOMPUTE
            mode = "recompute" if ctx.is_recompute else "forward"
            count[mode] += 1
            return CheckpointPolicy.PREFER_RECOMPUTE if count[mode] % 2 == 0 \
                else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if func in SAVE_LIST \
            else CheckpointPolicy.PREFER_RECOMPUTE
    return _policy


def context_fn():
    """``checkpoint(..., context_fn=context_fn)``: PyTorch's selective-checkpoint pair of
    contexts (forward, recompute) with :func:`policy`; in the recompute, the modeled
    clock (``parallel.ops_table.pricing``) prices only the GEMM and attention kernels
    that really re-run, not those whose saved outputs the cache hands back."""
    fwd, rec = create_selective_checkpoint_contexts(policy())
    return fwd, _Recompute(rec)


class _Ran(TorchDispatchMode):
    """Below the selective-checkpoint mode in the recompute: sees only the ops that run
    (a saved op's output comes from the cache and never reaches it)."""

    def __init__(self):
        super().__init__()
        self.kernels = 0            # GEMMs and attention kernels that re-ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _KERNELS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


class _Recompute:
    """PyTorch's recompute context, entered above a :class:`_Ran`; while inside, a
    simulated op of class matmul or attention (a DistTensor op the clock prices) whose
    kernel did not re-run is not priced again."""

    def __init__(self, cached):
        self.cached = cached
        self.stack = self.ran = None
        self.seen = 0

    def _served(self, entry) -> bool:
        fresh, self.seen = self.ran.kernels - self.seen, self.ran.kernels
        return fresh == 0 and entry.op_class in ("matmul", "attention")

    def __enter__(self):
        from ..parallel.ops_table import pricing
        self.stack = contextlib.ExitStack()
        self.ran, self.seen = self.stack.enter_context(_Ran()), 0
        self.stack.enter_context(self.cached)
        pricing.SKIP_FORWARD.append(self._served)
        self.stack.callback(pricing.SKIP_FORWARD.remove, self._served)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def saved_outputs(forward_context) -> list:
    """The tensors a region's forward context (the first of :func:`context_fn`'s pair)
    saved for the backward: its cache, ``storage`` (a private attribute of PyTorch's
    caching mode: op -> {call index: wrapped outputs} in torch 2.13; tests/test_op_sac.py
    holds the shapes it yields to the policy's)."""
    out = []
    for entries in forward_context.storage.values():
        for e in entries.values():
            for w in (e if isinstance(e, (tuple, list)) else (e,)):
                val = getattr(w, "val", None)
                if isinstance(val, torch.Tensor):
                    out.append(val)
    return out
