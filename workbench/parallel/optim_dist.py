"""``torch.optim`` over DistTensor parameters, as over PyTorch DTensor ones.

``opt = torch.optim.AdamW(model.parameters())`` after ``wb.parallelize_module(model, ...)``:
PyTorch's DTensor is a ``torch.Tensor`` subclass, so torch's optimizers take it, make
its states (``torch.zeros_like(p)``) DTensors with the parameter's placements, and step
it with the DTensor's own ops.  A DistTensor is not a ``torch.Tensor``, so the
``Optimizer`` methods that ask ``isinstance(x, torch.Tensor)`` are taught it here (torch
2.13 ``torch/optim/optimizer.py``), and ``torch.amp.GradScaler``'s unscale; the steps themselves are torch's
(``zeros_like``, ``lerp_``, ``addcdiv_``... run through the SPMD rules, and
``torch._foreach_*`` through :mod:`.foreach_ops`):

* ``add_param_group`` (and so the constructor) accepts DistTensors with torch's checks
  (a leaf or ``retains_grad``, the duplicate warning, disjoint groups, ``(name, p)``
  pairs, defaults filled, ``required`` ones); a group with no DistTensor is torch's own.
  A single DistTensor as ``params`` of the constructor raises torch's TypeError.
* ``state_dict()`` keys a DistTensor parameter's state by its index, as torch does a
  tensor's (torch packs ``isinstance(k, torch.Tensor)`` keys only); the states stay
  DistTensors, as DTensor's stay DTensors.
* ``load_state_dict`` takes DistTensor states back (torch's ``_cast`` would iterate
  them), cast to the parameter's dtype.  A one-device optimizer's (plain) state for a
  DistTensor parameter is laid out as the parameter, a DistTensor state for a plain
  parameter gathered (:func:`_laid_out`), so either optimizer goes on as one device
  (PyTorch DTensor loads them as they are and its next ``step`` raises "got mixed
  torch.Tensor and DTensor"; the wrappers' parameters here take one device's states
  alike, ``strategies/laid_out.py``).
* ``torch.amp.GradScaler``'s ``unscale_`` (and so ``step``) checks and unscales
  DistTensor gradients (torch asserts ``isinstance(param, torch.Tensor)``).

A gradient that is Partial (shares of a sum not yet reduced: a backward inside
``DistributedDataParallel.no_sync()``) is refused at ``step()`` (:func:`_check_grads`,
a global step pre-hook).  The gradients of the tensor-parallel plans are never Partial
here: a Replicate parameter's (a norm's weight under ``SequenceParallel``, a rowwise
bias) is summed over the ranks in backward, by the all-reduce of its replication
(DESIGN "Two executors"), where DTensor leaves it Partial and reduces it in the step's ops.

What torch cannot step exactly here is refused before a number changes
(:func:`_refuse`): ``fused=True`` (torch's fused kernels take plain tensors; DTensor
runs them on each local shard, not built here),
``differentiable=True``, ``SparseAdam`` (sparse gradients) and ``LBFGS`` (it flattens
every gradient into one plain vector with ``view(-1)`` and ``torch.cat``).
"""
from __future__ import annotations

import collections

import torch
from torch.optim.optimizer import Optimizer, required

__all__ = ["install"]


def _is_dist(x) -> bool:
    from .dist_tensor import DistTensor
    return isinstance(x, DistTensor)


def _params_of(param_group) -> list:
    """The tensors of a param group (a generator, ``{"params": model.parameters()}``,
    made a list in the group first, as torch's own check does)."""
    ps = param_group.get("params") if isinstance(param_group, dict) else None
    if not isinstance(ps, (torch.Tensor, set, list, tuple)) and not _is_dist(ps) \
            and hasattr(ps, "__iter__"):
        ps = param_group["params"] = list(ps)
    if _is_dist(ps):
        return [ps]
    if isinstance(ps, (list, tuple)):
        return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in ps]
    return []


# ---- what torch cannot step here: refused, naming the way that works -----------------

def _refuse(opt: Optimizer, group: dict) -> None:
    cls = type(opt).__name__
    if isinstance(opt, (torch.optim.SparseAdam, torch.optim.LBFGS)):
        why = ("it steps sparse gradients, which a DistTensor never has"
               if isinstance(opt, torch.optim.SparseAdam) else
               "it flattens every gradient into one plain vector (view(-1), torch.cat)")
        raise TypeError(f"torch.optim.{cls} over DistTensor parameters: {why}; use "
                        "another torch.optim optimizer (Adam, AdamW, SGD...) or give it "
                        "plain tensors (a one-device model)")
    if group.get("fused"):
        raise RuntimeError(f"torch.optim.{cls}(fused=True) over DistTensor parameters: "
                           "torch's fused kernels take plain tensors only; pass "
                           "foreach=True or leave foreach=None (the same numbers)")
    if group.get("differentiable"):
        raise RuntimeError(f"torch.optim.{cls}(differentiable=True) over DistTensor "
                           "parameters is not supported (the step's graph runs through "
                           "the states in place); leave differentiable=False")


# ---- add_param_group: torch's checks, DistTensors accepted ------------------------------

def _wrap_add_param_group(orig):
    def add_param_group(self, param_group):
        if not any(_is_dist(p) for p in _params_of(param_group)):
            return orig(self, param_group)
        params = param_group["params"]
        if _is_dist(params):
            params = [params]
        param_group["params"] = list(params)
        tensors, names = [], []
        for p in param_group["params"]:
            if isinstance(p, tuple):
                names.append(p[0])
                p = p[1]
            tensors.append(p)
        param_group["params"] = tensors
        if names:
            if len(names) != len(tensors):
                raise ValueError("all optimizer params should be with/without names. Some "
                                 "param names are missing")
            param_group["param_names"] = names
        for p in tensors:
            if not (isinstance(p, torch.Tensor) or _is_dist(p)):
                raise TypeError("optimizer can only optimize Tensors, but one of the params "
                                "is " + torch.typename(p))
            if not self.defaults.get("differentiable", None) and not (
                    p.is_leaf or getattr(p, "retains_grad", False)):
                raise ValueError("can't optimize a non-leaf Tensor")
        for name, default in self.defaults.items():
            if default is required and name not in param_group:
                raise ValueError("parameter group didn't specify a value of required "
                                 f"optimization parameter {name}")
            param_group.setdefault(name, default)
        _refuse(self, param_group)
        if len({id(p) for p in tensors}) != len(tensors):
            import warnings
            warnings.warn("optimizer contains a parameter group with duplicate parameters; "
                          "in future, this will cause an error; see "
                          "github.com/pytorch/pytorch/issues/40967 for more information",
                          stacklevel=3)
        seen = set()
        for group in self.param_groups:
            seen.update(id(p) for p in group["params"])
            if ("param_names" in param_group) != ("param_names" in group):
                txt = "with names" if "param_names" in param_group else "without names"
                raise ValueError("all optimizer param groups should be with/without names. "
                                 f"cannot add param group {txt} to the optimizer")
        if any(id(p) in seen for p in tensors):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(param_group)
    add_param_group._wb_torch = orig
    add_param_group.__doc__ = orig.__doc__
    return add_param_group


def _wrap_init(orig):
    def __init__(self, params, defaults):
        if _is_dist(params):        # torch's own refusal of one tensor as ``params``
            raise TypeError("params argument given to the optimizer should be an iterable "
                            "of Tensors or dicts, but got " + torch.typename(params))
        return orig(self, params, defaults)
    __init__._wb_torch = orig
    __init__.__doc__ = orig.__doc__
    return __init__


# ---- state_dict / load_state_dict: DistTensor keys and values ---------------------------

def _holds_dist(opt: Optimizer) -> bool:
    return any(_is_dist(p) for g in opt.param_groups for p in g["params"])


def _first(hooks: collections.OrderedDict, hook) -> collections.OrderedDict:
    out = collections.OrderedDict([(object(), hook)])
    out.update(hooks)
    return out


def _wrap_state_dict(orig):
    def state_dict(self):
        if not _holds_dist(self):
            return orig(self)

        def index_dist_keys(opt, sd):
            # torch's packed indices, param by param (its param_mappings by id)
            index = {id(p): i for g, pg in zip(opt.param_groups, sd["param_groups"])
                     for p, i in zip(g["params"], pg["params"])}
            sd["state"] = {(index[id(k)] if _is_dist(k) else k): v
                           for k, v in sd["state"].items()}
        hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = _first(hooks, index_dist_keys)
        try:
            return orig(self)
        finally:
            self._optimizer_state_dict_post_hooks = hooks
    state_dict._wb_torch = orig
    state_dict.__doc__ = orig.__doc__
    return state_dict


class _Held:
    """A DistTensor state carried through torch's ``_cast`` untouched (it would
    iterate it); put back, cast to its parameter's dtype, after the load."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _laid_out(v, p):
    """A saved state ``v`` as parameter ``p`` holds its states: for a DistTensor ``p`` a
    one-device (plain) state of ``p``'s shape laid out as ``p``, of another shape
    (Adafactor's factored variances) replicated, a 0-d one (``step``, ``eta``, ``mu``)
    plain as DTensor keeps it; for a plain ``p`` a DistTensor state gathered."""
    if _is_dist(p) and isinstance(v, torch.Tensor) and v.dim() > 0:
        from .dist_tensor import distribute_tensor
        from .placement import Replicate
        ps = p.placements if tuple(v.shape) == tuple(p.shape) else \
            [Replicate()] * p.mesh.ndim
        return _Held(distribute_tensor(v.detach(), p.mesh, ps))
    if _is_dist(v):
        return _Held(v) if _is_dist(p) else v.full_tensor().detach()
    return v


def _wrap_load_state_dict(orig):
    def load_state_dict(self, state_dict):
        def hold(opt, sd):
            saved = [i for g in sd["param_groups"] for i in g["params"]]
            mine = dict(zip(saved, (p for g in opt.param_groups for p in g["params"])))
            sd["state"] = {k: ({key: _laid_out(v, mine[k]) for key, v in s.items()}
                               if isinstance(s, dict) and k in mine else s)
                           for k, s in sd["state"].items()}
            return sd

        def put_back(opt):
            for p, s in opt.state.items():
                for key, v in list(s.items()) if isinstance(s, dict) else ():
                    if isinstance(v, _Held):
                        v = v.value
                        s[key] = v.to(p.dtype) if key != "step" and p.is_floating_point() \
                            and v.dtype != p.dtype else v
        sd_holds = any(_is_dist(v) for s in state_dict.get("state", {}).values()
                       if isinstance(s, dict) for v in s.values())
        if not (_holds_dist(self) or sd_holds):
            return orig(self, state_dict)
        pre, post = (self._optimizer_load_state_dict_pre_hooks,
                     self._optimizer_load_state_dict_post_hooks)
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict(
            list(pre.items()) + [(object(), hold)])
        self._optimizer_load_state_dict_post_hooks = _first(post, put_back)
        try:
            return orig(self, state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
    load_state_dict._wb_torch = orig
    load_state_dict.__doc__ = orig.__doc__
    return load_state_dict


# ---- step: a Partial gradient is not the gradient -----------------------------------------

def _check_grads(opt: Optimizer, args, kwargs) -> None:
    """Global step pre-hook: a DistTensor parameter whose gradient is Partial (its ranks
    hold shares of a sum not yet reduced: inside ``DistributedDataParallel.no_sync()``)
    is refused before anything changes; torch would step each share."""
    if not _holds_dist(opt):
        return
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        g = p.grad if _is_dist(p) else None
        if g is None or not any(q.is_partial() and not pq.is_partial()
                                for q, pq in zip(g.placements, p.placements)):
            continue
        axes = [n for n, q in zip(p.mesh.dim_names, g.placements) if q.is_partial()]
        raise RuntimeError(
            f"{type(opt).__name__}.step(): parameter {i}'s gradient is {g.notation()}, "
            f"Partial over {axes}: each rank holds a share of a sum not yet reduced (a "
            "backward inside DistributedDataParallel.no_sync()).  Step after a backward "
            "outside no_sync(), which sums the gradients")


# ---- torch.amp.GradScaler: unscale DistTensor gradients ---------------------------------

def _wrap_unscale_grads(orig):
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not _holds_dist(optimizer):
            return orig(self, optimizer, inv_scale, found_inf, allow_fp16)
        # torch's (torch 2.13 torch/amp/grad_scaler.py), a DistTensor's gradient checked
        # over every rank's shard and unscaled by its own ops (torch asserts
        # isinstance(param, torch.Tensor))
        from torch.amp.grad_scaler import _MultiDeviceReplicator
        per_inv, per_found = _MultiDeviceReplicator(inv_scale), _MultiDeviceReplicator(found_inf)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    found, inv = per_found.get(g.device), per_inv.get(g.device)
                    if not _is_dist(g):
                        torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv)
                        continue
                    finite = torch.isfinite(g).all()    # Partial(min) over the shards:
                    if not bool(finite.full()):         # one scalar all-reduce, as FSDP's
                        found.fill_(1.0)                # ShardedGradScaler reduces found_inf
                    g.mul_(inv)
        return per_found._per_device_tensors
    _unscale_grads_._wb_torch = orig
    _unscale_grads_.__doc__ = orig.__doc__
    return _unscale_grads_


_HOOK = []


def install() -> None:
    """Teach ``torch.optim.Optimizer`` DistTensors (idempotent)."""
    for name, wrap in (("__init__", _wrap_init), ("add_param_group", _wrap_add_param_group),
                       ("state_dict", _wrap_state_dict),
                       ("load_state_dict", _wrap_load_state_dict)):
        orig = getattr(Optimizer, name)
        if not hasattr(orig, "_wb_torch"):
            setattr(Optimizer, name, wrap(orig))
    from torch.amp.grad_scaler import GradScaler
    if not hasattr(GradScaler._unscale_grads_, "_wb_torch"):
        GradScaler._unscale_grads_ = _wrap_unscale_grads(GradScaler._unscale_grads_)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOK.append(register_optimizer_step_pre_hook(_check_grads))
