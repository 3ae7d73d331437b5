"""An op's kernels in a compiled step, as the search prices them and the schedule lays
them out: one function for both, so the search's estimate and ``prog.step()`` count the
same kernels and launches.

Forward: one kernel, one launch.  Backward (an op the backward runs through): the
kernels ``pricing.backward_parts`` says autograd runs for the inputs that require grad
(the dispatcher records the same): one kernel and one launch, or for a two-operand
matmul whose cost the op table splits (``ops_table/pricing.py``'s :class:`SplitCost`)
its dgrad and wgrad GEMMs and a bias's sum, a kernel and a launch each, the
dgrad left out when the first input does not require grad (the graph's data), the wgrad
when the second does not (a frozen weight), the sum when the bias does not.  Each
kernel's time is the roofline time of its FLOPs and bytes (``pricing._time``, the
dispatcher's, a GEMM's with its shape), or the profile's measured time of the kernel
where it has one (the loss, ``loss_pricing``), without the launch; the launches are
priced apart (``profiles.launch_overhead``, as ``schedule.replay`` records
them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.ops_table import pricing
from ..parallel.ops_table.table import TABLE

__all__ = ["Kernels", "op_kernels", "launch_time"]


def launch_time(profile, dtype=torch.float32) -> float:
    """One host launch on ``profile`` (its compute path's launch term)."""
    return profile.compute_path(dtype)[3]


@dataclass(frozen=True)
class Kernels:
    cost: object                 # the op table's Cost on the busiest rank's local shapes
    dtype: torch.dtype           # the dtype the kernels are priced in
    forward: "tuple | None"      # (kernel seconds without launch, launches); None: no kernel
    backward: "tuple | None"     # the same for the backward; None: none (or not run)

    def time(self, profile) -> float:
        """Kernels plus launches, as ``schedule.replay`` records them (each launch on the
        kernels' dtype's path, as the dispatcher prices it: float64 on ascend-910b's AI
        CPU, profile ``slow_paths``)."""
        lt = launch_time(profile, self.dtype)
        return sum(k + n * lt for k, n in (self.forward or (0.0, 0), self.backward or (0.0, 0)))


def op_kernels(graph, mesh, profile, node, specs, cand, backward: bool) -> Kernels:
    """The kernels of ``node`` run with ``cand`` (module docstring); ``specs`` the inputs'
    specs (only their shapes and dtypes are read), ``backward`` whether the step's
    backward runs through the node."""
    entry = TABLE[node.op]
    ins = []
    for vid, c in zip(node.inputs, node.in_consts or (None,) * len(node.inputs)):
        if vid is None:
            ins.append(c)
        else:
            v = graph.values[vid]
            ins.append(torch.empty(v.shape, dtype=v.dtype, device="meta"))
    outs = [graph.values[o] for o in node.outs]
    out_dtypes = tuple(v.dtype for v in outs)
    cost = pricing.local_cost(entry, mesh, specs, ins, cand, tuple(v.shape for v in outs),
                              out_dtypes, node.attrs)
    dtype = pricing.pricing_dtype(specs, out_dtypes)
    lt = launch_time(profile, dtype)
    fwd = bwd = None
    # a kernel the profile measured (the loss: loss_pricing) at its measured price, launch
    # included, as the dispatcher records it (pricing.record_forward)
    measured = pricing._measured(cost, profile)
    if cost.flops or cost.bytes:
        t = measured[0] if measured else pricing._time(cost.flops, cost.bytes, profile,
                                                       dtype, entry.op_class,
                                                       getattr(cost, "gemm", None), launches=1)
        fwd = (max(t - lt, 0.0), 1)
    needs = tuple(vid is not None and graph.values[vid].requires_grad for vid in node.inputs)
    parts = pricing.backward_parts(cost, needs) if backward else []
    if parts and measured and len(parts) == 1:
        bwd = (max(measured[1] - lt, 0.0), 1)
    elif parts:                    # each kernel on its own roofline, as the dispatcher's
        bwd = (sum(max(pricing._time(f, b, profile, dtype, pricing.part_class(
            part, entry.op_class), gemm, launches=1) - lt, 0.0)
            for part, f, b, gemm in parts), len(parts))
    return Kernels(cost, dtype, fwd, bwd)
