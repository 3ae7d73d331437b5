"""PyTorch's tensor-parallel API on DistTensors: ``parallelize_module`` and the ParallelStyles.

    from workbench import (parallelize_module, ColwiseParallel, RowwiseParallel,
                           SequenceParallel, PrepareModuleInput, Replicate, Shard)
    mesh = wb.Mesh.grid((2, 4), ["dp", "tp"])
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),          # wk, wv the same
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    })

The styles mean what torch's mean (``torch/distributed/tensor/parallel/style.py`` and
``api.py``, torch 2.13; torchtitan's ``apply_tp`` is the canonical plan): parameters laid
out (Linear and Embedding as torch lays them out), a forward pre-hook bringing inputs from
``input_layouts`` to the layout the style computes in, a forward hook bringing outputs to
``output_layouts``.  A layout is one placement for the tensor-parallel mesh dim (ours, or
torch's ``torch.distributed.tensor`` placements); torch's own style objects are accepted
too (:mod:`.tp_from_torch`).  What one process that simulates every
rank changes, each said where it happens:

* ``device_mesh``: a 1-d Mesh as torch, or an n-d one with ``mesh_dim`` (default: the dim
  named "tp") naming the tensor-parallel dim; the other mesh dims are Replicate for the
  parameters and left as they are for DistTensor inputs.  Torch takes only a 1-d mesh
  (``world_mesh["tp"]``); here ``mesh["tp"]`` is the sub-mesh of the first data-parallel
  group only, so the whole mesh is passed.
* A plain ``torch.Tensor`` input is the GLOBAL tensor (the simulator holds every rank's
  data), laid out by ``input_layouts`` on the tp dim (replicated on the others); torch
  reads it as this rank's local shard (``DTensor.from_local``), and so do we under
  torchrun (one rank per process).  A DistTensor input is moved from its own placement
  to the one the style needs (torch trusts input_layouts).
* ``use_local_output``: there is no per-rank tensor to hand a caller, so outputs stay
  DistTensors whatever it says.  Torch code written for local shards with ``view(B, S,
  -1, head_dim)`` runs unchanged and every op gives the global answer (what the torch
  program computes over its ranks); code that spells out a local size (``n_heads // tp``)
  raises a shape error here rather than computing something else.
* A plan key that matches no submodule raises (torch warns and skips it).

Communication follows Megatron-LM (Shoeybi et al. 2019, sec. 3; Korthikanti et al. 2022
for sequence parallelism): an input brought to Replicate enters the tp region through
Megatron's ``f`` (:func:`.strategies.tensor_parallel.megatron_f`: from Shard(seq) an
all-gather whose backward is a reduce-scatter; from Replicate a copy whose backward is one
all-reduce), and the partial sums of a row-parallel output leave through ``g`` (an
all-reduce, or a reduce-scatter onto Shard(1)).  As in torch, a linear keeps the
all-gathered input for its weight gradient (``megatron_f(regather=False)``), where
Megatron-LM's recipe keeps the sequence shard and all-gathers it again in backward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from ..sim_mesh.mesh import Mesh
from . import storage
from .dist_tensor import DistTensor, from_local, shard_tensor
from .module import parallelize
from .placement import Placement, Replicate, Shard, normalize_placements
from .reshard import reshard
from .strategies.tensor_parallel import megatron_f

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"]


# ---- layouts -----------------------------------------------------------------------------

def _placement(p, arg: str, none_ok: bool = False):
    """One placement (ours or torch's), or None where a placeholder is allowed."""
    if p is None and none_ok:
        return None
    if isinstance(p, Placement):
        return p
    if type(p).__module__.startswith("torch.distributed"):
        from .interop import from_dtensor_placements
        return from_dtensor_placements([p])[0]
    raise TypeError(f"{arg}={p!r}: expected a placement such as Replicate() or Shard(1)"
                    + (", or None for an input left as it is" if none_ok else ""))


def _layouts(v, arg: str):
    """A placement or a tuple of them (None placeholders allowed) as a tuple, or None."""
    if v is None:
        return None
    if isinstance(v, (tuple, list)):
        return tuple(_placement(p, f"{arg}[{i}]", none_ok=True) for i, p in enumerate(v))
    return (_placement(v, arg),)


def _check_bool(v, arg: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{arg}={v!r}: expected True or False")
    return v


def _put(x, mesh: Mesh, md: int, p: Placement, what: str, enter: bool = False):
    """``x`` laid out with ``p`` on mesh dim ``md``: a DistTensor moved there (``enter``:
    an input brought to Replicate goes through Megatron's f, so its gradient is reduced
    once, where DTensor's redistribute backward reduces it), a plain tensor taken as the
    global tensor (under torchrun: as this process's shard)."""
    if isinstance(x, DistTensor):
        if x.mesh != mesh:
            raise ValueError(f"{what} lives on {x.mesh}, the module's parameters on {mesh}: "
                             "parallelize_module on the mesh the inputs live on (an n-d mesh "
                             "with mesh_dim='tp', not mesh['tp'])")
        ps = list(x.placements)
        ps[md] = p
        ps = normalize_placements(ps, mesh, x.ndim, arg=what)
        if enter and ps[md].is_replicate() and x.requires_grad and torch.is_grad_enabled():
            cur = x.placements[md]
            if cur.is_partial():
                x = reshard(x, mesh, ps)
                cur = ps[md]
            # regather=False: the linears keep the gathered input, as DTensor's autograd
            # does (the redistributed Replicate input is what aten.mm saves); Megatron-LM's
            # recipe (strategies.tensor_parallel) keeps the shard and gathers it again
            return megatron_f(x, md, sp=cur.is_shard(),
                              seq_dim=cur.dim if cur.is_shard() else 1, regather=False)
        return x if ps == x.placements else reshard(x, mesh, ps)
    if isinstance(x, torch.Tensor):
        ps = [Replicate()] * mesh.ndim
        ps[md] = p
        ps = normalize_placements(ps, mesh, x.dim(), arg=what)
        if storage.holds_own(mesh):         # torchrun: this process's shard, as torch's
            return from_local(x, mesh, ps, check_replicas=False)
        return shard_tensor(x, mesh, ps)
    raise TypeError(f"{what} is a {type(x).__name__}: expected a torch.Tensor or DistTensor "
                    "(give None as its layout to leave it as it is)")


# ---- the styles --------------------------------------------------------------------------

class ParallelStyle(ABC):
    """How ``parallelize_module`` parallelizes one module (torch's contract: ``_apply``)."""

    _lays_params = False             # lays out the module's parameters (one such per module)

    def _check(self, module: nn.Module) -> None:
        """Raise if this style cannot apply to ``module`` (before anything changes)."""
        if self._lays_params:
            for name, p in module.named_parameters():
                if isinstance(p, DistTensor):
                    raise ValueError(f"{type(self).__name__} on a {type(module).__name__} "
                                     f"whose parameter {name!r} is already a DistTensor "
                                     f"{p.placements}: apply one style per module")

    def _planned(self, module: nn.Module) -> list:
        """(name, parameter, placement on the tp dim) of each parameter this style lays out."""
        return []

    @abstractmethod
    def _apply(self, module: nn.Module, mesh: Mesh, md: int) -> nn.Module: ...

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def _shard_params(module: nn.Module, mesh: Mesh, md: int, places: dict) -> None:
    """Lay out ``module``'s parameters: ``places`` maps a parameter name to its placement on
    the tp dim (Replicate on the other mesh dims)."""
    plan = {}
    for name, p in places.items():
        if module._parameters.get(name) is not None:
            plan[name] = [Replicate()] * mesh.ndim
            plan[name][md] = p
    parallelize(module, mesh, plan, mesh_dim=md)


class _LinearOrEmbedding(ParallelStyle):
    """Colwise / Rowwise: an nn.Linear or nn.Embedding, one input, one output."""

    _lays_params = True

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = (_placement(input_layouts or self._in, "input_layouts"),)
        self.output_layouts = (_placement(output_layouts or self._out, "output_layouts"),)
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def _check(self, module):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise NotImplementedError(
                f"{type(self).__name__} currently only support nn.Linear and nn.Embedding! "
                f"(got a {type(module).__name__}); give its parent PrepareModuleInput / "
                "PrepareModuleOutput, or SequenceParallel for a norm or dropout")
        super()._check(module)

    def _planned(self, module):
        places = (self._linear() if isinstance(module, nn.Linear) else self._embedding())[0]
        return [(n, module._parameters[n], p) for n, p in places.items()
                if module._parameters.get(n) is not None]

    def _apply(self, module, mesh, md):
        places, want = self._linear() if isinstance(module, nn.Linear) else self._embedding()
        _shard_params(module, mesh, md, places)
        given, out = self.input_layouts[0], self.output_layouts[0]
        name = type(self).__name__

        def pre(mod, args, kwargs):
            if not args:
                raise TypeError(f"{name}: {type(mod).__name__} called with no positional input")
            x = args[0]
            if not isinstance(x, DistTensor):
                x = _put(x, mesh, md, given, f"{name} input")
            return (_put(x, mesh, md, want, f"{name} input", enter=True), *args[1:]), kwargs

        def post(mod, args, y):
            return _put(y, mesh, md, out, f"{name} output")
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)
        return module


class ColwiseParallel(_LinearOrEmbedding):
    """Column-wise: Linear weight and bias Shard(0) (output features split), Embedding
    weight Shard(1); input Replicate (default ``input_layouts``), output Shard(-1) by default."""
    _in, _out = Replicate(), Shard(-1)

    def _linear(self):
        return {"weight": Shard(0), "bias": Shard(0)}, Replicate()

    def _embedding(self):
        return {"weight": Shard(1)}, Replicate()


class RowwiseParallel(_LinearOrEmbedding):
    """Row-wise: Linear weight Shard(1) and bias Replicate (input features split: partial
    sums), input Shard(-1); Embedding weight Shard(0) (vocabulary split), input Replicate.
    The partial output goes to ``output_layouts`` (default Replicate: an all-reduce;
    Shard(1): a reduce-scatter)."""
    _in, _out = Shard(-1), Replicate()

    def _linear(self):
        return {"weight": Shard(1), "bias": Replicate()}, Shard(-1)

    def _embedding(self):
        return {"weight": Shard(0)}, Replicate()


class SequenceParallel(ParallelStyle):
    """Parameters replicated, the input sharded on ``sequence_dim`` (a plain tensor input
    is the global activation, sharded here), the output as the module computes it
    (Shard(sequence_dim) for a norm or dropout).  Any module type, as torch's (meant for
    LayerNorm, RMSNorm, Dropout): an op that needs the whole sequence gets it by the SPMD
    rules, never a wrong number."""

    _lays_params = True

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        if type(sequence_dim) is not int:
            raise TypeError(f"sequence_dim={sequence_dim!r}: expected an int (a tensor dim)")
        self.sequence_dim = sequence_dim
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def _planned(self, module):
        return [(n, p, Replicate()) for n, p in module.named_parameters()]

    def _apply(self, module, mesh, md):
        _shard_params(module, mesh, md, {})
        p = Shard(self.sequence_dim)

        def pre(mod, args, kwargs):
            if not args:
                raise TypeError("SequenceParallel: module called with no positional input")
            return (_put(args[0], mesh, md, p, "SequenceParallel input"), *args[1:]), kwargs
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module
