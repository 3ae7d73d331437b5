"""A parameter assigned on the module after wrapping: the next forward raises.

``model.lm_head.weight = model.wte.weight`` (nanoGPT's weight tying) or ``m.head.weight =
nn.Parameter(t)`` after ``DistributedDataParallel`` / ``FullyShardedDataParallel`` /
``fully_shard`` replaced the module's parameter with one the wrapper does not hold:

* FSDP and ``fully_shard`` gathered their own shard into that attribute at the next
  forward and put it back after, so the tie was undone at once and the old head trained
  on (1.9 off one device's tied model after two steps, habits9), silently;
* DDP on simulated ranks failed with a bare ``KeyError`` (its bucket order looks the
  parameters up by identity).

torch's wrappers: ``DistributedDataParallel`` raises at the next iteration ("Expected to
have finished reduction in the prior iteration": its reducer waits for the replaced
parameter's gradient; measured on gloo, torch 2.13); FSDP2 re-reads each sharded
parameter at its lazy init before the first forward (torch 2.13
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:296-307`` ``lazy_init`` ->
``_fsdp_param.py:995`` ``reset_sharded_param``), so a tie to another of its sharded
parameters made between ``fully_shard`` and the first forward trains as one device
(measured on gloo), and a plain ``nn.Parameter`` fails there with an ``AttributeError``
(no ``_local_tensor``).  Following a tie here is not built: the wrappers raise, naming
the parameter and the fix (tie or replace before wrapping).
"""
from __future__ import annotations

from .laid_out_hooks import carry_hooks

__all__ = ["check_places", "check_named", "snapshot", "mark_successor", "follow_successors",
           "check_dist_places", "check_read_through"]

_FIX = ("the wrapper laid out the module's parameters when it was built, so it would not "
        "follow the change (its forward would use its own parameter there, or none).  Tie or "
        "replace parameters before wrapping the module (nanoGPT ties lm_head.weight = "
        "wte.weight in the model's __init__)")


_PARAMETRIZED = ("the wrapper laid out the module's parameters when it was built, so it "
                 "would not follow it.  Register the parametrization before wrapping (the "
                 "wrapper then lays out its original and trains it as one device)")


def _parametrized(m, attr: str) -> bool:
    """Did ``torch.nn.utils.parametrize`` move ``m.<attr>`` into ``m.parametrizations``
    (``weight_norm`` / ``spectral_norm`` / ``register_parametrization`` after wrapping)?"""
    from torch.nn.utils import parametrize
    return m is not None and parametrize.is_parametrized(m, attr)


def _place(root, name: str):
    """``(module, attribute)`` of the dotted parameter ``name`` under ``root``."""
    path, _, attr = name.rpartition(".")
    try:
        return (root.get_submodule(path) if path else root), attr
    except AttributeError:
        return None, attr


def _raise(who: str, name: str, now, new: bool = False, place=None) -> None:
    if place is not None and _parametrized(*place):
        # before (habits9b): "assigned after wrapping ... weight tying", which it was not
        raise RuntimeError(
            f"{who}: the module's parameter {name!r} was parametrized after wrapping "
            "(torch.nn.utils.parametrizations.weight_norm / spectral_norm, "
            "register_parametrization: it moved into module.parametrizations); "
            + _PARAMETRIZED)
    if new:
        what = f"the module's parameter {name!r} was registered after wrapping"
    else:
        what = (f"the module's parameter {name!r} was assigned after wrapping (it now holds "
                f"{'another tensor' if now is not None else 'nothing'}: weight tying such as "
                "head.weight = wte.weight, a new nn.Parameter, or torch.func.functional_call "
                "on the wrapper, which a wrapper cannot follow: call it on the plain module)")
    raise RuntimeError(f"{who}: {what}; " + _FIX)


def check_places(units, who: str) -> None:
    """FSDP's units (:func:`.fsdp_units.plan_units`: ``(name, shard, places)``): every
    place still holds the unit's shard, else raise."""
    for u in units:
        for name, shard, places in u.params:
            for m, attr in places:
                now = m._parameters.get(attr)
                if now is not shard:
                    _raise(who, name, now, place=(m, attr))


def check_read_through(wrapper, who: str) -> None:
    """Each of ``wrapper``'s parameters, read by its name through the wrapper, is still
    the wrapper's (else raise).  ``torch.func.functional_call(fsdp, params, x)`` sets the
    given tensors as attributes of the wrapper (it holds no ``_parameters`` of its own, its
    names reach the module's), which its forward never reads: it computed with its own
    shards and returned their output for any ``params`` (1.17 off one device's
    functional_call with zeros, measured), silently."""
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        obj = wrapper
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if obj is not p:
            raise RuntimeError(
                f"{who}: its parameter {name!r} reads as another tensor through the wrapper "
                "(torch.func.functional_call or torch.nn.utils.stateless on the wrapper, or "
                f"an assignment wrapper.{name} = ...); the wrapper computes with its own "
                "shards, so it would ignore it.  Call functional_call on the plain module "
                "before wrapping, or load values into the wrapper with load_state_dict")


def check_dist_places(module, who: str, entries=None) -> None:
    """A module of DistTensor parameters (``wb.parallelize``: each held in ``_parameters``
    and ``_wb_dist_params`` alike): a plain tensor assigned over one (``m.bias =
    nn.Parameter(t)`` registers it in ``_parameters`` only) raises; ``entries`` (FSDP over
    DistTensors: ``(name, places, template)``) also, each place still holds its template.
    Before: FSDP over DistTensors built its shards from the templates and put them back,
    the assigned tensor dropped (0.17 off one device's forward, habits9), silently."""
    for mname, m in module.named_modules():
        for attr, t in getattr(m, "_wb_dist_params", {}).items():
            now = m._parameters.get(attr)
            if now is not t:
                _raise(who, f"{mname}.{attr}" if mname else attr, now)
    for name, places, tmpl in entries or ():
        for m, attr in places:
            if getattr(m, "_wb_dist_params", {}).get(attr) is not tmpl:
                _raise(who, name, m._parameters.get(attr))


def snapshot(module) -> list:
    """``(name, parameter)`` of every place of ``module`` (tied ones under each name)."""
    return list(module.named_parameters(remove_duplicate=False))


def check_named(module, snap: list, who: str) -> None:
    """``module``'s parameters are still ``snap``'s (the same objects, names), else raise."""
    now = module.named_parameters(remove_duplicate=False)
    have = dict(now)
    for name, p in snap:
        q = have.get(name)
        if q is not p:
            _raise(who, name, q, place=_place(module, name))
    if len(have) != len({n for n, _ in snap}):
        extra = next(n for n in have if n not in {n for n, _ in snap})
        _raise(who, extra, have[extra], new=True)


# ---- an optimizer built before wrapping (nanoGPT's order) ----------------------------------
# nanoGPT's train.py builds the optimizer from the plain model, then wraps it in DDP
# (``optimizer = model.configure_optimizers(...)``; ``model = DDP(model, ...)``).  torch's
# DDP keeps the module's parameters, so that optimizer trains (one device's parameters,
# measured on gloo, torch 2.13); here DDP's rows and FSDP's / fully_shard's chunks are new
# tensors, and the optimizer stepped the old ones, which never get a gradient: nothing
# trained (0.020 off one device after two AdamW steps, habits9), silently.  torch's FSDP2
# replaces the parameters too and trains nothing the same way (measured on gloo); its docs
# ask for the optimizer after fully_shard.  Here the wrapper leaves on each parameter it
# replaced its successor, and before any step the optimizer's groups and states follow it
# (:func:`follow_successors`): states of the module's shape (a step taken before wrapping)
# are then laid out as the new parameter by the next step pre-hook
# (:func:`.laid_out._lay_out_loaded_states`), so the run goes on as on one device.


def mark_successor(old, new) -> None:
    """``old`` (a module's parameter) was replaced by ``new`` when a wrapper laid it out;
    the gradient hooks a user registered on ``old`` move to ``new`` (.laid_out_hooks)."""
    if new is not old:
        old._wb_successor = new
        carry_hooks(old, new)


def _last(p):
    while getattr(p, "_wb_successor", None) is not None:
        p = p._wb_successor
    return p


def follow_successors(optimizer) -> None:
    """The optimizer's parameters that a wrapper replaced, swapped for what replaced them
    in its groups (in place: the same lists) and its state (moved to the new key)."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if getattr(p, "_wb_successor", None) is None:
                continue
            new = _last(p)
            params[i] = new
            if p in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(p)
