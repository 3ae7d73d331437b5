"""A call's keyword arguments as the positional ones a compiled program was captured with.

``torch.export.export(f, args, kwargs)`` captures a call with keywords, and the exported
program is called the way ``f`` is.  A :class:`~.program.CompiledProgram` captures its
example inputs by position, so a keyword is bound to its parameter by ``f``'s own
signature (``inspect.signature``, the rules Python applies to the call itself) and taken
by position: ``prog(x, mask=m)`` is ``prog(x, m)``.  A parameter the capture did not
receive ran with its default, which the graph holds: a call that gives it another value
is refused naming it (the graph would silently use the default).
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["positional"]

_POS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:       # noqa: BLE001 (an object whose == is not a truth value)
        return False


def positional(fn, args: tuple, kwargs: dict, n: int | None = None) -> tuple:
    """``fn(*args, **kwargs)``'s arguments by position.  ``n``: how many the capture
    took (a parameter after them must keep its default); None: up to the last one given."""
    if not kwargs and (n is None or len(args) >= n):
        return tuple(args)
    target = getattr(fn, "forward", fn)
    name = getattr(target, "__qualname__", type(fn).__name__)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        raise TypeError(f"compiled program: keyword arguments {sorted(kwargs)} cannot be "
                        f"bound, {name} has no signature to read: pass them by position"
                        ) from None
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"compiled program ({name}): {e}") from None
    given = dict(bound.arguments)
    bound.apply_defaults()
    out, last = [], -1
    for prm in sig.parameters.values():
        if prm.kind == inspect.Parameter.VAR_POSITIONAL:
            vals = bound.arguments.get(prm.name, ())
            out.extend(vals)
            if vals:
                last = len(out) - 1
            continue
        if prm.kind not in _POS:
            val = given.get(prm.name, {} if prm.kind == inspect.Parameter.VAR_KEYWORD
                            else prm.default)
            if prm.name in given and not (prm.kind == inspect.Parameter.KEYWORD_ONLY and
                                          _same(val, prm.default)):
                raise TypeError(
                    f"compiled program ({name}): argument {prm.name!r} is keyword-only (or "
                    "**kwargs): the program is captured from positional example inputs; "
                    "wrap the function so that it takes it by position, or leave it at its "
                    "default")
            continue
        out.append(bound.arguments[prm.name])
        if prm.name in given:
            last = len(out) - 1
    keep = last + 1 if n is None else max(n, last + 1)
    params = [p for p in sig.parameters.values() if p.kind in _POS]
    if n is not None:
        for i in range(n, keep):
            prm = params[i] if i < len(params) else None
            if prm is None or not _same(out[i], prm.default):
                what = f"argument {prm.name!r}" if prm is not None else f"argument {i}"
                default = "" if prm is None or prm.default is inspect.Parameter.empty else \
                    f" with its default {prm.default!r}"
                raise ValueError(
                    f"compiled program ({name}): {what} is given ({out[i]!r:.60}), but the "
                    f"program was captured without it{default}, which the graph holds: "
                    "compile again with it among the example inputs")
        keep = n
    return tuple(out[:keep])
