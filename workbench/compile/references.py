"""What a program's code reads besides its inputs (:func:`references`): the globals and
closure variables its code names, the module attributes its classes' methods name, and
the user's functions it reaches; ``_MISSING`` marks a value that is absent."""
from __future__ import annotations

import sys as _sys
import types

import torch
from torch import nn


_MISSING = object()


_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)


def is_scalar(v) -> bool:
    return isinstance(v, _SCALARS) or (isinstance(v, tuple) and len(v) <= 64 and
                                       all(isinstance(x, _SCALARS) for x in v))


def _code_names(code, out: set, strings: bool = False) -> set:
    """The names ``code`` (and the code nested in it) reads; ``strings``: instead, its
    string constants that could name an attribute (``getattr(self, "scale")``)."""
    if not strings:
        out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out, strings)
        elif strings and isinstance(c, str) and c.isidentifier() and c[0] != "_":
            out.add(c)
    return out


_NOT_FORWARD = {"__init__", "__repr__", "extra_repr", "reset_parameters", "__setstate__",
                "__getstate__", "_load_from_state_dict", "_save_to_state_dict"}


def _functions_of(cls):
    """The functions a module class defines (its own and its bases' below nn.Module)."""
    for k in cls.__mro__:
        if k is nn.Module:
            break
        if not issubclass(k, nn.Module):        # a mixin (the parallel wrappers' state)
            continue
        for name, v in vars(k).items():
            if name in _NOT_FORWARD:
                continue
            if isinstance(v, property):         # ``self.scale`` read through a getter
                yield from (f for f in (v.fget,) if isinstance(f, types.FunctionType))
                continue
            f = getattr(v, "__func__", v)
            if isinstance(f, types.FunctionType):
                yield f


def _library(f) -> bool:
    """A function of torch, workbench or another installed library (not the user's)."""
    mod = getattr(f, "__module__", None) or ""
    return mod.split(".")[0] in _LIBRARIES or mod in _sys.stdlib_module_names


_LIBRARIES = {"torch", "workbench", "numpy", "builtins", "functools", "typing", "einops",
              "transformers", "triton"}


def _user_functions(f, seen: dict) -> dict:
    """``f`` and the user's functions its code reaches through the globals and closure
    variables it names (a helper ``scale(self, y)`` that reads ``self.eps`` or a global:
    ``torch.compile`` guards what it reads too), by id."""
    if not isinstance(f, types.FunctionType) or id(f) in seen or len(seen) > 256 or \
            (seen and _library(f)):            # (fn itself, or a module's own method: read)
        return seen
    seen[id(f)] = f
    g = f.__globals__
    for n in _code_names(f.__code__, set()):
        _user_functions(g.get(n), seen)
    for cell in f.__closure__ or ():
        try:
            _user_functions(cell.cell_contents, seen)
        except ValueError:                      # an empty closure cell
            pass
    return seen


def references(fn) -> dict:
    """{label: getter} of what ``fn``'s code reads besides its arguments: the globals and
    closure variables its code names and, for a module, the instance attributes the
    methods of each submodule's class name (``self.scale``); the code of the user's
    functions it calls (by a global or closure name) counts as its own."""
    out: dict = {}

    def add(f):
        for h in _user_functions(f, {}).values():
            names = _code_names(h.__code__, set())
            g = h.__globals__
            for n in names:
                if n in g:
                    out.setdefault(f"global {n}", lambda g=g, n=n: g.get(n, _MISSING))
            for n, cell in zip(h.__code__.co_freevars, h.__closure__ or ()):
                out.setdefault(f"closure variable {n}", lambda c=cell: c.cell_contents)
    if isinstance(fn, nn.Module):
        # an attribute any of the code names, on any submodule: a parent's forward reads
        # ``self.sub.scale``, a helper ``getattr(self, "scale")``
        names: set = set()
        strings: set = set()        # (names the code may look up by a string: hasattr)
        for _, mod in fn.named_modules():
            for f in _functions_of(type(mod)):
                add(f)
                for h in _user_functions(f, {}).values():
                    _code_names(h.__code__, names)
                    _code_names(h.__code__, strings, strings=True)
        names |= strings
        for mname, mod in fn.named_modules():
            d, cls = vars(mod), type(mod)
            held = set(mod._parameters) | set(mod._buffers) | set(mod._modules)
            for n in sorted(names):
                if n == "training" or n.startswith("__") or n in held:
                    continue
                on_class = _class_value(cls, n)
                # an instance attribute, a class attribute (``scale = 2.0`` in the class
                # body: the class's value changed, or an instance's shadows it since), or
                # one the code asks for by name and that is absent (``hasattr(self, n)``)
                if n in d or on_class is not _MISSING or \
                        (n in strings and not hasattr(cls, n)):
                    out.setdefault(f"module attribute {mname + '.' if mname else ''}{n}",
                                   lambda d=d, n=n, c=cls: d.get(n, _class_value(c, n)))
    else:
        f = getattr(fn, "__func__", fn)
        obj = getattr(fn, "__self__", None)
        if not isinstance(f, types.FunctionType) and not isinstance(
                fn, (types.BuiltinFunctionType, types.MethodType, type)):
            obj, f = fn, getattr(type(fn), "__call__", None)    # a callable object
        if isinstance(f, types.FunctionType):
            add(f)
        # the object a method is bound to, or the callable object (``self.k`` its code
        # reads): compared by its attributes (a module's are read afresh, as above)
        if obj is not None and not isinstance(obj, (nn.Module, types.ModuleType, type)):
            out.setdefault(f"the object {type(obj).__name__} the program is bound to",
                           lambda o=obj: o)
    return out


def _class_value(cls, n):
    """The data attribute ``n`` of a module class (a value in its body, not a method,
    property or other descriptor), or ``_MISSING``."""
    for k in cls.__mro__:
        if n in vars(k):
            v = vars(k)[n]
            return _MISSING if hasattr(v, "__get__") or isinstance(v, type) else v
    return _MISSING
