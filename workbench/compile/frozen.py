"""What a capture holds fixed from what its code read (:class:`Frozen`): Python values
compared on every call through their :func:`snapshot`, tensors and modules the code reads
from outside read again and checked."""
from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor
from .guard_module import check_hooks, check_module_tree, check_training_flags, hook_keys, \
    module_tree, training_flags
from .guard_tensors import _key, _module_tensors, _tensor_key
from .references import _MISSING, is_scalar, references


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
