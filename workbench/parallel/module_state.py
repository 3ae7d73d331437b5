"""A ``parallelize``d module keeps PyTorch's module habits.

:func:`~workbench.parallel.module.parallelize` puts each DistTensor where the module
held its ``nn.Parameter`` (``module._parameters``), as ``fully_shard`` puts DTensor
parameters there (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
``_setattr_on_modules``).  So ``named_parameters()``, ``parameters()``, ``state_dict()``
(DistTensors, as FSDP2 returns DTensors), ``zero_grad()`` and ``requires_grad_()`` see
them through torch's own module code.  Where that code calls functions that only take a
``torch.Tensor`` (loading a state dict, ``.to(dtype)`` / ``.double()``), each module that
holds a DistTensor gets a class that handles its DistTensors itself and leaves the rest
to torch: FSDP2 swaps the class of the module it shards the same way (``FSDPModule``
subclasses, ``_fully_shard.py``).  The class keeps its name (``repr`` is unchanged).

:func:`check_state_dict` checks keys and shapes before anything is copied, with the
messages ``nn.Module.load_state_dict`` writes, so that a failed load leaves the module
untouched (torch copies what it can before it raises).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import storage
from .dist_tensor import DistTensor, shard_tensor


def clear_grad(t: torch.Tensor, set_to_none: bool) -> None:
    """``t.grad`` cleared as ``torch.optim.Optimizer.zero_grad`` / ``nn.Module.zero_grad``
    clear one gradient: set to None, or zeroed in place, detached in place first only when
    it has a history (a view such as a bucket's piece keeps its storage)."""
    g = t.grad
    if g is None:
        return
    if set_to_none:
        t.grad = None
        return
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    g.zero_()

__all__ = ["adopt", "check_state_dict", "load_dist_", "refuse_backward_hook",
           "refuse_backward_hooks", "BackwardHookRefusal"]


def refuse_backward_hook(module: nn.Module, how: str) -> None:
    """``module.<how>(hook)`` (``register_full_backward_hook`` / ``_pre_hook`` /
    ``register_backward_hook``) on a module whose inputs and outputs are DistTensors
    (a ``parallelize``d module, a wrapper over one): torch's backward hooks hold only
    ``torch.Tensor`` outputs (``nn.Module._call_impl`` warns "module output should be a
    Tensor" and never calls the hook), so a hook that scales or logs a gradient was
    dropped (habits18: the gradients one device's without the hook's change)."""
    raise NotImplementedError(
        f"{type(module).__name__}.{how}(hook): this module's inputs and outputs are "
        "DistTensors (tensor parallelism), which torch's module backward hooks do not see: "
        "the hook would never run (torch only warns).  Read or change gradients after "
        "backward through the parameters (p.grad, before optimizer.step()), or register "
        "the hook on a module run without tensor parallelism (DDP / FSDP / fully_shard of "
        "a plain module call it)")


def refuse_backward_hooks(module: nn.Module, what: str) -> None:
    """Before ``what`` (parallelize / parallelize_module) lays ``module`` out: a backward
    hook registered on it or a submodule would stop running (:func:`refuse_backward_hook`);
    raise, nothing changed."""
    if not isinstance(module, nn.Module):
        return                          # (the caller's own type check names it)
    for name, m in module.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            raise NotImplementedError(
                f"{what}: module {name or type(module).__name__!r} has a backward hook "
                "(register_full_backward_hook / register_full_backward_pre_hook / "
                "register_backward_hook); its inputs and outputs become DistTensors, which "
                "torch's module backward hooks do not see, so it would never run.  Remove "
                "it (handle.remove()) and read gradients through the parameters after "
                "backward (p.grad), or keep this module off tensor parallelism")
    for name, p in module.named_parameters():
        # p.register_hook(fn) / register_post_accumulate_grad_hook(fn) before: the
        # parameter is replaced by a DistTensor and the hook was dropped, silently
        # (habits9b: a halving hook never ran, 0.018 off one device's after two steps)
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks",
                                                           None):
            raise NotImplementedError(
                f"{what}: parameter {name!r} has a gradient hook (Tensor.register_hook / "
                f"register_post_accumulate_grad_hook); {what} replaces it by a DistTensor, "
                "so the hook would never run.  Remove it (handle.remove()) and read or "
                "change the gradient after loss.backward() through p.grad, before "
                "optimizer.step()")


class BackwardHookRefusal:
    """Mixed into a module whose inputs and outputs are DistTensors: its backward hook
    registrations raise (:func:`refuse_backward_hook`); forward hooks stay torch's."""

    def register_full_backward_hook(self, hook, prepend: bool = False):
        refuse_backward_hook(self, "register_full_backward_hook")

    def register_full_backward_pre_hook(self, hook, prepend: bool = False):
        refuse_backward_hook(self, "register_full_backward_pre_hook")

    def register_backward_hook(self, hook):
        refuse_backward_hook(self, "register_backward_hook")

_CLASSES: dict = {}


def adopt(module: nn.Module) -> None:
    """Give ``module`` and each submodule the class that handles DistTensor parameters
    (once; idempotent)."""
    for m in module.modules():
        cls = type(m)
        if issubclass(cls, ParallelModule):
            continue
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (ParallelModule, cls),
                                 {"__module__": cls.__module__, "_wb_base": cls})
        m.__class__ = _CLASSES[cls]


def _hidden(mods):
    """Take the DistTensors out of each module's ``_parameters`` (so torch's code that
    wants tensors skips them); returns what to put back."""
    held = []
    for m in mods:
        if any(isinstance(v, DistTensor) for v in m._parameters.values()):
            saved = dict(m._parameters)
            held.append((m, saved))
            for k, v in saved.items():
                if isinstance(v, DistTensor):
                    del m._parameters[k]
    return held


def _restore(held):
    for m, saved in held:
        cur = dict(m._parameters)
        m._parameters.clear()
        for k, v in saved.items():        # in the module's own order
            m._parameters[k] = v if isinstance(v, DistTensor) else cur.get(k, v)


@contextlib.contextmanager
def _without_dist(mods):
    """The DistTensors out of ``mods``' ``_parameters`` for the block (torch's module code
    sees only tensors), put back after it, even on error; yields what was taken out."""
    held = _hidden(mods)
    _HIDING[0] += 1
    try:
        yield held
    finally:
        _HIDING[0] -= 1
        _restore(held)


_HIDING = [0]       # >0 inside _without_dist: the modules are not whole (nothing built)


def _unique(held):
    """The distinct DistTensors :func:`_hidden` took out (a tied weight once)."""
    seen = set()
    for _, saved in held:
        for v in saved.values():
            if isinstance(v, DistTensor) and id(v) not in seen:
                seen.add(id(v))
                yield v


def _shards(m) -> dict:
    """{attr: shard} of a module whose parameters FullyShardedDataParallel's DistTensor
    mode moved into flat shards (:mod:`.strategies.fsdp_dist_habits`); else empty."""
    return m.__dict__.get("_wb_shards", {})


def _params_or_shards(m):
    """``m``'s (name, parameter) pairs, a parameter held in ``fully_shard``'s shards as
    its shard (``wb.FullyShardedDataParallel(module, ...)``'s module keeps its templates:
    ``fsdp.parameters()`` gives the shards there, as the wrapper's own)."""
    sh = _shards(m)
    if not sh or not m.__dict__.get("_wb_fully_shard_params"):
        return m._parameters.items()
    return [(k, sh.get(k, v)) for k, v in m._parameters.items()]


class ParallelModule(BackwardHookRefusal):
    """Mixed into the class of a module that ``parallelize`` sharded."""

    def _get_name(self):
        return self._wb_base.__name__

    def register_parameter(self, name, param):
        """torch's, and a DistTensor (e.g. ``nn.Parameter(distribute_tensor(...))`` in a
        ``distribute_module`` partition_fn) is registered as a parameter, as a DTensor is."""
        if not isinstance(param, DistTensor):
            return super().register_parameter(name, param)
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"register_parameter(name={name!r}): give a non-empty name "
                           "without '.'")
        if hasattr(self, name) and name not in self._parameters:
            raise KeyError(f"attribute '{name}' already exists")
        self._parameters[name] = param
        self.__dict__.setdefault("_wb_dist_params", {})[name] = param

    def __setattr__(self, name, value):
        if isinstance(value, DistTensor) and name in self.__dict__.get("_parameters", {}):
            self._parameters[name] = value      # a DistTensor parameter replaced by another
            self.__dict__.setdefault("_wb_dist_params", {})[name] = value
            return
        super().__setattr__(name, value)

    # ---- state_dict: DCP reads it (DistTensors as full tensors, loaded back in place) ---
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        sd = super().state_dict(*args, destination=destination, prefix=prefix,
                                keep_vars=keep_vars)
        if args or destination is not None:     # a sub-module's part of a parent's dict
            return sd
        from .dcp_interop import as_stateful
        from .keep_vars import as_parameters
        # a user's keep_vars=True: the parameters themselves, as torch's (keep_vars)
        return as_stateful(as_parameters(self, sd, prefix, keep_vars))

    # ---- named_parameters: a parameter moved into FSDP's flat shards is its shard -------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """torch's walk, except that a parameter ``fully_shard`` (its DistTensor mode)
        moved into flat shards is given as its shard (what the optimizer steps and the
        forward gathers), not the DistTensor left behind as its template (its value at
        wrapping): a sub-module of a ``fully_shard``-ed model answers as FSDP2's, whose
        parameters are the sharded DTensors on every module.  Under a ``fully_shard`` root
        over DistTensors not built yet, the sharded state is built first, as the root's own
        ``parameters()`` does (:mod:`.strategies.fully_shard_tp`)."""
        if not _HIDING[0]:          # torch's own walk with the DistTensors hidden: not now
            from .strategies.fully_shard_tp import build_above
            build_above(self)
        return self._named_members(_params_or_shards, prefix=prefix, recurse=recurse,
                                   remove_duplicate=remove_duplicate)

    def get_parameter(self, target: str):
        """torch's, and a DistTensor parameter (not an ``nn.Parameter``, which torch's
        refused: "`weight` is not an nn.Parameter") is returned as ``named_parameters()``
        gives it under that name (its shard where ``fully_shard`` moved it into one)."""
        path, _, name = target.rpartition(".")
        mod = self.get_submodule(path)
        if not isinstance(mod, ParallelModule) or \
                not isinstance(mod._parameters.get(name), DistTensor):
            return super().get_parameter(target)
        if not _HIDING[0]:
            from .strategies.fully_shard_tp import build_above
            build_above(mod)
        return dict(_params_or_shards(mod))[name]

    # ---- .to(dtype), .double(), .half(), .float(), .cpu(): each local shard as torch would
    def _apply(self, fn, recurse=True):
        sharded = [m for m in (self.modules() if recurse else [self]) if _shards(m)]
        if sharded:
            raise NotImplementedError(
                f"{self._get_name()}.to() / .double() / .half() ...: its parameters live in "
                "the flat shards of fully_shard / FullyShardedDataParallel / Zero3 over "
                "tensor parallelism, which a conversion of the module would miss; convert "
                "the module before wrapping it")
        with _without_dist(self.modules() if recurse else [self]) as held:
            super()._apply(fn, recurse)
        for v in _unique(held):                 # a tied weight: converted once
            _convert(v, fn)
        for hook in self.__dict__.get("_wb_apply_hooks", ()):     # e.g. DualPipe's copy 1
            hook(fn)
        return self

    # ---- requires_grad_: in place on each shard, its gradient kept (as torch) -----------
    def requires_grad_(self, requires_grad: bool = True):
        with _without_dist(self.modules()) as held:
            super().requires_grad_(requires_grad)
        for v in _unique(held):
            ts = storage.tensors(v._local)
            if all(t.is_leaf for t in ts):
                for t in ts:
                    t.requires_grad_(requires_grad)
            else:
                v.requires_grad_(requires_grad)
        for m in self.modules():        # wrapped by FullyShardedDataParallel: its shards
            for t in _shards(m).values():
                t.requires_grad_(requires_grad)
        return self

    # ---- zero_grad: every DistTensor's gradient too -----------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        with _without_dist(self.modules()) as held:
            super().zero_grad(set_to_none)
        for v in _unique(held):
            for t in storage.tensors(v._local):
                hook = getattr(t, "_wb_zero_grad_hook", None)
                if hook is not None:    # gradient state kept elsewhere (ZeRO-2's shards)
                    hook(set_to_none)
                clear_grad(t, set_to_none)
        for m in self.modules():        # wrapped by FullyShardedDataParallel: its shards
            for t in _shards(m).values():
                # torch's rule (clear_grad): a gradient without history is not detached in
                # place (fully_shard over tensor parallelism hands out an alias of it, which
                # detach_() refused: "Can't detach views in-place", habits15)
                clear_grad(t, set_to_none)
        for fn in self.__dict__.get("_wb_zero_grad_hooks", ()):    # e.g. DualPipe's copy 1
            fn(set_to_none)

    # ---- load_state_dict: DistTensors or full tensors, checked before any copy ----------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) on a parallelized module: "
                                      "its parameters are DistTensors laid out by the plan; "
                                      "load with assign=False (copies into them)")
        from .keep_vars import module_values
        state_dict = module_values(state_dict)      # a wrapper's keep_vars dict: values
        expected = {k: tuple(v.shape) if hasattr(v, "shape") else None   # None: extra state
                    for k, v in self.state_dict(keep_vars=True).items()}
        check_state_dict(self._get_name(), expected, state_dict, strict)
        return super().load_state_dict(state_dict, strict)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        dts = {k: v for k, v in self._parameters.items() if isinstance(v, DistTensor)}
        with _without_dist([self]) as held:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        for name, dt in dts.items():
            key = prefix + name
            while key in unexpected_keys:       # hidden above, so torch called it unexpected
                unexpected_keys.remove(key)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            msg = load_dist_(dt, state_dict[key], key)
            if msg:
                error_msgs.append(msg)


@torch.no_grad()
def _convert(dt: DistTensor, fn) -> None:
    """``fn`` (torch's per-tensor conversion in ``Module._apply``) on every local shard of
    ``dt`` and of its gradient; ``dt`` stays the same object (torch keeps the Parameter)."""
    ts = storage.tensors(dt._local)
    new = {}
    for t in ts:
        if id(t) in new:
            continue
        out = fn(t)
        # torch's Module._apply sets .data only where the types allow it (meta -> cpu by
        # to_empty does not): a new leaf then, as torch's new Parameter
        if out is not t and t.is_leaf and torch._has_compatible_shallow_copy_type(t, out):
            # the same leaf converted in place, as torch's Module._apply sets param.data:
            # an optimizer over the local leaves (DDP's replicas) still holds it
            grad = t.grad
            t.data = out
            if grad is not None:
                t.grad = fn(grad)
            out = t
        elif out is not t:
            out = out.detach().requires_grad_(t.requires_grad)
            if t.grad is not None:
                out.grad = fn(t.grad)
        new[id(t)] = out
    loc = storage.with_tensors(dt._local, [new[id(t)] for t in ts])
    dt._local = loc
    dt.dtype = storage.tensors(loc)[0].dtype
    dt._spec = None


@torch.no_grad()
def load_dist_(dt: DistTensor, value, key: str):
    """Copy ``value`` (a DistTensor of the same global shape, or a full tensor) into the
    DistTensor parameter ``dt`` in place; returns an error message or None."""
    if isinstance(value, DistTensor):
        if value.mesh != dt.mesh:
            return (f"While copying the parameter named {key!r}: the DistTensor lives on "
                    f"{value.mesh}, the module's on {dt.mesh}; load its .full() instead")
        value = value.full()
    if not isinstance(value, torch.Tensor):
        return (f"While copying the parameter named {key!r}, expected torch.Tensor or "
                f"DistTensor from checkpoint but received {type(value)}")
    if tuple(value.shape) != tuple(dt.shape):
        return (f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {dt.shape}.")
    if dt.device.type == "meta" and value.device.type != "meta":
        return (f"While copying the parameter named {key!r}: the module's parameter is on the "
                "meta device (a shape, no storage), so the copy would do nothing (torch warns "
                "and skips it); build the module on a real device before wb.parallelize (or "
                "module.to_empty(device='cpu') first), then load")
    src = shard_tensor(value.detach().to(dt.dtype), dt.mesh, dt.placements)
    mine, theirs = storage.tensors(dt._local), storage.tensors(src._local)
    if len(mine) == len(theirs) and all(_fits(b, a) for a, b in zip(mine, theirs)):
        for a, b in zip(mine, theirs):      # in place: one copy per rank where ``a`` has
            a.copy_(b.expand_as(a))         # them (DDP's replicas), the optimizer's tensors
    else:                                   # another storage form (e.g. one copy per rank)
        rg = dt.requires_grad
        dt._local = storage.map_tensors(src._local, lambda t: t.detach().requires_grad_(rg))
    return None


def _fits(b, a) -> bool:
    """Does ``b`` fill ``a`` (the same shape, or size 1 where ``a`` holds copies)?"""
    return b.dim() == a.dim() and all(x == y or x == 1 for x, y in zip(b.shape, a.shape))


def check_state_dict(owner: str, expected: dict, given, strict: bool) -> None:
    """Raise torch's ``load_state_dict`` error before anything is copied: missing and
    unexpected keys (``strict``), and size mismatches (always, as torch).  ``expected``:
    key -> the shape the module holds."""
    if not hasattr(given, "keys"):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(given)}.")
    errors = []
    if strict:
        unexpected = [k for k in given.keys() if k not in expected]
        missing = [k for k in expected if k not in given]
        if missing:
            errors.append("Missing key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in missing) + ". ")
        if unexpected:
            errors.append("Unexpected key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    for k, shape in expected.items():
        v = given.get(k) if hasattr(given, "get") else None
        if shape is None:               # a module's extra state (get_extra_state)
            continue
        if v is not None and hasattr(v, "shape") and tuple(v.shape) != tuple(shape):
            if not (len(shape) == 0 and tuple(v.shape) == (1,)):
                errors.append(f"size mismatch for {k}: copying a param with shape "
                              f"{tuple(v.shape)} from checkpoint, the shape in current model "
                              f"is {tuple(shape)}.")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {owner}:\n\t"
                           + "\n\t".join(errors))
