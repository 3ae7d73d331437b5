"""``loss_parallel()``: cross-entropy on vocabulary-sharded logits, as PyTorch's context.

    parallelize_module(model, mesh, {"output": ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    with loss_parallel():
        pred = model(tokens)                                         # (B, S, V), S(2) on tp
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()

Inside the context ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) on DistTensor logits
runs Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al. 2019, sec. 3;
``vocab_parallel_cross_entropy`` in megatron/core/tensor_parallel/cross_entropy.py), the
op table's "vocabulary parallel" strategy (``ops_table/cross_entropy.py``): the logits stay
where they are and three all-reduces inside the op (max logit, sum of exp, target logit)
give the exact loss; backward needs no communication.  The same conditions as torch's
(``torch/distributed/tensor/parallel/loss.py``, torch 2.13), the same ValueErrors: exactly
one mesh dim shards the class dim (dim 1; dim 0 of 1-d logits), and every other mesh dim
is Shard or Replicate.  Beyond torch: ``reduction="mean"`` on an n-d mesh and
``label_smoothing`` are exact here (the global count and the sum of logits are
all-reduced too); backward may run inside or outside the context (it is local).
Outside the context the dispatcher picks the cheapest strategy, which may gather.
Plain-tensor logits are left to torch.

The fused op needs even shards; a vocabulary the tp size does not divide (torch.chunk
shards, as DTensor's uneven ``Shard(-1)``), class weights, and ``log_softmax`` /
``nll_loss`` called alone on class-sharded input run as torch's handlers do, composed of
table ops (``tp_loss_compose.py``): the same all-reduces (three for the loss, none
backward), ``log_softmax`` keeping ``Shard(class dim)``.  ``log_softmax`` over another
dim is left to the dispatcher (torch raises there).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn import _reduction as _legacy
from torch.overrides import TorchFunctionMode

from ..sim_mesh import backends as _B
from ..sim_mesh.trace import current_trace
from .dispatch import force_candidate
from .tensor_methods import METHOD_HOOKS
from . import layout
from . import tp_loss_compose as _compose
from .dist_tensor import DistTensor
from .ops_table.table import on_change

__all__ = ["loss_parallel"]


def _class_dim_mesh_dim(x: DistTensor) -> tuple[int, int]:
    """(class dim, the one mesh dim sharding it); torch's errors otherwise."""
    cdim = 1 if x.ndim >= 2 else 0
    ps = x.placements
    hits = [i for i, p in enumerate(ps) if p.is_shard(cdim)]
    if len(hits) != 1:
        raise ValueError(f"loss_parallel() requires exactly one mesh dim to shard tensor "
                         f"dimension {cdim}, but got placements {ps} with {len(hits)} such "
                         "mesh dim(s). Lay the logits out Shard(-1) on tp (ColwiseParallel("
                         "output_layouts=Shard(-1)) and flatten them to (tokens, vocab)")
    bad = [i for i, p in enumerate(ps) if i != hits[0] and not (p.is_shard() or p.is_replicate())]
    if bad:
        raise ValueError(f"loss_parallel() expects non-TP mesh dims to be Shard or Replicate, "
                         f"but got {ps[bad[0]]} on mesh dim {bad[0]} of {ps}; reshard first")
    return cdim, hits[0]


def _vocab_parallel(x: DistTensor, cdim: int, md: int, key):
    """The candidate that keeps the logits where they are (the vocabulary-parallel one).
    Where it is the dispatcher's own choice, ``key`` is remembered: the dispatcher's cache
    then gives it again without forcing (a forced op is prepared afresh on every call)."""
    def pick(dec):
        if dec.op != "cross_entropy":
            return None
        for c in dec.candidates:
            if tuple(c.strategy.inputs[0]) == tuple(x.placements):
                if c is dec.chosen and key is not None:
                    _CHOSEN.add(key)
                return c
        raise ValueError(f"loss_parallel(): no vocabulary-parallel cross_entropy for logits "
                         f"of shape {tuple(x.shape)} laid out {x.placements} (class dim "
                         f"{x.shape[cdim]} on mesh dim {md} of size {x.mesh.shape[md]}); lay "
                         "the target out as torch's loss_parallel derives it (the logits' "
                         "row placements, Replicate on the class dim's mesh dim)")
    return pick


_CHOSEN: set = set()       # calls whose cheapest strategy is the vocabulary-parallel one
on_change(_CHOSEN.clear)   # a rule changed: the dispatcher's cache is cleared, so is this
_B.on_register(_CHOSEN.clear)


def _key(args, kwargs):
    """The call's layout, attributes and profile (what the dispatcher's cache is keyed by);
    None where a weight tensor makes it hard to say."""
    if any(a is not None for a in args[2:]) or kwargs.get("weight") is not None:
        return None
    specs = tuple(a.spec if isinstance(a, DistTensor) else (tuple(a.shape), a.dtype)
                  for a in (*args[:2], kwargs.get("input"), kwargs.get("target"))
                  if isinstance(a, (DistTensor, torch.Tensor)))
    tr = current_trace()
    attrs = tuple(sorted((k, v) for k, v in kwargs.items()
                         if k not in ("input", "target", "weight")))
    return specs, attrs, tr.profile.name if tr is not None else None


_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
            "reduction", "label_smoothing")
_NLL_ARGS = _CE_ARGS[:-1]
_LOG_SOFTMAX = {F.log_softmax: ("input", "dim", "_stacklevel", "dtype"),
                torch.log_softmax: ("input", "dim", "dtype"),
                torch.Tensor.log_softmax: ("input", "dim", "dtype")}


def _named(names, args, kwargs) -> dict:
    if len(args) > len(names):
        raise TypeError(f"{len(args)} positional arguments for ({', '.join(names)})")
    return {**dict(zip(names, args)), **kwargs}


def _reduction(a: dict) -> str:
    if a.get("size_average") is not None or a.get("reduce") is not None:
        return _legacy.legacy_get_string(a.get("size_average"), a.get("reduce"))
    return a.get("reduction", "mean")


def _tp_dim(x, dim):
    """The one mesh dim sharding ``dim`` where torch's loss_parallel takes the layout
    (others Shard or Replicate), else None."""
    hits = [i for i, p in enumerate(x.placements) if p.is_shard(dim)]
    if len(hits) != 1 or any(not (p.is_shard() or p.is_replicate())
                             for i, p in enumerate(x.placements) if i != hits[0]):
        return None
    return hits[0]


def _fused_takes(x, t) -> bool:
    """The fused op's vocabulary-parallel strategy needs even shards (its collectives
    run on the stacked shards); the composition takes the rest."""
    return layout.is_even(x.shape, x.mesh, x.placements) and \
        (not isinstance(t, DistTensor) or layout.is_even(t.shape, t.mesh, t.placements))


def _composed(func, args, kwargs):
    """log_softmax / nll_loss / weighted or uneven cross_entropy on class-sharded logits
    (tp_loss_compose.py); None where the call is left to the dispatcher."""
    if func in _LOG_SOFTMAX:
        a = _named(_LOG_SOFTMAX[func], args, kwargs)
        x, dim = a.get("input"), a.get("dim")
        if not isinstance(x, DistTensor) or not isinstance(dim, int) or x.ndim == 0:
            return None
        dim = dim % x.ndim
        md = _tp_dim(x, dim)
        return None if md is None else _compose.log_softmax(x, dim, md, a.get("dtype"))
    names = _CE_ARGS if func is F.cross_entropy else _NLL_ARGS
    a = _named(names, args, kwargs)
    x, t = a.get("input"), a.get("target")
    if not isinstance(x, DistTensor) or not isinstance(t, (torch.Tensor, DistTensor)) or \
            t.dtype.is_floating_point:              # probability targets: the dispatcher's
        return None
    cdim = 1 if x.ndim >= 2 else 0
    kw = {"weight": a.get("weight"), "ignore_index": int(a.get("ignore_index", -100)),
          "reduction": _reduction(a)}
    if func is F.nll_loss:
        md = _tp_dim(x, cdim)
        return None if md is None else _compose.nll_loss(x, t, md, **kw)
    _, md = _class_dim_mesh_dim(x)                   # torch's ValueErrors
    if kw["weight"] is None and _fused_takes(x, t):
        return None                                  # the fused op (below)
    return _compose.cross_entropy(x, t, md, label_smoothing=float(a.get("label_smoothing", 0.0)),
                                  **kw)


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy or func is F.nll_loss or func in _LOG_SOFTMAX:
            out = _composed(func, args, kwargs)
            if out is not None:
                return out
        if func is F.cross_entropy:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, DistTensor):
                cdim, md = _class_dim_mesh_dim(x)
                key = _key(args, kwargs)
                if key is not None and key in _CHOSEN:
                    return func(*args, **kwargs)
                with force_candidate(_vocab_parallel(x, cdim, md, key)):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


_ON = [0]          # loss_parallel contexts open


def _log_softmax_method(x, args, kwargs):
    """``x.log_softmax(dim)`` inside the context (a DistTensor method reaches no mode)."""
    if not _ON[0]:
        return NotImplemented
    out = _composed(torch.Tensor.log_softmax, (x,) + tuple(args), kwargs)
    return NotImplemented if out is None else out


METHOD_HOOKS["log_softmax"] = _log_softmax_method


@contextlib.contextmanager
def loss_parallel():
    """Cross-entropy on class-sharded DistTensor logits computed vocabulary-parallel
    (module docstring)."""
    _ON[0] += 1
    try:
        with _LossParallelMode():
            yield
    finally:
        _ON[0] -= 1
