"""Which device the course runs on, said once at the top of every notebook.

    device = wb.npu.course_device()
    # workbench: simulated ranks on cpu (no Ascend NPU or CUDA device found)

On an Ascend machine (torch_npu and CANN installed) or a CUDA one, the simulated
ranks' tensors live on that device: the notebook's tensors are created there by
default, so the same notebook runs unchanged.  On a CPU everything stays as is.
"""
from __future__ import annotations

import torch

from .device import device as best_device
from .device import probe

__all__ = ["course_device"]


def course_device(use_accelerator: bool = True, verbose: bool = True) -> torch.device:
    """The device the course's tensors use, made torch's default when it is an
    accelerator; prints one line saying which (and why, when it is the CPU)."""
    dev = best_device() if use_accelerator else torch.device("cpu")
    if dev.type != "cpu":
        torch.set_default_device(dev)
        why = ""
    elif not use_accelerator:
        why = " (asked for)"
    else:
        p = probe()
        why = (" (no Ascend NPU or CUDA device found)" if p.imported or not p.installed else
               f" (torch_npu did not load: {p.error})")
    if verbose:
        print(f"workbench: simulated ranks on {dev}{why}")
    return dev
