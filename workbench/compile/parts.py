"""A module whose forward breaks the graph: the break falls back to eager, its children
are compiled on their own.

``torch.compile`` splits a function at a graph break and compiles the pieces around it;
here the unit is the module: the forward that holds the break runs eagerly (op by op
through the dispatcher), and each child module it calls is captured and compiled with
the inputs it received (found by running the forward once, eagerly, with hooks), down to
the children whose own forward breaks again.  That run leaves no mark: it records no
trace events and puts back the random generator and the module's buffers.  A child
called with keyword arguments stays eager (its hook cannot see them), as does one the
forward calls twice with inputs of other shapes, layouts or values (one capture answers
for one signature).
"""
from __future__ import annotations

import contextlib

import torch

from ..parallel.dist_tensor import DistTensor

__all__ = ["compile_children", "swapped"]


def compile_children(module, args, make):
    """{child name: compiled program} for the children ``module(*args)`` calls;
    ``make(child, child_args)`` compiles one.  Runs ``module`` once, eagerly."""
    seen, outs, hooks = {}, {}, []
    from .program import _signature
    for name, child in module.named_children():
        def hook(m, a, kw, name=name):
            if name not in seen:
                seen[name] = None if kw else a
            elif seen[name] is not None and (
                    kw or [_signature(x) for x in a] != [_signature(x) for x in seen[name]]):
                seen[name] = None       # called again with other inputs: it stays eager

        def after(m, a, out, name=name):
            outs.setdefault(name, out)
        # first, before the child's own pre-hooks: the call's inputs as the parent gave
        # them (the child's program runs its hooks itself, as its capture did)
        hooks.append(child.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
        hooks.append(child.register_forward_hook(after))
    # the run only finds the children's inputs: it leaves no mark (no trace events, the
    # random generator and the buffers as they were, as the capture on meta tensors)
    from ..sim_mesh.trace import suspend
    bufs = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with suspend(), torch.random.fork_rng(devices=[]):
            module(*args)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for b, was in bufs:
                b.copy_(was)
    # each part hands its output on in eager's layout (pinned), so that the eager code
    # between the parts sees what it saw when it ran op by op
    return {name: make(module.get_submodule(name), a,
                       {"output": list(outs[name].placements)}
                       if isinstance(outs.get(name), DistTensor) else None)
            for name, a in seen.items() if a is not None}


@contextlib.contextmanager
def swapped(module, parts):
    """Each compiled child answers for the child while the parent runs: it takes the
    child's place among the parent's submodules, so that ``self.child(x)`` calls the
    program, whose graph holds the child's hooks (the child's own ``__call__`` around it
    would run them a second time: 446 off on a probe with a forward hook)."""
    saved = {name: module._modules[name] for name in parts}
    for name, prog in parts.items():
        module._modules[name] = prog
    try:
        yield
    finally:
        for name, child in saved.items():
            module._modules[name] = child
