"""A write through one replica's handle reaches every replica (or raises).

On torch.distributed every process runs the user's line, so ``sd = ddp.state_dict();
sd[k].copy_(t)``, ``ddp.module.state_dict()[k].mul_(2)``, ``torch.distributed.
checkpoint.load(sd, ...)`` change every replica.  On simulated ranks
``DistributedDataParallel`` stores a parameter as one row per rank (``(N, *shape)``,
:mod:`.laid_out`) and its state dicts give rank ``broadcast_from``'s row (a view, as
torch's values are views of the parameters): a write through it reaches that row only,
and the next forward would run N different models.

So the rows are made equal again before anything reads them as replicas (the next
forward, any ``torch.optim`` step, ``check_replicas``): :func:`sync_rows` checks each
parameter whose version counter (``tensor._version``, shared by every view of it, so a
write through any handle bumps it) moved since it last looked; if the rows differ,
they are compared with a copy of the value they held when last found equal:

* only rank ``broadcast_from``'s row changed: that row is copied into every row, as
  every process would have written it;
* another row changed (a row written on its own, ``p[1] += 1``: not a handle any
  process has): a ``RuntimeError`` naming the parameter and the rows, before any number
  goes wrong.

The comparison is bitwise (floats viewed as integers of their width), so a NaN or a
``-0.0`` the replicas share counts as equal.  A ``torch.optim`` step keeps equal rows
equal (every row the same update from the averaged gradient; the pre-hook syncs them
first, so a write between backward and step ends as one device's: the written row
stepped, then copied), so its new versions are taken as seen with no comparison (a
step post-hook) and a training loop pays nothing; the copy of the old value is dropped
then, and a later look compares the rows with each other: on 3 or more ranks the odd
one out, on 2 ranks rank ``broadcast_from``'s taken as the written one (a row-1 write on
2 ranks after a step is not told apart; ``check_replicas`` before any step is exact).

The same holds for a ``torch.optim`` optimizer's states over such a parameter
(``optimizer.state_dict()`` gives rank ``broadcast_from``'s rows,
:func:`.laid_out._module_shaped_states`): :func:`sync_optimizer_rows` runs in the step
pre-hook, while a tensor an optimizer's ``state_dict()`` gave over such parameters is
alive, or it gave one since its last step (those are held until then, so a one-line
``opt.state_dict()["state"][0]["exp_avg"].mul_(3)`` counts): a training loop that never
asks for the optimizer's state dict pays nothing for it.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["sync_rows", "sync_optimizer_rows", "handed_out", "before_write", "after_write"]

_SEEN = WeakIdKeyDictionary()       # rows -> [version counter, the row] when last equal
_VIEWS = WeakIdKeyDictionary()      # the tensors an optimizer's state_dict() gave -> True
_FRESH = WeakIdKeyDictionary()      # optimizer -> those given since its last step (held)

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width (bitwise comparison: NaN == NaN)."""
    if t.is_floating_point() and t.element_size() in _INT:
        return t.view(_INT[t.element_size()])
    if t.is_complex():
        return _bits(torch.view_as_real(t))
    return t


def rows_of(p):
    """(the plain ``(N, *shape)`` storage, the source row) of a DDP row parameter, or
    None for any other tensor."""
    n, src = getattr(p, "_wb_rows", None), getattr(p, "_wb_src", None)
    if not n or src is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        rows = p.detach()
    return rows, src


@torch.no_grad()
def _sync(key, t, n: int, src: int, what: str) -> None:
    """``t`` (``n`` rows on dim 0) looked at when its version counter moved: rows
    compared with the copy of the value they all held at the last look; only row ``src``
    changed (or it and every other row alike, by a write through ``.data``): copied into
    every row; every row changed alike (an optimizer step): kept;
    otherwise a ``RuntimeError``.  Then the copy is taken again (kept under ``key``, the
    tensor handed out: ``t`` may be a fresh plain view of it)."""
    seen = _SEEN.get(key)
    if n < 2 or seen is not None and seen[0] == t._version:
        return
    b = _bits(t).reshape(n, -1)
    if bool((b == b[src]).all()):       # the common case (every row stepped alike)
        if seen is None or seen[1] is None:
            _SEEN[key] = [t._version, t[src].clone()]
        else:
            seen[0] = t._version
            seen[1].copy_(t[src])
        return
    # the old value: the copy taken when last equal (none since a step: the others' common
    # one, which on 2 ranks takes rank src's row as the written one)
    old = b[0 if src else 1] if seen is None or seen[1] is None else \
        _bits(seen[1]).reshape(-1)
    changed = (b != old).any(1).nonzero().flatten().tolist()
    # every other row changed alike besides row src: a write of every row that no version
    # counter saw (``p.data.mul_(0.5)``: ``.data`` has its own), then one through row src's
    # handle (a checkpoint loaded in place): as every process, row src's value
    others = b[[i for i in range(n) if i != src]]
    alike = src in changed and bool((others == others[0]).all())
    if changed != [src] and not alike:
        raise RuntimeError(
            f"DistributedDataParallel: the replicas of {what} differ between the "
            f"simulated ranks (rows {changed} changed since they were last equal, not "
            f"rank {src}'s alone), so no process's write explains them; write through the "
            "wrapper's handles (ddp.state_dict() values, ddp.module's parameters, "
            "ddp.load_state_dict), which reach every replica, not into one rank's row")
    t.copy_(t[src:src + 1].clone().expand_as(t))
    _SEEN[key] = [t._version, t[src].clone()]


@torch.no_grad()
def sync_rows(named) -> None:
    """For each ``(name, parameter)`` of ``named`` stored as DDP's rows: every row made
    rank ``broadcast_from``'s when only that row was written (the module docstring), or
    a ``RuntimeError``."""
    # a forward or a replica check: no step is under way (one that raised, e.g. its
    # closure or a KeyboardInterrupt, skipped the post-hook that clears the mark; an
    # LBFGS closure's forward inside a step only makes its writes compare the rows)
    _STEPPING[0] = 0
    for name, p in named:
        got = rows_of(p)
        if got is not None:
            rows, src = got
            _sync(p, rows, p._wb_rows, src, repr(name))


@torch.no_grad()
def sync_optimizer_rows(optimizer) -> None:
    """Before a step: the parameters stored as DDP's rows, and their optimizer states of
    the rows' shape (``exp_avg``, ``momentum_buffer``...), synced as :func:`sync_rows`
    does (a write through ``optimizer.state_dict()``'s rank-``broadcast_from`` row)."""
    states = _FRESH.pop(optimizer, None) is not None or len(_VIEWS) > 0
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            got = rows_of(p)
            if got is None:
                continue
            rows, src = got
            where = f"param_groups[{gi}]['params'][{pi}]"
            _sync(p, rows, p._wb_rows, src, f"the optimizer's {where}")
            if not states:
                continue
            for key, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == rows.shape:
                    _sync(v, v, p._wb_rows, src, f"optimizer state {key!r} of {where}")


def handed_out(optimizer, state_dict) -> None:
    """``optimizer.state_dict()`` over DDP row parameters gave ``state_dict``: its
    tensors (rank ``broadcast_from``'s rows of the states) watched from now on."""
    views = [v for st in state_dict["state"].values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    for v in views:
        _VIEWS[v] = True
    if optimizer in _FRESH:
        _FRESH[optimizer].extend(views)
    else:
        _FRESH[optimizer] = views


def before_write(p) -> None:
    """An in-place op on a DDP row parameter itself (every row written alike) outside an
    optimizer step: a write through a row handle before it is synced first, so that
    ``sd[k].copy_(t); p.mul_(0.5)`` ends as one device's (both rows would otherwise have
    changed, and no longer alike)."""
    if not _STEPPING[0] and rows_of(p) is not None:
        sync_rows([(f"the parameter of shape {p._wb_shape}", p)])


def after_write(p) -> None:
    """After that op: its rows, written alike, are the value a later look compares with
    (else ``p.zero_()`` then a write through one row's handle, e.g. a checkpoint loaded in
    place into ``ddp.state_dict()``, found every row changed since they were last seen
    equal and raised)."""
    before_write(p)


_STEPPING = [0]             # inside a torch.optim step (its writes keep the rows equal)


def _step_pre_hook(optimizer, args, kwargs) -> None:
    sync_optimizer_rows(optimizer)
    _STEPPING[0] = 1


def _step_post_hook(optimizer, args, kwargs) -> None:
    """A step keeps equal rows equal (every row the same update from the averaged
    gradient): its new versions are taken as seen, with no comparison, so a training
    loop pays nothing; the copy of the old value is dropped (the next look after a write
    compares the rows with each other)."""
    _STEPPING[0] = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not getattr(p, "_wb_rows", None):
                continue
            for t in [p] + [v for v in optimizer.state.get(p, {}).values()
                            if isinstance(v, torch.Tensor) and v in _SEEN]:
                _SEEN[t] = [t._version, None]


register_optimizer_step_pre_hook(_step_pre_hook)
register_optimizer_step_post_hook(_step_post_hook)
