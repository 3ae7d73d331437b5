"""``torch.distributed.checkpoint`` (DCP) on state dicts holding DistTensors.

DCP (torch 2.13, ``torch/distributed/checkpoint/planner_helpers.py``, ``state_dict_loader.py``)
reads and writes in place only ``torch.Tensor`` values (DTensor and ShardedTensor
included).  A DistTensor is not a ``torch.Tensor``: ``dcp.save`` pickled it whole (torch's
``dcp.load`` into tensors then put DistTensor objects where the tensors were), and
``dcp.load`` set it to None in the caller's dict (``_init_state_dict`` keeps only the types
it knows) and failed with "expected BytesStorageMetadata".  Two things here:

* a module's ``state_dict()`` that holds DistTensors is a :class:`DistStateDict`, which DCP
  reads as ``Stateful`` where it sits at the top of DCP's dict (``dcp.save({"model":
  model.state_dict()})``, the habit of torch's DCP tutorial): DCP saves and loads its
  ``state_dict()``, the full tensors (the checkpoint is then one any torch program
  reads), and hands the loaded values to its ``load_state_dict``, which copies them into
  the DistTensors in place and on into the model's storage (:mod:`.load_back`: FSDP's
  shards, DDP's replicas), as ``wb.checkpoint.load`` does;
* a DistTensor given to DCP anywhere else answers DCP's ``_Checkpointable`` hook
  (``__create_write_items__``, which DTensor implements) with a TypeError naming what to
  call: ``wb.checkpoint.save`` / ``load`` (DCP's own format, each rank's shard written
  without a gather).  A load into a DistTensor elsewhere never reaches such a hook (DCP
  drops the value first): DCP's own error is what comes.

An optimizer's state dict holding DistTensors (``wb.checkpoint.get_optimizer_state_dict``
over tensor-parallel parameters: ``{"state": {fqn: {"exp_avg": DistTensor, ...}},
"param_groups": [...]}``) is read the same way, as a :class:`DistOptimStateDict`: DCP
saves the full tensors and its load copies them back into the DistTensors in place.
"""
from __future__ import annotations

from collections import OrderedDict

__all__ = ["install", "DistStateDict", "DistOptimStateDict", "as_stateful",
           "as_optim_stateful"]


def _message(what: str, fqn: str | None) -> str:
    key = f" {fqn!r}" if fqn else ""
    return (f"torch.distributed.checkpoint.{what} on a workbench DistTensor{key}: DCP reads "
            "and writes only torch.Tensor / DTensor values (any other object is pickled "
            "whole, and a load would never reach the model).  Give DCP the module's "
            "state_dict() itself as a top-level entry, dcp.save({'model': "
            "model.state_dict()}) (read as Stateful: full tensors, loaded back into the "
            "model); or use wb.checkpoint.save(path, state) / wb.checkpoint.load(path, state) "
            "(DCP's own format, each rank's shard); or give DCP full tensors, "
            "{k: v.full() for k, v in sd.items()}, then model.load_state_dict")


def _write_items(self, fqn, obj):
    raise TypeError(_message("save", fqn))


def _chunk_list(self):
    raise TypeError(_message("load", None))


def install(cls) -> None:
    """DCP's ``_Checkpointable`` hooks on DistTensor: refused, naming the fix."""
    cls.__create_write_items__ = _write_items
    cls.__create_chunk_list__ = _chunk_list


class DistStateDict(OrderedDict):
    """A module's ``state_dict()`` holding DistTensors: an ordinary ordered dict, which
    DCP also reads as ``Stateful`` (module docstring)."""

    def __repr__(self):
        return repr(OrderedDict(self))           # printed as torch's state_dict()

    def __reduce__(self):
        # pickled as the plain OrderedDict torch's state_dict() is (torch.load's
        # weights_only unpickler takes that, _metadata included, not this class)
        return (OrderedDict, (), dict(vars(self)) or None, None, iter(self.items()))

    def state_dict(self) -> dict:
        """What DCP saves and loads into: each DistTensor as its full tensor, the other
        values as they are (tensors DCP loads in place)."""
        from .dist_tensor import DistTensor
        return {k: v.full().detach() if isinstance(v, DistTensor) else v
                for k, v in self.items()}

    def load_state_dict(self, state_dict) -> None:
        """DCP's loaded values into this dict's own values in place, and on into the
        model (every check first: a failure changes nothing)."""
        from .dist_tensor import DistTensor
        from .load_back import write_back
        from .module_state import load_dist_
        import torch
        _check_shapes((k, self.get(k), v) for k, v in state_dict.items())
        for k, v in state_dict.items():
            cur = self.get(k)
            if isinstance(cur, DistTensor):
                err = load_dist_(cur, v, k)
                if err:
                    raise RuntimeError(err)
                write_back(cur)
            elif cur is not v:
                self[k] = v                    # DCP's own habit: the value replaced
            elif isinstance(cur, torch.Tensor):
                write_back(cur)                # loaded in place: a marked view's storage


def _check_shapes(entries) -> None:
    """Each ``(name, current value, DCP's value)``: a DistTensor must get a tensor of its
    global shape (checked for every entry before anything is loaded)."""
    import torch

    from .dist_tensor import DistTensor
    for name, cur, v in entries:
        if isinstance(cur, DistTensor) and (not isinstance(v, torch.Tensor) or
                                             tuple(v.shape) != tuple(cur.shape)):
            raise RuntimeError(f"load into {name!r}: DCP gave {type(v).__name__} "
                               f"{tuple(getattr(v, 'shape', ()))}, the DistTensor holds "
                               f"{tuple(cur.shape)}")


def as_stateful(sd):
    """``sd`` (a top-level ``state_dict()``) as a :class:`DistStateDict` where it holds a
    DistTensor (torch's ``_metadata`` kept); else ``sd`` itself."""
    from .dist_tensor import DistTensor
    if type(sd) not in (dict, OrderedDict) or not any(isinstance(v, DistTensor) for v in sd.values()):
        return sd
    out = DistStateDict(sd)
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = meta
    return out


def _leaves(tree, path=()):
    """(path, leaf) of a nested dict / list."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))
    else:
        yield path, tree


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value) -> None:
    _get(tree, path[:-1])[path[-1]] = value


class DistOptimStateDict(dict):
    """An optimizer's state dict holding DistTensors: an ordinary dict, which DCP also
    reads as ``Stateful`` (module docstring)."""

    def __repr__(self):
        return repr(dict(self))

    def __reduce__(self):
        return (dict, (), None, None, iter(self.items()))

    def state_dict(self) -> dict:
        """A copy of the nesting with each DistTensor as its full tensor (what DCP saves
        and loads into); the other values as they are."""
        from .dist_tensor import DistTensor

        def copy(v):
            if isinstance(v, dict):
                return {k: copy(x) for k, x in v.items()}
            if isinstance(v, list):
                return [copy(x) for x in v]
            return v.full().detach() if isinstance(v, DistTensor) else v
        return copy(dict(self))

    def load_state_dict(self, state_dict) -> None:
        """DCP's loaded values into this dict's DistTensors in place (every check first: a
        failure changes nothing); other values replaced, as DCP replaces them."""
        from .dist_tensor import DistTensor
        from .module_state import load_dist_
        mine = dict(_leaves(dict(self)))
        given = list(_leaves(state_dict))
        _check_shapes((".".join(map(str, path)), mine.get(path), v) for path, v in given)
        for path, v in given:
            cur = mine.get(path)
            if isinstance(cur, DistTensor):
                err = load_dist_(cur, v, ".".join(map(str, path)))
                if err:
                    raise RuntimeError(err)
            elif path in mine and cur is not v:
                _set(self, path, v)


def as_optim_stateful(osd):
    """``osd`` (an optimizer's nested state dict) as a :class:`DistOptimStateDict` where
    it holds a DistTensor; else ``osd`` itself."""
    from .dist_tensor import DistTensor
    if type(osd) is not dict or not any(isinstance(v, DistTensor) for _, v in _leaves(osd)):
        return osd
    return DistOptimStateDict(osd)
