"""``torch.distributed.checkpoint.state_dict``'s helpers, for workbench's wrappers too.

    from workbench.checkpoint import get_state_dict, set_state_dict, StateDictOptions
    model_sd, optim_sd = get_state_dict(ddp, opt)        # one device's keys: no "module."
    wb.checkpoint.save("ckpt", {"model": model_sd, "optim": optim_sd})
    ...
    model_sd, optim_sd = get_state_dict(other, other_opt)  # any wrapper, any layout
    wb.checkpoint.load("ckpt", {"model": model_sd, "optim": optim_sd})
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

The six functions and :class:`StateDictOptions` are torch's (torch 2.13,
``torch/distributed/checkpoint/state_dict.py``; the options object is torch's own class),
with torch's semantics:

* keys are the unwrapped module's fully qualified names (FQNs): a DDP's ``module.``
  prefix and ``torch.compile``'s ``_orig_mod.`` are dropped, so a state dict moves between
  a plain module, ``wb.DistributedDataParallel``, ``wb.FullyShardedDataParallel``,
  ``wb.fully_shard``, ``ZeroRedundancyOptimizer`` and tensor-parallel modules;
* the optimizer's state dict is keyed by those FQNs (``{"state": {fqn: {...}},
  "param_groups": [{..., "params": [fqn, ...]}]}``), several optimizers merged in one;
  an optimizer that has taken no step yet gets its states first, as torch does (a
  step with zero gradients and ``lr`` 0), so a checkpoint can be loaded into them in place;
* ``full_state_dict=True``: every DistTensor gathered into its full tensor (FSDP's and
  tensor parallelism's ``Shard`` values); ``cpu_offload=True``: tensors moved to the CPU
  (with ``full_state_dict`` on torch.distributed, only rank 0 keeps them, as torch's);
  ``ignore_frozen_params=True``: parameters with ``requires_grad=False`` left out;
  ``strict``: :func:`set_model_state_dict`'s; ``flatten_optimizer_state_dict=True``:
  ``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<key>": v}`` both ways;
  ``broadcast_from_rank0`` needs ``full_state_dict`` (torch's check), and on simulated
  ranks is what loading does anyway (one process holds rank 0's dict).
* the ``set_*`` functions take a state dict of DistTensors or of full tensors, whatever
  the layout that saved it: a DistTensor going into a plain tensor is gathered first.

Differences, as the wrappers' own ``state_dict()``: an optimizer's states come in one
device's shapes (full tensors, not DTensor shards); the deprecated ``submodules=``
argument raises (filter the returned dict instead).  A failed set changes nothing: a
plain module's values are put back when ``load_state_dict`` raises (torch's copies what
fits first), and a saved optimizer state of another shape than the one the optimizer
holds is refused naming it (torch's load takes it; the next step fails).  A
``ZeroRedundancyOptimizer``'s states are read from its ranks' own optimizers;
``partition="chunks"`` (flat chunks, not keyed by parameters) is refused, naming the way.
A dict holding DistTensors (tensor parallelism) is read by torch's ``dcp.save`` /
``dcp.load`` as ``Stateful``: full tensors, loaded back in place.  torch's own helpers do not know
``wb.FullyShardedDataParallel`` (they look the names up as attributes of the wrapper)
nor DistTensors (``full_state_dict=True`` raises ``Unexpected value type``); over
``wb.DistributedDataParallel`` (torch DDP's names) they keep the ``module.`` prefix, which
they drop for torch's own DDP class only: use these.  A recipe's stage optimizers
(``Hybrid``) are not ``torch.optim`` optimizers: their training state moves between
layouts with
:mod:`.training` (``train --save`` / ``--resume``).
"""
from __future__ import annotations

import sys
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ..parallel.dcp_interop import as_optim_stateful, as_stateful
from ..parallel.dist_tensor import DistTensor
from ..parallel.load_back import values_kept
from .flat_optim import flatten as _flatten, unflatten as _unflatten

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict"]


# ---- names -------------------------------------------------------------------------------

def _prefixes(model: nn.Module) -> tuple[str, ...]:
    """The prefixes ``model``'s own state-dict keys carry before the FQN: DDP's ``module.``
    (torch's and workbench's), ``torch.compile``'s ``_orig_mod.``."""
    from ..parallel.strategies.ddp import DistributedDataParallel
    # a torch.compile'd module exists only once torch._dynamo is imported: not imported
    # here for the check (about 1 s of CPU: parallel/lazy_dynamo.py)
    dynamo = sys.modules.get("torch._dynamo")
    out = []
    while True:
        if isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            out.append("module.")
            model = model.module
        elif dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
            out.append("_orig_mod.")
            model = model._orig_mod
        else:
            return tuple(out)


def _fqn(key: str, prefixes) -> str:
    for p in prefixes:
        if key.startswith(p):
            key = key[len(p):]
    return key


def _check(model, submodules, options, name) -> StateDictOptions:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name}(model={type(model).__name__}): give the nn.Module (or its "
                        "wrapper) whose state dict this is")
    if submodules:
        raise NotImplementedError(f"{name}(submodules=...): deprecated in torch; filter the "
                                  "returned dict by its keys' prefixes instead")
    options = StateDictOptions() if options is None else options
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"{name}(options={options!r}): give a StateDictOptions("
                        "full_state_dict=..., cpu_offload=..., ...)")
    hook = getattr(options, "dsd_fqn_modifiers", None)
    odd = [n for n, m in model.named_modules() if hook and hasattr(m, hook)] if hook else []
    if odd:     # torch drops the names those hooks return from the keys: not built here
        raise NotImplementedError(
            f"{name}: module {odd[0] or type(model).__name__!r} defines "
            f"{hook}() (StateDictOptions.dsd_fqn_modifiers), whose names torch drops "
            "from the state dict's keys; not applied here: rename the keys yourself, or "
            "give StateDictOptions(dsd_fqn_modifiers=...) a name no module defines")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    if options.broadcast_from_rank0 and dist.is_available() and dist.is_initialized():
        raise NotImplementedError(
            f"{name}(options=StateDictOptions(broadcast_from_rank0=True)) under "
            "torch.distributed: not built here; give every rank the state dict (e.g. "
            "wb.checkpoint.load of a sharded checkpoint reads each rank's pieces)")
    return options


def _optimizers(optimizers, name) -> list:
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else \
        list(optimizers) if isinstance(optimizers, Iterable) else [optimizers]
    for i, o in enumerate(opts):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"{name}: optimizers[{i}] is a {type(o).__name__}, not a torch.optim."
                "Optimizer; a recipe's stage optimizers (Hybrid) move between layouts "
                "with wb.checkpoint.training.save_training / resume_training (python -m "
                "workbench train --save / --resume), or their own state_dict()")
        from ..parallel.strategies.zero_optimizer_dist import ChunkedZeroOptimizer
        if isinstance(o, ChunkedZeroOptimizer):
            # its groups hold the flat chunks it steps, not the model's parameters: read
            # through them, a trained one took a state-initializing step ("no parameter
            # has a gradient"), a fresh one named its chunks "not among named_parameters"
            raise NotImplementedError(
                f"{name}: optimizers[{i}] is ZeroRedundancyOptimizer(partition='chunks'), "
                "whose states are flat chunks per data-parallel rank, not keyed by the "
                "model's parameters; not built here. Save it as itself, "
                "wb.checkpoint.save(path, {'model': model.state_dict(), 'optim': opt}), and "
                "load it into the same layout; or train with the hybrid recipe "
                "(Hybrid(dp=..., zero=1), python -m workbench train --save / --resume), "
                "whose checkpoints reshard these states into any layout")
    return opts


def _param_fqns(model, opts, name) -> list[list[str]]:
    """For each optimizer, the FQN of each of its parameters, in its state dict's order."""
    prefixes = _prefixes(model)
    fqn = {}
    for n, p in model.named_parameters():
        fqn.setdefault(id(p), _fqn(n, prefixes))
    out = []
    for i, o in enumerate(opts):
        row = []
        for g, group in enumerate(o.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) not in fqn:
                    raise ValueError(
                        f"{name}: parameter {k} of param_groups[{g}] of optimizers[{i}] "
                        f"(shape {tuple(p.shape)}) is not among model.named_parameters(); "
                        "build the optimizer over the (wrapped) model's parameters() (a "
                        "recipe's stage optimizers' parameters(), Hybrid's, are its layout's "
                        "storage: such a run moves with wb.checkpoint.training."
                        "save_training / resume_training)")
                row.append(fqn[id(p)])
        out.append(row)
    return out


# ---- values ------------------------------------------------------------------------------

def _value(v, options):
    if isinstance(v, DistTensor):
        if options.full_state_dict:
            v = v.full().detach()
        elif options.cpu_offload and v.device.type != "cpu":
            raise NotImplementedError(
                "StateDictOptions(cpu_offload=True) with a DistTensor on "
                f"{v.device}: give full_state_dict=True (the full tensor goes to the CPU)")
    if isinstance(v, torch.Tensor) and options.cpu_offload:
        v = v.cpu()
    return v


def _values(tree, options):
    if isinstance(tree, dict):
        return {k: _values(v, options) for k, v in tree.items()}
    return _value(tree, options)


def _rank0_only(options) -> bool:
    """torch keeps a full state dict offloaded to the CPU on rank 0 only."""
    return options.full_state_dict and options.cpu_offload and dist.is_available() and \
        dist.is_initialized() and dist.get_rank() != 0


def _full(v):
    return v.full() if isinstance(v, DistTensor) else v


def _laid_out_as(v, p):
    """A saved optimizer state ``v`` for parameter ``p``: gathered for a plain ``p``;
    for a DistTensor ``p`` (tensor parallelism: torch.optim over DistTensors), a state of
    ``p``'s shape is laid out as ``p`` (a full tensor sharded, a DistTensor resharded),
    as torch's ``set_optimizer_state_dict`` distributes full states to the DTensor
    parameter's placements; a scalar (``step``) stays as it is."""
    if not isinstance(p, DistTensor):
        return _full(v)
    if not isinstance(v, (torch.Tensor, DistTensor)) or tuple(v.shape) != tuple(p.shape):
        return v
    from ..parallel.dist_tensor import distribute_tensor
    from ..parallel.reshard import reshard
    if isinstance(v, DistTensor):
        same = v.mesh == p.mesh and tuple(v.placements) == tuple(p.placements)
        return v if same else reshard(v, p.mesh, p.placements)
    return distribute_tensor(v.detach(), p.mesh, p.placements)


def _holds_state(optim) -> bool:
    """torch's test of an optimizer that has stepped (``optim.state`` not empty), and for
    ``wb.ZeroRedundancyOptimizer`` its ranks' own optimizers, which hold the states (the
    wrapper's ``state`` stays empty, as torch's ZeroRedundancyOptimizer's): read through
    the wrapper alone, a ZeRO run that had stepped and then zeroed its gradients
    (``zero_grad()``) took one more step here (step + 1, Adam's moments times beta)."""
    if optim.state:
        return True
    inner = getattr(optim, "optimizers", None)          # ZeroRedundancyOptimizer: per rank
    held = isinstance(inner, dict) and any(o is not None and bool(o.state)
                                           for o in inner.values())
    group = getattr(optim, "group", None)
    if isinstance(inner, dict) and getattr(group, "distributed", False):
        dev = next((p.device for g in optim.param_groups for p in g["params"]), None)
        flag = torch.tensor([float(held)], device=dev)  # a rank owning nothing holds none:
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=group.pg)    # all ranks decide alike
        held = bool(flag.item())
    return held


def _init_optim_state(optim) -> None:
    """torch's ``_init_optim_state``: an optimizer that has taken no step gets its states
    from one step with zero gradients and ``lr`` 0 (the parameters keep their values)."""
    if _holds_state(optim) or any(p.grad is not None for g in optim.param_groups
                                  for p in g["params"]):
        return
    for g in optim.param_groups:
        for p in g["params"]:
            if p.requires_grad and isinstance(p, DistTensor):
                (p * 0).sum().backward()        # a zero gradient (.grad is not assignable)
            elif p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for g in optim.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        with values_kept(p for g in optim.param_groups for p in g["params"]):
            optim.step()                # state_dict() copies taken before stay current
    finally:                            # a step that raises (LBFGS wants a closure) leaves
        for g in optim.param_groups:    # the lr as it was, not 0 (as torch's left it)
            if "lr" in g:
                g["lr"] = lrs.pop(0)
        optim.zero_grad(set_to_none=True)


# ---- get -----------------------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, submodules=None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """``model.state_dict()`` under the unwrapped module's FQNs (see the module doc)."""
    options = _check(model, submodules, options, "get_model_state_dict")
    prefixes = _prefixes(model)
    frozen = {_fqn(n, prefixes) for n, p in model.named_parameters() if not p.requires_grad} \
        if options.ignore_frozen_params else set()
    out = {}
    for k, v in model.state_dict().items():
        k = _fqn(k, prefixes)
        if k not in frozen:
            out[k] = _value(v, options)
    # holding DistTensors: torch's dcp.save / dcp.load read it as Stateful (full tensors,
    # loaded back into the model), as the wrappers' own state_dict()
    return {} if _rank0_only(options) else as_stateful(out)


def get_optimizer_state_dict(model: nn.Module, optimizers, *, submodules=None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state dicts merged, keyed by FQN (see the module doc)."""
    options = _check(model, submodules, options, "get_optimizer_state_dict")
    opts = _optimizers(optimizers, "get_optimizer_state_dict")
    state, groups = {}, []
    for o in opts:
        _init_optim_state(o)
    for o, fqns in zip(opts, _param_fqns(model, opts, "get_optimizer_state_dict")):
        osd = o.state_dict()
        for i, st in osd["state"].items():
            state[fqns[i]] = _values(st, options)
        for g in osd["param_groups"]:
            groups.append({**g, "params": [fqns[i] for i in g["params"]]})
    out = {"state": state, "param_groups": groups}
    # holding DistTensors (tensor parallelism's states): torch's dcp.save / dcp.load read
    # it as Stateful (full tensors, loaded back into the DistTensors), as the model's
    out = as_stateful(_flatten(out)) if options.flatten_optimizer_state_dict else \
        as_optim_stateful(out)
    return {} if _rank0_only(options) else out


def get_state_dict(model: nn.Module, optimizers, *, submodules=None,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """(:func:`get_model_state_dict`, :func:`get_optimizer_state_dict`)."""
    for o in _optimizers(optimizers, "get_state_dict"):
        _init_optim_state(o)    # first: a step changes FSDP's shards under the model's dict
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules,
                                     options=options))


# ---- set -----------------------------------------------------------------------------------

def set_model_state_dict(model: nn.Module, model_state_dict: dict, *,
                         options: StateDictOptions | None = None):
    """``model.load_state_dict`` of a state dict keyed by FQN, of DistTensors or full
    tensors from any layout; returns torch's ``(missing_keys, unexpected_keys)`` (the
    model's own keys, as torch's).  An empty dict, as torch's: refused when
    ``options.strict`` (torch's exceptions kept), else nothing loaded, no key reported
    (torch's own result holds two empty dicts there; here the documented empty lists)."""
    options = _check(model, None, options, "set_model_state_dict")
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"set_model_state_dict(model_state_dict={type(model_state_dict).__name__})"
                        ": give a dict {fqn: tensor}, e.g. get_model_state_dict(model)")
    if not model_state_dict and not options.broadcast_from_rank0:
        # torch 2.13 (cf30153c, torch/distributed/checkpoint/state_dict.py:415-428
        # _verify_state_dict, :566-567 _load_model_state_dict): an empty dict is refused
        # when strict (unless frozen parameters are ignored or a full state dict is
        # offloaded to CPU), else nothing is loaded and no key is reported; it listed
        # every key as missing (strict=False) here
        if options.strict and not options.ignore_frozen_params and \
                not (options.cpu_offload and options.full_state_dict):
            raise RuntimeError(
                "set_model_state_dict(model_state_dict={}): the state dict is empty and "
                "options.strict is True (torch's words: the option indicates that model "
                "state_dict is required to save or load, but model state_dict is empty); "
                "give get_model_state_dict(model)'s dict, or StateDictOptions(strict=False) "
                "to load nothing")
        return nn.modules.module._IncompatibleKeys([], [])
    prefixes = _prefixes(model)
    own = model.state_dict(keep_vars=True)
    key = {_fqn(k, prefixes): k for k in own}
    given = {}
    for k, v in model_state_dict.items():
        mine = key.get(k, k)
        if isinstance(v, DistTensor) and mine in own and (
                not isinstance(own[mine], DistTensor) or own[mine].mesh != v.mesh):
            v = v.full()                # a plain tensor, or one on another mesh (FSDP's or
            #                             TP 4's into TP 2), takes the full value
        given[mine] = v
    # torch's load_state_dict copies every value that fits before it raises for a wrong
    # shape, a missing or an unexpected key; the wrappers check first and change nothing.
    # So a plain module's tensors are kept and put back: a failed set leaves it as it was
    kept = [(t, t.detach().clone()) for t in own.values()
            if isinstance(t, torch.Tensor) and not isinstance(t, DistTensor)
            and t.device.type != "meta"]
    try:
        return model.load_state_dict(given, strict=options.strict)
    except BaseException:
        with torch.no_grad():
            for t, old in kept:
                t.copy_(old)
        raise


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict, *,
                             options: StateDictOptions | None = None) -> None:
    """Load a state dict keyed by FQN (:func:`get_optimizer_state_dict`'s, from any
    layout) into each optimizer: its parameters' states and their groups' settings."""
    options = _check(model, None, options, "set_optimizer_state_dict")
    opts = _optimizers(optimizers, "set_optimizer_state_dict")
    if not isinstance(optim_state_dict, dict):
        raise TypeError("set_optimizer_state_dict(optim_state_dict="
                        f"{type(optim_state_dict).__name__}): give get_optimizer_state_dict's "
                        "dict")
    all_fqns = _param_fqns(model, opts, "set_optimizer_state_dict")
    if "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        if any(k.startswith(("state.", "param_groups.")) for k in optim_state_dict):
            optim_state_dict = _unflatten(optim_state_dict,
                                          [f for fq in all_fqns for f in fq])
        else:
            raise ValueError("set_optimizer_state_dict: optim_state_dict has neither 'state' "
                             f"nor 'param_groups' (keys {list(optim_state_dict)[:3]}); give "
                             "get_optimizer_state_dict's dict")
    saved_state = optim_state_dict["state"]
    group_of = {}
    for g in optim_state_dict["param_groups"]:
        for f in g["params"]:
            group_of[f] = g
    loads = []
    for i, (o, fqns) in enumerate(zip(opts, all_fqns)):
        state, groups, k = {}, [], 0
        held = _current_states(o)
        for g, group in enumerate(o.param_groups):
            mine = fqns[k:k + len(group["params"])]
            saved = [group_of.get(f) for f in mine]
            if mine and (saved[0] is None or any(s is not saved[0] for s in saved)):
                missing = [f for f, s in zip(mine, saved) if s is None]
                raise ValueError(
                    f"set_optimizer_state_dict: param_groups[{g}] of optimizers[{i}] holds "
                    + (f"{missing[:3]}, which no saved param group lists" if missing else
                       f"{mine[:3]}..., which the saved state dict puts in different groups")
                    + "; build the optimizer with the saving run's param groups")
            hyper = {n: v for n, v in (saved[0] if mine else {}).items() if n != "params"}
            groups.append({**{n: v for n, v in group.items() if n != "params"}, **hyper,
                           "params": list(range(k, k + len(mine)))})
            for j, (f, p) in enumerate(zip(mine, group["params"])):
                if f in saved_state:
                    _check_shapes(f, saved_state[f], held.get(k + j, {}))
                    state[k + j] = {n: _laid_out_as(v, p) for n, v in saved_state[f].items()}
            k += len(mine)
        loads.append((o, {"state": state, "param_groups": groups}))
    for o, osd in loads:
        o.load_state_dict(osd)


def _current_states(o) -> dict:
    """{index in the optimizer's state dict: its states} that ``o`` holds now, as its
    ``state_dict()`` gives them (one device's shapes, whatever the wrapper's storage; a
    ZeRO optimizer's from its ranks' own optimizers, none under torch.distributed, where
    they live on their owners)."""
    if not _holds_state(o) or (isinstance(getattr(o, "optimizers", None), dict) and
                               getattr(getattr(o, "group", None), "distributed", False)):
        return {}
    return o.state_dict()["state"]


def _check_shapes(fqn, saved: dict, held: dict) -> None:
    """A saved state of another shape than the one the optimizer holds for ``fqn`` (e.g.
    the moments of another model's parameter) is refused naming it: torch's
    ``Optimizer.load_state_dict`` takes it and the next step fails on a broadcast."""
    for name, v in saved.items():
        have = held.get(name)
        if isinstance(v, (torch.Tensor, DistTensor)) and isinstance(have, (torch.Tensor,
                                                                           DistTensor)) \
                and tuple(v.shape) != tuple(have.shape):
            raise ValueError(
                f"set_optimizer_state_dict: state {name!r} of {fqn!r} has shape "
                f"{tuple(v.shape)}, the optimizer holds {tuple(have.shape)} for it (the "
                "parameter's); give the optimizer state dict of this model (the saving "
                "run's get_optimizer_state_dict)")


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict,
                   optim_state_dict: dict, options: StateDictOptions | None = None):
    """:func:`set_model_state_dict` then :func:`set_optimizer_state_dict`; returns the
    model's ``(missing_keys, unexpected_keys)``."""
    out = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return out
