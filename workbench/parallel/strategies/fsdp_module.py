"""``FSDPModule``: what a module becomes under ``fully_shard`` (the class swapped in place).

FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) gives the
module a class ``FSDP<Class>`` with ``FSDPModule`` first in its method resolution order,
so the user's object keeps its own forward and attributes and gains FSDP's methods.  Here
too (:func:`fsdp_class`).  What the class does beyond torch's module:

* ``model(x)`` on the root runs its sharded state (:class:`.fully_shard_state.
  FullyShardRoot`): the input split over the ranks, every unit gathered around its own
  forward; a block run outside its root's forward raises (its weights are shards);
* ``state_dict()`` gives FSDP2's ``Shard(0)`` DistTensors under the module's own names
  (a block's: its own entries), ``load_state_dict`` takes them or full tensors (on the
  root);
* FSDP2's methods: ``set_requires_gradient_sync`` (gradient accumulation without
  communication), ``set_reshard_after_forward``, ``reshard`` (the parameters are the
  shards outside forward already: nothing to do, as torch when already resharded); what
  is not built (``unshard``, explicit prefetch lists, a custom divide factor,
  ``set_reshard_after_backward(False)``) raises, naming what to do instead.

A hook on each sharded module casts its floating inputs to ``param_dtype``
(``cast_forward_inputs``) and its floating outputs to ``output_dtype``, as FSDP2's
pre-/post-forward do per module.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

from ..dcp_interop import as_stateful
from .fsdp_units import tree_cast
from .fully_shard_tp import built, tp_named_parameters
from .laid_out_hooks import refuse_held_hooks

__all__ = ["FSDPModule", "fsdp_class", "install_hooks"]

_CLASSES: dict = {}
_RAW = [0]          # >0 while the sharded state reads the module's own state_dict


@contextlib.contextmanager
def _raw():
    _RAW[0] += 1
    try:
        yield
    finally:
        _RAW[0] -= 1


def fsdp_class(cls):
    """``FSDP<cls>``: FSDPModule before ``cls`` (made once per class, as torch's)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                             {"__module__": cls.__module__})
    return _CLASSES[cls]


def install_hooks(module) -> None:
    """The per-module casts of ``mp_policy`` (module docstring)."""
    module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    module.register_forward_hook(_cast_output)


def _cast_inputs(module, args, kwargs):
    mp = module._wb_fully_shard.mp_policy
    if mp.param_dtype is None or not mp.cast_forward_inputs:
        return None
    return tree_cast(args, mp.param_dtype), tree_cast(kwargs, mp.param_dtype)


def _cast_output(module, args, output):
    dt = module._wb_fully_shard.mp_policy.output_dtype
    return None if dt is None else tree_cast(output, dt)


def _tp_under_torchrun(m) -> bool:
    """``m`` is sharded over DistTensors on a torch.distributed mesh."""
    tp = m._wb_fully_shard.tp
    if not tp:
        return False
    from ...sim_mesh import backends as _B
    return _B.is_distributed(tp[0])


def _building(m) -> bool:
    while m._wb_fully_shard.top is not None:
        m = m._wb_fully_shard.top
    return m._wb_fully_shard.building


class FSDPModule:
    """FSDP2's ``FSDPModule`` methods on a ``fully_shard``-ed module (module docstring)."""

    def __new__(cls, *args, **kwargs):
        # a container indexed by a slice makes ``type(self)(...)``: the original class,
        # as torch's FSDPModule.__new__ does
        orig = cls.__mro__[cls.__mro__.index(FSDPModule) + 1]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    # ---- running: the root runs its sharded state -------------------------------------
    def _wb_root(self):
        st = self._wb_fully_shard
        return st.wrapper if st.wrapper is not None else st.owner

    def __call__(self, *args, **kwargs):
        st = self._wb_fully_shard
        if st.tp is not None:            # over DistTensor parameters: hooks on the modules
            w = built(self)
            if w.module is self:         # the last step's reduce-scatters waited (clock)
                if not w.__dict__.get("_wb_in_forward"):
                    w.check_places("fully_shard")   # assigned since: raise (.replaced_params)
                w.finish_gradient_synchronization()
            d = w.__dict__               # module.weight: the gathered copy while inside
            if not d.get("_wb_in_forward"):      # a new forward: copies before it not read
                d["_wb_forward_id"] = d.get("_wb_forward_id", 0) + 1
            d["_wb_in_forward"] = d.get("_wb_in_forward", 0) + 1     # (.fully_shard_attrs)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                d["_wb_in_forward"] -= 1
        if st.wrapper is not None and st.wrapper._k is None:
            return st.wrapper(*args, **kwargs)
        if self._wb_root()._k is None:
            raise RuntimeError(
                f"{st.name} (fully_shard-ed inside {type(st.owner.module).__name__}) was "
                "called outside its root's forward: its parameters are shards, gathered only "
                "by the root; call the root module (model(x))")
        return super().__call__(*args, **kwargs)

    def __deepcopy__(self, memo):
        raise NotImplementedError(
            f"copy.deepcopy of a fully_shard-ed {self._wb_fully_shard.name}: its shards are "
            "held by its sharded state (as FSDP2, which refuses too); deepcopy the module "
            "before fully_shard and shard the copy")

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """Plain modules: the shards the module holds (torch's own walk).  Over DistTensor
        parameters: the dp shards of the sharded state, under the module's own names."""
        from ..module_state import _HIDING
        st = self._wb_fully_shard
        if st.tp is None or _building(self) or _HIDING[0]:   # (a walk of the plain ones)
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return tp_named_parameters(self, prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        return (p for _, p in self.named_parameters(recurse=recurse))

    # ---- state dicts: FSDP2's Shard(0) DistTensors ---------------------------------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The module's own names; each parameter a DistTensor ``Shard(0)`` on the mesh
        (a copy), buffers plain tensors, as FSDP2's ``state_dict()``."""
        if args:                          # torch's deprecated positional order
            destination, prefix, keep_vars = (list(args[:3]) +
                                              [destination, prefix, keep_vars][len(args):])
        if _RAW[0] or self._wb_fully_shard.tp is not None:   # tp: fsdp_dist_habits' hooks
            from ..keep_vars import as_parameters
            sd = super().state_dict(destination=destination, prefix=prefix,
                                    keep_vars=keep_vars)
            if _RAW[0] or destination is not None:
                return sd
            # a user's keep_vars=True: the parameters themselves (the shards), as FSDP2's
            return as_parameters(self, sd, prefix, keep_vars)
        st = self._wb_fully_shard
        with _raw():
            if st.wrapper is not None:
                sd = st.wrapper.state_dict(destination, prefix, keep_vars)
                return sd if destination is not None else as_stateful(sd)
            root = st.owner
            qual = next(n for n, m in root.module.named_modules() if m is self) + "."
            full = root.state_dict()
        out = OrderedDict() if destination is None else destination
        for k, v in full.items():
            if k.startswith(qual):
                out[prefix + k[len(qual):]] = v
        return out if destination is not None else as_stateful(out)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """On the root: :meth:`state_dict`'s DistTensors or full tensors, cut into the
        shards in place (checked first, ``strict`` as torch)."""
        st = self._wb_fully_shard
        if st.tp is not None:            # the habits' hooks cut the values into the shards
            return super().load_state_dict(state_dict, strict, assign)
        if st.wrapper is None:
            raise NotImplementedError(
                f"load_state_dict on {st.name}, a fully_shard-ed block of "
                f"{type(st.owner.module).__name__}: load through the root "
                "(model.load_state_dict(sd), every key under its own prefix)")
        with _raw():
            return st.wrapper.load_state_dict(state_dict, strict, assign)

    # ---- FSDP2's methods --------------------------------------------------------------
    def _wb_fsdp_modules(self, recurse):
        return [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: the next backwards reduce nothing and hold each rank's unsharded
        gradients; the first backward after ``True`` reduce-scatters their sum onto the
        shards (FSDP2's gradient accumulation without communication, FSDP1's ``no_sync``)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync({requires_gradient_sync!r}): give "
                            "True or False")
        mods = self._wb_fsdp_modules(recurse)
        if not requires_gradient_sync and any(_tp_under_torchrun(m) for m in mods):
            raise NotImplementedError(
                "set_requires_gradient_sync(False) over tensor-parallel DistTensor parameters "
                "under torch.distributed is not built: accumulate with sync on (each "
                "backward reduce-scatters onto the shards, where the gradients add up to the "
                "same sum)")
        if not requires_gradient_sync:     # a user's p.register_hook (.laid_out_hooks)
            refuse_held_hooks([p for m in mods for p in m.parameters()],
                              "set_requires_gradient_sync(False)")
        for m in mods:
            m._wb_fully_shard.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP's all-reduce across replicas: there is none with a 1-d mesh (as in torch,
        where the flag then changes nothing); a bool is taken."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"set_requires_all_reduce({requires_all_reduce!r}): give True or "
                            "False")

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """True: free the gathered weights after forward, gather again in backward; False:
        keep them for backward."""
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward({reshard_after_forward!r}): give True "
                            "or False (an int, a smaller world, is not built)")
        mods = self._wb_fsdp_modules(recurse)
        if not reshard_after_forward and any(_tp_under_torchrun(m) for m in mods):
            raise NotImplementedError(
                "set_reshard_after_forward(False) over tensor-parallel DistTensor parameters "
                "under torch.distributed is not built: every unit re-gathers in backward there")
        for m in mods:
            m._wb_fully_shard.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """True (the default, what runs here): the weights are freed after backward."""
        if reshard_after_backward is not True:
            raise NotImplementedError(
                f"set_reshard_after_backward({reshard_after_backward!r}): keeping the "
                "gathered weights from backward to the next forward is not built; every "
                "forward gathers again (leave it True)")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """A hint for waiting on reductions: they run inside backward here, so none wait."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward({is_last_backward!r}): give True or False")

    def reshard(self) -> None:
        """Outside forward the parameters are the shards already (the gathered copies live
        only inside the root's forward and backward): nothing to free, as torch's
        ``reshard()`` of a resharded module."""

    def unshard(self, async_op: bool = False):
        raise NotImplementedError(
            "FSDPModule.unshard(): the gathered weights live only inside the root's forward "
            "here; for the full values use model.state_dict() (DistTensors; .full()) or run "
            "model(x)")

    def set_modules_to_forward_prefetch(self, modules) -> None:
        raise NotImplementedError("set_modules_to_forward_prefetch: explicit prefetch lists are "
                                  "not built; each unit is gathered when it starts (use "
                                  "wb.FullyShardedDataParallel(..., prefetch=True) to gather "
                                  "one unit early)")

    def set_modules_to_backward_prefetch(self, modules) -> None:
        raise NotImplementedError("set_modules_to_backward_prefetch: explicit prefetch lists "
                                  "are not built (see wb.FullyShardedDataParallel's prefetch)")

    def set_gradient_divide_factor(self, factor: float) -> None:
        raise NotImplementedError(
            f"set_gradient_divide_factor({factor!r}): the gradients are those of the loss over "
            "the whole batch (one device's); another factor is not built")

    set_reduce_scatter_divide_factor = set_gradient_divide_factor
