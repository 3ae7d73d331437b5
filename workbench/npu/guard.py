"""A guard against float64 work on an Ascend NPU.

The NPU has no float64 kernels for most ops.  A float64 tensor sent there
either runs on the AI CPU (slow, often by orders of magnitude) or is silently
cast to float32 with a one-time "Device do not support double dtype now"
(``/work/shared/reference/torch_npu.md``, "Dtypes and slow paths").  Neither is
what a reader expects, so :func:`check_dtype` says so clearly, once per call
site: the first time a given line of user code sends float64 work to a given
site (for example ``wb.ops.rms_norm``), never again after that.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["NpuDtypeWarning", "check_dtype", "dtype_problem"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_warned: set[tuple[str, str, int]] = set()


class NpuDtypeWarning(UserWarning):
    """float64 work was sent to an NPU."""


def dtype_problem(dtype: torch.dtype, device_type: str) -> str | None:
    """Why ``dtype`` on ``device_type`` is a problem, or None when it is fine."""
    if device_type == "npu" and dtype in (torch.float64, torch.complex128):
        return (f"{dtype} on the NPU runs on the slow AI CPU or is silently cast to "
                "float32 ('Device do not support double dtype now')")
    return None


def _user_frame():
    """The innermost frame outside the workbench package: the user's call site."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return frame


def check_dtype(tensor: torch.Tensor, site: str) -> bool:
    """Warn once per call site when ``tensor`` is float64 on an NPU; True when it is.

    ``site`` names the work (``"wb.ops.rms_norm"``); the call site is that name
    plus the first line of code outside the workbench package, so a notebook
    cell that sends float64 to two ops hears about each once.
    Reads only ``tensor.dtype`` and ``tensor.device.type``: cheap on every path.
    """
    problem = dtype_problem(tensor.dtype, tensor.device.type)
    if problem is None:
        return False
    frame = _user_frame()
    key = (site, frame.f_code.co_filename, frame.f_lineno) if frame else (site, "?", 0)
    if key not in _warned:
        _warned.add(key)
        warnings.warn_explicit(
            f"{site}: {problem}. Fix: compute in float32 or bfloat16 on the NPU "
            f"(tensor.float()), and keep float64 reference checks on the CPU.",
            NpuDtypeWarning, key[1], key[2])
    return True
