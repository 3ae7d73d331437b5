"""Which accelerator is here, found without ever failing an import.

The rule (see ``/work/shared/reference/torch_npu.md``, "Loading"): with
auto-load off (:mod:`workbench.npu._autoload`), ``import torch_npu`` inside a
``try``; any exception means "no NPU", and its text is kept so that
:func:`workbench.npu.report` can say *why*.  The probe runs once, lazily, on the
first question asked (``is_available()``, ``device()``, ``report()``), never
at ``import workbench``.

    >>> import workbench.npu as npu
    >>> npu.device()            # npu:0 on Ascend, cuda on NVIDIA, else cpu
    >>> npu.dist_backend()      # "hccl" | "nccl" | "gloo"
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = ["Probe", "probe", "torch_npu_module", "is_available", "device_count",
           "device", "device_type", "dist_backend"]


@dataclass(frozen=True)
class Probe:
    """What ``import torch_npu`` did: the module, or why there is none."""
    module: ModuleType | None   # torch_npu itself when the import worked
    installed: bool             # False: no torch_npu on sys.path at all
    error: str | None           # "ImportError: libhccl.so: ..." when the import failed
    cause: str | None           # the chained exception (__cause__), often the real reason

    @property
    def imported(self) -> bool:
        return self.module is not None


_probe: Probe | None = None


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def probe(refresh: bool = False) -> Probe:
    """Try ``import torch_npu`` once and remember the outcome.

    ``refresh=True`` forgets the remembered outcome and tries again (used by
    tests that install a stand-in ``torch_npu`` in ``sys.modules``).
    """
    global _probe
    if _probe is not None and not refresh:
        return _probe
    try:
        module = importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            _probe = Probe(None, False, None, None)
        else:   # torch_npu is there but one of its own imports is missing
            _probe = Probe(None, True, _describe(exc), _describe(exc.__cause__))
    except Exception as exc:   # noqa: BLE001 - any failure means "no NPU", reported verbatim
        _probe = Probe(None, True, _describe(exc), _describe(exc.__cause__ or exc.__context__))
    else:
        _probe = Probe(module, True, None, None)
    return _probe


def torch_npu_module() -> ModuleType:
    """The imported torch_npu, or a RuntimeError that says why there is none."""
    found = probe()
    if found.module is not None:
        return found.module
    if not found.installed:
        raise RuntimeError("torch_npu is not installed, so the 'npu' backend cannot run. "
                           "Fix: pip install torch-npu (it pins torch exactly), or use "
                           "wb.ops.use('native') / wb.ops.use('reference').")
    raise RuntimeError(f"torch_npu is installed but failed to import ({found.error}"
                       f"{'; caused by ' + found.cause if found.cause else ''}). "
                       "Run `python -m workbench doctor` for the fix.")


def _npu_namespace():
    """``torch.npu`` (registered by torch_npu) or ``torch_npu.npu``; None without torch_npu."""
    module = probe().module
    if module is None:
        return None
    return getattr(torch, "npu", None) or getattr(module, "npu", None)


def is_available() -> bool:
    """True when torch_npu imports and at least one Ascend device is visible."""
    ns = _npu_namespace()
    try:
        return bool(ns is not None and ns.is_available())
    except Exception:   # noqa: BLE001 - a driver error means "not available"
        return False


def device_count() -> int:
    """Visible Ascend devices (``ASCEND_RT_VISIBLE_DEVICES`` is honoured by torch_npu)."""
    return int(_npu_namespace().device_count()) if is_available() else 0


def device() -> torch.device:
    """The device to compute on: ``npu:0`` on Ascend, ``cuda`` on NVIDIA, else ``cpu``."""
    return _best_device()


def _best_device() -> torch.device:
    if is_available():
        return torch.device("npu", 0)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_type(device: torch.device | str) -> str:
    """``"npu"`` for ``"npu:1"`` or ``torch.device("npu", 1)``.

    Strings are parsed here, not by ``torch.device``: "npu" is a device type
    torch only knows once torch_npu has loaded.
    """
    return device.split(":")[0] if isinstance(device, str) else torch.device(device).type


_DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def dist_backend(device: torch.device | str | None = None) -> str:
    """The torch.distributed backend for ``device`` (default: :func:`device`).

    ``"hccl"`` on Ascend, ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
    """
    if device is None:
        device = _best_device()
    kind = device_type(device)
    try:
        return _DIST_BACKENDS[kind]
    except KeyError:
        raise ValueError(f"dist_backend(device={str(device)!r}): no torch.distributed backend "
                         f"is known for device type {kind!r}; use one of "
                         f"{sorted(_DIST_BACKENDS)}") from None
