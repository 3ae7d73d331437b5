"""State-dict values that are not the module's storage: how an in-place load reaches it.

``torch.distributed.checkpoint.load`` fills a state dict in place, and on one device (or
under FSDP2, whose ``state_dict()`` DTensors are the sharded parameters themselves) that
alone changes the model: the state dict's tensors are the parameters.  Some of the
wrappers' state-dict values here are not: on simulated ranks ``DistributedDataParallel``
gives rank ``broadcast_from``'s row (a view of one replica of N), ``FullyShardedDataParallel``
and ``Zero3`` give ``Shard(0)`` / template-laid DistTensors gathered from the flat shards
(copies).  A load into those alone would change one replica (the others silently keep
their values) or nothing.  So each such value carries how to write a loaded value back
(:func:`mark`), and ``wb.checkpoint.load`` calls it after filling the value
(:func:`write_back`); ``wrapper.load_state_dict(sd)`` afterwards (DCP's documented habit)
does the same work again and changes nothing more.

The callable is kept beside the value, in a table keyed weakly by the value's identity
(``torch.utils.weak.WeakIdKeyDictionary``), not as an attribute on it: a tensor's
``__dict__`` is pickled by ``torch.save``, and a function there would make
``torch.save(ddp.state_dict())`` fail.

A write into such a copy by any other path (``sd[k].copy_(t)``, ``sd[k].mul_(2)``,
``torch.distributed.checkpoint.load``, ``nn.init.zeros_(sd[k])``) changes the model in
torch; here a copy marked with its ``source`` (the storage it was gathered from) is
watched: its version counter (``tensor._version``; a DistTensor's local storage's) is
kept, and :func:`flush` (run before the wrappers' next forward, state dict or load and
any ``torch.optim`` step) writes back every copy written since, as the load does.  A copy taken before the
model changed (its source's version moved, e.g. an optimizer step) and written after
raises there: it held old values, so writing it back whole would undo the change where
torch (whose values are the parameters) would not.  The copies of the latest state dicts
are held until that flush, so a one-line ``fsdp.state_dict()[k].fill_(0)`` is seen too.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["mark", "write_back", "flush", "values_kept", "loading"]

_BACK = WeakIdKeyDictionary()      # state-dict value -> {tag: how to write it back}
_WATCH = WeakIdKeyDictionary()     # a copy -> [its versions, its source, the source's version]
_HELD: list = []                   # copies handed out since the last flush (kept alive)


def mark(value, fn, tag: str = "storage", source=None):
    """``value`` (a state-dict tensor or DistTensor) with ``fn(value)``, which writes the
    value it then holds into the module's storage; returns ``value``.  One ``fn`` per
    ``tag`` (marking again replaces it): "storage" for the wrapper's own layout, another
    tag for a second copy to keep equal (DualPipe's copy 1 of every stage).  ``source``:
    ``value`` is a copy of that tensor's values, watched for writes (:func:`flush`)."""
    fns = _BACK.get(value)
    if fns is None:
        fns = _BACK[value] = {}
    fns[tag] = fn
    if source is not None:
        _WATCH[value] = [_versions(value), source, source._version]
        _HELD.append(value)
    return value


def _versions(value):
    """The version counters (and identities) of ``value``'s storage."""
    from .dist_tensor import DistTensor
    from .storage import tensors
    ts = tensors(value._local) if isinstance(value, DistTensor) else [value]
    return tuple((id(t), t._version) for t in ts)


def _same(a, b) -> bool:
    """Whether two copies hold the same values (bitwise on the full tensors: NaN too)."""
    from .dist_tensor import DistTensor
    a, b = (x.full() if isinstance(x, DistTensor) else x for x in (a, b))
    return a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _rewatch(value) -> None:
    w = _WATCH.get(value)
    if w is not None:
        w[0], w[2] = _versions(value), w[1]._version


@torch.no_grad()
def flush(release: bool = True) -> None:
    """Write back every watched copy written since it was handed out (or last written
    back); raise for one taken before its source changed (the module docstring).
    ``release=False`` (inside a state_dict() that is marking copies): keep holding the
    copies handed out so far."""
    held = list(_HELD)
    if release:
        _HELD.clear()
    if not _WATCH:
        return
    written = [(v, w) for v, w in list(_WATCH.items()) if _versions(v) != w[0]]
    # every staleness decided before any write-back (tied weights: two copies, one source)
    stale = [v for v, w in written if w[1]._version != w[2]]
    # two written copies of one source (two state_dict() calls): each holds the whole
    # tensor, so writing both back would keep the last one's values only, where torch
    # (whose values are views of one parameter) keeps every write; equal copies are one
    clash = []
    by_source: dict = {}
    for v, w in written:
        if w[1]._version == w[2]:
            by_source.setdefault(id(w[1]), []).append(v)
    for vs in by_source.values():
        if any(not _same(vs[0], x) for x in vs[1:]):
            clash += vs
    for v in stale + clash:
        del _WATCH[v]                   # told once: the write is not applied
    if not stale and not clash:
        for v, _ in written:
            _write_back(v)
    del held, written
    if clash and not stale:
        raise RuntimeError(
            f"two state_dict() values of one parameter (shape {tuple(clash[0].shape)}) were "
            "both written, with different values: on simulated ranks "
            "FullyShardedDataParallel's and Zero3's state_dict() values are gathered copies, "
            "not views of one parameter as torch's, so writing both back would keep only "
            "the last one's; the writes were not applied.  Write into one state_dict()'s "
            "values, or load full tensors with load_state_dict")
    if stale:
        raise RuntimeError(
            f"a state_dict() value (shape {tuple(stale[0].shape)}) was written after the "
            "model changed (an optimizer step or a load since it was taken): on simulated ranks "
            "FullyShardedDataParallel's and Zero3's state_dict() values are gathered copies, "
            "not the shards themselves as FSDP2's, so writing it back whole would undo that "
            "change; the write was not applied.  Take state_dict() again and write into "
            "its values, or load full tensors with load_state_dict")


@torch.no_grad()
def write_back(value) -> bool:
    """Write ``value`` (filled in place) back into the storage it was taken from, when it
    is marked; returns whether it was.  The copies written before are written back first
    (:func:`flush`), as torch, where each write lands when it is made."""
    flush(release=False)
    return _write_back(value)


def _write_back(value) -> bool:
    fns = _BACK.get(value)
    for fn in (fns or {}).values():
        fn(value)
    _rewatch(value)
    return bool(fns)


def _step_pre_hook(optimizer, args, kwargs) -> None:
    flush()


class values_kept:
    """A block that writes ``tensors`` without changing their values (torch's
    ``_init_optim_state``: one optimizer step at ``lr`` 0, which ``get_optimizer_state_dict``
    takes to give a fresh optimizer its states): the copies handed out before it stay
    current, as torch's (views of the parameters) do.  A tensor whose values did change
    (compared bitwise with a copy taken before) keeps its copies stale."""

    def __init__(self, tensors):
        # the plain ones: a DistTensor (torch.optim over a tensor-parallel model's
        # parameters) hands out no watched copies and has no _version
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]

    def __enter__(self):
        flush(release=False)            # a write into a copy lands first
        with torch.no_grad():
            self.before = {id(t): (t, t.detach().clone(), t._version) for t in self.tensors}
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        for v, w in list(_WATCH.items()):
            got = self.before.get(id(w[1]))
            if got is not None and w[2] == got[2] and _same(got[0].detach(), got[1]):
                w[2] = w[1]._version
        return False


class loading:
    """A load in place of ``targets`` (``wb.checkpoint.load``'s writes, DCP's through
    ``dcp_interop``): a target that is the module's storage itself (a tied weight's
    second key, e.g. the GPT's ``lm_head.weight`` beside a ZeRO-3 copy of
    ``tok_emb.weight``) changes a watched copy's source, and the copy, written by the
    same load, would then read as taken before the model changed and be refused.  Inside
    this block such a copy stays current when the load left its source holding the very
    values the load wrote into the copy (bitwise): writing it back changes nothing the
    load did not.  Other values (a checkpoint whose two keys of one tied parameter
    differ) stay stale, refused at the write back as before."""

    def __init__(self, targets):
        self.targets = list(targets)

    def __enter__(self):
        flush(release=False)            # earlier writes into copies land first, as torch's
        self.before = []
        for v in self.targets:
            w = _WATCH.get(v)
            if w is not None and w[1]._version == w[2]:
                self.before.append((v, w[2]))
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        for v, version in self.before:
            w = _WATCH.get(v)
            if w is not None and w[2] == version and w[1]._version != version:
                now = _whole(w[1], v.shape)
                if now is not None and _same(v, now):
                    w[2] = w[1]._version
        return False


def _whole(source, shape):
    """``source``'s value in the module's shape ``shape``, or None where it is not at hand
    (a flat chunk of it; another process's parts)."""
    full = getattr(source, "_wb_full", None)
    try:
        if full is not None:
            value = source.full_tensor()        # a laid-out parameter (strategies.laid_out)
        else:
            value = source.detach()
    except NotImplementedError:
        return None
    return value if tuple(value.shape) == tuple(shape) else None


register_optimizer_step_pre_hook(_step_pre_hook)
