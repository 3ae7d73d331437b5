"""The strategy seam of a :class:`~.hybrid.Hybrid`, building: the model split into its
pipeline stages and sharded by its own tensor-parallel plan (and sequence and expert
parallel), and the optimizers of each stage (data parallel / ZeRO over dp)."""
from __future__ import annotations

import fnmatch
import math

from torch import nn

from ..models.config import build_model as _build
from ..parallel.module import dist_parameters, parallelize
from ..parallel.module_state import adopt
from ..parallel.strategies.data_parallel import DataParallel
from ..parallel.strategies.tensor_parallel import (megatron_f, sequence_parallel_norms,
                                                   sequence_parallel_params,
                                                   tensor_parallel_region)
from . import dualpipe as _dualpipe
from .moe import keep_residual_layout, split_params, wire_expert_parallel
from .zero3_stage import Zero3Stage


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


class _Build:
    """Building the model and its optimizers (a base of :class:`~.hybrid.Hybrid`)."""

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
