"""``parallelize(module, mesh, plan)``: shard an ``nn.Module``'s parameters so its own
forward runs unchanged on DistTensors.

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    wb.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"})   # Megatron MLP
    y = model(wb.shard_tensor(x, mesh, [wb.Replicate()]))           # y is Partial

Plan values, per module name or parameter name (``fnmatch`` patterns):

* ``"colwise"``: Linear weight ``Shard(0)`` and bias ``Shard(0)`` (output features
  split: Megatron's column-parallel linear); Embedding weight ``Shard(1)``;
* ``"rowwise"``: Linear weight ``Shard(1)``, bias replicated (input features split:
  the output is a partial sum); Embedding weight ``Shard(0)`` (vocabulary-parallel);
* ``"replicate"``; or an explicit placements list for one parameter.

Parameters no key matches are replicated.  Every parameter becomes a DistTensor
leaf (``requires_grad``) in the module's ``_parameters``, where FSDP2 keeps its DTensor
parameters: ``named_parameters()``, ``state_dict()`` (DistTensors; ``load_state_dict``
takes them or full tensors), ``zero_grad()``, ``requires_grad_()`` and ``.to(dtype)`` /
``.double()`` work as on one device (:mod:`.module_state`); :func:`dist_parameters`
lists them for an optimizer.  ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``
(:mod:`.clip_grad_torch`) and :func:`workbench.clip_grad_norm_` /
:func:`workbench.clip_grad_value_` take them and give one device's answer.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from ..sim_mesh.mesh import Mesh
from .dist_tensor import DistTensor, shard_tensor
from .module_state import adopt, refuse_backward_hooks
from .placement import Replicate, Shard, parse_placements

__all__ = ["parallelize", "dist_parameters", "STYLES"]

STYLES = ("colwise", "rowwise", "replicate")


def _style_placements(style: str, mod: nn.Module, pname: str, mesh_dim: int, ndim: int):
    if style == "replicate":
        return Replicate()
    if isinstance(mod, nn.Embedding):
        return Shard(1 if style == "colwise" else 0)
    if isinstance(mod, nn.Linear):
        if pname == "weight":
            return Shard(0 if style == "colwise" else 1)
        return Shard(0) if style == "colwise" else Replicate()
    raise ValueError(f"plan style {style!r} for a {type(mod).__name__}: colwise/rowwise apply "
                     "to nn.Linear and nn.Embedding; give explicit placements instead")


def _check_plan_value(key, val) -> None:
    """A style name, or placements such as ``["R", "S(0)"]``: a clear error otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"plan key {key!r} ({type(key).__name__}): keys are module or "
                        f"parameter names as strings, e.g. {str(key)!r} or '0.weight'")
    if isinstance(val, str) and val in STYLES:
        return
    try:
        parse_placements(val)
    except (ValueError, TypeError):
        raise ValueError(f"plan[{key!r}] = {val!r}: not a style nor placements; use one of "
                         f"{', '.join(repr(s) for s in STYLES)}, or placements such as "
                         "['S(0)'] for one parameter") from None


def _plan_dict(module, plan) -> dict:
    """``plan`` as a dict; a style name alone applies to ``module`` itself, as torch's
    ``parallelize_module(module, mesh, ColwiseParallel())`` does with one style."""
    if plan is None or isinstance(plan, dict):
        return dict(plan or {})
    ex = "{'0': 'colwise', '2': 'rowwise'}"
    if isinstance(plan, str) and plan in STYLES:
        if not any(p is not None for p in module._parameters.values()):
            raise ValueError(f"parallelize(plan={plan!r}): a style alone applies to the module "
                             f"itself, and this {type(module).__name__} has no parameters of "
                             f"its own; name its submodules in a dict, e.g. {ex}")
        return {"": plan}
    from .tp_styles import ParallelStyle
    if isinstance(plan, ParallelStyle):
        raise TypeError(f"parallelize(plan={plan!r}): a ParallelStyle object is "
                        "wb.parallelize_module's (torch's API): call wb.parallelize_module("
                        "module, mesh, style), or give parallelize a dict of names to style "
                        f"strings, e.g. {ex}")
    raise TypeError(f"parallelize(plan={plan!r:.60}): expected a dict of module or parameter "
                    f"names to styles ({', '.join(repr(s) for s in STYLES)}) or placements, "
                    f"e.g. {ex}, or one style name for the module itself")


def parallelize(module: nn.Module, mesh: Mesh, plan: dict | None = None,
                mesh_dim: int | str = -1) -> nn.Module:
    """Shard ``module``'s parameters in place by ``plan`` along ``mesh_dim`` (the
    tensor-parallel dim; other mesh dims replicate). Returns the module.  A style name
    alone (``"colwise"``) applies to ``module``'s own parameters, e.g. one nn.Linear."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r}: expected a workbench Mesh")
    refuse_backward_hooks(module, "parallelize")
    plan = _plan_dict(module, plan)
    for key, val in plan.items():
        _check_plan_value(key, val)
    md = mesh.dim(mesh_dim)
    used = set()
    todo = []                      # (module, name, parameter, placements): nothing written yet
    for mname, mod in module.named_modules():
        for pname, param in list(mod._parameters.items()):
            if param is None or isinstance(param, DistTensor):     # sharded by an earlier call
                continue
            full = f"{mname}.{pname}" if mname else pname
            ps = None
            for key, val in plan.items():
                hit_param = fnmatch.fnmatchcase(full, key)
                hit_module = fnmatch.fnmatchcase(mname, key) and isinstance(val, str) \
                    and val in STYLES
                if not (hit_param or hit_module):
                    continue
                if isinstance(val, str) and val in STYLES:
                    ps = [Replicate()] * mesh.ndim
                    ps[md] = _style_placements(val, mod, pname, md, param.dim())
                else:
                    ps = list(parse_placements(val))
                used.add(key)
                break
            if ps is None:
                ps = [Replicate()] * mesh.ndim
            todo.append((mod, pname, full, param, ps))
    unused = set(plan) - used
    if unused:
        raise ValueError(f"plan keys {sorted(unused)} match no module or parameter of "
                         f"{type(module).__name__}; names are like "
                         f"{[n for n, _ in module.named_modules() if n][:5]}")
    # a tied weight (one nn.Parameter in two modules) stays one DistTensor: its places
    # must agree, or the two copies would train apart
    seen = {}
    for _, _, full, param, ps in todo:
        first = seen.setdefault(id(param), (full, ps))
        if first[1] != ps:
            raise ValueError(f"plan: {first[0]!r} and {full!r} are one tied parameter but get "
                             f"placements {first[1]} and {ps}; give both the same placements "
                             "(or untie them before parallelize)")
    # every DistTensor first (shard_tensor may refuse a placement), then every write
    made = {}
    for _, _, full, param, ps in todo:
        if id(param) in made:
            continue
        dt = getattr(param, "_wb_dist", None)       # tied with a module of an earlier call
        if dt is None or dt.mesh != mesh or list(dt.placements) != list(ps):
            try:
                dt = shard_tensor(param.detach(), mesh, ps)
            except ValueError as e:                 # name the parameter: which one is 1-d?
                raise ValueError(f"plan for {full!r} (shape {tuple(param.shape)}): {e}"
                                 ) from None
            if param.requires_grad:
                dt.requires_grad_()
        made[id(param)] = dt
    for mod, pname, _, param, _ in todo:
        dt = param._wb_dist = made[id(param)]
        mod._parameters[pname] = dt     # where torch looks: state_dict, zero_grad...
        mod.__dict__.setdefault("_wb_dist_params", {})[pname] = dt
    adopt(module)
    return module


class _Named(tuple):
    """A (name, DistTensor) pair that says what to do when read as a parameter (torch's
    clip_grad_norm_ reads ``p.grad`` of each item it is given)."""
    __slots__ = ()

    @property
    def grad(self):
        raise AttributeError(
            "wb.dist_parameters(model) yields (name, DistTensor) pairs, not parameters; "
            "pass the parameters: torch.nn.utils.clip_grad_norm_(model.parameters(), "
            "max_norm) or wb.clip_grad_norm_(model.parameters(), max_norm)")


def dist_parameters(module: nn.Module):
    """(qualified name, DistTensor) for every parameter ``parallelize`` sharded, a tied
    one once (under its first name, as ``named_parameters``)."""
    seen = set()
    for mname, mod in module.named_modules():
        for pname in getattr(mod, "_wb_dist_params", {}):
            p = getattr(mod, pname)
            if id(p) not in seen:
                seen.add(id(p))
                yield _Named(((f"{mname}.{pname}" if mname else pname), p))

