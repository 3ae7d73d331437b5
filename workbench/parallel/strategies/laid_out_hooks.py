"""A user's gradient hooks on a wrapped parameter: one device's gradient, once a backward.

``p.register_hook(fn)`` (torch calls ``fn(grad)`` once a backward with the parameter's
gradient, and a tensor ``fn`` returns replaces it) and ``p.register_post_accumulate_grad_hook
(fn)`` (``fn(p)`` once ``p.grad`` holds the backward's sum; torch's "optimizer step in
backward" recipe steps there) on a parameter that a data-parallel wrapper lays out on
simulated ranks (:mod:`.laid_out`: DDP's rows ``(N, *shape)``, FSDP's / ``fully_shard``'s
padded flat chunks ``(N, chunk)``):

* before (habits9b): ``register_hook``'s ``fn`` got the storage's gradient (DDP:
  ``(4, 6, 3)``, one row per rank; FSDP: ``(4, 5)``, the padded chunks), so
  a hook reading its shape or a mean over it was silently not one device's (gradient
  centralization, ``g - g.mean(dims 1..)``: 0.060 / 0.120 off one device's after two SGD
  steps); a post-accumulate hook read FSDP's ``p.grad`` as the storage ``(4, 5)``;
* now ``fn`` gets the module's gradient, one device's (DDP: the rows' sum, which the
  all-reduce takes; FSDP: the reduce-scattered chunks unflattened), and what it returns
  goes back into the storage so that the wrapper's reduction gives it (DDP: row 0, the
  other rows zero; FSDP: cut into chunks); a post-accumulate hook runs when torch runs
  it, FSDP's ``p.grad`` then read as the module's (:class:`.rank_grads.ChunkRows`), DDP's
  as its rows (one device's once its bucket is all-reduced; a read before raises).

torch DDP runs such hooks on each process's local gradient before the all-reduce (a
non-linear hook then differs from one device's); the simulated wrappers hold one
device's answer.  Where the module's gradient is not all in this process (a process's
chunk under torch.distributed, ``fully_shard`` over tensor parallelism), the registration
raises naming the fix.

Hooks registered on a parameter *before* wrapping (torch keeps DDP's parameters, so
they run there) used to be dropped with the parameter the wrapper replaced (count 0,
0.018 off one device's after two SGD steps with a halving hook, every wrapper): the
wrapper now moves a ``register_hook`` onto its parameter as above (:func:`carry_hooks`)
and refuses a ``register_post_accumulate_grad_hook`` (:func:`check_hooks`: its ``fn(p)``
would get a parameter the user's code does not hold); ``parallelize`` /
``parallelize_module`` refuse both (``module_state.refuse_backward_hooks``).
"""
from __future__ import annotations

import math

import torch

__all__ = ["HOOKS", "register", "carry_hooks", "check_hooks", "refuse_held_hooks"]

_T = torch.Tensor
HOOKS = (_T.register_hook, _T.register_post_accumulate_grad_hook)
_FIX = ("read or change the gradient after loss.backward() through p.grad (one device's "
        "there), before optimizer.step()")


def _plain(fn, *args):
    with torch._C.DisableTorchFunctionSubclass():
        return fn(*args)


def _module_grad(p, g):
    """The module's gradient from the storage's gradient ``g``."""
    if getattr(p, "_wb_rows", None):
        return g.sum(0)         # DDP: each rank's share; the all-reduce is their sum
    return p._wb_full(g)        # FSDP: the reduce-scattered chunks


def _storage_grad(p, new, g):
    """``new`` (the module's shape) as the storage's gradient the reduction turns into it."""
    if tuple(new.shape) != tuple(p._wb_shape):
        raise RuntimeError(
            f"a gradient hook on a wrapped parameter returned shape {tuple(new.shape)}; "
            f"return the gradient's own shape {tuple(p._wb_shape)} (or None)")
    new = new.to(g.dtype)
    if getattr(p, "_wb_rows", None):
        out = torch.zeros_like(g)
        out[0] = new            # the rows' sum (the all-reduce) is new, bitwise
        return out
    return p._wb_store(new).to(g.dtype).contiguous()


def _refuse(p, func) -> None:
    raise RuntimeError(
        f"{func.__name__} on this wrapped parameter is not built ({p._wb_layout}, which "
        "this process does not read as the module's tensor): the hook would see the "
        f"storage's gradient, not the module's.  Instead {_FIX}")


def register(p, func, fn):
    """A user's ``func`` (:data:`HOOKS`) on the laid-out parameter ``p``: ``fn`` sees one
    device's gradient (module docstring).  Returns torch's handle."""
    if getattr(p, "_wb_full", None) is None or not getattr(p, "_wb_here", False):
        _refuse(p, func)
    if func is _T.register_hook:
        p._wb_grad_hooks = True         # FSDP's gradient accumulation refuses it (below)

        def on_storage(g):
            if g is None:               # FSDP holding the gradients (no_sync): none yet
                refuse_held_hooks([p], "a backward that holds the gradients")
            new = fn(_module_grad(p, g))
            return None if new is None else _storage_grad(p, new, g)
        return _plain(_T.register_hook, p, on_storage)

    def accumulated(q):
        if not getattr(p, "_wb_rows", None) and p.grad is not None:
            # FSDP's chunks hold the reduce-scattered sum already: p.grad read as the
            # module's (its own hook, registered at each forward, runs after this one)
            from .rank_grads import ChunkRows, as_chunk_rows
            if not isinstance(p.grad, ChunkRows):
                p.grad = as_chunk_rows(p.grad, math.prod(p._wb_shape), p._wb_shape)
        return fn(p)
    return _plain(_T.register_post_accumulate_grad_hook, p, accumulated)


def refuse_held_hooks(params, who: str) -> None:
    """``who`` (``FullyShardedDataParallel.no_sync()``, ``fully_shard``'s
    ``set_requires_gradient_sync(False)``) holds each micro-batch's gradient unsharded and
    reduce-scatters their sum at the next synced backward, so a ``register_hook`` on one
    of ``params`` would run once, on the sum, where one device runs it on each micro-batch's
    gradient (a clamp, a centralization: another number): raise naming the fix.  (FSDP2's
    own hook on a sharded parameter runs once on the sum, torch 2.13
    ``_fsdp_param_group.py`` ``post_backward``.)"""
    if any(getattr(p, "_wb_grad_hooks", False) for p in params):
        raise RuntimeError(
            f"{who}: a parameter has a gradient hook (p.register_hook), which would run once "
            "on the micro-batches' summed gradient at the synced backward, not on each "
            "micro-batch's gradient as on one device.  Accumulate with synchronization on "
            "(each backward reduce-scatters: the same sum), or remove the hook "
            "(handle.remove())")


def check_hooks(module, who: str, distributed: bool, keeps: bool = False) -> None:
    """Before ``who`` lays out ``module``'s parameters (``keeps``: it keeps them, as DDP
    on torch.distributed): a ``register_post_accumulate_grad_hook`` on one raises naming
    the fix, since its ``fn(p)`` would be called with the wrapper's parameter where the
    user's code holds the module's (an optimizer per parameter: a KeyError), and so does
    a ``register_hook`` under torch.distributed (``distributed``: this process's chunk
    only); nothing changed.  Other ``register_hook`` hooks move to the wrapper's
    parameter (:func:`carry_hooks`)."""
    if keeps:
        return
    for name, p in module.named_parameters():
        if getattr(p, "_wb_layout", None) is not None:
            continue        # laid out already (fully_shard of a submodule first): kept
        post = getattr(p, "_post_accumulate_grad_hooks", None)
        if post or distributed and getattr(p, "_backward_hooks", None):
            what = "register_post_accumulate_grad_hook" if post else "register_hook"
            raise RuntimeError(
                f"{who}: parameter {name!r} has a gradient hook ({what}), and {who} "
                "replaces the module's parameters by its own, so the hook would "
                + ("be called with a parameter the hook's code does not know.  Register "
                   f"it after wrapping, on {who}'s parameters (model.parameters())" if post else
                   f"see this process's chunk of the gradient.  Instead {_FIX}"))


def carry_hooks(old, new) -> None:
    """The ``register_hook`` hooks a user registered on ``old`` (a module's parameter)
    before a wrapper replaced it by ``new``: registered on ``new`` as by :func:`register`
    (where ``new``'s gradient is not all in this process, that raises)."""
    for fn in list((getattr(old, "_backward_hooks", None) or {}).values()):
        register(new, _T.register_hook, fn)
