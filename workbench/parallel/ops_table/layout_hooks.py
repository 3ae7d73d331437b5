"""The recipes' layout hooks as ops of the table, for a captured program (``wb.compile``).

The hybrid recipe puts Megatron-LM's f and g (``strategies/tensor_parallel.py``) around
each attention and MLP block as forward hooks, and keeps a mixture-of-experts layer's
output laid out as its input (``keep_layout``, ``recipes/moe.py``); the hooks read and set
DistTensor placements.  On capture's meta tensors there are none to read, so each hook is
recorded as one op whose rule is its layout contract (Shoeybi et al. 2019, sec. 3;
sequence parallelism, Korthikanti et al. 2022):

    megatron_f(x)   tp: x R -> R, every tp rank its copy (backward: all-reduce over tp);
                    sp: x S(seq) -> R (the whole sequence: all-gather; backward
                    reduce-scatter)
    megatron_g(y)   tp: y R -> R (the planner brings a partial sum there: all-reduce);
                    sp: y S(seq) -> S(seq) (from a partial sum: reduce-scatter)

    keep_layout(y, like)
                    y laid out as ``like`` is, on every mesh dim (like passes as it is)

Every other mesh dim passes f and g as it is (R, S(d), P), as they leave it.  The compiled
program lays the inputs out as the rule asks and then calls the function itself on the
DistTensors (``extra["runs_itself"]``, ``compile/lower.py``), so its gradient's way back
(f's asynchronous all-reduce, the sequence shard's re-gather) and its trace are eager's.
"""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ..dist_tensor import DistTensor
from ..placement import Partial, Replicate, Shard
from ..strategies import tensor_parallel as _tp
from . import costs
from .strategy import combine
from .table import register

__all__ = ["megatron_f_rule", "megatron_g_rule", "keep_layout", "keep_layout_rule"]

R = Replicate()


def _passing(x) -> list:
    """Every layout of ``x`` on a mesh dim that f and g leave as it is."""
    opts = [((R,), (R,), "passes")]
    opts += [((Shard(d),), (Shard(d),), "passes") for d in range(len(x.shape))]
    opts += [((Partial(op),), (Partial(op),), "passes") for op in ("sum", "avg")]
    return opts


def _rule(x, tp_axis, sp, seq_dim, out_sp, what):
    nd = x.mesh.ndim
    seq = seq_dim % max(len(x.shape), 1)
    want = Shard(seq) if sp else R
    got = Shard(seq) if out_sp else R
    per = [_passing(x) for _ in range(nd)]
    per[tp_axis] = [((want,), (got,), what)]
    return combine(nd, per, 1)


def megatron_f_rule(x, *, tp_axis, sp=False, seq_dim=1, **_):
    """f: on tp, R (sp: the sequence shard) -> R; the other mesh dims pass."""
    return _rule(x, tp_axis, sp, seq_dim, False,
                 "f: all-gather of the sequence" if sp else "f: each tp rank its copy")


def megatron_g_rule(y, *, tp_axis, sp=False, seq_dim=1, **_):
    """g: on tp, R -> R (sp: the sequence shard -> itself); the other mesh dims pass."""
    return _rule(y, tp_axis, sp, seq_dim, sp, "g: the partial sums reduced")


def keep_layout(y, like):
    """``y`` laid out as ``like`` (a reshard where their placements differ; ``y`` itself
    where they agree, or where ``y`` is a plain tensor, as the hook that calls it had it).
    To ``wb.compile``'s capture one op of the table (module docstring)."""
    if isinstance(y, DistTensor) and isinstance(like, DistTensor):
        if tuple(y.placements) == tuple(like.placements):
            return y
        from ..reshard import reshard
        return reshard(y, like.mesh, list(like.placements))
    if has_torch_function((y, like)):
        return handle_torch_function(keep_layout, (y, like), y, like)
    if type(y) is torch.Tensor and y.is_meta:
        return y.view_as(y)
    if type(y) is torch.Tensor:
        return y
    raise TypeError(f"keep_layout: y is a {type(y).__name__}; give a DistTensor laid out on "
                    "like's mesh (or a plain tensor, returned as it is)")


def keep_layout_rule(y, like, **_):
    """y in ``like``'s placements, ``like`` as it is: one strategy."""
    nd = like.mesh.ndim
    return combine(nd, [[((p, p), (p,), "laid out as its input")] for p in like.placements], 2)


def _local(nd, ctx, x, *_, **__):
    """On the meta device only (a shape): the compiled program calls the functions."""
    if ctx is None:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    raise RuntimeError("megatron_f, megatron_g and keep_layout run as themselves on "
                       "DistTensors, not as a local op")


_WHY = ("a recipe's layout hook (f and g read a Hybrid / tensor_parallel_region mesh's tp "
        "axis): held to eager by tests/test_compile11.py (compiled Hybrid models)")

register("megatron_f", [_tp.megatron_f],
         parse=lambda x, tp_axis, sp=False, seq_dim=1, regather=True, *, origin="megatron_f":
             ((x,), {"tp_axis": int(tp_axis), "sp": bool(sp), "seq_dim": int(seq_dim),
                     "regather": bool(regather), "origin": str(origin)}),
         rule=megatron_f_rule, local=_local, cost=costs.view, op_class="view",
         meta_check=False, sample=_WHY)
register("megatron_g", [_tp.megatron_g],
         parse=lambda y, tp_axis, sp=False, seq_dim=1:
             ((y,), {"tp_axis": int(tp_axis), "sp": bool(sp), "seq_dim": int(seq_dim)}),
         rule=megatron_g_rule, local=_local, cost=costs.view, op_class="view",
         meta_check=False, sample=_WHY)
register("keep_layout", [keep_layout], parse=lambda y, like: ((y, like), {}),
         rule=keep_layout_rule, local=_local, cost=costs.view, op_class="view",
         meta_check=False, sample=_WHY)
for _name in ("megatron_f", "megatron_g", "keep_layout"):
    from .table import TABLE as _TABLE
    _TABLE[_name].extra["runs_itself"] = True
