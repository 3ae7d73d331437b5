"""Placements, DistTensor, reshard plans, SPMD rules and parallel strategies."""
from .placement import Placement, Replicate, Shard, Partial
from .dist_tensor import DistTensor, TensorSpec, shard_tensor, from_local
from .reshard import Step, Plan, plan_reshard, reshard

__all__ = ["Placement", "Replicate", "Shard", "Partial", "DistTensor", "TensorSpec",
           "shard_tensor", "from_local", "Step", "Plan", "plan_reshard", "reshard"]
