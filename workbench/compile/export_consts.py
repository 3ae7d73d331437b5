"""The constants of an exported graph: buffers and lifted tensors, and views of them.

``torch.export`` lists a program's buffers (and the tensors it lifts) as placeholders
before its inputs.  Capture numbers the values as tracing does (the inputs, the
parameters, then each constant where an op first reads it) and, as tracing does, folds a
view of a constant (``self.rope_cos[:S]``: ``aten.slice`` of a buffer) into a constant:
the same memory as the buffer, so a later in-place update of it is still read.
"""
from __future__ import annotations

import torch

from .graph import Ref

__all__ = ["Const", "Env", "view_of_const", "node_args"]


class Const:
    """A constant of the graph (a buffer, a lifted tensor, a view of one), registered as a
    value where an op first reads it, as tracing numbers it; one buffer is one value
    (``key``: its id, ``vids``: id -> vid)."""

    def __init__(self, g, metas, vids, data, name, key=None):
        self.g, self.metas, self.vids, self.data, self.name, self.key = \
            g, metas, vids, data, name, key

    def __call__(self) -> Ref:
        if self.key is not None and self.key in self.vids:
            return Ref(self.vids[self.key])
        vid = self.g.value(self.data.shape, self.data.dtype, "const", self.name)
        self.g.consts[vid] = self.data
        self.metas[vid] = torch.empty(self.data.shape, dtype=self.data.dtype, device="meta")
        if self.key is not None:
            self.vids[self.key] = vid
        return Ref(vid)


class Env(dict):
    """fx node name -> Ref (or tuple of Refs); a constant not read yet is in ``later``
    (name -> :class:`Const`), made a value when first read."""

    def __init__(self):
        super().__init__()
        self.later = {}

    def __missing__(self, name):
        ref = self[name] = self.later.pop(name)()
        return ref


def view_of_const(g, node, env, metas, adapt) -> bool:
    """A view of a constant (``self.rope_cos[:S]``: aten.slice of a buffer) is a constant
    of the graph, the same memory as the buffer (a later in-place update of the buffer is
    seen, as the program sees it), as tracing makes it: True when ``node`` is one (then
    ``env.later`` holds it)."""
    ins = node.all_input_nodes
    ad = adapt.get(node.target)
    if len(ins) != 1 or ins[0].name not in env.later or ad is None:
        return False
    base = env.later[ins[0].name]
    args, kwargs = node_args(node, _Data(env, base.data, ins[0].name))
    func, args, kwargs = ad(args, kwargs)
    try:
        with torch.no_grad():
            out = func(*args, **kwargs)
    except Exception:                 # noqa: BLE001 (mapped as an op, which reports it)
        return False
    if not isinstance(out, torch.Tensor) or \
            out.untyped_storage().data_ptr() != base.data.untyped_storage().data_ptr():
        return False                        # computed: an op of the graph, run on each call
    env.later[node.name] = Const(g, metas, {}, out, f"{base.name} ({node.name})")
    return True


class _Data(dict):
    """``env`` for :func:`node_args` with one pending constant read as its data."""

    def __init__(self, env, data, name):
        super().__init__()
        self.env, self.data, self.name = env, data, name

    def __missing__(self, name):
        return self.data if name == self.name else self.env[name]


def node_args(node, env):
    """An fx node's (args, kwargs), each fx node in them replaced by its Ref(s)."""
    def sub(x):
        if hasattr(x, "name") and hasattr(x, "op"):      # an fx node
            return env[x.name]
        if isinstance(x, (list, tuple)):
            return type(x)(sub(y) for y in x)
        return x
    return sub(tuple(node.args)), {k: sub(v) for k, v in node.kwargs.items()}
