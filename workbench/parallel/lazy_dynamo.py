"""``torch.optim`` in eager mode without importing ``torch._dynamo``.

torch's optimizers guard their methods against ``torch.compile`` tracing: ``step`` is
wrapped by ``_use_grad_for_differentiable``, whose wrapper runs ``import torch._dynamo``
and ``torch._dynamo.graph_break()`` on every call, and ``add_param_group`` (so the
constructor), ``zero_grad``, ``state_dict`` and ``load_state_dict`` by
``torch._disable_dynamo``, which imports ``torch._dynamo`` on its first call to build
``torch._dynamo.disable(fn)`` (torch 2.13 ``torch/optim/optimizer.py``: ``_use_grad``,
``@torch._disable_dynamo``; ``torch/_compile.py``: ``_disable_dynamo``).  So the first
optimizer made in a process imports the whole compiler stack (dynamo, sympy, the fx
symbolic shapes): 1.0-1.2 s of CPU, about what ``import torch`` itself costs (measured,
``python -c "import workbench; import torch._dynamo"`` split with ``time.process_time``,
1.04-1.16 s over five runs on this project's 2-core machine) -- paid by every torchrun
worker, notebook kernel and subprocess that trains anything, none of which compiles.

Nothing can be compiling while ``torch._dynamo`` was never imported (``torch.compile``
and ``torch.export`` import it before they trace), and both guards only matter under
tracing: ``graph_break()`` does nothing in eager mode and ``disable(fn)`` runs ``fn``
with no frame callback to remove.  So, while ``"torch._dynamo"`` is not in
``sys.modules``, each guarded call here runs what torch's guard runs in eager mode and
nothing more:

* a ``_use_grad`` step (every torch.optim class's): grad mode set to the group defaults'
  ``differentiable`` around the undecorated step, restored after (as ``_use_grad``
  does); the class's ``step`` is replaced by :func:`_lazy_step`;
* a ``torch._disable_dynamo`` function: torch's wrapper reads its
  ``torch._dynamo.disable(fn)`` from ``fn.__dynamo_disable`` before importing dynamo to
  build one, so a stand-in that calls ``fn`` is put there (:func:`_seed`); the functions
  are torch's own objects, unchanged.  Seeded: those reachable from torch.optim, from
  torch's Python references and decompositions, which run as the meta kernels of many
  ops (the dispatcher's shape checks on meta tensors), and DTensor's; every
  TorchDispatchMode subclass's ``__torch_dispatch__`` (FlopCounterMode's...); and
  whatever ``torch._disable_dynamo`` guards after this is installed (:func:`_seeding`:
  a dispatch mode made later, as the planner's meta run).

Once ``torch._dynamo`` is imported (anything compiled in this process, before or
after), every call goes through torch's own guard, unchanged: the stand-in removes
itself and torch builds its own.  Only functions whose code is exactly torch's guard's
(checked by code object: another torch that changes the guards is left alone) are
touched.  Still imported by torch itself in eager mode: the non-reentrant
``torch.utils.checkpoint`` (reads ``torch._dynamo.config``) and torch's own DDP
constructor (``get_optimize_ddp_mode``).
"""
from __future__ import annotations

import functools
import sys
import types

import torch
import torch.optim
from torch.optim.optimizer import Optimizer, _use_grad_for_differentiable

__all__ = ["install"]

_DYNAMO = "torch._dynamo"
_CACHE = "__dynamo_disable"      # torch/_compile.py: _disable_dynamo's per-function cache
# the modules whose guarded functions the eager paths here meet: torch.optim's methods,
# torch's Python references and decompositions, which run as the meta kernels of many
# ops (the dispatcher's shape checks on meta tensors), DTensor's constructor.  Not
# torch.utils.checkpoint: its non-reentrant checkpoint reads torch._dynamo.config itself
# (torch 2.13 torch/utils/checkpoint.py, _checkpoint_without_reentrant_generator), so a
# run with recompute imports torch._dynamo whatever is done here; so does torch's own
# DDP constructor (torch/nn/parallel/distributed.py: get_optimize_ddp_mode).
_MODULES = ("torch.optim", "torch._refs", "torch._prims", "torch._decomp",
            "torch._meta_registrations", "torch.distributed.tensor")


def _code_of_use_grad():
    return _use_grad_for_differentiable(lambda self: None).__code__


def _code_of_disable():
    return getattr(torch._disable_dynamo, "_wb_eager", torch._disable_dynamo)(
        lambda: None).__code__


def _lazy_step(guarded):
    """``guarded`` (a torch optimizer's ``_use_grad`` step) without the dynamo import
    while nothing can be compiling."""
    raw = guarded.__wrapped__

    @functools.wraps(guarded)
    def step(self, *args, **kwargs):
        if _DYNAMO in sys.modules:
            return guarded(self, *args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)
    step._wb_eager = guarded
    return step


def _seed(guarded) -> bool:
    """``guarded`` (a ``torch._disable_dynamo`` wrapper) calls its function directly while
    nothing can be compiling: torch's wrapper looks its ``torch._dynamo.disable(fn)`` up
    in ``fn.__dynamo_disable`` before importing ``torch._dynamo`` to build one, so a
    stand-in is put there; once ``torch._dynamo`` is imported the stand-in removes itself
    and calls ``guarded`` again, which builds and keeps torch's own."""
    cells = dict(zip(guarded.__code__.co_freevars, guarded.__closure__ or ()))
    try:
        fn = cells["fn"].cell_contents
    except (KeyError, ValueError):
        return False
    if getattr(fn, _CACHE, None) is not None:
        return False                    # torch's own already built (or seeded before)

    def stand_in(*args, **kwargs):
        if _DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        if fn.__dict__.get(_CACHE) is stand_in:
            fn.__dict__.pop(_CACHE, None)
        return guarded(*args, **kwargs)
    setattr(fn, _CACHE, stand_in)
    return True


def _guarded_functions(code) -> list:
    """Every function with ``code`` (torch's guard wrapper) reachable from the functions
    and classes of :data:`_MODULES`: through decorators' ``__wrapped__`` and closures."""
    found, seen = [], set()
    todo = [v for name, m in list(sys.modules.items())
            if m is not None and name.startswith(_MODULES) for v in vars(m).values()]
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        kind = type(v)                   # not isinstance: no attribute read on odd objects
        if kind is types.FunctionType:
            if v.__code__ is code:
                found.append(v)
            for c in v.__closure__ or ():
                try:
                    todo.append(c.cell_contents)
                except ValueError:           # an empty cell
                    pass
            if "__wrapped__" in v.__dict__:
                todo.append(v.__dict__["__wrapped__"])
        elif kind is type and v.__module__.startswith(_MODULES):
            todo.extend(vars(v).values())
    return found


def _seeding(orig, code):
    """``torch._disable_dynamo`` that seeds what it makes (:func:`_seed`): the functions
    torch guards after this is installed (a ``TorchDispatchMode`` subclass's
    ``__torch_dispatch__``, wrapped when the class is made, as FlopCounterMode's and the
    planner's meta run's; a custom op's kernel)."""
    @functools.wraps(orig)
    def _disable_dynamo(fn=None, recursive=True):
        if fn is None:                   # @torch._disable_dynamo(recursive=False)
            return functools.partial(_disable_dynamo, recursive=recursive)
        out = orig(fn, recursive)
        if type(out) is types.FunctionType and out.__code__ is code:
            _seed(out)
        return out
    _disable_dynamo._wb_eager = orig
    return _disable_dynamo


def _dispatch_modes() -> list:
    """``__torch_dispatch__`` of every TorchDispatchMode subclass made so far."""
    from torch.utils._python_dispatch import TorchDispatchMode
    out, todo, seen = [], [TorchDispatchMode], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        f = cls.__dict__.get("__torch_dispatch__")
        if type(f) is types.FunctionType:
            out.append(f)
    return out


def install() -> None:
    """Put the stand-ins in (idempotent; before :mod:`.optim_dist` wraps its own methods
    around torch's)."""
    use_grad, code = _code_of_use_grad(), _code_of_disable()
    if not hasattr(torch._disable_dynamo, "_wb_eager"):
        torch._disable_dynamo = _seeding(torch._disable_dynamo, code)
    seen = set()
    todo = [Optimizer]
    while todo:                          # torch.optim's classes: their _use_grad steps
        cls = todo.pop()
        if cls in seen or not cls.__module__.startswith("torch.optim"):
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        f = vars(cls).get("step")
        if f is not None and getattr(f, "__code__", None) is use_grad and \
                "__wrapped__" in f.__dict__:
            cls.step = _lazy_step(f)
    for f in _guarded_functions(code) + _dispatch_modes():
        if f.__code__ is code:
            _seed(f)
