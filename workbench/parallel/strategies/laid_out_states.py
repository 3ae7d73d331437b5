"""A ``torch.optim`` optimizer over laid-out parameters: its states given in the module's
shapes by its ``state_dict()``, one device's states laid out before its next step (a
global step pre-hook, registered when this module is imported), and the optimizers whose
update reads a parameter whole refused before their first step."""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..load_back import mark
from .replaced_params import follow_successors
from .replica_writes import handed_out


def _lay_out_loaded_states(optimizer, args, kwargs) -> None:
    """Before any ``torch.optim`` step: a state tensor of a :class:`LaidOutParameter`'s
    module shape (a one-device optimizer's ``state_dict()`` loaded into the optimizer over
    a wrapper's parameters) laid out as the parameter is (every rank's row or chunk), so
    training goes on as on one device; torch would otherwise broadcast it against the
    rows or fail on the chunks' shape.  ``step`` (and, for a 0-d parameter, the other
    scalar states: ``_SCALAR_STATES``) are left as they are.  A global step pre-hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``); it first refuses an
    optimizer whose update reads a parameter whole where the storage would mislead it
    (:func:`_check_whole_parameter_optimizer`).  Before all, an optimizer built before
    wrapping follows the parameters the wrapper replaced (:mod:`.replaced_params`)."""
    follow_successors(optimizer)
    _check_whole_parameter_optimizer(optimizer)
    for p in _laid_out_params(optimizer):
        if p not in optimizer.state:
            continue
        st = optimizer.state[p]
        skip = _SCALAR_STATES if not p._wb_shape else ("step",)
        for key, v in list(st.items()):
            if key not in skip and isinstance(v, torch.Tensor) and \
                    tuple(v.shape) == p._wb_shape:
                st[key] = p._wb_store(v.detach()).contiguous().clone()
    if not getattr(optimizer, "_wb_sd_hook", False) and \
            any(True for _ in _laid_out_params(optimizer)):
        optimizer._wb_sd_hook = True
        optimizer.register_state_dict_post_hook(_module_shaped_states)
        # its states read as the gradients are, the module's (rank_grads), once made
        optimizer.register_step_post_hook(_states_read_as_grads)


def _states_read_as_grads(optimizer, args, kwargs) -> None:
    from .rank_grads import states_read_as_grads
    states_read_as_grads(optimizer, list(_laid_out_params(optimizer)))


# torch.optim's optimizers whose update of an element reads more than that element (torch
# 2.13 torch/optim/lbfgs.py: one flat gradient of every parameter, its dot products and
# 1 / |g|_1 for the first step; adafactor.py: a parameter of 2 or more dims gets its second
# moment factored over its last two dims, a 1-d one does not).  On DDP's rows (N, *shape)
# LBFGS counts every replica (Adafactor factors each row as one device: exact); on FSDP's
# chunks ((N, chunk), or (chunk,) per process) Adafactor factors the chunks' shape, not the
# parameter's, and LBFGS (whose flat update was exact on the chunks while ``p.numel()`` was
# the storage's) now cuts its flat vector by ``p.numel()``, the module's (laid_out_whole),
# and views each piece as the storage: misaligned wherever a chunk is padded, so refused
_WHOLE = {"LBFGS": ("any", "its flat gradient, dot products and |g|_1 run over the "
                    "parameters' storage (each replica counted once more on DDP's rows) "
                    "while its flat vector is cut by p.numel(), the module's"),
          "Adafactor": ("chunks", "it factors a parameter's second moment by its shape, and "
                        "here the storage's shape is the flat chunks'"),
          # torch 2.13 torch/optim/_muon.py: each 2-d parameter's update orthogonalized
          # (Newton-Schulz) and its lr scaled by the matrix's shape; FSDP's (N, chunk) and
          # DDP's (N, d) rows of a 1-d parameter are 2-d storages it takes as the matrix
          "Muon": ("any", "it orthogonalizes each parameter's update as a matrix of its "
                   "shape, and here the storage's shape is the wrapper's layout")}


_REPLICAS = "its storage holds every replica's tensor-parallel shards"


def _check_whole_parameter_optimizer(optimizer) -> None:
    """Raise, before the step changes anything, for an optimizer of :data:`_WHOLE` over a
    storage it would read as the parameter."""
    what = _WHOLE.get(type(optimizer).__name__)
    if what is None or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return
    kind, why = what
    # every storage of another shape than its module's: Zero3's (no _wb_store) and DDP's
    # replica storage over tensor parallelism too (habits10: torch's stride error, and an
    # AttributeError for the message's _wb_layout)
    for p in (p for g in optimizer.param_groups for p in g["params"]
              if getattr(p, "_wb_shape", None) is not None):
        with torch._C.DisableTorchFunctionSubclass():
            if tuple(p.shape) == tuple(p._wb_shape):
                continue
        rows = getattr(p, "_wb_rows", None)
        if (kind == "rows" and rows and rows > 1) or (kind == "chunks" and not rows) or \
                kind == "any":
            raise NotImplementedError(
                f"torch.optim.{type(optimizer).__name__} over a wrapped parameter of shape "
                f"{tuple(p._wb_shape)} ({getattr(p, '_wb_layout', _REPLICAS)}): "
                f"{why}, which is not one device's update. "
                "Use an optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop...)"
                + (", or DDP under torchrun (one replica per process)" if kind == "rows"
                   else ", or DDP under torchrun (one whole replica per process)"
                   if kind == "any" else ", or DistributedDataParallel (whole parameters)"))


# torch.optim's per-parameter states that are 0-d whatever the parameter's shape (Adam's
# step, ASGD's eta and mu, NAdam's mu_product): for a 0-d parameter they cannot be told
# from its 0-d states by shape, so they are never laid out
_SCALAR_STATES = ("step", "eta", "mu", "mu_product")


def _laid_out_params(optimizer):
    """The optimizer's parameters whose storage is not the module's shape (the wrapper
    says how to convert: ``_wb_store``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_wb_store", None) is None:
                continue
            with torch._C.DisableTorchFunctionSubclass():
                if tuple(p.shape) != p._wb_shape:
                    yield p


def _module_shaped_states(optimizer, state_dict):
    """``optimizer.state_dict()`` over a wrapper's parameters: each state tensor of the
    storage's shape given in the module's shape (DDP: rank ``broadcast_from``'s row;
    FSDP: the chunks gathered, the padding dropped; under torch.distributed each
    process's part gathered, a collective: every process takes the same ``state_dict()``,
    as torch's full optimizer state dict), as one device's optimizer holds it,
    so the checkpoint loads into a plain optimizer, another rank count, or this one
    (:func:`_lay_out_loaded_states` lays it out again).  New dicts: the optimizer's own
    states are untouched."""
    order = [p for group in optimizer.param_groups for p in group["params"]]
    mine = {id(p) for p in _laid_out_params(optimizer)}
    for i, st in list(state_dict["state"].items()):
        p = order[i] if isinstance(i, int) and i < len(order) else None
        if p is None or id(p) not in mine:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            storage = tuple(p.shape)
        state_dict["state"][i] = {
            k: _shaped_state(p, v) if k != "step" and isinstance(v, torch.Tensor) and
            tuple(v.shape) == storage else v for k, v in st.items()}
    if any(getattr(p, "_wb_rows", None) for p in order):
        handed_out(optimizer, state_dict)   # a write into DDP's rows: every row (.replica_writes)
    return state_dict


def _shaped_state(p, v):
    """The state ``v`` (laid out as ``p``) in the module's shape; a load in place
    (``wb.checkpoint.load``) writes it back into every row or chunk (:mod:`..load_back`:
    DDP's is one row's view)."""
    return mark(p._wb_full(v.detach()), lambda val, v=v, p=p: v.copy_(p._wb_store(val.clone())))


register_optimizer_step_pre_hook(_lay_out_loaded_states)
