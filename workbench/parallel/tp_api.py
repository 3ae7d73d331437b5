"""``parallelize_module(module, device_mesh, parallelize_plan)``: PyTorch's entry point for
tensor parallelism (``torch/distributed/tensor/parallel/api.py``, torch 2.13) on our
DistTensors; the styles are in :mod:`.tp_styles` and :mod:`.tp_prepare`."""
from __future__ import annotations

import fnmatch

from torch import nn

from ..sim_mesh.mesh import Mesh
from . import storage
from .module_state import adopt, refuse_backward_hooks
from .tp_from_torch import from_torch_style, is_torch_style
from .tp_styles import ParallelStyle

__all__ = ["parallelize_module"]


def _tp_dim(mesh, mesh_dim) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"device_mesh={mesh!r:.60}: expected a workbench Mesh, e.g. "
                        "wb.Mesh.grid(4, ['tp'])")
    if mesh_dim is not None:
        return mesh.dim(mesh_dim)
    if mesh.ndim == 1:
        return 0
    if "tp" in mesh.dim_names:
        return mesh.dim("tp")
    raise ValueError(f"device_mesh {mesh} has {mesh.ndim} dims and none is named 'tp': say "
                     "which is tensor parallel with mesh_dim= (a name or an index)")


def _resolve(module, key: str, full: str) -> list:
    """Torch's resolution of a plan key: its first dot-separated token is fnmatch-ed
    against the child names, the rest resolved in each matching child ("" is the module)."""
    if key == "":
        return [module]
    token, _, rest = key.partition(".")
    hits = [m for n, m in module.named_children() if fnmatch.fnmatchcase(n, token)]
    if not hits:
        raise ValueError(f"parallelize_plan key {full!r}: no submodule of "
                         f"{type(module).__name__} matches {token!r}; its children are "
                         f"{[n for n, _ in module.named_children()][:8]}")
    return [m for child in hits for m in _resolve(child, rest, full)]


def _check_tie(seen: dict, param, p, name: str, md: int, key: str, owner) -> None:
    """A parameter shared by two modules (tied weights) stays one DistTensor: both styles
    must lay it out alike (here or in an earlier call).  One parameter of one module
    reached by two keys (a style on a parent, e.g. SequenceParallel on an MLP, and one on
    its child) that lay it out differently is not a tie: two styles for one parameter."""
    dt = getattr(param, "_wb_dist", None)
    first = seen.setdefault(id(param), (name, p, key, owner) if dt is None else
                            ("an earlier parallelize_module call", dt.placements[md], None, None))
    if first[1] != p and first[3] is owner and first[2] != key:
        raise ValueError(f"parallelize_plan keys {first[2]!r} and {key!r} both lay out "
                         f"{name!r} (a style on a module lays out its submodules' parameters "
                         "too): give each parameter one style")
    if first[1] != p:
        raise ValueError(f"parallelize_plan: {first[0]!r} and {name!r} are one tied parameter "
                         f"but get {first[1]!r} and {p!r} on the tp dim; give both modules styles "
                         "that lay it out alike (e.g. RowwiseParallel embedding and "
                         "ColwiseParallel head: Shard(0) both), or untie them")


def parallelize_module(module: nn.Module, device_mesh: Mesh, parallelize_plan=None, *,
                       src_data_rank: int | None = 0, mesh_dim: int | str | None = None):
    """Apply ``parallelize_plan`` (a ParallelStyle, or a dict of module names, with
    ``fnmatch`` patterns per dotted token, to styles; torch's own style objects are read
    as ours, :mod:`.tp_from_torch`) to ``module`` in place; returns it.
    ``mesh_dim``: the tensor-parallel dim of an n-d ``device_mesh`` (module docstring).
    ``src_data_rank``: 0, or None in the simulator (the module's parameters are one copy:
    the same); under torchrun only 0 (parameters laid out from the first rank's copy)."""
    md = _tp_dim(device_mesh, mesh_dim)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r:.60}: expected an nn.Module instance")
    refuse_backward_hooks(module, "parallelize_module")
    if src_data_rank not in (0, None) or isinstance(src_data_rank, bool):
        raise ValueError(f"src_data_rank={src_data_rank!r}: the simulated module's parameters "
                         "are one copy, laid out from it; give 0 (the default) or None")
    if src_data_rank is None and storage.holds_own(device_mesh):
        raise ValueError("src_data_rank=None under torchrun: parameters are laid out from "
                         "the first rank's copy (as src_data_rank=0), not from each process's "
                         "own; give 0, or make every process's copy the same first")
    if parallelize_plan is None:
        raise ValueError("parallelize_plan=None: give a ParallelStyle or a dict of module "
                         "names to styles (torch warns and does nothing)")
    if isinstance(parallelize_plan, ParallelStyle) or (
            not isinstance(parallelize_plan, dict) and is_torch_style(parallelize_plan)):
        parallelize_plan = {"": parallelize_plan}
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for "
                        f"parallelize_plan, {type(parallelize_plan)} found!")
    plan = {}
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle) and is_torch_style(style):
            style = from_torch_style(style)         # torch's own styles, read as ours
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan[{key!r}] = {style!r}: expected module name -> "
                            "ParallelStyle, e.g. {'w1': ColwiseParallel()}")
        plan[key] = style
    parallelize_plan = plan
    # every key resolved and every style checked before anything is changed
    todo, laid, tied = [], {}, {}
    for key, style in parallelize_plan.items():
        # a module reached twice by one key (shared by two parents, "*.x"): one module,
        # one style (it was applied twice: "plan keys ['bias', 'weight'] match no module")
        for mod in {id(m): m for m in _resolve(module, key, key)}.values():
            style._check(mod)
            if style._lays_params:
                first = laid.setdefault(id(mod), key)
                if first != key:
                    raise ValueError(f"parallelize_plan keys {first!r} and {key!r} both lay out "
                                     f"the parameters of one {type(mod).__name__}: give it one "
                                     "style")
            for pname, param, p in style._planned(mod):
                owner = mod.get_submodule(pname.rpartition(".")[0])
                _check_tie(tied, param, p, f"{key}.{pname}" if key else pname, md, key, owner)
            todo.append((style, mod))
    for style, mod in todo:
        style._apply(mod, device_mesh, md)
    adopt(module)           # the root's own habits too (its state_dict() read by DCP...)
    return module
