"""Placements, DistTensor, reshard plans, SPMD rules and parallel strategies."""
from .placement import Placement, Replicate, Shard, Partial
from .dist_tensor import DistTensor, TensorSpec, shard_tensor, from_local, distribute_tensor
from .reshard import Step, Plan, plan_reshard, reshard
from . import rules
from .rules import register_rule, Strategy, Decision, NoRuleError, infer
from .dispatch import allow_replicate_fallback
from .explain import explain, Explanation
from .module import parallelize, dist_parameters
from .distribute_module import distribute_module
from .local_map import local_map
from .dtensor_api import zeros, ones, empty, full, rand, randn  # torch.distributed.tensor's factories
from .clip_grad import clip_grad_norm_, clip_grad_value_, get_total_norm
from . import clip_grad_torch as _clip_grad_torch  # noqa: E402
_clip_grad_torch.install()      # torch.nn.utils.clip_grad_norm_ & co. take DistTensors
from . import foreach_ops as _foreach_ops  # noqa: E402
_foreach_ops.install()          # torch._foreach_* / AveragedModel's grouping take DistTensors
from . import lazy_dynamo as _lazy_dynamo  # noqa: E402
_lazy_dynamo.install()          # torch.optim in eager mode without importing torch._dynamo
from . import optim_dist as _optim_dist  # noqa: E402
_optim_dist.install()           # torch.optim steps DistTensor parameters, as DTensor ones
from .tp_styles import ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel
from .tp_prepare import PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput
from .tp_api import parallelize_module
from .tp_loss import loss_parallel
from . import interop
from . import tensor_methods as _tensor_methods
from . import ops_table

ops_table.load()
_tensor_methods.install(DistTensor)
from . import custom_function as _custom_function       # Function.apply on DistTensors
_custom_function.install()

__all__ = ["Placement", "Replicate", "Shard", "Partial", "DistTensor", "TensorSpec",
           "shard_tensor", "from_local", "Step", "Plan", "plan_reshard", "reshard", "rules",
           "register_rule", "Strategy", "Decision", "NoRuleError", "infer",
           "allow_replicate_fallback", "explain", "Explanation", "parallelize",
           "dist_parameters", "interop", "clip_grad_norm_", "clip_grad_value_", "get_total_norm",
           "distribute_tensor", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
           "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
           "PrepareModuleInputOutput", "parallelize_module", "loss_parallel",
           "distribute_module", "local_map"]
