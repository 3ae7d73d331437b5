"""Keep ``import torch`` from auto-loading torch_npu.

On torch >= 2.5 an installed torch-npu registers itself as a ``torch.backends``
entry point, and ``import torch`` imports it.  Without the CANN toolkit that
import fails ("libhccl.so: cannot open shared object file") and takes
``import torch`` down with it.  Setting ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
*before torch is imported* turns the auto-load off; :mod:`workbench.npu.device`
then imports torch_npu itself, inside a ``try``, and falls back to CPU.

Import this module first thing (``workbench/__init__.py`` and
``workbench/npu/__init__.py`` do).  It uses ``setdefault``: a user who sets the
variable explicitly keeps their choice.
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
