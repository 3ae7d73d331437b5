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

The program's parts live beside this module: the values it is called with and gives back
(:mod:`.program_args`), running it (:mod:`.program_run`) and reading it
(:mod:`.program_report`).
"""
from __future__ import annotations

from torch import nn

from ..sim_mesh.profiles import get_profile
from ..sim_mesh.trace import current_trace
from . import passes as _passes
from .arguments import positional
from .capture import Broken, CaptureError, capture
from .graph import GraphBreak
from .guards import Frozen, hook_keys, module_tree, tensor_attributes, training_flags
from .lower import lower
from .mesh_trips import mesh_trips
from .program_args import (_fulls, _mesh_of, _named_parameters, _signature,  # noqa: F401
                           replica_dims)
from .program_report import _Reading
from .program_run import _Running
from .propagate import greedy, propagate
from .reads import amp_state, autograd_state

__all__ = ["compile", "CompiledProgram", "LEVELS"]

LEVELS = ("O0", "O1", "O2")


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


class CompiledProgram(_Running, _Reading):
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
        try:           # a redistribute to another mesh: a round trip, or a break
            graph.vias = mesh_trips(graph, mesh)
        except CaptureError as e:
            self.breaks.append(GraphBreak(str(e), *(e.where or ("?", 0, ""))))
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
        # the program's own t.redistribute (capture: tracer.py), then the caller's pins
        out = {vid: ps for vid, (_m, ps, _w) in graph.pins.items()}
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
