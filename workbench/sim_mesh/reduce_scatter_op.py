"""The stacked reduce-scatter as ONE torch operator: ``torch.ops.workbench.reduce_scatter``.

On the stacked form (:mod:`workbench.sim_mesh.grid`) a reduce-scatter over mesh axis
``axis`` is a sum (or mean) over that leading axis whose result every rank reads its
chunk of: no data is copied to "scatter" it, rank k's chunk of local ``dim`` is a view::

    x: (*lead, *local)  with lead[axis] = n          the ranks' partial sums
    s = x.sum(axis, keepdim=True)                    (.., 1, .., L, ..)
    y = s viewed as (.., n, .., L / n, ..)           rank k: s[..., k-th chunk of L, ...]

Written as a handful of aten ops, a dispatch mode (PyTorch's selective activation
checkpointing, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``) sees a
``sum`` and some views, none of which says "collective".  Registered as one operator
(``torch.library.custom_op``) it is seen as what it is, as PyTorch's functional
collectives are (``torch.ops._c10d_functional.reduce_scatter_tensor``): a policy can save
its output so that the backward's recompute does not communicate again (torchtitan's op
SAC, ``workbench.models.op_sac``).  :data:`RUNS` counts the times the operator really
ran; a caller that sees it unchanged after a call knows the output came from such a
cache (nothing moved, so :mod:`~workbench.sim_mesh.collectives` records no collective).

Reductions ``"sum"`` and ``"avg"`` only (what a reduce-scatter of partial sums or means
needs; their gradient needs no saved input); ``max``/``min`` stay plain aten ops.  The
gradient is what autograd gives the aten form, op for op (the views' inverses, then
``sum``'s expand, ``mean``'s expand divided by n), so values and gradients are bit for
bit those of the unregistered form (tests/test_reduce_scatter_op.py).
"""
from __future__ import annotations

import torch

__all__ = ["reduce_scatter", "run", "scatter_view", "OPS", "RUNS", "OVERLOAD"]

OPS = ("sum", "avg")            # the reductions the operator runs
RUNS = [0]                      # times the operator's kernel ran (a cache hit does not)


def scatter_view(s: torch.Tensor, nd: int, axis: int, dim: int, n: int) -> torch.Tensor:
    """Rank k's chunk k of local ``dim`` of the reduced stack ``s`` (size 1 on ``axis``),
    as one view with the ranks on ``axis``: (.., 1, .., L, ..) -> (.., n, .., L / n, ..)."""
    shape = s.shape
    L = shape[nd + dim]
    if axis == nd - 1 and dim == 0:
        # the chunk index lands where the mesh axis was: one view does it
        return s.view(shape[:axis] + (n, L // n) + shape[nd + 1:])
    y = s.squeeze(axis)
    d = nd - 1 + dim
    t = y.shape
    return y.view(t[:d] + (n, t[d] // n) + t[d + 1:]).movedim(d, axis)


def _unscatter(g: torch.Tensor, nd: int, axis: int, dim: int, n: int) -> torch.Tensor:
    """The inverse of :func:`scatter_view` as autograd runs it (ViewBackward's reshape,
    PermuteBackward's inverse permutation, SqueezeBackward's unsqueeze)."""
    shape = g.shape
    if axis == nd - 1 and dim == 0:
        return g.reshape(shape[:axis] + (1, n * shape[axis + 1]) + shape[axis + 2:])
    d = nd - 1 + dim
    y = g.movedim(axis, d)
    t = y.shape
    return y.reshape(t[:d] + (t[d] * t[d + 1],) + t[d + 2:]).unsqueeze(axis)


def _run(x: torch.Tensor, nd: int, axis: int, dim: int, op: str) -> torch.Tensor:
    if op not in OPS:
        raise ValueError(f"reduce_scatter(op={op!r}): this operator runs {list(OPS)}; "
                         "reduce max or min with workbench.sim_mesh.grid")
    RUNS[0] += 1
    n = x.shape[axis]
    if op == "avg":
        s = x.mean(axis, keepdim=True)                             # (.., 1, .., L, ..)
    elif x.is_floating_point():
        s = x.sum(axis, keepdim=True)
    else:
        s = x.sum(axis, keepdim=True, dtype=x.dtype)               # int32 stays int32
    return scatter_view(s, nd, axis, dim, n)


reduce_scatter = torch.library.custom_op("workbench::reduce_scatter", _run, mutates_args=())
reduce_scatter.__doc__ = """``torch.ops.workbench.reduce_scatter(x, nd, axis, dim, op)``: reduce
the stacked ``x`` over leading ``axis`` (``op``: sum or avg, in x's dtype as
torch.distributed reduces), then every rank its chunk of local ``dim`` (a view of the
reduced tensor).  ``nd``: the number of leading (mesh) axes."""
reduce_scatter.register_fake(_run)          # meta tensors (the dry run) run the same math
OVERLOAD = torch.ops.workbench.reduce_scatter.default      # what a dispatch mode sees


def run(x: torch.Tensor, nd: int, axis: int, dim: int, op: str) -> torch.Tensor:
    """:func:`reduce_scatter` where a dispatch mode may look (one is on the stack: a
    selective-checkpointing context, the dry run's provenance); otherwise the same math
    as plain aten ops, whose autograd gives the same gradient, without the operator's
    Python dispatch (measured when this was written: 98 us against 40 us a call,
    (4, 2, 64, 128) fp32 requiring grad, the 2-core CPU of the course's test machine,
    mean of 2000 calls).  Both count in :data:`RUNS`."""
    if torch._C._len_torch_dispatch_stack():
        return reduce_scatter(x, nd, axis, dim, op)
    return _run(x, nd, axis, dim, op)


def _setup_context(ctx, inputs, output):
    x, nd, axis, dim, op = inputs
    ctx.args = (tuple(x.shape), nd, axis, dim, op)


def _backward(ctx, g):
    shape, nd, axis, dim, op = ctx.args
    n = shape[axis]
    gx = _unscatter(g, nd, axis, dim, n).expand(shape)        # sum's backward: expand
    if op == "avg":
        gx = gx / n                                            # mean's: expand, then / n
    return gx, None, None, None, None


reduce_scatter.register_autograd(_backward, setup_context=_setup_context)
