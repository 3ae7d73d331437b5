"""Which gradients ``DistributedDataParallel`` all-reduces together: torch DDP's buckets.

torch 2.13's ``torch.nn.parallel.DistributedDataParallel`` (``distributed.py``,
``_BucketCapacityConfig`` and ``_ddp_init_helper``; the C++ ``Reducer``, ``c10d/reducer.cpp``)
groups the gradients into buckets and all-reduces each bucket as one message:

* :func:`assign_by_size` is ``compute_bucket_assignment_by_size`` (exposed as
  ``torch.distributed._compute_bucket_assignment_by_size``): tensors are walked in a given
  order, each joins the open bucket of its (dtype, device); a bucket closes once it holds
  at least its limit, and the next bucket of that key takes the next limit of the list
  (the last one repeats).  Without an order (registration order) the buckets are sorted by
  their smallest index; the buckets still open at the end come after the closed ones, in
  the reverse of the order their keys were first seen (the iteration order of the C++
  ``unordered_map`` for these keys; held to torch's function over every order of four
  dtypes in ``tests/test_ddp_buckets_default.py``).
* the default (``find_unused_parameters=False``, no ``static_graph``) starts with **one
  bucket per dtype** (limit ``sys.maxsize``): parameters' registration order is not
  trusted to be backward's.  The first backward that all-reduces records the order in
  which the gradients become ready; before the next forward the reducer *rebuilds* its
  buckets in that order with limits ``[first_bucket_bytes_cap, bucket_bytes_cap]``: 1 MiB
  (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) then 25 MiB (``_DEFAULT_BUCKET_CAP_MB``)
  when ``bucket_cap_mb`` is not given, ``bucket_cap_mb`` MiB for both when it is.
  ``static_graph=True``: the same, the rebuild one backward later (after the second).
* ``find_unused_parameters=True``: buckets from registration order with limits
  ``[1 MiB, 25 MiB]`` (or ``[bucket_cap_mb]``), reversed (the last-registered first: the
  order backward is assumed to produce them); never rebuilt.
* the reducer launches bucket ``i`` only once every bucket before it has been launched
  (``Reducer::mark_bucket_ready``: buckets are reduced in sequence), and all-reduces the
  bucket's whole buffer (a parameter without a gradient as zeros);
* besides the buckets torch sends, and the trace records: before the first rebuilt step,
  two broadcasts from rank 0 (:func:`sync_bucket_indices`); with
  ``find_unused_parameters=True`` (and in a static graph's first step) one all-reduce of
  which parameters each rank used, one int32 each (counted with torch's profiler).

Measured with torch's own ``DistributedDataParallel`` (a comm hook recording each bucket's
parameters, step by step) in ``tests/test_ddp_buckets_default.py``.

workbench's own ``bucket_bytes=B`` (:class:`~.ddp.DistributedDataParallel`) keeps fixed
buckets from the first step: the rebuilt buckets torch would make from a backward that
produces the gradients in reverse registration order, every limit ``B`` (``B=1``: one
all-reduce per parameter, the naive version).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

__all__ = ["FIRST_BUCKET_BYTES", "DEFAULT_BUCKET_CAP_MB", "assign_by_size", "BucketPolicy",
           "torch_policy", "fixed_policy", "reachable_leaves", "ready_order", "BucketBook",
           "sync_bucket_indices", "output_tensors"]

FIRST_BUCKET_BYTES = 1024 * 1024   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (reducer.hpp)
DEFAULT_BUCKET_CAP_MB = 25         # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
NO_LIMIT = sys.maxsize             # _ddp_init_helper's limit for the first step: one bucket


def assign_by_size(keys, sizes, limits, order=None) -> list[list[int]]:
    """torch's ``compute_bucket_assignment_by_size`` (module docstring): buckets of indices
    into ``keys`` / ``sizes`` (a hashable (dtype, device) key and a byte count per tensor),
    walked in ``order`` (default: 0, 1, ... then sorted by smallest index)."""
    if not limits or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                         for x in limits):
        raise ValueError(f"limits={limits!r}: give a non-empty list of byte counts >= 0")
    walk = range(len(sizes)) if order is None else order
    out, open_, step, seen = [], {}, {}, []
    for i in walk:
        key = keys[i]
        if key not in open_:
            open_[key], step[key] = [[], 0], 0
            seen.append(key)
        bucket = open_[key]
        bucket[0].append(i)
        bucket[1] += sizes[i]
        if bucket[1] >= limits[step[key]]:
            out.append(bucket[0])
            open_[key] = [[], 0]
            step[key] = min(step[key] + 1, len(limits) - 1)
    out += [open_[k][0] for k in reversed(seen) if open_[k][0]]
    if order is None:
        out.sort(key=min)
    return out


@dataclass(frozen=True)
class BucketPolicy:
    """How a DDP wrapper buckets: ``initial`` (limits for the first buckets, taken from
    registration order and reversed, or from reverse registration order when
    ``reverse_walk``), ``rebuild`` (limits for the buckets rebuilt in the order backward
    produced the gradients; None: never rebuilt) after ``rebuild_after`` backwards that
    all-reduced."""
    initial: tuple
    rebuild: tuple | None = None
    rebuild_after: int = 1
    reverse_walk: bool = False

    def first_buckets(self, keys, sizes) -> list[list[int]]:
        if self.reverse_walk:
            return assign_by_size(keys, sizes, list(self.initial),
                                  order=range(len(sizes) - 1, -1, -1))
        return assign_by_size(keys, sizes, list(self.initial))[::-1]

    def rebuilt_buckets(self, keys, sizes, ready) -> list[list[int]]:
        """``ready``: every index, in the order the gradients became ready."""
        return assign_by_size(keys, sizes, list(self.rebuild), order=ready)


def torch_policy(bucket_cap_mb=None, find_unused_parameters=False,
                 static_graph=False) -> BucketPolicy:
    """torch 2.13 DDP's buckets for these arguments (``_BucketCapacityConfig.create`` and
    ``compute_bucket_size_limits``)."""
    default = bucket_cap_mb is None
    cap = int((DEFAULT_BUCKET_CAP_MB if default else bucket_cap_mb) * 1024 * 1024)
    first = FIRST_BUCKET_BYTES if default else cap
    limits = (first, cap) if first < cap else (cap,)
    if static_graph or not find_unused_parameters:
        return BucketPolicy((NO_LIMIT,), (first, cap), 2 if static_graph else 1)
    return BucketPolicy(limits)


def fixed_policy(bucket_bytes: int) -> BucketPolicy:
    """workbench's ``bucket_bytes``: fixed buckets of at least ``bucket_bytes`` filled in
    reverse registration order from the first step (module docstring)."""
    return BucketPolicy((bucket_bytes,), reverse_walk=True)


def reachable_leaves(outputs) -> set:
    """ids of the leaf tensors the autograd graph of ``outputs`` (tensors) reaches: torch
    DDP's search for unused parameters (``find_unused_parameters=True``,
    ``Reducer::prepare_for_backward``), run on the forward's outputs."""
    stack = [t.grad_fn for t in outputs if getattr(t, "grad_fn", None) is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)        # an AccumulateGrad node
        if leaf is not None:
            found.add(id(leaf))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


def ready_order(outputs, views) -> list[int]:
    """Indices of ``views`` (one non-leaf tensor per parameter: a simulated rank's view of
    its row) in the order one device's backward makes their gradients ready.  torch's CPU
    engine runs the nodes of a backward by descending sequence number (the ready queue's
    order; every node's consumers were made after it), so a parameter's gradient is ready
    once its last consumer, the one of lowest sequence number, has run (ties: in the
    consumer's order of inputs).  On simulated ranks every rank's views are made before
    the forwards, so the hooks themselves fire in one order whatever the model: this gives
    the order torch's reducer records instead (held to torch's in the tests)."""
    node_of = {v.grad_fn: i for i, v in enumerate(views) if v.grad_fn is not None}
    last = {}
    stack = [t.grad_fn for t in outputs if getattr(t, "grad_fn", None) is not None]
    seen = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for pos, (nxt, _) in enumerate(fn.next_functions):
            if nxt is None:
                continue
            if nxt in node_of:
                key = (fn._sequence_nr(), -pos)
                i = node_of[nxt]
                last[i] = min(last.get(i, key), key)
            stack.append(nxt)
    return sorted(last, key=last.__getitem__, reverse=True)


class BucketBook:
    """The reducer's bookkeeping for one wrapper: ``params`` (the trainable parameters, in
    registration order) with their per-rank byte ``sizes``, bucketed by ``policy``; which
    buckets are ready, which may launch (in sequence), and the rebuild."""

    def __init__(self, params, sizes, policy: BucketPolicy):
        self.params, self.sizes, self.policy = list(params), list(sizes), policy
        self.keys = [(p.dtype, p.device) for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.rebuilt = policy.rebuild is None          # True: nothing left to rebuild
        self.backwards = 0                  # backwards that all-reduced
        self.order, self.pending = [], None
        self.order_given = False            # set_order: the hooks' order is not recorded
        self._set(policy.first_buckets(self.keys, self.sizes))

    def _set(self, buckets):
        self.buckets = [[self.params[i] for i in b] for b in buckets]
        self.bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self.reset()

    def reset(self):
        """A new backward: nothing ready, nothing launched."""
        self.ready = [0] * len(self.buckets)
        self.next = 0                       # the next bucket to launch (Reducer's next_bucket_)
        self.marked = set()

    def nbytes(self, b: int) -> int:
        """Bucket ``b``'s buffer: every parameter of it, used or not (torch's contents)."""
        return sum(self.sizes[self.index[id(p)]] for p in self.buckets[b])

    def mark_ready(self, p, launch: bool = True) -> list[int]:
        """Parameter ``p``'s gradient is ready; the buckets that may launch now, in order
        (none with ``launch=False``: a static graph's first backward launches at its end)."""
        i = self.index[id(p)]
        if i in self.marked:
            return []
        self.marked.add(i)
        if self.recording and not self.order_given:
            self.order.append(i)
        self.ready[self.bucket_of[id(p)]] += 1
        out = []
        while launch and self.next < len(self.buckets) and \
                self.ready[self.next] == len(self.buckets[self.next]):
            out.append(self.next)
            self.next += 1
        return out

    def rest(self) -> list[int]:
        """The buckets not launched yet (at the end of backward), in order."""
        out = list(range(self.next, len(self.buckets)))
        self.next = len(self.buckets)
        return out

    @property
    def recording(self) -> bool:
        """Is this backward's order the one the rebuild takes?"""
        return not self.rebuilt and self.pending is None and \
            self.backwards == self.policy.rebuild_after - 1

    def set_order(self, order) -> None:
        """The recorded backward's order, computed from its graph (:func:`ready_order`)."""
        self.order, self.order_given = list(order), True

    def backward_done(self):
        """A backward that all-reduced has ended: after the policy's count, the order seen
        (parameters never ready last, by index, as torch appends a static graph's unused
        ones) waits for the rebuild."""
        self.backwards += 1
        if self.rebuilt or self.pending is not None:
            return
        if self.backwards == self.policy.rebuild_after:
            seen = set(self.order)
            self.pending = self.order + [i for i in range(len(self.params)) if i not in seen]

    def rebuilt_buckets(self) -> list[list[int]]:
        """The buckets (indices) the pending rebuild makes."""
        return self.policy.rebuilt_buckets(self.keys, self.sizes, self.pending)

    def rebuild(self, buckets) -> None:
        """Before a forward with grad enabled (``Reducer::rebuild_buckets``): take
        ``buckets`` (indices; on processes rank 0's)."""
        self._set(buckets)
        self.pending, self.rebuilt = None, True


def sync_bucket_indices(buckets, record, broadcast=None) -> list[list[int]]:
    """torch's ``Reducer::sync_bucket_indices``: rank 0's rebuilt ``buckets`` (indices) sent
    to every rank in two blocking broadcasts of int32, the indices and the bucket count,
    then the buckets' lengths (both counted with torch's profiler, tests).  ``record(n)``
    traces one broadcast of ``n`` bytes; ``broadcast(t)`` runs it in place on processes
    (None: simulated ranks, which hold one order).  Returns rank 0's buckets."""
    flat = [i for b in buckets for i in b] + [len(buckets)]
    lengths = [len(b) for b in buckets]
    record(4 * len(flat))
    if broadcast is not None:
        t = torch.tensor(flat, dtype=torch.int32)
        broadcast(t)
        flat = t.tolist()
    record(4 * flat[-1])
    if broadcast is None:
        return buckets
    t = torch.tensor(lengths if len(lengths) == flat[-1] else [0] * flat[-1],
                     dtype=torch.int32)
    broadcast(t)
    out, at = [], 0
    for k in t.tolist():
        out.append(flat[at:at + k])
        at += k
    return out


def output_tensors(out) -> list:
    """The tensors of a forward's output, found as torch DDP's ``_find_tensors``
    (``torch/nn/parallel/distributed.py``) finds them: a tensor, the items of a list /
    tuple, the values of a dict (a subclass too: Transformers' ``ModelOutput``), the fields
    of a dataclass; a DistTensor gives its local tensors.  Anything else holds none (as in
    torch: with ``find_unused_parameters=True`` every parameter is then unused, and a
    gradient reaching one raises in :class:`~.ddp.DistributedDataParallel`)."""
    import dataclasses
    if isinstance(out, torch.Tensor):
        return [out]
    local = getattr(out, "_local", None)               # a DistTensor
    if local is not None and hasattr(local, "items") and not isinstance(local, dict):
        return list(local.items)
    if isinstance(local, torch.Tensor):
        return [local]
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in output_tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in output_tensors(x)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name))]
    return []
