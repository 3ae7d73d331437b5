"""``local_map(func, out_placements, in_placements, ...)``: run a function written for
plain tensors on each rank's local shards, and lay its outputs out as DistTensors
(DTensor's ``torch.distributed.tensor.experimental.local_map``, torch 2.13).

    row_sum = wb.parallel.local_map(lambda x: x.sum(0), out_placements=[wb.Partial()],
                                    in_placements=([wb.Shard(0)],))
    row_sum(wb.distribute_tensor(x, mesh, [wb.Shard(0)])).full_tensor()   # == x.sum(0)

What the simulator changes: every rank lives in this one process, so ``func`` runs once
per rank, in mesh order, on that rank's local shards (a plain tensor argument is given
to every call as it is, as every process would pass its own); the outputs of the ranks
are put together by :func:`from_local` (uneven shards included; Replicate outputs that
differ between ranks raise).  Gradients flow through each call to each rank's shard; a
replicated input's gradient is the sum of the ranks' (what ``in_grad_placements``
``Partial()`` declares in torch; torch's default declares the ranks' gradients equal).
Under torchrun ``func`` runs once, on this process's shards, as torch's.
"""
from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from . import storage
from .dist_tensor import DistTensor, from_local
from .placement import normalize_placements

__all__ = ["local_map"]


def local_map(func=None, out_placements=None, in_placements=None, in_grad_placements=None,
              device_mesh=None, *, redistribute_inputs: bool = False):
    """``func`` wrapped to take DistTensors (see the module docstring); without ``func``,
    a decorator.  ``out_placements``: one placements list per output (one list alone for
    a single output; None for a non-tensor output).  ``in_placements``: one per flattened
    input (None for non-tensors): DistTensors in another layout raise, or are resharded
    with ``redistribute_inputs=True``."""
    if func is None:
        return functools.partial(local_map, out_placements=out_placements,
                                 in_placements=in_placements,
                                 in_grad_placements=in_grad_placements,
                                 device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    if not callable(func):
        raise TypeError(f"local_map(func={func!r:.60}): expected a function")

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        return _run(func, out_placements, in_placements, in_grad_placements, device_mesh,
                    redistribute_inputs, args, kwargs)
    return wrapped


def _is_placements(x) -> bool:
    from .placement import Placement
    return isinstance(x, (list, tuple)) and all(isinstance(p, Placement) for p in x) and \
        len(x) > 0


def _run(func, out_placements, in_placements, in_grad_placements, mesh, redistribute,
         args, kwargs):
    from .reshard import reshard
    flat, spec = pytree.tree_flatten(args)
    for name, given in (("in_placements", in_placements),
                        ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat):
            raise ValueError(f"local_map({name}): {len(given)} entries for {len(flat)} input "
                             "arguments (flattened); give one per argument, None for "
                             "non-tensors")
    dists = []
    for i, a in enumerate(flat):
        if not isinstance(a, DistTensor):
            if in_placements is not None and in_placements[i] is not None and \
                    not isinstance(a, torch.Tensor):
                raise ValueError(f"local_map: argument {i} ({type(a).__name__}) is not a "
                                 f"tensor but in_placements gives it {in_placements[i]}; "
                                 "give None")
            continue
        if mesh is None:
            mesh = a.mesh
        if a.mesh != mesh:
            raise ValueError(f"local_map: argument {i} lives on {a.mesh}, another mesh than "
                             f"{mesh}; reshard it first")
        if in_placements is not None:
            if in_placements[i] is None:
                raise ValueError(f"local_map: argument {i} is a DistTensor but in_placements "
                                 "gives it None; give its placements")
            want = normalize_placements(in_placements[i], mesh, a.ndim, "in_placements")
            if tuple(want) != a.placements:
                if not redistribute:
                    raise ValueError(
                        f"local_map: argument {i} has placements "
                        f"{[str(p) for p in a.placements]} but in_placements gives "
                        f"{[str(p) for p in want]}; reshard it, or pass "
                        "redistribute_inputs=True")
                a = flat[i] = reshard(a, mesh, want)
        if in_grad_placements is not None and in_grad_placements[i] is not None:
            normalize_placements(in_grad_placements[i], mesh, a.ndim, "in_grad_placements")
        dists.append(i)
    if not dists:
        return func(*args, **kwargs)            # as torch: no DistTensor, a plain call
    own = storage.holds_own(mesh)
    ranks = [None] if own else list(mesh.ranks)
    outs = []
    for r in ranks:
        local = [a.local(r) if isinstance(a, DistTensor) else a for a in flat]
        outs.append(pytree.tree_flatten(func(*pytree.tree_unflatten(local, spec), **kwargs)))
    flat_out, out_spec = outs[0]
    specs = (out_placements,) if _is_placements(out_placements) or out_placements is None \
        else tuple(out_placements)
    if len(specs) != len(flat_out):
        raise ValueError(f"local_map(out_placements={out_placements!r:.80}): "
                         f"{len(specs)} placements for {len(flat_out)} outputs; give one "
                         "placements list per output (None for a non-tensor output)")
    result = []
    for k, (o, ps) in enumerate(zip(flat_out, specs)):
        if isinstance(o, DistTensor):
            raise TypeError(f"local_map: output {k} of func is a DistTensor; func runs on "
                            "local torch.Tensors and returns torch.Tensors")
        if not isinstance(o, torch.Tensor):
            if ps is not None:
                raise ValueError(f"local_map: output {k} ({type(o).__name__}) is not a tensor "
                                 f"but out_placements gives it {ps}; give None")
            result.append(o)
            continue
        if ps is None:
            raise ValueError(f"local_map: output {k} is a tensor but out_placements gives "
                             "it None; give its placements")
        if own:
            result.append(from_local(o, mesh, ps, check_replicas=False))
        else:
            result.append(from_local([out[0][k] for out in outs], mesh, ps))
    return pytree.tree_unflatten(result, out_spec)
