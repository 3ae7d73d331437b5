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

The guards live beside this module, which keeps their import path: the module's tree,
flags and hooks (:mod:`.guard_module`), the tensors bound by name (:mod:`.guard_tensors`),
what the code reads (:mod:`.references`) and what a capture holds fixed from it
(:mod:`.frozen`); a call under a torch-function mode and the forward's writes of module
state are refused here.
"""
from __future__ import annotations

import contextlib

from torch import nn

from .frozen import Frozen, snapshot
from .guard_module import (check_hooks, check_module_tree, check_training_flags, hook_keys,
                           module_tree, training_flags)
from .guard_tensors import bind_attributes, check_parameter, tensor_attributes
from .references import _MISSING, _functions_of, _user_functions, is_scalar, references

__all__ = ["module_tree", "check_module_tree", "training_flags", "check_training_flags",
           "tensor_attributes", "bind_attributes", "check_no_mode", "state_writes",
           "check_parameter", "references", "Frozen", "hook_keys", "check_hooks", "is_scalar",
           "snapshot"]


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
