"""``wb.compile``: capture a program, choose its placements over the whole graph, run
its passes, and give back a :class:`CompiledProgram`.

Levels (MindSpore's JIT levels, as the issue names them):

* ``"O0"``: capture only; each op keeps the dispatcher's own (greedy) choice.
* ``"O1"``: fusion of known patterns into ``wb.ops`` calls, whole-graph placements
  (:mod:`.propagate`), and removal of reshards that cancel.
* ``"O2"``: O1, then the step's schedule passes: small gradient all-reduces bucketed,
  collectives moved early (async) and split to overlap compute, and the whole graph
  launched at once (graph / task sink: no per-kernel host launch on the clock).

The schedule passes edit the step laid out ahead (``prog.step()``, ``prog.stages``).
Running the program on the simulated ranks (or under torch.distributed) runs the O1
program; at O2 its trace records the graph sink (one launch, kernels without their own)
and its gradients are all-reduced in the bucket pass's buckets, one collective per
bucket (``buckets.py``; under torch.distributed one per parameter, as O1).  The overlap
pass's early and split collectives stay a priced plan: the run issues each collective
whole, where its consumer needs it (``prog.notes`` says which the schedule holds).

Calling it: like ``fn`` (keyword arguments bound by ``fn``'s signature, ``arguments.py``),
with inputs like the example's; what the capture held fixed (train/eval mode, submodules,
hooks, Python values the code read) is checked on every call and a change refused with
the fix (``guards.py``).  A compiled module answers for its module (``prog.parameters()``,
``prog.state_dict()``, ``prog.train()``), as ``torch.compile``'s does.

A graph break (data-dependent control flow) is reported with its source line and the
program runs eagerly (op by op through the dispatcher), as MindSpore and
``torch.compile`` fall back to Python for what they cannot capture.
"""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.dist_tensor import DistTensor
from ..parallel.placement import fmt_placements
from ..sim_mesh.profiles import get_profile
from ..sim_mesh.trace import current_trace
from . import passes as _passes
from .arguments import positional
from .capture import Broken, CaptureError, capture
from .graph import GraphBreak, same_tuple
from .guards import (Frozen, bind_attributes, check_hooks, check_no_mode, snapshot,
                     check_module_tree, check_parameter, check_training_flags, hook_keys,
                     module_tree, tensor_attributes, training_flags)
from .lower import Reshard, execute_program, lower
from .propagate import greedy, propagate
from .reads import amp_state, autograd_state, describe_change

__all__ = ["compile", "CompiledProgram", "LEVELS"]

LEVELS = ("O0", "O1", "O2")


def _mesh_of(args, module):
    from .capture import nested_tensors
    for a in nested_tensors(list(args)):
        if isinstance(a, DistTensor):
            return a.mesh
    if module is not None:
        for m in module.modules():
            for p in m._parameters.values():
                if isinstance(p, DistTensor):
                    return p.mesh
    return None


def _signature(a):
    """What a call's argument must share with the example's: a tensor's shape, dtype,
    placements and mesh; a Python value, a container or an object by its
    :func:`~.guards.snapshot` (the graph holds what capture read from it: 2, not 2.0;
    ``cfg.scale``; a tensor inside one by its identity, a constant of the graph)."""
    if isinstance(a, (torch.Tensor, DistTensor)):
        mesh = getattr(a, "mesh", None)
        return (tuple(a.shape), a.dtype, tuple(getattr(a, "placements", ())),
                None if mesh is None else (tuple(mesh.dim_names), tuple(mesh.shape),
                                           tuple(mesh.ranks)))
    return snapshot(a)


def _named_parameters(module) -> dict:
    """{name: parameter} of the module's parameters now (a tied one under its first name;
    ``None`` entries, a ``bias=False`` linear's, left out)."""
    named = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                named.setdefault(f"{mname}.{pname}" if mname else pname, p)
    return named


def replica_dims(module, graph, mesh) -> dict:
    """{param vid: the mesh dims it is replicated along and held once per rank} (a
    data-parallel optimizer's replicas, ``DataParallel``; a sequence-parallel norm's
    copies, ``sequence_parallel_norms``; on torch.distributed ``_wb_replica_axes``): each
    rank's gradient stays its own there, and the optimizer reduces it once per step."""
    named = _named_parameters(module)
    out = {}
    for name, vid in graph.params.items():
        p = named.get(name)
        if not isinstance(p, DistTensor) or p.mesh != mesh:
            continue
        loc = p._local
        dims = set(getattr(loc, "_wb_replica_axes", ()))
        if isinstance(loc, torch.Tensor) and loc.dim() >= mesh.ndim:
            dims |= {i for i, n in enumerate(mesh.shape)
                     if n > 1 and loc.shape[i] == n and p.placements[i].is_replicate()}
        if dims:
            out[vid] = tuple(sorted(dims))
    return out


def _fulls(tree):
    """``tree`` with each DistTensor as its global tensor (``.full()``: autograd flows)."""
    if isinstance(tree, DistTensor):
        return tree.full()
    if isinstance(tree, tuple):
        return same_tuple(tree, [_fulls(x) for x in tree])
    if isinstance(tree, list):
        return [_fulls(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _fulls(x) for k, x in tree.items()}
    return tree


def compile(fn, *example_inputs, level: str = "O1", mesh=None, pin=None, profile=None,
            method: str = "auto", beam: int = 4, memory_limit: int | None = None,
            kwargs: dict | None = None):
    """Compile ``fn`` (a function or an ``nn.Module``) for inputs like ``example_inputs``
    (and keyword inputs ``kwargs``, as ``torch.export.export`` takes them: bound to their
    parameters by ``fn``'s signature, :mod:`.arguments`).

    Placements come from the example DistTensors and the module's DistTensor parameters
    (plain tensors are replicated on ``mesh``; a program of plain tensors only returns
    plain tensors, as it does eagerly); ``pin`` maps a value (its number in
    ``program.graph``, a parameter name, or ``"output"``) to the placements it must have.
    ``profile``: the hardware profile the choice is priced on (the current trace's, or
    the default).  ``memory_limit``: bytes per rank the ops' outputs and re-laid-out
    inputs may hold (``propagate.py``; at equal time the search takes less memory anyway).
    Returns a :class:`CompiledProgram`; call it like ``fn``."""
    if level not in LEVELS:
        raise ValueError(f"compile(level={level!r}): use one of {LEVELS}")
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1:
        raise ValueError(f"compile(beam={beam!r}): give the number of cheapest partial "
                         "assignments the search keeps per op, an int >= 1 (default 4)")
    if memory_limit is not None and (isinstance(memory_limit, bool) or
                                     not isinstance(memory_limit, int) or memory_limit < 1):
        raise ValueError(f"compile(memory_limit={memory_limit!r}): give bytes per rank, an "
                         "int >= 1, or None for no limit")
    if not callable(fn):
        raise TypeError(f"compile(fn={fn!r:.60}): expected a function or an nn.Module")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"compile(kwargs={kwargs!r:.60}): give a dict of keyword example "
                        "inputs, as torch.export.export takes them")
    example_inputs = positional(fn, example_inputs, kwargs or {})
    module = fn if isinstance(fn, nn.Module) else None
    from ..sim_mesh.mesh import Mesh
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"compile(mesh={mesh!r:.60}): give a wb.Mesh (the mesh the program "
                        "runs on), or None to take the example DistTensors' mesh")
    mesh = mesh or _mesh_of(example_inputs, module)
    if mesh is None:
        raise ValueError("compile: no DistTensor among the example inputs or parameters; "
                         "pass mesh= to say where the program runs")
    if profile is None:
        tr = current_trace()
        profile = tr.profile.name if tr is not None else get_profile(None).name
    if memory_limit is not None and level == "O0":
        raise ValueError("compile(level='O0', memory_limit=...): O0 keeps the dispatcher's "
                         "own choice; the limit applies to the whole-graph search (O1, O2)")
    return CompiledProgram(fn, example_inputs, level, mesh, pin, profile, method, beam,
                           memory_limit)


class CompiledProgram:
    """A captured program with its placements, passes and schedule (module docstring).

    ``graph``: the captured ops; ``assignment`` / ``greedy``: the whole-graph and the
    op-by-op choices, priced; ``program``: the lowered instructions; ``log``: each pass
    with the program before and after; ``breaks``: graph breaks (then it runs eagerly)."""

    def __init__(self, fn, example_inputs, level, mesh, pin, profile, method, beam,
                 memory_limit=None):
        self.fn, self.level, self.mesh, self.profile = fn, level, mesh, profile
        self.module = fn if isinstance(fn, nn.Module) else None
        self.breaks: list[GraphBreak] = []
        self.log: list = []                 # (pass name, before, after, what it saved)
        self.stages: list = []              # (pass name, schedule after it, its StepReport)
        self.graph = self.assignment = self.greedy = self.program = self.schedule = None
        self.parts: dict = {}               # child name -> its compiled program (a break)
        self._example = [_signature(a) for a in example_inputs]
        try:
            graph, placements = capture(fn, example_inputs, method)
        except Broken as e:
            self.breaks.append(e.brk)
            if self.module is not None:     # the break stays eager, the children compile
                from .parts import compile_children
                self.parts = compile_children(self.module, example_inputs, lambda m, a, pn: (
                    CompiledProgram(m, a, level, mesh, pn, profile, method, beam,
                                    memory_limit)))
                for name, part in self.parts.items():   # (its refusals name the parent)
                    part._part = (type(self.module).__name__, name)
            return
        except CaptureError as e:          # an op the table lacks: that program runs eagerly
            where = getattr(e, "where", None) or ("?", 0, "")
            self.breaks.append(GraphBreak(str(e), *where))
            return
        self.captured = graph
        self._placements = placements
        if self.module is not None:         # what the call checks and re-reads (guards.py)
            self._param_names = tuple(_named_parameters(self.module))
            self._modes = training_flags(self.module)
            self._tree = module_tree(self.module)
            self._attrs = tensor_attributes(self.module, graph.consts)
        self._frozen = Frozen(fn, graph.consts)
        self._amp = amp_state()             # the caller's autocast at capture (reads.py)
        # the code read autograd's state (reads.py): the capture's answer is a guard
        # (its grad mode: on, as capture runs)
        self._autograd = None
        if graph.autograd_reads:
            ins, params, _ = autograd_state(example_inputs, self.module)
            self._autograd = (ins, params, True)
        if self.module is not None and graph.stats_layers:
            # what the program itself writes on each call (a MoE layer's last routing,
            # ``record_stats``) is no value the graph read: its change is no reason to
            # refuse the next call (it refused the second call of a compiled MoE model)
            mine = {id(m) for m in graph.stats_layers}
            for mname, mod in self.module.named_modules(remove_duplicate=False):
                if id(mod) in mine:
                    for a in getattr(mod, "STATS_WRITES", ()):
                        label = f"module attribute {mname + '.' if mname else ''}{a}"
                        self._frozen.scalars.pop(label, None)
                        self._frozen.objects.pop(label, None)
        self._hooks = hook_keys(fn)
        if self.module is not None:
            graph.replica_dims = replica_dims(self.module, graph, mesh)
        if level != "O0":
            graph = _passes.run_graph_passes(self, graph)
        self.graph = graph
        pins = self._pins(graph, pin)
        self.greedy = greedy(graph, placements, mesh, profile, pins)
        self.assignment = self.greedy if level == "O0" else \
            propagate(graph, placements, mesh, profile, pins, beam=beam,
                      memory_limit=memory_limit)
        self.program = lower(graph, self.assignment)
        if level != "O0":
            self.program = _passes.run_program_passes(self, self.program)
        from .schedule import build_schedule
        self.schedule = build_schedule(self)
        from .schedule import replay
        self.stages.append((level if level != "O2" else "O1", self.schedule,
                            replay(self.schedule)))
        if level == "O2":
            self.schedule = _passes.run_schedule_passes(self, self.schedule)

    def _pins(self, graph, pin):
        out = {}
        for k, ps in (pin or {}).items():
            if k == "output":
                for vid in graph.output_vids():
                    out[vid] = ps
            else:
                out[k] = ps
        return out

    def __getattr__(self, name):
        """A compiled module answers for its module, as ``torch.compile``'s does
        (``prog.parameters()`` for the optimizer, ``prog.state_dict()``, ``prog.zero_grad()``);
        a method that returns the module (``prog.train()``) returns the program."""
        mod = self.__dict__.get("module")
        if mod is None or name.startswith("_"):
            raise AttributeError(f"'CompiledProgram' object has no attribute {name!r}" + (
                " (a compiled function has no module to answer for it)"
                if mod is None and hasattr(nn.Module, name) else ""))
        attr = getattr(mod, name)
        if callable(attr) and getattr(attr, "__self__", None) is mod:
            def call(*args, **kwargs):
                out = attr(*args, **kwargs)
                return self if out is mod else out
            call.__name__, call.__doc__ = name, attr.__doc__
            return call
        return attr

    # ---- running ------------------------------------------------------------------
    @property
    def eager(self) -> bool:
        """True where a graph break made the program run op by op."""
        return self.graph is None

    def __call__(self, *args, **kwargs):
        if self.eager:
            if self.parts:
                from .parts import swapped
                with swapped(self.module, self.parts):
                    return self.fn(*args, **kwargs)
            return self.fn(*args, **kwargs)
        args = positional(self.fn, args, kwargs, len(self._example))
        self._check_signature(args)
        return self._run(args)

    def _check_signature(self, args) -> None:
        got = [_signature(a) for a in args]
        if got != self._example:
            diff = [i for i in range(max(len(got), len(self._example)))
                    if got[i:i + 1] != self._example[i:i + 1]]
            what = type(self.fn).__name__ if self.module is not None else \
                getattr(self.fn, "__qualname__", type(self.fn).__name__)
            part = getattr(self, "_part", None)     # a compiled child of an eager module
            what, fix = (what, "it") if part is None else \
                (f"{what}, the child {part[1]!r} of {part[0]}, which runs eagerly", part[0])
            raise ValueError(f"compiled program ({what}) called with inputs of other "
                             "shapes, dtypes, "
                             "placements or meshes, or other Python values, than it was "
                             f"compiled for (argument {', '.join(map(str, diff))}: "
                             f"{got} vs {self._example}); compile {fix} again for these")

    def _run(self, args):
        if self.module is not None:
            check_module_tree(self.module, self._tree)
            check_training_flags(self.module, self._modes)
        check_no_mode()
        check_hooks(self.fn, self._hooks)
        if amp_state() != self._amp:
            raise ValueError(
                "compiled program called under another torch.autocast state than at "
                f"capture (autocast dtype {self._amp} then, {amp_state()} now): the graph's "
                "dtypes and placements were chosen for the capture's; compile it again "
                "under this autocast (or call it as at capture)")
        if self._autograd is not None:
            now = autograd_state(args, self.module)
            if now != self._autograd:
                raise ValueError(
                    "compiled program: its code read "
                    f"{', '.join(sorted(self.graph.autograd_reads))} at capture (a Python "
                    "branch may follow it), and this call answers otherwise: "
                    f"{describe_change(self._autograd, now)}; compile it again for such "
                    "calls (or call it as at capture)")
        g = self.graph
        bind = {}
        tensors = [a for a in args if isinstance(a, (torch.Tensor, DistTensor))]
        for vid, a in zip(g.inputs, tensors):
            bind[vid] = a
        if self.module is not None:
            named = _named_parameters(self.module)
            new = sorted(set(named) - set(self._param_names))
            if new:     # (``m.bias = nn.Parameter(...)``: the graph has no op that reads it)
                raise ValueError(f"compiled program: parameter{'s' if len(new) > 1 else ''} "
                                 f"{', '.join(map(repr, new[:4]))} added to the module since "
                                 "capture; the graph does not read "
                                 f"{'them' if len(new) > 1 else 'it'}: compile the module "
                                 "again")
            for name, vid in g.params.items():
                bind[vid] = check_parameter(name, named.get(name), g.values[vid],
                                            self._placements.get(vid))
        for vid, c in g.consts.items():
            bind[vid] = c
        bind.update(self._frozen.check(g.values))   # what the code read, as it is now
        if self.module is not None:         # buffers and tensor attributes as they are now
            bind.update(bind_attributes(self.module, {v: w for v, w in self._attrs.items()
                                                      if v in g.consts}, g.values))
        self._check_held(g, bind)
        if self.level != "O2":
            return self._result(execute_program(g, self.program, self.mesh, bind))
        # O2: the whole graph is launched once (graph / task sink); its kernels, forward
        # and backward, are recorded without their own launches
        from ..parallel.ops_table.pricing import graph_sink
        tr = current_trace()
        if tr is not None:
            lt = tr.profile.compute_path(torch.float32)[3]
            tr.record_compute(self.mesh.ranks, "graph launch", lt, label="launch",
                              args={"launch": lt})
        with graph_sink():
            return self._result(execute_program(g, self.program, self.mesh, bind,
                                                self._grad_buckets()))

    def _check_held(self, g, bind) -> None:
        """Refuse a call after a constant that a pass relied on changed (a fused
        attention's causal mask, a buffer filled or replaced since): the graph no longer
        reads it, so it would silently keep the value of the capture."""
        for vid, (want, why) in g.held.items():
            now = bind.get(vid)
            if now is None or (now.shape == want.shape and now.dtype == want.dtype and
                               torch.equal(now.detach().cpu(), want)):
                continue
            where = getattr(self, "_attrs", {}).get(vid)
            name = (f"module tensor {'.'.join(x for x in where if x)!r}" if where else
                    f"the constant %{vid} ({g.values[vid].name})")
            raise ValueError(f"compiled program: {name} was {why}; it has changed since, and "
                             "the graph does not read it: compile again (or at level='O0', "
                             "which keeps the ops that read it)")

    def _result(self, out):
        """A program of plain tensors only (inputs and parameters: no DistTensor; it ran
        replicated on ``mesh``) gives plain tensors back, as the function does eagerly;
        ``.full()`` keeps the autograd path to them."""
        if any(isinstance(v, tuple) for v in self._placements.values()):
            return out
        return _fulls(out)

    def _grad_buckets(self):
        """The O2 schedule's gradient buckets, for one run (``buckets.py``); None under
        torch.distributed (each rank's all-reduce is the dispatcher's, per parameter)."""
        from ..sim_mesh import backends
        from .buckets import GradBuckets
        if backends.is_distributed(self.mesh):
            return None
        return GradBuckets(self.mesh, [(it.members, it.mesh_dim, it.async_)
                                       for it in self.schedule.items
                                       if it.kind == "comm" and it.grad and it.members])

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
        return sum(wire_bytes(it.coll, it.nbytes, shape[it.mesh_dim])
                   for it in self.schedule.items
                   if it.kind == "comm" and it.phase == "backward")

    def step(self, schedule=None):
        """The compiled step (forward and backward) replayed on the clock: a
        :class:`~.schedule.StepReport` (its ``trace`` holds the timeline)."""
        from .schedule import replay
        if self.eager:
            raise RuntimeError("this program runs eagerly (a graph break); trace it instead")
        return replay(schedule or self.schedule)

    def passes(self) -> str:
        """Each pass: what it changed and what it saved."""
        return "\n".join(f"{name}: {saved}" for name, _, _, saved in self.log)
