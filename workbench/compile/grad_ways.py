"""The gradient reductions of a compiled step: one per input and layout, as eager records.

Where ops give every rank a view of a tensor held once along a mesh dim (replicated, or
gathered by a reshard), eager records the gradient's way back once per tensor, after its
readers' backward, as the reshard planner's plan from the summed Partial gradient back to
the tensor's layout (``workbench/parallel/reshard_backward.py``: ``gather`` for a tensor
read as it is, ``mark`` for a reshard's gathered result, whose gradient goes back to the
source's ``S(d)``: a reduce-scatter, not an all-reduce of the gathered bytes).  PyTorch
DTensor does the same: autograd sums the readers' Partial gradients (``P + P -> P``) and
one redistribution brings the sum back (torch 2.13, git cf30153,
torch/distributed/tensor/_redistribute.py:1771-1862).

The compiled program runs through the same dispatcher (``lower.execute_program`` marks
its reshards as ``wb.reshard`` does), and :class:`GradWays` prices what that run records:
the readers of one tensor (a value in one layout, made by the same reshard, by the same
gather run again for another reader as O0 keeps it, or by none) are grouped; the group's
steps are emitted with the backward of its first reader in forward order (the last to
run in backward, where autograd has summed them).  Assumed, as the
schedule assumed before: a replicated value is held once along its replicated mesh dims.
"""
from __future__ import annotations

from ..parallel.placement import Partial
from ..parallel.reshard import plan_reshard_cached
from ..parallel.spec import TensorSpec

__all__ = ["GradWays", "sent_by_group"]


def sent_by_group(s, shape, dtype, mesh) -> tuple:
    """``schedule.Item.sent`` of plan step ``s`` of a tensor ``shape`` / ``dtype``: each
    group's busiest rank, ((group, bytes), ...), where the pieces are uneven
    (``reshard.step_records``, what the run records on either executor); () where even."""
    from ..parallel.reshard import step_records
    return tuple((tuple(kw["groups"][0]), kw["sent"])
                 for kw in step_records(s, tuple(shape), dtype, mesh) if "sent" in kw)


class GradWays:
    """Groups the per-rank readers of each tensor (:meth:`read`, in forward order) and
    gives each group's gradient steps at its last backward reader (:meth:`steps`)."""

    def __init__(self, graph, mesh, pname):
        self.g, self.mesh, self.pname = graph, mesh, pname
        self.made_by = {}          # (vid, placements) -> the Reshard that made that copy
        self.groups = {}           # key -> dict(uses, readers, members, ins, vid, ps)
        self.of_node = {}          # nid -> [(key, pos, dims)]
        self.held = {}             # (vid, placements) -> the copy the run holds there
        self.marked = {}           # (vid, src, dst) -> (source copy, its marked copy)

    def reshard(self, ins) -> bool:
        """Reshard ``ins`` (program order); False where the run reads an earlier copy
        instead and runs this one's collectives without autograd (O0's gather repeated for
        another reader, lower.execute_program): it has no backward of its own, its
        readers' gradients go back through the first copy's."""
        pinned = ins.why.startswith("pinned") and not ins.marks
        # (a pinned copy is the value's own layout from then on: lower.py marks it not;
        # but a program's t.redistribute, marked as eager's wb.reshard result)
        self.made_by[(ins.vid, tuple(ins.dst))] = None if pinned else ins
        src, dst = tuple(ins.src), tuple(ins.dst)
        key = (ins.vid, src, dst)
        source = self.held.get((ins.vid, src), (ins.vid, src))    # (the input as bound)
        again = self.marked.get(key)
        if again is not None and again[0] == source and not pinned:
            self.held[(ins.vid, dst)] = again[1]
            return False
        copy = self.held[(ins.vid, dst)] = ("copy", id(ins))
        if not pinned and _gathers(ins) and self.g.values[ins.vid].requires_grad:
            self.marked[key] = (source, copy)             # lower.py: reshard_backward.mark
        return True

    def read(self, node, strategy):
        """Node ``node`` (forward order) reads its inputs laid out as ``strategy`` asks."""
        diverge = [i for i in range(self.mesh.ndim)
                   if any(not ps[i].is_replicate() for ps in strategy.outputs)]
        mine = []
        for pos, (vid, req) in enumerate(zip(node.inputs, strategy.inputs)):
            if vid is None or req is None or not self.g.values[vid].requires_grad:
                continue
            dims = tuple(i for i in diverge if req[i].is_replicate())
            if not dims:
                continue
            ps = tuple(req)
            ins = self.made_by.get((vid, ps))
            # a reshard's marked copy: one way back for all its readers (and for those of
            # the same gather repeated, O0's: lower.execute_program reads the first copy);
            # another reshard's copy: its own; the value's own layout: one per set of dims
            # read per rank (reshard_backward.gather's key)
            key = (vid, ps, "gathered", ins.src) if ins is not None and _gathers(ins) else \
                (vid, ps, id(ins)) if ins is not None else (vid, ps, None, dims)
            grp = self.groups.setdefault(key, dict(uses=[], readers=0, members=[], ins=ins,
                                                   vid=vid, ps=ps))
            use = tuple(Partial() if i in dims else p for i, p in enumerate(ps))
            if use not in grp["uses"]:
                grp["uses"].append(use)
            grp["readers"] += 1
            grp["members"] += [(node.nid, pos, i) for i in dims]
            mine.append(key)
        self.of_node[node.nid] = mine

    def steps(self, nid):
        """The gradient steps due at node ``nid``'s backward: those of the groups whose last
        reader (in backward order) it is, each ``(kind, mesh dim, buffer bytes, vid,
        members)``; ``members`` (the readers' (node, input position, mesh dim) keys) only
        for a parameter's or input's all-reduce (bucketable)."""
        out = []
        for key in self.of_node.get(nid, ()):
            grp = self.groups[key]
            grp["readers"] -= 1
            if grp["readers"]:
                continue
            out += self._plan(grp)
        return out

    def _plan(self, grp):
        vid, ps, ins = grp["vid"], grp["ps"], grp["ins"]
        v = self.g.values[vid]
        back = ps
        if ins is not None and any(a.is_shard() and b.is_replicate()
                                   for a, b in zip(ins.src, ins.dst)):
            # a reshard's gathered result (reshard_backward.mark): back to the source's
            # shards on the dims it gathered
            back = tuple(a if b.is_replicate() and a.is_shard() else b
                         for a, b in zip(ins.src, ins.dst))
        # a parameter's (or input's) all-reduce is bucketable: buckets.py expands the
        # tensor the readers read (the parameter, or its gathered copy) and counts the
        # bytes priced here (a gathered copy's: its shard's, the slice first, as eager)
        leaf = v.kind in ("param", "input")
        out = []
        for grad in _merged(grp["uses"]):
            plan = plan_reshard_cached(TensorSpec(tuple(v.shape), self.mesh, grad, v.dtype,
                                                  _trusted=True), back, self.pname)
            for s in plan.steps:
                if not s.bytes:
                    continue
                bucket = leaf and s.kind == "all_reduce" and back[s.mesh_dim].is_replicate()
                members = tuple(m for m in grp["members"] if m[2] == s.mesh_dim) \
                    if bucket else ()
                # (uneven pieces: each group's busiest rank, as the run records it)
                out.append((s.kind, s.mesh_dim, s.buffer_bytes, vid, members,
                            sent_by_group(s, v.shape, v.dtype, self.mesh)))
        return out


def _gathers(ins) -> bool:
    """Whether reshard ``ins`` gathers a mesh dim (``S(d) -> R``: reshard_backward.mark
    gives its copy a way back)."""
    return any(a.is_shard() and b.is_replicate() for a, b in zip(ins.src, ins.dst))


def _merged(uses):
    # the readers' gradients summed (reshard_backward._merged: the one rule)
    from ..parallel.reshard_backward import _merged as merged
    return merged(uses)
