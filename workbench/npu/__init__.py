"""The NPU layer: find the accelerator safely, guard dtypes, profile.

``_autoload`` runs first, before anything here imports torch: it turns off
torch's auto-loading of torch_npu so that a torch_npu without CANN cannot
break ``import torch`` (see :mod:`workbench.npu._autoload`).

    wb.npu.is_available()     # Ascend present and usable
    wb.npu.device()           # npu:0 | cuda:0 | cpu
    wb.npu.dist_backend()     # hccl | nccl | gloo
    print(wb.npu.report())    # what was found and why (python -m workbench doctor)
    wb.npu.check_dtype(t, "my_op")           # warns once about float64 on an NPU
    with wb.npu.profile("trace.json"): ...   # a Chrome trace, on any backend
"""
from . import _autoload  # noqa: F401  (must precede every torch import)
from .device import Probe, device, device_count, dist_backend, is_available, probe, torch_npu_module
from .doctor import Report, main_doctor, report
from .guard import NpuDtypeWarning, check_dtype, dtype_problem
from .profiler import Profile, profile
from .course import course_device

__all__ = ["Probe", "probe", "torch_npu_module", "is_available", "device_count", "device",
           "dist_backend", "Report", "report", "main_doctor", "NpuDtypeWarning", "check_dtype",
           "dtype_problem", "Profile", "profile", "course_device"]
