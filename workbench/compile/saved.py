"""What an op of a captured program saved for backward, for a write into it (``y = a.exp();
y.add_(1)``): torch's backward raises there (its version counter), so the write is a graph
break and the program runs eagerly, whose backward raises torch's error
(``parallel/versions.py``).  Used by :mod:`.writes`."""
from __future__ import annotations

import torch

__all__ = ["check_saved", "own_saves"]


def _refused():
    from .writes import Refused
    return Refused


def _storage(t):
    return t.untyped_storage()._cdata


def check_saved(tracer, x, op) -> set:
    """A write into a value an op of the program saved for backward (``y = a.exp();
    y.add_(1)``: exp saves its output; ``z = y * b; y.add_(1)``: mul saves y): torch's
    backward raises "one of the variables needed for gradient computation has been
    modified by an inplace operation", where the captured graph of new values would give
    the old values' gradient.  Told as torch tells it: the write bumps the meta stand-in's
    version counter (its views share it), and every saved value of the traced graph is
    unpacked (torch's SavedVariable check).  Refused: the program runs eagerly, whose
    backward raises torch's error (parallel/versions.py).  Returns the nodes seen."""
    torch.autograd.graph.increment_version(x)
    own = getattr(tracer, "_wb_own_saves", set())
    seen, todo = set(), [t.grad_fn for t in tracer.keep
                         if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for a in dir(fn):
            if a.startswith("_saved_") and (fn, a) not in own:
                try:
                    getattr(fn, a)
                except RuntimeError as e:
                    if "modified by an inplace operation" not in str(e) and \
                            "been modified inplace" not in str(e):
                        raise
                    raise _refused()(
                        f"{op} writes into a value that {fn.name()} saved for backward: "
                        "torch's backward raises (\"modified by an inplace operation\"); "
                        "the program runs eagerly, whose backward raises it too. Fix: clone() "
                        "before writing, or use the out-of-place op") from None
        todo.extend(f for f, _ in fn.next_functions)
    return seen


def own_saves(tracer, x, new, before) -> None:
    """What the write's own new value saved of ``x`` (``clamp_`` computed as ``clamp(x)``
    saves x): torch saves an in-place op's original self apart, so a later write into ``x``
    does not touch it; remembered on the tracer, skipped by :func:`check_saved`."""
    own = tracer.__dict__.setdefault("_wb_own_saves", set())
    todo = [new.grad_fn] if isinstance(new, torch.Tensor) else []
    while todo:
        fn = todo.pop()
        if fn is None or fn in before:
            continue
        before.add(fn)
        for a in dir(fn):
            if a.startswith("_saved_"):
                try:
                    v = getattr(fn, a)
                except RuntimeError:
                    continue
                if isinstance(v, torch.Tensor) and _storage(v) == _storage(x):
                    own.add((fn, a))
        todo.extend(f for f, _ in fn.next_functions)
