"""Which of a GEMM's backward kernels a split backward's pass runs (zero-bubble ``B``/``W``).

A zero-bubble schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv
2401.10241, sec. 2) splits a stage's backward in two: ``B`` computes the input
gradients (every op's backward on the way from the stage's output to its input, each
GEMM's dgrad ``dA = dC B^T``), ``W`` the weight gradients (each GEMM's wgrad
``dB = A^T dC``).  The simulator runs ``B`` as ``torch.autograd.backward(out, g,
inputs=[stage input])``: autograd's engine then executes only the graph nodes on the way
to that input, and a GEMM's backward computes only the gradients the engine will use
(``Node::task_should_compute_output``).  So that the clock prices what runs, a GEMM
recorded in a trace notes the autograd node each of its inputs' gradients goes to (:func:`edges_of`), and its backward asks the engine which of them it will
execute now (:func:`running`, ``torch._C._will_engine_execute_node``, as
``torch.autograd.graph.register_multi_grad_hook`` does): ``B`` prices the dgrad (and
the gradient of any operand computed from the stage input), ``W``
(``sim_mesh.backward_pass.weight_pass``) the rest, and B + W is the GEMM's backward.
Ops priced as one backward kernel (a norm, a pointwise op) are priced whole by the pass
that runs them first (``B``), as Qi et al. keep them in ``B``.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from .. import storage

__all__ = ["edges_of", "running"]


def edges_of(inputs) -> "tuple | None":
    """Per input (local data in any form :mod:`..storage` holds, or a non-tensor): the
    autograd nodes its gradient goes to (a leaf's accumulator, else its ``grad_fn``).
    Noted for every GEMM, not only in a split backward: any backward into some inputs
    only (``torch.autograd.grad(loss, x)``, ``loss.backward(inputs=[x])``) skips the
    other inputs' GEMMs as a zero-bubble ``B`` does."""
    out = []
    for x in inputs:
        ts = storage.tensors(x) if isinstance(x, (torch.Tensor, storage.Cells)) else []
        out.append(tuple(_node(t) for t in ts if t.requires_grad))
    return tuple(out)


def _node(t):
    """``get_gradient_edge(t).node`` (torch 2.13, torch/autograd/graph.py:190-200,
    ``_get_grad_fn_or_grad_acc``): a non-leaf's ``grad_fn``, a leaf's accumulator.  Read
    directly: ``get_gradient_edge`` also makes an ownership token (a ``view_as``) for a
    Python-defined node, which only the edge holds and ``.node`` drops; one view per GEMM
    input per traced call, for nothing."""
    fn = t.grad_fn
    if fn is not None:
        return fn
    return get_gradient_edge(t).node      # a leaf: its accumulator (no token is made)


def _executes(node) -> bool:
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        # a leaf under torch.autograd.grad(inputs=...): torch does not say, but the
        # engine captures the gradient of exactly those leaves
        return True


def running(needs, edges) -> tuple:
    """``needs`` (per input: it requires grad) narrowed, during a backward, to the inputs
    whose gradient the running backward computes (some node of theirs executes)."""
    return tuple(bool(n) and i < len(edges) and any(_executes(e) for e in edges[i])
                 for i, n in enumerate(needs))
