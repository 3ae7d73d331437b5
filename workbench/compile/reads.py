"""What a program's Python code asks of autograd, of the random generator and of its own
Python state while it is captured: things a graph cannot hold.

``torch.compile`` guards a frame on each input tensor's ``requires_grad`` and on the grad
mode (TorchDynamo's TENSOR_MATCH and GLOBAL_STATE guards) and recompiles when one changes.
A :class:`~.program.CompiledProgram` holds one capture, so:

* **autograd state read** (:func:`autograd_reads`): code that reads ``x.requires_grad``,
  ``x.is_leaf``, ``x.grad`` or ``x.grad_fn`` of a traced tensor, or asks
  ``torch.is_grad_enabled()``, may branch on it (``x * 2 if x.requires_grad else x``);
  the capture's answer is then a guard: a call whose inputs, parameters or grad mode
  answer otherwise is refused with the fix (:func:`autograd_state`), never run down the
  captured branch.  Code that reads none of them is not guarded: a program captured from
  an input without gradients runs for one with them, as its ops do eagerly.
* **the random generator reseeded** (``torch.manual_seed(0)`` inside the program): each
  eager call restarts the draws, the graph would draw on from wherever the generator is;
  capture stops and the program runs eagerly.
* **Python state written** (a global or closure counter, ``CALLS[0] += 1``): the graph
  would not repeat the write; capture stops, the values are put back as they were before
  the capture ran, and the program runs eagerly (as ``guards.state_writes`` does for a
  module's attributes).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["amp_state", "from_library", "autograd_reads", "autograd_state",
           "describe_change", "rng_reseeds_refused", "python_writes", "TENSOR_READS"]

_T = torch.Tensor
# the tensor attributes whose answer a Python branch may follow (their getters, as a
# torch-function mode sees them)
TENSOR_READS = {_T.requires_grad.__get__: "requires_grad", _T.is_leaf.__get__: "is_leaf",
                _T.grad.__get__: "grad", _T.grad_fn.__get__: "grad_fn"}
_TORCH = os.path.dirname(torch.__file__)
_LIB = tuple(os.path.join(os.path.dirname(os.path.dirname(__file__)), d)
             for d in ("compile", "parallel", "sim_mesh"))


def from_library(depth: int, through_torch: bool = True) -> bool:
    """True when the code that asked (the frame ``depth`` up; with ``through_torch`` the
    first one outside torch from there: a tensor attribute's getter reaches a mode through
    torch's frames) is torch's or workbench's machinery, not the program's own code nor a
    model's (``torch.enable_grad()`` asks the grad mode itself: not the program)."""
    f = sys._getframe(depth + 1)
    while through_torch and f is not None and (
            os.path.abspath(f.f_code.co_filename).startswith(_TORCH) or
            "/contextlib.py" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return True
    name = os.path.abspath(f.f_code.co_filename)
    return name.startswith(_TORCH) or name.startswith(_LIB) or "/contextlib.py" in name


class _Watch(TorchFunctionMode):
    """Notes which of :data:`TENSOR_READS` the program asks of a tensor (under export)."""

    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = TENSOR_READS.get(func)
        if what is not None and not from_library(1):
            self.seen.add(what)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def autograd_reads():
    """Yields ``(seen, watch)``: ``seen`` collects what the program asked of autograd
    ("requires_grad", "is_leaf", "grad", "grad_fn" of a tensor, "grad mode" for a call of
    ``torch.is_grad_enabled()`` from outside torch's and workbench's machinery);
    ``watch()`` is a torch-function mode that notes the tensor reads (the trace's own mode
    notes them itself)."""
    seen: set = set()
    orig = torch.is_grad_enabled

    def is_grad_enabled():
        if not from_library(1, through_torch=False):
            seen.add("grad mode")
        return orig()
    torch.is_grad_enabled = is_grad_enabled
    try:
        yield seen, lambda: _Watch(seen)
    finally:
        torch.is_grad_enabled = orig


def autograd_state(args, module) -> tuple:
    """What a call's autograd looks like, for the guard of a program that read it: each
    tensor input's (requires_grad, is_leaf, grad is None), each parameter's
    requires_grad, and the grad mode."""
    from ..parallel.dist_tensor import DistTensor
    ins = tuple((i, bool(a.requires_grad), bool(a.is_leaf), a.grad is None)
                for i, a in enumerate(args) if isinstance(a, (torch.Tensor, DistTensor)))
    params = () if module is None else tuple(
        (n, bool(p.requires_grad)) for n, p in module.named_parameters())
    return ins, params, torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def describe_change(was: tuple, now: tuple) -> str:
    """What differs between two :func:`autograd_state` answers, in words."""
    out = []
    for a, b in zip(was[0], now[0]):
        for k, name in ((1, "requires_grad"), (2, "is_leaf"), (3, "grad is None")):
            if a[k] != b[k]:
                out.append(f"argument {a[0]}'s {name} was {a[k]} and is {b[k]}")
    for a, b in zip(was[1], now[1]):
        if a != b:
            out.append(f"parameter {a[0]}'s requires_grad was {a[1]} and is {b[1]}")
    if was[2] != now[2]:
        out.append(f"gradients were {'on' if was[2] else 'off'} at capture and are "
                   f"{'on' if now[2] else 'off'} now")
    return "; ".join(out[:3]) + (" ..." if len(out) > 3 else "")


def amp_state():
    """The CPU autocast dtype now (``torch.autocast("cpu", ...)``), or None when it is off.
    A traced op records it and runs under it (an autocast region inside the program: the
    graph's matmul ran in float32 where eager's ran in bfloat16, 0.04 off); a compiled
    program is called under the autocast state of its capture (TorchDynamo guards the
    same global state), or refused."""
    if not torch.is_autocast_enabled("cpu"):
        return None
    return torch.get_autocast_dtype("cpu")


_SEEDS = ("manual_seed", "seed", "set_rng_state")


@contextlib.contextmanager
def rng_reseeds_refused(error):
    """While the block runs: the program's own call of ``torch.manual_seed`` /
    ``torch.seed`` / ``torch.set_rng_state`` (or ``torch.random``'s) raises ``error(name,
    where)`` (torch's and workbench's machinery pass: ``fork_rng`` restores a state)."""
    import torch.random as trandom
    saved = []
    for mod in (torch, trandom):
        for name in _SEEDS:
            orig = getattr(mod, name)

            def refuse(*a, _orig=orig, _name=name, **k):
                if not from_library(1, through_torch=False):
                    raise error(_name)
                return _orig(*a, **k)
            saved.append((mod, name, orig))
            setattr(mod, name, refuse)
    try:
        yield
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)


@contextlib.contextmanager
def python_writes(fn):
    """Yields a list that collects the globals and closure variables the program's code
    names (``guards.references``) whose value changed while the block ran (a counter, an
    item of a list or dict); each is put back as it was (a global or closure rebound, a
    list's, dict's or set's items restored)."""
    from .guards import references, snapshot
    refs = {label: get for label, get in references(fn).items()
            if label.startswith(("global ", "closure variable "))}
    before = {}
    for label, get in refs.items():
        try:
            v = get()
        except ValueError:                      # an empty closure cell
            continue
        items = list(v.items()) if isinstance(v, dict) else \
            list(v) if isinstance(v, (list, set)) else None
        before[label] = (v, snapshot(v), items)
    found: list = []
    try:
        yield found
    finally:
        for label, (v, snap, items) in before.items():
            try:
                now = refs[label]()
            except ValueError:
                now = None
            if now is v and snapshot(now) == snap:
                continue
            found.append(label.split(" ", 1)[1] if label.startswith("global ") else
                         label.split(" ", 2)[2])
            _put_back(fn, label, v, items)


def _put_back(fn, label, v, items):
    """Rebind ``label`` (a global or closure variable of ``fn``'s code) to ``v`` and give a
    container its items back."""
    from .guards import _user_functions
    name = label.split()[-1]
    funcs = []
    if isinstance(fn, torch.nn.Module):
        from .guards import _functions_of
        for m in fn.modules():
            for f in _functions_of(type(m)):
                funcs += list(_user_functions(f, {}).values())
    else:
        f = getattr(fn, "__func__", fn)
        if not hasattr(f, "__code__"):
            f = getattr(type(fn), "__call__", None)
        funcs = list(_user_functions(f, {}).values()) if hasattr(f, "__code__") else []
    for h in funcs:
        if label.startswith("global ") and name in h.__globals__:
            h.__globals__[name] = v
        for n, cell in zip(h.__code__.co_freevars, h.__closure__ or ()):
            if n == name and label.startswith("closure variable "):
                cell.cell_contents = v
    if items is not None:
        if isinstance(v, dict):
            v.clear()
            v.update(items)
        elif isinstance(v, list):
            v[:] = items
        elif isinstance(v, set):
            v.clear()
            v.update(items)
