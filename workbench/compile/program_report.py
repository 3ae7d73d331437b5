"""Reading a :class:`~.program.CompiledProgram`: its notes, its printout (placements and
reshards op by op, priced), the bytes its forward and backward send, its step replayed on
the clock and what each pass saved."""
from __future__ import annotations

from ..parallel.placement import fmt_placements
from .lower import Reshard


class _Reading:
    """What a compiled program reports (a base of :class:`~.program.CompiledProgram`)."""

    @property
    def data_dependent(self) -> list:
        """What the step cannot know: each op that reads a partial sum (Partial sum / avg)
        beside a factor, where the dispatcher reduces the partial sum first when a factor
        holds inf, a divisor 0, or (mul / div of a floating partial sum) a factor 0 or a
        divisor inf, decided from the values at run time (``dispatch._unsafe_factor``),
        and a plain 0-d tensor read as a number (``dispatch._unsafe_scale``: inf or nan, a
        divisor 0, a factor 0 beside a floating partial sum): then the run makes one
        all-reduce per such input that :meth:`step` does not hold, and the op runs as
        eager's from there (``lower.execute_program``).  A Python number of the graph is
        no such item: it is known when the program is compiled, and the plan reduces the
        partial sum first where the dispatcher will (``int_partials.scaled_first``); a
        divisor that is such a number reads nothing.  [] where no op does (or the program
        runs eagerly)."""
        if self.eager:
            return []
        from ..parallel.dist_tensor import DistTensor
        from ..parallel.ops_table.table import TABLE
        from .lower import Run
        g = self.graph
        ins_ps = getattr(self, "_placements", {})

        def plain_number(vid):
            """A plain 0-d floating tensor (the dispatcher reads it as a number)."""
            v = g.values[vid]
            return len(v.shape) == 0 and v.dtype.is_floating_point and \
                not isinstance(ins_ps.get(vid), tuple) and \
                not isinstance(g.consts.get(vid), DistTensor)

        def summing(ps):
            return any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in ps)
        # the layouts each value has had so far: an input the op takes as a partial sum that
        # no layout of it was is made partial by the dispatcher inside the op, after its
        # reads (lower.made_partial_inside, the program's Reshard.inside): no partial sum
        # reaches them (a row-parallel linear's replicated bias)
        have = {v.vid: {tuple(self.assignment.placements[v.vid])} for v in g.values
                if v.kind != "op" and v.vid in self.assignment.placements}
        out = []
        for ins in self.program:
            if isinstance(ins, Reshard):
                if not ins.inside:
                    have.setdefault(ins.vid, set()).update((tuple(ins.src), tuple(ins.dst)))
                continue
            if not isinstance(ins, Run):
                continue
            n = g.nodes[ins.nid]
            for vid, ps in zip(n.outs, ins.strategy.outputs):
                have.setdefault(vid, set()).add(tuple(ps))
            if n.op not in ("mul", "div") and TABLE[n.op].op_class != "matmul":
                continue
            summed = [vid for vid, req in zip(n.inputs, ins.strategy.inputs)
                      if vid is not None and req is not None and summing(req) and
                      any(summing(ps) for ps in have.get(vid, {tuple(req)}))]
            if not summed:
                continue
            consts = n.in_consts or (None,) * len(n.inputs)
            numbers = [k for k, (vid, c) in enumerate(zip(n.inputs, consts))
                       if vid is None and c is not None]
            if n.op == "div" and 1 in numbers:
                continue        # a number of the graph divides: decided when compiled
            dts = [g.values[v].dtype for v in summed]
            # signed zeros: a floating partial sum of mul / div (dispatch._unsafe_factor)
            signed = n.op in ("mul", "div") and any(d.is_floating_point or d.is_complex
                                                    for d in dts)
            others = [vid for vid in n.inputs if vid is not None and vid not in summed]
            if n.op == "mul" and numbers and not others:
                when = "a part of the partial sum holds inf"        # x * 2.0: its parts
                how = "dispatch._unsafe_factor"
            else:
                when = ("a divisor holds 0" + (" or inf" if signed else "") if n.op == "div"
                        else "a factor holds " + ("0 or inf" if signed else "inf"))
                how = "dispatch._unsafe_factor"
                read = [vid for vid in others if plain_number(vid)]
                if n.op in ("mul", "div") and read:
                    when += (", or the 0-d tensor " + ", ".join(f"%{v}" for v in read) +
                             " read as a number is inf or nan")
                    how = "dispatch._unsafe_factor / _unsafe_scale"
            reads = ", ".join(f"%{v}:{fmt_placements(req)}" for v, req in
                              zip(n.inputs, ins.strategy.inputs) if v in summed)
            out.append(f"data-dependent: {n.name} ({n.op}) reads the partial sum {reads}: "
                       f"where {when} at run time the dispatcher reduces it first "
                       f"({how}), an all-reduce the step does not model; "
                       "modeled as not reduced")
        return out

    @property
    def notes(self) -> list:
        """What running the program does, and what only its schedule holds."""
        if self.eager or self.level != "O2":
            return []
        out = ["run: the graph is launched once (sink); gradients are all-reduced in the "
               "bucket pass's buckets, one collective per bucket when its last gradient is "
               "ready (on simulated ranks; under torch.distributed one per parameter)"]
        tags = {t for it in self.schedule.items for t in it.tag.split()}
        if "early" in tags or any(it.tag.startswith("split") for it in self.schedule.items):
            out.append("plan only: the overlap pass's early and split collectives are "
                       "priced on the clock (prog.step()); the run issues each collective "
                       "where its consumer needs it, whole")
        return out

    # ---- reading -----------------------------------------------------------------
    def __str__(self) -> str:
        if self.eager:
            parts = "".join(
                f"\n  {name}: " + ("eager" if p.eager else f"compiled, {len(p.graph.nodes)} ops")
                for name, p in self.parts.items())
            return (f"compiled program ({self.level}): runs eagerly, op by op"
                    + (f", calling its compiled children:{parts}" if parts else "") + "\n"
                    + "\n".join(str(b) for b in self.breaks))
        a = self.assignment
        lines = [f"compiled program ({self.level}) on {self.mesh} priced on {self.profile}: "
                 f"{len(self.graph.nodes)} ops, capture by {self.graph.method}"]
        lines += [f"  # {n}" for n in self.graph.notes + self.notes]
        g = self.graph
        for v in g.values:
            if v.kind in ("input", "param"):
                lines.append(f"  %{v.vid} = {v.kind} {v.name} "
                             f"{fmt_placements(a.placements[v.vid])} {tuple(v.shape)}")
        pending = []
        for ins in self.program:
            if isinstance(ins, Reshard):
                if ins.why.startswith("pinned"):
                    lines.append(str(ins))
                else:
                    pending.append(ins)
                continue
            n = g.nodes[ins.nid]
            st = ins.strategy
            ins_txt = ", ".join("-" if vid is None else f"%{vid}:{fmt_placements(req)}"
                                for vid, req in zip(n.inputs, st.inputs))
            outs = ", ".join(f"%{o}:{fmt_placements(ps)}" for o, ps in zip(n.outs, st.outputs))
            lines.append(f"  {outs} = {n.op}({ins_txt})" + (f"  # {n.note}" if n.note else ""))
            lines += ["  " + str(r) for r in pending]
            pending = []
        lines.append(f"  return {g.output}")
        lines.append(f"modeled step {a.time * 1e6:.2f} us ({a.how}); greedy "
                     f"{self.greedy.time * 1e6:.2f} us; forward reshards "
                     f"{self.bytes:,d} B per rank (greedy {self.greedy.bytes:,d} B); "
                     f"activations {a.memory:,d} B per rank (greedy {self.greedy.memory:,d} B)")
        return "\n".join(lines)

    __repr__ = __str__

    @property
    def bytes(self) -> int:
        """Bytes each rank sends in the program's forward reshards (the backward's:
        :attr:`backward_bytes`)."""
        from .extrema import inner_bytes      # (an amax / amin reducing its own output)
        return sum(i.plan.total_bytes for i in self.program if isinstance(i, Reshard)) + \
            sum(inner_bytes(c) for c in self.assignment.choice.values())

    @property
    def backward_bytes(self) -> int:
        """Bytes each rank sends in the step's backward collectives: the reshards'
        backward and the gradient reductions of :attr:`schedule` (``schedule.py``; after
        this level's passes, so O2's buckets), what a traced run records for the program's
        backward (``benchmarks/eager_comm_probe.py`` holds the two equal)."""
        if self.eager:
            raise RuntimeError("this program runs eagerly (a graph break); trace it instead")
        from ..sim_mesh.cost import wire_bytes
        shape = self.mesh.shape
        r0 = self.mesh.ranks[0]
        return sum(sum(b for grp, b in it.sent if r0 in grp) if it.sent else  # (uneven)
                   (it.wire if r0 in it.ranks else 0) if it.ranks else   # (a round trip's)
                   wire_bytes(it.coll, it.nbytes, shape[it.mesh_dim])
                   for it in self.schedule.items
                   if it.kind == "comm" and it.phase == "backward")

    def step(self, schedule=None):
        """The compiled step (forward and backward) replayed on the clock: a
        :class:`~.schedule.StepReport` (its ``trace`` holds the timeline)."""
        from .schedule import replay
        if self.eager:
            raise RuntimeError("this program runs eagerly (a graph break); trace it instead")
        rep = replay(schedule or self.schedule)
        rep.assumed = tuple(self.data_dependent)      # what the replay cannot know
        return rep

    def passes(self) -> str:
        """Each pass: what it changed and what it saved."""
        return "\n".join(f"{name}: {saved}" for name, _, _, saved in self.log)
