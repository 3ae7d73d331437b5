"""Activation checkpointing inside a simulated rank's forward: the recompute sees that
rank's parameters.

A data-parallel wrapper on simulated ranks (:func:`.ranks.run_per_rank`) runs the
module once per rank with the rank's rows of the stacked parameters swapped in
(``torch.func.functional_call``); afterwards the module holds the stacked parameters
again.  A module that checkpoints its own activations
(``torch.utils.checkpoint.checkpoint``, reentrant or not; the course's models with
``recompute="full"``) reruns part of its forward during backward, reading the module's
attributes *then*: it would read the stacked parameter (one row per rank) instead of
the rank's row, and fail on shapes or compute another rank's numbers.

Each process of a torchrun job holds its own module, so its recompute reads its own
parameters.  Here the same holds because every autograd node created by rank ``k``'s
forward that may run a recompute gets a pre-hook that puts rank ``k``'s parameters (and
the buffers and loss share its forward saw) back into the module while the node's
backward runs, and a post-hook that takes them out again
(``torch.autograd.graph.Node.register_prehook`` / ``register_hook``).  A backward that
raises inside such a node never runs its post-hook: the next wrapped forward puts the
stacked parameters back first (:func:`close_open_scopes`).

A recompute always runs inside the backward of a node its forward made: the reentrant
``CheckpointFunction``'s own node, or (non-reentrant) the first node of the region
that unpacks a saved tensor (:func:`checkpoint_nodes`); a module without a checkpoint
gets no hooks and pays one walk of its graph a forward.

A reentrant checkpoint on simulated ranks is refused (:func:`reentrant_error`): its
backward runs one inner backward per rank, so the stacked parameter would get its
ranks' gradients in separate accumulations, and the wrapper's end-of-backward
averaging (queued in the first inner backward) would run before the rest arrive.
"""
from __future__ import annotations

import contextlib
import sys

import torch

__all__ = ["RankScope", "seq_mark", "outer_checkpoint", "checkpoint_nodes", "hook_nodes",
           "reentrant_error", "refuse_checkpoint", "refuse_outer_reentrant", "close_open_scopes"]

_OPEN: list = []    # scopes whose pre-hook ran and post-hook has not (yet)


def seq_mark() -> int:
    """The sequence number of a new autograd node of this thread: the nodes a forward
    makes after it have larger numbers (each new node takes the thread's next one).
    Outside inference mode too: a forward under ``torch.inference_mode()`` makes no node,
    but the probe needs one (it raised AttributeError there)."""
    with torch.inference_mode(False), torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class RankScope:
    """Rank ``k``'s view of ``module``: the slots that hold a wrapped parameter hold the
    rank's row (``rows``: id(stacked parameter) -> row), the buffer slots hold what the
    rank's forward read (``buffers``: [(submodule, name, tensor)]), and ``ctx`` (a
    context-manager factory) is entered, e.g. the rank's loss share."""

    def __init__(self, module, rows: dict, buffers=(), ctx=None):
        self.params = [(m, n, rows[id(p)]) for m in module.modules()
                       for n, p in m._parameters.items() if p is not None and id(p) in rows]
        self.buffers = list(buffers)
        self.ctx = ctx
        self._held = []

    def pre(self, grad_outputs):
        held = [(m, n, m._parameters[n]) for m, n, _ in self.params]
        held_b = [(m, n, m._buffers[n]) for m, n, _ in self.buffers]
        for m, n, v in self.params:
            m._parameters[n] = v
        for m, n, v in self.buffers:
            m._buffers[n] = v
        stack = contextlib.ExitStack()
        if self.ctx is not None:
            stack.enter_context(self.ctx())
        self._held.append((held, held_b, stack))
        _OPEN.append(self)

    def post(self, grad_inputs, grad_outputs):
        if not self._held:
            return
        held, held_b, stack = self._held.pop()
        if self in _OPEN:
            _OPEN.remove(self)
        stack.close()
        for m, n, v in held:
            m._parameters[n] = v
        for m, n, v in held_b:
            m._buffers[n] = v


_SAVED_ATTRS: dict = {}      # node type -> its ``_raw_saved_*`` attribute names


def close_open_scopes() -> None:
    """Put back what scopes left open by a backward that raised took out (the post-hook
    of the node that raised never ran)."""
    while _OPEN:
        _OPEN[-1].post(None, None)


def outer_checkpoint():
    """The unpack hook of a non-reentrant checkpoint region open around the wrapper's own
    forward (``checkpoint(ddp, x, use_reentrant=False)``, or that region's recompute in
    backward), else None.  Its recompute reruns the whole wrapper, which puts each rank's
    parameters in place itself: its nodes get no rank hooks (ckpt11: the hooks put rank
    0's rows in the module before the rerun, whose forward then raised "'0.weight' was
    assigned after wrapping").  The top of the saved-tensor hooks stack
    (torch/csrc/autograd/python_saved_variable_hooks.cpp, read without packing a
    tensor, which would count as one of the region's saved tensors)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is not None and getattr(top[1], "__module__", None) == _CKPT:
        return top[1]
    return None


def _in_checkpoint_region(node, outer=None) -> bool:
    """Whether ``node`` keeps a saved tensor packed by a non-reentrant checkpoint region
    opened inside the forward: inside one every saved tensor is (torch.utils.checkpoint
    packs it into a holder whose unpack runs the recompute); other saved-tensor hooks
    (offloading, FSDP's) are not, nor is a region around the wrapper (``outer``,
    :func:`outer_checkpoint`: each region's saved tensors share its unpack hook)."""
    names = _SAVED_ATTRS.get(type(node))
    if names is None:
        names = _SAVED_ATTRS[type(node)] = [a for a in dir(node) if a.startswith("_raw_saved_")]
    for a in names:
        saved = getattr(node, a)
        for t in (saved if isinstance(saved, (list, tuple)) else (saved,)):
            hook = getattr(t, "unpack_hook", None)
            if hook is not None and hook is not outer and \
                    getattr(hook, "__module__", None) == _CKPT:
                return True
    return False


_CKPT = torch.utils.checkpoint.__name__


def checkpoint_nodes(outputs, since: int, outer=None):
    """The nodes reachable from ``outputs`` that a forward made (sequence numbers from
    ``since`` on, :func:`seq_mark`) whose backward may run a checkpoint's recompute:
    ``(reentrant, non_reentrant)`` lists.  A reentrant region is its own node
    (``CheckpointFunctionBackward``, which reruns the region and backpropagates through
    it); a non-reentrant region reruns from the first of its nodes that unpacks a saved
    tensor.  ``outer``: a region around the wrapper's forward (:func:`outer_checkpoint`),
    not one of the module's."""
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and
             t.grad_fn is not None]
    seen, reentrant, plain = set(), [], []
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if type(n).__name__ == "AccumulateGrad" or n._sequence_nr() < since:
            continue
        if type(n).__name__ == "CheckpointFunctionBackward":
            reentrant.append(n)
        elif _in_checkpoint_region(n, outer):
            plain.append(n)
        stack.extend(f for f, _ in n.next_functions)
    return reentrant, plain


def hook_nodes(nodes, scope: RankScope) -> None:
    """``scope`` in place while each node's backward runs."""
    for n in nodes:
        n.register_prehook(scope.pre)
        n.register_hook(scope.post)


def _in_reentrant_forward() -> bool:
    """Whether this call runs inside the forward of a reentrant checkpoint
    (``CheckpointFunction.forward``, torch/utils/checkpoint.py: the region under
    ``torch.no_grad()``); looked for only when grad is off, so a training forward pays
    nothing."""
    if torch.is_grad_enabled():
        return False
    code = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def refuse_outer_reentrant(who: str, args, kwargs) -> None:
    """``torch.utils.checkpoint.checkpoint(wrapper, x, use_reentrant=True)`` with plain
    tensor inputs: refused (NotImplementedError naming the fix).  The reentrant checkpoint
    is a ``torch.autograd.Function`` whose forward runs the wrapper under ``no_grad``; the
    wrapper on simulated ranks returns a DistTensor, which is no ``torch.Tensor``, so the
    Function passes it through untracked and no gradient reaches the parameters (ckpt11:
    backward raised "element 0 of tensors does not require grad").  With a DistTensor
    input the call runs as use_reentrant=False (..custom_function), and it trains as one
    device (tests/test_ckpt11.py)."""
    if not _in_reentrant_forward():
        return
    from torch.utils import _pytree as pytree
    from ..dist_tensor import DistTensor
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda t: isinstance(t, DistTensor))
    if any(isinstance(t, DistTensor) for t in leaves):
        return
    raise NotImplementedError(
        f"{who}: called inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True) "
        "with plain tensor inputs: the reentrant checkpoint is an autograd.Function, and "
        "the wrapper's output on simulated ranks is a DistTensor (not a torch.Tensor), so "
        "the Function would pass it through untracked and no gradient would reach the "
        "parameters.  Pass use_reentrant=False (PyTorch's recommended mode; gives one "
        "device's gradients), or give the input as a DistTensor "
        "(wb.shard_tensor(x, mesh, [wb.Shard(0)]).requires_grad_())")


def reentrant_error(who: str, n: int) -> NotImplementedError:
    """Why a reentrant checkpoint is refused on ``n`` simulated ranks."""
    return NotImplementedError(
        f"{who} on {n} simulated ranks: the module calls torch.utils.checkpoint."
        "checkpoint(..., use_reentrant=True), whose backward runs a separate backward per "
        "rank inside the main one, so each stacked parameter would receive its ranks' "
        "gradients in separate inner backwards, and the wrapper would average them "
        "when the first inner backward ends, before all have arrived; pass "
        "use_reentrant=False (PyTorch's recommended mode; works here and gives one "
        "device's gradients), or run under torchrun, where each process holds its own "
        "module")


def refuse_checkpoint(outputs, since: int, who: str, n: int) -> None:
    """FullyShardedDataParallel / fully_shard on simulated ranks: a checkpoint region in
    a rank's forward refused (NotImplementedError naming the fix).  Its recompute in
    backward would read the module's parameters when they are the shards again, not the
    rank's gathered weights: the recompute under the sharded wrappers is not built."""
    from torch.utils import _pytree as pytree
    reentrant, plain = checkpoint_nodes(pytree.tree_leaves(outputs), since,
                                        outer_checkpoint())
    if reentrant or plain:
        raise NotImplementedError(
            f"{who} on {n} simulated ranks: the module checkpoints its own activations "
            "(torch.utils.checkpoint, e.g. ModelConfig(recompute='full' / 'selective' / "
            "'op')), whose recompute in backward would read the parameters as shards, "
            "not the rank's gathered weights; the sharded wrappers do not rebuild them "
            "for a recompute.  Use wb.DistributedDataParallel (it recomputes with each "
            "rank's parameters), build the model with recompute='none', or run under "
            "torchrun (one process per rank)")
