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
"""
from __future__ import annotations

import contextlib
import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import build_model as _build
from ..parallel import schedules as S
from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.module import dist_parameters, parallelize
from ..parallel.module_state import adopt
from ..parallel.placement import Replicate, Shard
from ..parallel.reshard import reshard
from ..parallel.strategies.data_parallel import DataParallel
from ..parallel.strategies.tensor_parallel import (megatron_f, sequence_parallel_norms,
                                                   sequence_parallel_params,
                                                   tensor_parallel_region)
from ..sim_mesh.mesh import Mesh
from ..train_checks import check_sizes, check_world
from . import dualpipe as _dualpipe
from .pipeline_loss import token_weights, weighted_loss_fn
from .zero3_stage import Zero3Stage
from .moe import (check_ep, check_ep_batch, check_moe_layout, expert_meshes,
                  keep_residual_layout, scale_aux_losses, split_params, whole_batch_stats,
                  wire_expert_parallel)

__all__ = ["Hybrid", "stage_meshes"]

ONE_BUFFER = math.inf      # DataParallel's bucket_bytes: every gradient in one bucket


def _relative(plan: dict, name: str) -> dict:
    """The entries of a root-level plan that fall inside module ``name``, keyed from it
    ("layers.*.attn.wq" inside "layers.3" is "attn.wq"; "tok_emb" inside itself is "")."""
    depth = len(name.split("."))
    out = {}
    for key, val in plan.items():
        parts = key.split(".")
        if fnmatch.fnmatchcase(name, ".".join(parts[:depth])):
            out[".".join(parts[depth:])] = val
    return out

SCHEDULES = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "interleaved": S.interleaved_1f1b,
             "zb-h1": S.zb_h1, "zb-v": S.zb_v,   # zb-v: 2 chunks per rank, V-placed
             "dualpipe": S.dualpipe}              # two copies of the stages: recipes/dualpipe.py


def stage_meshes(dp: int, tp: int, pp: int) -> list[Mesh]:
    """One (dp, tp) mesh per pipeline stage over consecutive ranks."""
    n = dp * tp
    return [Mesh([[s * n + i * tp + j for j in range(tp)] for i in range(dp)], ["dp", "tp"])
            for s in range(pp)]


def _arg(name: str, value=None) -> str:
    """An argument as the messages write it: ``dp`` or ``dp=4``."""
    return name if value is None else f"{name}={value!r}"


def _microbatch_hint(batch_size, dp, m, pp, schedule) -> str:
    """``", or Hybrid(microbatches=k)"`` for the k nearest ``m`` that fits the batch."""
    if batch_size % dp:
        return ""
    per = batch_size // dp
    ks = [k for k in range(1, per + 1) if per % k == 0
          and (schedule != "interleaved" or k % pp == 0)
          and (schedule != "zb-v" or k >= pp)              # zb_v: m >= p
          and (schedule != "dualpipe" or (k % 2 == 0 and k >= 2 * pp))]
    if not ks:
        return ""
    k = min(ks, key=lambda k: (abs(k - m), -k))
    return f", or Hybrid(microbatches={k})"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_args(*, dp, tp, pp, sp, zero, schedule, microbatches, virtual, distributed,
                regather=True):
    """Hybrid's arguments, before any mesh is built (microseconds whatever the values)."""
    for n, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not _int(v) or v < 1:
            raise ValueError(f"Hybrid({n}={v!r}): give an int >= 1, the number of ranks "
                             f"along {n} (1: no {n})")
    check_world(dp, tp, pp, f"Hybrid(dp={dp}, tp={tp}, pp={pp})")
    for n, v in (("sp", sp), ("distributed", distributed), ("regather", regather)):
        if not isinstance(v, bool):
            raise TypeError(f"Hybrid({n}={v!r}): give True or False")
    if sp and tp == 1:
        raise ValueError("Hybrid: sp=True needs tp > 1: sequence parallelism shards the "
                         "tensor-parallel region's norms and dropouts over tp; add tp=2 or "
                         "leave sp False")
    if not regather and not sp:
        raise ValueError("Hybrid(regather=False) with sp=False: regather says what sequence "
                         "parallelism's linears keep for backward (the sequence shard, "
                         "gathered again, or the gathered input); add sp=True (and tp > 1) "
                         "or leave regather True")
    if not _int(zero) or zero not in (0, 1, 2, 3):
        raise ValueError(f"Hybrid(zero={zero!r}): give the ZeRO stage, 0 (plain data "
                         "parallel), 1, 2 or 3")
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"Hybrid(schedule={schedule!r}): use one of {list(SCHEDULES)}")
    for n, v in (("microbatches", microbatches), ("virtual", virtual)):
        if v is not None and (not _int(v) or v < 1):
            raise ValueError(f"Hybrid({n}={v!r}): give an int >= 1, or None for the default")
    if schedule == "dualpipe":
        _dualpipe.check_args(pp=pp, zero=zero, distributed=distributed)
    if schedule == "zb-v" and distributed:      # before a step, not in its first pipeline
        raise NotImplementedError("Hybrid(schedule='zb-v', distributed=True): the 'v' layout "
                                  "runs on the simulator only; use schedule='1f1b', "
                                  "'interleaved' or 'zb-h1' on torch.distributed")
    if schedule == "zb-v" and virtual not in (None, 2):
        raise ValueError(f"Hybrid(virtual={virtual}) with schedule='zb-v': ZB-V places "
                         "exactly two chunks per rank; leave virtual None")
    if virtual is not None and virtual > 1 and schedule not in ("interleaved", "zb-v"):
        raise ValueError(f"Hybrid(virtual={virtual}) with schedule={schedule!r}: model chunks "
                         "per rank need the interleaved schedule; add schedule='interleaved' "
                         "or leave virtual None")


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


class Hybrid:
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

    # ---- checks ---------------------------------------------------------------------------
    def check(self, cfg, batch_size: int) -> None:
        """A clear error before anything runs when the layout does not fit the model."""
        tp, pp, v = self.tp, self.pp, self.v
        check_ep_batch(self.edp, self.ep, batch_size)           # recipes/moe.py
        check_sizes(self.dp, tp, pp, batch_size, cfg, "the model", _arg, self.stage_sizes)
        check_moe_layout(cfg, self.ep)
        if self._m is not None and self.dp * self._m > batch_size:
            raise ValueError(f"microbatches={self._m}: at most batch_size // dp = "
                             f"{batch_size // self.dp} (batch_size={batch_size}, "
                             f"{self._dp_words()}): every micro-batch holds at least one "
                             "sequence per dp rank; lower microbatches")
        if self._m is None and pp > 1:      # 2p micro-batches if the batch allows, else p
            self.m = 2 * pp if batch_size % (self.dp * 2 * pp) == 0 else pp
        for name, val in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head),
                          ("d_ff", cfg.d_ff)):
            if val % tp:
                raise ValueError(f"tp={tp} does not divide {name}={val}: tensor parallelism "
                                 "splits heads and hidden features evenly")
        self._check_layers(cfg)
        if batch_size % (self.dp * self.m):
            n = self.dp * self.m
            raise ValueError(f"batch_size={batch_size} does not divide into {self._dp_words()} x "
                             f"{self.m} micro-batches: the micro-batches must be equal, each "
                             f"split evenly over the dp ranks; give a batch_size that divides by "
                             f"{n} (e.g. {n * max(1, round(batch_size / n))})"
                             + _microbatch_hint(batch_size, self.dp, self.m, pp,
                                                self.schedule_name))
        if getattr(cfg, "tie_embeddings", False) and pp * v > 1 and self.device.type != "meta":
            # Megatron keeps a copy of the word embedding on the last stage and all-reduces
            # the two copies' gradients every step; without that the copies drift apart
            if pp == 1:                 # virtual stages on one rank (was: "with pp > 1
                raise NotImplementedError(  # ... use pp=1" when pp was 1)
                    f"tie_embeddings=True with schedule={self.schedule_name!r} and {v} "
                    "model chunks on one rank (pp=1): the head's stage needs its copy of "
                    "the embedding's gradient summed with the first stage's, not built yet; "
                    "use schedule='1f1b' (one stage), or cfg.replace(tie_embeddings=False)")
            raise NotImplementedError(
                "tie_embeddings=True with pp > 1: the last stage's copy of the embedding "
                "needs Megatron's embedding-gradient all-reduce, not built yet; use pp=1, or "
                "cfg.replace(tie_embeddings=False), or --dry-run (which prices it)")
        if getattr(cfg, "recompute", "none") == "op" and pp > 1 and \
                self.schedule_name in ("zb-h1", "zb-v", "dualpipe"):
            # PyTorch's selective activation checkpoint allows one backward per region
            raise NotImplementedError(
                f"recompute='op' with schedule={self.schedule_name!r}: the schedule splits "
                "each backward in two (B: input gradients, W: weight gradients), and "
                "PyTorch's selective activation checkpoint allows one backward through its "
                "region; use recompute 'full' or 'selective', or schedule '1f1b'")
        if self.sp and cfg.seq_len % tp:
            raise ValueError(f"sp: seq_len={cfg.seq_len} does not divide by tp={tp}")
        if self.schedule_name == "interleaved" and self.m % pp:
            raise ValueError(f"interleaved schedule: {self.m} micro-batches must be a multiple "
                             f"of pp={pp}")
        if self.schedule_name == "zb-v" and self.m < pp and pp > 1:
            # before the step (was: zb_v's "zb_v(p=2, m=1)" from inside forward_backward,
            # naming the schedule function's arguments, not Hybrid's)
            raise ValueError(f"Hybrid(microbatches={self.m}) with schedule='zb-v' and "
                             f"pp={pp}: the V schedule fills its warm-up with the first pp "
                             f"micro-batches; give Hybrid(microbatches={pp}) or more (a "
                             f"batch_size that divides by dp x it), or schedule='1f1b'")
        if self.schedule_name == "dualpipe":
            _dualpipe.check(self, batch_size)

    def _dp_words(self) -> str:
        """The data-parallel ranks as the user gave them: "dp=2", or with expert parallelism
        "dp=1 x ep=4 = 4" (the dense layers' dp is edp x ep, a number nobody typed: was
        "microbatches=4: at most batch_size // dp = 2 (batch_size=8, dp=4)" for
        Hybrid(ep=4))."""
        if self.ep > 1:
            return f"dp={self.edp} x ep={self.ep} = {self.dp} data-parallel ranks"
        return f"dp={self.dp}"

    def _check_layers(self, cfg) -> None:
        """The model's layers cut into pp x virtual stages (or ``stage_sizes``), said in
        Hybrid's words; :meth:`build_model` checks it too, as it cuts the model before any
        step's :meth:`check` (was: ``model.pipeline_stages``' "n_stages=4 does not divide
        n_layer=2 ... give sizes=", arguments a Hybrid user never wrote)."""
        pp, v = self.pp, self.v
        if self.stage_sizes is not None:
            if sum(self.stage_sizes) != cfg.n_layer:
                raise ValueError(f"stage_sizes={self.stage_sizes} hold {sum(self.stage_sizes)} "
                                 f"layers, not n_layer={cfg.n_layer}")
        elif cfg.n_layer % (pp * v):
            raise ValueError(f"pp={pp} x {v} chunks = {pp * v} stages do not divide "
                             f"n_layer={cfg.n_layer}; pick pp x virtual dividing n_layer"
                             + (" or give stage_sizes (one layer count per stage)"
                                if v == 1 else ""))

    # ---- the strategy seam -------------------------------------------------------------------
    def build_model(self, cfg, seed: int) -> nn.Module:
        """The model, split and sharded by what it says of itself: its pipeline stages
        (``pipeline_stages``), its tensor-parallel plan (``tp_plan``) and the regions
        that take Megatron's f and g (``tp_regions``)."""
        self._check_layers(cfg)
        with self.device:               # "meta" for a dry run (workbench.plan.dryrun)
            model = _build(cfg, seed=seed).train()
        self.cfg = cfg
        self.stages = model.pipeline_stages(self.pp * self.v, self.stage_sizes)
        self.stage_layers = [st["layers"] for st in self.stages]
        plan = model.tp_plan(self.tp)
        if self.ep > 1:                 # experts onto the expert meshes first (recipes/moe.py)
            wire_expert_parallel(model, self.stages, self.meshes, self.expert_meshes, self.pp,
                                 self.ep_chunks, self._own)
        self._sp_norms = {}
        for s, stage in enumerate(self.stages):
            mesh = self._mesh_of(s)
            if not self._own(mesh):
                continue                 # torch.distributed: another process's stage
            for name in stage["modules"]:
                parallelize(model.get_submodule(name), mesh, _relative(plan, name),
                            mesh_dim="tp")
            if self.tp > 1:
                for name in model.tp_regions(stage["layers"]):
                    tensor_parallel_region(model.get_submodule(name), mesh, "tp", self.sp,
                                           seq_dim=1, regather=self.regather,
                                           origin=type(self).__name__)
                keep_residual_layout(model, stage["layers"])     # MoE layers (recipes/moe.py)
            # SP: norm gradients summed over tp once per step, as Megatron-LM does
            # (ZeRO-3 shards them instead: there they keep the per-micro-batch all-reduce)
            self._sp_norms[s] = [p for name in stage["modules"] for p in
                                 sequence_parallel_norms(model.get_submodule(name), mesh,
                                                         model.norm_classes())] \
                if self.sp and self.zero != 3 else []
            if self.sp and self.zero != 3 and \
                    "lm_head" in stage["modules"] and "lm_head" not in plan:
                # SP, a head replicated over tp (a vocabulary tp does not divide) after the
                # final norm's sequence shards: its weight's gradient is a partial sum over
                # tp, as a norm's. Megatron-LM all-reduces such sequence-parallel gradients
                # once per step after the flush (finalize_model_grads), not per
                # micro-batch as autograd's replica sum did here (gpt-tiny, tp 2, pp 2:
                # 2 all-reduces of the head's gradient at 2 micro-batches, 4 at 4; one
                # stage too: apart from the norms' once-per-step one, fixlist15)
                self._sp_norms[s] += sequence_parallel_params(model.lm_head, mesh)
            if self.sp and self.zero != 3 and getattr(cfg, "tie_embeddings", False) and \
                    "tok_emb" in stage["modules"] and "norm" in stage["modules"] and \
                    "tok_emb" not in plan:
                # the same, tied on one stage: the head reads the word embedding's table
                # (replicated over tp), so its gradient is the head's partial sum over tp
                # plus the lookup's (whole, on tp rank 0's copy: measured); one sum
                # in the norms' buffer per step (was: a separate replica all-reduce of
                # 19,200 B, gpt-tiny, m = 1 and 2; fixlist16). Megatron all-reduces its
                # word embedding only between the first and last stages
                # (_allreduce_word_embedding_grads, pp > 1) and pads the vocabulary so
                # that tp divides it; a table replicated over tp is ours
                self._sp_norms[s] += sequence_parallel_params(model.tok_emb, mesh)
            if self.sp and self.tp > 1 and "norm" in stage["modules"] and "tok_emb" in plan:
                # SP, vocabulary-parallel head: Megatron's output layer is a
                # ColumnParallelLinear with sequence_parallel (megatron/core/models/gpt/
                # gpt_model.py output_layer; tensor_parallel/layers.py
                # LinearWithGradAccumulationAndAsyncCommunication): it all-gathers the
                # final norm's sequence shards, keeps the shard and gathers it again in
                # backward, and reduce-scatters the input gradient; the logits stay
                # vocabulary-sharded for the vocab-parallel cross-entropy.  Megatron's f
                # on the head's input does exactly that (without it the dispatcher's
                # cheapest plan gathered the head's weight and all-reduced its input's
                # gradient; plan.costs.head_cost prices Megatron's)
                ax = mesh.dim("tp")
                model.get_submodule("norm").register_forward_hook(
                    lambda mod, args, out, ax=ax: megatron_f(
                        out, ax, True, seq_dim=1, regather=self.regather,
                        origin=type(self).__name__))
        if getattr(cfg, "tie_embeddings", False) and len(self.stages) == 1 \
                and hasattr(model, "lm_head") and self._own(self._mesh_of(0)):
            # one stage: ``stage_forward`` reads the tied head from the embedding's table,
            # but ``model.forward`` calls lm_head, which still held the plain parameter
            # (its logits never trained); give it the embedding's DistTensor
            # (parallelize reuses a tied parameter's)
            head_plan = {"": "colwise"} if "lm_head" in plan else {}
            parallelize(model.lm_head, self._mesh_of(0), head_plan, mesh_dim="tp")
        # the whole model (not only each stage's modules) handles its DistTensors:
        # model.zero_grad(set_to_none=False), .to(dtype), load_state_dict
        adopt(model)
        if len(self.stages) > 1:        # model(x) would run every stage on one mesh
            from .pipeline_eval import refuse_forward
            model.register_forward_pre_hook(refuse_forward)
        if self.schedule_name == "dualpipe":      # the second copy of every stage
            _dualpipe.build_twin(self, model, cfg, seed)
        return model

    def _mesh_of(self, s: int):
        """The mesh running layer-stage ``s``: rank s % pp, or the V of ZB-V (rank s, then
        rank 2 pp - 1 - s: Schedule.placement of the "v" layout)."""
        pp = self.pp
        if self.schedule_name == "zb-v":
            return self.meshes[s if s < pp else 2 * pp - 1 - s]
        return self.meshes[s % pp]

    def _own(self, mesh) -> bool:
        """Does this process run ``mesh``'s stage? (always, in the simulator)"""
        if not self.distributed:
            return True
        from ..sim_mesh import backends as _B
        return _B.rank() in mesh

    def _stage_holds_params(self, model, s) -> bool:
        """Does layer-stage ``s`` hold a parameter? (a middle stage of 0 layers does not,
        and gets no optimizer: :meth:`build_optimizer`)"""
        return any(True for name in self.stages[s]["modules"]
                   for _ in model.get_submodule(name).parameters())

    def _stage_params(self, model, s):
        if self.zero == 3:              # the leaves autograd reaches are the dp shards
            return self._shards[s]
        return [p for name in self.stages[s]["modules"]
                for _, p in dist_parameters(model.get_submodule(name))]

    def build_optimizer(self, model, lr: float, weight_decay: float):
        opts = []
        self._shards = {}
        for s in range(len(self.stage_layers)):
            mesh = self._mesh_of(s)
            if not self._own(mesh):
                continue
            if not self._stage_holds_params(model, s):
                # a middle stage of 0 layers (stage_sizes=[2, 0, 2]) holds no parameter:
                # nothing to step (was: its DataParallel raised "no parameter has a
                # gradient" in every optimizer_step, its ZeRO-3 "the module has none")
                self._shards[s] = []
                continue
            if self.zero == 3:
                holder = nn.ModuleList([model.get_submodule(n)
                                        for n in self.stages[s]["modules"]])
                opts.append(Zero3Stage(holder, mesh, "dp", lr=lr, weight_decay=weight_decay))
                self._shards[s] = [e[3] for e in opts[-1].entries]
            else:
                # Megatron-LM keeps a stage's gradients in one contiguous buffer and, with
                # its default overlap_grad_reduce=False, all-reduces it as ONE bucket after
                # the pipeline flush (megatron/core/distributed/
                # distributed_data_parallel_config.py: bucket_size None when not
                # overlapping): one collective per stage, not one per tensor (ZeRO-1/2
                # reduce-scatter every gradient in one buffer anyway)
                dense, experts = split_params(self._stage_params(model, s), mesh)
                opts.append(DataParallel(dense, mesh, "dp", zero=self.zero,
                                         bucket_bytes=ONE_BUFFER if self.zero == 0 else None,
                                         lr=lr,
                                         weight_decay=weight_decay,
                                         partial_grads=self._sp_norms.get(s, ())))
                if experts:             # expert parallelism: reduced over edp only
                    opts.append(DataParallel(experts, self.expert_meshes[s % self.pp], "edp",
                                             zero=self.zero, bucket_bytes=ONE_BUFFER
                                             if self.zero == 0 else None, lr=lr,
                                             weight_decay=weight_decay))
        if len(self.stage_layers) > 1:  # a stage alone would clip by its own norm
            from .pipeline_clip import mark_stage_optimizers
            mark_stage_optimizers(opts)
        self._copy0_optimizers = len(opts)
        if self.schedule_name == "dualpipe":      # copy 1's own optimizer states
            opts += _dualpipe.twin_optimizers(self, lr, weight_decay)
        return opts

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
