"""``python -m workbench doctor``: what this machine has, and why.

:func:`report` gathers plain data (a :class:`Report`); ``str(report())`` is the
readable page; :func:`main_doctor` prints it.  Every "no" comes with the reason
found and, where one is known, the fix.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from .device import _best_device, device_count, dist_backend, is_available, probe

__all__ = ["Report", "report", "main_doctor"]

_CANN_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH",
              "ASCEND_AICPU_PATH", "ASCEND_RT_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Report:
    """Everything the doctor found; plain data (``dataclasses.asdict`` works)."""
    python: str
    platform: str
    torch: str                      # torch.__version__
    autoload: str                   # TORCH_DEVICE_BACKEND_AUTOLOAD as seen now
    torch_npu: str                  # "not installed" | "imported" | "import failed"
    torch_npu_version: str | None
    torch_npu_error: str | None     # the exception text when the import failed
    torch_npu_cause: str | None     # its chained cause (often the missing library)
    cann_env: dict[str, str]        # the ASCEND_* variables that are set
    npu_available: bool
    npu_count: int
    cuda_available: bool
    cuda_count: int
    cuda_version: str | None        # the CUDA torch was built with
    device: str                     # what workbench.npu.device() picks
    dist_backend: str               # what workbench.npu.dist_backend() picks
    dist_backends: dict[str, bool]  # torch.distributed backends this torch can use
    notes: tuple[str, ...]          # why things are as they are, and fixes

    def as_dict(self) -> dict:
        return asdict(self)

    def _cuda_line(self) -> str:
        if self.cuda_available:
            return f"{self.cuda_count} device(s), CUDA {self.cuda_version}"
        if self.cuda_version:
            return f"none (torch built with CUDA {self.cuda_version})"
        return "none (CPU build of torch)"

    def __str__(self) -> str:
        npu = self.torch_npu + (f" ({self.torch_npu_version})" if self.torch_npu_version else "")
        rows = [
            ("python", f"{self.python} on {self.platform}"),
            ("torch", self.torch),
            ("TORCH_DEVICE_BACKEND_AUTOLOAD", self.autoload),
            ("torch_npu", npu),
        ]
        if self.torch_npu_error:
            rows.append(("  error", self.torch_npu_error))
        if self.torch_npu_cause:
            rows.append(("  caused by", self.torch_npu_cause))
        rows += [
            ("CANN environment", ", ".join(f"{k}={v}" for k, v in self.cann_env.items())
             or "none of " + ", ".join(_CANN_VARS[:3]) + " is set"),
            ("Ascend NPU", f"{self.npu_count} device(s)" if self.npu_available else "none"),
            ("CUDA", self._cuda_line()),
            ("device", self.device),
            ("distributed", f"{self.dist_backend} (available: " + ", ".join(
                k for k, ok in self.dist_backends.items() if ok) + ")"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["workbench doctor", *(f"  {k:<{width}}  {v}" for k, v in rows)]
        lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def _notes(found, npu_ok: bool, torch_version: str, npu_version: str | None) -> list[str]:
    notes = []
    text = " ".join(filter(None, (found.error, found.cause)))
    if not found.installed:
        notes.append("torch_npu is not installed: no Ascend backend (pip install torch-npu "
                     "to add one; it pins torch exactly).")
    elif found.error:
        if "libhccl" in text or "libascend" in text or ".so" in text:
            notes.append("torch_npu cannot find the CANN libraries. Fix: install the CANN "
                         "toolkit and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
                         "before starting Python.")
        elif "Two accelerators" in text:
            notes.append("this torch is a CUDA build and torch_npu refuses to load beside it. "
                         "Fix: install the CPU build of the torch version torch_npu pins.")
        else:
            notes.append("torch_npu failed to import; the error above is verbatim.")
        notes.append("CPU work is unaffected: workbench falls back to the CPU.")
    elif npu_version and npu_version.split("+")[0].split(".")[:2] != \
            torch_version.split("+")[0].split(".")[:2]:
        notes.append(f"torch {torch_version} and torch_npu {npu_version} differ: torch_npu "
                     "pins torch exactly; install matching versions.")
    if found.imported and not npu_ok:
        notes.append("torch_npu imported but sees no device: check the driver (npu-smi info) "
                     "and ASCEND_RT_VISIBLE_DEVICES.")
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") not in (None, "0"):
        notes.append("TORCH_DEVICE_BACKEND_AUTOLOAD is on: a broken torch_npu would break "
                     "`import torch`; workbench sets it to 0 unless you set it.")
    return notes


def report() -> Report:
    """Probe torch, torch_npu, CANN, CUDA and torch.distributed; return what was found."""
    found = probe()
    npu_ok = is_available()
    npu_version = getattr(found.module, "__version__", None) if found.imported else None
    dist = torch.distributed
    backends = {}
    for name in ("gloo", "nccl", "hccl", "mpi"):
        try:
            backends[name] = bool(dist.is_available() and dist.is_backend_available(name))
        except Exception:   # noqa: BLE001 - an unknown backend name is simply unavailable
            backends[name] = False
    cuda_ok = torch.cuda.is_available()
    dev = _best_device()
    return Report(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        torch=torch.__version__,
        autoload=os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "<unset>"),
        torch_npu=("imported" if found.imported else
                   "import failed" if found.installed else "not installed"),
        torch_npu_version=npu_version,
        torch_npu_error=found.error,
        torch_npu_cause=found.cause,
        cann_env={k: os.environ[k] for k in _CANN_VARS if k in os.environ},
        npu_available=npu_ok,
        npu_count=device_count(),
        cuda_available=cuda_ok,
        cuda_count=torch.cuda.device_count() if cuda_ok else 0,
        cuda_version=torch.version.cuda,
        device=str(dev),
        dist_backend=dist_backend(dev),
        dist_backends=backends,
        notes=tuple(_notes(found, npu_ok, torch.__version__, npu_version)),
    )


def main_doctor() -> int:
    """Print :func:`report` (the body of ``python -m workbench doctor``); exit code 0."""
    print(report())
    sys.stdout.flush()
    return 0
