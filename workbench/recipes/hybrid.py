"""The hybrid recipe: DP x TP x PP (x SP) training of the course's models on simulated ranks.

A recipe joins models and strategies: it lives above ``workbench.parallel`` (which knows no
model) beside ``train`` and ``plan``.

The mesh layout (PaddlePaddle 3's 8-device example when dp = tp = pp = 2)::

    stage 0: Mesh([[0, 1], [2, 3]], ["dp", "tp"])     stage 1: Mesh([[4, 5], [6, 7]], ...)

The recipe reads what it needs from the model itself: its tensor-parallel plan
(``model.tp_plan(tp)``), the regions that take Megatron's f and g
(``model.tp_regions(layers)``, :mod:`workbench.parallel.strategies.tensor_parallel`),
its norm classes (``model.norm_classes()``, for sequence parallelism), its pipeline stages
(``model.pipeline_stages(n)``) and how to run one (``model.stage_forward``):

* tensor parallel (Megatron-LM): for the Llama, q, k, v, gate and up projections
  column-parallel, o and down row-parallel; the embedding vocabulary-parallel and
  the lm head column-parallel (vocabulary-sharded logits, vocabulary-parallel
  cross-entropy) when the vocabulary divides by tp;
* sequence parallel: the residual stream is sharded on the sequence dim over tp
  (one reshard after the embedding; the SPMD rules then insert Megatron-SP's
  all-gather before each column-parallel linear and reduce-scatter after each
  row-parallel one, because those are the cheapest plans);
* data parallel / ZeRO over dp (:mod:`workbench.parallel.strategies.data_parallel`,
  :mod:`workbench.parallel.strategies.zero3`);
* pipeline parallel: the layers split into ``pp * v`` stages on the stage meshes,
  run by :func:`workbench.schedules.run_pipeline` in the chosen schedule's order;
* expert parallel (``ep``, mixture-of-experts models): the experts split over ep ranks
  carved out of the data-parallel ones (dense layers dp x ep, experts (edp=dp, ep, tp));
  tokens exchanged by uneven all-to-all (:mod:`workbench.recipes.moe`).

Every configuration trains the same global batch with the same loss as one device,
dropout included (``train`` keys the masks: :mod:`workbench.sim_mesh.rng`).

The recipe's parts live beside this module (its names stay importable from here): the
stage meshes and schedules (:mod:`.hybrid_layout`), the checks (:mod:`.hybrid_checks`),
building the model and optimizers (:mod:`.hybrid_build`) and running a step
(:mod:`.hybrid_step`).
"""
from __future__ import annotations

import torch

from ..parallel import schedules as S
from ..train_checks import check_world
from . import dualpipe as _dualpipe
from .hybrid_build import ONE_BUFFER, _Build, _relative  # noqa: F401
from .hybrid_checks import _Checks, _arg, _check_args, _int, _microbatch_hint  # noqa: F401
from .hybrid_layout import SCHEDULES, stage_meshes
from .hybrid_step import (_FAILED_STEP, _NO_STEP, _NOT_MEASURED,  # noqa: F401
                          _PIPELINE_ACTIVATIONS, _Step)
from .moe import check_ep, expert_meshes

__all__ = ["Hybrid", "stage_meshes"]


class Hybrid(_Checks, _Build, _Step):
    """A training strategy (see :mod:`workbench.train`) for any dp x tp x pp layout."""

    name = "hybrid"

    def __init__(self, dp=1, tp=1, pp=1, sp=False, zero=0, schedule="1f1b",
                 microbatches=None, virtual=None, distributed: bool = False,
                 stage_sizes=None, ep=1, ep_chunks=1, regather: bool = True):
        _check_args(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, schedule=schedule,
                    microbatches=microbatches, virtual=virtual, distributed=distributed,
                    regather=regather)
        # expert parallelism (recipes/moe.py): ep ranks carved out of dp x ep data-parallel
        # ranks; self.dp is the dense layers' data-parallel size, self.edp the experts'
        check_ep(ep, ep_chunks, zero, sp)
        if ep > 1 and schedule in ("dualpipe", "zb-v"):
            raise ValueError(f"ep={ep} with schedule={schedule!r}: expert parallelism is wired "
                             "for one copy of each stage in the interleaved placement; use "
                             "schedule '1f1b', 'gpipe', 'interleaved' or 'zb-h1' with ep > 1")
        self.ep, self.ep_chunks, self.edp = ep, ep_chunks, dp
        dp = dp * ep
        if ep > 1:
            check_world(dp, tp, pp, f"Hybrid(dp={self.edp}, ep={ep}, tp={tp}, pp={pp})")
        self.dp, self.tp, self.pp, self.sp, self.zero = dp, tp, pp, sp, zero
        # sp: the column-parallel linears keep the sequence shard and all-gather it again
        # in backward (Megatron-LM), or keep the gathered input (regather=False, as
        # PyTorch's DTensor): tensor_parallel.megatron_f's ``regather``
        self.regather = regather
        self.schedule_name = schedule
        self.v = virtual or (2 if schedule in ("interleaved", "zb-v") else 1)
        self._m = microbatches
        self.m = microbatches or (2 * pp if pp > 1 else 1)
        self.meshes = stage_meshes(dp, tp, pp)
        self.expert_meshes = expert_meshes(self.meshes, ep) if ep > 1 else []
        self.distributed = distributed
        if distributed:                 # one rank per process on torch.distributed
            from ..sim_mesh import backends as _B
            if _B.world_size() != dp * tp * pp:
                raise ValueError(f"{_B.world_size()} processes for dp x tp x pp = "
                                 f"{dp * tp * pp} ranks: launch torchrun --nproc-per-node "
                                 f"{dp * tp * pp}")
            self.meshes = [_B.register(m) for m in self.meshes]
            self.expert_meshes = [_B.register(m) for m in self.expert_meshes]
        self.device = torch.device("cpu")
        self.profile = None            # the trace's default hardware profile
        # layers per pipeline stage when uneven (None: n_layer / pp each; 1F1B / GPipe)
        if stage_sizes is not None and (
                not isinstance(stage_sizes, (list, tuple))
                or any(not _int(k) or k < 0 for k in stage_sizes)):
            raise ValueError(f"Hybrid(stage_sizes={stage_sizes!r}): give a list of pp={pp} "
                             "layer counts, ints >= 0 adding up to n_layer (e.g. "
                             "stage_sizes=[1, 3]: pp=2, n_layer=4)")
        if stage_sizes is not None and (len(stage_sizes) != pp or self.v != 1):
            raise ValueError(f"stage_sizes={stage_sizes!r}: give the layers of each of the "
                             f"pp={pp} stages (uneven stages are not interleaved)")
        self.stage_sizes = None if stage_sizes is None else list(stage_sizes)

    def _schedule(self, m):
        if self.schedule_name == "interleaved":
            return S.interleaved_1f1b(self.pp, m, self.v)
        return SCHEDULES[self.schedule_name](self.pp, m)

    def clip_grad_norm_(self, optimizers, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, every stage scaled by
        one coefficient; returns one device's total norm.  Call it after
        :meth:`forward_backward`, before :meth:`optimizer_step`
        (:mod:`workbench.recipes.pipeline_clip`)."""
        from .pipeline_clip import clip_hybrid_norm_
        return clip_hybrid_norm_(self, optimizers, max_norm, norm_type, error_if_nonfinite,
                                 foreach)

    def clip_grad_value_(self, optimizers, clip_value: float, foreach=None) -> None:
        """``torch.nn.utils.clip_grad_value_`` over every stage's gradients (summed over
        dp first); call it where :meth:`clip_grad_norm_` goes."""
        from .pipeline_clip import clip_hybrid_value_
        clip_hybrid_value_(self, optimizers, clip_value, foreach)

    def finish_gradient_synchronization(self, optimizers) -> None:
        """Every stage's gradients summed over its dp ranks (DualPipe: the two copies'
        first), for a ``torch.optim`` optimizer over the stage optimizers' ``parameters()``
        (ZeRO 0): call it after :meth:`forward_backward`, then that optimizer's step."""
        if self.schedule_name == "dualpipe":
            _dualpipe.sum_copies_once(self)
        for o in optimizers:
            o.finish_gradient_synchronization()

    def optimizer_step(self, optimizers) -> None:
        if self.schedule_name == "dualpipe":      # sum the two copies' gradients first
            _dualpipe.sum_copies_once(self)
        self._copies_summed = False
        for o in optimizers:
            o.step()

    def step_report(self, tr, optimizers) -> dict:
        """What one step cost on the modeled clock: time, bytes each rank sent (the
        busiest rank), model-state bytes per rank (parameters, gradients, Adam states)
        and, without a pipeline, the activation bytes a rank keeps for backward (run the
        step inside :meth:`measure_activations`: without it this raises).  Each figure is
        the largest over the ranks, as the simulator's trace holds every rank's clock; on
        torch.distributed a process's trace holds its own ranks', so every process calls
        this and the figures are gathered (one all-reduce MAX over the world, not traced):
        every process reports the simulator's record (was: each its own, rank 0's printed;
        pp 2 rank 0's modeled step and state bytes, not the slowest and the largest)."""
        per_rank = tr.bytes_per_rank()
        held: dict = {}                # a rank with several chunks (interleaved, zb-v,
        for o in optimizers:           # dualpipe) holds the states of each of them, and
            total = o.memory().total   # a MoE rank its dense and its experts' states
            mesh = getattr(o, "mesh", None)
            for r in (mesh.ranks if mesh is not None else (("optimizer", id(o)),)):
                held[r] = held.get(r, 0) + total
        rec = {"modeled_ms": tr.time(),
               "comm_bytes": max(per_rank.values(), default=0),
               "state_bytes": max(held.values(), default=0)}
        if len(self.stage_layers) == 1:
            # activations autograd kept for backward, per rank (counted without pipelining;
            # with a pipeline the peak depends on the schedule: see run_pipeline/simulate)
            rec["activation_bytes"] = self.last_activation_bytes   # raises if not counted
        if self.distributed:            # the slowest / largest over every process
            import torch.distributed as dist
            top = torch.tensor([float(v) for v in rec.values()], dtype=torch.float64)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            rec = {k: v if k == "modeled_ms" else int(v)
                   for k, v in zip(rec, top.tolist())}
        rec["modeled_ms"] = round(rec["modeled_ms"] * 1e3, 6)
        return rec
