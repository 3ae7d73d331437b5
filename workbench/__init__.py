"""workbench: learn how large models are trained across many devices.

    import workbench as wb
    mesh = wb.Mesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    x = wb.shard_tensor(torch.randn(8, 6), mesh, [wb.Shard(0), wb.Replicate()])
    with wb.trace(profile="ascend-910b") as tr:
        y = wb.reshard(x, mesh, [wb.Replicate(), wb.Shard(1)])
    print(wb.plan_reshard(x, mesh, ["R", "S(1)"]))

See the course in notebooks/ and the map in README.md.
"""
import os as _os

# torch_npu auto-loads on `import torch` (torch >= 2.5) and breaks it when the CANN
# toolkit is missing; workbench.npu imports torch_npu itself, guarded.
_os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from .sim_mesh import Mesh, Trace, Event, trace, current_trace, get_profile, list_profiles  # noqa: E402
from .sim_mesh import collectives  # noqa: E402
from .sim_mesh import init_device_mesh  # noqa: E402  DeviceMesh's constructor for a Mesh
from .parallel import (Placement, Replicate, Shard, Partial, DistTensor, TensorSpec,  # noqa: E402
                       shard_tensor, from_local, plan_reshard, reshard, Plan, Step,
                       register_rule, allow_replicate_fallback, explain, parallelize,
                       dist_parameters, clip_grad_norm_, clip_grad_value_)
from .parallel import distribute_tensor  # noqa: E402  DTensor's name for shard_tensor
from .parallel import distribute_module  # noqa: E402  DTensor's module API
from .parallel import (ParallelStyle, ColwiseParallel, RowwiseParallel,  # noqa: E402
                       SequenceParallel, PrepareModuleInput, PrepareModuleOutput,
                       PrepareModuleInputOutput, parallelize_module, loss_parallel)
from .parallel.strategies.ddp import DistributedDataParallel  # noqa: E402
from .parallel.strategies.fsdp import FullyShardedDataParallel  # noqa: E402
from .parallel.strategies.fully_shard import (fully_shard, MixedPrecisionPolicy,  # noqa: E402
                                              FSDPModule)
from .parallel.strategies.zero_optimizer import ZeroRedundancyOptimizer  # noqa: E402
from .parallel.strategies.rank_hooks import simulated_rank  # noqa: E402  a hook's rank
# a wrapped parameter's simulated storage (every rank's row or chunk): p.shape is the module's
from .parallel.strategies.laid_out_whole import storage as simulated_storage  # noqa: E402
from .parallel import rules as spmd  # noqa: E402  wb.spmd.infer(op, *specs, **attrs)
from .parallel import schedules  # noqa: E402  wb.schedules.one_f_one_b(p, m), ...
from . import ops, npu  # noqa: E402  (the parallel layer imports both already)
from .sim_mesh import backends as distributed  # noqa: E402  wb.distributed.init() under torchrun

# The layers above parallel are imported on first use (PEP 562 module __getattr__ below):
# every process that imports workbench (each torchrun worker, notebook kernel, subprocess)
# pays only for the layers it uses.  None of them registers anything at import that the
# layers below read (they import sim_mesh/parallel/ops, never the other way).
#   wb.plan.estimate(cfg, wb.plan.Layout(...), cluster)
#   wb.recipes.Hybrid(dp=2, tp=2, pp=2): models x strategies
#   wb.serve.generate(model, idx, n): KV cache, any layout
#   wb.compile(fn, *inputs, level="O1"): a callable package
#   wb.checkpoint.save / load (torch.distributed.checkpoint takes about 0.5 s to import)
_LAZY = ("exercises", "models", "plan", "recipes", "serve", "compile", "checkpoint")

__version__ = "0.1.0"
__all__ = ["Mesh", "Trace", "Event", "trace", "current_trace", "get_profile", "list_profiles",
           "collectives", "Placement", "Replicate", "Shard", "Partial", "DistTensor",
           "TensorSpec", "shard_tensor", "from_local", "plan_reshard", "reshard", "Plan", "Step",
           "register_rule", "allow_replicate_fallback", "spmd", "schedules", "explain",
           "parallelize", "dist_parameters", "clip_grad_norm_", "clip_grad_value_",
           "DistributedDataParallel", "distribute_tensor",
           "FullyShardedDataParallel", "ZeroRedundancyOptimizer", "ops", "npu", "exercises",
           "distributed", "models", "plan", "recipes", "compile", "checkpoint", "serve",
           "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
           "parallelize_module", "loss_parallel", "fully_shard", "MixedPrecisionPolicy",
           "FSDPModule", "init_device_mesh", "distribute_module", "simulated_storage",
           "simulated_rank"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
