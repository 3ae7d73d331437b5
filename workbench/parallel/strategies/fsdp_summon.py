"""FSDP1's ``summon_full_params`` and ``state_dict_type``, on ``FullyShardedDataParallel``.

``FullyShardedDataParallel.summon_full_params(module, recurse=True, writeback=True,
rank0_only=False, offload_to_cpu=False, with_grads=False)`` (torch 2.13,
``torch/distributed/fsdp/fully_sharded_data_parallel.py:864-935``, arguments checked as
``_unshard_param_utils._validate_unshard_params_args``): inside the context the module's
parameters are the full ones (its own shapes, the shards' dtype, not ``compute_dtype``:
torch unshards without mixed precision); on exit they are the shards again and, with
``writeback=True``, what was written into the full ones is cut back into the shards (each
process keeps its own chunk of its own copy, as torch's "only the portion corresponding to
the local param shard will persist"); ``writeback=False`` discards the writes.  ``module``
is a wrapper, or a module holding wrappers (each one summoned).  ``recurse=False``
summons the root unit only (FSDP1's nested instances are our ``units``).  Not inside a
forward or backward, and no forward inside the context (torch raises for both).
``with_grads=True`` is not built here (raises).

``FullyShardedDataParallel.state_dict_type(module, state_dict_type, state_dict_config=None,
optim_state_dict_config=None)`` (the same file, ``state_dict_type`` and
``set_state_dict_type``): ``StateDictType.FULL_STATE_DICT`` makes ``state_dict()`` inside
the context the full tensors under the module's own names (FSDP1's; ``FullStateDictConfig``
``offload_to_cpu`` / ``rank0_only`` honoured); ``load_state_dict`` takes them always.
``LOCAL_STATE_DICT`` (flat shards) and ``SHARDED_STATE_DICT`` raise: the default
``state_dict()`` here is FSDP2's ``Shard(0)`` DistTensors already (:mod:`.fsdp_state`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..load_back import flush
from .flat_shards import flat_padded

__all__ = ["SummonFullParams"]


def _wrappers(module, cls) -> list:
    """The ``cls`` instances in ``module``: itself, or those its tree holds (walked through
    ``_modules``: a wrapper's ``modules()`` answers with its wrapped module's)."""
    if isinstance(module, cls):
        return [module]
    out, todo, seen = [], [module], set()
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, cls):
            out.append(m)
            continue
        todo.extend(c for c in m._modules.values() if c is not None)
    return out


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"summon_full_params({name}={value!r}): give True or False")


def _dist_tensor_mode(w) -> str | None:
    from .fsdp_dist import DistTensorFSDP
    if isinstance(w, DistTensorFSDP):
        return ("FullyShardedDataParallel over DistTensor parameters (ZeRO-3) is not built "
                "for it; read each parameter's full value with p.full()")
    return None


class SummonFullParams:
    """Mixed into FullyShardedDataParallel (``self.units``, ``self._full``, ``self._store``)."""

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """Inside: the full parameters; on exit, the writes cut back into the shards when
        ``writeback`` (module docstring)."""
        from .fsdp import FullyShardedDataParallel
        for name, value in (("recurse", recurse), ("writeback", writeback),
                            ("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu),
                            ("with_grads", with_grads)):
            _check_flag(name, value)
        if with_grads:
            raise NotImplementedError("summon_full_params(with_grads=True) is not built here: "
                                      "read the gradients' norm with clip_grad_norm_, or "
                                      "leave with_grads=False")
        if writeback and rank0_only:    # torch's own refusal (_validate_unshard_params_args)
            raise NotImplementedError("summon_full_params(writeback=True, rank0_only=True) is "
                                      "not supported (torch's): pass writeback=False with "
                                      "rank0_only=True")
        wrappers = _wrappers(module, FullyShardedDataParallel)
        if not wrappers:
            raise ValueError(f"summon_full_params({type(module).__name__}): it neither is nor "
                             "holds a FullyShardedDataParallel; pass the wrapper (a module "
                             "given to fully_shard has its parameters as DistTensors: use "
                             "p.full())")
        for w in wrappers:
            why = w._cannot_summon()
            if why:
                raise RuntimeError(f"summon_full_params: {why}")
        flush()                     # a write into an earlier state_dict()'s copies lands first
        done = []                   # (wrapper, [(shard, places, full)])
        try:
            for w in wrappers:
                done.append((w, w._summon(recurse, rank0_only, offload_to_cpu)))
            yield
        finally:
            errors = []
            for w, entries in reversed(done):
                try:
                    w._unsummon(entries, writeback)
                except BaseException as e:      # every wrapper gets its shards back
                    errors.append(e)
            if errors:
                raise errors[0]

    def _cannot_summon(self) -> str | None:
        if getattr(self, "_wb_summoned", False):
            return "this FullyShardedDataParallel's full parameters are summoned already"
        if self._k is not None:
            return "inside this FullyShardedDataParallel's forward; call it after forward"
        return _dist_tensor_mode(self)

    @torch.no_grad()
    def _summon(self, recurse, rank0_only, offload_to_cpu) -> list:
        g = self.group
        show = not (rank0_only and g.distributed and g.k != 0)      # torch: rank 0 only
        entries = []
        units = self.units if recurse else self.units[:1]
        try:
            for u in units:
                for _, shard, places in u.params:
                    full = self._full(shard).clone()        # every process: a collective
                    if offload_to_cpu:
                        full = full.cpu()
                    full = nn.Parameter(full, requires_grad=shard.requires_grad)
                    entries.append((shard, places, full))
                    if show:
                        for m, attr in places:
                            m._parameters[attr] = full
        except BaseException:
            self._unsummon(entries, False)
            raise
        object.__setattr__(self, "_wb_summoned", True)
        return entries

    @torch.no_grad()
    def _unsummon(self, entries, writeback) -> None:
        try:
            if writeback:
                for shard, places, full in entries:
                    g = self.group
                    rows = flat_padded(full.detach().to(shard.device, shard.dtype),
                                       g.n).view(g.n, -1)
                    shard.copy_(rows[g.k] if g.distributed else rows)
        finally:
            for shard, places, _ in entries:
                for m, attr in places:
                    m._parameters[attr] = shard
            object.__setattr__(self, "_wb_summoned", False)

    # ---- state_dict_type -------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """``StateDictType.FULL_STATE_DICT``: ``state_dict()`` inside gives full tensors
        (module docstring); the other types raise."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from .fsdp import FullyShardedDataParallel
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(f"state_dict_type({state_dict_type!r}): give a torch.distributed."
                            "fsdp.StateDictType (FULL_STATE_DICT is built here)")
        if state_dict_type != StateDictType.FULL_STATE_DICT:
            raise NotImplementedError(
                f"state_dict_type({state_dict_type}): only StateDictType.FULL_STATE_DICT is "
                "built here (LOCAL_STATE_DICT and SHARDED_STATE_DICT are not); the default "
                "state_dict() already gives FSDP2's Shard(0) DistTensors, the sharded form")
        if state_dict_config is None:
            state_dict_config = FullStateDictConfig()
        if type(state_dict_config) is not FullStateDictConfig:
            raise TypeError(f"state_dict_type(FULL_STATE_DICT, state_dict_config="
                            f"{state_dict_config!r}): give a FullStateDictConfig (or None)")
        if optim_state_dict_config is not None:
            raise NotImplementedError(
                "state_dict_type(optim_state_dict_config=...): FSDP1's optim_state_dict is not "
                "built here; an optimizer over the shards gives full tensors in its own "
                "state_dict() (strategies/laid_out); leave it None")
        wrappers = _wrappers(module, FullyShardedDataParallel)
        if not wrappers:
            raise ValueError(f"state_dict_type({type(module).__name__}): it neither is nor "
                             "holds a FullyShardedDataParallel; pass the wrapper")
        for w in wrappers:
            why = _dist_tensor_mode(w)
            if why:
                raise NotImplementedError(f"state_dict_type: {why}")
        before = [getattr(w, "_wb_full_sd", None) for w in wrappers]
        for w in wrappers:
            object.__setattr__(w, "_wb_full_sd", state_dict_config)
        try:
            yield
        finally:
            for w, b in zip(wrappers, before):
                object.__setattr__(w, "_wb_full_sd", b)
