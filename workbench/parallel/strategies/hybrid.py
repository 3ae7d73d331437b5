"""DP x TP x PP (x SP) training of the course's Llama on simulated ranks.

The mesh layout (PaddlePaddle 3's 8-device example when dp = tp = pp = 2)::

    stage 0: Mesh([[0, 1], [2, 3]], ["dp", "tp"])     stage 1: Mesh([[4, 5], [6, 7]], ...)

* tensor parallel (Megatron-LM): q, k, v, gate and up projections column-parallel,
  o and down projections row-parallel (``Llama`` ``TP_PLAN``); the embedding
  vocabulary-parallel and the lm head column-parallel (vocabulary-sharded logits,
  vocabulary-parallel cross-entropy) when the vocabulary divides by tp;
* sequence parallel: the residual stream is sharded on the sequence dim over tp
  (one reshard after the embedding; the SPMD rules then insert Megatron-SP's
  all-gather before each column-parallel linear and reduce-scatter after each
  row-parallel one, because those are the cheapest plans);
* data parallel / ZeRO over dp (:mod:`.data_parallel`, :mod:`.zero3`);
* pipeline parallel: the layers split into ``pp * v`` stages on the stage meshes,
  run by :func:`workbench.schedules.run_pipeline` in the chosen schedule's order.

Every configuration trains the same global batch with the same loss as one device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...models.config import build_model as _build
from ...models.gpt import GPT_TP_PLAN
from ...models.llama import TP_PLAN
from ...sim_mesh import collectives as C
from ...sim_mesh.mesh import Mesh
from .. import schedules as S
from ..dist_tensor import DistTensor, shard_tensor
from ..module import dist_parameters, parallelize
from ..placement import Replicate, Shard
from ..reshard import reshard
from .data_parallel import DataParallel
from .memory import saved_activation_bytes
from .zero3 import Zero3

__all__ = ["Hybrid", "stage_meshes"]

SCHEDULES = {"gpipe": S.gpipe, "1f1b": S.one_f_one_b, "interleaved": S.interleaved_1f1b,
             "zb-h1": S.zb_h1}


def stage_meshes(dp: int, tp: int, pp: int) -> list[Mesh]:
    """One (dp, tp) mesh per pipeline stage over consecutive ranks."""
    n = dp * tp
    return [Mesh([[s * n + i * tp + j for j in range(tp)] for i in range(dp)], ["dp", "tp"])
            for s in range(pp)]


class Hybrid:
    """A training strategy (see :mod:`workbench.train`) for any dp x tp x pp layout."""

    name = "hybrid"

    def __init__(self, dp=1, tp=1, pp=1, sp=False, zero=0, schedule="1f1b",
                 microbatches=None, virtual=None, distributed: bool = False):
        for n, v in (("dp", dp), ("tp", tp), ("pp", pp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{n}={v!r}: must be an int >= 1")
        if sp and tp == 1:
            raise ValueError("sp=True needs tp > 1: sequence parallelism shards the "
                             "tensor-parallel region's norms and dropouts over tp")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: use one of {list(SCHEDULES)}")
        self.dp, self.tp, self.pp, self.sp, self.zero = dp, tp, pp, sp, zero
        self.schedule_name = schedule
        self.v = virtual or (2 if schedule == "interleaved" else 1)
        self._m = microbatches
        self.m = microbatches or (2 * pp if pp > 1 else 1)
        self.meshes = stage_meshes(dp, tp, pp)
        self.distributed = distributed
        if distributed:                 # one rank per process on torch.distributed
            from ...sim_mesh import backends as _B
            if _B.world_size() != dp * tp * pp:
                raise ValueError(f"{_B.world_size()} processes for dp x tp x pp = "
                                 f"{dp * tp * pp} ranks: launch torchrun --nproc-per-node "
                                 f"{dp * tp * pp}")
            self.meshes = [_B.register(m) for m in self.meshes]
        self.device = torch.device("cpu")
        self.profile = None            # the trace's default hardware profile

    # ---- checks ---------------------------------------------------------------------------
    def check(self, cfg, batch_size: int) -> None:
        """A clear error before anything runs when the layout does not fit the model."""
        tp, pp, v = self.tp, self.pp, self.v
        if self._m is None and pp > 1:      # 2p micro-batches if the batch allows, else p
            self.m = 2 * pp if batch_size % (self.dp * 2 * pp) == 0 else pp
        for name, val in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head),
                          ("d_ff", cfg.d_ff)):
            if val % tp:
                raise ValueError(f"tp={tp} does not divide {name}={val}: tensor parallelism "
                                 "splits heads and hidden features evenly")
        if cfg.n_layer % (pp * v):
            raise ValueError(f"pp={pp} x {v} chunks = {pp * v} stages do not divide "
                             f"n_layer={cfg.n_layer}")
        if batch_size % (self.dp * self.m):
            raise ValueError(f"batch_size={batch_size} does not divide into dp={self.dp} x "
                             f"{self.m} micro-batches")
        if cfg.tie_embeddings and pp * v > 1 and self.device.type != "meta":
            # Megatron keeps a copy of the word embedding on the last stage and all-reduces
            # the two copies' gradients every step; without that the copies drift apart
            raise NotImplementedError(
                "tie_embeddings=True with pp > 1: the last stage's copy of the embedding "
                "needs Megatron's embedding-gradient all-reduce, not built yet; use pp=1, or "
                "cfg.replace(tie_embeddings=False), or --dry-run (which prices it)")
        if self.sp and cfg.seq_len % tp:
            raise ValueError(f"sp: seq_len={cfg.seq_len} does not divide by tp={tp}")
        if self.schedule_name == "interleaved" and self.m % pp:
            raise ValueError(f"interleaved schedule: {self.m} micro-batches must be a multiple "
                             f"of pp={pp}")

    # ---- the strategy seam -------------------------------------------------------------------
    def build_model(self, cfg, seed: int) -> nn.Module:
        with self.device:               # "meta" for a dry run (workbench.plan.dryrun)
            model = _build(cfg, seed=seed).train()
        tp_plan = GPT_TP_PLAN if cfg.arch == "gpt" else TP_PLAN
        self.cfg = cfg
        n_stages = self.pp * self.v
        per = cfg.n_layer // n_stages
        self.stage_layers = [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]
        vocab_parallel = self.tp > 1 and cfg.vocab_size % self.tp == 0
        # TP_PLAN names parameters from the model's root ("layers.*.attn.wq"); per block:
        block_plan = {k.split("layers.*.", 1)[1]: v for k, v in tp_plan.items()
                      if k.startswith("layers.*.")} if self.tp > 1 else {}
        for s in range(n_stages):
            mesh = self.meshes[s % self.pp]
            if not self._own(mesh):
                continue                 # torch.distributed: another process's stage
            for i in self.stage_layers[s]:
                parallelize(model.layers[i], mesh, block_plan, mesh_dim="tp")
                if self.tp > 1:
                    for sub in (model.layers[i].attn, model.layers[i].mlp):
                        self._megatron_f_g(sub, mesh)
            if s == 0:
                parallelize(model.tok_emb, mesh, {"": "rowwise"} if vocab_parallel else {},
                            mesh_dim="tp")
                if hasattr(model, "pos_emb"):       # GPT's learned positions: replicated
                    parallelize(model.pos_emb, mesh, {}, mesh_dim="tp")
            if s == n_stages - 1:
                parallelize(model.norm, mesh, {}, mesh_dim="tp")
                if cfg.tie_embeddings and n_stages == 1:
                    # one table: the head reads the (vocabulary-parallel) embedding's shard
                    del model.lm_head._parameters["weight"]
                    model.lm_head.weight = model.tok_emb.weight
                else:
                    parallelize(model.lm_head, mesh, {"": "colwise"} if vocab_parallel else {},
                                mesh_dim="tp")
        return model

    # ---- Megatron's f and g around each tensor-parallel region ---------------------------------
    def _megatron_f_g(self, module, mesh):
        """f before the region: give each tp rank its copy of the input (tensor parallel:
        no traffic, all-reduce in backward; sequence parallel: all-gather the sequence,
        reduce-scatter in backward).  g after it: sum the row-parallel partial outputs
        (all-reduce; with sequence parallelism reduce-scatter onto the sequence dim,
        all-gather in backward).  Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022."""
        tp_axis = mesh.dim("tp")
        out_ps = [Shard(0), Shard(1) if self.sp else Replicate()]

        def f(mod, args):
            x, *rest = args
            loc = x._local
            if self.sp:          # S(1) on tp -> every rank the whole sequence
                loc = C.all_gather(loc, mesh, tp_axis, 1, expanded=True, label="f: all-gather")
            else:
                loc = C.expand_replicas(loc, mesh, [tp_axis], label="f: grad all-reduce")
            full = DistTensor(loc, mesh, [x.placements[0], Replicate()], x.shape, x.dtype)
            return (full, *rest)

        def g(mod, args, out):
            return reshard(out, mesh, out_ps)
        module.register_forward_pre_hook(f)
        module.register_forward_hook(g)

    def _own(self, mesh) -> bool:
        """Does this process run ``mesh``'s stage? (always, in the simulator)"""
        if not self.distributed:
            return True
        from ...sim_mesh import backends as _B
        return _B.rank() in mesh

    def _stage_params(self, model, s):
        if self.zero == 3:              # the leaves autograd reaches are the dp shards
            return self._shards[s]
        mods = [model.layers[i] for i in self.stage_layers[s]]
        if s == 0:
            mods.append(model.tok_emb)
        if s == len(self.stage_layers) - 1:
            mods += [model.norm, model.lm_head]
        if s == 0 and hasattr(model, "pos_emb"):
            mods.append(model.pos_emb)
        out = {id(p): p for m in mods for _, p in dist_parameters(m)}   # a tied table once
        return list(out.values())

    def build_optimizer(self, model, lr: float, weight_decay: float):
        opts = []
        self._shards = {}
        for s in range(len(self.stage_layers)):
            mesh = self.meshes[s % self.pp]
            if not self._own(mesh):
                continue
            if self.zero == 3:
                holder = nn.ModuleList([model.layers[i] for i in self.stage_layers[s]] +
                                       ([model.tok_emb] if s == 0 else []) +
                                       ([model.pos_emb] if s == 0 and
                                        hasattr(model, "pos_emb") else []) +
                                       ([model.norm, model.lm_head]
                                        if s == len(self.stage_layers) - 1 else []))
                opts.append(Zero3(holder, mesh, "dp", lr=lr, weight_decay=weight_decay))
                self._shards[s] = [e[3] for e in opts[-1].entries]
            else:
                opts.append(DataParallel(self._stage_params(model, s), mesh, "dp", zero=self.zero,
                                         lr=lr, weight_decay=weight_decay))
        return opts

    def _batch(self, t: torch.Tensor, mesh) -> DistTensor:
        return shard_tensor(t, mesh, [Shard(0), Replicate()])

    def _embed(self, model, idx):
        x = model.tok_emb(idx)                                              # (B, S, h)
        if hasattr(model, "pos_emb"):   # GPT: learned positions
            x = x + model.pos_emb(torch.arange(idx.shape[1], device=x.device))
        if self.tp > 1:                 # the residual stream: replicated, or with sequence
            x = reshard(x, x.mesh, [Shard(0), Shard(1) if self.sp else Replicate()])
        return F.dropout(x, model.cfg.dropout, model.training)

    def _blocks(self, model, s, x):
        S_ = x.shape[1]
        rope = (model.rope_cos[:S_], model.rope_sin[:S_]) if hasattr(model, "rope_cos") else ()
        for i in self.stage_layers[s]:
            x = model.layers[i](x, *rope)
        return x

    def _head(self, model, x):
        return model.lm_head(model.norm(x))                                 # (B, S, V)

    def _loss(self, logits, targets):
        B, S_, V = logits.shape
        flat = logits.reshape(B * S_, V)
        if flat.dtype != torch.float32:         # in float32, as the models' own forward
            flat = flat.float()
        return F.cross_entropy(flat, targets.reshape(B * S_))

    def forward_backward(self, model, inputs, targets):
        self.check(model.cfg, inputs.shape[0])
        n_stages = len(self.stage_layers)
        if n_stages == 1:
            mesh = self.meshes[0]

            def forward():
                x = self._blocks(model, 0, self._embed(model, self._batch(inputs, mesh)))
                return self._loss(self._head(model, x), self._batch(targets, mesh))
            params = [p for _, p in dist_parameters(model)]
            loss, saved = saved_activation_bytes(forward, params=params, lead_dims=mesh.ndim)
            self.last_activation_bytes = saved.bytes      # what one rank keeps for backward
            loss.backward()
            return loss.full().detach()
        stages = []
        for s in range(n_stages):
            def stage(x, s=s):
                if s == 0:
                    x = self._embed(model, x)
                x = self._blocks(model, s, x)
                return self._head(model, x) if s == n_stages - 1 else x
            stages.append(stage)
        m = self.m
        first, last = self.meshes[0], self.meshes[(n_stages - 1) % self.pp]
        xs = [self._batch(c, first) if self._own(first) else None for c in inputs.chunk(m)]
        ts = [self._batch(c, last) if self._own(last) else None for c in targets.chunk(m)]
        sched = self._schedule(m)
        params = [self._stage_params(model, s) if self._own(self.meshes[s % self.pp]) else []
                  for s in range(n_stages)] if sched.split_backward else None
        run = S.run_pipeline(sched, stages, self.meshes, xs,
                             lambda out, i: self._loss(out, ts[i]), params=params)
        return torch.tensor(run.loss)

    def _schedule(self, m):
        if self.schedule_name == "interleaved":
            return S.interleaved_1f1b(self.pp, m, self.v)
        return SCHEDULES[self.schedule_name](self.pp, m)

    def optimizer_step(self, optimizers) -> None:
        for o in optimizers:
            o.step()

    def step_report(self, tr, optimizers) -> dict:
        """What one step cost on the modeled clock: time, bytes each rank sent (the
        busiest rank), model-state bytes per rank (parameters, gradients, Adam states)
        and, without a pipeline, the activation bytes a rank keeps for backward."""
        per_rank = tr.bytes_per_rank()
        states = [o.memory() for o in optimizers]
        rec = {"modeled_ms": round(tr.time() * 1e3, 6),
               "comm_bytes": max(per_rank.values(), default=0),
               "state_bytes": max(m.total for m in states) if states else 0}
        if len(self.stage_layers) == 1:
            # activations autograd kept for backward, per rank (counted without pipelining;
            # with a pipeline the peak depends on the schedule: see run_pipeline/simulate)
            rec["activation_bytes"] = self.last_activation_bytes
        return rec
