"""``distribute_module(module, mesh, partition_fn, input_fn, output_fn)``: DTensor's
lowest-level module API (torch 2.13, ``torch/distributed/tensor/_api.py``) on DistTensors.

    def shard_rows(name, module, mesh):                 # torch's partition_fn, unchanged
        for pname, p in module.named_parameters(recurse=False):
            dist = nn.Parameter(wb.distribute_tensor(p, mesh, [wb.Shard(0)]))
            module.register_parameter(pname, dist)
    wb.parallel.distribute_module(model, mesh, shard_rows,
                                  input_fn=lambda mod, inputs, mesh: ...)

``partition_fn(name, submodule, mesh)`` runs on every sub-module (``named_modules``
order); every parameter it leaves a plain tensor is then replicated, as torch's.
``input_fn(module, inputs, mesh)`` runs as a forward pre-hook and ``output_fn(module,
outputs, mesh)`` as a forward hook (the two-argument forms ``input_fn(inputs, mesh)`` /
``output_fn(outputs, mesh)`` too, which torch deprecates).  What differs: buffers stay
plain tensors (an op between a DistTensor and a plain tensor reads the plain one as
replicated, which is what torch's replicated buffer DTensors hold), and
``nn.Parameter(d)`` stays a DistTensor, registered by the module (``isinstance(d,
nn.Parameter)`` is False: a DistTensor is not a torch.Tensor).
"""
from __future__ import annotations

import inspect
import warnings

from torch import nn

from ..sim_mesh.mesh import Mesh

__all__ = ["distribute_module"]


def _arity(fn, arg: str) -> int:
    n = len(inspect.signature(fn).parameters)
    if n not in (2, 3):
        raise ValueError(f"distribute_module({arg}={getattr(fn, '__name__', fn)!r}): expected "
                         f"a function of (module, {'inputs' if arg == 'input_fn' else 'outputs'}"
                         f", device_mesh), got one of {n} arguments")
    if n == 2:
        warnings.warn(f"distribute_module: {arg} of two arguments is deprecated (as in torch); "
                      "take (module, inputs/outputs, device_mesh)", FutureWarning, stacklevel=3)
    return n


def distribute_module(module: nn.Module, device_mesh: Mesh | None = None, partition_fn=None,
                      input_fn=None, output_fn=None) -> nn.Module:
    """Lay ``module``'s parameters out on ``device_mesh`` by ``partition_fn`` (default:
    replicate every one) and hook ``input_fn`` / ``output_fn`` around its forward.
    Returns ``module`` (changed in place)."""
    from .module import parallelize
    from .module_state import adopt
    if not isinstance(module, nn.Module):
        raise TypeError(f"distribute_module(module={type(module).__name__}): expected an "
                        "nn.Module")
    if not isinstance(device_mesh, Mesh):
        raise TypeError(f"distribute_module(device_mesh={device_mesh!r:.60}): give a workbench "
                        "Mesh, e.g. wb.init_device_mesh('cpu', (4,))")
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module should only be called once on a module, but it "
                           "has already been called on this module!")
    for arg, fn in (("partition_fn", partition_fn), ("input_fn", input_fn),
                    ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"distribute_module({arg}={fn!r:.60}): expected a function or None")
    n_in = _arity(input_fn, "input_fn") if input_fn is not None else 0
    n_out = _arity(output_fn, "output_fn") if output_fn is not None else 0
    if partition_fn is not None:
        adopt(module)       # register_parameter / setattr take DistTensors from here on
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, device_mesh)
    parallelize(module, device_mesh)        # what is still a plain parameter: replicated
    if input_fn is not None:
        if n_in == 3:
            module.register_forward_pre_hook(
                lambda mod, inputs: input_fn(mod, inputs, device_mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(inputs, device_mesh))
    if output_fn is not None:
        if n_out == 3:
            module.register_forward_hook(
                lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
        else:
            module.register_forward_hook(
                lambda mod, inputs, outputs: output_fn(outputs, device_mesh))
    module._distribute_module_applied = True
    return module
