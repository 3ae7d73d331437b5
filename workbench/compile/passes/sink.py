"""Graph sink: launch the whole step at once.

Run op by op, the host launches every kernel (``profiles.launch_overhead`` each: 1 us on
an A100, the clock's figure; notebook 12).  A captured graph can be launched whole: CUDA
Graphs capture the step's kernels and replay them with one launch; on Ascend, graph mode
sinks the graph's tasks to the device (MindSpore's ``GRAPH_MODE`` with sink mode,
TorchAir's ``reduce-overhead`` / ``max-autotune`` modes for torch_npu).  On the clock:
every kernel's launch is dropped and one launch is paid for the graph.
"""
from __future__ import annotations

from .schedule_log import log_pass

__all__ = ["sink"]


def sink(prog, sched):
    new = sched.copy()
    n = 0
    for it in new.items:
        if it.kind == "compute" and it.launches:
            n += it.launches
            it.launches = 0
            it.tag = (it.tag + " sunk").strip()
    new.graph_launch = True
    return log_pass(prog, "sink", sched, new, f"{n} kernel launches replaced by one graph launch")
