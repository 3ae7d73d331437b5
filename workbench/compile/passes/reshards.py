"""Remove reshards that cancel: a tensor brought to a layout it already has.

Lowering gives every consumer its own reshard from the layout its input is in, as the
dispatcher does op by op.  When two consumers need the same layout, the second reshard
repeats the first; when a tensor is pinned (or resharded) and a later consumer wants the
layout it was made in, the reshard undoes the pin's.  Both find the layout already
materialized: the reshard is dropped and the consumer reads that copy (memory for
communication, as a compiler's common-subexpression elimination trades it).  A round
trip to another mesh (``mesh_trips.py``) is not undone so: its copy replaces the layouts
before it.
"""
from __future__ import annotations

from ..lower import Reshard

__all__ = ["cancel_reshards"]


def cancel_reshards(prog, program):
    before = _text(program)
    avail = {}
    out, dropped, saved_b, saved_t = [], 0, 0, 0.0
    g = prog.graph
    for v in g.values:
        if v.kind != "op":
            avail[v.vid] = {prog.assignment.placements[v.vid]}
    for ins in program:
        if isinstance(ins, Reshard):
            have = avail.setdefault(ins.vid, set())
            if ins.dst in have and not ins.why.startswith("pinned"):
                dropped += 1
                saved_b += ins.plan.total_bytes
                saved_t += ins.plan.total_time
                continue
            if ins.via is not None:
                # a round trip's copy is the value from then on (mesh_trips.py): a reader
                # of the layout it left reshards from the copy, as eager's reader does, so
                # the gradient goes back through the trip (read before it, the trip ran
                # forward and its backward never: compile17, O1 round trip then a slice)
                have.clear()
            have.add(ins.dst)
            out.append(ins)
        else:
            n = g.nodes[ins.nid]
            for vid, ps in zip(n.outs, ins.strategy.outputs):
                avail[vid] = {tuple(ps)}
            out.append(ins)
    saved = (f"{dropped} reshard(s) removed, {saved_b:,d} B and {saved_t * 1e6:.2f} us "
             "of forward communication saved")
    prog.log.append(("cancel_reshards", before, _text(out), saved))
    return out


def _text(program) -> str:
    lines = []
    for ins in program:
        lines.append(str(ins).strip() if isinstance(ins, Reshard) else f"run node {ins.nid}")
    return "\n".join(lines)
