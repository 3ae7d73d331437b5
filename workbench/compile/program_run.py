"""Running a :class:`~.program.CompiledProgram`: a call checked against what the capture
held fixed (``guards.py``), its tensors bound, the lowered program executed on the ranks
(at O2 as one launch, its gradients in the bucket pass's buckets)."""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from ..sim_mesh.trace import current_trace
from .arguments import positional
from .guards import (bind_attributes, check_hooks, check_module_tree, check_no_mode,
                     check_parameter, check_training_flags)
from .lower import execute_program
from .program_args import _fulls, _named_parameters, _signature
from .reads import amp_state, autograd_state, describe_change


class _Running:
    """The call of a compiled program (a base of :class:`~.program.CompiledProgram`)."""

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
