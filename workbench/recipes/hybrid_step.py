"""The strategy seam of a :class:`~.hybrid.Hybrid`, running: a batch laid out on the
stage meshes, forward and backward through the stages (the pipeline schedule's order when
pp > 1), the activations a step keeps (counted when asked) and evaluation."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..parallel import schedules as S
from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.module import dist_parameters
from ..parallel.placement import Replicate, Shard
from ..parallel.reshard import reshard
from . import dualpipe as _dualpipe
from .moe import scale_aux_losses, whole_batch_stats
from .pipeline_loss import token_weights, weighted_loss_fn


# why ``last_activation_bytes`` has no figure (it raises with these words)
_NO_STEP = "no forward_backward has run yet"
_NOT_MEASURED = ("the last forward_backward did not count its activations (the count watches "
                 "every op of the forward, a third of a step's time, so it runs only when "
                 "asked): run the step inside `with strategy.measure_activations():` "
                 "(wb.train does)")
_FAILED_STEP = "the last forward_backward raised before its activations were counted"
_PIPELINE_ACTIVATIONS = ("the last forward_backward ran a pipeline (pp > 1 or virtual stages), "
                         "whose activation peak depends on the schedule: see "
                         "workbench.parallel.schedules.simulate, or the dry run's memory")


class _Step:
    """Running a step and evaluating (a base of :class:`~.hybrid.Hybrid`)."""

    def _batch(self, t: torch.Tensor, mesh) -> DistTensor:
        return shard_tensor(t, mesh, [Shard(0), Replicate()])

    def _layout(self, x):
        """The residual stream after the embedding: replicated on tp, or sharded on the
        sequence (sequence parallelism)."""
        if self.tp == 1:
            return x
        return reshard(x, x.mesh, [Shard(0), Shard(1) if self.sp else Replicate()])

    def _stage(self, model, s, x):
        n = len(self.stages)
        if s == 0 and hasattr(model, "pos_emb"):        # the GPT's learned positions
            return model.stage_forward(self.stages[s], x, True, n == 1, self._layout,
                                       positions=self._positions(x))
        return model.stage_forward(self.stages[s], x, s == 0, s == n - 1, self._layout)

    @staticmethod
    def _positions(ids, order=None):
        """The position of each token, (b, s), laid out as the token ids ``ids`` (``order``:
        the positions of the ids' columns, default 0 .. s-1), as Megatron-LM hands its GPT
        ``position_ids`` of the batch's shape (megatron/training/utils.py
        ``get_ltor_masks_and_position_ids``: ``arange(seq_length)`` expanded to the ids').
        Looked up so, the position table's output is laid out as the token embedding's and
        its gradient stays each rank's, summed with the other parameters' by the data-
        parallel reduction; an (s,) lookup broadcast over a batch sharded on dp made that
        output a replicated input, whose gradient was all-reduced over dp in backward (one
        s x h all-reduce a micro-batch, on the trace as "grad of a replicated input")."""
        B, S = ids.shape
        pos = torch.arange(S) if order is None else order
        pos = pos.to(device=ids.device, dtype=ids.dtype).expand(B, S).contiguous()
        return shard_tensor(pos, ids.mesh, list(ids.placements))

    def _loss(self, logits, targets):
        B, S_, V = logits.shape
        flat = logits.reshape(B * S_, V)
        if flat.dtype != torch.float32:         # in float32, as the models' own forward
            flat = flat.float()
        return F.cross_entropy(flat, targets.reshape(B * S_))

    def forward_backward(self, model, inputs, targets):
        self._activations = _FAILED_STEP        # until this step's own figure (or reason)
        if not torch.is_grad_enabled():
            raise RuntimeError("Hybrid.forward_backward under torch.no_grad(): a training "
                               "step needs gradients; to evaluate use "
                               "strategy.evaluate(model, inputs, targets) (forward only)")
        if self.schedule_name == "dualpipe":
            self._activations = _PIPELINE_ACTIVATIONS
            return _dualpipe.forward_backward(self, model, inputs, targets)
        self.check(model.cfg, inputs.shape[0])
        n_stages = len(self.stage_layers)
        if n_stages == 1:
            mesh = self.meshes[0]

            def forward():
                logits = self._stage(model, 0, self._batch(inputs, mesh))
                return self._loss(logits, self._batch(targets, mesh))
            loss = self._forward_counted(model, mesh, forward)
            loss.backward()
            return loss.full().detach()
        # no count of a pipeline's activations: the peak depends on the schedule
        self._activations = _PIPELINE_ACTIVATIONS
        stages = [lambda x, s=s: self._stage(model, s, x) for s in range(n_stages)]
        m = self.m
        first, last = self.meshes[0], self._mesh_of(n_stages - 1)
        xs = [self._batch(c, first) if self._own(first) else None for c in inputs.chunk(m)]
        ts = [self._batch(c, last) if self._own(last) else None for c in targets.chunk(m)]
        sched = self._schedule(m)
        scale_aux_losses(model, m)      # MoE: the load-balancing loss averaged as the loss
        params = [self._stage_params(model, s) if self._own(self._mesh_of(s)) else []
                  for s in range(n_stages)] if sched.split_backward else None
        # ignored targets (-100): each micro-batch weighed by its tokens (pipeline_loss.py)
        loss_fn = weighted_loss_fn(lambda out, i: self._loss(out, ts[i]),
                                   token_weights(targets, m))
        with whole_batch_stats(model):  # MoE last_stats: every micro-batch (recipes/moe.py)
            run = S.run_pipeline(sched, stages, self.meshes, xs, loss_fn, params=params)
        return torch.tensor(run.loss)

    # ---- the activations a step keeps for backward: counted when asked -----------------
    @contextlib.contextmanager
    def measure_activations(self):
        """Count, in every one-stage :meth:`forward_backward` inside the block, the bytes
        one rank keeps for backward (``last_activation_bytes``, the ``activation_bytes``
        of :meth:`step_report`), as the dry run counts them
        (:class:`workbench.plan.meta_run.SavedCounter`).  Off by default: the count
        watches every op of the forward (``benchmarks/sim_overhead.py --only ops --timer
        cpu``, task simperf3, load 5-7: a traced gpt-tiny Hybrid(dp=2, tp=2) step 3.6-3.7x
        plain torch's time, 5.0-5.5x with the count); ``wb.train`` turns it on for its
        records."""
        before = getattr(self, "_measuring", False)
        self._measuring = True
        try:
            yield self
        finally:
            self._measuring = before

    @property
    def last_activation_bytes(self) -> int:
        """The bytes one rank kept for backward in the last :meth:`forward_backward`
        (one stage, run inside :meth:`measure_activations`); raises otherwise, never a
        figure of an earlier step."""
        got = getattr(self, "_activations", _NO_STEP)
        if isinstance(got, str):
            raise RuntimeError(f"{type(self).__name__}.last_activation_bytes: {got}")
        return got

    def _forward_counted(self, model, mesh, forward):
        """``forward()``, its saved activations counted when :meth:`measure_activations`
        is on (else the count is marked missing, so that no earlier step's is read)."""
        if not getattr(self, "_measuring", False):
            self._activations = _NOT_MEASURED
            return forward()
        self._activations = _FAILED_STEP
        params = [p for _, p in dist_parameters(model)] + list(model.buffers())
        # (buffers, e.g. the RoPE tables: resident, not saved activations)
        # what one rank keeps for backward, counted as the dry run counts it (a broadcast
        # copy the simulator makes of a stacked tensor counted as its source; checkpointed
        # blocks' inputs): plan.meta_run.SavedCounter
        from ..plan.meta_run import SavedCounter
        with SavedCounter(mesh, params).counting() as saved:
            loss = forward()
        self._activations = saved.bytes               # what one rank keeps for backward
        return loss

    def evaluate(self, model, inputs, targets=None) -> torch.Tensor:
        """The batch's mean loss, forward only (``torch.distributed.pipelining``'s
        ``schedule.eval()``); without ``targets`` the logits (B, S, V)
        (:mod:`workbench.recipes.pipeline_eval`)."""
        from .pipeline_eval import evaluate
        return evaluate(self, model, inputs, targets)
