"""Megatron-LM's f and g: the two conjugate operators around a tensor-parallel region.

Shoeybi et al. 2019 (Megatron-LM), sec. 3: a column-parallel linear followed by a
row-parallel one needs one operator before the region and one after it:

* ``f``: every tp rank gets its copy of the input; forward moves nothing, backward
  all-reduces the input gradient over tp.  Under sequence parallelism (Korthikanti
  et al. 2022) the input arrives sharded on the sequence dim, so f all-gathers it
  (and backward reduce-scatters);
* ``g``: the row-parallel partial sums are reduced: an all-reduce over tp (backward:
  identity).  Under sequence parallelism a reduce-scatter onto the sequence dim
  (backward: all-gather).

:func:`tensor_parallel_region` registers both on a module as forward hooks, so the
module's own forward is untouched.  This is the one copy used by the hybrid recipe
and the torchrun activation check.
"""
from __future__ import annotations

from ...sim_mesh import collectives as C
from ..dist_tensor import DistTensor
from ..placement import Replicate, Shard
from ..reshard import reshard

__all__ = ["megatron_f", "megatron_g", "tensor_parallel_region"]


def megatron_f(x: DistTensor, tp_axis: int, sp: bool = False, seq_dim: int = 1) -> DistTensor:
    """Enter a tp region: each tp rank its own copy of ``x`` (sp: the whole sequence)."""
    mesh, loc = x.mesh, x._local
    if sp:          # S(seq_dim) on tp -> every rank the whole sequence
        loc = C.all_gather(loc, mesh, tp_axis, seq_dim, expanded=True, label="f: all-gather")
    else:
        loc = C.expand_replicas(loc, mesh, [tp_axis], label="f: grad all-reduce")
    ps = list(x.placements)
    ps[tp_axis] = Replicate()
    return DistTensor(loc, mesh, ps, x.shape, x.dtype)


def megatron_g(y: DistTensor, tp_axis: int, sp: bool = False, seq_dim: int = 1) -> DistTensor:
    """Leave a tp region: reduce the partial sums (sp: onto the sequence shards)."""
    ps = list(y.placements)
    ps[tp_axis] = Shard(seq_dim) if sp else Replicate()
    return reshard(y, y.mesh, ps)


def tensor_parallel_region(module, mesh, tp="tp", sp: bool = False, seq_dim: int = 1):
    """Put f before ``module`` (on its first argument) and g after it; returns the hooks."""
    ax = mesh.dim(tp)

    def f(mod, args):
        x, *rest = args
        return (megatron_f(x, ax, sp, seq_dim), *rest)

    def g(mod, args, out):
        return megatron_g(out, ax, sp, seq_dim)
    return module.register_forward_pre_hook(f), module.register_forward_hook(g)
