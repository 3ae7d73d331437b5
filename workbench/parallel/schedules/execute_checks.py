"""What :func:`~.execute.run_pipeline` checks before (or as) it runs a schedule, so that
a pipeline step gives one device's gradients or a clear error, never a silent difference:
micro-batches of one size (each loss weighs 1/m), module stages' parameters all listed
for a split backward (``W`` computes only those), DistTensors between stages.
"""
from __future__ import annotations

import contextlib

import torch

from ..dist_tensor import DistTensor

__all__ = ["check_even_microbatches", "check_sendable", "check_weights", "stage_loss",
           "microbatch_rows", "check_meshes", "check_graph_weights", "input_grad"]


def check_meshes(meshes) -> None:
    """Every stage's mesh is a Mesh of one shape: each rank sends its shard to the rank at
    its place in the next stage's mesh (as under torch.distributed, where each process
    has one partner).  Stage meshes of two sizes moved the data, but the trace recorded
    only the pairs the shorter mesh has: a (2,)-rank stage sending to a (1,)-rank one
    showed rank 1 sending nothing."""
    from ...sim_mesh.mesh import Mesh
    for i, mesh in enumerate(meshes):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"meshes[{i}] is a {type(mesh).__name__}: give one wb.Mesh per "
                            f"pipeline rank, e.g. [wb.Mesh([r], ['pp']) for r in range(p)]")
    shapes = [tuple(mesh.shape) for mesh in meshes]
    if len(set(shapes)) > 1:
        i = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise ValueError(f"meshes[{i}] has shape {shapes[i]} and meshes[0] {shapes[0]}: "
                         "run_pipeline sends each rank's shard to the rank at its place in "
                         "the next stage's mesh, so every stage needs a mesh of one shape "
                         "(wb.recipes.hybrid.stage_meshes(dp, tp, pp) builds them)")


def check_sendable(out, slot: int) -> None:
    """A stage's output goes to the next stage's mesh: a DistTensor (it says where it is)."""
    if isinstance(out, (tuple, list, dict)):
        raise TypeError(f"stages[{slot}] returned a {type(out).__name__} of {len(out)}: "
                        "run_pipeline sends one DistTensor from a stage to the next; return "
                        "one tensor (torch.cat the outputs, or keep the stage boundary where "
                        "the model carries a single activation)")
    if not isinstance(out, DistTensor):
        raise TypeError(f"stages[{slot}] returned a {type(out).__name__}: run_pipeline sends "
                        "DistTensors from one stage's mesh to the next; parallelize each "
                        "stage's module on its mesh (wb.parallelize(module, meshes[r])) and "
                        "give DistTensor micro-batches (wb.shard_tensor(x, meshes[0], ['R'])), "
                        "as notebook 07 does")


def stage_loss(loss_fn, out, mb: int):
    """``loss_fn(out, mb)``, checked to be one number: each micro-batch backpropagates one
    scalar loss (a per-sample loss, ``reduction="none"``, raised deep inside with torch's
    "only one element tensors can be converted to Python scalars"; a Python float, an
    AttributeError)."""
    loss = loss_fn(out, mb)
    if not isinstance(loss, (torch.Tensor, DistTensor)):
        raise TypeError(f"loss_fn(output, {mb}) returned a {type(loss).__name__}: "
                        "run_pipeline backpropagates each micro-batch's loss, so loss_fn "
                        "must return a one-element tensor computed from the output "
                        "(e.g. F.cross_entropy(output, targets[i]))")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn(output, {mb}) returned a tensor of shape "
                         f"{tuple(loss.shape)}: run_pipeline backpropagates one scalar loss "
                         "per micro-batch (weighed 1/m); reduce it in loss_fn, e.g. "
                         "reduction='mean' (or loss.mean())")
    return loss


def check_weights(stages, params) -> None:
    """A split backward's ``W`` computes the gradients of ``params[slot]`` only: a trainable
    parameter of a module stage left out of them would silently get none.  Each entry is
    a list of the stage's tensors (a flat list of every stage's parameters gave a function
    stage's W one DistTensor to walk: no weight got a gradient, silently)."""
    for slot, ps in enumerate(params):
        if isinstance(ps, (torch.Tensor, DistTensor)) or not isinstance(ps, (list, tuple)) or \
                not all(isinstance(q, (torch.Tensor, DistTensor)) for q in ps):
            raise TypeError(f"params[{slot}] is a {type(ps).__name__}, not a list of "
                            "tensors: give one list per stage, "
                            "params=[list(stage.parameters()) for stage in stages]")
    for slot, st in enumerate(stages):
        if not isinstance(st, torch.nn.Module):
            continue                    # a function: its parameters are the caller's word
        given = {id(q) for q in params[slot]}
        missing = [n for n, q in st.named_parameters()
                   if q.requires_grad and id(q) not in given]
        if missing:
            raise ValueError(f"params[{slot}] leaves out {missing[:3]} of stages[{slot}]'s "
                             "trainable parameters: the split backward's W computes only the "
                             "listed ones, so these would get no gradient; pass "
                             f"list(stages[{slot}].parameters())")


def _rows(x):
    """The leading size of a micro-batch: of the tensor, or of the first tensor in a
    tuple, list or dict of them (stage 0 may take several inputs); None when none has
    a shape."""
    if isinstance(x, (tuple, list)):
        return next((r for r in map(_rows, x) if r is not None), None)
    if isinstance(x, dict):
        return _rows(list(x.values()))
    shape = getattr(x, "shape", None)
    return shape[0] if shape is not None and len(shape) else None


def microbatch_rows(x, mb: int, m: int):
    """``rng.rows`` of micro-batch ``mb`` of ``m`` (keyed dropout draws its rows of the
    batch's mask); no key for a micro-batch without a leading size."""
    from ...sim_mesh import rng
    n = _rows(x)
    return rng.rows(mb * n, m * n) if n is not None else contextlib.nullcontext()


def check_even_microbatches(inputs) -> None:
    """Each micro-batch's loss is scaled by 1/m, so the sum is the batch's mean (one
    device's loss) only when the micro-batches are the same size; keyed dropout rows
    assume it too."""
    rows = [_rows(x) for x in inputs]
    if None in rows or len(set(rows)) <= 1:
        return
    raise ValueError(f"inputs: micro-batches of {rows} rows; every micro-batch's loss "
                     f"weighs 1/m = 1/{len(rows)}, which gives the batch's mean only when they "
                     f"are the same size: split a batch whose size divides by m={len(rows)} "
                     f"(e.g. {sum(rows) - sum(rows) % len(rows)} rows) into equal "
                     "micro-batches")


def check_graph_weights(out, x, weights, slot: int) -> None:
    """The trainable tensors behind a stage's output (its autograd graph's leaves) must be
    its input or among ``weights``: a split backward's ``W`` computes only those, so a
    function stage's weight left out of ``params[slot]`` got no gradient, silently (a
    module stage is checked by :func:`check_weights` before the run)."""
    from .execute import _leaves
    t = out._local if isinstance(out, DistTensor) else out
    roots = [r for r in _storage_tensors(t) if r.grad_fn is not None]
    known = {id(q) for q in _leaves(list(weights))}
    known |= {id(q) for q in _leaves(_flat(x))}
    seen, todo, missing = set(), [r.grad_fn for r in roots], []
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)         # AccumulateGrad: a leaf
        if var is not None and id(var) not in known:
            missing.append(tuple(var.shape))
        todo.extend(f for f, _ in fn.next_functions)
    if missing:
        raise ValueError(f"stages[{slot}] computes with {len(missing)} trainable tensor(s) "
                         f"(local shapes {missing[:3]}) that params[{slot}] leaves out: the "
                         "split backward's W computes only the listed weights' gradients, "
                         f"so these would get none; add them to params[{slot}]")


def _flat(x) -> list:
    """The tensors and DistTensors in ``x`` (a stage input: one, or a tuple, list or dict)."""
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat(y)]
    if isinstance(x, dict):
        return _flat(list(x.values()))
    return [x] if isinstance(x, (torch.Tensor, DistTensor)) else []


def _storage_tensors(t):
    from .. import storage
    return storage.tensors(t) if not isinstance(t, torch.Tensor) else [t]


def input_grad(gx, s: int, slot: int, mb: int):
    """The gradient stage ``s`` sends back for micro-batch ``mb``, or a clear error when its
    input got none: ``stages[slot]`` computed its output without its input (or detached
    it), so nothing flows to the stages before it.  One device would leave their
    gradients None; the executor sends a gradient across every stage boundary, and the
    missing one failed as "'NoneType' object has no attribute 'placements'"."""
    if gx is None:
        raise ValueError(f"run_pipeline: stage {s}'s input got no gradient in micro-batch "
                         f"{mb}'s backward: stages[{slot}] computes its output without its "
                         "input (or detaches it), so the stages before it would get no "
                         "gradient; a pipeline sends a gradient back across every stage "
                         f"boundary. Fix: compute stage {s}'s output from its input, or move "
                         "what it computes from constants into the stage where the "
                         "activation flows")
    return gx
