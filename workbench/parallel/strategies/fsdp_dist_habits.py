"""The wrapped module's own habits under ``FullyShardedDataParallel``'s DistTensor mode.

:class:`.fsdp_dist.DistTensorFSDP` (and ``Zero3``) moves each DistTensor parameter into
flat shards (the ``nn.Parameter`` s an optimizer steps); the module's ``_parameters`` keep
the DistTensors ``wb.parallelize`` made, as templates (placements, shapes).  On simulated
ranks a template's storage is a view of its shard (:mod:`.fsdp_dist_views`), so it reads
the values the optimizer wrote last; under torch.distributed it is a copy, refreshed
after each step (below).  What a user calls on the module itself must reach the shards,
so :func:`install_habits` makes:

* ``module.state_dict()`` (and ``fsdp.state_dict()``): each parameter a DistTensor of the
  template's placements gathered from the shards now (FSDP2's ``state_dict()`` gives its
  sharded DTensors; here the DistTensor holds the parameter's own layout), from a
  state-dict hook on each module holding parameters;
* ``module.load_state_dict(...)``: the loaded values (DistTensors or full tensors) cut
  into the shards, from a load post-hook;
* ``module.zero_grad()`` / ``requires_grad_()``: the shards' gradients and flags
  (:class:`~workbench.parallel.module_state.ParallelModule` reads ``_wb_shards``);
  ``module.to(dtype)`` raises (the shards would stay as they are);
* each template's storage tensors carry ``_wb_stale`` (a message), as do the copies a
  forward gathers (a module's attribute until the optimizer step,
  :meth:`.fsdp_dist.DistTensorFSDP._gather`): an in-place write to either (``nn.init``
  on ``module.weight`` after wrapping) is not built (it would not reach the shards under
  torch.distributed, nor from a gathered copy), so DistTensor's in-place writes refuse it
  (``parallel/inplace.py``);
* on simulated ranks a template whose shard got new storage (``p.data = ...``,
  ``vector_to_parameters``, an optimizer assigning ``.data``) views it again, and the
  module's attributes gathered from the old storage are dropped (they read the template);
  a gradient reaching a template (a loss term on ``model.parameters()`` outside forward)
  raises: it would not reach the shards (:mod:`.fsdp_dist_views`);
* on torch.distributed the templates (``model.named_parameters()``) hold the values at
  wrapping and the module's attributes (``wb.dist_parameters(model)``) the copies the
  last forward gathered; an optimizer step over the shards gathers the parameters again
  into both (:func:`_refresh_after_step`, not traced: a read, as the state dict's), so
  they hold the values the shards hold now, as on simulated ranks (where the templates
  are views of the shards) and as FSDP2's parameters (its sharded DTensors, stepped in
  place); before, they were one step (or, the templates, every step) old;
* ``p.grad`` of a module's parameter (and of its attribute): on simulated ranks a view
  of the shard's gradient in the parameter's layout (:class:`.fsdp_dist_views.GradOf`),
  as FSDP2's parameters carry their sharded gradients; under torch.distributed reading
  one that exists raises, naming the shards (it was None, silently);
* ``torch.nn.utils.clip_grad_norm_(module.parameters(), ...)`` (and ``wb.``'s,
  ``clip_grad_value_``, over the templates or the module's attributes after a forward):
  each is read as its shard (``_wb_clip_shard``,
  :func:`..clip_grad._to_shards`), so it gives one device's norm and clips the shards, as
  FSDP2's ``model.parameters()`` (its sharded DTensors) do (it raised, naming the
  shards; before their ``.grad`` existed it was a silent no-op); torch's own
  ``clip_grad_norm_(fsdp.parameters(), ...)`` reads the shards and gives the total norm
  on simulated ranks (each shard once); under torch.distributed a shard's norm is partial,
  reduced over the mesh's groups when torch combines the norms (:func:`_shard_norm_grad`).
"""
from __future__ import annotations

import functools

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import storage
from ..dist_tensor import DistTensor
from ..load_back import flush, mark
from .flat_shards import unflat
from .fsdp_dist_views import VIEW_NOTE, GradOf, relink, wrapper_names
from .rank_grads import as_gathered_grad, as_shard_grad

__all__ = ["install_habits", "gathered", "module_shaped_optimizer_states"]


def _clip_message(fsdp) -> str:
    who, var = wrapper_names(fsdp)
    return (f"{who} keeps this parameter's values and gradient in its flat shards; the "
            "module's DistTensor is its layout and value (its .grad a view of the shard's "
            "on simulated ranks), and a clip over it is not built.  "
            "Clip the shards: "
            f"torch.nn.utils.clip_grad_norm_({var}.parameters(), max_norm)")


@torch.no_grad()
def gathered(fsdp, i: int) -> DistTensor:
    """Entry ``i``'s parameter now: a DistTensor of the template's placements whose
    storage is gathered from the shards (one copy on the dp dim; not traced)."""
    from ...sim_mesh.trace import suspend
    _, _, tmpl, shard = fsdp.entries[i]
    with suspend():
        if not fsdp.async_:                  # torch.distributed: the blocking gather
            d = fsdp._gather(tmpl, shard.detach())
            return DistTensor(d._local.detach().clone(), fsdp.mesh, tmpl.placements,
                              tmpl.shape, shard.dtype)
        nd = fsdp.mesh.ndim
        full = fsdp.gather_compact(shard.detach())                     # one copy on dp
        full = unflat(full, tuple(tmpl._local.shape[nd:]), nd).clone()
    return DistTensor(full, fsdp.mesh, tmpl.placements, tmpl.shape, shard.dtype)


class _TPChunks:
    """Entry ``i``'s shard storage and the parameter's global tensor, both ways (the
    ``how`` of :func:`.laid_out.laid_out`): so a ``torch.optim`` optimizer's
    ``state_dict()`` over the shards gives one device's shapes and takes them back
    (:func:`.laid_out._module_shaped_states`), as over the plain-module FSDP's."""

    def __init__(self, fsdp, i: int):
        self.fsdp, self.i = fsdp, i

    @torch.no_grad()
    def full(self, t):
        from ...sim_mesh.trace import suspend
        fsdp, tmpl = self.fsdp, self.fsdp.entries[self.i][2]
        nd = fsdp.mesh.ndim
        with suspend():
            if fsdp.async_:
                loc = fsdp.gather_compact(t.detach())                      # one copy on dp
                loc = unflat(loc, tuple(tmpl._local.shape[nd:]), nd)
            else:                       # torch.distributed: this process's local shard
                # a collective over the mesh's processes: each makes the same read, or
                # the reader gets an error naming the fix (it hung: fixlist16)
                from ...sim_mesh.agreed_reads import agree
                from .rank_grads import GatheredGrad
                names = getattr(fsdp, "names", None)
                name = names[self.i] if names else f"parameter {self.i}"
                of = "the gradient of " if isinstance(t, GatheredGrad) else ""
                agree(fsdp.mesh.ranks, f"{of}{wrapper_names(fsdp)[0]}'s {name!r} "
                                       f"{tuple(tmpl.shape)}")
                loc = fsdp._gather(tmpl, t.detach())._local.detach()
            return DistTensor(loc, fsdp.mesh, tmpl.placements, tmpl.shape, t.dtype).full()

    @torch.no_grad()
    def store(self, v):
        from ..dist_tensor import shard_tensor
        fsdp, tmpl = self.fsdp, self.fsdp.entries[self.i][2]
        dt = shard_tensor(v.detach(), fsdp.mesh, tmpl.placements)
        return fsdp.chunk_of(dt._local)


def module_shaped_optimizer_states(fsdp) -> None:
    """Each shard says how its storage and the parameter's global tensor map
    (:class:`_TPChunks`): the optimizer's states in one device's shapes.  For
    ``fully_shard`` (:mod:`.fully_shard_tp`) and a user's optimizer over ``Zero3``'s shards
    too; ``Zero3``'s own stage optimizer keeps the storage's shapes, which its
    ``load_state_dict`` checks (:mod:`.zero3`).  Under torch.distributed
    as on simulated ranks (each process's ``(1, 1, chunk)`` gathered over dp, then its
    tensor-parallel shards over tp: collectives every process joins, as each takes the
    same ``state_dict()``), so a checkpoint saved under torchrun loads into a plain
    optimizer, another layout or the simulated ranks of the same program (it kept the
    storage's shapes there, which none of them takes)."""
    for i, (_, _, tmpl, shard) in enumerate(fsdp.entries):
        if isinstance(tmpl._local, torch.Tensor):
            how = _TPChunks(fsdp, i)
            shard._wb_shape, shard._wb_full, shard._wb_store = \
                tuple(tmpl.shape), how.full, how.store


def users_read_the_module(fsdp) -> None:
    """Simulated ranks: a user's ``numel()`` / ``shape`` / reductions of a shard (and of
    its gradient, a :class:`.rank_grads.GatheredGrad`) read the module parameter's global
    tensor, gathered (the rule habits14 gave ``fully_shard`` over tensor parallelism; the
    wrappers' own reads stay the storage's).  Before (habits15, ``Linear(3, 6), GELU,
    Linear(6, 3)`` on 2 x 2): ``FullyShardedDataParallel`` / ``Zero3`` over DistTensors read
    every rank's flat chunks, padding included: ``sum(p.numel())`` 52 for 45, the weight's
    ``p.mean()`` -0.0489 for -0.0543, ``p.grad.abs().min()`` 0.  ``Zero3``'s shards get
    ``_wb_store`` too (habits13b): its own stage optimizer keeps the storage's states.  Under
    torch.distributed FSDP1's shards stay this process's flat piece (torch's
    FlatParameter), ``fully_shard``'s gather (:mod:`.fully_shard_tp`)."""
    if not fsdp.async_:
        return
    for i, (_, _, tmpl, shard) in enumerate(fsdp.entries):
        if not isinstance(tmpl._local, torch.Tensor):
            continue
        if getattr(shard, "_wb_full", None) is None:
            shard._wb_shape, shard._wb_full = tuple(tmpl.shape), _TPChunks(fsdp, i).full
        if getattr(shard, "_wb_store", None) is None:
            # Zero3's (no _wb_store): nn.init.normal_(p) one device's draw cut into the
            # chunks, as FSDP's (laid_out._one_draw; it raised, habits16)
            shard._wb_draw_store = _TPChunks(fsdp, i).store
        shard._wb_gathers = "users"
        if shard.requires_grad:
            shard.register_post_accumulate_grad_hook(_gathered_grad)


def _gathered_grad(shard) -> None:
    shard.grad = as_gathered_grad(shard.grad, shard)


def install_habits(fsdp) -> None:
    msg = _clip_message(fsdp)
    stale = (f"this DistTensor is {wrapper_names(fsdp)[0]}'s template of a parameter it moved "
             "into flat shards (it reads their values; an in-place write to it is not built, "
             "it would not reach the shards the forward reads): initialize before wrapping, "
             "or load values with module.load_state_dict (it cuts them into the shards)")
    for i, (_, _, tmpl, shard) in enumerate(fsdp.entries):
        for t in storage.tensors(tmpl._local):
            # model.<p>.grad: a view of the shard's gradient (fsdp_dist_views.GradOf)
            t._wb_grad_of = GradOf(fsdp, i)
            t._wb_clip_refuse = msg
            t._wb_clip_shard = shard    # a clip over it clips the shard (clip_grad.
            #                             _to_shards), as over FSDP2's model.parameters()
            t._wb_stale = stale         # for DistTensor's in-place writes to refuse
            # model.<name>.requires_grad_(False) (a parameter from named_parameters()):
            # its shard, the leaf the optimizer steps, frozen too (it was not: the
            # frozen parameter went on training)
            t._wb_on_requires_grad = shard.requires_grad_
            # and the reverse: opt's parameter (the shard) frozen, the module's reads so
            # (DistTensor.requires_grad reads the shard's flag; it read its own, True)
            t._wb_requires_grad_of = shard
            if not fsdp.async_:         # its own storage: a write through .data would not
                t._wb_data_stale = True     # reach the shards (habits._get_data refuses)
        if not fsdp.async_ and shard.requires_grad:
            shard.register_post_accumulate_grad_hook(_shard_norm_grad(fsdp, tmpl))
    for i, (_, _, _, shard) in enumerate(fsdp.entries):
        if not fsdp.async_:             # torch.distributed: the gathered copies go stale
            shard._wb_refresh = (fsdp, i)
        else:                           # simulated: the templates view the shards
            shard._wb_relink = (fsdp, i)
            shard._wb_on_data_set = functools.partial(relink, fsdp, i)
            shard._wb_view_note = VIEW_NOTE
    for m in fsdp.module.modules():
        items = fsdp._by_mod.get(id(m))
        if not items:
            continue
        m.__dict__["_wb_shards"] = {attr: fsdp.entries[i][3] for attr, i in items}
        m._register_state_dict_hook(_state_dict_hook(fsdp, items))
        pre, post = _load_hooks(fsdp, items)
        m._register_load_state_dict_pre_hook(pre, with_module=True)
        m.register_load_state_dict_post_hook(post)
    # each state_dict() of the model first writes back and releases the copies the calls
    # before it handed out (the hooks above, once per submodule, keep this call's held)
    fsdp.module.register_state_dict_pre_hook(lambda module, prefix, keep_vars: flush())


def _shard_norm_grad(fsdp, tmpl):
    """torch.distributed: each process's shard holds 1/dp of its tensor-parallel local
    storage, so its gradient's norm is a part: a :class:`.rank_grads.ShardGrad`, whose
    partial norms torch's ``clip_grad_norm_`` reduces over every mesh dim's group in turn
    (FSDP2's ``_NormPartial`` of DTensor shards), a copy held on several ranks of a
    dim the parameter is replicated on (not dp) counted on that dim's rank 0 only.  It
    raised ("not built for this mode").  ``fully_shard``'s (the shard's ``_wb_gathers``):
    its other reads (``numel``, ``sum``, ``mean``, ``max``, a norm along a dim or of order
    0...) are the whole gradient's, gathered over dp then tp (FSDP2's DTensor gradient's);
    they were this process's chunk's (habits13: numel [5, 2, 5, 2] for [18, 6, 18, 3] on
    2 x 2 gloo processes).  FSDP1's keep the chunk, as torch's flat parameter."""
    from ...sim_mesh import backends as _B
    mesh = fsdp.mesh
    coord = _B.coordinate(mesh)
    skip = any(coord[a] != 0 for a in range(mesh.ndim)
               if a not in fsdp.axes and tmpl.placements[a].is_replicate())
    groups = tuple(_B.group(mesh, a)[0] for a in range(mesh.ndim))

    def hook(shard):
        # fully_shard's (_wb_gathers): its reads gather, as FSDP2's DTensor gradient's
        shard.grad = as_shard_grad(shard.grad, groups, skip, param=shard)
    return hook


def _state_dict_hook(fsdp, items):
    def hook(module, state_dict, prefix, local_metadata):
        flush(release=False)    # a write into an earlier state_dict()'s copies: first
        for attr, i in items:
            key = prefix + attr
            if key in state_dict:
                # a copy: a load in place (wb.checkpoint.load) is cut into the shards
                state_dict[key] = mark(gathered(fsdp, i), lambda v, i=i: _cut(fsdp, i, v),
                                      source=fsdp.entries[i][3])
    return hook


@torch.no_grad()
def _cut(fsdp, i: int, value) -> None:
    """``value`` (a DistTensor or a full tensor) into entry ``i``'s template and shard."""
    from ..module_state import load_dist_
    tmpl, shard = fsdp.entries[i][2], fsdp.entries[i][3]
    if isinstance(value, DistTensor) and value.mesh != tmpl.mesh:
        value = value.full()
    err = load_dist_(tmpl, value, "")
    if err:
        raise RuntimeError(err)
    shard.copy_(fsdp.chunk_of(storage.tensors(tmpl._local)[0].detach()))
    if fsdp.async_:
        relink(fsdp, i)


def _load_hooks(fsdp, items):
    """Before the module loads: each template its parameter's value now (so a key that
    fails to load leaves it as it was); after: the templates cut into the shards."""
    from ..module_state import load_dist_
    todo = []

    @torch.no_grad()
    def pre(module, state_dict, prefix, *_):
        flush(release=False)    # a write into a state_dict() copy lands first, as torch's
        todo[:] = [(attr, i) for attr, i in items if prefix + attr in state_dict]
        for _, i in todo:
            load_dist_(fsdp.entries[i][2], gathered(fsdp, i), "")

    @torch.no_grad()
    def post(module, incompatible_keys):
        for _, i in todo:
            tmpl, shard = fsdp.entries[i][2], fsdp.entries[i][3]
            shard.copy_(fsdp.chunk_of(storage.tensors(tmpl._local)[0].detach()))
            if fsdp.async_:
                relink(fsdp, i)
        todo.clear()
    return pre, post


@torch.no_grad()
def _refresh_after_step(optimizer, args, kwargs) -> None:
    """After any ``torch.optim`` step over torch.distributed ZeRO-3 shards: each stepped
    shard's parameter gathered again into its template and the module's attributes
    (every place of a tied weight; the shard's ``_version`` cannot tell a step, which
    may write ``p.data``, so every step gathers).  A collective over the shard's dp
    group, whose ranks all step it (module docstring).  A global step post-hook
    (``torch.optim.optimizer.register_optimizer_step_post_hook``)."""
    todo = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "_wb_refresh", None)
            if ref is not None:
                todo.setdefault(id(ref[0]), (ref[0], set()))[1].add(ref[1])
    for fsdp, idx in todo.values():
        for i in sorted(idx):
            tmpl, fresh = fsdp.entries[i][2], gathered(fsdp, i)
            mine, theirs = storage.tensors(tmpl._local), storage.tensors(fresh._local)
            if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
                raise RuntimeError(f"{type(fsdp).__name__}: the gathered {fsdp.names[i]} does "
                                   "not fit its template's storage")
            for a, b in zip(mine, theirs):      # model.named_parameters(): the templates
                a.detach().copy_(b)
                # the attribute below answers as the forward's gathered copy does
                # (fsdp_dist._gather): its flag, .data and clipping the parameter's
                b._wb_stale = fsdp._gathered_message()
                b._wb_on_requires_grad, b._wb_data_of = tmpl.requires_grad_, tmpl
                if getattr(a, "_wb_clip_refuse", None):
                    b._wb_clip_refuse = a._wb_clip_refuse
                if getattr(a, "_wb_clip_shard", None) is not None:
                    b._wb_clip_shard = a._wb_clip_shard
                if getattr(a, "_wb_requires_grad_of", None) is not None:
                    b._wb_requires_grad_of = a._wb_requires_grad_of
            for mod, attr in fsdp._places[i]:   # wb.dist_parameters: the attributes
                object.__setattr__(mod, attr, fresh)


register_optimizer_step_post_hook(_refresh_after_step)


@torch.no_grad()
def _relink_after_step(optimizer, args, kwargs) -> None:
    """After any ``torch.optim`` step over simulated ZeRO-3 shards: each stepped shard's
    template a view of it again where the step replaced its storage (``p.data = ...``;
    :func:`.fsdp_dist_views.relink`, nothing done where it still is one).  The module's
    attributes, the copies the last forward gathered, are views of the shards too (with
    autograd to them: a loss term on ``module.weight`` gives the shard its gradient), so
    they stay.  A global step post-hook, as :func:`_refresh_after_step`; nothing gathered,
    nothing traced."""
    todo = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "_wb_relink", None)
            if ref is not None:
                todo.setdefault(id(ref[0]), (ref[0], set()))[1].add(ref[1])
    for fsdp, idx in todo.values():
        for i in sorted(idx):
            relink(fsdp, i)


register_optimizer_step_post_hook(_relink_after_step)
