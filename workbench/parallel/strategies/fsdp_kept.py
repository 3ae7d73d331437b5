"""What backward reads of FSDP's gathered weights after a ``p.data`` write or assignment
between forward and backward: one device's values, found with one check per backward.

One device's saved weights follow two rules (torch's ``p.data``: a tensor with a version
counter of its own, so no error either way):

* a write through ``p.data`` (``p.data.mul_(2)``, ``p.data.copy_(t)``) changes the
  parameter's storage, so every saved tensor of it reads the written values;
* an assignment ``p.data = t`` gives the parameter ``t``'s storage (torch's ``set_data``);
  a saved tensor that *is* the parameter (``x @ w``, ``w * x``: autograd saved ``w``
  itself) reads ``t``, a view made in forward (``F.linear``'s ``w.t()``) keeps the old
  storage and its values (``torch/csrc/autograd/saved_variable.cpp``: a leaf is saved as
  itself, anything else as the tensor given; ``set_data`` shallow-copies ``t``'s storage
  into the parameter's TensorImpl and keeps its version counter).

The wrappers' module runs on gathered copies (:mod:`.fsdp_units`), so each saved weight
records whether it was the installed parameter itself (``own``) or a view of it, and
where its values come from at backward: the shard now (``own``) or the storage the
gather read (``src``: the same storage unless ``p.data = t`` swapped it since;
:func:`.laid_out_draws._module_shaped_data` swaps a sharded parameter's storage as torch
does).  A unit resharded after forward re-gathers from there anyway.  The root's copy is
kept gathered: :func:`kept_changes` compares it with its source once per backward, for
every kept weight at once, and gathers again those that differ (one all-gather,
recorded ``fsdp re-gather root``).  On torch.distributed a rank holds its own chunk
only, so the flags of all kept weights go through ONE all-reduce (MAX) per backward,
recorded ``fsdp kept-check root`` (``all_reduce``, 4 bytes a flag).  FSDP2 has no such
check: its root keeps its unsharded parameters registered on the module from forward to
backward, so between them ``p.data = t`` goes to the unsharded parameter (measured, torch
2.13 ``fully_shard`` on 2 gloo processes, a ``Linear`` weight: the gradients one
device's, but after backward the sharded parameter still holds the old values, silently;
before forward the assignment to its DTensor parameter is ignored, silently).  Simulated
ranks hold every chunk: the comparison needs no collective and none is recorded.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = ["source_alias", "note_kept", "kept_changes", "regather_sources"]


def source_alias(shard) -> torch.Tensor:
    """A plain tensor on ``shard``'s storage now (no copy): what a view saved in forward
    reads after a later ``p.data = t`` gives the parameter another storage."""
    with torch._C.DisableTorchFunctionSubclass():
        alias = shard.detach()
    return alias if type(alias) is torch.Tensor else alias.as_subclass(torch.Tensor)


def note_kept(call, k, key, t) -> None:
    """Forward saved ``t`` (rank k's kept copy of ``key`` = (parameter index, own)):
    remembered weakly (the graph holds it; the call may outlive the graph)."""
    call.kept.setdefault(k, {}).setdefault(key, []).append(weakref.ref(t))


def _source(fsdp, call, k, key):
    i, own = key
    shard = call.unit.params[i][1] if own else call.src[k][i]
    return fsdp._cast(source_alias(shard) if own else shard)


def kept_changes(fsdp, call, k) -> dict:
    """``{key: flat}`` for rank k's kept weights whose copy differs from what one device's
    backward reads (module docstring), each gathered again; worked out at the first
    unpack of a backward and kept until it ends (``call.checked``)."""
    done = call.checked.get(k)
    if done is not None:
        return done
    g = fsdp.group
    keys = sorted(call.kept.get(k, {}))
    flags, sources = [], []
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for key in keys:
            t = next((r() for r in call.kept[k][key] if r() is not None), None)
            now = _source(fsdp, call, k, key).reshape(-1)
            sources.append(now)
            if t is None:               # its graph is gone: nothing will read it
                flags.append(0)
                continue
            flat = t.new_empty(0).set_(t.untyped_storage())
            if g.distributed:           # this rank's chunk of the gathered copy
                same = flat.numel() == now.numel() * g.n and \
                    torch.equal(now, flat.view(g.n, -1)[g.k])
            else:
                same = now.shape == flat.shape and torch.equal(now, flat)
            flags.append(0 if same else 1)
        if g.distributed and keys:      # a write on any rank: every rank gathers again
            flag = torch.tensor(flags, dtype=torch.int32)
            g.record("all_reduce", flag.numel() * flag.element_size(),
                     f"fsdp kept-check {call.unit.name or 'root'}")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g.pg)
            flags = flag.tolist()
    todo = [x for x, f in enumerate(flags) if f]
    out = {}
    if todo:
        with torch.no_grad():
            flats = fsdp._all_gather(call, k, [sources[x] for x in todo], "re-gather")
        out = {keys[x]: f for x, f in zip(todo, flats)}
    call.checked[k] = out
    return out


def regather_sources(fsdp, call, k, keys) -> list:
    """The shards a resharded unit's re-gather of ``keys`` reads (module docstring)."""
    return [_source(fsdp, call, k, key) for key in keys]
