"""A linear that keeps the SHARD of its all-gathered input and gathers it again in backward.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) all-gathers the sequence
shards before each column-parallel linear (Megatron's ``f``).  The linear needs that
whole-sequence input again for its weight gradient, but keeping it would undo what
sequence parallelism saves: Table 2's ``sbh (34/t + ...)`` counts the column-parallel
linears' inputs at ``2 sbh / t``.  Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` (megatron/core/tensor_parallel/
layers.py) therefore saves the sequence-parallel input (``ctx.save_for_backward(input,
weight)`` of the shard when ``sequence_parallel``) and, in backward, all-gathers it
again, asynchronously, while the input-gradient GEMM runs (``handle = all_gather(...,
async_op=True)``; ``grad_input = grad_output.matmul(weight)``; ``handle.wait()``), then
computes the weight gradient from the gathered input.

Here:

* :func:`mark` (called by ``strategies.tensor_parallel.megatron_f``) notes on the
  gathered local tensor how to rebuild it from its shard (:class:`Regather`);
* the ``linear`` op's local (``matmul._linear_local``) runs :class:`RegatheredLinear`
  for a marked input: forward as before, but autograd keeps the shard (and the weight),
  not the gathered input; backward gathers the shard again (ONE gather per marked
  tensor and backward, shared by every linear reading it: the query, key and value
  projections are one fused QKV GEMM in Megatron-LM) and runs the local linear's own
  backward on it, so the gradients are the ones the plain linear gives;
* the clock (``pricing``): a linear whose input is marked records the re-gather on the
  tp group when its backward starts, beside its input-gradient GEMM, and its
  weight-gradient GEMM waits for it (:func:`trace_regather`).  On torch.distributed the
  gather blocks (the backends' collectives are synchronous) but is recorded the same
  way: the clock prices the program, not the executor (task tdclock).

``megatron_f(..., regather=False)`` keeps the gathered input instead (what autograd does
on its own, and what PyTorch's DTensor ``SequenceParallel`` + ``ColwiseParallel`` keep):
2 sbh per column-parallel input on every rank, and no all-gather in backward.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...sim_mesh import cost as _cost

__all__ = ["Regather", "CastRegather", "mark", "carry_cast", "carry", "of",
           "RegatheredLinear", "trace_regather"]


class Regather:
    """How to rebuild a gathered input in backward: ``rebuild(shard)`` returns the local
    tensor the forward's linear read (same shape and strides), moving the data without
    recording; ``groups``, ``mesh_dim``, ``nbytes`` (the gathered buffer per rank, the
    cost model's all-gather convention), ``label`` and ``blocking`` say how the clock
    records it.  Holds no tensor beyond the backward that uses it (the shard is saved by
    autograd, so ``torch.utils.checkpoint`` may drop and recompute it)."""

    def __init__(self, rebuild, groups, mesh_dim: str, nbytes: int, label: str,
                 blocking: bool):
        self.rebuild, self.groups, self.mesh_dim = rebuild, groups, mesh_dim
        self.nbytes, self.label, self.blocking = int(nbytes), label, blocking
        self.gathered = None          # the re-gathered input, during one backward
        self.handles = None           # its collectives on the clock, during one backward

    def gather(self, shard):
        if self.gathered is None:
            with torch.no_grad():
                self.gathered = self.rebuild(shard.detach())
            release_after_backward(self)
        return self.gathered

    def release(self) -> None:
        self.gathered = self.handles = None
        self._queued = False

    _queued = False


def release_after_backward(rg) -> None:
    """Drop ``rg``'s re-gathered input and clock handles when the backward pass running
    now ends (``queue_callback`` of torch's autograd engine, as torch's DDP reducer
    finalizes its buckets), whatever it computed.  :class:`_Release` drops them earlier,
    once every linear reading the input has run its backward, but runs only when the
    input's own gradient is wanted: a weights-only backward
    (``torch.autograd.grad(loss, weights)``) never reaches it, and would otherwise keep
    the gathered input, and the handles a later backward's clock would wait on, until
    the graph is freed."""
    while isinstance(rg, CastRegather):      # the state lives on the base
        rg = rg.base
    if rg._queued or torch._C._current_graph_task_id() == -1:     # not in a backward
        return
    rg._queued = True
    torch.autograd.Variable._execution_engine.queue_callback(rg.release)


class _Release(torch.autograd.Function):
    """Identity; its backward (after every linear reading the tensor: their input
    gradients all flow through it) drops the re-gathered input."""

    @staticmethod
    def forward(ctx, rg, x):
        ctx.rg = rg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.rg.release()
        return None, g


def mark(gathered, shard, rg: Regather):
    """``gathered`` (a local tensor), marked so that the linears reading it keep
    ``shard`` instead (module docstring).  Returns the tensor to hand on (an identity
    view of ``gathered``).  An input that needs no gradient (frozen norms below it) is
    marked too: a linear whose weight trains still keeps its input."""
    if not torch.is_grad_enabled():
        return gathered                   # no backward: nothing is kept either way
    out = _Release.apply(rg, gathered) if gathered.requires_grad else \
        gathered.view_as(gathered)        # (no gradient: released after the backward)
    if hasattr(gathered, "_wb_replica_axes"):     # torch.distributed: one copy per rank
        out._wb_replica_axes = gathered._wb_replica_axes
    out._wb_regather = (rg, shard)
    return out


def of(x):
    """``(Regather, shard)`` of a marked local tensor, else None."""
    return getattr(x, "_wb_regather", None)


def carry(src, out):
    """``out`` (an identity view of the local tensor ``src`` that a hook hands on in its
    place) marked as ``src`` is, so that the linears reading it still keep the shard.
    A module's forward hook that wraps its output after ``megatron_f``'s (ZeRO-3's
    ``_BeforeBackward`` on the final norm, whose output the head reads) dropped the mark:
    the head under ZeRO-3 kept its whole all-gathered input, 2 s b h per rank where
    ZeRO-0 keeps the 2 s b h / t shard (GPT 22B, tp 2, sp: 25.2 MB against 12.6 MB;
    found by plan10's random layouts, tests/test_plan11.py)."""
    held = of(src)
    if held is not None and out is not src:
        out._wb_regather = held
    return out


class CastRegather:
    """``base``'s re-gathered input cast from ``src`` to ``dtype``: the mark of a marked
    tensor's cast (``torch.autocast``'s cast of the gathered input before a linear,
    ``parallel.autocast``).  The shard kept is still ``base``'s (the norm's output, in its
    own dtype), gathered again in ``src`` once per backward (``base``'s gather and clock
    handles, shared with every other linear reading the tensor) and cast for each linear
    that reads it, as Megatron-LM's linear under autocast does: its autograd function
    (``LinearWithGradAccumulationAndAsyncCommunication``, ``@custom_fwd`` without
    ``cast_inputs``) saves the uncast shard, gathers it again in backward, and its
    weight-gradient GEMM casts the gathered input under the forward's autocast state
    (``@custom_bwd``).  ``copies``: the lead axes along which the forward cast one copy
    and expanded it to every rank (``autocast._cast``), done again here so the linear
    reads the layout it read in forward."""

    def __init__(self, base, src: torch.dtype, dtype: torch.dtype, copies=(), layout=None):
        self.base, self.src, self.dtype, self.copies = base, src, dtype, tuple(copies)
        self.layout = layout      # (shape, strides) of the forward's cast: laid out again

    def __getattr__(self, name):          # groups, mesh_dim, nbytes, label, blocking
        return getattr(self.base, name)

    @property
    def handles(self):
        return self.base.handles

    @handles.setter
    def handles(self, hs):
        self.base.handles = hs

    def gather(self, shard):
        with torch.no_grad():               # each linear's own cast, dropped after it
            g = self.base.gather(shard)
            shape = g.shape
            for a in self.copies:
                g = g.narrow(a, 0, 1)
            c = g.to(self.dtype).expand(shape)
            if self.layout is None or c.stride() == self.layout[1]:
                return c
            return _laid_out(c, *self.layout)

    def release(self) -> None:
        self.base.release()


def carry_cast(src, out, copies=()):
    """Mark ``out`` (the local tensor of a cast of the local tensor ``src``) as ``src``
    is, re-gathered then cast (:class:`CastRegather`); ``out`` unchanged if ``src`` is
    not marked or autograd is off."""
    held = of(src)
    if held is None or out is src or not torch.is_grad_enabled():
        return out
    rg, shard = held
    out._wb_regather = (CastRegather(rg, src.dtype, out.dtype, copies,
                                     (tuple(out.shape), out.stride())), shard)
    return out


def _laid_out(c, shape, stride):
    """``c``'s values in the layout ``(shape, stride)`` the forward's cast had: its
    stride-0 dims (one copy expanded to every rank, read once) taken at index 0 and
    expanded again, the others at the forward's strides.  ``Tensor.to`` lays a cast of a
    non-dense tensor out afresh, so under a dp x tp mesh the cast in backward gave other
    strides than the forward's (dp 512 where the forward read 1024) and the re-gathering
    linear raised ('the re-gathered input is laid out ...')."""
    one = [a for a, (n, st) in enumerate(zip(shape, stride)) if st == 0 and n > 1]
    for a in one:
        c = c.narrow(a, 0, 1)
    buf = torch.empty_strided(c.shape, stride, dtype=c.dtype, device=c.device)
    buf.copy_(c)
    return buf.expand(shape)


class RegatheredLinear(torch.autograd.Function):
    """``local(nd, ctx, x, w, b)`` (the linear op's local) on the gathered ``x``, keeping
    ``shard`` for backward in its place (module docstring)."""

    @staticmethod
    def forward(ctx, rg, local, nd, lctx, shard, x, w, b):
        ctx.rg, ctx.local, ctx.nd, ctx.lctx = rg, local, nd, lctx
        ctx.x_layout = _layout(x)
        # torch's linear keeps its input and weight, not the bias (no gradient depends
        # on the bias's values; under autocast its bf16 copy is not kept either):
        # keep the bias's layout only, and a zero stand-in of it runs the backward
        ctx.b_layout = None if b is None else (b.shape, b.stride(), b.dtype, b.device)
        ctx.save_for_backward(shard, w)
        return local(nd, lctx, x, w, b)

    @staticmethod
    @once_differentiable       # a double backward raises (the gradients carry no graph)
    def backward(ctx, g):
        shard, w = ctx.saved_tensors
        b = None
        if ctx.b_layout is not None:
            shape, stride, dtype, device = ctx.b_layout
            span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
            b = torch.zeros(span, dtype=dtype, device=device).as_strided(shape, stride)
        x = ctx.rg.gather(shard)
        if _layout(x) != ctx.x_layout:      # the same local linear runs on it again
            raise RuntimeError(f"linear: the re-gathered input is laid out {_layout(x)}; "
                               f"the forward read {ctx.x_layout}")
        need = ctx.needs_input_grad[5:8]
        # plain tensors, whatever subclass autograd hands back: ZeRO-3's gathered weight
        # is a view of a laid-out parameter's storage (strategies.laid_out._LaidOutView),
        # and autograd returns a saved input as that object (no saved-tensor hooks) or as
        # a plain detached alias (under hooks: measure_activations' SavedCounter).  The
        # subclass's detach() leaf was not what the local linear read, so its weight
        # gradient came back None (Hybrid(dp=2, tp=2, sp=True, zero=3) outside
        # measure_activations: AttributeError in zero3_clock's reduce-scatter hook)
        with torch._C.DisableTorchFunctionSubclass():
            leaves = [None if t is None else t.detach().requires_grad_(n)
                      for t, n in zip((x, w, b), need)]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        with torch.enable_grad():         # the local linear's own backward, on the leaves
            y = ctx.local(ctx.nd, ctx.lctx, *leaves)
            grads = iter(torch.autograd.grad(y, wanted, g, allow_unused=True)
                         if wanted else ())
        out = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
        return (None, None, None, None, None, *out)


def _layout(t) -> tuple:
    """Shape, and the strides of the dims longer than 1 (which alone locate elements)."""
    return tuple(t.shape), tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def trace_regather(tr, rg: Regather) -> list:
    """Record ``rg``'s all-gather on ``tr`` at most once per backward (every linear
    reading the input waits for the same one), issued now on the tp groups' comm stream
    beside the input-gradient GEMM recorded next; returns the handles the
    weight-gradient GEMM waits for.  Called only where a weight-gradient GEMM runs: in a
    split backward (zero-bubble) that is ``W``, which then gathers the input again."""
    if rg.handles is not None:
        return rg.handles
    hs = []
    for g in rg.groups:
        if len(g) == 1:
            continue
        hs.append(tr.record_collective(
            g, "all_gather", _cost.price("all_gather", rg.nbytes, g, tr.profile),
            bytes=_cost.wire_bytes("all_gather", rg.nbytes, len(g)), label=rg.label,
            args={"mesh_dim": rg.mesh_dim, "buffer_bytes": rg.nbytes,
                  "overlaps": "" if rg.blocking else "dgrad"},
            overlap=not rg.blocking))
    rg.handles = hs
    release_after_backward(rg)
    return hs
