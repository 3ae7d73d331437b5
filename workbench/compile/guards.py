"""What a compiled program reads afresh on each call (its module's parameters and buffers,
the tensors its code names) and what it holds fixed from its capture (checked on every
call, a change refused with the fix).

``torch.compile`` guards a captured frame on what it read: ``module.training`` (a
dropout, a Python branch on ``self.training``) and the tensors the code read off the
module; when one changes it captures again.  A :class:`~.program.CompiledProgram` holds
one capture, so:

* the module's tree of submodules is recorded at capture: a call after one was added,
  removed or replaced (``m.act = nn.Tanh()``) is refused with the fix;
* the training flags of the module and its children are recorded at capture; a call
  after ``model.eval()`` (or ``train()``) of a program captured in the other mode is
  refused with the fix (compile again), never run in the captured mode;
* a tensor the forward read off the module (a buffer, or a plain tensor attribute such
  as a RoPE table) is a constant of the graph; it is looked up again by its module path
  on every call, so that ``module.buf = new`` is seen as ``module.buf.fill_(...)`` is.
  A replacement of another shape or dtype is refused with the fix;
* what the code reads besides its inputs (the module's Python attributes its class's
  methods name, e.g. ``self.scale``, a capacity factor; the globals and closure variables
  the function names) was frozen into the graph: a Python number or string that differs
  at a call is refused with the fix, a tensor is read again, as a buffer is
  (:func:`references`);
* the module hooks the capture ran (forward and pre-forward hooks of the module and its
  children, and the global ones) are part of the graph: a hook added or removed since
  is refused with the fix (:func:`hook_keys`);
* a parameter is bound by its name on every call (its current data); one of another
  shape, dtype or layout than at capture (``model.double()``, a new parallel plan) is
  refused with the fix;
* a forward that writes module state (``self.last = y``, ``self.calls += 1``) is not
  captured: the graph would not replay the write (``torch.compile`` does), so capture
  stops (:func:`state_writes`, the program then runs eagerly) and the module's
  attributes are put back as they were;
* the graph runs its ops through the dispatcher directly, so a torch-function mode the
  caller has on (``context_parallel``: attention as a ring) would not see them: a
  call under one is refused with the fix.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys as _sys
import types

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor

__all__ = ["module_tree", "check_module_tree", "training_flags", "check_training_flags",
           "tensor_attributes", "bind_attributes", "check_no_mode", "state_writes",
           "check_parameter", "references", "Frozen", "hook_keys", "check_hooks", "is_scalar",
           "snapshot"]


def module_tree(module: nn.Module) -> tuple:
    """(name, the submodule itself) for the module and every child: what the graph ran
    (the objects, held: an id alone could be a new module's at the same address)."""
    return tuple(module.named_modules(remove_duplicate=False))


def check_module_tree(module: nn.Module, captured: tuple) -> None:
    """Refuse a call after a submodule was added, removed or replaced (``m.act = Tanh()``:
    the graph still runs the ops of the one it captured)."""
    now = module_tree(module)
    if len(now) == len(captured) and all(a == b and m is n for (a, m), (b, n) in
                                         zip(now, captured)):
        return
    was, is_ = dict(captured), dict(now)
    changed = [f"{n or 'the module'} ({type(was[n]).__name__ if n in was else 'none'} -> "
               f"{type(is_[n]).__name__ if n in is_ else 'none'})"
               for n in list(was) + [n for n in is_ if n not in was]
               if was.get(n) is not is_.get(n)]
    raise ValueError("compiled program: submodules added, removed or replaced since capture: "
                     f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; the graph "
                     "runs the ops of the modules it captured: compile the module again")


def training_flags(module: nn.Module) -> tuple:
    """(submodule name, its ``training`` flag) for the module and every child."""
    return tuple((name, m.training) for name, m in module.named_modules())


def check_training_flags(module: nn.Module, captured: tuple) -> None:
    """Refuse a call in another train/eval mode than the capture's."""
    now = training_flags(module)
    if now == captured:
        return
    was = dict(captured)
    changed = [f"{name or 'the module'} ({'train' if was[name] else 'eval'} -> "
               f"{'train' if flag else 'eval'})" for name, flag in now
               if name in was and was[name] != flag]
    raise ValueError(
        "compiled program called with its module in another train/eval mode than at "
        f"capture: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; the graph "
        "keeps what the capture's mode did (dropout, branches on self.training): compile "
        "the module again in this mode (wb.compile after model.train() / model.eval()), or "
        "set the mode back")


def _key(t: torch.Tensor):
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


def tensor_attributes(module: nn.Module, consts: dict) -> dict:
    """{const vid: (submodule name, attribute)} for the constants of a captured graph that
    are the module's buffers or plain tensor attributes (found by their storage)."""
    where = {}
    for mname, mod in module.named_modules():
        named = list(mod._buffers.items()) + [
            (k, v) for k, v in vars(mod).items() if not k.startswith("_")]
        for attr, t in named:
            if type(t) is torch.Tensor and not t.is_meta and t.numel():
                where.setdefault(_key(t), (mname, attr))
    out = {}
    for vid, c in consts.items():
        if type(c) is torch.Tensor and not c.is_meta and c.numel() and _key(c) in where:
            out[vid] = where[_key(c)]
    return out


def bind_attributes(module: nn.Module, table: dict, values: list) -> dict:
    """{const vid: the module's tensor now} for :func:`tensor_attributes`' ``table``."""
    out = {}
    for vid, (mname, attr) in table.items():
        t = getattr(module.get_submodule(mname), attr, None)
        v = values[vid]
        full = f"{mname}.{attr}" if mname else attr
        if isinstance(t, DistTensor) or not isinstance(t, torch.Tensor) or \
                tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype:
            got = (f"{type(t).__name__} {tuple(t.shape)} {t.dtype}"
                   if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"compiled program: module tensor {full!r} was a "
                             f"{tuple(v.shape)} {v.dtype} tensor at capture and is now "
                             f"{got}; compile the module again")
        out[vid] = t.detach()
    return out


def check_no_mode() -> None:
    """Refuse a call under a torch-function mode (it would not see the graph's ops)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext     # ``with torch.device(...)``: harmless
    modes = [type(m).__name__ for m in _get_current_function_mode_stack()
             if not isinstance(m, DeviceContext)]
    if modes:
        raise NotImplementedError(
            f"compiled program called under {', '.join(modes)}: the graph runs its ops "
            "without torch-function modes, so it would not do what the mode asks (under "
            "context_parallel, attention would not run as a ring). Fix: call the function "
            "itself (eagerly) inside the mode, or the compiled program outside it")


_MISSING = object()


@contextlib.contextmanager
def state_writes(module):
    """Yields a list that collects "module.attr" for each attribute the code sets on
    ``module`` or a child while the block runs; every such attribute is put back after."""
    found: list = []
    if not isinstance(module, nn.Module):
        yield found
        return
    mods = {id(m): name for name, m in module.named_modules()}
    old, base = {}, nn.Module.__setattr__

    def watch(self, name, value):
        if id(self) in mods and not name.startswith("__") and name != "training":
            key = (id(self), name)
            if key not in old:
                old[key] = (self, getattr(self, name, _MISSING))
                where = mods[id(self)]
                found.append(f"{where}.{name}" if where else name)
        base(self, name, value)
    # containers the module holds (self.history.append(y)): their contents before
    boxes = [(f"{mname}.{k}" if mname else k, v, _contents(v))
             for mname, m in module.named_modules() for k, v in vars(m).items()
             if not k.startswith("__") and type(v) in (list, dict, set)]
    nn.Module.__setattr__ = watch
    try:
        yield found
    finally:
        nn.Module.__setattr__ = base
        for (_, name), (mod, was) in old.items():
            if was is _MISSING:
                mod.__dict__.pop(name, None)
            else:
                base(mod, name, was)
        for label, box, was in boxes:
            if _contents(box)[2] != was[2]:
                found.append(label)
                box.clear()
                if isinstance(box, dict):
                    box.update(was[1])
                elif isinstance(box, list):
                    box.extend(was[1])
                else:
                    box.update(was[1])


def _contents(box):
    """A container's contents, compared by identity (what a forward may have added)."""
    if isinstance(box, dict):
        items = dict(box)
        return ("dict", items, tuple((k, id(v)) for k, v in items.items()))
    items = list(box)
    return (type(box).__name__, items, tuple(id(v) for v in items))


def check_parameter(name: str, p, value, captured):
    """The module's parameter ``name`` now, if it is as captured (shape, dtype, layout)."""
    was = captured.placements if isinstance(captured, DistTensor) else \
        captured[1] if isinstance(captured, tuple) else ()
    now = tuple(p.placements) if isinstance(p, DistTensor) else ()
    if p is None or tuple(p.shape) != tuple(value.shape) or p.dtype != value.dtype or \
            tuple(now) != tuple(was):
        got = "gone" if p is None else f"{tuple(p.shape)} {p.dtype} {list(map(str, now))}"
        raise ValueError(f"compiled program: parameter {name!r} was {tuple(value.shape)} "
                         f"{value.dtype} {list(map(str, was))} at capture and is now {got}; "
                         "compile the module again")
    return p


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


_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, type, nn.Module)


class _Same:
    """An object compared by identity (and held: an id alone could be a new object's)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)

    def __repr__(self):
        return f"the same {type(self.obj).__name__}"


def snapshot(v, depth: int = 0, budget: list | None = None):
    """A comparable copy of a Python value the graph may hold what it read from: a
    number or string with its type (2 == 2.0, but int_tensor * 2 is an int tensor); a
    list, tuple, set or dict by its items; a dataclass by its fields; another object by
    its identity and its attributes (``cfg.scale``); a tensor inside one, a module, a
    function or a class by its identity.  Deep or large values are cut (identity)."""
    budget = [512] if budget is None else budget
    budget[0] -= 1
    if isinstance(v, (torch.Tensor, DistTensor)):
        return ("tensor", _Same(v))
    if is_scalar(v) and not isinstance(v, tuple):
        return ("value", type(v).__name__, v)
    if depth > 4 or budget[0] < 0 or isinstance(v, _OPAQUE):
        return ("object", type(v).__name__, _Same(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(snapshot(x, depth + 1, budget) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, snapshot(x, depth + 1, budget)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)) and all(is_scalar(x) for x in v):
        return (type(v).__name__, frozenset(v))
    if dataclasses.is_dataclass(v):
        return ("dataclass", type(v).__name__, tuple(
            (f.name, snapshot(getattr(v, f.name, None), depth + 1, budget))
            for f in dataclasses.fields(v)))
    if not hasattr(v, "__dict__"):
        return ("object", type(v).__name__, _Same(v))
    # (attributes the object's own calls write, named by its class's STATS_WRITES, as a
    # MoE layer's: no value the graph read; the expert-parallel dispatcher's
    # ``last_send_rows`` refused a compiled EP model's second call)
    own = getattr(type(v), "STATS_WRITES", ())
    return ("object", type(v).__name__, _Same(v), tuple(
        (k, snapshot(x, depth + 1, budget)) for k, x in sorted(vars(v).items())
        if k not in own))


class Frozen:
    """What a capture read through :func:`references`: Python values compared on every
    call (a container or an object by its :func:`snapshot`: ``self.cfg.scale``), tensors
    (constants of the graph) read again."""

    def __init__(self, fn, consts: dict):
        self.refs = references(fn)
        self.scalars, tensors = {}, {}
        self.objects: dict = {}                 # label -> snapshot at capture
        for label, get in self.refs.items():
            try:
                v = get()
            except ValueError:                  # an empty closure cell
                continue
            if is_scalar(v) or v is _MISSING:
                self.scalars[label] = v
            elif type(v) is torch.Tensor and not v.is_meta and v.numel():
                tensors.setdefault(_key(v), label)
            elif not isinstance(v, (torch.Tensor, DistTensor)) and v is not _MISSING:
                # (a function, a class or a module by its identity: ``self.act = torch.tanh``
                # after capture ran relu)
                self.objects[label] = snapshot(v)
        self.consts = {vid: tensors[_key(c)] for vid, c in consts.items()
                       if type(c) is torch.Tensor and not c.is_meta and c.numel()
                       and _key(c) in tensors}
        # a module the code reads from outside (a closure over a frozen ``nn.Linear``):
        # the graph's constants that are its parameters and buffers, read again on each
        # call by their names (was: ``lin.weight = nn.Parameter(...)`` after capture left
        # the graph multiplying by the old weight, silently)
        self.held: dict = {}                    # const vid -> (label, tensor name)
        # such a module's submodules, train/eval flags and hooks, as the compiled module's
        # own (was: ``seq[1] = nn.Tanh()`` or ``seq.eval()`` after capture ran ReLU and
        # dropout on, silently)
        self.modules: dict = {}                 # label -> (tree, flags, hooks) at capture
        owned = {}
        for label, get in self.refs.items():
            try:
                v = get()
            except ValueError:
                continue
            if isinstance(v, nn.Module):
                self.modules[label] = (module_tree(v), training_flags(v), hook_keys(v))
                for name, t in _module_tensors(v):
                    k = _tensor_key(t)
                    if k is not None:
                        owned.setdefault(k, (label, name))
        for vid, c in consts.items():
            k = _tensor_key(c)
            if vid not in self.consts and k is not None and k in owned:
                self.held[vid] = owned[k]

    def check(self, values: list) -> dict:
        """Refuse a changed Python value; {const vid: its tensor now}."""
        for label, was in self.scalars.items():
            now = self.refs[label]()
            if now is not was and not (type(now) is type(was) and now == was):
                shown = "gone" if now is _MISSING else repr(now)
                then = "absent" if was is _MISSING else repr(was)
                raise ValueError(f"compiled program: {label} was {then} at capture and is "
                                 f"now {shown}; the graph holds the value it read: compile "
                                 "again (or pass the value in as a tensor input)")
        for label, was in self.objects.items():
            if snapshot(self.refs[label]()) != was:
                raise ValueError(f"compiled program: {label} changed since capture (an "
                                 "item or attribute, or another object); the graph holds "
                                 "the values it read from it: compile again (or pass the "
                                 "value in as a tensor input)")
        out = {}
        for vid, label in self.consts.items():
            t, v = self.refs[label](), values[vid]
            if type(t) is not torch.Tensor or tuple(t.shape) != tuple(v.shape) or \
                    t.dtype != v.dtype:
                raise ValueError(f"compiled program: {label} was a {tuple(v.shape)} "
                                 f"{v.dtype} tensor at capture and is now "
                                 f"{type(t).__name__}; compile again")
            out[vid] = t.detach()
        for label, (tree, flags, hooks) in self.modules.items():
            mod = self.refs[label]()
            if not isinstance(mod, nn.Module):
                continue                        # (another object: its snapshot said so)
            try:
                check_module_tree(mod, tree)
                check_training_flags(mod, flags)
                check_hooks(mod, hooks)
            except ValueError as e:
                raise ValueError(f"compiled program: the module {label} the code reads "
                                 f"changed since capture: {str(e).split(': ', 1)[-1]}") from None
        for vid, (label, name) in self.held.items():
            mod, v = self.refs[label](), values[vid]
            t = dict(_module_tensors(mod)).get(name) if isinstance(mod, nn.Module) else None
            if not isinstance(t, (torch.Tensor, DistTensor)) or \
                    tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype or t.requires_grad:
                now = "gone" if t is None else (
                    f"a {tuple(t.shape)} {t.dtype} {type(t).__name__}"
                    + (" that requires grad" if t.requires_grad else ""))
                raise ValueError(f"compiled program: {label}'s {name} was a {tuple(v.shape)} "
                                 f"{v.dtype} tensor at capture (a constant of the graph) and is "
                                 f"now {now}; compile again (or compile the module itself)")
            out[vid] = t.detach()
        return out


def _module_tensors(module):
    """(name, tensor) of a module's parameters and buffers, tied ones under each name."""
    for mname, mod in module.named_modules(remove_duplicate=False):
        for where in (mod._parameters, mod._buffers):
            for n, t in where.items():
                if t is not None:
                    yield (f"{mname}.{n}" if mname else n), t


def _tensor_key(t):
    """The storage key of a plain tensor, or of a DistTensor's first local tensor (a
    constant holds ``t.detach()``: the same storage, another object)."""
    if isinstance(t, DistTensor):
        from ..parallel import storage
        ts = storage.tensors(t._local)
        t = ts[0] if ts else None
    if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():   # (a Parameter too)
        return _key(t)
    return None


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_keys(module) -> tuple:
    """The hooks a call of ``module`` runs: per submodule and globally, their handles' ids."""
    from torch.nn.modules import module as M
    glob = tuple(tuple(getattr(M, f"_global{h}", {})) for h in _HOOKS)
    if not isinstance(module, nn.Module):
        return (glob,)
    return (glob,) + tuple((name, tuple(tuple(getattr(m, h, {})) for h in _HOOKS))
                           for name, m in module.named_modules())


def check_hooks(module, captured: tuple) -> None:
    """Refuse a call after a module hook was added or removed (the graph ran the old ones)."""
    now = hook_keys(module)
    if now == captured:
        return
    was = dict(captured[1:])
    where = ["global module hooks"] if now[0] != captured[0] else []
    where += [repr(name) if name else "the module" for name, keys in now[1:]
              if was.get(name) != keys]
    raise ValueError(f"compiled program: hooks added or removed since capture on "
                     f"{', '.join(where[:4])}; the graph holds what the hooks at capture "
                     "did: compile again with the hooks you want")
