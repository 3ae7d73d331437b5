"""The captured program: values (tensors, each with a global shape and dtype) and the
ops between them, in program order, each op an entry of the op table
(``parallel/ops_table``) called with the same arguments the user's code gave it.

A :class:`Value` is one tensor: a user input, a parameter (by its name in the module),
a constant (a buffer or a tensor the code made without inputs: it is replicated, as the
dispatcher treats a plain tensor) or the output of an op.  A :class:`Node` is one call:
the op table's name, the torch callable, its arguments with :class:`Ref` in place of each
traced tensor, the tensor inputs as the op's rule sees them (``parse``), the attributes,
and the source line that made it.  Nothing here holds data but the constants.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Ref", "Value", "Node", "Graph", "GraphBreak", "map_refs", "same_tuple"]


@dataclass(frozen=True)
class Ref:
    """A traced tensor in a node's arguments: value number ``vid``."""
    vid: int

    def __repr__(self):
        return f"%{self.vid}"


@dataclass
class Value:
    vid: int
    shape: torch.Size
    dtype: torch.dtype
    kind: str                   # "input" | "param" | "const" | "op" | "fresh" (made by
                                # the op's parse on each call: a dropout mask)
    name: str                   # input position / parameter name / op output name
    producer: int | None = None  # the node that makes it (kind "op")
    requires_grad: bool = False


@dataclass
class Node:
    nid: int
    op: str                     # the op table's name
    func: Any                   # the torch callable the code called
    args: tuple                 # the call's arguments, traced tensors as Ref
    kwargs: dict
    inputs: tuple               # per rule input: a value number, or None (not a tensor)
    attrs: dict                 # the rule's attributes (from the entry's parse)
    outs: tuple                 # value numbers of the outputs
    out_tree: Any               # the result's structure, outputs as Ref
    source: str = ""            # "file:line  code" of the call
    note: str = ""              # what a pass did to it
    in_consts: tuple = ()       # per rule input: the non-tensor value (None for tensors)
    grad: bool = True           # False: called under torch.no_grad() in the program (the
                                # run calls it so too: no gradient flows through it)
    amp: Any = None             # torch.autocast's dtype where the call ran under CPU autocast
                                # (traced: the run calls it so too); None: without

    @property
    def name(self) -> str:
        return f"{self.op}_{self.nid}"


@dataclass(frozen=True)
class GraphBreak:
    """Code capture cannot follow (data-dependent control flow): where and why."""
    reason: str
    file: str
    line: int
    code: str

    def __str__(self):
        return f"graph break at {_short(self.file)}:{self.line}  {self.code}\n  ({self.reason})"


def _short(path: str) -> str:
    """A notebook cell's file (``/tmp/ipykernel_<pid>/<hash>.py``, new in every kernel) as
    ``<cell>``; other files as they are."""
    import re
    return "<cell>" if re.search(r"ipykernel_\d+/\d+\.py$", path or "") else path


@dataclass
class Graph:
    values: list = field(default_factory=list)      # Value, by vid
    nodes: list = field(default_factory=list)       # Node, in program order
    inputs: list = field(default_factory=list)      # vids of the user inputs, in order
    params: dict = field(default_factory=dict)      # parameter name -> vid
    consts: dict = field(default_factory=dict)      # vid -> the constant tensor (data)
    output: Any = None                              # the result's structure, tensors as Ref
    method: str = ""                                # "export" or "trace"
    notes: list = field(default_factory=list)       # what capture had to say
    held: dict = field(default_factory=dict)        # const vid -> (its value, why): what a
                                                    # pass relied on, checked on each call
    stats_layers: list = field(default_factory=list)  # the layers given each router_topk
                                                    # node's routing on each call, in order
                                                    # (models.moe.MoE.record_stats)
    pins: dict = field(default_factory=dict)        # vid -> (mesh, placements, where):
                                                    # the program's t.redistribute (tracer)
    vias: dict = field(default_factory=dict)        # pinned vid -> (other mesh, placements):
                                                    # a round trip there and back
                                                    # (mesh_trips.py)
    autograd_reads: set = field(default_factory=set)  # what the code asked of autograd
                                                    # (reads.py): guarded on each call
    replica_dims: dict = field(default_factory=dict)  # param vid -> the mesh dims it is
                                                    # held once per rank along (replicated;
                                                    # its gradient reduced by the optimizer:
                                                    # program.replica_dims)

    def value(self, shape, dtype, kind, name, producer=None, requires_grad=False) -> int:
        v = Value(len(self.values), torch.Size(shape), dtype, kind, name, producer,
                  requires_grad)
        self.values.append(v)
        return v.vid

    def consumers(self) -> dict:
        """vid -> [node ids that read it]."""
        out = {v.vid: [] for v in self.values}
        for n in self.nodes:
            for vid in set(i for i in n.inputs if i is not None):
                out[vid].append(n.nid)
        return out

    def output_vids(self) -> list:
        found = []
        map_refs(self.output, lambda r: found.append(r.vid) or r)
        return found

    def copy(self) -> "Graph":
        import copy
        g = copy.copy(self)
        g.values = [copy.copy(v) for v in self.values]
        g.nodes = [copy.copy(n) for n in self.nodes]
        g.notes = list(self.notes)
        g.held = dict(self.held)
        return g

    def __str__(self) -> str:
        lines = [f"graph ({self.method}): {len(self.nodes)} ops, "
                 f"{len(self.inputs)} inputs, {len(self.params)} parameters"]
        for v in self.values:
            if v.kind != "op":
                lines.append(f"  %{v.vid} = {v.kind} {v.name} {tuple(v.shape)} "
                             f"{str(v.dtype).replace('torch.', '')}")
        for n in self.nodes:
            ins = ", ".join("-" if i is None else f"%{i}" for i in n.inputs)
            outs = ", ".join(f"%{o}" for o in n.outs)
            shp = ", ".join(str(tuple(self.values[o].shape)) for o in n.outs)
            lines.append(f"  {outs} = {n.op}({ins}) {shp}"
                         + ("  [no_grad]" if not n.grad else "")
                         + (f"  # {n.note}" if n.note else ""))
        lines.append(f"  return {self.output}")
        return "\n".join(lines)


def same_tuple(tree: tuple, vals):
    """``vals`` as a tuple of ``tree``'s kind: a namedtuple's, or a structseq's
    (``torch.return_types.max``: ``.values`` / ``.indices``, as eager returns it), else a
    plain tuple."""
    if hasattr(tree, "_fields"):
        return type(tree)(*vals)
    if hasattr(type(tree), "n_fields"):          # a structseq takes one sequence
        return type(tree)(list(vals))
    return tuple(vals)


def map_refs(tree, fn):
    """``tree`` with every :class:`Ref` replaced by ``fn(ref)`` (tuples, lists, dicts)."""
    if isinstance(tree, Ref):
        return fn(tree)
    if isinstance(tree, tuple):
        return same_tuple(tree, [map_refs(x, fn) for x in tree])
    if isinstance(tree, list):
        return [map_refs(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: map_refs(x, fn) for k, x in tree.items()}
    if isinstance(tree, slice):
        return slice(map_refs(tree.start, fn), map_refs(tree.stop, fn), map_refs(tree.step, fn))
    return tree
