"""``torch.autocast`` on DistTensors: torch's cast policy applied before an op is dispatched.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` plain torch runs ``F.linear``,
``matmul``, ``mm``, ``bmm``, the convolutions and ``scaled_dot_product_attention`` in
bfloat16, a few ops (``prod``, ``cross_entropy``, ``polar``, ``view_as_complex``) in
float32, and ``cat`` / ``stack`` in their inputs' widest dtype; every other op keeps its
inputs' dtypes.  The policy is torch's per aten op (torch 2.13,
``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``: the
``lower_precision_fp``, ``fp32`` and ``promote`` lists); an op's *local* implementation
here need not call the same aten op (our ``linear`` and ``addmm`` add the bias apart:
their output was float32 where torch's is bfloat16; our ``mse_loss`` stayed bfloat16
where torch's is float32), so :func:`cast_args` applies the policy to the op's
DistTensor and tensor arguments by the op-table name before dispatch, as torch's
autocast wrapper does before it calls the kernel:

* ``lower``: floating tensors other than float64 cast to ``torch.get_autocast_dtype``;
* ``fp32``: floating tensors other than float64 cast to float32;
* ``promote``: floating tensors other than float64 cast to float32 if one of them is,
  else to the autocast dtype (another lower-precision dtype raises, as torch's);
* ``off``: ``torch.convolution``, ``mv``, ``addmv`` (not on torch's lists; ours call a
  listed convolution or ``matmul``) run with autocast off.

The casts are DistTensor ops (recorded in the trace, as torch's cast kernels run).
Other ops run their local implementation under the caller's autocast, as torch's
composite ops do (``einsum`` contracts through ``bmm``, which autocast casts).

Simulated ranks hold CPU tensors: ``torch.autocast("cuda")`` leaves them as it leaves
plain CPU tensors (no change).  Autocast on another device type than the CPU for the
DistTensors' own device (torch.distributed on accelerators) raises: its policy (e.g.
CUDA's float32 ``softmax``) is not applied here.
"""
from __future__ import annotations

import torch

from . import storage

__all__ = ["POLICY", "cast_args", "policy_for"]

# by op-table name, or the torch function's name for compositions (habits.COMPOSED)
_LOWER = ("conv1d", "conv2d", "conv3d", "bmm", "mm", "linear", "matmul",
          "scaled_dot_product_attention", "addmm", "baddbmm", "addbmm",
          "flash_attention")      # wb.ops' scaled_dot_product_attention (the same policy)
_FP32 = ("prod", "polar", "view_as_complex", "trace", "cross_entropy", "mse_loss", "l1_loss",
         "smooth_l1_loss", "huber_loss", "kl_div", "nll_loss", "binary_cross_entropy",
         "binary_cross_entropy_with_logits", "margin_ranking_loss", "soft_margin_loss",
         "cosine_embedding_loss", "hinge_embedding_loss", "poisson_nll_loss",
         "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss",
         "quantile", "nanquantile")     # (these two: a bfloat16 input gives float32 in
# torch 2.13 under CPU autocast, measured; without autocast torch refuses bfloat16)
_PROMOTE = ("cat", "stack")
_OFF = ("convolution", "mv", "addmv")      # not on torch's lists; ours call matmul

POLICY = {**{n: "lower" for n in _LOWER}, **{n: "fp32" for n in _FP32},
          **{n: "promote" for n in _PROMOTE}, **{n: "off" for n in _OFF}}

_is_enabled = torch.is_autocast_enabled
_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def policy_for(name: str, args, kwargs):
    """The autocast policy that applies to the op ``name`` now (None: none, or autocast
    is off for the DistTensors' device)."""
    kind = POLICY.get(name)
    if kind is None or not _any_enabled():
        return None
    dev = _device_type(args, kwargs)
    if dev is None:
        return None
    if dev != "cpu":
        if _is_enabled(dev):
            raise NotImplementedError(
                f"{name}() under torch.autocast({dev!r}) on DistTensors: only the CPU "
                "autocast policy is applied; run the region without autocast and cast "
                "explicitly (x.to(torch.bfloat16))")
        return None
    return kind if _is_enabled("cpu") else None


def _device_type(args, kwargs):
    from .dist_tensor import DistTensor
    for x in _tensors(args, kwargs):
        if isinstance(x, DistTensor):
            return storage.device(x._local).type
    return None


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _eligible(x) -> bool:
    from .dist_tensor import DistTensor
    return isinstance(x, (DistTensor, torch.Tensor)) and x.dtype.is_floating_point


def _promote_type(args, kwargs):
    """The dtype torch's ``promote`` policy casts to (``autocast_mode.h``,
    ``prioritize``): it starts at the autocast dtype, ignores float64 inputs (left as they
    are; the op's own type promotion follows), takes float32 if any input is float32, and
    raises for another lower-precision dtype (a float16 under bfloat16 autocast)."""
    lower = torch.get_autocast_dtype("cpu")
    cur = lower
    for x in _tensors(args, kwargs):
        if not _eligible(x) or x.dtype == torch.float64:
            continue
        if cur == torch.float32 or x.dtype == torch.float32:
            cur = torch.float32
        elif x.dtype != lower:
            raise RuntimeError(
                f"cat() / stack() under torch.autocast('cpu', dtype={lower}): an input is "
                f"{x.dtype}, which torch's promote policy refuses (torch raises 'Unexpected "
                "floating ScalarType in at::autocast::prioritize'); cast it to "
                f"{lower} or torch.float32 first")
    return cur


def _cast(x, to):
    """``x.to(to)``, keeping a DistTensor's per-rank copies and its sequence-parallel mark.

    A replicated tensor that ``C.expand_replicas`` (Megatron's ``f``) gave every rank
    its own copy is held stacked, one copy per rank; the cast, announced Replicate, keeps
    the first copy (``storage.keep_first_replica``), and the next op that works per rank
    would expand it again with a second traced all-reduce of its gradient, where the
    copies' gradients are summed once, by ``f``'s backward (recorded there).  Each rank
    casts its own copy, as torch's autocast does on each process: the cast's copy is
    expanded back to every rank here, untraced.  A sequence-parallel input stays marked
    (``ops_table.linear_regather.CastRegather``), so the linear reading it keeps the
    uncast shard, as without autocast.  Over torch.distributed each process holds its
    own copy already (``_wb_replica_axes``, ``backends.tag``): the process casts it and
    the cast stays tagged and marked the same way (the dispatched cast would keep the
    gradient of the first rank's copy only, and the linear would expand the untagged
    result again: a second all-reduce, and the gathered input kept whole)."""
    from .dist_tensor import DistTensor
    from .ops_table import linear_regather
    y = x.to(to)
    if not (isinstance(x, DistTensor) and isinstance(y, DistTensor)) or y is x:
        return y
    src, out = x._local, y._local
    if type(src) is not torch.Tensor or type(out) is not torch.Tensor:
        return y
    if storage.holds_own(x.mesh):
        tags = getattr(src, "_wb_replica_axes", ())
        if tags:                          # this process's copy, cast by this process
            out = src.to(to)
            out._wb_replica_axes = tags
        linear_regather.carry_cast(src, out)
        return y if out is y._local else _same_order(
            DistTensor(out, y.mesh, y.placements, y.shape, y.dtype), y)
    nd = x.mesh.ndim
    copies = tuple(a for a in range(nd) if x.placements[a].is_replicate()
                   and src.shape[a] > 1 and out.shape[a] == 1)
    if copies:
        out = out.expand(tuple(src.shape[:nd]) + tuple(out.shape[nd:]))
    linear_regather.carry_cast(src, out, copies)
    if out is y._local:
        return y
    return _same_order(DistTensor(out, y.mesh, y.placements, y.shape, y.dtype), y)


def _same_order(out, y):
    """``out`` (y's values) with y's recorded sequence order (seq_order.py)."""
    out._ring_order = getattr(y, "_ring_order", None)
    out._ring_also = getattr(y, "_ring_also", ())
    return out


def cast_args(kind: str, args, kwargs):
    """``args`` and ``kwargs`` with torch's autocast cast applied (tensors in a list or
    tuple argument too, as ``cat``'s)."""
    if kind == "lower":
        to = torch.get_autocast_dtype("cpu")
        want = lambda x: to if x.dtype != torch.float64 else None   # noqa: E731
    elif kind == "fp32":
        want = lambda x: torch.float32 if x.dtype != torch.float64 else None   # noqa: E731
    else:
        widest = _promote_type(args, kwargs)
        want = lambda x: widest if x.dtype != torch.float64 else None   # noqa: E731

    def one(x):
        if _eligible(x):
            to = want(x)
            if to is not None and x.dtype != to:
                return _cast(x, to)
        return x

    def arg(a):
        if isinstance(a, (list, tuple)) and any(_eligible(b) for b in a):
            return type(a)(one(b) for b in a)
        return one(a)
    return tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()}
