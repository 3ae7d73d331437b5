"""One micro-batch of one pipeline stage, run for real on the meta device.

:func:`run_stage` takes a model built and parallelized by the library's ``Hybrid``
recipe on meta tensors (shapes, dtypes and placements, no data), feeds one
micro-batch into pipeline stage ``s`` exactly as ``run_pipeline`` would (a token batch
on the first stage, the previous stage's activation layout elsewhere), runs the
stage's forward (and the loss on the last stage) and its backward under the caller's
trace, and reports:

- the stage's forward and backward time on the modeled clock (every op the real code
  dispatches, priced forward and backward from the op table; every collective the
  recipe issues, priced on the topology): the latest clock of the stage's ranks;
- the bytes ONE rank keeps for backward (:class:`SavedCounter`): every tensor autograd
  saves, each storage once, parameters left out, split over the device axes that
  really vary (as ``parallel.strategies.memory.saved_activation_bytes``, which skips
  meta tensors), plus the inputs that ``torch.utils.checkpoint`` keeps for its
  recompute (non-reentrant checkpointing holds them in a closure, not as saved tensors:
  full recompute keeps each block's input, selective the attention core's q, k, v);
- the time to send the stage's output to the next stage (``schedules.execute._send``,
  the function the pipeline executor uses) and its gradient back (the same size).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.placement import Replicate, Shard
from ..parallel.schedules.execute import _detach_leaf, _send

__all__ = ["SavedCounter", "run_stage"]

_CHECKPOINTING_MODULES = ("workbench.models.gpt", "workbench.models.llama")


class SavedCounter:
    """Per-rank bytes of what a forward keeps for backward (module docstring)."""

    def __init__(self, params=(), lead_dims: int = 0):
        self.nd = lead_dims
        self.skip = {getattr(p, "_local", p).untyped_storage()._cdata for p in params}
        self.seen: dict[int, tuple] = {}     # storage id -> (bytes per rank, tensor)

    def add(self, t) -> None:
        t = getattr(t, "_local", t)
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip or key in self.seen or st.nbytes() == 0:
            return
        k = min(self.nd, t.dim())
        ranks = math.prod(n for n, s in zip(t.shape[:k], t.stride()[:k]) if s != 0)
        self.seen[key] = (st.nbytes() // max(1, ranks), t)   # t held: the id stays unique

    @property
    def bytes(self) -> int:
        return sum(b for b, _ in self.seen.values())

    @contextlib.contextmanager
    def counting(self):
        """Count saved tensors and checkpointed regions' inputs inside the block."""
        import importlib
        mods = [importlib.import_module(m) for m in _CHECKPOINTING_MODULES]
        originals = [m.checkpoint for m in mods]

        def keep_inputs(fn, *args, **kwargs):
            for a in args:
                self.add(a)
            return originals[0](fn, *args, **kwargs)

        def pack(t):
            self.add(t)
            return t
        try:
            for m in mods:
                m.checkpoint = keep_inputs
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for m, f in zip(mods, originals):
                m.checkpoint = f


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
    counter = SavedCounter(params, lead_dims=mesh.ndim)
    if s == 0:
        x = h._batch(torch.zeros(B, S, dtype=torch.long, device="meta"), mesh)
    else:                          # the layout a stage output arrives in (Hybrid's g)
        ps = [Shard(0), Shard(1) if h.sp else Replicate()]
        x = _detach_leaf(shard_tensor(torch.empty(B, S, cfg.d_model, dtype=cfg.torch_dtype,
                                                  device="meta"), mesh, ps))
    with counter.counting():
        y = x
        if s == 0:
            y = h._embed(model, y)
        y = h._blocks(model, s, y)
        if s == n_stages - 1:
            y = h._loss(h._head(model, y),
                        h._batch(torch.zeros(B, S, dtype=torch.long, device="meta"), mesh))
    t_fwd = _clock(tr, ranks)
    send = 0.0
    if s < n_stages - 1:           # the activation to the next stage (and its gradient back)
        dst = h.meshes[(s + 1) % h.pp]
        c0 = max(_clock(tr, ranks), _clock(tr, dst.ranks))
        _send(y.detach(), dst, list(y.placements), f"stage {s} -> {s + 1}")
        send = max(_clock(tr, ranks), _clock(tr, dst.ranks)) - c0
    t1 = _clock(tr, ranks)
    if s == n_stages - 1:
        y.backward()
    else:
        torch.autograd.backward([y._local], [torch.empty_like(y._local)])
    t_bwd = _clock(tr, ranks)
    return {"stage": s, "forward": t_fwd - t0, "backward": t_bwd - t1, "send": send,
            "activation_bytes": counter.bytes, "saved_tensors": len(counter.seen)}


def stage_ranks(h, s: int) -> list[int]:
    return list(h.meshes[s % h.pp].ranks)


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
