"""One micro-batch of one pipeline stage, run for real on the meta device.

:func:`run_stage` takes a model built and parallelized by the library's ``Hybrid``
recipe on meta tensors (shapes, dtypes and placements, no data), feeds one
micro-batch into pipeline stage ``s`` exactly as ``run_pipeline`` would (a token batch
on the first stage, the previous stage's activation layout elsewhere), runs the
stage's forward (and the loss on the last stage) and its backward under the caller's
trace, and reports:

- the stage's forward and backward time on the modeled clock (every op the real code
  dispatches, priced forward and backward from the op table; every collective the
  recipe issues, priced on the topology): the latest clock of the stage's ranks; a
  recompute's ops priced again as they re-run, except (``recompute="op"``) the GEMMs
  and attention kernels whose saved outputs the selective checkpoint hands back;
- the bytes ONE rank keeps for backward (:class:`SavedCounter`): every tensor autograd
  saves, each storage once, parameters left out, split over the device axes that
  really vary (as ``parallel.strategies.memory.saved_activation_bytes``, which skips
  meta tensors), plus the inputs that ``torch.utils.checkpoint`` keeps for its
  recompute (non-reentrant checkpointing holds them in a closure, not as saved tensors:
  full recompute keeps each block's input, selective the attention core's q, k, v) and,
  with ``recompute="op"``, the outputs its selective-checkpoint policy saved
  (:mod:`..models.op_sac`: the block's input and those);
- the time to send the stage's output to the next stage (``schedules.execute._send``,
  the function the pipeline executor uses) and its gradient back (the same size).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..models import op_sac
from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.ops_table import ring_attention as _ring
from ..parallel.placement import Replicate, Shard
from ..parallel.schedules.execute import _detach_leaf, _send
from ..parallel.strategies.memory import _ranks_splitting, _varying_axes
from ..sim_mesh import backends as _B
from ..sim_mesh.trace import Handle

__all__ = ["SavedCounter", "run_stage"]

_CHECKPOINTING_MODULES = ("workbench.models.gpt", "workbench.models.llama")


_COPIES = {"clone", "_unsafe_view", "expand_copy", "_to_copy", "copy", "contiguous"}


class _Provenance(TorchDispatchMode):
    """Which storage each new storage copies (``clone``, ``_unsafe_view``, a same-dtype
    ``_to_copy``): the simulator materializes broadcast copies of a stacked tensor
    (``torch.matmul`` expands a replicated input before its batched GEMM), which a
    device, holding one rank's tensor, never makes; a copy is counted as its source.

    With ``mesh_shape``, also the mesh axes each new storage varies along (``axes``):
    its own (*mesh, *local) layout when every tensor input has one; otherwise (an input
    without lead axes: one rank's piece, as the expert-parallel layer's per-group tensors
    taken at tp index 0, or a flattened view, as cross-entropy's (B * S, V) rows) the
    union of its inputs' storages' axes: a tensor computed from inputs replicated over
    tp is replicated over tp.  Inputs whose axes are unknown (a factory's output, such as
    the meta routing's stand-in assignment, or a tensor made outside the mode without
    lead axes) add none (an ASSUMPTION); with no known input the axes are unknown (None:
    the counter's split over every rank)."""

    def __init__(self, mesh_shape=None):
        super().__init__()
        self.parent: dict[int, int] = {}
        self.first: dict[int, torch.Tensor] = {}
        self.made: dict[int, str] = {}           # storage id -> the op that made it
        # storage id of a copy -> the view of a copy-free storage that its first copy
        # read (the elements it holds, in their (*mesh, *local) layout)
        self.via: dict[int, torch.Tensor] = {}
        self.mesh_shape = mesh_shape
        self.axes: dict[int, frozenset | None] = {}   # storage id -> axes it varies along
        # storage id -> (lead shape, cells): made while a group of ranks computed its own
        # ring-attention blocks (``ops_table.ring_attention.OWNER``): theirs alone
        self.owner: dict[int, tuple] = {}
        self._layouts: dict = {}    # (shape, stride) -> _varying_axes (a function of them)

    def _axes_of(self, t):
        """``_varying_axes(t, self.mesh_shape)``, once per (shape, stride): it reads no more."""
        key = (t.shape, t.stride())
        got = self._layouts.get(key, self)
        if got is self:
            got = self._layouts[key] = _varying_axes(t, self.mesh_shape)
        return got

    def storage_axes(self, t):
        """The axes ``t``'s storage varies along: recorded, else its first tensor's (or
        ``t``'s base's, or ``t``'s own) layout; a 0-dim tensor is one value every rank
        holds (no axes); None if unknown."""
        if t.dim() == 0:
            return frozenset()
        key = self.root(t.untyped_storage()._cdata)
        if key in self.axes:
            return self.axes[key]
        for cand in (self.first.get(key), t._base, t):
            if cand is not None:
                axes = self._axes_of(cand)
                if axes is not None:
                    return axes
        return None

    def _derive(self, out, inputs):
        own = self._axes_of(out)
        if own is not None and all(t.dim() == 0 or self._axes_of(t) is not None
                                   for t in inputs):
            return own
        ins = [a for a in map(self.storage_axes, inputs) if a is not None]
        return frozenset().union(*ins) if ins else own

    def root(self, key: int) -> int:
        while key in self.parent:
            key = self.parent[key]
        return key

    # Fast path (task simperf3: the mode watches every aten op of a counted forward, ~400
    # in a gpt-tiny step, and was ~45% of a wb.train step): the work is the same, done
    # only where it can change what is recorded, so every record is the same as before
    # (tests/test_sim_overhead_counter.py holds it to the plain version). The inputs are
    # gathered only for an output whose storage is new (a view's is not), by a walk that
    # finds the tensors ``pytree.tree_leaves`` finds in aten's arguments (tensors, lists
    # and tuples of them, kwargs); an op's name is looked up once.
    _names: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # no torch.compile frame runs in here: skip the per-op torch._disable_dynamo
        # wrapper TorchDispatchMode puts around __torch_dispatch__ (torch 2.13
        # utils/_python_dispatch.py __init_subclass__, _should_skip_dynamo's docstring)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        copy = src is not None and name in _COPIES and isinstance(out, torch.Tensor) \
            and out.dtype == src.dtype
        inputs = None
        first = self.first
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if copy and key != src.untyped_storage()._cdata:
                skey = src.untyped_storage()._cdata
                self.parent.setdefault(key, self.root(skey))
                self.via.setdefault(key, self.via.get(skey, src))
            if key in first:
                continue
            if self.mesh_shape is not None:
                if inputs is None:
                    inputs = _tensor_args(args, kwargs)
                self.axes[key] = self._derive(t, inputs)
                if _ring.OWNER:
                    self.owner[key] = _ring.OWNER[-1]
            first[key] = t
            self.made.setdefault(key, name)
        return out


def _tensor_args(args, kwargs) -> list:
    """The tensors among an op's arguments, in ``pytree.tree_leaves`` order (lists,
    tuples and dicts opened at any depth)."""
    found: list = []

    def walk(a):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
    walk(args)
    if kwargs:
        walk(kwargs)
    return found


class SavedCounter:
    """Per-rank bytes of what a forward keeps for backward (module docstring).

    A stacked tensor of shape (*mesh, *local) holds ``numel(local)`` elements per rank
    on the lead dims that vary (stride-0 or size-1 ones are a copy every rank holds
    whole): the layout rule of ``parallel.strategies.memory.saved_activation_bytes``,
    the same function (``_ranks_splitting``).  ``params``: tensors resident anyway (the
    parameters, and the model's buffers), never counted.

    Why not ``saved_activation_bytes`` itself (task simperf2, measured per saved tensor
    on the dry runs of tiny dp2 tp2, tp2 sp, tp2 full, dp2 selective, cp2, cp2 tp2 full
    and gpt-tiny dp2 tp2, micro-batch 2: 166 of 231 tensors counted alike, 61 raise
    there, 4 differ).  Using it raised in three CP / full-recompute dry runs and moved a
    plan-vs-dry-run row to 1.124x (task simperf); it differs:

    * a saved tensor whose lead dims a local kernel flattened ((L * B, ...): the CPU
      flash kernel's output and logsumexp, cross-entropy's (B * S, V) log-softmax, the
      loss) matches no mesh layout: it RAISES there (2 to 6 per run above); here its
      storage is split over the mesh axes its op's inputs vary along (``_Provenance``:
      the flattened rows keep each rank's rows apart, as a batch-leading flatten does,
      and a tensor computed from inputs replicated over tp is held whole by each tp rank:
      the loss's log-softmax on a non-vocab-parallel head, the expert-parallel layer's
      per-group tensors under ep x tp), over every rank where no input's axes are known
      (an ASSUMPTION).  Task savedtp: it split every such tensor over every rank,
      1/tp of what each tp rank holds (ep 2 x tp 2: 0.72x the estimate, now 1.0006x;
      helper tdclock's torchrun count: the log-softmax 76,800 B per rank, 38,400 here);
    * a storage that copies another (``_Provenance``: the broadcast copies the simulator
      makes of a stacked tensor, which a device never makes; 1 to 9 per run) is counted
      once, in its source's layout, and not at all when the source is a parameter; it
      counts the copy's own layout (3 of the 4 that differ: a RoPE table's per-rank
      gather, half the bytes) or raises on a flattened copy, and it counted the
      simulator's weight copies as activations (commit 1431019, with the flattened dims
      taken for ranks: tiny dp 2 gave 1,564,756 B where one rank keeps 2,854,938);
    * a view is read in its own layout first, its storage's first tensor second; it
      reads the view's ``_base`` first, whose lead dim can equal the mesh size by chance:
      cp 2, the (B=2, S) token batch under its (1, B, S) stacked view, 512 B per rank
      there where each rank holds the whole 1,024;
    * on the meta device (every dry run) it counts nothing (it skips meta tensors, and
      keys storages by data_ptr, 0 for each of them); this keys the storage object;
    * checkpointed regions' inputs and selective checkpointing's saved outputs are not
      saved tensors: only this counter's ``counting`` sees them."""

    def __init__(self, mesh, params=()):
        self.shape = tuple(mesh.shape)
        self.size = math.prod(self.shape)
        # torch.distributed: every tensor is this process's own (its lead axes, where it
        # has them, of size 1): nothing is split over ranks.  Read through the layout
        # rule, a tensor without the lead axes was divided by the mesh size (EP 2 x dp 2:
        # 0.98 MB where the simulated ranks count 2.62; task tdclock)
        self.local = _B.is_distributed(mesh)
        self.skip = {getattr(p, "_local", p).untyped_storage()._cdata for p in params}
        self.seen: dict[int, tuple] = {}     # root storage id -> (bytes per rank, tensor)
        # (lead shape, cell) -> bytes of the tensors only some ranks hold (a causal ring's
        # blocks: ``_Provenance.owner``); the busiest cell's are every rank's at most
        self.owned: dict[tuple, int] = {}
        self.items: list[tuple] = []         # (bytes per rank, shape, dtype, op that made it)
        self.prov = _Provenance(None if self.local else self.shape)

    def _per_rank(self, t) -> int | None:
        """Bytes of ``t``'s storage one rank holds, by the shared layout rule; None if
        ``t`` has no lead axes matching the mesh."""
        if self.local:
            return t.untyped_storage().nbytes()
        ranks = _ranks_splitting(t, self.shape)
        return None if ranks is None else t.untyped_storage().nbytes() // max(1, ranks)

    def _slots(self, t, key) -> int:
        """The ranks' slots of ``t``'s storage that ``t`` (laid out as (*mesh, *local))
        leaves out: the mesh axes the storage varies along (``_Provenance.axes``) on which
        ``t`` is one rank's slice (size 1).  The simulator keeps a value replicated over
        a mesh axis as rank 0's slice of a stacked storage where it computed every rank's
        (a batched GEMM over operands expanded along cp: the dense MoE's experts under
        cp when cp does not divide the micro-batch); a device holds its own slot only.
        Read in the view's layout alone, the storage counted whole on every rank: cp x
        each expert GEMM's output (Llama MoE, cp 2, micro-batch 1: 92.3 MB where a rank
        keeps 46.1; dry run / estimate activations 1.356, now 1.005;
        tests/test_plan11.py)."""
        axes = self.prov.axes.get(key)
        if not axes:
            return 1
        return math.prod(self.shape[i] for i in axes if t.shape[i] == 1)

    def add(self, t) -> None:
        t = getattr(t, "_local", t)
        if not isinstance(t, torch.Tensor):
            return
        key = t.untyped_storage()._cdata
        root = self.prov.root(key)
        if {key, root} & self.skip or root in self.seen or t.untyped_storage().nbytes() == 0:
            return
        src = self.prov.first.get(root, t)
        owner = None if self.local else self.prov.owner.get(root)
        if owner is not None:
            # one group of ranks' own tensor (a ring block, which selective checkpointing
            # saves), split evenly among its cells; the ranks hold unequal numbers of them
            # (rank i of a causal load-balanced ring cp + 1 + i blocks): tallied per cell,
            # the busiest counted (``bytes``).  Read through the layout rule, every
            # rank's blocks were counted on each (cp 2: 7 blocks where the busiest rank
            # holds 4)
            lead, cells = owner
            per = src.untyped_storage().nbytes() // len(cells)
            for c in cells:
                self.owned[(lead, c)] = self.owned.get((lead, c), 0) + per
            self.seen[root] = (0, t)
            self.items.append((per, tuple(src.shape), src.dtype,
                               self.prov.made.get(root, "input")))
            return
        per = self._per_rank(t)
        if not self.local:  # (torch.distributed: no broadcast copies; a copy is the
            #                 process's own, counted at its own size, once)
            via = self.prov.via.get(key) if root != key else None
            if via is not None and self._per_rank(via) is not None:
                # a copy: as the view of its source it copied, which says how many ranks
                # split those elements (a broadcast copy's view is stride 0 on the ranks
                # it was expanded over: the source's share; a split's, as the ring
                # layout's local chunks of a sequence whole on every cp rank, varies over
                # them: 1/cp of it).  Counted in the source storage's own layout, the
                # ring's residual chunk was counted as the whole sequence (cp x)
                per = self._per_rank(via)
            elif per is None or root != key:
                per = self._per_rank(src) if self._per_rank(src) is not None else per
            else:                # the view's own layout, in its storage
                per //= self._slots(t, key)
            if per is None:      # no lead axes: the axes its inputs vary along
                axes = self.prov.storage_axes(src)
                split = self.size if axes is None else math.prod(self.shape[i] for i in axes)
                per = src.untyped_storage().nbytes() // max(1, split)
        self.seen[root] = (per, t)           # t held: the id stays unique
        self.items.append((per, tuple(src.shape), src.dtype, self.prov.made.get(root, "input")))

    @property
    def bytes(self) -> int:
        return sum(b for b, _ in self.seen.values()) + max(self.owned.values(), default=0)

    @contextlib.contextmanager
    def counting(self):
        """Count saved tensors and checkpointed regions' inputs inside the block."""
        import importlib
        mods = [importlib.import_module(m) for m in _CHECKPOINTING_MODULES]
        originals = [m.checkpoint for m in mods]

        def keep_inputs(fn, *args, **kwargs):
            for a in args:
                self.add(a)
            make = kwargs.get("context_fn")
            if make is None:
                return originals[0](fn, *args, **kwargs)
            fwd, rec = make()               # selective checkpointing (recompute="op")
            out = originals[0](fn, *args, **dict(kwargs, context_fn=lambda: (fwd, rec)))
            for t in op_sac.saved_outputs(fwd):     # what its policy saved
                self.add(t)
            return out

        def pack(t):
            self.add(t)
            return t
        try:
            for m in mods:
                m.checkpoint = keep_inputs
            with self.prov, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for m, f in zip(mods, originals):
                m.checkpoint = f


# the labels of the gradient reductions the data-parallel optimizers' backward hooks issue
# asynchronously (zero_optimizer_dist.defer_reduce_scatter: ZeRO-2's "zero-2 grad (async)",
# ZeRO-3's "zero-3 params" reduce-scatter; ddp_reducer's buckets)
GRAD_SYNC_LABELS = frozenset({"zero-2 grad (async)", "zero-3 params", "ddp grad",
                              "ddp bucket"})
_SYNC_KINDS = ("reduce_scatter", "all_reduce")


def sync_tail(tr, ranks, first: int, end: float) -> float:
    """How long the backward that recorded ``tr.events[first:]`` on ``ranks`` ends (at
    ``end``) after its own work: its compute and every collective but the data-parallel
    gradient reductions its hooks issued asynchronously (:data:`GRAD_SYNC_LABELS`).  That
    tail is the exposed part of the step's gradient sync, which the estimate files under
    its sync heading (``estimate``'s ``_dp_sync``: the reductions overlapped with the last
    micro-batch's backward, the rest exposed) and the dry run now too (``dryrun``)."""
    rs = set(ranks)
    own = max(tr.now(r, "compute") for r in ranks)
    for e in tr.events[first:]:
        if e.stream == "comm" and rs.intersection(e.ranks) and not (
                e.name in _SYNC_KINDS and e.label in GRAD_SYNC_LABELS):
            own = max(own, e.end)
    return max(0.0, end - own)


def _clock(tr, ranks) -> float:
    return max(max(tr.now(r, "compute"), tr.now(r, "comm")) for r in ranks)


def run_stage(h, model, s: int, cfg, micro_batch: int, tr, params) -> dict:
    """Run one micro-batch of ``micro_batch`` sequences per data-parallel rank through
    stage ``s`` of the ``Hybrid`` strategy ``h`` (model on meta) under trace ``tr``.
    ``params``: the stage's parameters (left out of the activation count)."""
    n_stages = len(h.stage_layers)
    mesh = h.meshes[s % h.pp]
    B, S = micro_batch * h.dp, cfg.seq_len
    ranks = mesh.ranks
    t0 = _clock(tr, ranks)
    # the model's buffers (the Llama's RoPE tables, sliced into every block) are resident
    # as its parameters are, allocated once, not per micro-batch: not activations
    counter = SavedCounter(mesh, list(params) + list(model.buffers()))
    if s == 0:
        x = h._batch(torch.zeros(B, S, dtype=torch.long, device="meta"), mesh)
    else:                          # the layout a stage output arrives in (Hybrid's g)
        ps = [Shard(0), Shard(1) if h.sp else Replicate()]
        x = _detach_leaf(shard_tensor(torch.empty(B, S, cfg.d_model, dtype=cfg.torch_dtype,
                                                  device="meta"), mesh, ps))
    with counter.counting():
        y = h._stage(model, s, x)           # the recipe's own stage: the model's stage_forward
        if s == n_stages - 1:
            y = h._loss(y, h._batch(torch.zeros(B, S, dtype=torch.long, device="meta"), mesh))
    t_fwd = _clock(tr, ranks)
    send, send_bytes, pair_bytes = 0.0, {}, 0
    if s < n_stages - 1:           # the activation to the next stage (and its gradient back)
        dst = h.meshes[(s + 1) % h.pp]
        b0, n0 = tr.bytes_per_rank(), len(tr.events)
        _send(y.detach(), dst, list(y.placements), f"stage {s} -> {s + 1}")
        # the send's own events, first start to last end: not the clocks' advance, which
        # is nothing when the receiving mesh already ran a later chunk (interleaved pp 2:
        # chunk 1 -> 2 lands on mesh 0, whose clock is past chunk 0's backward)
        sent = tr.events[n0:]
        send = max(e.end for e in sent) - min(e.start for e in sent) if sent else 0.0
        pair_bytes = max((e.bytes for e in sent), default=0)  # one sender's, to one peer
        send_bytes = {r: b - b0.get(r, 0) for r, b in tr.bytes_per_rank().items()
                      if b != b0.get(r, 0)}
        # the backward is timed alone, after the send: the composed pipeline (plan.dryrun)
        # adds the send to this stage's forward and runs the backward once the gradient
        # is back; left on the compute clock, its ops started beside the send (which holds
        # only the comm stream) and it measured the send's length short (Llama 2 7B, tp 8,
        # pp 2 on 910B: 1.25 ms of a layer's 4.08 ms backward; tests/test_plan10.py)
        if sent:
            tr.wait(Handle(tuple(ranks), max(e.end for e in sent)))
    t1 = _clock(tr, ranks)
    n1 = len(tr.events)
    # the recipe's backward context (context parallelism: recomputed attention on the ring)
    with getattr(h, "backward_context", contextlib.nullcontext)():
        if s == n_stages - 1:
            y.backward()
        else:
            torch.autograd.backward([y._local], [torch.empty_like(y._local)])
    t_bwd = _clock(tr, ranks)
    return {"stage": s, "forward": t_fwd - t0, "backward": t_bwd - t1, "send": send,
            "sync_tail": sync_tail(tr, ranks, n1, t_bwd),
            "send_pair_bytes": pair_bytes,     # what each sender sends its peer
            "send_bytes": send_bytes,      # per rank: the send's and the receiving mesh's
            "activation_bytes": counter.bytes, "saved_tensors": len(counter.seen)}


def is_meta(model) -> bool:
    """Every parameter (and its DistTensor shards) lives on the meta device."""
    for p in model.parameters():
        if p.device.type != "meta":
            return False
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, DistTensor) and v._local.device.type != "meta":
                return False
    return True
